"""The offload pass: park chosen stashes in host memory between F and B (PipeOffload, arXiv 2503.01328, §4).

`add_offload(schedule, K)` takes a compute-only schedule and inserts, on every offloading rank, an
OFFLOAD right after the forward of each (microbatch, chunk) with chunk < K — a rank's first chunks have
the longest lifespans (their backward comes last), so they are offloaded first — and a RELOAD placed
so that the copy back is done one backward-duration before that backward starts. Placement is planned
on the simulated timeline of the schedule (`CostModel`, default F=1, BI=BW=1, B=2) with one copy lane
per rank that serves offloads and reloads alike (PipeOffload's single stream; copies of one rank never
overlap): offloads take the earliest free lane time after their forward, reloads the latest free lane
time before their deadline. A transfer of a stash takes `offload_time` × its chunk's forward time.

Rules (the reference's): a stash whose gap from the end of its F to (start of its backward − one
backward) is at most three round trips is not worth moving and stays (`OffloadPlan.short_lived`); one
whose reload finds no free lane time between its offload and its deadline is skipped with an
`OffloadWarning` (never an error). The issue point of a RELOAD in the list is right after the last
compute action that ends at or before its planned start, so the copy starts no later than planned.
What runs is exactly the returned list: the validator checks it, the simulator times it (a stash counts
as resident until its offload copy completes and again from the start of its reload) and the executor
moves real tensors (`offload_store.OffloadStore`).

Feasibility: k = round-trip copy time / F+B compute time of one layer (arXiv 2503.01328, Eq. 1). Full offload
is free when k ≤ 1; one stream hides about a 1/k share, so PO-H needs about k ≤ 2. With t_B = 2·t_F,
`offload_time` T (one-way / forward) and k are related by k = 2T / 3, so the default T = 0.25 is
k ≈ 0.17. `k_from_formula` is Eq. 1 of the paper, `k_from_measurement` the same ratio from a measured
bandwidth and layer time (benchmarks/bench_offload.py measures both on a GPU).

Worked example (p=4, m=8, v=2, uniform repeating order, K=1, T=0.25, F = BI = BW = 1): rank 0 offloads
all eight chunk-0 stashes. F3.0 runs 7..8 and its copy out 8..8.25. BI3.0 starts at 37, so the copy back
must be done by 36: it is planned for 35.75..36 and issued after BI4.1, which ends at 35, so it runs
35..35.25. Rank 0's list begins `F0.0 OFFLOAD0.0 F1.0 OFFLOAD1.0 F0.1 F2.0 OFFLOAD2.0 F1.1 F3.0
OFFLOAD3.0 BI0.1 BW0.1 F2.1 F4.0 OFFLOAD4.0 BI1.1 RELOAD0.0 BW1.1 F3.1 BI0.0 ...` (tests/schedules/
test_offload.py checks these numbers).
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import warnings
from dataclasses import dataclass, field
from typing import Iterable

from megatron_pp.schedules.comm import insert_communication
from megatron_pp.schedules.ir import COMM_OPS, TRANSFER_OPS, Action, Op, Schedule
from megatron_pp.schedules.simulate import DEFAULT_TRANSFER, CostModel, simulate

SHORT_LIFESPAN_ROUND_TRIPS = 3.0
"""A stash whose free gap is at most this many round trips stays on the device (reference-code rule)."""


class OffloadWarning(UserWarning):
    """An offload the pass wanted but could not place; the stash stays on the device."""


@dataclass(frozen=True)
class PlannedCopy:
    """One planned copy on a rank's lane: `op` (OFFLOAD or RELOAD) of (microbatch, chunk) at [start, end),
    issued right after the compute action at index `after` of the rank's compute list."""

    op: Op
    microbatch: int
    chunk: int
    start: float
    end: float
    after: int


