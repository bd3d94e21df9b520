"""The simulator: replays every rank's list with per-action durations and reports time and stash memory.

Each rank runs its list in order on one compute stream. Sends are asynchronous: a send costs no compute
time and its data reaches the peer `p2p_latency` after it is posted, whenever the peer posts the receive.
Receives cost no compute time either; the compute that consumes a received tensor waits for that
receive's data and nothing else. A host that runs the list itself (no device stream to post ahead of)
pays `CostModel.host_compute` before each compute action and `host_post` per send or receive posted, on
the rank's clock (both 0 by default: the schedule's own timeline). That is what the executor does where each point-to-point operation is
its own work (gloo: sends are completed in the background, enough receives of each link are posted ahead
so its data can flow during compute, and a receive is waited for by its consumer only; see
`schedules.execute`). On NCCL a batch is one coalesced work, so a consumer there also waits for the other
members of its batch; the simulator does not model that (docs/schedules.md, "Cost model"). Durations come from a `CostModel`: F=1, B=2, BI=1, BW=1 per
chunk by default, optionally scaled per global stage or taken from a measured per-(op, stage) table or
function. The result holds each rank's timeline, the makespan, busy time and bubble fraction, and the
stash curve: the number of device-resident (microbatch, chunk) stashes over time, +1 when an F starts and
-1 when its B (or BW, when the backward is split) ends.

Stash transfers (OFFLOAD/RELOAD to host memory, EVICT/LOAD to a peer rank) run on side lanes beside the
compute stream: one host-copy lane per rank (PipeOffload's single stream, alternating offloads and
reloads in issue order) and, for peer transfers, one lane per (rank, peer) and direction (EVICT out,
LOAD back: the two directions of a full-duplex link, with a process group each). Issuing one costs the
compute stream nothing; it starts when its lane is free (and, coming back, once its outbound copy is
done) and lasts `CostModel.transfer_time`. Accounting (ours; docs/schedules.md, "Formulas and their
sources"): a stash stops counting as resident when its outbound copy *completes* (never when it
starts), counts again from the *start* of the copy back (the buffer is allocated then), and its backward
waits for that copy to finish. The `parked` curve counts stashes held off-device (in host memory or on
the peer). A peer transfer also needs the peer: an EVICT starts no earlier than the acceptor's ACCEPT
is posted and a LOAD no earlier than its RETURN (posting either costs the acceptor's compute nothing),
and the hosted stash counts on the acceptor from its ACCEPT (the buffers are allocated there) until the
LOAD has delivered it back. An acceptor holds at most `runtime.hosting_bound` guests, as its store does:
an ACCEPT beyond it waits (on the acceptor's clock) until the oldest returned guest's LOAD has ended.
A forward waits for the EVICTs issued before it (the executor frees their memory before it allocates), so an evicting rank never holds its bound plus two. With `CostModel.stash_bytes` the curves are also
weighed in bytes (`SimResult.peak_bytes`, guests at their owner's size) and, with `peer_bandwidth`,
EVICT/LOAD take bytes / bandwidth.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence, Union

from megatron_pp.schedules.comm import Wakeups, link_sides
from megatron_pp.schedules.ir import (COMPUTE_OPS, HOSTING_OPS, PARTNER_OP, RETURN_TRANSFER, TRANSFER_OPS, Action, Op,
                                      Schedule, ScheduleError, whole_schedule_pass)
from megatron_pp.schedules.runtime import hosting_bound

MeasuredCosts = Union[Mapping[tuple[Op, int], float], Callable[[Op, int], float]]

DEFAULT_TRANSFER = 0.25
"""One-way transfer time of one stash, as a multiple of its chunk's forward time, when neither the cost
model nor the schedule's `offload_time` option says otherwise (the issue's default)."""


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
    host_compute: float = 0.0
    """Host time the rank spends before each compute action (the executor's loop and dispatch): the action
    starts no earlier than the rank's clock plus this, and waiting for its input overlaps it."""
    host_post: float = 0.0
    """Host time to post one send or receive: a communication batch advances the rank's clock by this per
    send and receive in it, sends first, each send leaving when its own post is done. Both host fields are
    ours, for a host that runs the list without posting ahead of a device stream (the emulated CPU runs of
    `tools/trace_vs_sim.py --emulate` calibrate them); 0 (the default) is a host that costs nothing."""
    transfer: float | None = None
    """One-way time of a stash transfer (OFFLOAD, RELOAD, EVICT, LOAD) as a multiple of the forward time of
    its chunk; None takes the schedule's planned `offload_time` option, else `DEFAULT_TRANSFER`."""
    stash_bytes: Sequence[float] | None = None
    """Bytes of one microbatch's stash per global stage: weights the stash curves (`SimResult.peak_bytes`)
    and, with `peer_bandwidth`, times EVICT/LOAD."""
    peer_bandwidth: float | None = None
    """Bytes per time unit of the link between BPipe partners: EVICT/LOAD of a stage's stash then take
    stash_bytes[stage] / peer_bandwidth instead of the `transfer` ratio (measured values still win)."""
    measured: MeasuredCosts | None = None
    """Measured durations: a mapping (op, global stage) -> time, where missing keys fall back to the fields
    above, or a function (op, global stage) -> time that replaces them entirely (transfers included)."""

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "backward_input", "backward_weight", "p2p_latency", "host_compute",
                     "host_post"):
            if getattr(self, name) < 0:
                raise ValueError(f"CostModel.{name} must be >= 0, got {getattr(self, name)}")
        if self.stage_weights is not None:
            object.__setattr__(self, "stage_weights", tuple(float(w) for w in self.stage_weights))
            if any(w < 0 for w in self.stage_weights):
                raise ValueError(f"CostModel.stage_weights must be >= 0, got {list(self.stage_weights)}")
        if self.transfer is not None and self.transfer < 0:
            raise ValueError(f"CostModel.transfer must be >= 0, got {self.transfer}")
        if self.stash_bytes is not None:
            object.__setattr__(self, "stash_bytes", tuple(float(b) for b in self.stash_bytes))
            if any(b < 0 for b in self.stash_bytes):
                raise ValueError(f"CostModel.stash_bytes must be >= 0, got {list(self.stash_bytes)}")
        if self.peer_bandwidth is not None and (self.stash_bytes is None or not self.peer_bandwidth > 0):
            raise ValueError(f"CostModel.peer_bandwidth must be > 0 and needs stash_bytes (transfer = bytes / "
                             f"bandwidth), got {self.peer_bandwidth} with stash_bytes {self.stash_bytes}")

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

    def stash_size(self, stage: int) -> float:
        """Bytes of one stash of global `stage` (1 without `stash_bytes`: the curves count stashes)."""
        if self.stash_bytes is None:
            return 1.0
        if stage >= len(self.stash_bytes):
            raise ValueError(f"CostModel.stash_bytes has {len(self.stash_bytes)} entries, no stage {stage}")
        return self.stash_bytes[stage]

    def transfer_time(self, op: Op, stage: int, schedule_ratio: float | None = None) -> float:
        """Time of stash transfer `op` of global `stage`: measured if given, else the transfer ratio (this
        model's, or `schedule_ratio`, or `DEFAULT_TRANSFER`) times the stage's forward time."""
        if callable(self.measured):
            value = self.measured(op, stage)
        elif self.measured is not None and (op, stage) in self.measured:
            value = self.measured[op, stage]
        elif op in (Op.EVICT, Op.LOAD) and self.peer_bandwidth is not None:
            value = self.stash_size(stage) / self.peer_bandwidth
        else:
            ratio = self.transfer if self.transfer is not None else (
                DEFAULT_TRANSFER if schedule_ratio is None else schedule_ratio)
            value = ratio * self.duration(Op.F, stage)
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
    parked: list[list[tuple[float, int]]] = field(default_factory=list)
    """Per rank, (time, stashes of this rank held off-device: in host memory or on a peer)."""
    peak_parked: list[int] = field(default_factory=list)
    transfer_busy: list[float] = field(default_factory=list)
    """Per rank, total time its transfer lanes were copying."""
    peak_bytes: list[float] = field(default_factory=list)
    """Per rank, peak bytes of resident stashes (its own and any it hosts) when the cost model has
    `stash_bytes`; empty otherwise."""


