"""Single-process access to `torch.distributed.checkpoint` (DCP) directories, for checkpoint conversion.

No process group is involved: DCP runs with `no_dist=True`. `DcpIndex` opens a directory's `.metadata`
through an allow-list of DCP's own classes (the index is a pickle, and a checkpoint from elsewhere must
not run code) and reads any region of any tensor key, only that region's bytes. `write_dcp` writes a
list of tensor chunks and byte objects whose data is pulled from the caller when DCP writes it, in the
order given, so a caller can stream a model without holding it. It lives in `core` because it is the
one place besides communication that touches `torch.distributed`.
"""
from __future__ import annotations

import io
import os
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
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

# The classes DCP pickles into `.metadata`; anything else (a function, another class) is refused.
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "TensorStorageMetadata",
                                              "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "collections": {"OrderedDict"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath"},  # the checkpoint id DCP records
}


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None),
                                                               (torch.dtype, torch.layout, torch.memory_format))):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}")


class _SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader with `.metadata` unpickled through `_IndexUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = os.path.join(str(self.path), ".metadata")
        try:
            with open(path, "rb") as f:
                metadata = _IndexUnpickler(f).load()
        except FileNotFoundError:
            raise ValueError(f"{path}: missing (not a torch.distributed.checkpoint directory)") from None
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError) as exc:
            raise ValueError(f"{path}: {exc}".replace("\n", " ")) from None
        if not isinstance(metadata, Metadata):
            raise ValueError(f"{path}: not a torch.distributed.checkpoint index")
        # What the base class sets after loading, so the rest of its reading works unchanged.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _RegionLoadPlanner(LoadPlanner):
    """Reads one region (`offsets`, shape of `destination`) of one key into `destination`, nothing else."""

    def __init__(self, key: str, offsets: tuple[int, ...], destination: torch.Tensor):
        self.key, self.offsets, self.destination = key, offsets, destination

    def set_up_planner(self, state_dict: Any, metadata: Optional[Metadata] = None,
                       is_coordinator: bool = False) -> None:
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


@dataclass(frozen=True)
class TensorInfo:
    """A tensor key of a DCP index: its global shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


class DcpIndex:
    """The keys of a DCP directory (tensors as `TensorInfo`, byte objects as None) and region reads."""

    def __init__(self, directory: str):
        self._storage = _SafeFileSystemReader(directory)
        entries = self._storage.read_metadata().state_dict_metadata
        self.keys: dict[str, Optional[TensorInfo]] = {
            key: TensorInfo(tuple(meta.size), meta.properties.dtype) if isinstance(meta, TensorStorageMetadata)
            else None for key, meta in entries.items()}

    def read(self, key: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The region of tensor `key` starting at `offsets` with `shape` (only its bytes are read)."""
        destination = torch.empty(shape, dtype=self.keys[key].dtype)
        dcp.load({}, storage_reader=self._storage, planner=_RegionLoadPlanner(key, offsets, destination),
                 no_dist=True)
        return destination


@dataclass(frozen=True)
class ChunkToWrite:
    """A chunk of tensor `key` (global shape `shape`) at `offsets` with `sizes`; `source` tells the fetch
    function which data it is (any hashable the caller chooses)."""

    key: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype
    source: Any


class _StreamingSavePlanner(SavePlanner):
    def __init__(self, items: list[WriteItem], sources: dict[MetadataIndex, Any], objects: dict[str, bytes],
                 fetch: Callable[[Any], torch.Tensor]):
        self._items, self._sources, self._objects, self._fetch = items, sources, objects, fetch

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
            return io.BytesIO(self._objects[write_item.index.fqn])
        return self._fetch(self._sources[write_item.index]).reshape(write_item.tensor_data.chunk.sizes)


def write_dcp(directory: str, chunks: list[ChunkToWrite], objects: dict[str, bytes],
              fetch: Callable[[Any], torch.Tensor]) -> None:
    """Write `chunks` (data from `fetch(chunk.source)`, asked in list order) and byte `objects` as a
    single-file DCP checkpoint in `directory`."""
    items: list[WriteItem] = []
    sources: dict[MetadataIndex, Any] = {}
    for chunk in chunks:
        index = MetadataIndex(chunk.key, torch.Size(chunk.offsets))
        sources[index] = chunk.source
        items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(chunk.offsets), sizes=torch.Size(chunk.sizes)),
            properties=TensorProperties(dtype=chunk.dtype), size=torch.Size(chunk.shape))))
    items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in objects]
    # One writer thread keeps the chunks in list order (DCP sorts them by size only to spread them over threads).
    writer = dcp.FileSystemWriter(directory, single_file_per_rank=True, thread_count=1, sync_files=True)
    dcp.save({}, storage_writer=writer, planner=_StreamingSavePlanner(items, sources, objects, fetch), no_dist=True)
