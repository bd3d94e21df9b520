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

The acceptor runs an `AcceptorStore`: its own stashes stay where they are, and its list's hosting
actions serve the partner, from the main thread in list order: `ACCEPT` allocates the stash's buffers
(resident from that moment) and posts their receives, `RETURN` posts the sends back and the buffers are
freed once they have completed. Neither waits for the partner, with three exceptions that the lists
make safe: an ACCEPT that would hold more guests than `hosting_bound` of its list (the most the list
has accepted and not yet returned) first waits for the oldest sends back, so memory stays within the
list's count whatever the partner's pace (the sends need only the partner's LOAD, which a list that is
deadlock-free under blocking semantics reaches before this ACCEPT; the simulator models the wait, and
with the lists' planned timing it does not happen), a RETURN on
gloo waits for its stash's receive to have completed (on CUDA it only orders the stream), and the
first ACCEPT of each chunk waits for the stash's layout (below). Where these operations sit among the
acceptor's pipeline transfers is fixed by its list (`bpipe.add_hosting` places them; `validate` proves
the order deadlock-free even where every operation blocks until its peer joins), so every run issues
them in the same order on both ranks, which NCCL asks of operations on different communicators.

Transfers go over process groups of the two ranks alone (`ParallelState.pair_groups`, created once per world and
layout), never the pipeline group, so they do not queue behind neighbour sends on NCCL and cannot be
matched against them on gloo; evictions and loads take one group each, so that on NCCL (one stream per
communicator) a stash going out and one coming back share the full-duplex link instead of queueing.
A stash goes as one message per storage, sent from the storage's own memory (no packing copy on the
memory-starved rank). The acceptor allocates the receive buffers before the stash is sent, so it must
know the storage sizes ahead: a chunk's stash has the same storages for every microbatch (the shapes
are fixed by sequence length, micro-batch size and the layer), so the first eviction of each chunk in
the stores' lifetime is preceded by a header (storage count, then sizes) that the acceptor's first
ACCEPT of that chunk waits for, and every later one sends the storages alone into buffers of the
known sizes. The evictor checks each stash against the layout it announced and stops with an error
naming both, rather than send a stash the partner's buffers do not fit.
The dry run (`training.dry_run`, torch's `fake` backend) moves no data: there every transfer is complete
once posted (its works are waited for at once: such works never report completion by themselves, and the
explicit wait is what retires them, as `core.p2p.PipelineComm` does for the pipeline's sends), and an
acceptor is given its partner's layouts ahead (`AcceptorStore.known_layouts`, learned by a dry run of the
partner up to its first evictions), still posting the header's receives so that both ends make the same
calls, but reading no data. On every other backend neither applies: the same messages, the same waits.
The same code runs on CPU with gloo, where sends and receives complete asynchronously in gloo's own
threads, and on CUDA with NCCL, where each pair group's operations run on that communicator's stream,
ordered after the current stream at posting.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Iterator, Optional, Sequence

import torch

from megatron_pp.core.comm import ProcessGroup
from megatron_pp.core.p2p import completes_at_once, post_batch
from megatron_pp.schedules.ir import Op, Schedule
from megatron_pp.schedules.offload_store import OffloadStore, StashState, SyncCopies, _bytes_of
from megatron_pp.schedules.runtime import hosting_bound
from megatron_pp.schedules.store import ActivationStore, Stash


def parking_pairs(schedule: Schedule) -> list[tuple[int, int]]:
    """(evictor, acceptor) pipeline ranks of every EVICT in `schedule`, sorted."""
    return sorted({(rank, a.peer) for rank, acts in enumerate(schedule.actions) for a in acts if a.op is Op.EVICT})


@dataclass
class Transfers:
    """Posted point-to-point operations and the tensors they read or fill (kept alive until done)."""

    works: list
    tensors: list[torch.Tensor] = field(default_factory=list)
    waited: bool = False
    """Waited for on a backend whose operations complete when posted (the dry run's `fake`): done, whatever
    `Work.is_completed()` says (such works never say so)."""

    def done(self) -> bool:
        """True once every operation has completed (never blocks)."""
        return self.waited or all(w.is_completed() for w in self.works)

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
    at_once: bool = field(init=False)
    """Operations complete when posted (torch's `fake` backend: the dry run); decided once, from the groups."""

    def __post_init__(self) -> None:
        self.at_once = completes_at_once(self.groups[0])

    def _post(self, sending: bool, tensors: Sequence[torch.Tensor], loads: bool) -> Transfers:
        if not tensors:
            return Transfers([])
        group = self.groups[1 if loads else 0]
        pairs = [(t, self.peer) for t in tensors]
        works = post_batch(pairs, [], group) if sending else post_batch([], pairs, group)
        done = Transfers(list(works), list(tensors))
        if self.at_once:  # nothing moves: the explicit wait is what retires the operations
            done.wait()
            done.waited = True
        return done

    def send_stash(self, storages: Sequence[torch.Tensor], announce: bool) -> Transfers:
        """Evictor: post the storages (uint8 views), after a header (storage count, then sizes) when
        `announce` (the first eviction of a chunk)."""
        head = Transfers([])
        if announce:
            count = torch.tensor([len(storages)], dtype=torch.int64, device=self.device)
            sizes = [torch.tensor([t.numel() for t in storages], dtype=torch.int64, device=self.device)] \
                if storages else []
            head = self._post(True, [count, *sizes], loads=False)
        body = self._post(True, storages, loads=False)
        return Transfers(head.works + body.works, head.tensors + body.tensors, waited=self.at_once)

    def receive_sizes(self, known: Optional[Sequence[int]] = None) -> list[int]:
        """Acceptor: block until a chunk's header is in; return its storage sizes in bytes. `known`: the sizes,
        where the wire carries no data (the dry run): the header's receives are posted all the same (so both
        ends make the same calls) and their data is not read."""
        if self.at_once and known is None:
            raise RuntimeError("BPipe acceptor: this backend carries no data, so the partner's stash layout "
                               "must be known ahead (AcceptorStore.known_layouts; the dry run sets it)")
        count = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._post(False, [count], loads=False).finish()
        n = len(known) if known is not None else int(count.item())
        if n == 0:
            return []
        sizes = torch.zeros(n, dtype=torch.int64, device=self.device)
        self._post(False, [sizes], loads=False).finish()
        return list(known) if known is not None else [int(x) for x in sizes.tolist()]

    def receive_stash(self, storages: Sequence[torch.Tensor]) -> Transfers:
        """Acceptor: post the receives of an evicted stash's storages into buffers of its chunk's sizes."""
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
        self._layouts: dict[Hashable, list[int]] = {}  # chunk -> storage sizes announced to the partner

    @property
    def announced_layouts(self) -> dict[Hashable, list[int]]:
        """Chunk -> the storage sizes announced to the partner so far (the dry run hands them to the acceptor)."""
        return {chunk: list(sizes) for chunk, sizes in self._layouts.items()}

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
        storages = [_bytes_of(e.storage, e.device) for e in record.parked]  # a fake storage says `meta`
        sizes = [t.numel() for t in storages]
        chunk = key[1] if isinstance(key, tuple) else None
        announced = self._layouts.setdefault(chunk, sizes)
        if announced is not sizes and announced != sizes:
            raise RuntimeError(f"BPipe: stash {key} has storages of {sizes} bytes, but this chunk's first evicted "
                               f"stash announced {announced} and the partner's buffers have those sizes; a chunk "
                               "must save the same tensors for every microbatch")
        record.state = StashState.OFFLOADING
        record.ticket = self.link.send_stash(storages, announce=announced is sizes)
        self.copied_bytes += sum(e.nbytes for e in record.parked)
        self.poll()

    def _free_parked(self, record) -> None:
        """The sends have completed: drop the storages, and the transfer with them. The works and the byte
        views they were posted with reference the storages too, so a ticket kept until the LOAD would keep
        the parked stash's memory on this rank while the partner holds a copy (as it did: the store counted it
        gone, the device still held it)."""
        super()._free_parked(record)
        record.ticket = None

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
        record.ticket = self.link.receive_back([_bytes_of(e.storage, e.device) for e in record.parked])
        self._note_peak()


class AcceptorStore(ActivationStore):
    """The acceptor's store: its own stashes stay; ACCEPT/RETURN host the partner's parked stashes.

    Resident counts and bytes include the hosted stashes from their ACCEPT (the buffers' allocation)
    until the sends of their RETURN are seen completed.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = (), *, link: PeerLink) -> None:
        super().__init__(exclude)
        self.link = link
        self._layouts: dict[Hashable, list[int]] = {}  # the partner's chunk -> its stash's storage sizes
        self.known_layouts: dict[Hashable, list[int]] = {}
        """The partner's chunk -> its stash's storage sizes, known ahead where the wire carries no data (the dry
        run sets them); empty: read from the header the partner sends."""
        self._guests: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._incoming: dict[tuple[int, int], Transfers] = {}
        self._outgoing: list[tuple[tuple[int, int], Transfers]] = []
        self.guest_bytes = 0
        self.peak_guests = 0
        self.max_guests = 1 << 30
        """Guests held at once, at most; `prepare_store` sets `hosting_bound` of the rank's list."""

    @property
    def resident_count(self) -> int:
        return len(self.live) + len(self._guests)

    def accept(self, key: tuple[int, int]) -> None:
        """ACCEPT: allocate the buffers of the partner's stash `key` and post their receives."""
        if key in self._guests:
            raise RuntimeError(f"BPipe acceptor: stash {key} of the partner is already hosted here")
        while self._outgoing and len(self._guests) >= self.max_guests:  # a slow partner: wait for room
            key_back, sends = self._outgoing.pop(0)
            sends.finish()
            self._drop(key_back)
        if key[1] not in self._layouts:  # the first of this chunk: the evictor announces its sizes
            self._layouts[key[1]] = self.link.receive_sizes(self.known_layouts.get(key[1]))
        buffers = [torch.empty(n, dtype=torch.uint8, device=self.link.device) for n in self._layouts[key[1]]]
        self._guests[key] = buffers
        self.guest_bytes += sum(b.numel() for b in buffers)
        self.peak_guests = max(self.peak_guests, len(self._guests))
        self._note_peak()
        self._incoming[key] = self.link.receive_stash(buffers)

    def give_back(self, key: tuple[int, int]) -> None:
        """RETURN: post the sends of hosted stash `key` back to the partner (its buffers go once sent)."""
        if key not in self._incoming:
            raise RuntimeError(f"BPipe acceptor: RETURN of stash {key}, which was not accepted here")
        self._incoming.pop(key).wait()  # gloo: the data is in; NCCL: the send is ordered after the receive
        self._outgoing.append((key, self.link.send_back(self._guests[key])))
        self.poll()

    def poll(self) -> None:
        """Free the buffers of hosted stashes whose sends back have completed (never blocks)."""
        while self._outgoing and self._outgoing[0][1].done():
            self._drop(self._outgoing.pop(0)[0])

    def _drop(self, key: tuple[int, int]) -> None:
        self.guest_bytes -= sum(b.numel() for b in self._guests.pop(key))

    @contextmanager
    def stash(self, key: Hashable) -> Iterator[Stash]:
        self.poll()  # what has gone back frees its room before this forward allocates
        with super().stash(key) as stash:
            yield stash

    def end_step(self) -> None:
        for key, sends in self._outgoing:
            sends.finish()
            self._drop(key)
        self._outgoing = []
        if self._guests:
            raise RuntimeError(f"BPipe acceptor: step ended hosting stashes {sorted(self._guests)} of the partner")

    def pack(self, t: torch.Tensor, stash):
        self.poll()  # a peak is counted against what is really still held
        packed = super().pack(t, stash)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes + self.guest_bytes)
        return packed

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes + self.guest_bytes
        self.peak_count = self.resident_count
        self.peak_guests = len(self._guests)

    def _note_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.live_bytes + self.guest_bytes)
        self.peak_count = max(self.peak_count, self.resident_count)


