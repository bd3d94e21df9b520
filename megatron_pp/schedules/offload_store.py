"""Host parking for PipeOffload: the activation store that moves a stash to host memory and back.

`OffloadStore` is the `ActivationStore` the executor uses when its list has OFFLOAD actions. During the
forward of a stash that the schedule will offload, `pack` wraps every saved tensor in a handle and
records its storage, except parameters and buffers (excluded by the base class) and tiny storages
(≤ `min_numel` elements: not worth a copy). Storages, not tensors, are the unit: a tensor saved by
several ops and every view of it (q/k/v slices of one QKV output, a transpose) are copied once and come
back as views of one reloaded storage, with their offsets and strides. Storages that the rest of the step
still reads stay on the device untouched: the microbatch's batch tensors and the chunk output waiting
to be sent (the executor names them), and any storage another live stash also saved.

A storage leaves the device in one of two ways once its copy to host has completed. By default the
handles drop their references, so the memory is freed as soon as autograd was its only holder (true
of everything a chunk computes and keeps only for backward), and nothing anyone else holds is ever
corrupted; the reload allocates a fresh storage and the handles rebuild their views on it. Storages the
caller declares private (the executor's chunk input, which it keeps only to read `.grad`) are emptied
in place (`resize_(0)`) and refilled in place on reload, since a reference outside autograd would
otherwise keep them alive. Resident bytes count a moved storage as freed: a module that keeps its own
reference to a tensor it saved for backward keeps that memory, uncounted, but never breaks.

Per stash the state machine is SAVING (forward running) → SAVED → OFFLOADING (copy to host issued,
device memory still held) → OFFLOADED (device storage released) → RELOADING (device storage
re-allocated, copy back issued) → RELOADED (copy complete) → released by the backward (B, or BW after
BI). With an engine that keeps a copy's source valid by itself (`frees_on_issue`: CUDA, where the
caching allocator tracks the copy stream's use of the block), the device storages are dropped as soon as
the copy to host is queued, so the memory is back with the allocator while the CPU runs ahead of the
GPU, and the reload's copy is ordered after the copy out. Otherwise device memory is freed only when the
copy to host has completed (`poll`, run before every forward and transfer), and a RELOAD that finds its
offload still in flight cancels it and keeps the device copy. Either way a saved tensor is never handed
to autograd before its reload has completed (`unpack` waits, and refuses a stash still parked).

Copies go through a `CopyEngine`. On CUDA (`CudaCopies`) copies to host and copies back run on two side
streams, so a reload never queues behind offloads issued before it: each copy waits on an event recorded
on the compute stream (the forward's output is ready; the reload buffer, allocated on the compute stream,
is ordered) and on the copy it must follow, and an event recorded after it tells `done()`; `wait()`
makes the compute stream wait for it. Host buffers are pinned, contiguous
(one per stash, storages packed at 512-byte offsets) and kept in `HostBufferPool` power-of-two bins, so
after the first step no host memory is allocated. On CPU (`SyncCopies`) the same state machine runs with
host-to-host copies that complete at once: "device memory" is then the store's resident bytes, which is
what the tests measure.
"""
from __future__ import annotations

import enum
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Iterator, Optional, Protocol, Sequence

import torch

from megatron_pp.core.storage import storage_key
from megatron_pp.schedules.store import ActivationStore, Stash

_ALIGN = 512
"""Byte alignment of each storage inside a stash's host buffer (DMA-friendly, cheap)."""


class StashState(enum.Enum):
    SAVING = "saving"
    SAVED = "saved"
    OFFLOADING = "offloading"
    OFFLOADED = "offloaded"
    RELOADING = "reloading"
    RELOADED = "reloaded"


class CopyTicket(Protocol):
    """A batch of issued copies."""

    def done(self) -> bool:
        """True once every copy of the batch has completed (never blocks)."""

    def wait(self) -> None:
        """Order the compute stream after the copies (on CPU: block until they are done)."""


class CopyEngine(Protocol):
    """Issues batches of copies `dst.copy_(src)` (uint8 tensors of equal size).

    `to_host` tells offloads from reloads (an engine may give them separate queues); `after` is a ticket
    the copies must follow (a reload follows its stash's offload, an offload into a reused host buffer
    follows the reload that last read it). An engine whose `frees_on_issue` is true keeps the source of
    a copy to host valid until the copy has run, whatever its owner does after issuing it (CUDA: the
    caching allocator's stream-use tracking), so the store may drop a stash's device memory at once.
    """

    frees_on_issue: bool

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, to_host: bool,
             after: Optional[CopyTicket] = None) -> CopyTicket:
        ...