@dataclass
class _StashLedger:
    """Timed +1/-1 stash events of one rank; the order of equal times is the order of recording."""

    events: list[tuple[float, int, int, float]] = field(default_factory=list)

    def change(self, time: float, delta: int, size: float = 1.0) -> None:
        self.events.append((time, len(self.events), delta, size))

    def curve(self) -> list[tuple[float, int]]:
        level, points = 0, [(0.0, 0)]
        for time, _, delta, _ in sorted(self.events):
            level += delta
            points.append((time, level))
        return points

    def peak_size(self) -> float:
        """Peak of the curve with every event weighted by its stash's size."""
        level = peak = 0.0
        for _, _, delta, size in sorted(self.events):
            level += delta * size
            peak = max(peak, level)
        return peak


@dataclass
class _RankState:
    """What the replay tracks per rank: its compute-stream clock and what it has recorded so far."""

    clock: float = 0.0
    busy: float = 0.0
    timeline: list[tuple[Action, float, float]] = field(default_factory=list)
    ledger: _StashLedger = field(default_factory=_StashLedger)
    parked: _StashLedger = field(default_factory=_StashLedger)
    posted_at: float | None = None
    """When the rank posted the sends of the batch it is processing (None when not in a batch)."""
    inputs_at: dict[tuple[Op, int, int], float] = field(default_factory=dict)
    """(F or B, microbatch, chunk) -> when the received input of that compute is in (its batch done)."""
    lanes: dict[tuple[str, int | None], float] = field(default_factory=dict)
    """Transfer lane ("host", None), ("EVICT", q) or ("LOAD", q) -> when it is free again."""
    away: dict[tuple[int, int], tuple[Op, float]] = field(default_factory=dict)
    """Stash (microbatch, chunk) sent off-device -> (its outbound op, when that copy completes)."""
    back_at: dict[tuple[int, int], float] = field(default_factory=dict)
    """Stash brought back -> when its copy back completes (its backward waits for it)."""
    transfer_busy: float = 0.0
    evicted_at: float = 0.0
    """When this rank's EVICTs issued so far have completed: a forward starts no earlier (the executor
    frees an evicted stash before the next forward allocates, see peer_store.PeerStore)."""
    hosting: dict[tuple[Op, int, int], tuple[float, int]] = field(default_factory=dict)
    """(ACCEPT or RETURN, microbatch, chunk) posted by this rank (an acceptor) -> (when, timeline index)."""
    guests: dict[tuple[int, int], float | None] = field(default_factory=dict)
    """Hosted stashes, in ACCEPT order -> when the partner's LOAD took them back (None: not yet)."""
    returned: set[tuple[int, int]] = field(default_factory=set)
    guest_cap: int = 0
    """`runtime.hosting_bound` of the rank's list: an ACCEPT beyond it waits for the oldest returned guest."""


