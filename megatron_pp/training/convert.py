"""Checkpoint conversion: Hugging Face, megatron_pp and Megatron-LM checkpoints, streamed tensor by tensor.

Every conversion is a reader and a writer. A reader shows a checkpoint as a `TransformerConfig` plus full
(unsharded) tensors under megatron_pp's global parameter names, read on demand: `HFReader` (safetensors
shards opened lazily with `safe_open`), `MegatronPPReader` (our per-stage, per-TP-rank files,
memory-mapped) and `MegatronLMReader` (Megatron-LM's per-rank `model_optim_rng.pt`, memory-mapped and
unpickled with `weights_only=True` and an explicit allow-list). A writer pulls one tensor at a time:
`write_megatron_pp` shards it for any tp / pp / virtual-stage / uneven split, `write_hf` writes
safetensors shards and a config.json that `from_pretrained` loads. Peak memory is one output file (one
global stage's share for one TP rank, or one safetensors shard of at most `max_shard_bytes`) plus one
full tensor, never the whole model; the price is that a source is read once per target TP rank.
Output goes to a staging directory beside `save_dir` that is renamed into place when complete, so an
interrupted conversion leaves nothing that looks like a checkpoint. Tokenizer files travel along.

A converted megatron_pp checkpoint is iteration 0 (a resharded one keeps its source's iteration) and
holds model weights only: load it with `--finetune`.
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import pickle
import re
import shutil
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from megatron_pp.core.tensor_parallel import param_is_partitioned, shard_tensor
from megatron_pp.models.config import TransformerConfig, flag
from megatron_pp.models.hf import (
    VOCAB_PARAMETERS,
    canonical_hf_name,
    config_from_hf,
    hf_config_from,
    is_ignored_hf_name,
    resize_vocab_rows,
    rotary_interleaved_to_half,
    tensor_maps,
)
from megatron_pp.models.layout import StageSpec, split_layers
from megatron_pp.models.transformer import StageModel
from megatron_pp.schedules.generators import looped_placement
from megatron_pp.training.checkpointing import (
    FORMAT_VERSION,
    METADATA_FILE,
    TRACKER_FILE,
    CheckpointError,
    iteration_dir,
    model_file,
    model_shape,
    read_metadata,
    read_tracker,
)

SOURCE_FORMATS = ("hf", "megatron_pp", "megatron_lm")
TARGET_FORMATS = ("hf", "megatron_pp")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")
"""Files carried along with the weights (generation_config.json too: it holds the token ids to stop on)."""
TOKENIZER_DIR = "tokenizer"
"""Where a megatron_pp checkpoint keeps the tokenizer files, beside latest_checkpointed_iteration.txt."""
HF_CONFIG_FILE = "hf_config.json"
"""The config.json a megatron_pp checkpoint was imported from, kept so an export restores its token ids."""
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
MEGATRON_LM_FILE = "model_optim_rng.pt"


# Configs as JSON ----------------------------------------------------------------------------------------


def config_to_json(config: TransformerConfig) -> dict[str, Any]:
    """The config as JSON values (the dtype as its name, e.g. "torch.bfloat16"), as metadata.json holds it."""
    values = dataclasses.asdict(config)
    values["params_dtype"] = str(config.params_dtype)
    return values


def config_from_json(values: dict[str, Any]) -> TransformerConfig:
    """Inverse of `config_to_json`; a field this code does not know is an error, not silently dropped."""
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise CheckpointError(f"the checkpoint's model config has fields this version does not know: "
                              f"{', '.join(unknown)}")
    values = dict(values)
    dtype_name = str(values.pop("params_dtype", "torch.float32")).removeprefix("torch.")
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"the checkpoint's model config has an unknown params_dtype {dtype_name!r}")
    return TransformerConfig(**values, params_dtype=dtype)


def training_flags(config: TransformerConfig) -> list[str]:
    """Command-line flags of pretrain_*.py that build exactly this model (to train a converted checkpoint)."""
    skipped = {"params_dtype", "attention_backend", "hidden_dropout", "attention_dropout", "init_method_std",
               "add_bias_linear", "untie_embeddings_and_output_weights"}
    flags: list[str] = []
    for field in dataclasses.fields(TransformerConfig):
        value = getattr(config, field.name)
        if field.name not in skipped and value is not None:
            flags += [flag(field.name), str(value)]
    if not config.add_bias_linear:
        flags.append("--disable-bias-linear")
    if config.untie_embeddings_and_output_weights:
        flags.append("--untie-embeddings-and-output-weights")
    return flags


# Parameters and shards ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParameterSpec:
    """A parameter's full shape (vocabulary rows unpadded: `config.vocab_size`) and its TP split."""

    shape: tuple[int, ...]
    partitioned: bool
    partition_dim: int
    partition_stride: int


