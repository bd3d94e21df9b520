"""From `.bin/.idx` to the train/valid/test datasets the training loop reads: `DataConfig` holds
Megatron's data flags (and `--data-order`); `check_data_args` finds every problem with them without
reading any data, so a mistyped path fails before a process group exists; `build_datasets` splits each
dataset's sequences by `--split` (with `--train-data-path` etc. each split has its own datasets
instead), blends several datasets by weight and builds the cached indices (rank 0 builds, the others
wait at `barrier`).

Two orders: `megatron` (default) reads the samples Megatron-LM reads for the same flags
(`megatron_order.py`: its split rounding, one shuffle of all full epochs with a short last epoch apart,
its greedy blend with a 0.5 % surplus per member); `epoch-exact` reads every token once per epoch
(`gpt_dataset.build_sample_index`, `blend.blend_index`). Preprocessing JSON lines into `.bin/.idx` is
`preprocess.py`'s job.

Index caches go to `--data-cache-path`, by default an `index-cache` directory next to each dataset.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import math
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from megatron_pp.data import megatron_order
from megatron_pp.data.blend import BlendedDataset, cached_blend_index, cached_megatron_blend, parse_blend
from megatron_pp.data.gpt_dataset import DATA_ORDERS, BatchOptions, DataFlagError, GPTDataset, IndexCache
from megatron_pp.data.indexed import IndexedDataset, data_file_paths
from megatron_pp.data.tokenizers import check_tokenizer_args

SPLIT_NAMES = ("train", "valid", "test")
CACHE_DIR_NAME = "index-cache"

@dataclass
class DataConfig:
    """Megatron's data flags. Fields with a `flag` in their metadata get one from `add_data_args`;
    seq_length, seed and vocab_size come from the model and training flags of the same names."""

    seq_length: int
    """Tokens per sample fed to the model (each sample reads seq_length + 1 for the labels)."""
    data_path: list[str] = field(default_factory=list, metadata={"flag": "--data-path", "nargs": "*"})
    """Dataset prefixes, optionally weighted: 'PREFIX', 'W1 PREFIX1 W2 PREFIX2 ...' or
    'PREFIX1 PREFIX2 ...' (weighted by token count); split into train/valid/test by --split."""
    train_data_path: Optional[list[str]] = field(default=None, metadata={"flag": "--train-data-path", "nargs": "*"})
    """Training datasets (same forms as --data-path), used whole; excludes --data-path."""
    valid_data_path: Optional[list[str]] = field(default=None, metadata={"flag": "--valid-data-path", "nargs": "*"})
    """Validation datasets, used whole."""
    test_data_path: Optional[list[str]] = field(default=None, metadata={"flag": "--test-data-path", "nargs": "*"})
    """Test datasets, used whole."""
    split: str = field(default="969,30,1", metadata={"flag": "--split"})
    """Relative train,valid,test shares of each --data-path dataset's documents, e.g. '969,30,1' or '98,2,0'."""
    seed: int = 1234
    """Seed of the document and sample shuffles."""
    eod_mask_loss: bool = field(default=False, metadata={"flag": "--eod-mask-loss"})
    """No loss at positions whose input token is the end-of-document token."""
    reset_position_ids: bool = field(default=False, metadata={"flag": "--reset-position-ids"})
    """Restart position ids at 0 after each end-of-document token."""
    reset_attention_mask: bool = field(default=False, metadata={"flag": "--reset-attention-mask"})
    """Attend only within a document (batches carry cu_seqlens)."""
    cache_dir: Optional[str] = field(default=None, metadata={"flag": "--data-cache-path"})
    """Directory of the cached sample indices (default: an 'index-cache' directory next to each dataset)."""
    tokenizer_type: Optional[str] = field(default=None, metadata={"flag": "--tokenizer-type"})
    """GPT2BPETokenizer, SentencePieceTokenizer, HuggingFaceTokenizer or NullTokenizer."""
    tokenizer_model: Optional[str] = field(default=None, metadata={"flag": "--tokenizer-model"})
    """SentencePiece .model file, tokenizer.json, or a local Hugging Face tokenizer directory."""
    vocab_file: Optional[str] = field(default=None, metadata={"flag": "--vocab-file"})
    """GPT-2 BPE vocab.json."""
    merge_file: Optional[str] = field(default=None, metadata={"flag": "--merge-file"})
    """GPT-2 BPE merges.txt."""
    vocab_size: Optional[int] = None
    """NullTokenizer's vocabulary (Megatron reuses --vocab-size)."""
    eod_token: Optional[str] = field(default=None, metadata={"flag": "--eod-token"})
    """End-of-document token (default: <|endoftext|>, </s> or the tokenizer's eos token)."""
    data_order: str = field(default="megatron", metadata={"flag": "--data-order", "choices": DATA_ORDERS})
    """Sample order: 'megatron' reads the samples Megatron-LM reads for the same flags, in its order (one
    shuffle over all full epochs, a short last epoch shuffled apart, its greedy blend); 'epoch-exact'
    reshuffles every epoch and reads every token once per epoch, blends by due time (docs/data.md)."""

    def tokenizer_args(self) -> dict:
        """Keyword arguments of `build_tokenizer` for this config."""
        return dict(tokenizer_type=self.tokenizer_type, tokenizer_model=self.tokenizer_model,
                    vocab_file=self.vocab_file, merge_file=self.merge_file, vocab_size=self.vocab_size,
                    eod_token=self.eod_token)


