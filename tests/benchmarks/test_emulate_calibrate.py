"""The host-cost calibration of the emulated grids (megatron_pp/benchmarks/emulate_calibrate.py) on records made by
hand: gaps counted against the posts in them, the line through their medians, the latency from a send's post to
its waiting consumer's input, and the simulator given those costs."""
import pytest

from megatron_pp.benchmarks.emulate_calibrate import (calibration_block, gap_samples, latency_samples,
                                                      line_through_medians, with_host_costs)
from megatron_pp.benchmarks.emulate_measure import compare
from megatron_pp.schedules.registry import build_schedule
from megatron_pp.schedules.simulate import CostModel, simulate


def test_line_through_medians_worked_example():
    intercept, slope, table = line_through_medians([(1, 0.2), (1, 0.3), (1, 0.3), (3, 0.7), (3, 0.7)])
    assert table == {1: [3, 0.3], 3: [2, 0.7]}
    assert slope == pytest.approx(0.2) and intercept == pytest.approx(0.1)


def test_a_preempted_gap_does_not_pull_the_line():
    samples = [(0, 0.1)] * 5 + [(0, 50.0)] + [(2, 0.5)] * 5
    intercept, slope, _ = line_through_medians(samples)
    assert intercept == pytest.approx(0.1) and slope == pytest.approx(0.2)


def test_one_post_count_only_gives_its_median_and_no_slope():
    assert line_through_medians([(2, 0.4), (2, 0.6), (2, 0.5)])[:2] == (0.5, 0.0)


def _record(compute, posts):
    """compute: (label, begin, end, waited); the cost is the time not waited (no overrun)."""
    return {"compute": [(label, b, e, w, 0.0, e - b - w, 0.0) for label, b, e, w in compute], "posts": posts}


# 1F1B at p = 2, m = 1: rank 0 runs F0, sends, receives B's gradient, runs B0; rank 1 receives, runs F0 and B0, sends.
ONE_MICROBATCH = [
    _record([("F0.0", 0.0, 1.0, 0.0), ("B0.0", 1.5, 7.1, 3.6)],
            [("send", 1, 1.1), ("recv", 1, 0.0), ("recv", 1, 1.2)]),
    _record([("F0.0", 0.2, 2.5, 1.3), ("B0.0", 2.6, 4.6, 0.0)],
            [("recv", 0, 0.0), ("send", 0, 4.7)]),
]


def test_gaps_count_the_posts_between_two_compute_actions():
    assert gap_samples(ONE_MICROBATCH) == [(2, pytest.approx(0.5)), (0, pytest.approx(0.1))]


def test_latency_is_a_sends_post_done_to_its_waiting_consumers_input():
    """Rank 1's F0 was called at 0.2 and had its input at 0.2 + 1.3 = 1.5: the send was posted at 1.1, done at
    1.1 + q (q = 0.05), latency 0.35. Rank 0's B0, called at 1.5, had its input at 1.5 + 3.6 = 5.1, its send
    posted at 4.7: 0.35 again. A consumer called after its send was posted gives no sample, even though it
    "waited" (gloo's receive completes only in the wait: some microseconds, or its own lateness)."""
    schedule = build_schedule("1f1b", 2, 1)
    assert latency_samples(schedule, ONE_MICROBATCH, 0.05) == [pytest.approx(0.35), pytest.approx(0.35)]
    in_already = [ONE_MICROBATCH[0], _record([("F0.0", 1.6, 2.5, 1e-5), ("B0.0", 2.6, 4.6, 0.0)],
                                             ONE_MICROBATCH[1]["posts"])]
    assert latency_samples(schedule, in_already, 0.05) == [pytest.approx(0.35)]


