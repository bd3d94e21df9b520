"""The simulator against the closed forms of docs/schedules.md ("Formulas and their sources") and against
hand-timed small cases."""
import pytest

from megatron_pp.schedules.generators import looped_placement
from megatron_pp.schedules.ir import Action, Op, Schedule, ScheduleError
from megatron_pp.schedules.registry import build_schedule
from megatron_pp.schedules.simulate import CostModel, simulate

GRID_P = (1, 2, 3, 4, 5, 8)
GRID_M = tuple(range(1, 17))


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_flush_schedules_match_closed_forms(name):
    for p in GRID_P:
        for m in GRID_M:
            result = simulate(build_schedule(name, p, m))
            # Uniform stages, F=1, B=2: m+p-1 slots of F+B each.
            assert result.makespan == pytest.approx(3 * (m + p - 1), abs=1e-9)
            assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-9)
            assert result.busy == [3.0 * m] * p
            expected_peak = [m] * p if name == "gpipe" else [min(p - s, m) for s in range(p)]
            assert result.peak_stash == expected_peak, (p, m)


@pytest.mark.parametrize("forward, backward", [(1.0, 1.0), (2.0, 3.0), (0.5, 1.5)])
def test_one_f_one_b_bubble_holds_for_any_uniform_costs(forward, backward):
    for p, m in [(4, 8), (3, 2), (6, 13)]:
        result = simulate(build_schedule("1f1b", p, m), CostModel(forward=forward, backward=backward))
        assert result.makespan == pytest.approx((m + p - 1) * (forward + backward), abs=1e-9)
        assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-9)


def test_interleaved_matches_closed_forms():
    checked = 0
    for p in GRID_P:
        for v in (2, 3, 4):
            for m in GRID_M:
                try:
                    schedule = build_schedule("interleaved-1f1b", p, m, v)
                except ValueError:
                    continue  # a short last group that deadlocks; covered in test_generators
                result = simulate(schedule)
                # Peak = warm-up forwards + the first steady forward, capped by all m*v chunk-forwards.
                assert result.peak_stash == [min(2 * (p - r - 1) + (v - 1) * p + 1, m * v) for r in range(p)]
                if m % p == 0:
                    assert result.makespan == pytest.approx(3 * (v * m + p - 1), abs=1e-9)
                    assert result.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-9)
                    # arXiv 2104.04473 §2.2: rank 0 holds v*p + p - 1 chunk stashes (all v*m of them if m = p).
                    assert result.peak_stash[0] == (v * p + p - 1 if m > p else v * m)
                    checked += 1
    assert checked == 114  # every (p, v, m) of the grid with m a multiple of p


def test_p2p_latency_delays_every_crossing():
    result = simulate(build_schedule("1f1b", 2, 1), CostModel(p2p_latency=0.5))
    assert result.makespan == pytest.approx(1 + 0.5 + 1 + 2 + 0.5 + 2)
    recv = [(str(a), s, e) for a, s, e in result.timeline[1] if a.op is Op.RECV_F]
    assert recv == [("RECV_F0.0<0", 0.0, 1.5)]


def test_stage_weights_scale_durations_and_memory_follows():
    result = simulate(build_schedule("gpipe", 2, 1), CostModel(stage_weights=[1, 3]))
    assert result.makespan == pytest.approx(1 + 3 + 6 + 2)
    assert result.busy == [3.0, 9.0]
    assert result.memory == [[(0.0, 0), (0.0, 1), (12.0, 0)], [(0.0, 0), (1.0, 1), (10.0, 0)]]
    timeline = [(str(a), s, e) for a, s, e in result.timeline[0]]
    assert timeline == [("F0.0", 0.0, 1.0), ("SEND_F0.0>1", 1.0, 1.0), ("RECV_B0.0<1", 1.0, 10.0), ("B0.0", 10.0, 12.0)]


