"""What runtime a schedule needs, read from its action lists (never from its name).

The executor and the trainer assemble a rank's runtime from these facts, so a schedule registered by a
plugin or read from a file gets the same machinery as a built-in one:

| fact in the lists                      | runtime part                                                  |
| -------------------------------------- | ------------------------------------------------------------- |
| OFFLOAD / RELOAD                       | host store (`offload_store.OffloadStore`)                     |
| EVICT / LOAD                           | peer store (`peer_store.PeerStore`, BPipe's evictor)          |
| ACCEPT / RETURN                        | acceptor store (`peer_store.AcceptorStore`, BPipe's partner)  |
| a weight version on any action, STEP   | two weight versions and the deferred optimizer step (2BW)     |
| BI / BW (a split backward)             | the weight-gradient store (`layers.WeightGradStore`): BI      |
|                                        | computes input gradients, BW the held weight GEMMs           |

Torch-free, so the argument checks can ask before anything is built.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megatron_pp.schedules.ir import Action, Op, Schedule


@dataclass(frozen=True)
class RuntimeNeeds:
    host_offload: bool
    peer_parking: bool
    """This schedule parks stashes on peers (some rank evicts or hosts)."""
    weight_versions: bool
    split_backward: bool
    hosting_ranks: tuple[int, ...] = ()
    """The ranks whose lists host a partner's stashes (ACCEPT/RETURN): they need an AcceptorStore."""


def runtime_needs(schedule: Schedule) -> RuntimeNeeds:
    ops = {a.op for acts in schedule.actions for a in acts}
    versioned = any(a.version is not None for acts in schedule.actions for a in acts)
    return RuntimeNeeds(
        host_offload=bool(ops & {Op.OFFLOAD, Op.RELOAD}),
        peer_parking=bool(ops & {Op.EVICT, Op.LOAD, Op.ACCEPT, Op.RETURN}),
        hosting_ranks=tuple(r for r, acts in enumerate(schedule.actions) if any(a.op is Op.ACCEPT for a in acts)),
        weight_versions=versioned or Op.STEP in ops,
        split_backward=bool(ops & {Op.BI, Op.BW}),
    )


def hosting_bound(actions: Sequence[Action]) -> int:
    """Guests an acceptor running `actions` holds at once, at most: the most its list has accepted and not
    yet returned. A stash sent back may still be on its way when the next ACCEPT comes; the store then
    waits at that ACCEPT for the oldest send back to complete (`peer_store.AcceptorStore.accept`), which
    needs only the partner's LOAD, reached before (`bpipe.add_hosting` proves it under blocking
    semantics). E.g. rank 3 of `bpipe` at p = 4, m = 8, K = 2 runs ACCEPT2 ... ACCEPT3 ... RETURN2
    ACCEPT4 ...: 2 (it was 3 with a spare one for the stash on its way, a whole stash above the bound)."""
    held = most = 0
    for a in actions:
        held += {Op.ACCEPT: 1, Op.RETURN: -1}.get(a.op, 0)
        most = max(most, held)
    return most
