"""PipeDream-2BW's lists: the generator, what the validator proves about them, the per-call segments and
the simulated step time (no (p−1) flush term, and the deferred global operations never wait)."""
from __future__ import annotations

import dataclasses
import textwrap

import pytest

from megatron_pp.schedules import twobw
from megatron_pp.schedules.ir import COMM_OPS, Action, Op, ScheduleError
from megatron_pp.schedules.registry import build_schedule
from megatron_pp.schedules.simulate import CostModel, simulate
from megatron_pp.schedules.twobw import CallKind, build_plan, check_weight_versions, cut_calls, two_bw, unrolled
from megatron_pp.schedules.validate import validate

GRID = [(p, m) for p in (1, 2, 3, 4, 5, 8) for m in sorted({p, p + 1, 2 * p, 2 * p + 3})]


def test_docstring_table_is_the_generated_one():
    assert textwrap.indent(twobw.steady_table(), "    ") in twobw.__doc__


def test_one_step_is_1f1b_with_a_step_at_the_end():
    """steps=1 (what `--pipeline-schedule 2bw` registers) is one flushed step: 1F1B's order on version 0,
    then the update that creates version 2."""
    for p, m in GRID:
        schedule, flush = build_schedule("2bw", p, m), build_schedule("1f1b", p, m)
        for ours, theirs in zip(schedule.actions, flush.actions):
            assert ours[-1] == Action(Op.STEP, version=2)
            assert [dataclasses.replace(a, version=None) for a in ours[:-1]] == theirs


def test_every_grid_point_unrolls_validly():
    for p, m in GRID:
        for steps in (1, 2, 3, 5):
            schedule = unrolled(p, m, steps)
            assert schedule.num_microbatches == steps * m
            assert [sum(a.op is Op.STEP for a in acts) for acts in schedule.actions] == [steps] * p
        build_plan(p, m)


def test_fewer_microbatches_than_stages_is_refused():
    with pytest.raises(ValueError, match=r"m >= p\), got m=3, p=4.*third weight version"):
        build_schedule("2bw", 4, 3)
    with pytest.raises(ValueError, match="has no virtual stages"):
        build_schedule("2bw", 2, 4, 2)