@dataclass
class OffloadPlan:
    """What the pass decided, per rank (all ranks listed, non-offloading ones empty)."""

    offload_chunks: int
    offload_time: float
    transfers: list[list[PlannedCopy]]
    """Per rank, the planned copies sorted by start time."""
    short_lived: list[list[tuple[int, int]]]
    """Per rank, (microbatch, chunk) candidates left on the device by the short-lifespan rule."""
    no_slot: list[list[tuple[int, int]]]
    """Per rank, candidates skipped because no lane time fitted (each also raised an OffloadWarning)."""
    k: float = field(default=0.0)
    """Round-trip copy time over F+B compute time implied by `offload_time` and the cost model."""

    def offloaded(self, rank: int) -> list[tuple[int, int]]:
        return [(t.microbatch, t.chunk) for t in self.transfers[rank] if t.op is Op.OFFLOAD]


def resolve_offload_chunks(num_chunks: int, offload_chunks: int | None, offload_fraction: float | None) -> int:
    """K from `--offload-chunks` or `--offload-fraction` (ceil(fraction · v)); 0 when neither is given."""
    if offload_chunks is not None and offload_fraction is not None:
        raise ValueError("--offload-chunks and --offload-fraction are mutually exclusive; give one")
    if offload_fraction is not None:
        if not 0.0 <= offload_fraction <= 1.0:
            raise ValueError(f"--offload-fraction must be within [0, 1], got {offload_fraction}")
        # PO-H is a fraction of 0.5: ceil(v/2) chunks; the epsilon keeps 0.5 * 4 from becoming 3.
        return math.ceil(offload_fraction * num_chunks - 1e-9)
    if offload_chunks is None:
        return 0
    if (not isinstance(offload_chunks, int) or isinstance(offload_chunks, bool)
            or not 0 <= offload_chunks <= num_chunks):
        raise ValueError(f"--offload-chunks must be an int within [0, {num_chunks}] (chunks per rank), "
                         f"got {offload_chunks!r}")
    return offload_chunks


def _check_offload_time(offload_time: float) -> float:
    if not isinstance(offload_time, (int, float)) or isinstance(offload_time, bool) or not offload_time > 0:
        raise ValueError(f"--offload-time must be a positive number (one-way transfer time of one chunk's stash "
                         f"in units of that chunk's forward time), got {offload_time!r}")
    return float(offload_time)


def _check_compute_only(schedule: Schedule) -> None:
    for rank, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            if a.op in (Op.EVICT, Op.LOAD):
                raise ValueError(
                    f"offload cannot be combined with BPipe (rank {rank}, action {i}: {a}): both move the same "
                    "stashes off the device, BPipe to a peer rank and offload to host memory, and a stash can "
                    "only be in one place; use one of them")
            if a.op in COMM_OPS or a.op in TRANSFER_OPS:
                raise ValueError(f"the offload pass expects a compute-only schedule; rank {rank}, action {i} is {a} "
                                 f"(run it before insert_communication, and only once)")


class _Lane:
    """Busy intervals of one rank's copy lane: sorted, never overlapping (every booking is a slot `earliest`
    or `latest` found free), so their ends are sorted too and both searches start by bisection."""

    def __init__(self) -> None:
        self.busy: list[tuple[float, float]] = []
        self._ends: list[float] = []

    def earliest(self, ready: float, length: float) -> float:
        start = ready
        for lo, hi in self.busy[bisect.bisect_right(self._ends, start):]:
            if lo >= start + length:
                break
            start = hi
        return start

    def latest(self, earliest: float, deadline: float, length: float) -> float | None:
        end = deadline
        for k in range(bisect.bisect_left(self.busy, (end,)) - 1, -1, -1):
            lo, hi = self.busy[k]
            if hi <= end - length:
                break
            end = lo
        return end - length if end - length >= earliest else None

    def book(self, start: float, end: float) -> None:
        k = bisect.bisect_right(self.busy, (start, end))
        self.busy.insert(k, (start, end))
        self._ends.insert(k, end)

    def free(self, start: float, end: float) -> None:
        k = self.busy.index((start, end))
        del self.busy[k], self._ends[k]


