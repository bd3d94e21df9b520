"""The simulator: replays every rank's list with per-action durations and reports time and stash memory.

Each rank runs its list in order on one compute stream. Sends are asynchronous: a send costs no compute
time and its data reaches the peer `p2p_latency` later; a receive (or a batch of them) waits until the
data of its matching send (same position on the same directed link) has arrived. Durations come from a
`CostModel`: F=1, B=2, BI=1, BW=1 per chunk by default, optionally scaled per global stage or taken from a
measured per-(op, stage) table or function. The result holds each rank's timeline, the makespan, busy
time and bubble fraction, and the stash curve: the number of resident (microbatch, chunk) stashes over
time, +1 when an F starts and -1 when its B (or BW, when the backward is split) ends.

Extension point for stash transfers (OFFLOAD/RELOAD, EVICT/LOAD): they would run on a per-rank copy
stream beside the compute stream with durations from the cost model; a stash stops counting when its
OFFLOAD or EVICT completes, counts again from the start of its RELOAD or LOAD (the buffer is allocated
then), and its backward waits for the transfer back. Memory changes are already recorded as timed events
and sorted per rank (`_StashLedger`), so such transfers only add events; `_run_local` rejects
them until that is written, rather than timing them wrongly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence, Union

from megatron_pp.schedules.comm import Link, link_slots
from megatron_pp.schedules.ir import (COMM_OPS, COMPUTE_OPS, TRANSFER_OPS, Action, Op, Schedule, ScheduleError,
                                      batches)

MeasuredCosts = Union[Mapping[tuple[Op, int], float], Callable[[Op, int], float]]


@dataclass(frozen=True)
class CostModel:
    """Durations of compute actions per chunk, in any time unit, and the point-to-point latency."""

    forward: float = 1.0
    """F of one microbatch on one chunk."""
    backward: float = 2.0
    """B (input and weight gradients together)."""
    backward_input: float = 1.0
    """BI, the input-gradient half of a split backward."""
    backward_weight: float = 1.0
    """BW, the weight-gradient half of a split backward."""
    stage_weights: Sequence[float] | None = None
    """Per global stage multiplier of the four durations above (e.g. layers per stage); None = all 1."""
    p2p_latency: float = 0.0
    """Time from a send to the data being available at the receiver."""
    measured: MeasuredCosts | None = None
    """Measured durations: a mapping (op, global stage) -> time, where missing keys fall back to the fields
    above, or a function (op, global stage) -> time that replaces them entirely."""

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "backward_input", "backward_weight", "p2p_latency"):
            if getattr(self, name) < 0:
                raise ValueError(f"CostModel.{name} must be >= 0, got {getattr(self, name)}")
        if self.stage_weights is not None:
            object.__setattr__(self, "stage_weights", tuple(float(w) for w in self.stage_weights))
            if any(w < 0 for w in self.stage_weights):
                raise ValueError(f"CostModel.stage_weights must be >= 0, got {list(self.stage_weights)}")

    def duration(self, op: Op, stage: int) -> float:
        """Time of compute action `op` on global `stage`."""
        if callable(self.measured):
            value = self.measured(op, stage)
        elif self.measured is not None and (op, stage) in self.measured:
            value = self.measured[op, stage]
        else:
            base = {Op.F: self.forward, Op.B: self.backward, Op.BI: self.backward_input,
                    Op.BW: self.backward_weight}[op]
            value = base * (1.0 if self.stage_weights is None else self.stage_weights[stage])
        if value < 0:
            raise ValueError(f"negative duration {value} for {op.value} on stage {stage}")
        return float(value)


@dataclass
class SimResult:
    """What `simulate` measured. Times start at 0; stash counts are in units of one (microbatch, chunk)."""

    timeline: list[list[tuple[Action, float, float]]]
    """Per rank, every action in list order with its (start, end); a receive ends when its data is in."""
    makespan: float
    busy: list[float]
    """Per rank, total compute (F/B/BI/BW) time."""
    bubble_fraction: float
    """Mean over ranks of (makespan - busy) / makespan."""
    memory: list[list[tuple[float, int]]]
    """Per rank, (time, resident stashes) after each change, starting with (0.0, 0)."""
    peak_stash: list[int]


@dataclass
class _StashLedger:
    """Timed +1/-1 stash events of one rank; the order of equal times is the order of recording."""

    events: list[tuple[float, int, int]] = field(default_factory=list)

    def change(self, time: float, delta: int) -> None:
        self.events.append((time, len(self.events), delta))

    def curve(self) -> list[tuple[float, int]]:
        level, points = 0, [(0.0, 0)]
        for time, _, delta in sorted(self.events):
            level += delta
            points.append((time, level))
        return points


@dataclass
class _RankState:
    """What the replay tracks per rank: its compute-stream clock and what it has recorded so far."""

    clock: float = 0.0
    busy: float = 0.0
    timeline: list[tuple[Action, float, float]] = field(default_factory=list)
    ledger: _StashLedger = field(default_factory=_StashLedger)
    posted_at: float | None = None
    """When the rank posted the sends of the batch it is waiting in (None when not in a batch)."""


def simulate(schedule: Schedule, costs: CostModel | None = None) -> SimResult:
    """Time `schedule` (with its communication inserted) under `costs` (default `CostModel()`).

    Raises ScheduleError if some rank waits for a message that never comes; run `validate` first for a
    precise diagnosis.
    """
    costs = CostModel() if costs is None else costs
    if costs.stage_weights is not None and len(costs.stage_weights) != schedule.num_stages:
        raise ValueError(f"CostModel.stage_weights has {len(costs.stage_weights)} entries, schedule "
                         f"{schedule.name!r} has {schedule.num_stages} stages")
    states = [_RankState() for _ in range(schedule.num_ranks)]
    pos = [0] * schedule.num_ranks
    slot_of = link_slots(schedule.actions)
    batch_end = [dict(batches(acts)) for acts in schedule.actions]  # first index of a batch -> its end
    arrival: dict[tuple[Link, int], float] = {}  # (link, position on it) -> when the data is at the receiver

    progress = True
    while progress:
        progress = False
        for rank, acts in enumerate(schedule.actions):
            state = states[rank]
            while pos[rank] < len(acts):
                i = pos[rank]
                if acts[i].op not in COMM_OPS:
                    _run_local(schedule, rank, i, acts[i], costs, state)
                    pos[rank] = i + 1
                    progress = True
                    continue
                end = batch_end[rank][i]
                if state.posted_at is None:
                    # Sends leave as soon as the batch is posted; the receives of the batch then wait.
                    state.posted_at = state.clock
                    for link, is_send, k in slot_of[rank][i:end]:
                        if is_send:
                            arrival[link, k] = state.clock + costs.p2p_latency
                    progress = True
                if any((link, k) not in arrival for link, is_send, k in slot_of[rank][i:end] if not is_send):
                    break
                start = state.posted_at
                for action, (link, is_send, k) in zip(acts[i:end], slot_of[rank][i:end]):
                    state.timeline.append((action, start, start if is_send else max(start, arrival[link, k])))
                state.clock = max([start] + [arrival[link, k] for link, is_send, k in slot_of[rank][i:end]
                                             if not is_send])
                state.posted_at, pos[rank] = None, end
                progress = True

    stuck = [f"rank {r}, action {pos[r]} ({acts[pos[r]]})" for r, acts in enumerate(schedule.actions)
             if pos[r] < len(acts)]
    if stuck:
        raise ScheduleError(f"simulation of {schedule.name!r} cannot proceed; waiting at " + "; ".join(stuck))
    makespan = max(state.clock for state in states)
    busy = [state.busy for state in states]
    bubble = 0.0 if makespan == 0 else sum((makespan - b) / makespan for b in busy) / len(states)
    memory = [state.ledger.curve() for state in states]
    return SimResult(
        timeline=[state.timeline for state in states],
        makespan=makespan,
        busy=busy,
        bubble_fraction=bubble,
        memory=memory,
        peak_stash=[max(level for _, level in curve) for curve in memory],
    )


def _run_local(schedule: Schedule, rank: int, index: int, action: Action, costs: CostModel,
               state: _RankState) -> None:
    """Run one non-communication action of `rank` on its compute stream."""
    start = state.clock
    if action.op in COMPUTE_OPS:
        duration = costs.duration(action.op, schedule.stage_of(rank, action.chunk))
        state.busy += duration
        if action.op is Op.F:
            state.ledger.change(start, +1)
        elif action.op in (Op.B, Op.BW):
            state.ledger.change(start + duration, -1)
    elif action.op in TRANSFER_OPS:
        raise ScheduleError(f"rank {rank}, action {index} ({action}): the simulator has no model for "
                            f"{action.op.value} yet (see the extension point in the simulate module docstring)")
    else:
        # REDUCE_GRAD and STEP mark points in the list; their cost is outside the pipeline model for now.
        duration = 0.0
    state.clock = start + duration
    state.timeline.append((action, start, start + duration))
