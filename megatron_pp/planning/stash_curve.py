"""Stash memory of a schedule from its own action lists: weight versions alive at once, the resident-stash
peak in list order (schedules that move no stashes) and on a simulated timeline (offload, BPipe). Used by
`planning.cost.Evaluator` (which re-exports these names), the BPipe estimator and the paper reproductions."""
from __future__ import annotations

import math
from typing import Optional, Sequence

from megatron_pp.schedules.execute import deferred_backwards
from megatron_pp.schedules.ir import Op, Schedule
from megatron_pp.schedules.runtime import hosting_bound
from megatron_pp.schedules.simulate import SimResult


def live_weight_versions(schedule: Schedule) -> int:
    """Weight copies a rank keeps at once. A version tag (`@v`) is alive on a rank from its first
    appearance in the rank's list (the STEP@v that creates it, or its first use) to its last use; the most
    versions alive together on any rank, at least 1, is applied to every rank: a two-version schedule
    keeps two parameter buffers on every stage (PipeDream-2BW at pp = 1 still updates W(t) while batch t
    runs on W(t − 1)). A flushed schedule tags nothing and keeps one."""
    most = 1
    for acts in schedule.actions:
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for index, a in enumerate(acts):
            if a.version is not None:
                first.setdefault(a.version, index)
                last[a.version] = index
        # One action carries one version, so no interval starts where another ends: order is unambiguous.
        edges = sorted([(i, 1) for i in first.values()] + [(i, -1) for i in last.values()], key=lambda e: (e[0], -e[1]))
        alive = 0
        for _, delta in edges:
            alive += delta
            most = max(most, alive)
    return most


def list_order_peaks(schedule: Schedule, stage_bytes: Sequence[float],
                     held_bytes: Optional[Sequence[float]] = None) -> list[float]:
    """Peak stash bytes per rank of a schedule that moves no stashes: walking each rank's list, + a
    stash at its F, − at its B (or BW); with `held_bytes`, + those of its stage at a BI whose BW is
    deferred (`deferred_backwards`) and − again at that BW. Compute runs in list order on a rank, so this
    is the simulator's curve under any cost model (`resident_peaks` of any simulation; tested)."""
    peaks = []
    for rank, acts in enumerate(schedule.actions):
        deferred = deferred_backwards(acts) if held_bytes is not None else set()
        level = peak = 0.0
        for a in acts:
            if a.op is Op.F:
                level += stage_bytes[schedule.stage_of(rank, a.chunk)]
                peak = max(peak, level)
            elif a.op is Op.BI and (a.microbatch, a.chunk) in deferred:
                level += held_bytes[schedule.stage_of(rank, a.chunk)]
                peak = max(peak, level)
            elif a.op is Op.B or a.op is Op.BW:
                level -= stage_bytes[schedule.stage_of(rank, a.chunk)]
                if (a.microbatch, a.chunk) in deferred:
                    level -= held_bytes[schedule.stage_of(rank, a.chunk)]
        peaks.append(peak)
    return peaks


def resident_peaks(schedule: Schedule, sim: SimResult, stage_bytes: Sequence[float],
                   held_bytes: Optional[Sequence[float]] = None) -> list[float]:
    """Peak device-resident stash bytes per rank: the simulator's stash curve with each (microbatch,
    chunk) weighted by its stage's bytes.

    The accounting is the simulator's (schedules/simulate.py): + a stash when its F starts, − when its B
    (or BW) ends, − when an OFFLOAD/EVICT copy completes and + when the RELOAD/LOAD back starts; a parked
    stash counts on its peer from the peer's ACCEPT until the LOAD has delivered it back. Events of a
    rank's own actions at equal times keep list order, as the simulator records them; a peer's events
    at equal times are taken pessimistically (arrivals first, departures last). With unit bytes this
    reproduces `SimResult.peak_stash` on every rank that hosts no guests (tested). With `held_bytes`, a
    (microbatch, chunk) whose BW is deferred also holds its stage's held bytes from the end of its BI to
    the end of its BW (`list_order_peaks`).

    A rank that hosts a peer's stashes allocates them at its ACCEPT but frees them only when the peer's
    LOAD has taken them back (`schedules.peer_store.AcceptorStore`), which on a real machine depends on
    the peer's pace, so they can overlap its own stashes differently from the simulated timeline. The
    store holds at most `runtime.hosting_bound` of its list at once, so such a rank is charged the
    larger of its simulated peak and (its own peak + that many guests), a bound that holds whatever the
    timing.
    """
    events: list[list[tuple[float, float, float]]] = [[] for _ in range(schedule.num_ranks)]
    for rank, line in enumerate(sim.timeline):
        deferred = deferred_backwards(schedule.actions[rank]) if held_bytes is not None else set()
        for index, (action, start, end) in enumerate(line):
            op = action.op
            if action.chunk is None or action.microbatch is None:
                continue
            size = float(stage_bytes[schedule.stage_of(rank, action.chunk)])
            if (action.microbatch, action.chunk) in deferred and op in (Op.BI, Op.BW):
                held = float(held_bytes[schedule.stage_of(rank, action.chunk)])
                events[rank].append((end, index, held if op is Op.BI else -held))
            if op is Op.F:
                events[rank].append((start, index, size))
            elif op in (Op.B, Op.BW):
                events[rank].append((end, index, -size))
            elif op in (Op.OFFLOAD, Op.EVICT):
                events[rank].append((end, index, -size))
            elif op is Op.ACCEPT:  # the buffers of the peer's stash, from their allocation
                events[rank].append((start, -math.inf, float(stage_bytes[schedule.stage_of(action.peer,
                                                                                         action.chunk)])))
            elif op in (Op.RELOAD, Op.LOAD):
                events[rank].append((start, index, size))
                if op is Op.LOAD:
                    events[action.peer].append((end, math.inf, -size))
    def peak_of(rank_events) -> float:
        level = peak = 0.0
        for _, _, delta in sorted(rank_events):
            level += delta
            peak = max(peak, level)
        return peak

    peaks = []
    for rank, rank_events in enumerate(events):
        peak = peak_of(rank_events)
        hosted = [a for a in schedule.actions[rank] if a.op is Op.ACCEPT]
        if hosted:
            guest = float(stage_bytes[schedule.stage_of(hosted[0].peer, hosted[0].chunk)])
            own = peak_of([e for e in rank_events if not math.isinf(e[1])])
            peak = max(peak, own + hosting_bound(schedule.actions[rank]) * guest)
        peaks.append(peak)
    return peaks
