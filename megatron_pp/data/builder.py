"""From corpus to training splits: preprocessing JSON lines into `.bin/.idx`, and `.bin/.idx` into the
train/valid/test datasets the training loop reads.

Two halves, each behind one function:

- `preprocess_jsonl` (behind `tools/preprocess_data.py`): reads `.jsonl`, `.jsonl.gz` or `.jsonl.zst`,
  tokenizes the `--json-keys` fields of every line in worker processes (results kept in input order,
  so any `--workers` gives the same bytes) and writes `{output_prefix}_{key}_document.bin/.idx`, as
  Megatron-LM names them. A line that is not valid UTF-8 JSON with the keys as strings is a *bad line*:
  fatal by default, skipped and reported with its line number with `skip_bad_lines`.
- `build_datasets` (behind `--data-path` and friends): `DataConfig` holds Megatron's data flags;
  `check_data_args` finds every problem with them without reading any data, so a mistyped path fails
  before a process group exists; `build_datasets` splits each dataset's documents by `--split`
  ("969,30,1" → the first 96.9 % of documents train, the next 3 % validate, the rest test; with
  `--train-data-path` etc. each split has its own datasets instead), blends several datasets by
  weight and builds the cached indices (rank 0 builds, the others wait at `barrier`).

Index caches go to `--data-cache-path`, by default an `index-cache` directory next to each dataset.
"""
from __future__ import annotations

import argparse
import ast
import collections
import dataclasses
import gzip
import inspect
import io
import json
import math
import multiprocessing as mp
import os
import re
import sys
import warnings
from contextlib import ExitStack, closing
from dataclasses import dataclass, field
from typing import BinaryIO, Callable, Iterator, Optional, Sequence

import numpy as np
import zstandard
from tqdm import tqdm

from megatron_pp.data.blend import BlendedDataset, cached_blend_index, parse_blend
from megatron_pp.data.gpt_dataset import BatchOptions, GPTDataset, IndexCache
from megatron_pp.data.indexed import IndexedDataset, IndexedDatasetWriter, best_dtype, data_file_paths
from megatron_pp.data.tokenizers import Tokenizer, build_tokenizer, check_tokenizer_args

SPLIT_NAMES = ("train", "valid", "test")
CACHE_DIR_NAME = "index-cache"

# ------------------------------------------------------------------------------------------------
# Reading JSON-lines corpora
# ------------------------------------------------------------------------------------------------


def open_corpus(path: str) -> BinaryIO:
    """Binary stream of a corpus file, decompressing `.gz` and `.zst` by suffix."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        return io.BufferedReader(_ZstdFrames(path), buffer_size=1 << 20)
    return open(path, "rb")


class _ZstdFrames(io.RawIOBase):
    """Every frame of a .zst file, decompressed, raising EOFError on a truncated last frame.

    zstandard's own stream reader ends quietly at a truncated frame, which would turn a damaged
    corpus into a silently shorter dataset.
    """

    def __init__(self, path: str) -> None:
        super().__init__()
        self._file = open(path, "rb")
        self._context = zstandard.ZstdDecompressor()
        self._frame = self._context.decompressobj()
        self._frame_started = False
        self._out = b""
        self._pos = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self._pos == len(self._out):
            data = self._file.read(1 << 20)
            if not data:
                if self._frame_started:
                    raise EOFError("the last zstd frame is truncated")
                return 0
            self._out, self._pos = self._decompress(data), 0
        count = min(len(buffer), len(self._out) - self._pos)
        buffer[:count] = self._out[self._pos : self._pos + count]
        self._pos += count
        return count

    def _decompress(self, data: bytes) -> bytes:
        pieces = []
        while data:
            self._frame_started = True
            pieces.append(self._frame.decompress(data))
            data = b""
            if self._frame.eof:  # a frame ended inside this chunk: the rest begins the next one
                data = self._frame.unused_data
                self._frame = self._context.decompressobj()
                self._frame_started = False
        return b"".join(pieces)

    def close(self) -> None:
        self._file.close()
        super().close()


class BadLine(ValueError):
    """A corpus line that cannot be used; `line` is 1-based."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        super().__init__(f"{path}:{line}: {reason}")
        self.path, self.line, self.reason = path, line, reason


def parse_json_line(raw: bytes, keys: Sequence[str]) -> list[str]:
    """The string values of `keys` in one JSON-lines record; ValueError with the reason otherwise."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"a JSON {_json_type(record)}, not an object")
    texts = []
    for key in keys:
        if key not in record:
            raise ValueError(f"no key {key!r}")
        if not isinstance(record[key], str):
            raise ValueError(f"{key!r} is a JSON {_json_type(record[key])}, not a string")
        texts.append(record[key])
    return texts


def _json_type(value: object) -> str:
    """JSON's name for the type of a decoded value."""
    if isinstance(value, bool):
        return "boolean"
    names = {int: "number", float: "number", list: "array", dict: "object", str: "string", type(None): "null"}
    return names[type(value)]