def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass: the string literal after each field."""
    body = ast.parse(inspect.getsource(cls)).body[0].body  # type: ignore[attr-defined]
    return {
        node.target.id: nxt.value.value  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:])
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
    }


def add_data_args(parser: argparse.ArgumentParser) -> None:
    """Megatron's data and tokenizer flags, generated from DataConfig (help = the field docstrings)."""
    group = parser.add_argument_group("data (generated from DataConfig)")
    docs = _field_docs(DataConfig)
    for f in dataclasses.fields(DataConfig):
        flag = f.metadata.get("flag")
        if flag is None:
            continue
        if f.type == "bool":
            group.add_argument(flag, dest=f.name, action="store_true", help=docs[f.name])
        elif "nargs" in f.metadata:
            default = [] if f.name == "data_path" else None
            group.add_argument(flag, dest=f.name, nargs=f.metadata["nargs"], default=default, help=docs[f.name])
        else:
            default = f.default if f.default is not dataclasses.MISSING else None
            group.add_argument(flag, dest=f.name, default=default, choices=f.metadata.get("choices"),
                               help=docs[f.name])


def data_config_from_args(args: argparse.Namespace, *, seq_length: int, vocab_size: Optional[int] = None) -> DataConfig:
    """DataConfig from parsed flags (after add_data_args). seq_length comes from the model config
    (a preset may set it); vocab_size (NullTokenizer's) defaults to --vocab-size."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(DataConfig)
              if f.metadata.get("flag") is not None}
    if vocab_size is None:
        vocab_size = getattr(args, "vocab_size", None)
    return DataConfig(seq_length=seq_length, seed=args.seed, vocab_size=vocab_size, **values)


# ------------------------------------------------------------------------------------------------
# Checking the flags (no data read)
# ------------------------------------------------------------------------------------------------


def parse_split(split: str) -> list[float]:
    """Normalised (train, valid, test) shares from '969,30,1' (or '969/30/1'; missing shares are 0)."""
    parts = [p.strip() for p in re.split(r"[,/]", split)]
    if not 1 <= len(parts) <= 3:
        raise ValueError(f"--split {split!r}: give 1 to 3 comma-separated shares, e.g. 969,30,1")
    values = []
    for part in parts:
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"--split {split!r}: {part!r} is not a number") from None
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"--split {split!r}: shares must be finite and >= 0, got {part}")
        values.append(value)
    values += [0.0] * (3 - len(values))
    total = sum(values)
    if total <= 0:
        raise ValueError(f"--split {split!r}: the shares sum to 0")
    return [v / total for v in values]


def split_ranges(num_documents: int, shares: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous document ranges for the shares; cumulative rounding, so they tile [0, n) exactly.

    Example: 1000 documents, '969,30,1' → [0, 969), [969, 999), [999, 1000).
    """
    bounds = [0]
    cumulative = 0.0
    for share in shares:
        cumulative += share
        bounds.append(min(num_documents, round(cumulative * num_documents)))
    bounds[-1] = num_documents
    return [(bounds[k], bounds[k + 1]) for k in range(len(shares))]