def stage_parameters(config: TransformerConfig, spec: StageSpec) -> dict[str, ParameterSpec]:
    """Every entry of a stage's state dict, in order, read off a model built on the meta device.

    Building the real module (without allocating) keeps one source of truth for names, shapes and
    tensor-parallel partitioning: whatever `StageModel` holds is what gets written.
    """
    model = StageModel(config, spec, device=torch.device("meta"))
    params = {}
    for name, param in model.state_dict(keep_vars=True).items():
        shape = tuple(param.shape)
        if name in VOCAB_PARAMETERS:
            shape = (config.vocab_size, *shape[1:])
        params[name] = ParameterSpec(shape, param_is_partitioned(param), getattr(param, "partition_dim", 0),
                                     getattr(param, "partition_stride", 1))
    return params


def model_parameters(config: TransformerConfig) -> dict[str, ParameterSpec]:
    """`stage_parameters` of the whole model as one stage."""
    return stage_parameters(config, split_layers(config.num_layers, 1)[0])


def join_shards(shards: list[torch.Tensor], param: ParameterSpec) -> torch.Tensor:
    """The full tensor from every TP rank's shard, in rank order (the offline inverse of `shard_tensor`)."""
    if not param.partitioned or len(shards) == 1:
        return shards[0]
    dim, stride = param.partition_dim, param.partition_stride
    pieces = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([pieces[rank][block] for block in range(stride) for rank in range(len(shards))], dim=dim)


