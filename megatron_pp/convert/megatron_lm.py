"""Megatron-LM's `torch` checkpoint format, both ways: `iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt` per rank.

Each file holds `args` (the run's argparse.Namespace), `checkpoint_version`, `iteration` and the model
as `model` (or `model0`, `model1`, ... per virtual pipeline chunk) under Megatron-Core `GPTModel`
names with layer numbers local to the chunk. `MegatronLMReader` also reads the legacy
`language_model.*` module tree. Files are unpickled with `weights_only=True` and an explicit allow-list
(no Megatron code is imported or run). `write_megatron_lm` writes what a Megatron-LM run of the same
tp / pp / virtual-stage split saves (model weights only, `checkpoint_version` 3.0) and an `args`
namespace carrying the fields Megatron-LM's `load_checkpoint`, `load_args_from_checkpoint` and its
`tools/checkpoint` loader read. The name maps and `args` <-> config translation here are shared with
the `torch_dist` format.
"""
from __future__ import annotations

import argparse
import io
import os
import pickle
import re
from typing import Any, Optional

import numpy as np
import torch
from tqdm import tqdm

from megatron_pp.models.config import TransformerConfig
from megatron_pp.models.hf import rotary_interleaved_to_half
from megatron_pp.models.layout import StageSpec
from megatron_pp.training.checkpointing import TRACKER_FILE, CheckpointError, iteration_dir
from megatron_pp.convert.export_args import megatron_lm_args
from megatron_pp.convert.core import (
    CheckpointReader,
    TargetLayout,
    join_shards,
    layer_of,
    model_parameters,
    stage_parameters,
    staged_output,
    tp_shard,
    write_tracker,
)

MEGATRON_LM_FILE = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0
TRANSFORMER_IMPLS = ("transformer_engine", "local")
TOKENIZER_DIR = "tokenizer"
"""Where an exported Megatron-LM checkpoint keeps the tokenizer files (`args.tokenizer_model` names it)."""

class MegatronObject:
    """Inert stand-in for any Megatron-LM class a checkpoint names (the enums in its `args`).

    Unpickling calls it instead of Megatron's class, so no Megatron code is imported or run; it only
    records what it was built from.
    """

    def __init__(self, *args: Any):
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


# The only non-tensor types a Megatron-LM `model_optim_rng.pt` may hold, besides the containers, numbers,
# strings and dtypes that `weights_only` always accepts: `args` is an argparse.Namespace, `rng_state`
# holds NumPy arrays of numbers (numpy.core was renamed numpy._core in NumPy 2; files carry either name),
# and TransformerEngine's `_extra_state` entries may be BytesIO buffers. Megatron's own classes (enums
# in `args`) become `MegatronObject`s.
_RECONSTRUCT = np._core.multiarray._reconstruct  # type: ignore[attr-defined]
_NUMERIC_NUMPY_DTYPES = (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
                         np.float16, np.float32, np.float64)
MEGATRON_LM_ALLOWED = (
    (argparse.Namespace, "argparse.Namespace"),
    (_RECONSTRUCT, "numpy._core.multiarray._reconstruct"),
    (_RECONSTRUCT, "numpy.core.multiarray._reconstruct"),
    (np.ndarray, "numpy.ndarray"),
    (np.dtype, "numpy.dtype"),
    *((type(np.dtype(t)), f"numpy.dtypes.{type(np.dtype(t)).__name__}") for t in _NUMERIC_NUMPY_DTYPES),
    (io.BytesIO, "_io.BytesIO"),
)
_MEGATRON_MODULES = ("megatron.",)