def peer_store_for(schedule: Schedule, state) -> Optional[ActivationStore]:
    """The store this rank needs to run `schedule`: a `PeerStore` where it evicts, an `AcceptorStore`
    where it hosts, None otherwise (the executor's default store). `state` is the rank's
    `ParallelState`. Collective when the schedule parks stashes: every rank must call it."""
    pairs = parking_pairs(schedule)
    if not pairs:
        return None
    groups = state.pair_groups(pairs)
    me = state.pp_rank
    for x, y in pairs:
        if me in (x, y):
            other = y if me == x else x
            link = PeerLink(groups[other], state.pp_global_rank(other), state.device)
            return PeerStore(link=link) if me == x else AcceptorStore(link=link)
    return None


def prepare_store(store: ActivationStore, schedule: Schedule, rank: int) -> None:
    """Check that `store` can play `rank`'s part in the peer parking of `schedule` and tell a `PeerStore`
    which stashes it will evict. Raises ValueError naming the store it needs."""
    evicted = {(a.microbatch, a.chunk) for a in schedule.actions[rank] if a.op is Op.EVICT}
    hosted = [a for a in schedule.actions[rank] if a.op is Op.ACCEPT]
    if evicted:
        if not isinstance(store, PeerStore):
            raise ValueError(f"--pipeline-schedule {schedule.name}: rank {rank} parks stashes on a peer (BPipe), which "
                             f"needs a PeerStore (build_pipeline makes one), got {type(store).__name__}")
        store.plan(evicted)
    if hosted and not isinstance(store, AcceptorStore):
        raise ValueError(f"--pipeline-schedule {schedule.name}: rank {rank} hosts stashes of rank {hosted[0].peer} "
                         f"(BPipe), which needs an AcceptorStore (build_pipeline makes one), got "
                         f"{type(store).__name__}")
    if hosted:
        store.max_guests = hosting_bound(schedule.actions[rank])