def _compact(tensor: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    # A copy with storage of its own: saving a view (a slice of a padded embedding, a memory-mapped
    # source) would otherwise write, or keep alive, the whole storage it points into.
    return tensor.to(dtype=dtype or tensor.dtype, memory_format=torch.contiguous_format, copy=True)


# Readers ------------------------------------------------------------------------------------------------


class CheckpointReader(ABC):
    """A checkpoint seen as its model config and full tensors under megatron_pp's global names.

    Vocabulary tensors may come with padding rows (any number >= `config.vocab_size`); writers resize.
    """

    config: TransformerConfig
    iteration: int = 0
    consumed_samples: int = 0
    tokenizer_dir: Optional[str] = None
    """A directory holding the checkpoint's tokenizer files, if it has any."""
    hf_config: Optional[dict] = None
    """The Hugging Face config.json the weights came from, if known."""

    @abstractmethod
    def tensor(self, name: str) -> torch.Tensor:
        """The full tensor of global parameter `name` (read now; the reader keeps no reference to it)."""

    def close(self) -> None:
        """Release open files."""

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _has_tokenizer(directory: str) -> bool:
    return any(os.path.isfile(os.path.join(directory, name))
               for name in TOKENIZER_FILES if name != "generation_config.json")


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class HFReader(CheckpointReader):
    """A Hugging Face `LlamaForCausalLM` / `GPT2LMHeadModel` directory: config.json plus safetensors.

    Opening checks everything that can be checked without reading weights: every tensor the model needs
    is present, none is left over, and each has the shape config.json implies.
    """

    def __init__(self, load_dir: str):
        config_path = os.path.join(load_dir, "config.json")
        if not os.path.isfile(config_path):
            raise CheckpointError(f"{load_dir}: no config.json (not a Hugging Face model directory)")
        with open(config_path) as f:
            self.hf_config = json.load(f)
        config = config_from_hf(_load_hf_config(load_dir))
        self._maps = {m.name: m for m in tensor_maps(config)}
        self._location = self._index(load_dir, config)  # canonical HF name -> (file, name as stored)
        self._handles: dict[str, Any] = {}
        self._check(config, load_dir)
        first = next(iter(self._maps.values())).hf_names[0]
        dtype = _SAFETENSORS_DTYPES.get(self._handle(first).get_slice(self._location[first][1]).get_dtype(),
                                        torch.float32)
        self.config = dataclasses.replace(config, params_dtype=dtype)
        self.tokenizer_dir = load_dir if _has_tokenizer(load_dir) else None

    def _index(self, load_dir: str, config: TransformerConfig) -> dict[str, tuple[str, str]]:
        index_path = os.path.join(load_dir, "model.safetensors.index.json")
        single = os.path.join(load_dir, "model.safetensors")
        if os.path.isfile(index_path):
            with open(index_path) as f:
                stored = {name: os.path.join(load_dir, file) for name, file in json.load(f)["weight_map"].items()}
        elif os.path.isfile(single):
            stored = {name: single for name in safe_open(single, framework="pt").keys()}
        elif any(name.startswith("pytorch_model") for name in os.listdir(load_dir)):
            raise CheckpointError(f"{load_dir} holds pytorch_model*.bin (pickle) weights; only safetensors are read: "
                                  "re-save the model with save_pretrained(..., safe_serialization=True)")
        else:
            raise CheckpointError(f"{load_dir}: no model.safetensors or model.safetensors.index.json")
        return {canonical_hf_name(name, config): (file, name) for name, file in stored.items()}

    def _check(self, config: TransformerConfig, load_dir: str) -> None:
        needed = {name for m in self._maps.values() for name in m.hf_names}
        missing = sorted(needed - set(self._location))
        if missing:
            raise CheckpointError(f"{load_dir} lacks {len(missing)} tensor(s) the model needs, e.g. {missing[:3]}")
        extra = sorted(n for n in set(self._location) - needed if not is_ignored_hf_name(n, config))
        if extra:
            raise CheckpointError(f"{load_dir} holds {len(extra)} tensor(s) this {_config_summary(config)} model "
                                  f"has no place for, e.g. {extra[:3]}; does config.json describe these weights?")
        for name, param in model_parameters(config).items():
            tensor_map = self._maps[name]
            expected = tensor_map.to_hf(torch.empty(param.shape, device="meta"), config)
            for hf_name, want in zip(tensor_map.hf_names, expected):
                have = tuple(self._handle(hf_name).get_slice(self._location[hf_name][1]).get_shape())
                if have != tuple(want.shape):
                    fields = ", ".join(f"{k}={self.hf_config.get(k)}" for k in tensor_map.hf_fields)
                    raise CheckpointError(f"{hf_name} has shape {list(have)}, but config.json ({fields}) implies "
                                          f"{list(want.shape)}")

    def _handle(self, hf_name: str) -> Any:
        """The open safetensors file holding `hf_name` (opening maps it; nothing is read yet)."""
        file = self._location[hf_name][0]
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="pt")
        return self._handles[file]

    def tensor(self, name: str) -> torch.Tensor:
        tensor_map = self._maps[name]
        parts = [self._handle(n).get_tensor(self._location[n][1]) for n in tensor_map.hf_names]
        return tensor_map.to_ours(parts, self.config)

    def close(self) -> None:
        self._handles.clear()


def _load_hf_config(load_dir: str) -> Any:
    # Never look a directory name up on a model hub (it would stall without a network).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(load_dir, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{load_dir}/config.json cannot be read by transformers: {exc}") from None


def _config_summary(config: TransformerConfig) -> str:
    return (f"{config.num_layers}-layer, hidden {config.hidden_size}, {config.num_attention_heads} heads "
            f"({config.query_groups} query groups)")


