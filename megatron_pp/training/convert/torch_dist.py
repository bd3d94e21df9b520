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
pickled object under `KEY/shard_L_NUMLAYERS`. Layout checked against megatron-core 0.16.1
(`GPTModel.sharded_state_dict` with the local and TransformerEngine layer specs).

`TorchDistReader` reads one tensor (one layer of a stacked key) at a time through DCP's planner with
only that region requested; `.metadata` is unpickled with an allow-list of DCP's own classes and
common.pt like a `torch`-format file, so nothing in a checkpoint can run code. `write_torch_dist`
writes the chunks a Megatron-LM run of the target tp would (one per layer and TP rank), pulling each
full tensor once when DCP asks for its first chunk.
"""
from __future__ import annotations

import io
import json
import os
import pickle
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from tqdm import tqdm

from megatron_pp.models.config import TransformerConfig
from megatron_pp.models.hf import rotary_interleaved_to_half
from megatron_pp.models.layout import StageSpec
from megatron_pp.training.checkpointing import TRACKER_FILE, CheckpointError, iteration_dir, write_json
from megatron_pp.training.convert.core import (
    CheckpointReader,
    ParameterSpec,
    TargetLayout,
    copy_tokenizer,
    full_tensor,
    layer_of,
    model_parameters,
    padded_shape,
    staged_output,
)
from megatron_pp.training.convert.megatron_lm import (
    CHECKPOINT_VERSION,
    TOKENIZER_DIR,
    config_from_megatron_args,
    load_megatron_lm_file,
    mcore_layer_name,
    megatron_lm_args,
    megatron_lm_directory,
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

# The classes DCP pickles into `.metadata`; anything else (a function, another class) is refused.
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "TensorStorageMetadata",
                                              "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None),
                                                               (torch.dtype, torch.layout, torch.memory_format))):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}")


class _SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader with `.metadata` unpickled through an allow-list of DCP's own classes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = os.path.join(str(self.path), ".metadata")
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing (not a torch_dist checkpoint)") from None
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError) as exc:
            raise CheckpointError(f"{path}: {exc}".replace("\n", " ")) from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path}: not a torch.distributed.checkpoint index")
        # What the base class sets after loading, so the rest of its reading works unchanged.
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _RegionLoadPlanner(LoadPlanner):
    """Reads one region (`offsets`, shape of `destination`) of one key into `destination`, nothing else."""

    def __init__(self, key: str, offsets: tuple[int, ...], destination: torch.Tensor):
        self.key, self.offsets, self.destination = key, offsets, destination

    def set_up_planner(self, state_dict: Any, metadata: Optional[Metadata] = None, is_coordinator: bool = False,
                       ) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        chunk = ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=self.destination.shape)
        return LoadPlan(create_read_items_for_chunk_list(self.key, self.metadata.state_dict_metadata[self.key],
                                                         [chunk]))

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise AssertionError("only tensors are requested")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        region = self.destination
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            region = region.narrow(dim, start, length)
        return region

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor handed out a view of the destination: the data is already in place


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
        self._storage = _SafeFileSystemReader(directory)
        self._index = self._storage.read_metadata().state_dict_metadata
        embedding = self._index.get("embedding.word_embeddings.weight")
        if not isinstance(embedding, TensorStorageMetadata):
            raise CheckpointError(f"{directory}: no embedding.word_embeddings.weight")
        rows = embedding.size[0]
        vocab_size = true_vocab_size or getattr(args, "vocab_size", None) or rows
        if vocab_size > rows:
            raise CheckpointError(f"vocabulary size {vocab_size} is larger than the checkpoint's {rows} embedding rows")
        self.config, self._interleaved = config_from_megatron_args(args, vocab_size)
        self._params = model_parameters(self.config)
        self._check()

    def _check(self) -> None:
        wanted = {sharded_key(name)[0] for name in self._params}
        for key, meta in self._index.items():
            if not key.startswith(("embedding.", "decoder.", "output_layer.")) or isinstance(meta, BytesStorageMetadata):
                continue  # optimizer state, RNG, `_extra_state` objects: not model weights
            tied_head = key == "output_layer.weight" and not self.config.untie_embeddings_and_output_weights
            if key not in wanted and not tied_head:
                raise CheckpointError(f"{self._directory}: {key} is not part of a GPT or LLaMA model megatron_pp knows "
                                      "(unsupported feature: QK norm, MoE, MLA, ...?)")
        for name, param in self._params.items():
            key, layer = sharded_key(name)
            meta = self._index.get(key)
            if not isinstance(meta, TensorStorageMetadata):
                raise CheckpointError(f"{self._directory}: no {key} (for {name})")
            shape = tuple(meta.size[1:]) if layer is not None else tuple(meta.size)
            if layer is not None and meta.size[0] != self.config.num_layers:
                raise CheckpointError(f"{self._directory}: {key} stacks {meta.size[0]} layers, args.num_layers is "
                                      f"{self.config.num_layers}")
            if shape[1:] != param.shape[1:] or (name not in ("embedding.word_embeddings.weight", "output_layer.weight")
                                                and shape != param.shape):
                raise CheckpointError(f"{self._directory}: {key} has shape {list(shape)} per layer, the model its args "
                                      f"describe has {list(param.shape)}")

    def tensor(self, name: str) -> torch.Tensor:
        key, layer = sharded_key(name)
        meta = self._index[key]
        if layer is None:
            offsets, shape = (0,) * len(meta.size), tuple(meta.size)
        else:
            offsets, shape = (layer,) + (0,) * (len(meta.size) - 1), (1, *meta.size[1:])
        destination = torch.empty(shape, dtype=meta.properties.dtype)
        dcp.load({}, storage_reader=self._storage, planner=_RegionLoadPlanner(key, offsets, destination),
                 no_dist=True)
        tensor = destination[0] if layer is not None else destination
        if self._interleaved and ".self_attention.linear_qkv." in name:
            tensor = rotary_interleaved_to_half(tensor, self.config)
        return tensor


# Writing ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Chunk:
    """Where one chunk DCP writes comes from: equal piece `piece` of `pieces` of our parameter `name` along `dim`."""

    name: str
    piece: int
    pieces: int
    dim: int


def _chunks(param: ParameterSpec, tp: int) -> list[tuple[int, int, int]]:
    """(piece, pieces, dim) of each chunk a tp-rank Megatron run saves for a parameter: one per rank's
    shard, and for a strided split (SwiGLU's fc1) one per rank and block, as Megatron-Core's factory
    splits it; the chunks lie in the full tensor in piece order."""
    if not param.partitioned or tp == 1 and param.partition_stride == 1:
        return [(0, 1, 0)]
    pieces = tp * param.partition_stride
    return [(piece, pieces, param.partition_dim) for piece in range(pieces)]


class _StreamingSavePlanner(SavePlanner):
    """Plans the chunks of a whole model and hands DCP each chunk's data when it writes it, reading each
    full tensor from the source once (chunks of one tensor are consecutive in the plan)."""

    def __init__(self, items: list[WriteItem], chunks: dict[MetadataIndex, _Chunk], fetch, bar: tqdm):
        self._items, self._chunks, self._fetch, self._bar = items, chunks, fetch, bar
        self._cached: tuple[Optional[str], Optional[torch.Tensor]] = (None, None)

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        pass

    def create_local_plan(self) -> SavePlan:
        return SavePlan(self._items)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        return create_default_global_save_plan(all_plans, rewrite_index_hints=False)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save(None, buffer)  # an `_extra_state` without FP8 metadata
            buffer.seek(0)
            return buffer
        chunk = self._chunks[write_item.index]
        name, full = self._cached
        if name != chunk.name:
            self._cached = (None, None)  # release the previous tensor before reading the next
            full = self._fetch(chunk.name)
            self._cached = (chunk.name, full)
            self._bar.update()
        size = full.shape[chunk.dim] // chunk.pieces
        # A layer's chunk carries the leading layer axis (of length 1) of its stacked key.
        return full.narrow(chunk.dim, chunk.piece * size, size).contiguous().view(write_item.tensor_data.chunk.sizes)


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
    stages = layout.checked_stages(config)
    saved_dtype = dtype or config.params_dtype
    padded = config.padded_vocab_size(layout.tp)
    params = model_parameters(config)
    items: list[WriteItem] = []
    chunks: dict[MetadataIndex, _Chunk] = {}
    for name, param in params.items():
        key, layer = sharded_key(name)
        shape = padded_shape(name, param, padded)
        global_shape = shape if layer is None else (config.num_layers, *shape)
        for piece, pieces, dim in _chunks(param, layout.tp):
            sizes = list(global_shape)
            offsets = [0] * len(global_shape)
            axis = dim if layer is None else dim + 1
            sizes[axis] //= pieces
            offsets[axis] = piece * sizes[axis]
            if layer is not None:
                sizes[0], offsets[0] = 1, layer
            index = MetadataIndex(key, torch.Size(offsets))
            chunks[index] = _Chunk(name, piece, pieces, dim)
            items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                properties=TensorProperties(dtype=saved_dtype), size=torch.Size(global_shape))))
    for layer in range(config.num_layers):
        for module in _EXTRA_STATE_MODULES:
            key = f"{_LAYER_PREFIX}{module}._extra_state/shard_{layer}_{config.num_layers}"
            items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))

    def fetch(name: str) -> torch.Tensor:
        value = full_tensor(reader, name, padded_shape(name, params[name], padded), config.vocab_size)
        return value.to(saved_dtype)

    with staged_output(save_dir) as staging:
        directory = iteration_dir(staging, reader.iteration)
        os.makedirs(directory)
        tokenizer_model = None
        if tokenizer_dir is not None:
            copy_tokenizer(tokenizer_dir, os.path.join(staging, TOKENIZER_DIR))
            tokenizer_model = os.path.join(os.path.abspath(save_dir), TOKENIZER_DIR)
        args = megatron_lm_args(config, layout, iteration=reader.iteration, consumed_samples=reader.consumed_samples,
                                ckpt_format="torch_dist", transformer_impl=transformer_impl,
                                tokenizer_model=tokenizer_model, dtype=saved_dtype)
        with tqdm(total=len(params), desc="torch_dist", unit="tensor", disable=not progress) as bar:
            # One writer thread keeps DCP's chunk order (it sorts by size only when spreading over threads).
            writer = dcp.FileSystemWriter(directory, single_file_per_rank=True, thread_count=1, sync_files=True)
            dcp.save({}, storage_writer=writer, planner=_StreamingSavePlanner(items, chunks, fetch, bar), no_dist=True)
        torch.save({"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": reader.iteration,
                    "num_floating_point_operations_so_far": 0}, os.path.join(directory, COMMON_FILE))
        write_json(os.path.join(directory, "metadata.json"), MCORE_METADATA)
        with open(os.path.join(staging, TRACKER_FILE), "w") as f:
            f.write(f"{reader.iteration}\n")
    return stages
