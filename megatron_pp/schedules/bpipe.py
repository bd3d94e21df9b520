"""The BPipe pass (Kim et al., ICML 2023): balance 1F1B's stash memory by parking stashes on the partner rank.

Under 1F1B with flush rank s holds up to p − s stashes: p on rank 0, one on the last rank. BPipe pairs
rank x with rank y = p − 1 − x (together they hold p + 1 at their peaks) and keeps at most
K = ⌈(p + 2)/2⌉ stashes resident on a rank between its actions (`--bpipe-max-resident` changes K).
The pairing and the bound are the paper's; which stash moves and when are ours, since the authors' code
is not public (docs/schedules.md, "Formulas and their sources").
`add_bpipe` rewrites each evicting rank's compute list by counting, without timing:

- after a forward that takes the rank above K, `EVICT j>y` ships the stash just made (the newest: 1F1B
  runs backwards oldest first, so it is needed last) to the partner;
- after every backward that leaves the rank below K with stashes parked, `LOAD i<y` brings back the
  oldest parked one. The resident set is then always the K oldest outstanding stashes, so a loaded
  stash's backward comes K − 1 backwards later and the copy hides behind that much compute.

In the steady state an evicting rank sends one stash and fetches one per 1F1B step. Only ranks with
p − x > K evict (x ≤ p/2 − 2 for even p); the middle rank of an odd p has no partner. Forward and
backward order, and so the bubble and the numerics, are those of 1F1B.

The partner's list gets the other side of each transfer when communication is inserted
(`add_hosting`, a pass this module registers to run at the end of `insert_communication`): `ACCEPTj.c<x` posts the receive of x's stash (j, c) into
new buffers, `RETURNj.c>x` sends it back, in the evictor's order. Both are posted without waiting and
cost the partner's compute nothing; their place in the list is what orders them against the partner's
pipeline transfers, identically on every run. An ACCEPT allocates the stash's buffers, so it goes as late
as its transfer allows: right after the partner's last compute that, simulated with a partner that is
always ready, ends no later than the latest start that moves nothing on the evictor (its copy over by
the evictor's next forward and by its stash's LOAD), and before the receive of the partner's own forward
of that microbatch (which the evictor sends only after its EVICT). A RETURN goes after the last compute
that ends no later than its LOAD starts. Either moves only where a replay of all lists with every
operation blocking until its peer joins would get stuck (each side waiting for the other).
In the p = 4 example below, rank 3's list becomes

    F0.0 B0.0 F1.0 B1.0 F2.0 ACCEPT3.0<0 B2.0 RETURN3.0>0 F3.0 ACCEPT4.0<0 B3.0 RETURN4.0>0 F4.0 ...

Counting as the simulator and the executor do (a stash is resident from the start of its forward until
its eviction has completed, a parked stash counts on the partner from its ACCEPT until its LOAD has
delivered it, and a loaded one counts again from the start of its LOAD), an evicting rank peaks at K + 1:
the forward that exceeds the bound holds its new stash before it can leave. The executor finishes
pending evictions before the next forward allocates, so it never holds K + 2. The partner holds its own
≤ x + 1 stashes and at most `runtime.hosting_bound` guests, the most its list has accepted and not
returned (≤ p − x − K, the most parked at once); its store waits at an ACCEPT for a returned guest to
have left rather than hold one more, which the built-in lists for p ≤ 9 never need on the simulated
timeline under the default costs (tested); with slower transfers it can (docs/bpipe.md, "The bound, measured").

Worked example, p = 4, m = 8, K = 3 (`format_table(per_row=10)` with transfers shown). Rank 0's 1F1B
peak is 4, so from F3 on each forward's stash goes to rank 3 and comes back after the next backward;
ranks 1–3 hold at most 3 and evict nothing:

    rank 0 | F0.0       F1.0       F2.0       F3.0       EVICT3.0>3 B0.0       LOAD3.0<3  F4.0       EVICT4.0>3 B1.0
    rank 1 | F0.0       F1.0       F2.0       B0.0       F3.0       B1.0       F4.0       B2.0       F5.0       B3.0
    rank 2 | F0.0       F1.0       B0.0       F2.0       B1.0       F3.0       B2.0       F4.0       B3.0       F5.0
    rank 3 | F0.0       B0.0       F1.0       B1.0       F2.0       B2.0       F3.0       B3.0       F4.0       B4.0

    rank 0 | LOAD4.0<3  F5.0       EVICT5.0>3 B2.0       LOAD5.0<3  F6.0       EVICT6.0>3 B3.0       LOAD6.0<3  F7.0
    rank 1 | F6.0       B4.0       F7.0       B5.0       B6.0       B7.0
    rank 2 | B4.0       F6.0       B5.0       F7.0       B6.0       B7.0
    rank 3 | F5.0       B5.0       F6.0       B6.0       F7.0       B7.0

    rank 0 | EVICT7.0>3 B4.0       LOAD7.0<3  B5.0       B6.0       B7.0
    rank 1 |
    rank 2 |
    rank 3 |

Simulated with F = 1, B = 2 and transfers of 0.25 forward (the default), the peaks are 4 3 2 2 against
1F1B's 4 3 2 1, the makespan is 1F1B's 33 and no backward waits for its load. At p = 4 the default bound
therefore saves nothing at the peak (the evicting forward is the peak); `--bpipe-max-resident 2` gives
3 3 3 3. BPipe pays from p = 6 on: at p = 8, K = 5 the peaks are 6 6 6 5 4 4 4 4 against 8 7 6 5 4 3 2 1.
"""
from __future__ import annotations