class MegatronPPReader(CheckpointReader):
    """A checkpoint written by `checkpointing.save_checkpoint` (or by this module): its newest iteration,
    or the `iter_*` directory given. Shard files are memory-mapped, one global stage at a time."""

    def __init__(self, load_dir: str):
        directory, root = _megatron_pp_directory(load_dir)
        metadata = read_metadata(directory)
        self.config = config_from_json(metadata["model"])
        self.iteration = int(metadata["iteration"])
        self.consumed_samples = int(metadata.get("consumed_samples", 0))
        layout = metadata["layout"]
        self._directory = directory
        self._tp = int(layout["tp"])
        stages = [StageSpec(**stage) for stage in layout["stages"]]
        self._params = model_parameters(self.config)
        self._owner = {name: _owning_stage(name, stages) for name in self._params}
        self._stage: Optional[int] = None
        self._shards: list[dict[str, torch.Tensor]] = []
        if os.path.isdir(os.path.join(root, TOKENIZER_DIR)):
            self.tokenizer_dir = os.path.join(root, TOKENIZER_DIR)
        if os.path.isfile(os.path.join(root, HF_CONFIG_FILE)):
            with open(os.path.join(root, HF_CONFIG_FILE)) as f:
                self.hf_config = json.load(f)

    def tensor(self, name: str) -> torch.Tensor:
        stage = self._owner[name]
        if stage != self._stage:
            self._shards = []  # drop the previous stage's mappings before opening the next
            for rank in range(self._tp):
                path = os.path.join(self._directory, model_file(stage, rank))
                if not os.path.isfile(path):
                    raise CheckpointError(f"{path}: missing from the checkpoint")
                self._shards.append(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["model"])
            self._stage = stage
        try:
            return join_shards([shard[name] for shard in self._shards], self._params[name])
        except KeyError:
            raise CheckpointError(f"{self._directory}: the stage {stage} files lack parameter {name}") from None

    def close(self) -> None:
        self._shards, self._stage = [], None


def _megatron_pp_directory(load_dir: str) -> tuple[str, str]:
    """(iteration directory, checkpoint root) for a root with a tracker file or an `iter_*` directory."""
    if os.path.isfile(os.path.join(load_dir, METADATA_FILE)):
        return load_dir, os.path.dirname(os.path.abspath(load_dir))
    iteration = read_tracker(load_dir) if os.path.isdir(load_dir) else None
    if iteration is None:
        raise CheckpointError(f"{load_dir}: no {TRACKER_FILE} and no {METADATA_FILE} (not a megatron_pp checkpoint)")
    return iteration_dir(load_dir, iteration), load_dir


def _owning_stage(name: str, stages: list[StageSpec]) -> int:
    """The global stage whose files hold `name` (the word embedding: the first stage's, not the head's copy)."""
    if name.startswith("layers."):
        layer = int(name.split(".")[1])
        return next(s.stage for s in stages if s.layer_start <= layer < s.layer_end)
    return 0 if name.startswith("embedding.") else stages[-1].stage


