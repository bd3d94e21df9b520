"""The simulator against an independent brute-force replay, for random schedules and random, unequal costs.

`replay` below is written from the simulator's documented rules only, by a different method: a Kleene
iteration. Every receive's arrival time starts at 0; each round times every rank's list alone, given
the current arrival times (compute actions run one after another on the rank's stream; a compute waits
for the receive that holds its input, not for the rest of its batch; a batch is posted when the rank reaches it
and its sends arrive `p2p_latency` later), and the sends' new arrival times feed the next round. The
times only grow and are bounded, so the rounds reach the least fixed point, the schedule's timing.
Sends are matched to receives by what they carry ((forward or backward, microbatch, destination
stage), in order), not by the simulator's link slots. Checked: each compute action's start and end,
the makespan, busy times, bubble fraction and the stash curves and their peaks (+1 at a forward's start, -1 at the end
of the backward that frees it: B, or BW when the backward is split), plus the closed forms of GPipe and
1F1B with equal stages. Schedules that move stashes off the device are left to tests/schedules/test_offload.py
and test_bpipe.py, which time their transfer lanes by hand.
"""
from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pp.schedules.ir import COMM_OPS, COMPUTE_OPS, SEND_OPS, Op
from megatron_pp.schedules.registry import build_schedule
from megatron_pp.schedules.simulate import CostModel, simulate

# derandomize + database=None: the same examples in every run, so CI cannot flake on a new one.
PROPERTY = settings(max_examples=60, deadline=None, derandomize=True, database=None)

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "gis", "gis-h", "looped-bfs", "2bw"]
VIRTUAL = {"interleaved-1f1b", "gis", "gis-h", "looped-bfs"}


def _carried(schedule, rank, action):
    """What a send or receive carries: (direction, microbatch, stage it is for, weight version)."""
    stage = schedule.stage_of(rank, action.chunk)
    if action.op is Op.SEND_F:
        stage += 1
    elif action.op is Op.SEND_B:
        stage -= 1
    forward = action.op in (Op.SEND_F, Op.RECV_F)
    return forward, action.microbatch, stage, action.version


def _time_rank(schedule, rank, costs, arrivals):
    """One rank's list alone, given when each receive's data arrives (by (key, occurrence))."""
    clock, busy = 0.0, 0.0
    compute = {}  # list index -> (start, end)
    sends = []  # (key, time the data arrives at the receiver)
    ready = {}  # (F or B, microbatch, chunk) -> when its input is here (its own receive, not its batch's)
    seen = defaultdict(int)
    acts = schedule.actions[rank]
    i = 0
    while i < len(acts):
        a = acts[i]
        if a.op in COMM_OPS:
            j = i
            while j < len(acts) and acts[j].op in COMM_OPS:
                j += 1
            for b in acts[i:j]:
                key = _carried(schedule, rank, b)
                occurrence = (key, seen[key, b.op in SEND_OPS])
                seen[key, b.op in SEND_OPS] += 1
                if b.op in SEND_OPS:
                    sends.append((occurrence, clock + costs.p2p_latency))
                else:
                    consumer = (Op.F if b.op is Op.RECV_F else Op.B, b.microbatch, b.chunk)
                    ready[consumer] = max(clock, arrivals.get(occurrence, 0.0))
            i = j
            continue
        start = clock
        if a.op in COMPUTE_OPS:
            consumer = Op.F if a.op is Op.F else Op.B
            if a.op is not Op.BW:
                start = max(start, ready.pop((consumer, a.microbatch, a.chunk), start))
            duration = costs.duration(a.op, schedule.stage_of(rank, a.chunk))
            busy += duration
            compute[i] = (start, start + duration)
            clock = start + duration
        i += 1
    return clock, busy, compute, sends