def test_next_batch_forwards_precede_the_end_of_the_batch():
    """The steady state spans the step boundary: rank s runs p−s−1 forwards of batch t+1 before its last
    backward of batch t, and all of batch t+1's forwards before batch t's update (STEP@(t+2))."""
    p, m = 4, 8
    schedule = two_bw(p, m, 3)
    for rank, acts in enumerate(schedule.actions):
        last_b0 = max(i for i, a in enumerate(acts) if a.op is Op.B and a.microbatch < m)
        early = [a for a in acts[:last_b0] if a.op is Op.F and m <= a.microbatch < 2 * m]
        assert [a.microbatch for a in early] == list(range(m, m + p - 1 - rank))
        step = acts.index(Action(Op.STEP, version=2))
        assert all(a.version == 1 for a in acts[:step] if a.op is Op.F and a.microbatch >= m)
        assert sum(1 for a in acts[:step] if a.op is Op.F and a.microbatch // m == 1) == m


@pytest.mark.parametrize("edit, message", [
    # The update of batch 0 moved after the first forward that needs its version.
    (lambda acts: _swap_step_with_next(acts, 2, Op.F), "version 2 is not in buffer 0"),
    # A forward of batch 2 on the old version (pitfall 2 in docs/2bw.md).
    (lambda acts: [dataclasses.replace(a, version=1) if a.op is Op.F and a.microbatch == 16 else a for a in acts],
     "must run on version 2"),
    # One of rank 0's three early forwards of batch 1 moved after batch 0's end: the pipeline drains.
    (lambda acts: [a for a in acts if not (a.op is Op.F and a.microbatch == 8)]
     + [Action(Op.F, 8, 0, version=1)], "ends with 2 forwards of batch 1 in flight, expected 3"),
    # The update applied before the batch's gradient is complete.
    (lambda acts: _swap_step_with_previous(acts, 2, Op.B), "before its last backward"),
])
def test_the_2bw_checks_catch_broken_lists(edit, message):
    p, m = 4, 8
    schedule = two_bw(p, m, 3)
    schedule.actions[0] = edit(list(schedule.actions[0]))
    with pytest.raises(ScheduleError, match=message):
        check_weight_versions(schedule)


def _step_at(acts, version, index):
    """`acts` with STEP@version moved to position `index` (of the list without it)."""
    step = Action(Op.STEP, version=version)
    rest = [a for a in acts if a != step]
    return rest[:index] + [step] + rest[index:]


def test_the_2bw_checks_at_the_first_and_last_versions():
    p, m = 2, 2

    def refused(rank, edit, message, steps=2):
        schedule = two_bw(p, m, steps)
        schedule.actions[rank] = edit(list(schedule.actions[rank]))
        with pytest.raises(ScheduleError, match=message):
            check_weight_versions(schedule)

    # A STEP must make version 2 or later, and say which.
    for version in (None, 0, 1):
        refused(0, lambda acts: [Action(Op.STEP, version=version)] + acts,
                r"^rank 0, action 0 \(STEP[@0-9]*\): a STEP must create a new version v >= 2, once$")
    # The last rank ends batch 0 before its first forward of batch 1: an update placed right there comes
    # before batch 1's forwards (which must still see version 1 next to it) -- at the last batch's update too.
    last = p - 1
    for steps in (2, 3):
        def early(acts):
            end_of_batch0 = max(i for i, a in enumerate(acts) if a.op is Op.B and a.microbatch < m)
            return _step_at(acts, 2, end_of_batch0 + 1)
        refused(last, early, r"STEP@2\): the update for batch 0 comes before the last forward of batch 1$", steps)
    # With two steps, batch 0 is also the last but one: rank 0's early forward of batch 1 moved after batch 0's
    # end drains the pipeline there too.
    def drained(acts):
        early = Action(Op.F, m, 0, version=1)
        rest = [a for a in acts if a != early]
        end_of_batch0 = max(i for i, a in enumerate(rest) if a.op is Op.B and a.microbatch < m)
        return rest[:end_of_batch0 + 1] + [early] + rest[end_of_batch0 + 1:]
    refused(0, drained, r"B1.0@0\): batch 0 ends with 0 forwards of batch 1 in flight, expected 1", 2)
    # A forward repeated in batch 0: its stash is still live when the update overwrites version 0.
    def repeated(acts):
        i = next(i for i, a in enumerate(acts) if a.op is Op.F)
        return acts[:i + 1] + [acts[i]] + acts[i + 1:]
    schedule = two_bw(p, m, 3)
    at = [a for a in repeated(list(schedule.actions[0]))].index(Action(Op.STEP, version=2))
    refused(0, repeated, rf"^rank 0, action {at} \(STEP@2\): buffer 0 still holds version 0 in use \(1 stashes live\)", 3)


@pytest.mark.parametrize("p, m, steps", [(2, 2, 2), (3, 3, 3), (4, 6, 2), (1, 2, 3)])
def test_calls_cut_each_list_after_its_batchs_last_backward(p, m, steps):
    lists = unrolled(p, m, steps).actions
    calls = cut_calls(unrolled(p, m, steps))
    assert len(calls) == steps
    for rank, acts in enumerate(lists):
        pieces = [call[rank] for call in calls]
        assert [a for piece in pieces for a in piece] == acts  # every action once, in order, from the first
        for batch, piece in enumerate(pieces):
            backwards = [i for i, a in enumerate(piece) if a.op is Op.B]
            assert {piece[i].microbatch // m for i in backwards} == {batch}
            if batch < steps - 1:  # after its last backward: only the messages that close it
                assert all(a.op in COMM_OPS for a in piece[backwards[-1] + 1:])
                assert pieces[batch + 1][0].op is not Op.STEP  # the next batch's forwards come before its update


def test_the_plan_reproduces_every_call_of_the_unrolled_lists():
    from megatron_pp.schedules.twobw import call_kinds

    for p, m in ((2, 2), (3, 4)):
        plan = build_plan(p, m)
        for steps in (1, 2, 3, 4):
            calls = cut_calls(unrolled(p, m, steps))
            for batch, kind in enumerate(call_kinds(steps)):
                for rank in range(p):
                    assert plan.segment(kind, rank, batch) == calls[batch][rank], (p, m, steps, batch, kind, rank)


def test_a_call_whose_messages_cross_into_the_next_is_refused():
    from megatron_pp.schedules.twobw import _check_call_is_closed

    def call(*rows):
        return [[Action.parse(t) for t in row.split()] for row in rows]

    _check_call_is_closed(call("F0.0 SEND_F0.0>1", "RECV_F0.0<0 F0.0"))
    for crossing in (call("F0.0 SEND_F0.0>1", "F1.0"), call("F0.0 SEND_F0.0>1 F1.0 SEND_F1.0>1", "RECV_F0.0<0 F0.0")):
        with pytest.raises(ScheduleError, match=r"^2bw: a call's messages cross into the next call"):
            _check_call_is_closed(crossing)


def _swap_step_with_next(acts, version, op):
    i = acts.index(Action(Op.STEP, version=version))
    j = next(k for k in range(i + 1, len(acts)) if acts[k].op is op)
    acts[i], acts[j] = acts[j], acts[i]
    return acts


def _swap_step_with_previous(acts, version, op):
    i = acts.index(Action(Op.STEP, version=version))
    j = max(k for k in range(i) if acts[k].op is op and acts[k].microbatch < 8)
    return acts[:j] + [acts[i]] + acts[j:i] + acts[i + 1:]


def test_a_backward_on_another_version_than_its_forward_is_refused():
    """Pitfall 1 in docs/2bw.md, caught by the generic validator."""
    schedule = build_schedule("2bw", 2, 4, steps=2)
    acts = schedule.actions[0]
    i = next(k for k, a in enumerate(acts) if a.op is Op.B and a.microbatch == 4)
    acts[i] = dataclasses.replace(acts[i], version=2)
    with pytest.raises(ScheduleError, match="weight version 2 differs from its forward's 1"):
        validate(schedule)


def test_segments_shift_and_close():
    """Each kind of call, cut from the unrolled lists, is the same for any batch up to numbering; on every
    link a call receives exactly what the peer's same call sends."""
    p, m = 4, 4
    plan = build_plan(p, m)
    calls = cut_calls(unrolled(p, m, 5))
    for rank in range(p):
        assert calls[0][rank] == plan.segment(CallKind.WARMUP, rank, 0)
        for batch in (1, 2, 3):
            assert calls[batch][rank] == plan.segment(CallKind.STEADY, rank, batch)
        assert calls[4][rank] == plan.segment(CallKind.COOLDOWN, rank, 4)
    steady = plan.segment(CallKind.STEADY, 0, 7)
    assert {a.version for a in steady if a.op is Op.B} == {7}
    assert [a for a in steady if a.op is Op.STEP] == [Action(Op.STEP, version=8)]
    assert [a.microbatch for a in steady if a.op is Op.F][-p + 1:] == [32, 33, 34]


@pytest.mark.parametrize("costs", [CostModel(), CostModel(forward=1.0, backward=1.0),
                                   CostModel(forward=1.0, backward=3.0, p2p_latency=0.3)],
                         ids=["F1B2", "F1B1", "F1B3-latency"])
def test_steady_step_time_has_no_flush_term(costs):
    """Each further step adds m·(t_F + t_B) to 2BW's makespan, (m + p − 1)·(t_F + t_B) to flushed 1F1B's;
    the bubble is paid once per run."""
    f, b = costs.forward, costs.backward
    for p in (2, 4, 8):
        for m in (p, 2 * p):
            spans = [simulate(unrolled(p, m, steps), costs).makespan for steps in (3, 4, 5)]
            step = [later - earlier for earlier, later in zip(spans, spans[1:])]
            flush = simulate(build_schedule("1f1b", p, m), costs).makespan
            if costs.p2p_latency == 0:
                assert step == pytest.approx([m * (f + b)] * 2)
                assert flush == pytest.approx((m + p - 1) * (f + b))
            else:
                # Latency slows the steady state a little, but never by what a flush costs.
                assert step[0] == pytest.approx(step[1])
                assert step[0] <= flush - (p - 1) * (f + b) + 1e-9


def test_deferred_global_operations_never_wait():
    """Every rank finishes batch t (and posts its norm, inf flag and tied-embedding share) at least one
    forward's time before any rank reaches STEP@(t+2), even at m = p: the deferred update waits for nothing."""
    for costs in (CostModel(), CostModel(forward=1.0, backward=1.0), CostModel(p2p_latency=0.3)):
        for p in (1, 2, 3, 4, 8):
            for m in (p, p + 1, 2 * p):
                steps = 5
                result = simulate(unrolled(p, m, steps), costs)
                finished: dict[int, float] = {}
                stepped: dict[int, float] = {}
                for timeline in result.timeline:
                    for action, start, end in timeline:
                        if action.op is Op.B:
                            batch = action.microbatch // m
                            finished[batch] = max(finished.get(batch, 0.0), end)
                        elif action.op is Op.STEP and action.version <= steps:  # the last one is the flush
                            stepped[action.version] = min(stepped.get(action.version, float("inf")), start)
                slack = min(stepped[v] - finished[v - 2] for v in stepped)
                assert slack >= costs.forward - 1e-9, (p, m, costs, slack)


def test_memory_equals_1f1b():
    """Stashes as 1F1B (rank s holds p − s), plus one extra weight version."""
    for p in (2, 4, 8):
        for m in (p, 2 * p):
            assert simulate(unrolled(p, m, 4)).peak_stash == [p - s for s in range(p)]