class _Done:
    def done(self) -> bool:
        return True

    def wait(self) -> None:
        pass


class SyncCopies:
    """Copies that complete when issued (CPU, and the reference path every test exercises)."""

    frees_on_issue = False  # nothing to gain: the copy is done before the store looks

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, to_host: bool = True,
             after: Optional[CopyTicket] = None) -> CopyTicket:
        for dst, src in pairs:
            dst.copy_(src)
        return _Done()


class _CudaTicket:
    def __init__(self, event: "torch.cuda.Event") -> None:
        self.event = event

    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        # Called from unpack, on the stream the backward runs on.
        torch.cuda.current_stream().wait_event(self.event)


class CudaCopies:
    """Two side streams, one for copies to host and one for copies back, ordered by events.

    Separate streams keep a reload from queueing behind offloads issued before it (device-to-host and
    host-to-device copies use different copy engines and run at once). Each copy to host marks its source
    as used by the offload stream (`record_stream`), so the store can drop the device storage as soon as
    the copy is queued: the caching allocator hands the block out again only after the copy has run.
    """

    frees_on_issue = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.out_stream = torch.cuda.Stream(device=device)
        self.in_stream = torch.cuda.Stream(device=device)

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, to_host: bool,
             after: Optional[CopyTicket] = None) -> CopyTicket:
        stream = self.out_stream if to_host else self.in_stream
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))  # sources written / destinations allocated
        done = torch.cuda.Event()
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            if isinstance(after, _CudaTicket):
                stream.wait_event(after.event)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
                if to_host:
                    src.record_stream(stream)
            done.record(stream)
        return _CudaTicket(done)


class HostBufferPool:
    """Contiguous host buffers in power-of-two bins, reused across stashes and steps (pinned on CUDA).

    A request for n bytes takes a free buffer of the bin ⌈log2 n⌉ or allocates one of exactly 2^⌈log2 n⌉
    bytes (the size the pinned allocator would round to anyway), so equal stashes share one bin and after
    the first step every request is served from the pool.
    """

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self._free: dict[int, list[torch.Tensor]] = {}
        self._fences: dict[int, Optional[CopyTicket]] = {}
        self.allocations = 0
        self.allocated_bytes = 0

    def take(self, nbytes: int) -> torch.Tensor:
        capacity = 1 << max(nbytes - 1, 1).bit_length()
        free = self._free.get(capacity)
        if free:
            return free.pop()
        self.allocations += 1
        self.allocated_bytes += capacity
        return torch.empty(capacity, dtype=torch.uint8, pin_memory=self.pin_memory)

    def give(self, buffer: torch.Tensor, fence: Optional[CopyTicket] = None) -> None:
        """Return `buffer`; `fence` is the last copy that reads it, which the next copy into it must follow."""
        self._fences[storage_key(buffer)] = fence
        self._free.setdefault(buffer.numel(), []).append(buffer)

    def fence(self, buffer: torch.Tensor) -> Optional[CopyTicket]:
        """The copy that last read `buffer` (None for a new buffer)."""
        return self._fences.get(storage_key(buffer))


def _bytes_of(storage: torch.UntypedStorage, device: Optional[torch.device] = None) -> torch.Tensor:
    """A uint8 tensor over a whole storage (what the copies move), on `device` (default the storage's own:
    a fake tensor's storage says `meta` whatever device the tensor is on, so the dry run passes the tensor's)."""
    return torch.empty(0, dtype=torch.uint8, device=device or storage.device).set_(storage)


@dataclass(eq=False)
class _Storage:
    """One saved storage of an offloaded stash and the handles that view it."""

    storage: Optional[torch.UntypedStorage]
    """The device storage while it is resident (None while parked, when it was dropped)."""
    nbytes: int
    handles: list["_Saved"] = field(default_factory=list)
    in_place: bool = False
    """Emptied and refilled in place (private to the caller) instead of dropped and re-allocated."""
    offset: int = 0
    """Where it sits in the stash's host buffer."""
    device: Optional[torch.device] = None
    """The device of the tensors saved in it (not `storage.device`, which is `meta` for fake tensors)."""


@dataclass(eq=False)
class _Record:
    """The offload side of one stash: its saved storages, what was parked, where, and its state."""

    stash: Stash
    state: StashState = StashState.SAVING
    storages: dict[int, _Storage] = field(default_factory=dict)
    """storage_key at save time -> storage, for storages big enough to move."""
    parked: list[_Storage] = field(default_factory=list)
    host: Optional[torch.Tensor] = None
    ticket: Optional[CopyTicket] = None