def plan_offload(schedule: Schedule, offload_chunks: int, offload_time: float = DEFAULT_TRANSFER,
                 ranks: Iterable[int] | None = None, costs: CostModel | None = None) -> OffloadPlan:
    """Decide the copies of a compute-only `schedule` (see the module docstring); changes nothing."""
    _check_compute_only(schedule)
    v = schedule.num_chunks
    K = resolve_offload_chunks(v, offload_chunks, None)
    T = _check_offload_time(offload_time)
    costs = CostModel() if costs is None else costs
    offloading = set(range(schedule.num_ranks) if ranks is None else ranks)
    p = schedule.num_ranks
    transfers: list[list[PlannedCopy]] = [[] for _ in range(p)]
    short_lived: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    no_slot: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    split = any(a.op is Op.BI for acts in schedule.actions for a in acts)
    t_f, t_b = costs.forward, (costs.backward_input + costs.backward_weight) if split else costs.backward
    plan = OffloadPlan(K, T, transfers, short_lived, no_slot, k=2 * T * t_f / (t_f + t_b) if t_f + t_b else 0.0)
    if K == 0 or not offloading:
        return plan
    if K == v and not full_offload_is_free(plan.k):
        warnings.warn(OffloadWarning(
            f"full offload is not free at --offload-time {T}: k = {plan.k:.2f} > 1 (round-trip copy time over F+B "
            f"compute), so one copy stream cannot hide every transfer; expect skipped offloads or a slower step "
            f"(PO-H, about half the chunks, needs k <= 2)"), stacklevel=2)
    timed = simulate(insert_communication(schedule), costs)
    for rank in sorted(offloading):
        times = {(a.op, a.microbatch, a.chunk): (s, e) for a, s, e in timed.timeline[rank] if a.is_compute}
        candidates = []
        for a in schedule.actions[rank]:
            if a.op is not Op.F or a.chunk >= K:
                continue
            back = Op.BI if (Op.BI, a.microbatch, a.chunk) in times else Op.B
            f_end = times[Op.F, a.microbatch, a.chunk][1]
            b_start, b_end = times[back, a.microbatch, a.chunk]
            copy = T * costs.duration(Op.F, schedule.stage_of(rank, a.chunk))
            deadline = b_start - (b_end - b_start)  # the reference margin: done one backward ahead
            if deadline - f_end <= SHORT_LIFESPAN_ROUND_TRIPS * 2 * copy:
                short_lived[rank].append((a.microbatch, a.chunk))
            else:
                candidates.append((f_end, deadline, copy, a.microbatch, a.chunk))
        lane = _Lane()
        offloads = {}
        for f_end, deadline, copy, mb, c in sorted(candidates):
            start = lane.earliest(f_end, copy)
            lane.book(start, start + copy)
            offloads[mb, c] = (start, start + copy)
        reloads = {}
        for f_end, deadline, copy, mb, c in sorted(candidates, key=lambda x: -x[1]):
            out_start, out_end = offloads[mb, c]
            start = lane.latest(out_end, deadline, copy)
            if start is None:
                lane.free(out_start, out_end)
                del offloads[mb, c]
                no_slot[rank].append((mb, c))
                continue
            lane.book(start, start + copy)
            reloads[mb, c] = (start, start + copy)
        forward_at = {(a.microbatch, a.chunk): i for i, a in enumerate(schedule.actions[rank]) if a.op is Op.F}
        acts = schedule.actions[rank]
        # The list's compute actions by end time, with the largest list index among those ending by each.
        ends = sorted((times[a.op, a.microbatch, a.chunk][1], i) for i, a in enumerate(acts) if a.is_compute)
        end_times, last_index = [e for e, _ in ends], list(itertools.accumulate((i for _, i in ends), max))
        for (mb, c), (start, end) in offloads.items():
            transfers[rank].append(PlannedCopy(Op.OFFLOAD, mb, c, start, end, forward_at[mb, c]))
        for (mb, c), (start, end) in reloads.items():
            # Issue after the last compute that ends by the planned start (never before its own OFFLOAD):
            # the copy then starts no later than planned.
            ended = bisect.bisect_right(end_times, start + 1e-9)
            after = max(last_index[ended - 1], forward_at[mb, c]) if ended else forward_at[mb, c]
            transfers[rank].append(PlannedCopy(Op.RELOAD, mb, c, start, end, after))
        transfers[rank].sort(key=lambda t: (t.start, t.op is Op.RELOAD))
    skipped = {rank: len(keys) for rank, keys in enumerate(no_slot) if keys}
    if skipped:
        rank = next(iter(skipped))
        warnings.warn(OffloadWarning(
            f"offload keeps {sum(skipped.values())} stash(es) on the device: no copy-lane time fits between their "
            f"offload and their reload at --offload-time {T} (per rank: {skipped}; first: rank {rank}, microbatch "
            f"{no_slot[rank][0][0]}, chunk {no_slot[rank][0][1]}); fewer offloaded chunks or faster copies fit"),
            stacklevel=2)
    return plan