# Megatron-LM ----------------------------------------------------------------------------------------------


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

    unsupported = [
        (get("num_experts"), "--num-experts (mixture of experts)"),
        (get("apply_residual_connection_post_layernorm", False), "--apply-residual-connection-post-layernorm"),
        (get("qk_layernorm", False), "--qk-layernorm"),
        (get("multi_latent_attention", False), "--multi-latent-attention"),
        (get("squared_relu", False), "--squared-relu"),
        (get("rotary_percent", 1.0) != 1.0, f"--rotary-percent {get('rotary_percent')}"),
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
        add_bias_linear=bool(get("add_bias_linear", True)),
        untie_embeddings_and_output_weights=bool(get("untie_embeddings_and_output_weights", False)),
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
        self._directory = _megatron_lm_directory(load_dir)
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


def _megatron_lm_directory(load_dir: str) -> str:
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


# Tokenizers -----------------------------------------------------------------------------------------------


def tokenizer_vocab_size(directory: str) -> Optional[int]:
    """Token ids the tokenizer in `directory` can produce (largest id + 1), or None if it has none we read."""
    path = os.path.join(directory, "tokenizer.json")
    if os.path.isfile(path):
        from tokenizers import Tokenizer

        return 1 + max(Tokenizer.from_file(path).get_vocab(with_added_tokens=True).values())
    path = os.path.join(directory, "tokenizer.model")
    if os.path.isfile(path):
        import sentencepiece

        return sentencepiece.SentencePieceProcessor(model_file=path).get_piece_size()
    ids: list[int] = []
    for name in ("vocab.json", "added_tokens.json"):
        if os.path.isfile(os.path.join(directory, name)):
            with open(os.path.join(directory, name)) as f:
                ids += list(json.load(f).values())
    return 1 + max(ids) if ids else None


def check_vocabulary(config: TransformerConfig, tokenizer_dir: str) -> None:
    """Refuse a model whose embedding has fewer rows than the tokenizer has token ids."""
    tokens = tokenizer_vocab_size(tokenizer_dir)
    if tokens is not None and tokens > config.vocab_size:
        raise CheckpointError(
            f"the tokenizer in {tokenizer_dir} produces ids up to {tokens - 1}, but the model's vocabulary has only "
            f"{config.vocab_size} rows: ids {config.vocab_size}..{tokens - 1} would have no embedding"
        )


def _copy_tokenizer(tokenizer_dir: str, destination: str) -> None:
    for name in TOKENIZER_FILES:
        source = os.path.join(tokenizer_dir, name)
        if os.path.isfile(source):
            os.makedirs(destination, exist_ok=True)
            shutil.copyfile(source, os.path.join(destination, name))


# Writing ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TargetLayout:
    """The parallel layout of a megatron_pp checkpoint to write (the training run's flags, same meaning)."""

    tp: int = 1
    pp: int = 1
    vp: Optional[int] = None
    """Virtual stages (model chunks) per pipeline rank; None: from `layers_per_virtual_stage`, else 1."""
    layers_per_virtual_stage: Optional[int] = None
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    account_for_embedding: bool = False
    account_for_loss: bool = False

    def num_chunks(self, num_layers: int) -> int:
        if self.vp is not None and self.layers_per_virtual_stage is not None:
            raise ValueError("--num-virtual-stages-per-pipeline-rank and --num-layers-per-virtual-pipeline-stage "
                             "are mutually exclusive")
        if self.layers_per_virtual_stage is None:
            return 1 if self.vp is None else self.vp
        slots = num_layers + int(self.account_for_embedding) + int(self.account_for_loss)
        per_stage = self.layers_per_virtual_stage
        if per_stage < 1 or slots % (self.pp * per_stage) != 0:
            raise ValueError(f"--num-layers-per-virtual-pipeline-stage {per_stage} does not divide {slots} layer slots "
                             f"into --pipeline-model-parallel-size {self.pp} ranks evenly")
        return slots // (self.pp * per_stage)

    def training_flags(self) -> list[str]:
        """The pretrain_*.py flags that build this layout."""
        flags = ["--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp)]
        for name, value in (("--num-virtual-stages-per-pipeline-rank", self.vp),
                            ("--num-layers-per-virtual-pipeline-stage", self.layers_per_virtual_stage),
                            ("--decoder-first-pipeline-num-layers", self.first_stage_layers),
                            ("--decoder-last-pipeline-num-layers", self.last_stage_layers)):
            if value is not None:
                flags += [name, str(value)]
        if self.account_for_embedding:
            flags.append("--account-for-embedding-in-pipeline-split")
        if self.account_for_loss:
            flags.append("--account-for-loss-in-pipeline-split")
        return flags

    def stages(self, num_layers: int) -> list[StageSpec]:
        return split_layers(num_layers, self.pp, self.num_chunks(num_layers),
                            first_stage_layers=self.first_stage_layers, last_stage_layers=self.last_stage_layers,
                            account_for_embedding=self.account_for_embedding, account_for_loss=self.account_for_loss)


_LAYOUT_FLAGS = re.compile(r"--(tensor-model-parallel-size|pipeline-model-parallel-size|"
                           r"num-virtual-stages-per-pipeline-rank|num-layers-per-virtual-pipeline-stage|"
                           r"decoder-first-pipeline-num-layers|decoder-last-pipeline-num-layers|"
                           r"account-for-embedding-in-pipeline-split|account-for-loss-in-pipeline-split)")
_SHORT_TARGET_FLAGS = {"tensor-model-parallel-size": "tensor-parallel-size",
                       "pipeline-model-parallel-size": "pipeline-parallel-size"}


def _target_error(exc: Exception) -> CheckpointError:
    """A layout error from the training code, reworded with the converter's --target-* flags."""
    return CheckpointError(_LAYOUT_FLAGS.sub(
        lambda m: "--target-" + _SHORT_TARGET_FLAGS.get(m.group(1), m.group(1)), str(exc)))


def _full_tensor(reader: CheckpointReader, name: str, shape: tuple[int, ...], vocab_size: int) -> torch.Tensor:
    """`reader.tensor(name)`, vocabulary rows resized to `shape[0]`, checked against `shape`."""
    tensor = reader.tensor(name)
    if name in VOCAB_PARAMETERS:
        if tensor.shape[0] < vocab_size:
            raise CheckpointError(f"{name} has {tensor.shape[0]} rows, fewer than the vocabulary size {vocab_size}")
        tensor = resize_vocab_rows(tensor, shape[0])
    if tuple(tensor.shape) != tuple(shape):
        raise CheckpointError(f"{name}: the source holds shape {list(tensor.shape)}, the model config implies "
                              f"{list(shape)}")
    return tensor


def _check_empty_target(save_dir: str) -> None:
    if os.path.exists(save_dir) and (not os.path.isdir(save_dir) or os.listdir(save_dir)):
        raise CheckpointError(f"--save-dir {save_dir} exists and is not empty; choose a new directory")


def _staging_dir(save_dir: str) -> str:
    parent = os.path.dirname(os.path.abspath(save_dir))
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=os.path.basename(os.path.abspath(save_dir)) + ".partial-", dir=parent)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: str) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _publish(staging: str, save_dir: str) -> None:
    """Make the complete `staging` tree appear as `save_dir` in one rename."""
    for directory, _, files in os.walk(staging):
        for name in files:
            _fsync_file(os.path.join(directory, name))
        _fsync_dir(directory)
    if os.path.isdir(save_dir):
        os.rmdir(save_dir)  # empty (checked before writing); rename cannot replace a directory otherwise
    os.rename(staging, save_dir)
    _fsync_dir(os.path.dirname(os.path.abspath(save_dir)))


