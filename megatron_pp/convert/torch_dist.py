"""Megatron-Core's distributed checkpoint format (`--ckpt-format torch_dist`, Megatron-LM's default), both ways.

A `torch_dist` checkpoint is a `torch.distributed.checkpoint` (DCP) directory plus Megatron-Core's own
files:

    DIR/latest_checkpointed_iteration.txt    "N" (or "release")
    DIR/iter_000000N/metadata.json           {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                              "common_backend": "torch", "common_backend_version": 1}
    DIR/iter_000000N/common.pt               torch.save of what is not sharded: args, iteration,
                                             checkpoint_version (plus optimizer scalars in a training run's)
    DIR/iter_000000N/.metadata               DCP's index: every key's global shape, dtype and chunks
    DIR/iter_000000N/__R_T.distcp            the chunks' bytes

Keys are Megatron-Core's sharded-tensor keys, independent of the parallel layout. A model's layers are
stacked along a leading axis of global layer number (`decoder.layers.self_attention.linear_qkv.weight`
is `[num_layers, qkv rows, hidden]`), each rank saving its layers as chunks at their global offsets;
tensor-parallel tensors are stored whole, each rank's shard a chunk. Norms use TransformerEngine's
names whichever `--transformer-impl` saved them (`...linear_qkv.layer_norm_weight`,
`...linear_fc1.layer_norm_weight`). SwiGLU's `linear_fc1` is stored as `[gate; up]` over the full
width (not Megatron's per-rank `[gate_r; up_r]` of the `torch` format), which is our full tensor.
The fused QKV's rows are grouped per query group, as ours. Each layer module's `_extra_state` is a
pickled one-element list `[object]` under `KEY/shard_L_NUMLAYERS`. Layout checked against megatron-core 0.16.1
(`GPTModel.sharded_state_dict` with the local and TransformerEngine layer specs).

`TorchDistReader` reads one tensor (one layer of a stacked key) at a time, only that region's bytes
(`megatron_pp.core.dcp_files`, which also unpickles `.metadata` through an allow-list of DCP's own
classes; common.pt is read like a `torch`-format file), so nothing in a checkpoint can run code.
`write_torch_dist` writes the chunks a Megatron-LM run of the target tp would (one per layer and TP
rank), reading each full tensor from the source once, when its first chunk is written.
"""
from __future__ import annotations

import io
import json
import os
from typing import Optional

import torch
from tqdm import tqdm

from megatron_pp.core.dcp_files import ChunkToWrite, DcpIndex, write_dcp
from megatron_pp.models.config import TransformerConfig
from megatron_pp.models.hf import rotary_interleaved_to_half
from megatron_pp.models.layout import StageSpec
from megatron_pp.training.checkpointing import CheckpointError, iteration_dir, write_json
from megatron_pp.convert.core import (
    CheckpointReader,
    ParameterSpec,
    TargetLayout,
    full_tensor,
    layer_of,
    model_parameters,
    padded_shape,
    staged_output,
)
from megatron_pp.convert.megatron_lm import (
    CHECKPOINT_VERSION,
    config_from_megatron_args,
    load_megatron_lm_file,
    mcore_layer_name,
    megatron_lm_directory,
    prepare_export,
)

MCORE_VERSION_CHECKED = "0.16.1"
COMMON_FILE = "common.pt"
MCORE_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                  "common_backend_version": 1}
_LAYER_PREFIX = "decoder.layers."
# Layer modules with an `_extra_state` sharded object, in either layer spec (TransformerEngine adds the
# core attention's). A loader asks only for its own; extra ones in the file are ignored.
_EXTRA_STATE_MODULES = ("self_attention.core_attention", "self_attention.linear_qkv", "self_attention.linear_proj",
                        "mlp.linear_fc1", "mlp.linear_fc2")


