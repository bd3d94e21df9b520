"""Peer parking for BPipe: the activation stores that ship a stash to the partner rank and back.

A schedule with EVICT/LOAD (the `bpipe` pass) pairs an evicting rank x with an acceptor y. The evictor
runs a `PeerStore`: it records the stashes it will evict exactly as `OffloadStore` does (every tensor
saved for backward, one entry per storage so views come back as views of their base, parameters and
buffers never included, the batch tensors and an output still to be sent left in place) but ships the
storages to y instead of host memory: `EVICT` posts the sends, and the storages are released only once
the sends have completed; `LOAD` allocates the storages again (resident from that moment) and posts the
receives; the backward's first read of a saved tensor waits for them. Before a forward allocates, the
evictor completes the evictions still in flight, so it never holds its bound plus two stashes (the
simulator models the same wait).

The acceptor runs an `AcceptorStore`: its own stashes stay where they are, and a service thread handles
the partner's transfers in the partner's list order, which is the order in which the evictor posts them:
for an EVICT it receives the stash's storage sizes, allocates the buffers (resident from that moment) and
receives into them; for a LOAD it sends the buffers back and frees them once the sends have completed.
Its list has no actions for this, so no compute waits for parking and no ordering between the two
lists can deadlock: every blocking call of the thread matches an operation the evictor has already
posted or posts without waiting for the acceptor. The thread starts with the step (`begin_step`) and
the step ends only when it has served every transfer (`end_step`).

Transfers go over process groups of the two ranks alone (`ParallelState.pair_groups`, created once per world and
layout), never the pipeline group, so they do not queue behind neighbour sends on NCCL and cannot be
matched against them on gloo; evictions and loads take one group each, so that on NCCL (one stream per
communicator) a stash going out and one coming back share the full-duplex link instead of queueing.
Each eviction is a header (storage count, then sizes) followed by one message per storage, sent from
the storage's own memory (no packing copy on the memory-starved rank).
The same code runs on CPU with gloo, where sends and receives complete asynchronously in gloo's own
threads, and on CUDA with NCCL, where the acceptor thread works on its own stream (not exercised
without a GPU).
"""
from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Iterator, Optional, Sequence

import torch

from megatron_pp.core.comm import ProcessGroup
from megatron_pp.core.p2p import post_batch
from megatron_pp.schedules.ir import Action, Op, Schedule
from megatron_pp.schedules.offload_store import OffloadStore, StashState, SyncCopies, _bytes_of
from megatron_pp.schedules.store import ActivationStore, Stash


def parking_pairs(schedule: Schedule) -> list[tuple[int, int]]:
    """(evictor, acceptor) pipeline ranks of every EVICT in `schedule`, sorted."""
    return sorted({(rank, a.peer) for rank, acts in enumerate(schedule.actions) for a in acts if a.op is Op.EVICT})


def hosted_transfers(schedule: Schedule, rank: int) -> list[Action]:
    """The EVICT/LOAD actions that park stashes on `rank`, in the order its (single) evictor posts them."""
    return [a for acts in schedule.actions for a in acts if a.op in (Op.EVICT, Op.LOAD) and a.peer == rank]


@dataclass
class Transfers:
    """Posted point-to-point operations and the tensors they read or fill (kept alive until done)."""

    works: list
    tensors: list[torch.Tensor] = field(default_factory=list)

    def done(self) -> bool:
        """True once every operation has completed (never blocks)."""
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        """Order the current stream after the operations (gloo: block until they are done)."""
        for work in self.works:
            work.wait()

    def finish(self) -> None:
        """Block until every operation has completed: after this their memory may be reused at once."""
        self.wait()
        while not self.done():  # NCCL's wait only orders the stream; the host needs completion
            time.sleep(1e-5)


@dataclass
class PeerLink:
    """Stash transfers between this rank and its partner over their own two-rank process groups."""

    groups: tuple[Optional[ProcessGroup], Optional[ProcessGroup]]
    """(evictions: evictor -> acceptor, loads: acceptor -> evictor), from `ParallelState.pair_groups`."""
    peer: int
    """Global rank of the partner."""
    device: torch.device

    def _post(self, sending: bool, tensors: Sequence[torch.Tensor], loads: bool) -> Transfers:
        if not tensors:
            return Transfers([])
        group = self.groups[1 if loads else 0]
        pairs = [(t, self.peer) for t in tensors]
        works = post_batch(pairs, [], group) if sending else post_batch([], pairs, group)
        return Transfers(list(works), list(tensors))

    def send_stash(self, storages: Sequence[torch.Tensor]) -> Transfers:
        """Evictor: post a header (storage count, then sizes) and the storages (uint8 views) themselves."""
        count = torch.tensor([len(storages)], dtype=torch.int64, device=self.device)
        sizes = [torch.tensor([t.numel() for t in storages], dtype=torch.int64, device=self.device)] if storages else []
        header = self._post(True, [count, *sizes], loads=False)
        body = self._post(True, storages, loads=False)
        return Transfers(header.works + body.works, header.tensors + body.tensors)

    def receive_sizes(self) -> list[int]:
        """Acceptor: block until the next stash's header is in; return its storage sizes in bytes."""
        count = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._post(False, [count], loads=False).finish()
        if int(count.item()) == 0:
            return []
        sizes = torch.zeros(int(count.item()), dtype=torch.int64, device=self.device)
        self._post(False, [sizes], loads=False).finish()
        return [int(n) for n in sizes.tolist()]

    def receive_stash(self, storages: Sequence[torch.Tensor]) -> Transfers:
        """Acceptor: post the receives of an evicted stash's storages (after `receive_sizes`)."""
        return self._post(False, storages, loads=False)

    def send_back(self, storages: Sequence[torch.Tensor]) -> Transfers:
        """Acceptor: post the sends of a hosted stash back to its owner."""
        return self._post(True, storages, loads=True)

    def receive_back(self, storages: Sequence[torch.Tensor]) -> Transfers:
        """Evictor: post the receives of a loaded stash into its re-allocated storages."""
        return self._post(False, storages, loads=True)