def apply_offload(schedule: Schedule, plan: OffloadPlan) -> Schedule:
    """Insert the planned OFFLOAD/RELOAD actions into the compute lists of `schedule`."""
    lists = []
    for rank, acts in enumerate(schedule.actions):
        after: dict[int, list[PlannedCopy]] = {}
        for t in plan.transfers[rank]:  # sorted by start, so the lane order is the issue order
            after.setdefault(t.after, []).append(t)
        out = []
        for i, a in enumerate(acts):
            out.append(a)
            out += [Action(t.op, t.microbatch, t.chunk) for t in after.get(i, [])]
        lists.append(out)
    options = {**schedule.options, "offload_chunks": plan.offload_chunks, "offload_time": plan.offload_time}
    return dataclasses.replace(schedule, actions=lists, options=options)


def add_offload(schedule: Schedule, offload_chunks: int | None = None, *, offload_fraction: float | None = None,
                offload_time: float | None = None, ranks: Iterable[int] | None = None,
                costs: CostModel | None = None) -> Schedule:
    """The pass: plan (`plan_offload`) and insert (`apply_offload`). K = 0 returns `schedule` unchanged."""
    _check_compute_only(schedule)
    K = resolve_offload_chunks(schedule.num_chunks, offload_chunks, offload_fraction)
    T = _check_offload_time(DEFAULT_TRANSFER if offload_time is None else offload_time)
    if K == 0:
        return schedule
    return apply_offload(schedule, plan_offload(schedule, K, T, ranks, costs))


# Feasibility ------------------------------------------------------------------------------------------


def k_from_formula(hidden_size: int, seq_length: int, flops_per_s: float, bandwidth: float) -> float:
    """Eq. 1 of PipeOffload: k = 10 / (3·(6h + s)) · B_c / B_o.

    `flops_per_s` is the achieved compute rate B_c, `bandwidth` the one-way (device-to-host, pinned) copy
    rate B_o in bytes/s. Assumes ≈ 20·s·b·h saved bytes per layer (norms and activations recomputed) and
    ≈ 12·s·b·h·(6h + s) F+B FLOPs. A100 (220 TFLOP/s, 15 GB/s), h = 4096, s = 4096: k ≈ 1.70.
    """
    return 10.0 / (3.0 * (6 * hidden_size + seq_length)) * flops_per_s / bandwidth


def k_from_measurement(stash_bytes: float, bandwidth: float, compute_s: float) -> float:
    """k from measurements: round trip (2 × `stash_bytes` / one-way `bandwidth`) over F+B time `compute_s`."""
    return 2.0 * stash_bytes / bandwidth / compute_s


def offload_time_from_k(k: float, forward_share: float = 1.0 / 3.0) -> float:
    """`--offload-time` (one-way copy / forward time) for a ratio k; `forward_share` = t_F / (t_F + t_B)."""
    return k / (2.0 * forward_share)


def full_offload_is_free(k: float) -> bool:
    """PO-F hides every copy behind compute iff k ≤ 1 (arXiv 2503.01328, Eq. 1); PO-H needs about k ≤ 2 (ours)."""
    return k <= 1.0