def _write_json(path: str, value: Any) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=1, default=str)
        f.write("\n")


def write_megatron_pp(
    reader: CheckpointReader,
    config: TransformerConfig,
    save_dir: str,
    layout: TargetLayout,
    *,
    dtype: Optional[torch.dtype] = None,
    tokenizer_dir: Optional[str] = None,
    source: Optional[dict] = None,
    progress: bool = True,
) -> list[StageSpec]:
    """Write `reader`'s weights as a megatron_pp checkpoint of `config` split as `layout`; returns the stages.

    The files are the ones `checkpointing.save_checkpoint` writes for model weights (one
    `model_stageSSS_tpTT.pt` per global stage and TP rank) with a metadata.json that `load_checkpoint`
    accepts, but no optimizer or RNG files. Vocabulary tensors are padded to `padded_vocab_size(tp)`.
    """
    try:
        config.validate(layout.tp)
        stages = layout.stages(config.num_layers)
    except ValueError as exc:
        raise _target_error(exc) from None
    _check_empty_target(save_dir)
    per_stage = [stage_parameters(config, spec) for spec in stages]
    staging = _staging_dir(save_dir)
    try:
        directory = iteration_dir(staging, reader.iteration)
        os.makedirs(directory)
        padded = config.padded_vocab_size(layout.tp)
        total = sum(len(params) for params in per_stage) * layout.tp
        with tqdm(total=total, desc="megatron_pp shards", unit="tensor", disable=not progress) as bar:
            for spec, params in zip(stages, per_stage):
                for rank in range(layout.tp):
                    shard = {}
                    for name, param in params.items():
                        shape = (padded, *param.shape[1:]) if name in VOCAB_PARAMETERS else param.shape
                        value = _full_tensor(reader, name, shape, config.vocab_size)
                        if param.partitioned:
                            value = shard_tensor(value, param.partition_dim, param.partition_stride, rank, layout.tp)
                        shard[name] = _compact(value, dtype)
                        bar.update()
                    torch.save({"model": shard}, os.path.join(directory, model_file(spec.stage, rank)))
        saved = dataclasses.replace(config, params_dtype=dtype or config.params_dtype)
        num_chunks = layout.num_chunks(config.num_layers)
        _write_json(os.path.join(directory, METADATA_FILE), {
            "format_version": FORMAT_VERSION,
            "iteration": reader.iteration,
            "consumed_samples": reader.consumed_samples,
            "world_size": layout.tp * layout.pp,
            "layout": {"tp": layout.tp, "pp": layout.pp, "dp": 1, "num_chunks": num_chunks,
                       "placement": [list(p) for p in looped_placement(layout.pp, num_chunks)],
                       "stages": [dataclasses.asdict(s) for s in stages]},
            "schedule": None,
            "model": config_to_json(saved),
            "model_shape": model_shape(saved),
            "optimizer": {"saved": False, "sharded_by_dp": False},
            "converted_from": source or {},
        })
        with open(os.path.join(staging, TRACKER_FILE), "w") as f:
            f.write(f"{reader.iteration}\n")
        if tokenizer_dir is not None:
            _copy_tokenizer(tokenizer_dir, os.path.join(staging, TOKENIZER_DIR))
        if reader.hf_config is not None:
            _write_json(os.path.join(staging, HF_CONFIG_FILE), reader.hf_config)
        _publish(staging, save_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return stages


def write_hf(
    reader: CheckpointReader,
    config: TransformerConfig,
    save_dir: str,
    *,
    dtype: Optional[torch.dtype] = None,
    tokenizer_dir: Optional[str] = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = True,
) -> list[str]:
    """Write `reader`'s weights as a Hugging Face model directory; returns the safetensors file names.

    Shards hold at most `max_shard_bytes` each (a larger single tensor gets a shard of its own); one
    shard is `model.safetensors`, several are `model-0000K-of-0000N.safetensors` with an index, as
    `save_pretrained` writes them. Vocabulary padding rows are dropped.
    """
    maps = tensor_maps(config)
    params = model_parameters(config)
    _check_empty_target(save_dir)
    staging = _staging_dir(save_dir)
    try:
        parts: list[str] = []
        weight_map: dict[str, str] = {}
        current: dict[str, torch.Tensor] = {}
        current_bytes = total_bytes = 0
        written_dtype = dtype

        def flush() -> None:
            nonlocal current, current_bytes
            part = f"part-{len(parts):05d}.safetensors"
            save_file(current, os.path.join(staging, part), metadata={"format": "pt"})
            parts.append(part)
            weight_map.update({name: part for name in current})
            current, current_bytes = {}, 0

        with tqdm(total=len(maps), desc="safetensors", unit="tensor", disable=not progress) as bar:
            for tensor_map in maps:
                full = _full_tensor(reader, tensor_map.name, params[tensor_map.name].shape, config.vocab_size)
                for hf_name, tensor in zip(tensor_map.hf_names, tensor_map.to_hf(full, config)):
                    tensor = _compact(tensor, dtype)
                    written_dtype = written_dtype or tensor.dtype
                    size = tensor.numel() * tensor.element_size()
                    if current and current_bytes + size > max_shard_bytes:
                        flush()
                    current[hf_name] = tensor
                    current_bytes += size
                    total_bytes += size
                del full  # before the next read, so two full tensors never coexist
                bar.update()
        flush()
        names = (["model.safetensors"] if len(parts) == 1 else
                 [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))])
        for part, name in zip(parts, names):
            os.rename(os.path.join(staging, part), os.path.join(staging, name))
        if len(parts) > 1:
            renamed = dict(zip(parts, names))
            _write_json(os.path.join(staging, "model.safetensors.index.json"), {
                "metadata": {"total_size": total_bytes},
                "weight_map": {name: renamed[part] for name, part in sorted(weight_map.items())},
            })
        hf_config_from(config, reader.hf_config, written_dtype).to_json_file(os.path.join(staging, "config.json"))
        if tokenizer_dir is not None:
            _copy_tokenizer(tokenizer_dir, staging)
        _publish(staging, save_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return names


# One call -----------------------------------------------------------------------------------------------


def open_reader(source_format: str, load_dir: str, *, true_vocab_size: Optional[int] = None) -> CheckpointReader:
    if source_format == "hf":
        return HFReader(load_dir)
    if source_format == "megatron_pp":
        return MegatronPPReader(load_dir)
    if source_format == "megatron_lm":
        return MegatronLMReader(load_dir, true_vocab_size=true_vocab_size)
    raise ValueError(f"--source-format {source_format!r} is not one of {', '.join(SOURCE_FORMATS)}")


@dataclass(frozen=True)
class Conversion:
    """What a conversion wrote."""

    save_dir: str
    config: TransformerConfig
    files: list[str]
    stages: Optional[list[StageSpec]] = None
    """The layer split written (megatron_pp targets)."""


def convert_checkpoint(
    source_format: str,
    target_format: str,
    load_dir: str,
    save_dir: str,
    *,
    layout: TargetLayout = TargetLayout(),
    dtype: Optional[torch.dtype] = None,
    tokenizer_dir: Optional[str] = None,
    make_vocab_size_divisible_by: Optional[int] = None,
    true_vocab_size: Optional[int] = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = True,
) -> Conversion:
    """Convert the checkpoint in `load_dir` to `target_format` in `save_dir` (which must be new or empty).

    `tokenizer_dir` replaces the tokenizer files the source carries (if any); the vocabulary must cover
    every id the tokenizer produces. `make_vocab_size_divisible_by` changes the padding rule of a
    megatron_pp target (default: the source's, 128 for Hugging Face sources). `true_vocab_size` is the
    real vocabulary: embedding rows beyond it are dropped (for a Megatron-LM source it also says where
    the padding starts, which its files do not record).
    """
    if target_format not in TARGET_FORMATS:
        raise ValueError(f"--target-format {target_format!r} is not one of {', '.join(TARGET_FORMATS)}")
    if os.path.abspath(load_dir) == os.path.abspath(save_dir):
        raise CheckpointError("--load-dir and --save-dir are the same directory")
    with open_reader(source_format, load_dir, true_vocab_size=true_vocab_size) as reader:
        config = reader.config
        if true_vocab_size is not None:
            if true_vocab_size > config.vocab_size:
                raise CheckpointError(f"--true-vocab-size {true_vocab_size} is larger than the checkpoint's "
                                      f"vocabulary of {config.vocab_size}")
            config = dataclasses.replace(config, vocab_size=true_vocab_size)
        if make_vocab_size_divisible_by is not None:
            config = dataclasses.replace(config, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
        tokenizer_dir = tokenizer_dir or reader.tokenizer_dir
        if tokenizer_dir is not None:
            check_vocabulary(config, tokenizer_dir)
        if target_format == "hf":
            files = write_hf(reader, config, save_dir, dtype=dtype, tokenizer_dir=tokenizer_dir,
                             max_shard_bytes=max_shard_bytes, progress=progress)
            return Conversion(save_dir, config, files)
        stages = write_megatron_pp(reader, config, save_dir, layout, dtype=dtype, tokenizer_dir=tokenizer_dir,
                                   source={"format": source_format, "path": os.path.abspath(load_dir)},
                                   progress=progress)
        files = sorted(model_file(s.stage, r) for s in stages for r in range(layout.tp))
        return Conversion(save_dir, dataclasses.replace(config, params_dtype=dtype or config.params_dtype), files,
                          stages)


def read_full_state(load_dir: str, source_format: str = "megatron_pp") -> Iterator[tuple[str, torch.Tensor]]:
    """Every full tensor of a checkpoint by global name, one at a time (vocabulary rows unpadded)."""
    with open_reader(source_format, load_dir) as reader:
        for name, param in model_parameters(reader.config).items():
            yield name, _full_tensor(reader, name, param.shape, reader.config.vocab_size)
