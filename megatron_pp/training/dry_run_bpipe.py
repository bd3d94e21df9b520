"""BPipe in the dry run: what an acceptor must know ahead, because the fake backend carries no data.

A BPipe acceptor allocates the buffers of its partner's parked stash before the stash is sent, so it must
know the stash's storage sizes; in a real job the partner sends them once per chunk, as a header
(`schedules.peer_store`). In the dry run every rank runs alone on the fake backend, whose receives deliver
no data, so the acceptor learns them the one way that needs no formula: it first dry-runs its partner
(the same job's code, on a fresh fake world, as that rank) until the partner has announced a layout for
every chunk it evicts, and takes the layouts the partner's `PeerStore` announced. The partner's first
evictions come after K + 1 forwards of its first step (K = `--bpipe-max-resident`), so this costs those
forwards and the build, not a whole rank. The acceptor still posts the header's receives (the same calls as
a real job, matched across ranks by `dry_run_agree`), and its buffers are exactly what the partner sends:
a wrong layout would be a send/receive mismatch in the dry run's agreement check.

Worked example: gpt-tiny at pp 4, m 8, `--pipeline-schedule bpipe` (K = 3): rank 3 hosts rank 0's stashes
from microbatch 3 on; its dry run first runs rank 0 up to `EVICT3.0`, learns chunk 0's layout there, then
runs rank 3 with it.

BPipe's bound is about what it moves, a stash's activations; `BatchApart` has a rank's store count the step's
batch tensors (which a stash may save: a learned position embedding keeps its position ids for its backward)
apart, for `tools/bpipe_dry_run.py`. The step holds every microbatch's batch on the device from its start to
its end (the trainer loads the step's microbatches up front, and the global token count reads them all
first), under any schedule, so no schedule can move or free them: the store counts a saved batch tensor in
every live stash that saved it, and a parked stash leaves it home (`PeerStore.evict`'s `keep`).
"""
from __future__ import annotations

import argparse
from typing import Callable, Hashable, Optional

import torch

from megatron_pp.core.parallel_state import RankLayout
from megatron_pp.core.storage import storage_key
from megatron_pp.schedules.ir import Op
from megatron_pp.schedules.peer_store import AcceptorStore, PeerStore, parking_pairs
from megatron_pp.training.arguments import model_config_from_args
from megatron_pp.training.job_schedule import build_job_schedule, num_chunks, virtual_stages_given

Prepare = Callable[[object], None]
"""Called with a rank's `Pipeline` once it is built, before its first step (`dry_run._run`)."""


class _Announced(Exception):
    """Raised out of the partner's dry run once its store has announced every layout the acceptor needs."""

    def __init__(self, layouts: dict[Hashable, list[int]]) -> None:
        super().__init__("layouts announced")
        self.layouts = layouts


def evicting_partner(args: argparse.Namespace, rank: int) -> Optional[int]:
    """The global rank whose stashes global rank `rank` hosts under the job's schedule (same tp and dp
    position, the evicting pipeline rank), or None where `rank` hosts nothing."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    layout = RankLayout(args.dry_run, tp, pp)
    me = layout.coords(rank)
    config = model_config_from_args(args, vocab_size=1)  # the layer count decides the chunks, not the vocabulary
    chunks = num_chunks(args, config) if virtual_stages_given(args) or not args.pipeline_schedule_file else None
    schedule = build_job_schedule(args, layout.dp, chunks)
    for evictor, acceptor in parking_pairs(schedule):
        if acceptor == me.pp:
            return layout.rank(me.tp, me.dp, evictor)
    return None


def stop_once_announced(pipe) -> None:
    """`Prepare` for the partner's dry run: raise `_Announced` with its store's layouts once it has evicted
    the first stash of every chunk it evicts."""
    store = pipe.executor.store
    if not isinstance(store, PeerStore):
        raise RuntimeError(f"BPipe dry run: pipeline rank {pipe.state.pp_rank} was expected to evict, but its "
                           f"store is a {type(store).__name__}")
    chunks = {a.chunk for a in pipe.schedule.actions[pipe.state.pp_rank] if a.op is Op.EVICT}
    evict = store.evict

    def evict_then_check(key, *rest, **kw) -> None:
        evict(key, *rest, **kw)
        layouts = store.announced_layouts
        if chunks <= set(layouts):
            raise _Announced(layouts)
    store.evict = evict_then_check


def acceptor_prepare(args: argparse.Namespace, rank: int,
                     run_partner: Callable[[int, Prepare], object]) -> Optional[Prepare]:
    """Where global rank `rank` hosts a partner's stashes: a `Prepare` giving its `AcceptorStore` the partner's
    stash layouts, learned by `run_partner(partner, stop_once_announced)` (the partner's dry run on a world of
    its own, stopped at its last first-eviction); None elsewhere (nothing is run)."""
    partner = evicting_partner(args, rank)
    if partner is None:
        return None
    try:
        run_partner(partner, stop_once_announced)
    except _Announced as announced:
        layouts = announced.layouts
    else:
        raise RuntimeError(f"BPipe dry run: rank {partner} finished its steps without evicting to rank {rank}")

    def give_layouts(pipe) -> None:
        store = pipe.executor.store
        if not isinstance(store, AcceptorStore):
            raise RuntimeError(f"BPipe dry run: rank {rank} hosts rank {partner}'s stashes, but its store is a "
                               f"{type(store).__name__}")
        store.known_layouts.update(layouts)
    return give_layouts


class BatchApart:
    """`Prepare` that has a rank's activation store leave the step's batch tensors out of its stashes (as it leaves
    out parameters), and notes apart the batch storages that some stash saved (`saved_bytes`, every microbatch's).

    Each chunk-forward is handed its microbatch's batch (`chunk(x, batch)`), so a forward pre-hook excludes those
    tensors before anything is saved; the keys stay valid because the batch lives as long as the run. Compose
    with an acceptor's `Prepare` through `both`."""

    def __init__(self) -> None:
        self.saved: dict[int, int] = {}
        """Storage key -> bytes of each batch storage a stash saved."""

    @property
    def saved_bytes(self) -> int:
        return sum(self.saved.values())

    def __call__(self, pipe) -> None:
        store = pipe.executor.store
        batch: set[int] = set()

        def exclude_batch(module, args) -> None:
            tensors = [t for t in args[1].values() if isinstance(t, torch.Tensor)] if len(args) > 1 else []
            store.exclude(tensors)
            batch.update(storage_key(t) for t in tensors)
        for chunk in pipe.executor.chunks:
            chunk.register_forward_pre_hook(exclude_batch)
        pack = store.pack

        def pack_noting(t: torch.Tensor, stash, pack=pack):
            key = storage_key(t)
            if key in batch:
                self.saved[key] = t.untyped_storage().nbytes()
            return pack(t, stash)
        store.pack = pack_noting  # the store's saved-tensor hooks call `self.pack`


def both(*prepares: Optional[Prepare]) -> Prepare:
    """One `Prepare` running each of `prepares` (None skipped) in order."""
    def run(pipe) -> None:
        for prepare in prepares:
            if prepare is not None:
                prepare(pipe)
    return run