MessageLatency = Callable[[int, int, int], float]
"""(sender, receiver, k) -> time from the k-th send on that link being posted to its data being in."""


@whole_schedule_pass
def simulate(schedule: Schedule, costs: CostModel | None = None, latencies: MessageLatency | None = None,
             extra: Mapping[tuple[int, str], float] | None = None) -> SimResult:
    """Time `schedule` (with its communication inserted) under `costs` (default `CostModel()`). For a replay
    of a measured run (`benchmarks.emulate_replay`): `latencies` gives each message its own latency in place
    of `costs.p2p_latency`, `extra` adds time to single compute actions, keyed (rank, str(action)).

    Raises ScheduleError if some rank waits for a message that never comes; run `validate` first for a
    precise diagnosis.
    """
    costs = CostModel() if costs is None else costs
    _check_costs(schedule, costs)
    states = [_RankState(guest_cap=hosting_bound(acts)) for acts in schedule.actions]
    pos = [0] * schedule.num_ranks
    sides_of, num_links = link_sides(schedule.actions)
    # Per link, when each message sent on it is at the receiver, in order: a rank posts its sends on a link
    # in list order, so the k-th entry is the k-th message.
    arrival: list[list[float]] = [[] for _ in range(num_links)]
    durations = _Durations(schedule, costs, extra)

    # A rank only waits here for a receive whose sender has not posted yet, so a posting wakes the
    # receiver and nothing else is looked at again (`Wakeups` keeps the order of the pass loop, which
    # fixes the order of stash events recorded on a BPipe partner).
    wakeups = Wakeups(schedule.num_ranks)
    latency = costs.p2p_latency
    while (rank := wakeups.next()) is not None:
        acts, state, sides = schedule.actions[rank], states[rank], sides_of[rank]
        i, n = pos[rank], len(acts)
        while i < n:
            if sides[i] is None:
                action = acts[i]
                if action.op in COMPUTE_OPS:
                    _run_compute(rank, i, action, durations, state)
                elif not _run_local(schedule, rank, i, action, durations, states):
                    break  # a parking transfer whose partner has not posted its side yet
                elif action.op in HOSTING_OPS or action.op is Op.LOAD:
                    wakeups.wake(action.peer)  # its EVICT or LOAD may go now; a LOAD frees a guest's room
                i += 1
                continue
            end = i + 1
            while end < n and sides[end] is not None:
                end += 1
            batch = sides[i:end]
            if state.posted_at is None:
                lag = latency if latencies is None else (lambda peer, k, r=rank: latencies(r, peer, k))
                _post_sends(state, batch, arrival, lag, costs.host_post, wakeups)
            # The replay needs the arrival times to go on; the simulated rank itself does not wait here:
            # each consumer waits for its own receive only (`_run_compute`).
            if any(side & 1 and len(arrival[side >> 1]) <= k for side, k, _, _ in batch):
                break
            _complete_batch(acts[i:end], batch, state, arrival)
            i = end
        pos[rank] = i

    stuck = [f"rank {r}, action {pos[r]} ({acts[pos[r]]})" for r, acts in enumerate(schedule.actions)
             if pos[r] < len(acts)]
    if stuck:
        raise ScheduleError(f"simulation of {schedule.name!r} cannot proceed; waiting at " + "; ".join(stuck))
    return _result(states, costs)