def test_the_block_and_the_cost_model_it_gives():
    schedule = build_schedule("1f1b", 2, 1)
    block = calibration_block(schedule, [ONE_MICROBATCH], 0.02, [1.0, 2.0])
    assert block["gaps"] == 2 and block["latency_samples"] == 2 and block["load_average"] == [1.0, 2.0]
    costs = with_host_costs(CostModel(forward=2.0), block)
    assert costs.forward == 2.0
    assert costs.host_compute == pytest.approx(block["host_compute_ms"] / 1e3)
    assert costs.host_post == pytest.approx(block["host_post_ms"] / 1e3)
    assert costs.p2p_latency == pytest.approx(block["p2p_latency_ms"] / 1e3)
    assert with_host_costs(costs, None) is costs
    # A median below 0 (a core per rank beats the estimate of when the send was done) is noise: 0.
    assert with_host_costs(CostModel(), {**block, "p2p_latency_ms": -0.013}).p2p_latency == 0.0


def test_rows_simulate_with_the_calibration_and_keep_the_ideal_beside_it():
    """`compare` times the lists twice: with the calibrated host costs (the targets' comparison) and without."""
    schedule = build_schedule("1f1b", 2, 1)
    steps = [ONE_MICROBATCH, ONE_MICROBATCH]
    for record, rank_events in zip(ONE_MICROBATCH, ([0.0, 7.1], [0.0, 4.7])):
        record.update(started=0.0, events=[("x", *rank_events)], copies=[], load=1.0)
    calibration = {"host_compute_ms": 100.0, "host_post_ms": 10.0, "p2p_latency_ms": 200.0}
    row = compare(schedule, CostModel(), steps, calibration)
    assert row["ideal_step_s"] == simulate(schedule).makespan == 6.0
    with_host = simulate(schedule, CostModel(host_compute=0.1, host_post=0.01, p2p_latency=0.2))
    assert row["simulated_step_s"] == with_host.makespan > row["ideal_step_s"]
    assert row["simulated_bubble"] == with_host.bubble_fraction
    assert row["step_error"] == pytest.approx(row["measured_step_s"] / with_host.makespan - 1)
    assert compare(schedule, CostModel(), steps)["simulated_step_s"] == row["ideal_step_s"]


def test_percentiles_and_draws_read_off_them():
    """101 points from the least to the largest sample; a draw is a uniform u in [0, 100) read off them, linear
    between: with the points 0, 1, ..., 100 ms that is u ms itself."""
    import random

    from megatron_pp.benchmarks.emulate_calibrate import latency_draw, percentiles

    points = percentiles([float(x) for x in range(101)])
    assert points == pytest.approx([float(x) for x in range(101)])
    draw, rng = latency_draw(points, seed=3), random.Random(3)
    for k in range(5):
        assert draw(0, 1, k) == pytest.approx(rng.random() * 100 / 1e3)


def test_rows_compare_the_mean_over_drawn_latencies():
    """With every percentile at 200 ms the draws are all 0.2 s: the drawn simulation is the one-latency one. With
    a spread (half the points at 0, half at 400 ms: the same median of 200 ms), the lists of 1F1B p = 2, m = 1
    cross two hops, so the mean step over draws differs from the median's, and the row compares that mean."""
    from megatron_pp.benchmarks.emulate_calibrate import LATENCY_DRAWS, drawn_simulation, latency_draw

    schedule = build_schedule("1f1b", 2, 1)
    base = {"host_compute_ms": 100.0, "host_post_ms": 10.0, "p2p_latency_ms": 200.0}
    flat = {**base, "latency_ms_percentiles": [200.0] * 101}
    at_median = simulate(schedule, CostModel(host_compute=0.1, host_post=0.01, p2p_latency=0.2))
    assert drawn_simulation(schedule, CostModel(), flat) == (pytest.approx(at_median.makespan),
                                                             pytest.approx(at_median.bubble_fraction))
    spread = {**base, "latency_ms_percentiles": [0.0] * 50 + [200.0] + [400.0] * 50}
    by_hand = []
    for seed in range(LATENCY_DRAWS):
        draw = latency_draw(spread["latency_ms_percentiles"], seed)
        first, second = draw(0, 1, 0), draw(1, 0, 0)  # F's activation, then B's gradient
        by_hand.append(at_median.makespan - 0.4 + first + second)
    step, _ = drawn_simulation(schedule, CostModel(), spread)
    assert step == pytest.approx(sum(by_hand) / len(by_hand)) and step != pytest.approx(at_median.makespan)
    steps = [ONE_MICROBATCH, ONE_MICROBATCH]
    for record, rank_events in zip(ONE_MICROBATCH, ([0.0, 7.1], [0.0, 4.7])):
        record.update(started=0.0, events=[("x", *rank_events)], copies=[], load=1.0)
    row = compare(schedule, CostModel(), steps, spread)
    assert row["simulated_step_s"] == pytest.approx(step)
    assert row["median_latency_step_s"] == pytest.approx(at_median.makespan)