import bisect
import dataclasses
import warnings
from collections import deque

from megatron_pp.schedules.comm import RendezvousReplay, insert_communication, register_communication_pass
from megatron_pp.schedules.ir import COMM_OPS, HOSTING_OPS, PARTNER_OP, SIDE_OPS, Action, Op, Schedule, ScheduleError
from megatron_pp.schedules.simulate import CostModel, simulate


class BPipeWarning(UserWarning):
    """The pass's transfers do not hide behind compute in the simulated step (see `warn_unhidden_transfers`)."""


def default_max_resident(num_ranks: int) -> int:
    """BPipe's bound K = ⌈(p + 2)/2⌉ (p/2 + 1 for even p): resident stashes per rank."""
    return -(-(num_ranks + 2) // 2)


def partner(rank: int, num_ranks: int) -> int | None:
    """The rank that `rank` is paired with (p − 1 − rank), or None for the middle rank of an odd p."""
    other = num_ranks - 1 - rank
    return None if other == rank else other


def _check_input(schedule: Schedule, max_resident: object) -> int:
    if schedule.num_chunks != 1:
        raise ValueError(f"bpipe pairs whole pipeline stages and takes one chunk per rank; schedule "
                         f"{schedule.name!r} has {schedule.num_chunks} "
                         "(drop --num-layers-per-virtual-pipeline-stage)")
    for rank, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            if a.op in COMM_OPS or a.op in SIDE_OPS:
                raise ValueError(f"the bpipe pass expects a compute-only schedule; rank {rank}, action {i} is {a} "
                                 "(run it before insert_communication, once, and not after the offload pass)")
    bound = default_max_resident(schedule.num_ranks) if max_resident is None else max_resident
    if not isinstance(bound, int) or isinstance(bound, bool) or bound < 1:
        raise ValueError(f"--bpipe-max-resident must be a positive int (stashes kept on each rank), got "
                         f"{max_resident!r}")
    return bound


def _evicting_list(actions: list[Action], peer: int, bound: int) -> list[Action]:
    """One rank's list with EVICT/LOAD inserted by the counting rule of the module docstring."""
    out: list[Action] = []
    resident = 0
    parked: deque[tuple[int, int]] = deque()
    for a in actions:
        out.append(a)
        if a.op is Op.F:
            resident += 1
            if resident > bound:
                out.append(Action(Op.EVICT, a.microbatch, a.chunk, peer))
                parked.append((a.microbatch, a.chunk))
                resident -= 1
        elif a.op in (Op.B, Op.BW):  # the stash is gone once its whole backward has run
            resident -= 1
            while parked and resident < bound:
                microbatch, chunk = parked.popleft()
                out.append(Action(Op.LOAD, microbatch, chunk, peer))
                resident += 1
    return out


def add_bpipe(schedule: Schedule, max_resident: int | None = None) -> Schedule:
    """The pass: EVICT/LOAD on every rank x < p − 1 − x whose count exceeds `max_resident` (default K).

    Returns compute lists plus transfers. Communication is inserted later, as for every schedule, and with
    it the partner's side of each transfer (`add_hosting`, which `insert_communication` runs as a registered pass). It places
    EVICT/LOAD by counting alone; `warn_unhidden_transfers` checks them on a simulated timeline.
    """
    bound = _check_input(schedule, max_resident)
    p = schedule.num_ranks
    lists = []
    for rank, acts in enumerate(schedule.actions):
        peer = partner(rank, p)
        lists.append(_evicting_list(acts, peer, bound) if peer is not None and rank < peer else list(acts))
    return dataclasses.replace(schedule, actions=lists, options={**schedule.options, "bpipe_max_resident": bound})


def add_hosting(schedule: Schedule, costs: CostModel | None = None) -> Schedule:
    """Give every acceptor the ACCEPT/RETURN of its evictor's EVICT/LOAD (see the module docstring).

    `schedule` has its pipeline communication (`insert_communication` runs this pass last) and EVICT/LOAD on
    the evictors only. A hosting action first goes right before the receives of the acceptor's first
    compute that, in a simulation under `costs` with the acceptor taken as always ready, ends after its
    transfer's latest start (`_latest_starts`: for a RETURN its LOAD's start; for an ACCEPT the latest
    start that delays nothing on the evictor, so that the buffers it allocates exist no earlier than they
    must), an ACCEPT no later than the receives of the acceptor's forward of its microbatch (after the
    sends of the compute before: it is posted when that compute ends, no later than the transfer needs,
    and ahead of inputs that may come from the evictor's later work; this splits a send-and-receive batch
    in two, which the replay below checks). It then moves only
    where a replay of the lists under rendezvous semantics (every operation blocks until its peer joins,
    parking included) gets stuck: one its acceptor waits at while the evictor waits elsewhere moves one
    place later; one an evictor waits for while the acceptor waits in a batch moves in front of the
    batch's members that wait. Each acceptor keeps its evictor's order, so both sides of each pair group
    post in one order.
    """
    pairs = sorted({(rank, a.peer) for rank, acts in enumerate(schedule.actions) for a in acts if a.op in PARTNER_OP})
    ranks = [r for pair in pairs for r in pair]
    if not pairs or len(set(ranks)) != len(ranks):
        return schedule  # nothing to host, or pairs that overlap, which `validate` reports
    base = [list(acts) for acts in schedule.actions]
    ready = [list(acts) for acts in base]
    hosting: dict[int, list[Action]] = {}
    for x, y in pairs:
        hosting[y] = [Action(PARTNER_OP[a.op], a.microbatch, a.chunk, x) for a in base[x] if a.op in PARTNER_OP]
        ready[y] = sorted(hosting[y], key=lambda a: a.op is Op.RETURN) + ready[y]  # no ACCEPT after a RETURN
    try:
        timed = simulate(dataclasses.replace(schedule, actions=ready), costs)
    except ScheduleError:
        return schedule  # lists that break a rule of their own, which `validate` reports precisely
    slots: dict[int, list[int]] = {}  # acceptor -> per hosting action, the index of `base[y]` it goes before
    for x, y in pairs:
        computes = [(i, end) for i, (a, _, end) in enumerate(timed.timeline[y][len(hosting[y]):]) if a.is_compute]
        ends = [end for _, end in computes]
        before_forward = _before_forwards(base[y]) if y > x else {}
        slots[y] = []
        for action, start in zip(hosting[y], _latest_starts(timed.timeline[x])):
            k = bisect.bisect_right(ends, start + 1e-9)
            at = computes[k - 1][0] + 1 if k else 0  # right after the last compute that ends in time
            if action.op is Op.ACCEPT:
                # No later than the batch that receives this microbatch's activation: under blocking
                # semantics it leaves the evictor, upstream, only once the EVICT has met its ACCEPT.
                at = min(at, before_forward.get(action.microbatch, at))
            slots[y].append(max([at] + slots[y][-1:]))
    replay = RendezvousReplay([_insert_before(acts, slots[r], hosting[r]) if r in hosting else list(acts)
                               for r, acts in enumerate(base)], parking=True)
    where = {y: {a: k for k, a in enumerate(h)} for y, h in hosting.items()}
    blocked: list = []
    for _ in range(4 * sum(len(h) for h in hosting.values()) + 4):
        blocked = replay.run()
        if not blocked:
            return dataclasses.replace(schedule, actions=[list(acts) for acts in replay.actions])
        moved = _repair(replay.actions, blocked, hosting, where, slots)
        if not moved:
            break
        # The replay goes on from its current state with the moved stretch of each list rewritten, rolled
        # back only where the change reaches (`RendezvousReplay.replace`): a repair costs what it moves,
        # not a replay of every list.
        replay.replace({y: _window(base[y], hosting[y], slots[y], old) for y, old in sorted(moved.items())})
    raise ScheduleError("bpipe: found no deadlock-free place for the acceptor's side of the transfers; stuck at "
                        + "; ".join(b.describe() for b in blocked))



register_communication_pass(frozenset(PARTNER_OP), add_hosting)


def _latest_starts(timeline: list[tuple[Action, float, float]]) -> list[float]:
    """Per EVICT/LOAD of an evictor's `timeline` (simulated with its partner always ready), in list order, the
    latest start that moves nothing on the evictor. An EVICT's copy must be over by the start of the rank's
    next forward (which waits for it, as the executor does) and of its stash's LOAD: it may start that
    minus its duration (in the p = 4, m = 8, K = 2 example, EVICT3 issued at 4.25 may start at 11.75, since
    F4 starts at 12 and the copy takes 0.25). A LOAD keeps its start: its stash's backward waits for it.
    The acceptor posts its side in the evictor's order, so no EVICT's latest start is after that of a
    transfer listed after it (a late ACCEPT would hold back the RETURN a LOAD waits for)."""
    out: list[tuple[Op, float, float]] = []  # (op, start, latest start)
    for i, (action, start, end) in enumerate(timeline):
        if action.op is Op.LOAD:
            out.append((action.op, start, start))
        elif action.op is Op.EVICT:
            key = (action.microbatch, action.chunk)
            later = [s for a, s, _ in timeline[i + 1:]
                     if a.op is Op.F or (a.op is Op.LOAD and (a.microbatch, a.chunk) == key)]
            out.append((action.op, start, max(start, min(later) - (end - start)) if later else start))
    latest = [limit for _, _, limit in out]
    for k in range(len(out) - 2, -1, -1):
        if out[k][0] is Op.EVICT:
            latest[k] = max(out[k][1], min(latest[k], latest[k + 1]))
    return latest


def _before_forwards(actions: list[Action]) -> dict[int, int]:
    """Microbatch -> the index right after the last compute before its forward in `actions` (where a
    hosting action goes to be posted before that forward's receives)."""
    out: dict[int, int] = {}
    last = 0
    for i, a in enumerate(actions):
        if a.op is Op.F:
            out.setdefault(a.microbatch, last)
        if a.is_compute:
            last = i + 1
    return out

def _insert_before(actions: list[Action], slots: list[int], hosting: list[Action]) -> list[Action]:
    """`actions` with hosting[k] inserted before actions[slots[k]] (several at one place in their order)."""
    out, k = [], 0
    for i, a in enumerate(actions):
        while k < len(hosting) and slots[k] == i:
            out.append(hosting[k])
            k += 1
        out.append(a)
    return out + hosting[k:]


def _window(base: list[Action], hosting: list[Action], slots: list[int],
            old: dict[int, int]) -> tuple[int, list[Action]]:
    """The stretch of `_insert_before(base, slots, hosting)` that differs from the list with the hosting
    actions at their `old` slots (k -> slot before the repair): (its start in the list, its new content)."""
    lo = min(min(old.values()), min(slots[k] for k in old))
    hi = max(max(old.values()), max(slots[k] for k in old))
    first, last = bisect.bisect_left(slots, lo), bisect.bisect_right(slots, hi)
    return lo + first, _insert_before(base[lo:hi + 1], [s - lo for s in slots[first:last]], hosting[first:last])


def _hosting_before(slots: list[int], before: dict[int, int], index: int) -> int:
    """How many hosting actions sit before list index `index` of the list the replay ran (hosting action k
    sits at slot + k, its slot being `before[k]` where this round moved it already, else slots[k])."""
    lo, hi = 0, len(slots)
    while lo < hi:
        mid = (lo + hi) // 2
        if before.get(mid, slots[mid]) + mid < index:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _repair(lists: list[list[Action]], blocked, hosting: dict[int, list[Action]], where: dict[int, dict[Action, int]],
            slots: dict[int, list[int]]) -> dict[int, dict[int, int]]:
    """Move the hosting actions a stuck replay of `lists` points at (see `add_hosting`); return, per acceptor
    whose actions moved, each moved action's slot before the move (empty: nothing to move)."""
    stuck = {b.rank: b for b in blocked}
    moved: dict[int, dict[int, int]] = {}

    def move(y: int, k: int, slot: int) -> None:
        moved.setdefault(y, {}).setdefault(k, slots[y][k])
        slots[y][k] = slot

    for b in blocked:
        for _, a in b.waiting:
            if a.op in HOSTING_OPS:  # the acceptor waits for its evictor, which waits elsewhere: one later
                y, k = b.rank, where[b.rank][a]
                if a.peer in stuck and any(w.op in PARTNER_OP for _, w in stuck[a.peer].waiting):
                    continue
                if slots[y][k] < len(lists[y]) - len(hosting[y]):
                    move(y, k, slots[y][k] + 1)
                    j = k + 1  # the ones after it keep their order (slots never decrease along the list)
                    while j < len(slots[y]) and slots[y][j] < slots[y][k]:
                        move(y, j, slots[y][k])
                        j += 1
            elif a.op in PARTNER_OP:  # the evictor waits for its acceptor, which waits in a batch: before it
                y = a.peer
                k = where[y][Action(PARTNER_OP[a.op], a.microbatch, a.chunk, b.rank)]
                if y not in stuck or any(w.op in HOSTING_OPS for _, w in stuck[y].waiting):
                    continue
                at = min(i for i, _ in stuck[y].waiting)
                # In the hosting-free list: the first member y waits for (the members before it are matched).
                first = at - _hosting_before(slots[y], moved.get(y, {}), at)
                if slots[y][k] > first:
                    move(y, k, first)
                    j = k - 1
                    while j >= 0 and slots[y][j] > first:
                        move(y, j, first)
                        j -= 1
    return moved


def warn_unhidden_transfers(schedule: Schedule, costs: CostModel | None = None) -> Schedule:
    """Return `schedule`, warning with a `BPipeWarning` when, simulated under `costs` (default
    `CostModel()`), its transfers are not hidden: a backward waits for its LOAD, or the step takes longer
    than the same lists without EVICT/LOAD (forwards waiting for the eviction that makes room for them on
    the critical path). A forward of the warm-up that waits while its rank would idle anyway is hidden."""
    bare = dataclasses.replace(schedule, actions=[[a for a in acts if a.op not in (Op.EVICT, Op.LOAD)]
                                                  for acts in schedule.actions])
    if not any(a.op in COMM_OPS for acts in schedule.actions for a in acts):
        schedule_c, bare = insert_communication(schedule), insert_communication(bare)
    else:
        schedule_c = schedule
    waits = transfer_waits(schedule_c, costs)  # with its communication already in: inserted once, not twice
    late_loads = {key: wait for key, wait in waits.items() if key[1].op is not Op.F}
    exposed = simulate(schedule_c, costs).makespan - simulate(bare, costs).makespan
    if late_loads or exposed > 1e-9:
        (rank, action), wait = max(waits.items(), key=lambda item: item[1])
        bound = schedule.options.get("bpipe_max_resident")
        warnings.warn(BPipeWarning(
            f"bpipe: transfers are not hidden in the simulated step ({exposed:g} time units longer than without "
            f"them; {len(late_loads)} backward(s) wait for their LOAD; longest wait: rank {rank}, {action}, "
            f"{wait:g}): the link is too slow for --bpipe-max-resident {bound}; a larger bound or a faster link "
            "hides them"), stacklevel=2)
    return schedule


def transfer_waits(schedule: Schedule, costs: CostModel | None = None) -> dict[tuple[int, Action], float]:
    """Computes that start later because of a peer transfer: (rank, action) -> delay, for a backward
    whose stash's LOAD had not arrived and a forward whose rank's earlier EVICTs had not completed.

    `schedule` may be compute-only (communication is inserted on a copy). The delay is measured on the
    simulated timeline from when the compute's rank and received inputs were ready.
    """
    if not any(a.op in (Op.EVICT, Op.LOAD) for acts in schedule.actions for a in acts):
        return {}
    if not any(a.op in COMM_OPS for acts in schedule.actions for a in acts):
        schedule = insert_communication(schedule)
    timed = simulate(schedule, costs)
    waits: dict[tuple[int, Action], float] = {}
    for rank, entries in enumerate(timed.timeline):
        loaded_at: dict[tuple[int, int], float] = {}
        evicted_at = 0.0
        received_at: dict[tuple[Op, int, int], float] = {}  # (F or B, mb, chunk) -> its input is in
        ready = 0.0  # when the compute stream of this rank is free
        i = 0
        while i < len(entries):
            action, start, end = entries[i]
            if action.is_comm:
                # A consumer waits for its own receive only (see simulate), which ends when its data is in.
                if action.op in (Op.RECV_F, Op.RECV_B):
                    consumer = Op.F if action.op is Op.RECV_F else Op.B
                    received_at[consumer, action.microbatch, action.chunk] = end
                i += 1
                continue
            key = (action.microbatch, action.chunk)
            if action.op is Op.LOAD:
                loaded_at[key] = end
            elif action.op is Op.EVICT:
                evicted_at = max(evicted_at, end)
            elif action.is_compute:
                consumer = Op.F if action.op is Op.F else Op.B
                free = max(ready, received_at.get((consumer, *key), 0.0))
                blocker = evicted_at if action.op is Op.F else loaded_at.get(key, 0.0)
                if action.op is not Op.BW and blocker > free + 1e-9:
                    waits[rank, action] = blocker - free
                ready = end
            i += 1
    return waits