def _check_costs(schedule: Schedule, costs: CostModel) -> None:
    for name in ("stage_weights", "stash_bytes"):  # one entry per global stage
        per_stage = getattr(costs, name)
        if per_stage is not None and len(per_stage) != schedule.num_stages:
            raise ValueError(f"CostModel.{name} has {len(per_stage)} entries, schedule {schedule.name!r} has "
                             f"{schedule.num_stages} stages")


def _post_sends(state: "_RankState", batch, arrival: list[list[float]], latency: float | Callable[[int, int], float],
                host_post: float, wakeups: "Wakeups") -> None:
    """Post a communication batch: its sends leave now (an even side sends, see `Side`), each arriving on its
    link after `latency` (or `latency(peer, k)` for its k-th message to that peer), and wake their receivers.
    With a `host_post` time, the sends are posted first, one after the other, each leaving once its own post
    is done, then the receives; the rank's clock moves on by the whole batch's posts."""
    state.posted_at = state.clock
    posted = state.clock
    for side, k, peer, _ in batch:
        if not side & 1:
            if host_post:
                posted += host_post
            arrival[side >> 1].append(posted + (latency(peer, k) if callable(latency) else latency))
            wakeups.wake(peer)
    if host_post:
        state.clock += host_post * len(batch)


def _complete_batch(actions, batch, state: "_RankState", arrival: list[list[float]]) -> None:
    """Record a posted batch whose messages have all arrived: a receive is done when its message is in (not
    before the post), a send at its post; a receive's arrival is its consumer's input time."""
    start = state.posted_at
    for action, (side, k, _, _) in zip(actions, batch):
        if side & 1:
            done = max(start, arrival[side >> 1][k])
            state.timeline.append((action, start, done))
            state.inputs_at[Op.F if action.op is Op.RECV_F else Op.B, action.microbatch, action.chunk] = done
        else:
            state.timeline.append((action, start, start))
    state.posted_at = None


def _result(states: list["_RankState"], costs: CostModel) -> SimResult:
    makespan = max([state.clock for state in states] + [t for state in states for t in state.lanes.values()])
    busy = [state.busy for state in states]
    bubble = 0.0 if makespan == 0 else sum((makespan - b) / makespan for b in busy) / len(states)
    memory = [state.ledger.curve() for state in states]
    parked = [state.parked.curve() for state in states]
    return SimResult(
        timeline=[state.timeline for state in states],
        makespan=makespan,
        busy=busy,
        bubble_fraction=bubble,
        memory=memory,
        peak_stash=[max(level for _, level in curve) for curve in memory],
        parked=parked,
        peak_parked=[max(level for _, level in curve) for curve in parked],
        transfer_busy=[state.transfer_busy for state in states],
        peak_bytes=[state.ledger.peak_size() for state in states] if costs.stash_bytes is not None else [],
    )


class _Durations:
    """Compute durations and stash sizes of one simulation, per (op, global stage) and asked once each:
    the replay needs them for every action, the cost model computes them the same way every time."""

    def __init__(self, schedule: Schedule, costs: CostModel, extra: Mapping[tuple[int, str], float] | None = None):
        self.schedule, self.costs, self.extra = schedule, costs, extra
        self._time: dict[tuple[Op, int, int], tuple[int, float, float]] = {}

    def compute(self, rank: int, op: Op, chunk: int) -> tuple[int, float, float]:
        """(global stage, duration, stash size) of compute `op` on (rank, chunk)."""
        key = (op, rank, chunk)
        found = self._time.get(key)
        if found is None:
            stage = self.schedule.stage_of(rank, chunk)
            found = self._time[key] = (stage, self.costs.duration(op, stage), self.costs.stash_size(stage))
        return found