def test_measured_costs_as_table_or_function():
    schedule = build_schedule("gpipe", 2, 1)
    assert simulate(schedule, CostModel(measured={(Op.F, 1): 5.0})).makespan == pytest.approx(1 + 5 + 2 + 2)
    assert simulate(schedule, CostModel(measured=lambda op, stage: 1.0 + stage)).makespan == pytest.approx(
        1 + 2 + 2 + 1)


def _single(text: str, m: int = 1) -> Schedule:
    return Schedule("hand", 1, m, 1, looped_placement(1, 1), [[Action.parse(t) for t in text.split()]])


def test_split_backward_frees_the_stash_at_the_end_of_bw():
    result = simulate(_single("F0.0 F1.0 BI0.0 BW0.0 BI1.0 BW1.0", 2))
    assert result.memory == [[(0.0, 0), (0.0, 1), (1.0, 2), (4.0, 1), (6.0, 0)]]
    assert result.peak_stash == [2] and result.busy == [6.0] and result.bubble_fraction == 0.0


def test_bookkeeping_actions_take_no_time():
    result = simulate(_single("F0.0 B0.0 REDUCE_GRAD.0 STEP"))
    assert [(str(a), s, e) for a, s, e in result.timeline[0]][2:] == [("REDUCE_GRAD.0", 3.0, 3.0), ("STEP", 3.0, 3.0)]
    assert result.makespan == 3.0


def test_unsupported_and_stuck_schedules_raise():
    with pytest.raises(ScheduleError, match=r"rank 0, action 2 \(B0.0\): its stash was sent away by OFFLOAD"):
        simulate(_single("F0.0 OFFLOAD0.0 B0.0"))
    stuck = Schedule("hand", 2, 1, 1, looped_placement(2, 1),
                     [[Action.parse(t) for t in "F0.0 B0.0".split()],
                      [Action.parse(t) for t in "RECV_F0.0<0 F0.0 B0.0".split()]])
    with pytest.raises(ScheduleError, match=r"cannot proceed; waiting at rank 1, action 0 \(RECV_F0.0<0\)"):
        simulate(stuck)


@pytest.mark.parametrize("field,zero,negative", [
    ("forward", 0.0, -1e-9), ("backward", 0.0, -1e-9), ("backward_input", 0.0, -1e-9),
    ("backward_weight", 0.0, -1e-9), ("p2p_latency", 0.0, -1e-9), ("transfer", 0.0, -1e-9),
    ("stage_weights", [0.0, 1.0], [1.0, -1e-9]), ("stash_bytes", [0.0, 1.0], [1.0, -1e-9])])
def test_cost_model_accepts_zero_and_refuses_below_it(field, zero, negative):
    CostModel(**{field: zero})
    with pytest.raises(ValueError, match=f"CostModel.{field} must be >= 0"):
        CostModel(**{field: negative})


def test_peer_bandwidth_must_be_positive_and_comes_with_stash_bytes():
    assert CostModel(stash_bytes=[1.0, 1.0], peer_bandwidth=1e-9).peer_bandwidth == 1e-9
    for bad in (0.0, -1.0):  # a zero bandwidth would divide by zero when EVICT/LOAD are timed
        with pytest.raises(ValueError, match="peer_bandwidth must be > 0 and needs stash_bytes"):
            CostModel(stash_bytes=[1.0, 1.0], peer_bandwidth=bad)
    with pytest.raises(ValueError, match="peer_bandwidth must be > 0 and needs stash_bytes"):
        CostModel(peer_bandwidth=1.0)


def test_cost_model_rejects_bad_values():
    with pytest.raises(ValueError, match="CostModel.backward must be >= 0"):
        CostModel(backward=-1)
    with pytest.raises(ValueError, match="stage_weights must be >= 0"):
        CostModel(stage_weights=[1, -1])
    with pytest.raises(ValueError, match="has 3 entries, schedule '1f1b' has 2 stages"):
        simulate(build_schedule("1f1b", 2, 2), CostModel(stage_weights=[1, 1, 1]))
    with pytest.raises(ValueError, match="negative duration -1.0 for F on stage 0"):
        simulate(build_schedule("1f1b", 2, 2), CostModel(measured=lambda op, stage: -1.0))