def _check_prefix(flag: str, prefix: str) -> list[str]:
    missing = [path for path in data_file_paths(prefix) if not os.path.isfile(path)]
    if not missing:
        return []
    if prefix.endswith((".bin", ".idx")) and os.path.isfile(prefix):
        return [f"{flag}: {prefix} is a data file; give the prefix without .bin/.idx"]
    return [f"{flag}: {missing[0]}: no such file"]


def _split_paths(config: DataConfig) -> dict[str, Optional[list[str]]]:
    return {"--train-data-path": config.train_data_path, "--valid-data-path": config.valid_data_path,
            "--test-data-path": config.test_data_path}


def check_data_args(config: DataConfig, *, mock_data: bool = False) -> list[str]:
    """Every problem with the data and tokenizer flags, one line each naming the flag or file.

    Reads no data (only checks that files exist), so it can run during argument validation. With
    `mock_data`, no dataset or tokenizer is required, but any that is given is still checked.
    """
    errors = _dataset_errors(config, mock_data)
    tokenizer_given = any(v is not None for v in (config.tokenizer_type, config.tokenizer_model, config.vocab_file,
                                                  config.merge_file, config.eod_token))
    if not mock_data or tokenizer_given:
        errors += check_tokenizer_args(config.tokenizer_type, tokenizer_model=config.tokenizer_model,
                                       vocab_file=config.vocab_file, merge_file=config.merge_file,
                                       vocab_size=config.vocab_size)
    return errors


def _dataset_errors(config: DataConfig, mock_data: bool) -> list[str]:
    errors: list[str] = []
    split_paths = {flag: paths for flag, paths in _split_paths(config).items() if paths is not None}
    if config.data_path and split_paths:
        errors.append(f"--data-path and {', '.join(split_paths)} are mutually exclusive")
    if not mock_data and not config.data_path and not split_paths:
        errors.append("no data: give --data-path (or --train-data-path/--valid-data-path/--test-data-path) or "
                      "--mock-data")
    lists = {"--data-path": config.data_path, **split_paths} if config.data_path else split_paths
    for flag, values in lists.items():
        try:
            prefixes, _ = parse_blend(values, flag)
        except ValueError as exc:
            errors.append(str(exc))
            continue
        for prefix in prefixes:
            errors += _check_prefix(flag, prefix)
    try:
        parse_split(config.split)
    except ValueError as exc:
        errors.append(str(exc))
    if config.seq_length < 1:
        errors.append(f"--seq-length must be >= 1, got {config.seq_length}")
    if config.cache_dir is not None and os.path.exists(config.cache_dir) and not os.path.isdir(config.cache_dir):
        errors.append(f"--data-cache-path {config.cache_dir} is a file, not a directory")
    return errors


# ------------------------------------------------------------------------------------------------
# Building the splits
# ------------------------------------------------------------------------------------------------

Dataset = GPTDataset | BlendedDataset
# One blend member of a split: (dataset, weight or None for "by token count", document range).
_Part = tuple[IndexedDataset, Optional[float], tuple[int, int]]
# Megatron-LM's: (dataset, weight as written or None, sequence range or None where --split gives no share).
_MegatronPart = tuple[IndexedDataset, Optional[float], Optional[tuple[int, int]]]


def _cache_for(config: DataConfig, prefix: str, is_builder: bool, barrier: Optional[Callable[[], None]]) -> IndexCache:
    directory = config.cache_dir or os.path.join(os.path.dirname(os.path.abspath(prefix)), CACHE_DIR_NAME)
    return IndexCache(directory, is_builder, barrier)