def _run_local(schedule: Schedule, rank: int, index: int, action: Action, durations: _Durations,
               states: list[_RankState]) -> bool:
    """Run one action of `rank` that is neither communication nor compute (`_run_compute`): a transfer on a
    lane, a hosting post or a marker. Returns False, doing nothing, for an EVICT or LOAD whose ACCEPT or
    RETURN the peer has not posted yet."""
    state = states[rank]
    op = action.op
    costs = durations.costs
    if op in HOSTING_OPS:
        key = (action.microbatch, action.chunk)
        if op is Op.ACCEPT and not _room_for_guest(state):
            return False  # the oldest returned guest's LOAD has not run yet
        if op is Op.ACCEPT:
            state.guests[key] = None
        else:
            state.returned.add(key)
        state.hosting[op, action.microbatch, action.chunk] = (state.clock, len(state.timeline))
        state.timeline.append((action, state.clock, state.clock))  # ends when the transfer does (patched then)
        if op is Op.ACCEPT:  # the receive buffer exists from the post on
            state.ledger.change(state.clock, +1, costs.stash_size(schedule.stage_of(action.peer, action.chunk)))
        return True
    if op in TRANSFER_OPS:
        if op in PARTNER_OP and (PARTNER_OP[op], action.microbatch, action.chunk) not in states[action.peer].hosting:
            return False
        _run_transfer(schedule, rank, index, action, costs, states)
        return True
    # REDUCE_GRAD and STEP mark points in the list; their cost is outside the pipeline model for now.
    state.timeline.append((action, state.clock, state.clock))
    return True


def _room_for_guest(state: _RankState) -> bool:
    """Before an ACCEPT: as `peer_store.AcceptorStore.accept`, hold at most `guest_cap` guests, waiting
    (the rank's clock moves on) for the oldest returned guest's LOAD to end. False if that LOAD has not
    been simulated yet (the partner's LOAD wakes this rank)."""
    while True:
        for key in [k for k, end in state.guests.items() if end is not None and end <= state.clock]:
            del state.guests[key]
        if len(state.guests) < state.guest_cap:
            return True
        oldest = next((k for k in state.guests if k in state.returned), None)
        if oldest is None:
            return True  # nothing sent back to wait for (the store goes on, as here)
        end = state.guests[oldest]
        if end is None:
            return False
        state.clock = max(state.clock, end)


def _run_compute(rank: int, index: int, action: Action, durations: _Durations, state: _RankState) -> None:
    """Run one compute action on the rank's compute stream, once its inputs and its stash are there."""
    op = action.op
    start = state.clock + durations.costs.host_compute
    key = (action.microbatch, action.chunk)
    if op is not Op.BW:
        arrived = state.inputs_at.pop((Op.F if op is Op.F else Op.B, *key), None)
        if arrived is not None and arrived > start:
            start = arrived
    if op is Op.F:
        start = max(start, state.evicted_at)
    elif op is not Op.BW:
        if key in state.away:
            raise ScheduleError(f"rank {rank}, action {index} ({action}): its stash was sent away by "
                                f"{state.away[key][0].value} and never brought back")
        start = max(start, state.back_at.pop(key, start))
    _, duration, size = durations.compute(rank, op, action.chunk)
    if durations.extra:
        duration += durations.extra.get((rank, str(action)), 0.0)
    state.busy += duration
    if op is Op.F:
        state.ledger.change(start, +1, size)
    elif op is not Op.BI:
        state.ledger.change(start + duration, -1, size)
    state.clock = start + duration
    state.timeline.append((action, start, start + duration))