def load_megatron_lm_file(path: str) -> dict:
    """Unpickle a Megatron-LM `model_optim_rng.pt` with `weights_only=True`, tensors memory-mapped.

    A global outside `MEGATRON_LM_ALLOWED` and Megatron's own modules (a function, an arbitrary class)
    is refused before anything is unpickled; `weights_only` enforces the same list while loading.
    """
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing")
    try:
        named = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except (RuntimeError, pickle.UnpicklingError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a torch.save zip file ({exc})".replace("\n", " ")) from None
    allowed_names = {name for _, name in MEGATRON_LM_ALLOWED}
    refused = sorted(n for n in named if n not in allowed_names and not n.startswith(_MEGATRON_MODULES))
    if refused:
        raise CheckpointError(
            f"{path}: refusing to unpickle {', '.join(refused)}: a Megatron-LM checkpoint holds only tensors, "
            "containers, argparse.Namespace, NumPy arrays and Megatron enums, and anything else could run "
            "arbitrary code"
        )
    safe = [*MEGATRON_LM_ALLOWED, *((MegatronObject, n) for n in named if n.startswith(_MEGATRON_MODULES))]
    try:
        with torch.serialization.safe_globals(safe):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        # torch's message is a page of advice around one line that names what was refused.
        reason = str(exc).partition("WeightsUnpickler error:")[2].partition("Check the documentation")[0]
        reason = " ".join(reason.split()) or str(exc)
        raise CheckpointError(f"{path}: refused by the weights-only unpickler: {reason}") from None


# Megatron-LM parameter names (its legacy `language_model.*` modules and Megatron-Core's GPTModel, with
# TransformerEngine's fused norms or the local ones) -> ours. Layer numbers in Megatron-LM files are
# local to their pipeline stage and model chunk.
_MLM_LAYER = re.compile(r"^(?:decoder|language_model\.(?:encoder|transformer))\.layers\.(\d+)\.(.+)$")
_MLM_LAYER_NAMES = {
    "input_layernorm": "input_layernorm",
    "input_norm": "input_layernorm",
    "self_attention.linear_qkv.layer_norm": "input_layernorm",
    "self_attention.linear_qkv": "self_attention.linear_qkv",
    "self_attention.query_key_value": "self_attention.linear_qkv",
    "self_attention.linear_proj": "self_attention.linear_proj",
    "self_attention.dense": "self_attention.linear_proj",
    "pre_mlp_layernorm": "pre_mlp_layernorm",
    "post_attention_layernorm": "pre_mlp_layernorm",
    "post_attention_norm": "pre_mlp_layernorm",
    "mlp.linear_fc1.layer_norm": "pre_mlp_layernorm",
    "mlp.linear_fc1": "mlp.linear_fc1",
    "mlp.dense_h_to_4h": "mlp.linear_fc1",
    "mlp.linear_fc2": "mlp.linear_fc2",
    "mlp.dense_4h_to_h": "mlp.linear_fc2",
}
_MLM_MODULES = {
    "embedding.word_embeddings": "embedding.word_embeddings",
    "language_model.embedding.word_embeddings": "embedding.word_embeddings",
    "embedding.position_embeddings": "embedding.position_embeddings",
    "language_model.embedding.position_embeddings": "embedding.position_embeddings",
    "decoder.final_layernorm": "final_layernorm",
    "language_model.encoder.final_norm": "final_layernorm",
    "language_model.encoder.final_layernorm": "final_layernorm",
    "language_model.transformer.final_layernorm": "final_layernorm",
    "output_layer": "output_layer",
    "language_model.output_layer": "output_layer",
}
# Entries that hold no weight of ours: TransformerEngine's FP8 state, RoPE frequency buffers, and the
# head stage's copy of a tied word embedding (legacy name; Megatron-Core calls it output_layer.weight).
_MLM_IGNORED = re.compile(r"(\._extra_state$|inv_freq$|^word_embeddings_for_head\.)")


def megatron_lm_parameter(name: str) -> Optional[tuple[str, Optional[int]]]:
    """(our name, or for a layer our name after `layers.N.`; the local layer number or None) of a
    Megatron-LM state-dict entry; None for entries that hold no weight. Unknown names raise."""
    if _MLM_IGNORED.search(name):
        return None
    module, _, param = name.rpartition(".")
    # TransformerEngine keeps a fused norm's parameters on the linear layer as layer_norm_weight / _bias.
    if param in ("layer_norm_weight", "layer_norm_bias"):
        module, param = module + ".layer_norm", param.removeprefix("layer_norm_")
    match = _MLM_LAYER.match(module + "." + param)
    if match:
        layer_module = match.group(2).rpartition(".")[0]
        if layer_module in _MLM_LAYER_NAMES:
            return f"{_MLM_LAYER_NAMES[layer_module]}.{param}", int(match.group(1))
    elif module in _MLM_MODULES:
        return f"{_MLM_MODULES[module]}.{param}", None
    raise CheckpointError(f"Megatron-LM parameter {name!r} is not part of a GPT or LLaMA model megatron_pp knows "
                          "(unsupported feature: QK norm, MoE, MLA, ...?)")


def config_from_megatron_args(args: Any, vocab_size: int) -> tuple[TransformerConfig, bool]:
    """Our config from a Megatron-LM checkpoint's `args`, and whether its RoPE is interleaved."""
    def get(name: str, default: Any = None) -> Any:
        value = getattr(args, name, default)
        return default if value is None else value

    # Switches (False / None unless a run sets them) that change what the weights compute: importing one
    # silently would give another model (--use-rope-scaling rescales the RoPE frequencies, ...).
    switches = ("apply_residual_connection_post_layernorm", "qk_layernorm", "multi_latent_attention", "squared_relu",
                "quick_geglu", "use_rope_scaling", "rotary_seq_len_interpolation_factor", "window_size",
                "no_rope_freq", "mtp_num_layers", "num_experts")
    unsupported = [(get(name), "--" + name.replace("_", "-")) for name in switches] + [
        (get("softmax_type", "vanilla") != "vanilla", f"--softmax-type {get('softmax_type')}"),
        (get("add_qkv_bias", False) and not get("add_bias_linear", True), "--add-qkv-bias without linear biases"),
    ]
    found = [what for on, what in unsupported if on]
    if found:
        raise CheckpointError(f"the Megatron-LM checkpoint uses {', '.join(found)}, which megatron_pp does not "
                              "implement")
    position = get("position_embedding_type") or ("rope" if get("use_rotary_position_embeddings", False)
                                                  else "learned_absolute")
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    kv_channels = get("kv_channels")
    dtype = get("params_dtype", torch.float32)
    config = TransformerConfig(
        num_layers=get("num_layers"),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=get("num_query_groups") if get("group_query_attention", False) else None,
        ffn_hidden_size=get("ffn_hidden_size"),
        kv_channels=None if kv_channels is None or kv_channels * heads == hidden else kv_channels,
        vocab_size=vocab_size,
        seq_length=get("seq_length") or get("max_position_embeddings"),
        max_position_embeddings=get("max_position_embeddings"),
        make_vocab_size_divisible_by=get("make_vocab_size_divisible_by", 128),
        normalization=get("normalization", "LayerNorm"),
        norm_epsilon=get("norm_epsilon", get("layernorm_epsilon", 1e-5)),
        activation="swiglu" if get("swiglu", False) else "gelu",
        position_embedding_type=position,
        rotary_base=float(get("rotary_base", 10000)),
        rotary_percent=float(get("rotary_percent", 1.0)),
        add_bias_linear=bool(get("add_bias_linear", True)),
        untie_embeddings_and_output_weights=bool(get("untie_embeddings_and_output_weights", False)),
        apply_layernorm_1p=bool(get("apply_layernorm_1p", False)),  # norm weights stored as scale - 1
        init_method_std=get("init_method_std", 0.02),
        params_dtype=dtype if isinstance(dtype, torch.dtype) else torch.float32,
    )
    try:
        config.validate()
    except ValueError as exc:
        raise CheckpointError(f"the Megatron-LM checkpoint's args describe no valid model: {exc}") from None
    return config, bool(get("rotary_interleaved", False)) and position == "rope"


_MP_RANK = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")


class MegatronLMReader(CheckpointReader):
    """Megatron-LM's `torch` checkpoint format: `iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt` per rank.

    Each file holds `args` (the run's argparse.Namespace), `checkpoint_version`, `iteration` and the
    model as `model` (or `model0`, `model1`, ... per virtual pipeline chunk), with layer numbers local
    to the chunk. Tensor-parallel shards split exactly as ours do (QKV by whole query groups, SwiGLU's
    fc1 as per-rank [gate; up], row-parallel weights by columns, the vocabulary by rows). Files are
    memory-mapped, one pipeline rank's at a time. The vocabulary size is `true_vocab_size` if given,
    else `args.vocab_size`, else the padded row count of the embedding.
    """

    def __init__(self, load_dir: str, *, true_vocab_size: Optional[int] = None):
        self._directory = megatron_lm_directory(load_dir)
        self._paths, self._tp, self._pp = self._rank_files()
        first = load_megatron_lm_file(self._paths[0, 0])
        args = first.get("args")
        if not isinstance(args, argparse.Namespace):
            raise CheckpointError(f"{self._paths[0, 0]}: no `args` (argparse.Namespace) in the file")
        version = first.get("checkpoint_version")
        if version is not None and float(version) < 2.0:
            raise CheckpointError(f"{self._paths[0, 0]}: checkpoint_version {version} stores QKV in an older order; "
                                  "re-save it with a current Megatron-LM first")
        for attr, have in (("tensor_model_parallel_size", self._tp), ("pipeline_model_parallel_size", self._pp)):
            if getattr(args, attr, have) != have:
                raise CheckpointError(f"{self._directory}: args.{attr} is {getattr(args, attr)} but the directory "
                                      f"holds {have} rank(s) of that kind")
        self.iteration = int(first.get("iteration", 0) or 0)
        self.consumed_samples = int(getattr(args, "consumed_train_samples", 0) or 0)  # where its sampler resumes
        key = _chunk_keys(first)[0]
        rows = sum(_vocab_rows(first if t == 0 else load_megatron_lm_file(self._paths[t, 0]), key)
                   for t in range(self._tp))
        vocab_size = true_vocab_size or getattr(args, "vocab_size", None) or rows
        if vocab_size > rows:
            raise CheckpointError(f"vocabulary size {vocab_size} is larger than the checkpoint's {rows} embedding rows")
        self.config, self._interleaved = config_from_megatron_args(args, vocab_size)
        del first
        self._params = model_parameters(self.config)
        self._where = self._locate()
        self._cached_pp: Optional[int] = None
        self._cached: list[dict[str, torch.Tensor]] = []

    def _rank_files(self) -> tuple[dict[tuple[int, int], str], int, int]:
        paths = {}
        for entry in sorted(os.listdir(self._directory)):
            match = _MP_RANK.match(entry)
            if entry.startswith("mp_rank_") and not match:
                raise CheckpointError(f"{self._directory}/{entry}: expert-parallel checkpoints are not supported")
            if match:
                paths[int(match.group(1)), int(match.group(2) or 0)] = os.path.join(self._directory, entry,
                                                                                     MEGATRON_LM_FILE)
        if not paths:
            raise CheckpointError(f"{self._directory}: no mp_rank_* directories (not a Megatron-LM torch checkpoint)")
        tp = 1 + max(t for t, _ in paths)
        pp = 1 + max(p for _, p in paths)
        missing = [f"tp {t} pp {p}" for t in range(tp) for p in range(pp) if (t, p) not in paths]
        if missing:
            raise CheckpointError(f"{self._directory}: rank directories missing for {', '.join(missing)}")
        return paths, tp, pp

    def _locate(self) -> dict[str, tuple[int, str, str]]:
        """Our global name -> (pipeline rank, chunk key, Megatron name), from tp rank 0's files."""
        found: dict[int, list[tuple[str, Optional[int], int, str, str]]] = {}
        for pp_rank in range(self._pp):
            state = load_megatron_lm_file(self._paths[0, pp_rank])
            for chunk, key in enumerate(_chunk_keys(state)):
                stage = chunk * self._pp + pp_rank  # Megatron's interleaved placement
                for name in _flatten(state[key]):
                    mapped = megatron_lm_parameter(name)
                    if mapped is not None:
                        found.setdefault(stage, []).append((*mapped, pp_rank, key, name))
        where: dict[str, tuple[int, str, str]] = {}
        offset = 0
        for stage in sorted(found):
            layers = sorted({local for _, local, *_ in found[stage] if local is not None})
            if layers != list(range(len(layers))):
                raise CheckpointError(f"{self._directory}: pipeline stage {stage} has layers {layers}; expected "
                                      "local numbers 0, 1, ...")
            for ours, local, pp_rank, key, name in found[stage]:
                full = ours if local is None else f"layers.{offset + local}.{ours}"
                if full in self._params:
                    where.setdefault(full, (pp_rank, key, name))
                elif not (full == "output_layer.weight" and not self.config.untie_embeddings_and_output_weights):
                    raise CheckpointError(f"{self._directory}: {name} has no counterpart in the model its args "
                                          "describe")
            offset += len(layers)
        if offset != self.config.num_layers:
            raise CheckpointError(f"{self._directory}: the files hold {offset} layers, args.num_layers is "
                                  f"{self.config.num_layers}")
        missing = sorted(set(self._params) - set(where))
        if missing:
            raise CheckpointError(f"{self._directory}: no Megatron-LM tensor for {len(missing)} parameter(s), "
                                  f"e.g. {missing[:3]}")
        return where

    def tensor(self, name: str) -> torch.Tensor:
        pp_rank, key, megatron_name = self._where[name]
        if pp_rank != self._cached_pp:
            self._cached = []  # one pipeline rank's files mapped at a time
            for t in range(self._tp):
                self._cached.append(_flatten(load_megatron_lm_file(self._paths[t, pp_rank])[key]))
            self._cached_pp = pp_rank
        tensor = join_shards([shards[megatron_name] for shards in self._cached], self._params[name])
        if self._interleaved and ".self_attention.linear_qkv." in name:
            tensor = rotary_interleaved_to_half(tensor, self.config)
        return tensor

    def close(self) -> None:
        self._cached, self._cached_pp = [], None


def megatron_lm_directory(load_dir: str) -> str:
    tracker = os.path.join(load_dir, TRACKER_FILE)
    if not os.path.isfile(tracker):
        return load_dir
    with open(tracker) as f:
        text = f.read().strip()
    if text == "release":
        return os.path.join(load_dir, "release")
    if not text.isdigit():
        raise CheckpointError(f"{tracker}: expected an iteration number or 'release', found {text[:40]!r}")
    return iteration_dir(load_dir, int(text))


def _chunk_keys(state: dict) -> list[str]:
    if "model" in state:
        return ["model"]
    keys = sorted((k for k in state if re.fullmatch(r"model\d+", k)), key=lambda k: int(k[5:]))
    if not keys:
        raise CheckpointError("a Megatron-LM checkpoint file without a `model` entry")
    return keys


def _flatten(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Tensors of a (legacy Megatron: nested) state dict by dotted name; non-tensor entries dropped."""
    flat: dict[str, torch.Tensor] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        elif isinstance(value, torch.Tensor):
            flat[name] = value
    return flat


def _vocab_rows(state: dict, key: str) -> int:
    for name, tensor in _flatten(state[key]).items():
        if name.endswith("embedding.word_embeddings.weight"):
            return tensor.shape[0]
    raise CheckpointError("the first pipeline stage of the Megatron-LM checkpoint has no word embedding")


# Writing ------------------------------------------------------------------------------------------------

# Our layer parameter -> Megatron-Core's, by --transformer-impl. TransformerEngine fuses each norm into the
# linear layer after it (`layer_norm_weight` on linear_qkv / linear_fc1); the local modules keep them apart.
_FUSED_NORMS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
# Modules whose state dict carries an `_extra_state` entry (FP8 metadata under TransformerEngine, None for the
# local modules): strict loading expects them, so they are written as None, which both implementations accept.
_EXTRA_STATE_MODULES = {
    "local": ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"),
    "transformer_engine": ("self_attention.core_attention", "self_attention.linear_qkv",
                           "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"),
}


def mcore_layer_name(ours: str, transformer_impl: str) -> str:
    """Megatron-Core's name, within `decoder.layers.N.`, of our `layers.N.` parameter suffix `ours`."""
    if transformer_impl == "transformer_engine":
        for prefix, fused in _FUSED_NORMS.items():
            if ours.startswith(prefix):
                return fused + ours.removeprefix(prefix)
    return ours


def mcore_name(name: str, transformer_impl: str, local_layer: Optional[int] = None) -> str:
    """Megatron-Core `GPTModel`'s name of our global parameter `name` (layers renumbered to `local_layer`)."""
    layer = layer_of(name)
    if layer is not None:
        suffix = name.split(".", 2)[2]
        return f"decoder.layers.{layer if local_layer is None else local_layer}." + \
            mcore_layer_name(suffix, transformer_impl)
    if name.startswith("final_layernorm."):
        return "decoder." + name
    return name


def _stage_state(reader: CheckpointReader, config: TransformerConfig, spec: StageSpec, rank: int, tp: int,
                 transformer_impl: str, dtype: Optional[torch.dtype]) -> dict[str, Any]:
    """One model chunk's state dict for TP rank `rank`, as Megatron-Core's GPTModel holds it."""
    state: dict[str, Any] = {}
    for name, param in stage_parameters(config, spec).items():
        layer = layer_of(name)
        target = mcore_name(name, transformer_impl, None if layer is None else layer - spec.layer_start)
        if name == "embedding.word_embeddings.weight" and not spec.has_embedding:
            target = "output_layer.weight"  # the head stage's copy of a tied embedding
        state[target] = tp_shard(reader, config, name, param, rank, tp, dtype)
    for local in range(len(spec.layers)):
        for module in _EXTRA_STATE_MODULES[transformer_impl]:
            state[f"decoder.layers.{local}.{module}._extra_state"] = None
    if spec.has_head:
        state["output_layer._extra_state"] = None
    return state


def prepare_export(staging: str, save_dir: str, reader: CheckpointReader, config: TransformerConfig,
                   layout: TargetLayout, *, ckpt_format: str, transformer_impl: str, tokenizer_dir: Optional[str],
                   dtype: torch.dtype) -> argparse.Namespace:
    """What both Megatron-LM formats put beside the weights: the tracker file naming the iteration and the
    tokenizer files (in `tokenizer/`, which `args.tokenizer_model` names by its final path); returns `args`."""
    write_tracker(staging, reader.iteration, tokenizer_dir, TOKENIZER_DIR)
    tokenizer_model = None if tokenizer_dir is None else os.path.join(os.path.abspath(save_dir), TOKENIZER_DIR)
    return megatron_lm_args(config, layout, iteration=reader.iteration, consumed_samples=reader.consumed_samples,
                            ckpt_format=ckpt_format, transformer_impl=transformer_impl,
                            tokenizer_model=tokenizer_model, dtype=dtype)


def rank_directory(tp_rank: int, pp_rank: int, pp: int) -> str:
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")


def write_megatron_lm(
    reader: CheckpointReader,
    config: TransformerConfig,
    save_dir: str,
    layout: TargetLayout,
    *,
    dtype: Optional[torch.dtype] = None,
    tokenizer_dir: Optional[str] = None,
    transformer_impl: str = "transformer_engine",
    progress: bool = True,
) -> list[StageSpec]:
    """Write `reader`'s weights as Megatron-LM's `torch` format split as `layout`; returns the stages.

    Rank (t, p) gets `iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt` holding its model chunks (`model`, or
    `model0`, `model1`, ... with virtual stages: chunk c of pipeline rank p is global stage c * pp + p,
    Megatron's interleaved placement), layer numbers local to each chunk, vocabulary padded for tp. No
    optimizer or RNG state: Megatron-LM loads it with `--finetune`, or `--no-load-optim --no-load-rng`
    to continue at its iteration.
    """
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise CheckpointError(f"--target-transformer-impl {transformer_impl!r} is not one of "
                              f"{', '.join(TRANSFORMER_IMPLS)}")
    stages = layout.checked_stages(config, interleaved_only=True)
    chunks = layout.num_chunks(config.num_layers)
    with staged_output(save_dir) as staging:
        directory = iteration_dir(staging, reader.iteration)
        args = prepare_export(staging, save_dir, reader, config, layout, ckpt_format="torch",
                              transformer_impl=transformer_impl, tokenizer_dir=tokenizer_dir,
                              dtype=dtype or config.params_dtype)
        with tqdm(total=layout.tp * layout.pp, desc="Megatron-LM ranks", unit="file", disable=not progress) as bar:
            for pp_rank in range(layout.pp):
                for tp_rank in range(layout.tp):
                    state: dict[str, Any] = {"args": args, "checkpoint_version": CHECKPOINT_VERSION,
                                             "iteration": reader.iteration,
                                             "num_floating_point_operations_so_far": 0}
                    for chunk in range(chunks):
                        key = "model" if chunks == 1 else f"model{chunk}"
                        state[key] = _stage_state(reader, config, stages[chunk * layout.pp + pp_rank], tp_rank,
                                                  layout.tp, transformer_impl, dtype)
                    rank_dir = os.path.join(directory, rank_directory(tp_rank, pp_rank, layout.pp))
                    os.makedirs(rank_dir)
                    torch.save(state, os.path.join(rank_dir, MEGATRON_LM_FILE))
                    del state
                    bar.update()
    return stages