class PeerStore(OffloadStore):
    """The evictor's store: planned stashes are parked on the partner between EVICT and LOAD."""

    def __init__(self, exclude: Iterable[torch.Tensor] = (), *, link: PeerLink, min_numel: int = 1024) -> None:
        # No host copies: the host-offload machinery is reused only for recording and rebuilding storages.
        super().__init__(exclude, device=link.device, copies=SyncCopies(), min_numel=min_numel)
        self.link = link

    @contextmanager
    def stash(self, key: Hashable) -> Iterator[Stash]:
        # The room this forward needs is the room the last eviction frees: finish it first (the bound).
        for record in self._records.values():
            if record.state is StashState.OFFLOADING and record.ticket is not None:
                record.ticket.finish()
        with super().stash(key) as stash:
            yield stash

    def evict(self, key: Hashable, keep: Iterable[torch.Tensor] = (), private: Iterable[torch.Tensor] = ()) -> None:
        """Start sending stash `key` to the partner; its storages are released once the sends completed.
        `keep` and `private` as for `OffloadStore.offload`."""
        record = self._record(key, StashState.SAVED, "EVICT")
        self._choose_parked(record, keep, private)
        record.state = StashState.OFFLOADING
        # Always send the header, even for an empty stash: the acceptor expects one per EVICT.
        record.ticket = self.link.send_stash([_bytes_of(e.storage) for e in record.parked])
        self.copied_bytes += sum(e.nbytes for e in record.parked)
        self.poll()

    def load(self, key: Hashable) -> None:
        """Bring stash `key` back: allocate its storages (resident from now) and post the receives."""
        record = self._record(key, None, "LOAD")
        if record.state is StashState.OFFLOADING:
            # A send cannot be recalled (the partner will send the stash back in its turn): let it finish.
            record.ticket.finish()
        self.poll()
        if record.state is not StashState.OFFLOADED:
            raise RuntimeError(f"LOAD of stash {key}: it is {record.state.value}, not parked on the partner")
        self._allocate_parked(record)
        record.state = StashState.RELOADING
        record.ticket = self.link.receive_back([_bytes_of(e.storage) for e in record.parked])
        self._note_peak()