def test_recent_ends_count_the_compute_actions_that_ended_just_before_a_send():
    """1F1B at p = 2, m = 1 in milliseconds: rank 0's F0 ends at 2 and its activation is posted at 5; rank 1's
    F0, called at 3, waits 6 for it (latency 9 - 5 = 4 ms). In the 4 ms up to the post one compute action
    ended (rank 0's F0 at 2); moved to 0.9 ms it is outside the window. Rank 1's gradient, posted at 21
    before rank 0's B0 was called (25), gives no sample."""
    from megatron_pp.benchmarks.emulate_calibrate import RECENT_ENDS_WINDOW_S, recent_ends

    assert RECENT_ENDS_WINDOW_S == 4e-3
    schedule = build_schedule("1f1b", 2, 1)

    def records(first_end: float) -> list[dict]:
        return [_record([("F0.0", 0.0, first_end, 0.0), ("B0.0", 0.025, 0.030, 0.0)], [("send", 1, 0.005)]),
                _record([("F0.0", 0.003, 0.012, 0.006), ("B0.0", 0.013, 0.020, 0.0)],
                        [("recv", 0, 0.0), ("send", 0, 0.021)])]
    assert recent_ends(schedule, records(0.002), 0.0) == [(1, pytest.approx(0.004))]
    assert recent_ends(schedule, records(0.0009), 0.0) == [(0, pytest.approx(0.004))]


def test_a_list_without_a_split_backward_has_one_calibration_for_both_cost_sets():
    from megatron_pp.benchmarks.emulate_calibrate import list_calibration_key

    assert list_calibration_key("1f1b", build_schedule("1f1b", 2, 4), "split") == "1f1b/equal"
    assert list_calibration_key("zb-h1", build_schedule("zb-h1", 2, 4), "split") == "zb-h1/split"
    assert list_calibration_key("zb-h1", build_schedule("zb-h1", 2, 4), "equal") == "zb-h1/equal"


def test_rows_are_simulated_with_their_own_lists_calibration_and_keep_the_common_one_beside():
    """With `own` the targets read its drawn simulation; the common calibration's stays as `common_*`."""
    from megatron_pp.benchmarks.emulate_calibrate import drawn_simulation

    schedule = build_schedule("1f1b", 2, 1)
    steps = [ONE_MICROBATCH, ONE_MICROBATCH]
    for record, rank_events in zip(ONE_MICROBATCH, ([0.0, 7.1], [0.0, 4.7])):
        record.update(started=0.0, events=[("x", *rank_events)], copies=[], load=1.0)
    common = {"host_compute_ms": 100.0, "host_post_ms": 10.0, "p2p_latency_ms": 200.0,
              "latency_ms_percentiles": [200.0] * 101}
    own = {"key": "1f1b/equal", "host_compute_ms": 50.0, "host_post_ms": 20.0, "p2p_latency_ms": 900.0,
           "latency_ms_percentiles": [900.0] * 101}
    row = compare(schedule, CostModel(), steps, common, own)
    assert (row["simulated_step_s"], row["simulated_bubble"]) == drawn_simulation(schedule, CostModel(), own)
    assert (row["common_step_s"], row["common_bubble"]) == drawn_simulation(schedule, CostModel(), common)
    assert row["simulated_step_s"] > row["common_step_s"] and row["calibrated_on"] == "1f1b/equal"
    assert row["step_error"] == pytest.approx(row["measured_step_s"] / row["simulated_step_s"] - 1)