def test_cost_model_keeps_its_own_copy_of_per_stage_lists():
    # A caller that reuses its list (a planner sweeping stage weights) must not change a model already made,
    # and models stay hashable values, as frozen dataclasses promise.
    weights, stash = [1, 3], [2, 4]
    model = CostModel(stage_weights=weights, stash_bytes=stash)
    weights[1] = 100
    stash[1] = 100
    assert model.stage_weights == (1.0, 3.0) and model.stash_bytes == (2.0, 4.0)
    assert hash(model) == hash(CostModel(stage_weights=(1.0, 3.0), stash_bytes=(2.0, 4.0)))
    assert simulate(build_schedule("gpipe", 2, 1), model).makespan == pytest.approx(1 + 3 + 6 + 2)


def test_a_measured_duration_of_zero_is_accepted():
    # Zero is a real measurement (an empty stage, an op fused away); only a negative one is refused.
    schedule = build_schedule("gpipe", 2, 1)
    assert simulate(schedule, CostModel(measured={(Op.F, 1): 0.0})).makespan == pytest.approx(1 + 0 + 2 + 2)
    assert simulate(schedule, CostModel(measured=lambda op, stage: 0.0)).makespan == 0.0


def test_stash_bytes_has_one_entry_per_stage():
    with pytest.raises(ValueError, match="stash_bytes has 1 entries, schedule '1f1b' has 2 stages"):
        simulate(build_schedule("1f1b", 2, 2), CostModel(stash_bytes=[1.0]))
    with pytest.raises(ValueError, match="stash_bytes has 3 entries, schedule '1f1b' has 2 stages"):
        simulate(build_schedule("1f1b", 2, 2), CostModel(stash_bytes=[1.0, 1.0, 1.0]))
    model = CostModel(stash_bytes=[3.0, 5.0])
    assert [model.stash_size(stage) for stage in (0, 1)] == [3.0, 5.0]
    with pytest.raises(ValueError, match="stash_bytes has 2 entries, no stage 2"):
        model.stash_size(2)  # asked directly, past the end: named, not an IndexError


def test_measured_function_also_times_the_stash_transfers():
    # A measured function replaces the cost model entirely, host copies included (the table form is tested
    # with PipeOffload's own figures): the transfer lanes are busy exactly its OFFLOAD + RELOAD time.
    def measured(op, stage):
        return {Op.F: 1.0, Op.B: 2.0, Op.OFFLOAD: 0.25, Op.RELOAD: 0.5}[op]

    schedule = build_schedule("1f1b", 4, 8, offload_chunks=1)
    result = simulate(schedule, CostModel(measured=measured))
    copies = [(sum(a.op is Op.OFFLOAD for a in acts), sum(a.op is Op.RELOAD for a in acts))
              for acts in schedule.actions]
    assert copies[0] == (8, 8)
    assert result.transfer_busy == pytest.approx([0.25 * out + 0.5 * back for out, back in copies])
    assert result.busy == [24.0] * 4


def test_a_transfer_time_of_zero_is_accepted_and_a_negative_one_named():
    schedule = build_schedule("1f1b", 4, 8, offload_chunks=1)
    free = simulate(schedule, CostModel(transfer=0.0))  # copies that cost nothing: the plain 1F1B time
    assert free.transfer_busy == [0.0] * 4
    assert free.makespan == simulate(build_schedule("1f1b", 4, 8)).makespan
    with pytest.raises(ValueError, match="negative duration -0.5 for OFFLOAD on stage 0"):
        simulate(schedule, CostModel(measured={(Op.OFFLOAD, 0): -0.5}))