def _run_transfer(schedule: Schedule, rank: int, index: int, action: Action, costs: CostModel,
                  states: list[_RankState]) -> None:
    """Time one stash transfer on its lane and record what it does to resident and parked stashes."""
    state = states[rank]
    key = (action.microbatch, action.chunk)
    lane = ("host", None) if action.op in (Op.OFFLOAD, Op.RELOAD) else (action.op.value, action.peer)
    stage = schedule.stage_of(rank, action.chunk)
    duration = costs.transfer_time(action.op, stage, schedule.options.get("offload_time"))
    size = costs.stash_size(stage)
    start = max(state.clock, state.lanes.get(lane, 0.0))
    partner = None
    if action.op in PARTNER_OP:  # the acceptor's ACCEPT / RETURN is posted (simulate checked)
        partner = states[action.peer]
        posted, partner_index = partner.hosting.pop((PARTNER_OP[action.op], action.microbatch, action.chunk))
        start = max(start, posted)
    if action.op in RETURN_TRANSFER:
        if key in state.away:
            raise ScheduleError(f"rank {rank}, action {index} ({action}): stash already sent away by "
                                f"{state.away[key][0].value}")
        end = start + duration
        state.away[key] = (action.op, end)
        state.ledger.change(end, -1, size)  # device memory is free only once the copy has completed
        state.parked.change(end, +1)
        if action.op is Op.EVICT:
            state.evicted_at = max(state.evicted_at, end)
    else:
        outbound = next(op for op, back in RETURN_TRANSFER.items() if back is action.op)
        if state.away.get(key, (None,))[0] is not outbound:
            raise ScheduleError(f"rank {rank}, action {index} ({action}): no {outbound.value} of this stash "
                                "before it")
        start = max(start, state.away.pop(key)[1])
        end = start + duration
        state.back_at[key] = end
        state.ledger.change(start, +1, size)  # the buffer it lands in is allocated when the copy starts
        state.parked.change(end, -1)
        if action.op is Op.LOAD:
            states[action.peer].ledger.change(end, -1, size)
            if key in states[action.peer].guests:
                states[action.peer].guests[key] = end
    state.lanes[lane] = end
    state.transfer_busy += duration
    state.timeline.append((action, start, end))
    if partner is not None:
        hosted, posted, _ = partner.timeline[partner_index]
        partner.timeline[partner_index] = (hosted, posted, end)


POSTING_PROBES = (CostModel(), CostModel(backward_input=1.5, backward_weight=0.5),
                  CostModel(backward_input=0.5, backward_weight=1.5),
                  CostModel(backward=3.0, backward_input=1.5, backward_weight=1.5),
                  CostModel(backward=1.5, backward_input=0.75, backward_weight=0.75))
"""Cost ratios `receives_ahead` times a list under (ours): equal costs, BI or BW three times the other, and a
backward 1.5 or 3 times the forward (the measured split here, BI 1.14 : BW 0.95, lies inside)."""


def receives_ahead(schedule: Schedule, probes: Sequence[CostModel] = POSTING_PROBES) -> list[dict[int, int]]:
    """Per rank and incoming link (keyed by the sending peer): how many receives the executor keeps posted
    ahead on that link, K, so that none is posted after its send on the simulated timeline under any of
    `probes`. With K ahead, receive j of a link is posted when the rank reaches receive j - K of that link
    (the first K when the step starts); K is the least such that, for every j, the rank reaches receive
    j - K strictly before the sender reaches send j (a tie is a race in a real run). At least 1; at most
    the link's message count (every receive posted at the start). Each holds one activation-sized buffer
    from its posting until its consumer, so K is also the number of early buffers per link.

    Worked: 1F1B at any p and m needs 1 (a rank reaches RECV_F j+1 only after F j, which waits for F j on
    the previous rank, before that rank's send j+1); looped BFS needs p at v = 2 (a rank receives a whole
    round of m forwards from its predecessor before it reaches the next receive of the round)."""
    need: list[dict[int, int]] = [dict() for _ in range(schedule.num_ranks)]
    for costs in probes:
        sends: dict[tuple[int, int], list[float]] = {}
        reach: dict[tuple[int, int], list[float]] = {}
        for rank, timeline in enumerate(simulate(schedule, costs).timeline):
            for action, start, _ in timeline:
                if action.op in (Op.SEND_F, Op.SEND_B):
                    sends.setdefault((rank, action.peer), []).append(start)
                elif action.op in (Op.RECV_F, Op.RECV_B):
                    reach.setdefault((action.peer, rank), []).append(start)
        for (peer, rank), reached in reach.items():
            k, i = need[rank].get(peer, 1), -1  # i: the last receive reached strictly before send j
            for j, sent in enumerate(sends[peer, rank]):
                while i + 1 <= j and reached[i + 1] < sent:
                    i += 1
                k = max(k, j - i)
            need[rank][peer] = k
    return need