class AcceptorStore(ActivationStore):
    """The acceptor's store: its own stashes stay; a service thread hosts the partner's parked stashes.

    Resident counts and bytes include the hosted stashes from the allocation of their buffers until
    their sends back have completed. Counters change on both threads, so every update of them holds one
    lock; the service thread reads the own-stash count from `_own`, which the main thread keeps, and never
    touches the `live` dictionary the main thread mutates.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = (), *, link: PeerLink, transfers: Sequence[Action]) -> None:
        super().__init__(exclude)
        bad = [a for a in transfers if a.op not in (Op.EVICT, Op.LOAD)]
        if bad:
            raise ValueError(f"AcceptorStore serves EVICT and LOAD actions only, got {bad[0]}")
        self.link = link
        self.transfers = list(transfers)
        self._lock = threading.RLock()
        self._guests: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.guest_bytes = 0
        self.peak_guests = 0
        self._own = 0
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._stream = torch.cuda.Stream(link.device) if link.device.type == "cuda" else None

    @property
    def resident_count(self) -> int:
        return len(self.live) + len(self._guests)

    # The service thread ----------------------------------------------------------------------------------
    def begin_step(self) -> None:
        if self._thread is not None:
            raise RuntimeError("AcceptorStore: the previous step's parking service is still running (that step "
                               "failed part way); rebuild the pipeline")
        if self.transfers:
            self._error = None
            self._thread = threading.Thread(target=self._serve, name="bpipe-acceptor", daemon=True)
            self._thread.start()

    def end_step(self) -> None:
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        if self._error is not None:
            raise RuntimeError(f"BPipe acceptor: serving the partner's transfers failed: {self._error!r}") \
                from self._error
        if self._guests:
            raise RuntimeError(f"BPipe acceptor: step ended hosting stashes {sorted(self._guests)}")

    def _serve(self) -> None:
        try:
            if self._stream is not None:
                torch.cuda.set_device(self.link.device)  # the current device is per thread
                with torch.cuda.stream(self._stream):
                    self._serve_all()
            else:
                self._serve_all()
        except BaseException as err:  # handed to the main thread by end_step
            self._error = err

    def _serve_all(self) -> None:
        for action in self.transfers:
            key = (action.microbatch, action.chunk)
            if action.op is Op.EVICT:
                sizes = self.link.receive_sizes()
                buffers = [torch.empty(n, dtype=torch.uint8, device=self.link.device) for n in sizes]
                self._count_guest(key, buffers)
                self.link.receive_stash(buffers).finish()
            else:
                buffers = self._guests[key]
                self.link.send_back(buffers).finish()
                self._drop_guest(key)

    def _count_guest(self, key: tuple[int, int], buffers: list[torch.Tensor]) -> None:
        with self._lock:
            self._guests[key] = buffers
            self.guest_bytes += sum(b.numel() for b in buffers)
            self.peak_guests = max(self.peak_guests, len(self._guests))
            self._note_peak()

    def _drop_guest(self, key: tuple[int, int]) -> None:
        with self._lock:
            buffers = self._guests.pop(key)
            self.guest_bytes -= sum(b.numel() for b in buffers)

    # Counters shared with the service thread ------------------------------------------------------------
    @contextmanager
    def stash(self, key: Hashable) -> Iterator[Stash]:
        with super().stash(key) as stash:
            with self._lock:
                self._own = len(self.live)
            yield stash

    def pack(self, t: torch.Tensor):
        with self._lock:
            packed = super().pack(t)
            self.peak_bytes = max(self.peak_bytes, self.live_bytes + self.guest_bytes)
        return packed

    def release(self, key: Hashable) -> None:
        with self._lock:
            super().release(key)
            self._own = len(self.live)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_bytes = self.live_bytes + self.guest_bytes
            self.peak_count = self._own + len(self._guests)
            self.peak_guests = len(self._guests)

    def _note_peak(self) -> None:
        with self._lock:
            self.peak_bytes = max(self.peak_bytes, self.live_bytes + self.guest_bytes)
            self.peak_count = max(self.peak_count, self._own + len(self._guests))


def check_acceptor_thread_is_safe(device: torch.device, environ: Optional[dict] = None) -> None:
    """Refuse peer parking where the acceptor's service thread can hang the GPU (docs/gpu.md).

    The thread issues its transfers on the pair's communicators in an order set by thread timing, beside
    the main thread's pipeline transfers. With `CUDA_DEVICE_MAX_CONNECTIONS=1` (set by many Megatron-style
    launch scripts for tensor-parallel overlap) every stream feeds one hardware queue, so a parked stash's
    receive queued before a pipeline transfer that waits on the evicting rank stalls the whole device:
    a cycle, and the job hangs."""
    env = os.environ if environ is None else environ
    if device.type == "cuda" and env.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        raise ValueError("BPipe peer parking (EVICT/LOAD in the schedule) cannot run with "
                         "CUDA_DEVICE_MAX_CONNECTIONS=1: the partner's service thread could queue a transfer ahead "
                         "of the pipeline's and hang the GPU; unset it for BPipe runs")


def peer_store_for(schedule: Schedule, state) -> Optional[ActivationStore]:
    """The store this rank needs to run `schedule`: a `PeerStore` where it evicts, an `AcceptorStore`
    where it hosts, None otherwise (the executor's default store). `state` is the rank's
    `ParallelState`. Collective when the schedule parks stashes: every rank must call it."""
    pairs = parking_pairs(schedule)
    if not pairs:
        return None
    check_acceptor_thread_is_safe(state.device)
    groups = state.pair_groups(pairs)
    me = state.pp_rank
    for x, y in pairs:
        if me in (x, y):
            other = y if me == x else x
            link = PeerLink(groups[other], state.pp_global_rank(other), state.device)
            if me == x:
                return PeerStore(link=link)
            return AcceptorStore(link=link, transfers=hosted_transfers(schedule, me))
    return None


def prepare_store(store: ActivationStore, schedule: Schedule, rank: int) -> None:
    """Check that `store` can play `rank`'s part in the peer parking of `schedule` and tell a `PeerStore`
    which stashes it will evict. Raises ValueError naming the store it needs."""
    evicted = {(a.microbatch, a.chunk) for a in schedule.actions[rank] if a.op is Op.EVICT}
    hosted = hosted_transfers(schedule, rank)
    if evicted:
        if not isinstance(store, PeerStore):
            raise ValueError(f"--pipeline-schedule {schedule.name}: rank {rank} parks stashes on a peer (BPipe), which "
                             f"needs a PeerStore (build_pipeline makes one), got {type(store).__name__}")
        store.plan(evicted)
    if hosted and not (isinstance(store, AcceptorStore) and store.transfers == hosted):
        raise ValueError(f"--pipeline-schedule {schedule.name}: rank {rank} hosts stashes of rank "
                         f"{next(r for r, acts in enumerate(schedule.actions) if hosted[0] in acts)} (BPipe), which "
                         f"needs an AcceptorStore serving those transfers (build_pipeline makes one), got "
                         f"{type(store).__name__}")