def _build_split(name: str, parts: list[_Part], num_samples: int, config: DataConfig, options: BatchOptions,
                 is_builder: bool, barrier: Optional[Callable[[], None]]) -> Optional[Dataset]:
    if num_samples <= 0:
        return None
    usable = []
    for dataset, weight, (start, stop) in parts:
        if weight == 0:
            continue
        if stop <= start or not dataset.sequence_lengths[start:stop].any():
            if len(parts) > 1:
                warnings.warn(f"{dataset.prefix}: --split {config.split} leaves it no {name} tokens; "
                              f"the {name} blend goes on without it")
            continue
        usable.append((dataset, weight, (start, stop)))
    if not usable:
        return None

    def gpt(part: _Part, count: int) -> GPTDataset:
        dataset, _, document_range = part
        return GPTDataset(dataset, document_range, count, seq_length=config.seq_length, seed=config.seed,
                          options=options, cache=_cache_for(config, dataset.prefix, is_builder, barrier),
                          split_name=name)

    if len(usable) == 1:
        return gpt(usable[0], num_samples)
    weights = [float(w) if w is not None else float(d.sequence_lengths[a:b].sum(dtype=np.int64))
               for d, w, (a, b) in usable]
    dataset_index, sample_index = cached_blend_index(
        weights, num_samples, _cache_for(config, usable[0][0].prefix, is_builder, barrier), f"blend-{name}"
    )
    counts = np.bincount(dataset_index, minlength=len(usable))
    if not counts.all():
        # A weight too small to earn even one of num_samples: leave the dataset out and renumber.
        renumber = np.cumsum(counts > 0) - 1
        dataset_index = renumber[dataset_index]
        usable = [part for part, count in zip(usable, counts) if count]
        counts = counts[counts > 0]
    return BlendedDataset([gpt(part, int(c)) for part, c in zip(usable, counts)], dataset_index, sample_index)


def _raw_weights(values: Sequence[str], flag: str) -> Optional[list[float]]:
    """The weights of a blend list as written (Megatron-LM normalises them itself, twice)."""
    _, weights = parse_blend(values, flag)
    return None if weights is None else [float(v) for v in list(values)[0::2]]


def _build_megatron_split(name: str, flag: str, parts: list[_MegatronPart], num_samples: int, config: DataConfig,
                          options: BatchOptions, is_builder: bool,
                          barrier: Optional[Callable[[], None]]) -> Optional[Dataset]:
    """Megatron-LM's dataset of one split (megatron_order.py's module doc): a single dataset, a weighted
    blend of members built with a surplus, or an unweighted blend of one epoch of each member."""
    if num_samples <= 0 or not parts or any(bounds is None for _, _, bounds in parts):
        return None  # a zero --split share: Megatron-LM builds no such split either
    parts = [part for part in parts if part[1] != 0]
    for dataset, _, (start, stop) in parts:  # type: ignore[misc]
        if int(dataset.sequence_lengths[start:stop].sum(dtype=np.int64)) < 2:
            raise DataFlagError(f"{flag}: --split {config.split} leaves {dataset.prefix} {stop - start} sequences "
                                f"for its {name} split, too few tokens for one sample; change --split")

    def gpt(part: _MegatronPart, count: Optional[int]) -> GPTDataset:
        dataset, _, document_range = part
        return GPTDataset(dataset, document_range, count, seq_length=config.seq_length,  # type: ignore[arg-type]
                          seed=config.seed, options=options, split_name=name, order="megatron",
                          cache=_cache_for(config, dataset.prefix, is_builder, barrier))

    weights = [weight for _, weight, _ in parts]
    if len(parts) == 1 and weights[0] is None:
        return gpt(parts[0], num_samples)
    if weights[0] is None:  # weighted by their sample counts, one epoch each
        members = [gpt(part, None) for part in parts]
        blend_weights: list[float] = [float(len(member)) for member in members]
        size = min(num_samples, int(sum(blend_weights)))
        if size < num_samples:
            raise DataFlagError(f"{flag}: unweighted datasets give one epoch each, {size} {name} samples, fewer than "
                                f"the {num_samples} the run needs (Megatron-LM stops there too); give weights")
    else:
        taken, built = megatron_order.blend_sizes(weights, num_samples)  # type: ignore[arg-type]
        members = [gpt(part, count) for part, count in zip(parts, built)]
        blend_weights, size = megatron_order.normalise(weights), sum(taken)  # type: ignore[arg-type]
    prefixes = [dataset.prefix for dataset, _, _ in parts]
    dataset_index, sample_index = cached_megatron_blend(
        blend_weights, size, _cache_for(config, prefixes[0], is_builder, barrier), f"blend-{name}", prefixes)
    return BlendedDataset(members, dataset_index, sample_index)