@dataclass(eq=False)
class _Saved:
    """What autograd holds for a saved tensor of an offloaded stash: the tensor (None while its storage is
    parked and dropped) and how to rebuild it as a view of its storage."""

    record: _Record
    entry: _Storage
    tensor: Optional[torch.Tensor]
    dtype: torch.dtype
    offset: int
    size: torch.Size
    stride: tuple[int, ...]

    def get(self) -> torch.Tensor:
        if self.tensor is None:
            self.tensor = torch.empty(0, dtype=self.dtype, device=self.entry.device).set_(
                self.entry.storage, self.offset, self.size, self.stride)
        return self.tensor


class OffloadStore(ActivationStore):
    """`ActivationStore` that parks planned stashes in host memory between OFFLOAD and RELOAD."""

    def __init__(self, exclude: Iterable[torch.Tensor] = (), *, device: torch.device | str = "cpu",
                 copies: CopyEngine | None = None, min_numel: int = 1024) -> None:
        super().__init__(exclude)
        self.device = torch.device(device)
        on_cuda = self.device.type == "cuda"
        if on_cuda and self.device.index is None:  # storages report their index: compare like with like
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.copies: CopyEngine = copies if copies is not None else (
            CudaCopies(self.device) if on_cuda else SyncCopies())
        self.pool = HostBufferPool(pin_memory=on_cuda)
        self.min_numel = min_numel
        self._planned: set[Hashable] = set()
        self._records: dict[Hashable, _Record] = {}
        self.host_bytes = 0
        self.peak_host_bytes = 0
        self.copied_bytes = 0
        """Bytes moved to host over the store's life (each storage once per offload)."""

    def plan(self, keys: Iterable[Hashable]) -> None:
        """The stashes that will be offloaded (the executor passes its list's OFFLOAD keys): only their
        forwards pay for recording storages."""
        self._planned = set(keys)

    @property
    def resident_count(self) -> int:
        return sum(1 for key in self.live if self.state(key) is not StashState.OFFLOADED)

    def state(self, key: Hashable) -> StashState:
        record = self._records.get(key)
        return StashState.SAVED if record is None else record.state

    # Forward side ---------------------------------------------------------------------------------------
    @contextmanager
    def stash(self, key: Hashable) -> Iterator[Stash]:
        self.poll()  # free what finished copying before this forward allocates
        with super().stash(key) as stash:
            if key in self._planned:
                self._records[key] = _Record(stash)
            yield stash
        if key in self._records:
            self._records[key].state = StashState.SAVED

    def pack(self, t: torch.Tensor, stash):
        packed = super().pack(t, stash)
        record = self._records.get(stash.key)
        if record is None:
            return packed
        storage = t.untyped_storage()
        # On the store's device by the tensor's device, not its storage's: a fake tensor's (the dry run's)
        # storage is on `meta`, so comparing storages would never move a fake stash.
        if (self.is_excluded(t) or storage.nbytes() <= self.min_numel * t.element_size()
                or t.device != self.device):
            return packed
        entry = record.storages.get(storage_key(storage))
        if entry is None:
            entry = record.storages[storage_key(storage)] = _Storage(storage, storage.nbytes(), device=t.device)
        saved = _Saved(record, entry, t, t.dtype, t.storage_offset(), t.size(), t.stride())
        entry.handles.append(saved)
        return saved

    def unpack(self, packed):
        if not isinstance(packed, _Saved):
            return packed
        record = packed.record
        if record.state is StashState.RELOADING:
            record.ticket.wait()
            record.state = StashState.RELOADED
        elif record.state in (StashState.OFFLOADING, StashState.OFFLOADED) and packed.entry in record.parked:
            raise RuntimeError(f"stash {record.stash.key} is read by its backward while parked in host memory "
                               f"({record.state.value}); the schedule needs a RELOAD before the backward")
        return packed.get()

    # Transfers -------------------------------------------------------------------------------------------
    def offload(self, key: Hashable, keep: Iterable[torch.Tensor] = (), private: Iterable[torch.Tensor] = ()) -> None:
        """Start copying stash `key` to host; its device storage is released once the copy completes.

        `keep`: tensors whose storages the step still reads before the backward (left on the device).
        `private`: tensors referenced outside autograd only by the caller, who will not read their data
        until the backward (emptied in place rather than dropped, so the memory really goes)."""
        record = self._record(key, StashState.SAVED, "OFFLOAD")
        offset = self._choose_parked(record, keep, private)
        record.state = StashState.OFFLOADING
        if record.parked:
            record.host = self.pool.take(offset)
            self.host_bytes += record.host.numel()
            self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
            self.copied_bytes += sum(e.nbytes for e in record.parked)
            record.ticket = self.copies.copy([(record.host[e.offset:e.offset + e.nbytes], _bytes_of(e.storage, e.device))
                                              for e in record.parked], to_host=True, after=self.pool.fence(record.host))
        if getattr(self.copies, "frees_on_issue", False):
            self._free_parked(record)  # the engine keeps the sources valid until the copy has run
        self.poll()

    def _choose_parked(self, record: _Record, keep: Iterable[torch.Tensor], private: Iterable[torch.Tensor]) -> int:
        """Fill `record.parked` with the storages that leave the device (see `offload` for `keep` and
        `private`) and their offsets in a packed buffer; return that buffer's size in bytes."""
        kept = {storage_key(t) for t in keep if isinstance(t, torch.Tensor)}
        for other in self.live.values():
            if other is not record.stash:
                kept.update(other.storages)  # shared with another live stash: not ours to move
        private_keys = {storage_key(t) for t in private}
        offset = 0
        for key, entry in record.storages.items():
            if key in kept or entry.nbytes == 0:
                continue
            entry.in_place, entry.offset = key in private_keys, offset
            record.parked.append(entry)
            offset += -(-entry.nbytes // _ALIGN) * _ALIGN
        return offset

    def _allocate_parked(self, record: _Record) -> None:
        """Give every parked storage of `record` device memory again (refilled by the caller's copy)."""
        for entry in record.parked:
            if entry.in_place:
                entry.storage.resize_(entry.nbytes)
            else:
                entry.storage = torch.empty(entry.nbytes, dtype=torch.uint8, device=self.device).untyped_storage()
            record.stash.put(entry.storage)
            self.live_bytes += entry.nbytes

    def poll(self) -> None:
        """Release the device storage of every stash whose copy to host has completed."""
        for record in self._records.values():
            if record.state is StashState.OFFLOADING and (record.ticket is None or record.ticket.done()):
                self._free_parked(record)

    def _free_parked(self, record: _Record) -> None:
        """Drop (or empty in place) the device storages of `record`'s parked entries: OFFLOADED from now."""
        for entry in record.parked:
            record.stash.drop(entry.storage)
            self.live_bytes -= entry.nbytes
            if entry.in_place:
                entry.storage.resize_(0)
            else:
                entry.storage = None
                for handle in entry.handles:
                    handle.tensor = None
        record.state = StashState.OFFLOADED

    def reload(self, key: Hashable) -> None:
        """Bring stash `key` back: allocate its storages on the compute stream and copy the data in."""
        record = self._record(key, None, "RELOAD")
        self.poll()
        if record.state is StashState.OFFLOADING:
            # The copy out is still running, so the device data was never freed: keep it.
            record.state = StashState.RELOADED
            return
        if record.state is not StashState.OFFLOADED:
            raise RuntimeError(f"RELOAD of stash {key}: it is {record.state.value}, not offloaded")
        self._allocate_parked(record)
        record.state = StashState.RELOADING
        if record.parked:
            # After the copy out, which may still be queued when the engine freed on issue.
            record.ticket = self.copies.copy([(_bytes_of(e.storage, e.device), record.host[e.offset:e.offset + e.nbytes])
                                              for e in record.parked], to_host=False, after=record.ticket)
        if record.ticket is None or record.ticket.done():
            record.state = StashState.RELOADED
        self._note_peak()

    def release(self, key: Hashable) -> None:
        record = self._records.pop(key, None)
        if record is not None:
            if record.parked and record.state in (StashState.OFFLOADING, StashState.OFFLOADED):
                raise RuntimeError(f"stash {key} released while parked in host memory (no RELOAD before its "
                                   "backward)")
            if record.state is StashState.RELOADING:
                record.ticket.wait()  # nothing unpacked it (no tensor of it was read): order it anyway
            if record.host is not None:
                # The next copy into this buffer must follow the last one that read it (or wrote it).
                self.pool.give(record.host, fence=record.ticket)
                self.host_bytes -= record.host.numel()
            for entry in record.storages.values():  # break record <-> handle cycles: free the memory now
                entry.storage = None
                entry.handles.clear()
        super().release(key)

    def _record(self, key: Hashable, expected: Optional[StashState], action: str) -> _Record:
        if key not in self.live:
            raise RuntimeError(f"{action} of stash {key}: no such live stash (its forward has not run, or its "
                               "backward already did)")
        record = self._records.get(key)
        if record is None:
            raise RuntimeError(f"{action} of stash {key}: it was not planned for offload (OffloadStore.plan)")
        if expected is not None and record.state is not expected:
            raise RuntimeError(f"{action} of stash {key}: it is {record.state.value}, expected {expected.value}")
        return record