def replay(schedule, costs):
    arrivals: dict = {}
    for _ in range(sum(len(a) for a in schedule.actions) + 2):
        timed = [_time_rank(schedule, r, costs, arrivals) for r in range(schedule.num_ranks)]
        new = {occurrence: t for _, _, _, sends in timed for occurrence, t in sends}
        if new == arrivals:
            break
        arrivals = new
    else:
        raise AssertionError("the replay did not settle: the schedule waits in a cycle")
    makespan = max(clock for clock, _, _, _ in timed)
    curves = []
    for rank, (_, _, compute, _) in enumerate(timed):
        split = any(a.op is Op.BW for a in schedule.actions[rank])
        frees = Op.BW if split else Op.B
        events = []  # in list order, which is time order on one compute stream with positive durations
        for i, (start, end) in sorted(compute.items()):
            op = schedule.actions[rank][i].op
            if op is Op.F:
                events.append((start, 1))
            elif op is frees:
                events.append((end, -1))
        level, curve = 0, [(0.0, 0)]
        for time, delta in sorted(events, key=lambda e: e[0]):
            level += delta
            curve.append((time, level))
        curves.append(curve)
    return makespan, [busy for _, busy, _, _ in timed], [c for _, _, c, _ in timed], curves


@st.composite
def cases(draw):
    name = draw(st.sampled_from(SCHEDULES))
    p = draw(st.integers(1, 4))
    v = draw(st.integers(2, 3)) if name in VIRTUAL else 1
    m = draw(st.integers(1, 9))
    positive = st.floats(0.1, 4.0, allow_nan=False, allow_infinity=False)
    costs = CostModel(forward=draw(positive), backward=draw(positive), backward_input=draw(positive),
                      backward_weight=draw(positive), p2p_latency=draw(st.sampled_from([0.0, 0.3, 1.7])),
                      stage_weights=draw(st.lists(positive, min_size=p * v, max_size=p * v)))
    return name, p, m, v, costs


def _build(name, p, m, v):
    try:
        return build_schedule(name, p, m, v) if name in VIRTUAL else build_schedule(name, p, m)
    except ValueError:  # a size the generator refuses (e.g. m < p where it needs m >= p)
        return None


@PROPERTY
@given(cases())
def test_simulator_matches_brute_force_replay(case):
    name, p, m, v, costs = case
    schedule = _build(name, p, m, v)
    if schedule is None:
        return
    result = simulate(schedule, costs)
    makespan, busy, compute, curves = replay(schedule, costs)
    assert result.makespan == pytest.approx(makespan, rel=1e-12, abs=1e-12)
    assert result.busy == pytest.approx(busy, rel=1e-12)
    expected_bubble = sum((makespan - b) / makespan for b in busy) / len(busy)
    assert result.bubble_fraction == pytest.approx(expected_bubble, rel=1e-9, abs=1e-12)
    assert result.peak_stash == [max(level for _, level in curve) for curve in curves]
    for simulated, expected in zip(result.memory, curves):
        assert [level for _, level in simulated] == [level for _, level in expected]
        assert [time for time, _ in simulated] == pytest.approx([time for time, _ in expected], rel=1e-12)
    for rank, timeline in enumerate(result.timeline):
        simulated = [t for a, s, e in timeline if a.op in COMPUTE_OPS for t in (s, e)]
        assert simulated == pytest.approx([t for i in sorted(compute[rank]) for t in compute[rank][i]], rel=1e-12)


@PROPERTY
@given(st.sampled_from(["gpipe", "1f1b"]), st.integers(1, 6), st.integers(1, 12),
       st.floats(0.1, 4.0), st.floats(0.1, 4.0), st.floats(0.1, 3.0))
def test_flush_schedules_closed_forms_with_any_equal_stage_cost(name, p, m, forward, backward, weight):
    """Equal stages (any F, B, and one weight for all of them): m + p - 1 slots of F + B."""
    result = simulate(build_schedule(name, p, m), CostModel(forward=forward, backward=backward,
                                                            stage_weights=[weight] * p))
    slot = (forward + backward) * weight
    assert result.makespan == pytest.approx((m + p - 1) * slot, rel=1e-9)
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=1e-9, abs=1e-12)
    assert result.peak_stash == ([m] * p if name == "gpipe" else [min(p - s, m) for s in range(p)])


def test_unequal_stages_makespan_is_bounded_by_the_slowest_stage():
    """GPipe with one slow stage: the slow stage's m forwards and m backwards plus every other stage's
    one forward and one backward (the fill and drain), exactly, with zero latency."""
    for p, m, slow in [(3, 4, 1), (4, 5, 3), (2, 7, 0)]:
        weights = [1.0] * p
        weights[slow] = 3.0
        result = simulate(build_schedule("gpipe", p, m), CostModel(stage_weights=weights))
        others = sum(3.0 * w for s, w in enumerate(weights) if s != slow)
        assert result.makespan == pytest.approx(m * 9.0 + others)