def sharded_key(name: str) -> tuple[str, Optional[int]]:
    """Megatron-Core's sharded-tensor key of our global parameter `name`, and its layer (the offset along
    the key's leading layer axis), None for parameters outside the layers."""
    layer = layer_of(name)
    if layer is not None:
        return _LAYER_PREFIX + mcore_layer_name(name.split(".", 2)[2], "transformer_engine"), layer
    if name.startswith("final_layernorm."):
        return "decoder." + name, None
    return name, None


# Reading ------------------------------------------------------------------------------------------------

def is_torch_dist(directory: str) -> bool:
    """True for a directory Megatron-Core wrote with the torch_dist backend."""
    path = os.path.join(directory, "metadata.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        return json.load(f).get("sharded_backend") == "torch_dist"


class TorchDistReader(CheckpointReader):
    """A Megatron-LM / Megatron-Core `torch_dist` checkpoint (model weights; optimizer state is skipped).

    The model config comes from common.pt's `args`, as for the `torch` format; the vocabulary size is
    `true_vocab_size` if given, else `args.vocab_size`, else the stored (padded) row count.
    """

    def __init__(self, load_dir: str, *, true_vocab_size: Optional[int] = None):
        directory = megatron_lm_directory(load_dir)
        if not is_torch_dist(directory):
            raise CheckpointError(f"{directory}: no metadata.json naming the torch_dist backend (not a Megatron-Core "
                                  "torch_dist checkpoint)")
        self._directory = directory
        common = load_megatron_lm_file(os.path.join(directory, COMMON_FILE))
        args = common.get("args")
        if args is None:
            raise CheckpointError(f"{directory}/{COMMON_FILE}: no `args` (Megatron-LM saves them; a bare "
                                  "Megatron-Core checkpoint does not say which model it holds)")
        self.iteration = int(common.get("iteration", 0) or 0)
        self.consumed_samples = int(getattr(args, "consumed_train_samples", 0) or 0)
        try:
            self._dcp = DcpIndex(directory)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
        self._index = self._dcp.keys
        embedding = self._index.get("embedding.word_embeddings.weight")
        if embedding is None:
            raise CheckpointError(f"{directory}: no embedding.word_embeddings.weight")
        rows = embedding.shape[0]
        vocab_size = true_vocab_size or getattr(args, "vocab_size", None) or rows
        if vocab_size > rows:
            raise CheckpointError(f"vocabulary size {vocab_size} is larger than the checkpoint's {rows} embedding rows")
        self.config, self._interleaved = config_from_megatron_args(args, vocab_size)
        self._params = model_parameters(self.config)
        self._check()

    def _check(self) -> None:
        wanted = {sharded_key(name)[0] for name in self._params}
        for key, meta in self._index.items():
            if not key.startswith(("embedding.", "decoder.", "output_layer.")) or meta is None:
                continue  # optimizer state, RNG, `_extra_state` objects: not model weights
            tied_head = key == "output_layer.weight" and not self.config.untie_embeddings_and_output_weights
            if key not in wanted and not tied_head:
                raise CheckpointError(f"{self._directory}: {key} is not part of a GPT or LLaMA model megatron_pp knows "
                                      "(unsupported feature: QK norm, MoE, MLA, ...?)")
        for name, param in self._params.items():
            key, layer = sharded_key(name)
            meta = self._index.get(key)
            if meta is None:
                raise CheckpointError(f"{self._directory}: no {key} (for {name})")
            shape = meta.shape[1:] if layer is not None else meta.shape
            if layer is not None and meta.shape[0] != self.config.num_layers:
                raise CheckpointError(f"{self._directory}: {key} stacks {meta.shape[0]} layers, args.num_layers is "
                                      f"{self.config.num_layers}")
            if shape[1:] != param.shape[1:] or (name not in ("embedding.word_embeddings.weight", "output_layer.weight")
                                                and shape != param.shape):
                raise CheckpointError(f"{self._directory}: {key} has shape {list(shape)} per layer, the model its args "
                                      f"describe has {list(param.shape)}")

    def tensor(self, name: str) -> torch.Tensor:
        key, layer = sharded_key(name)
        shape = self._index[key].shape
        if layer is None:
            tensor = self._dcp.read(key, (0,) * len(shape), shape)
        else:
            tensor = self._dcp.read(key, (layer,) + (0,) * (len(shape) - 1), (1, *shape[1:]))[0]
        if self._interleaved and ".self_attention.linear_qkv." in name:
            tensor = rotary_interleaved_to_half(tensor, self.config)
        return tensor


# Writing ------------------------------------------------------------------------------------------------


def _pieces(param: ParameterSpec, tp: int) -> tuple[int, int]:
    """(pieces, dim): the equal chunks a tp-rank Megatron run saves of a parameter (per layer). One per
    rank's shard, and for a strided split (SwiGLU's fc1) one per rank and block, as Megatron-Core's
    factory splits it; in the full tensor they lie in piece order."""
    if not param.partitioned:
        return 1, 0
    return tp * param.partition_stride, param.partition_dim


def write_torch_dist(
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
    """Write `reader`'s weights as a Megatron-Core torch_dist checkpoint; returns the target's stages.

    The keys and global shapes are layout-free; `layout` decides the vocabulary padding (for its tp),
    the chunking (as a run of that tp saves it) and the parallel sizes recorded in `args`, which
    Megatron-LM uses only to decide whether RNG state could be restored. Model weights only: `args`
    says `no_save_optim` and `no_save_rng`, so Megatron-LM loads it without optimizer flags.
    """
    stages = layout.checked_stages(config, interleaved_only=True)
    saved_dtype = dtype or config.params_dtype
    padded = config.padded_vocab_size(layout.tp)
    params = model_parameters(config)
    chunks: list[ChunkToWrite] = []
    for name, param in params.items():
        key, layer = sharded_key(name)
        shape = padded_shape(name, param, padded)
        global_shape = shape if layer is None else (config.num_layers, *shape)
        pieces, dim = _pieces(param, layout.tp)
        axis = dim if layer is None else dim + 1
        for piece in range(pieces):
            sizes, offsets = list(global_shape), [0] * len(global_shape)
            sizes[axis] //= pieces
            offsets[axis] = piece * sizes[axis]
            if layer is not None:
                sizes[0], offsets[0] = 1, layer
            chunks.append(ChunkToWrite(key, global_shape, tuple(offsets), tuple(sizes), saved_dtype,
                                       (name, piece, pieces, dim)))
    # Megatron-Core stores a sharded object as a pickled one-element list: here an `_extra_state` without
    # FP8 metadata, which both layer specs accept.
    empty_state = io.BytesIO()
    torch.save([None], empty_state)
    objects = {f"{_LAYER_PREFIX}{module}._extra_state/shard_{layer}_{config.num_layers}": empty_state.getvalue()
               for layer in range(config.num_layers) for module in _EXTRA_STATE_MODULES}

    with tqdm(total=len(params), desc="torch_dist", unit="tensor", disable=not progress) as bar:
        cached: dict[str, torch.Tensor] = {}

        def fetch(source: tuple[str, int, int, int]) -> torch.Tensor:
            name, piece, pieces, dim = source
            if name not in cached:  # chunks of one tensor come one after another: read it once
                cached.clear()
                cached[name] = full_tensor(reader, name, padded_shape(name, params[name], padded),
                                           config.vocab_size).to(saved_dtype)
                bar.update()
            full = cached[name]
            size = full.shape[dim] // pieces
            return full.narrow(dim, piece * size, size).contiguous()

        with staged_output(save_dir) as staging:
            directory = iteration_dir(staging, reader.iteration)
            os.makedirs(directory)
            args = prepare_export(staging, save_dir, reader, config, layout, ckpt_format="torch_dist",
                                  transformer_impl=transformer_impl, tokenizer_dir=tokenizer_dir, dtype=saved_dtype)
            write_dcp(directory, chunks, objects, fetch)
            torch.save({"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": reader.iteration,
                        "num_floating_point_operations_so_far": 0}, os.path.join(directory, COMMON_FILE))
            write_json(os.path.join(directory, "metadata.json"), MCORE_METADATA)
    return stages