def numbered_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw line) of every non-blank line; blank lines carry no document."""
    number = 0
    try:
        with open_corpus(path) as f:
            for number, raw in enumerate(f, 1):
                if raw.strip():
                    yield number, raw
    except (OSError, EOFError, zstandard.ZstdError) as exc:  # a truncated or corrupt .gz/.zst
        raise ValueError(f"{path}: unreadable after line {number}: {exc}") from None


def iter_corpus_texts(paths: Sequence[str], keys: Sequence[str], *, skip_bad_lines: bool = False,
                      on_bad_line: Optional[Callable[[BadLine], None]] = None) -> Iterator[str]:
    """Every `keys` field of every record of the JSON-lines files `paths`, in order.

    A bad line raises `BadLine`, or with `skip_bad_lines` goes to `on_bad_line` and is skipped.
    """
    for path in paths:
        for number, raw in numbered_lines(path):
            try:
                texts = parse_json_line(raw, keys)
            except ValueError as exc:
                bad = BadLine(path, number, str(exc))
                if not skip_bad_lines:
                    raise bad from None
                if on_bad_line is not None:
                    on_bad_line(bad)
                continue
            yield from texts


# ------------------------------------------------------------------------------------------------
# Preprocessing: JSON lines -> .bin/.idx
# ------------------------------------------------------------------------------------------------


@dataclass
class PreprocessResult:
    outputs: dict[str, str]
    """json key -> output prefix written."""
    documents: int
    """Documents written per output (one per good line)."""
    tokens: dict[str, int]
    """json key -> tokens written."""
    bad_lines: list[BadLine]
    """Lines skipped (only with skip_bad_lines)."""
    dtype: str
    """Token dtype of the .bin files."""


# Per worker process: (tokenizer, json keys, append_eod, dtype), set by _init_worker.
_worker: Optional[tuple[Tokenizer, tuple[str, ...], bool, np.dtype]] = None


def _init_worker(tokenizer_args: dict, keys: tuple[str, ...], append_eod: bool) -> None:
    global _worker
    tokenizer = build_tokenizer(**tokenizer_args)
    _worker = (tokenizer, keys, append_eod, best_dtype(tokenizer.vocab_size))


def _tokenize_lines(chunk: list[tuple[int, bytes]]) -> list[tuple[int, Optional[list[np.ndarray]], str]]:
    """(line number, one id array per key or None, bad-line reason) for each line of the chunk."""
    assert _worker is not None, "_init_worker must run first"
    tokenizer, keys, append_eod, dtype = _worker
    out: list[tuple[int, Optional[list[np.ndarray]], str]] = []
    for number, raw in chunk:
        try:
            texts = parse_json_line(raw, keys)
            arrays = []
            for text in texts:
                ids = tokenizer.tokenize(text)
                if append_eod:
                    ids.append(tokenizer.eod)
                arrays.append(np.asarray(ids, dtype=dtype))
        except ValueError as exc:  # bad JSON, or text this tokenizer rejects (NullTokenizer)
            out.append((number, None, str(exc)))
            continue
        out.append((number, arrays, ""))
    return out


def _chunks(lines: Iterator[tuple[int, bytes]], size: int) -> Iterator[list[tuple[int, bytes]]]:
    chunk: list[tuple[int, bytes]] = []
    for item in lines:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _ordered_results(chunks: Iterator[list], workers: int, initargs: tuple) -> Iterator[list]:
    """`_tokenize_lines` of each chunk, in input order, on `workers` processes (1: in this process).

    At most 4 chunks per worker are in flight, so memory stays bounded however large the input
    (Pool.imap would read the whole file ahead).
    """
    if workers == 1:
        _init_worker(*initargs)
        yield from map(_tokenize_lines, chunks)
        return
    # fork shares the already imported modules; spawn (elsewhere) would re-import torch per worker.
    context = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with context.Pool(workers, initializer=_init_worker, initargs=initargs) as pool:
        pending: collections.deque = collections.deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_tokenize_lines, (chunk,)))
            if len(pending) >= 4 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron's output naming: `{output_prefix}_{key}_document`."""
    return f"{output_prefix}_{key}_document"


def preprocess_jsonl(input_path: str, output_prefix: str, tokenizer_args: dict, *, json_keys: Sequence[str] = ("text",),
                     append_eod: bool = False, workers: int = 1, skip_bad_lines: bool = False,
                     on_bad_line: Optional[Callable[[BadLine], None]] = None, progress: bool = False,
                     lines_per_chunk: int = 256) -> PreprocessResult:
    """Tokenize a JSON-lines corpus into one indexed dataset per json key (see the module doc).

    `tokenizer_args` are `build_tokenizer`'s keyword arguments (each worker builds its own). Nothing
    is written unless the whole input succeeds.
    """
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    keys = tuple(json_keys)
    if not keys or len(set(keys)) != len(keys):
        raise ValueError(f"--json-keys must be distinct and non-empty, got {list(keys)}")
    dtype = best_dtype(build_tokenizer(**tokenizer_args).vocab_size)
    outputs = {key: output_prefix_for(output_prefix, key) for key in keys}
    tokens = dict.fromkeys(keys, 0)
    bad_lines: list[BadLine] = []
    documents = 0
    with ExitStack() as stack:
        writers = [stack.enter_context(IndexedDatasetWriter(outputs[key], dtype)) for key in keys]
        bar = stack.enter_context(tqdm(unit=" docs", disable=not progress, file=sys.stderr, desc=input_path))
        chunks = _chunks(numbered_lines(input_path), lines_per_chunk)
        # closing(): on an error below, stop the worker pool now rather than when garbage is collected.
        ordered = stack.enter_context(closing(_ordered_results(chunks, workers, (tokenizer_args, keys, append_eod))))
        for results in ordered:
            for number, arrays, reason in results:
                if arrays is None:
                    bad = BadLine(input_path, number, reason)
                    if not skip_bad_lines:
                        raise bad
                    bad_lines.append(bad)
                    if on_bad_line is not None:
                        on_bad_line(bad)
                    continue
                for key, writer, array in zip(keys, writers, arrays):
                    writer.add_document(array)
                    tokens[key] += len(array)
                documents += 1
            bar.update(len(results))
    return PreprocessResult(outputs, documents, tokens, bad_lines, dtype.name)


# ------------------------------------------------------------------------------------------------
# Configuration and flags
# ------------------------------------------------------------------------------------------------


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
            group.add_argument(flag, dest=f.name, default=default, help=docs[f.name])


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