def _megatron_parts(config: DataConfig, open_dataset: Callable[[str], IndexedDataset]) -> list[list[_MegatronPart]]:
    """Each split's members: (dataset, weight as written or None, sequence range or None for a zero share)."""
    parts: list[list[_MegatronPart]] = [[], [], []]
    if config.data_path:
        prefixes, _ = parse_blend(config.data_path, "--data-path")
        weights = _raw_weights(config.data_path, "--data-path")
        for i, prefix in enumerate(prefixes):
            dataset = open_dataset(prefix)
            for k, bounds in enumerate(megatron_order.split_bounds(config.split, len(dataset))):
                parts[k].append((dataset, None if weights is None else weights[i], bounds))
        return parts
    for k, (flag, paths) in enumerate(_split_paths(config).items()):
        if paths:
            prefixes, _ = parse_blend(paths, flag)
            weights = _raw_weights(paths, flag)
            for i, prefix in enumerate(prefixes):
                dataset = open_dataset(prefix)
                parts[k].append((dataset, None if weights is None else weights[i], (0, len(dataset))))
    return parts


def split_sample_counts(train_samples: int, global_batch_size: int, eval_iters: int, eval_interval: Optional[int],
                        train_iters: int) -> tuple[int, int, int]:
    """Samples asked of (train, valid, test), as Megatron-LM asks them: the validation set holds one block of
    `eval_iters` global batches per evaluation (every `eval_interval` iterations, and one at the end), read
    one block after another; the test set one block. Their counts set the epochs, hence the order.

    Example: 100 iterations of 16, eval every 40 for 5 iterations → (1600, (100 // 40 + 1)·5·16 = 240, 80).
    """
    if not eval_interval or eval_iters <= 0:
        return train_samples, 0, 0
    return (train_samples, (train_iters // eval_interval + 1) * eval_iters * global_batch_size,
            eval_iters * global_batch_size)


def build_datasets(config: DataConfig, num_samples: tuple[int, int, int], eod_id: int, *,
                   barrier: Optional[Callable[[], None]] = None,
                   is_builder: bool = True) -> tuple[Optional[Dataset], Optional[Dataset], Optional[Dataset]]:
    """(train, valid, test) datasets of the requested sample counts; None for an empty split.

    Every rank calls this with the same arguments. Ranks with `is_builder` build missing index
    caches; all ranks then call `barrier()` once per cached index (pass e.g. `torch.distributed.barrier`
    and `is_builder = rank == 0`; the cache directory must be shared) and load them.
    """
    # The tokenizer flags are not checked here: the datasets only need eod_id.
    errors = _dataset_errors(config, mock_data=False)
    if errors:
        raise ValueError("; ".join(errors))
    if len(num_samples) != 3 or min(num_samples) < 0:
        raise ValueError(f"num_samples must be three counts >= 0 (train, valid, test), got {num_samples}")
    options = BatchOptions(eod_id, config.eod_mask_loss, config.reset_position_ids, config.reset_attention_mask)
    opened: dict[str, IndexedDataset] = {}

    def open_dataset(prefix: str) -> IndexedDataset:
        if prefix not in opened:
            opened[prefix] = IndexedDataset(prefix)
        return opened[prefix]

    if config.data_order == "megatron":
        flags = ["--data-path"] * 3 if config.data_path else list(_split_paths(config))
        megatron_parts = _megatron_parts(config, open_dataset)
        return tuple(_build_megatron_split(SPLIT_NAMES[k], flags[k], megatron_parts[k], num_samples[k], config,
                                           options, is_builder, barrier) for k in range(3))  # type: ignore[return-value]
    parts: list[list[_Part]] = [[], [], []]
    if config.data_path:
        prefixes, weights = parse_blend(config.data_path, "--data-path")
        shares = parse_split(config.split)
        for i, prefix in enumerate(prefixes):
            dataset = open_dataset(prefix)
            for k, document_range in enumerate(split_ranges(len(dataset), shares)):
                parts[k].append((dataset, None if weights is None else weights[i], document_range))
    else:
        for k, (flag, paths) in enumerate(_split_paths(config).items()):
            if paths:
                prefixes, weights = parse_blend(paths, flag)
                for i, prefix in enumerate(prefixes):
                    dataset = open_dataset(prefix)
                    parts[k].append((dataset, None if weights is None else weights[i], (0, len(dataset))))
    train, valid, test = (
        _build_split(SPLIT_NAMES[k], parts[k], num_samples[k], config, options, is_builder, barrier) for k in range(3)
    )
    return train, valid, test
