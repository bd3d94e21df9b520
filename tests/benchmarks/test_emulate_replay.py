"""The replay of an emulated step with its measured transfers (megatron_pp/benchmarks/emulate_replay.py), on a
1F1B p = 2, m = 1 trace made by hand whose answer is worked out below."""
import pytest

from megatron_pp.benchmarks.emulate_replay import (measured_latencies, measured_overruns, replay, replay_row,
                                                   send_leave_times, waited_latencies)
from megatron_pp.schedules.registry import build_schedule
from megatron_pp.schedules.simulate import CostModel, simulate

Q, H = 0.05, 0.1  # host_post, host_compute
COSTS = CostModel(forward=1.0, backward=2.0, host_compute=H, host_post=Q)


def _record(compute, posts):
    """compute: (label, begin, end, waited, cost)."""
    return {"compute": [(label, b, e, w, 0.0, c, 0.0) for label, b, e, w, c in compute], "posts": posts,
            "started": 0.0, "events": [(label, b, e) for label, b, e, _, _ in compute], "copies": []}


# Rank 0 runs F0, posts SEND_F0 at 1.1 (it leaves at 1.1 + Q = 1.15), B0 called at 1.5 waits 4.1: input in at
# 5.6. Rank 1's F0 called at 0.2 waits 1.3: input in at 1.5; its B0 ends 0.2 late (an overrun); SEND_B0
# posted at 4.9 leaves at 4.95. Measured latencies: F 1.5 - 1.15 = 0.35, B 5.6 - 4.95 = 0.65.
TRACE = [
    _record([("F0.0", 0.0, 1.0, 0.0, 1.0), ("B0.0", 1.5, 7.6, 4.1, 2.0)],
            [("recv", 1, 0.0), ("send", 1, 1.1), ("recv", 1, 1.1)]),
    _record([("F0.0", 0.2, 2.5, 1.3, 1.0), ("B0.0", 2.6, 4.8, 0.0, 2.0)],
            [("recv", 0, 0.0), ("send", 0, 4.9)]),
]


def test_each_message_gets_its_measured_latency():
    schedule = build_schedule("1f1b", 2, 1)
    assert measured_latencies(schedule, TRACE, Q) == {(0, 1, 0): pytest.approx(0.35), (1, 0, 0): pytest.approx(0.65)}
    assert measured_overruns(TRACE) == {(0, "F0.0"): 0.0, (0, "B0.0"): 0.0, (1, "F0.0"): 0.0,
                                        (1, "B0.0"): pytest.approx(0.2)}


def test_sends_of_one_batch_leave_one_post_after_another():
    record = {"posts": [("send", 1, 2.0), ("send", 2, 2.0), ("recv", 1, 2.0), ("send", 1, 3.0)]}
    assert send_leave_times([record], 0.5) == {(0, 1): [2.5, 3.5], (0, 2): [3.0]}


def test_replay_by_hand():
    """Rank 0: F0 at H = 0.1 to 1.1, SEND_F0 leaves at 1.15, in at 1.5; its batch's two posts take it to 1.2.
    Rank 1: RECV_F0 posted to 0.05, F0 at 1.5 to 2.5, B0 at 2.6 to 4.6, SEND_B0 leaves 4.65, in at 4.65 + 0.65
    = 5.3. Rank 0: B0 at 5.3 to 7.3: the makespan. With rank 1's B0 overrun (0.2) kept too, everything after it
    moves by 0.2: 7.5. The calibrated simulation's one latency (0.35 for both) ends at 7.0."""
    schedule = build_schedule("1f1b", 2, 1)
    result = replay(schedule, COSTS, TRACE)
    compute = {(r, str(a)): (round(s, 9), round(e, 9)) for r in range(2) for a, s, e in result.timeline[r]
               if a.op.value in ("F", "B")}
    assert compute == {(0, "F0.0"): (0.1, 1.1), (1, "F0.0"): (1.5, 2.5), (1, "B0.0"): (2.6, 4.6),
                       (0, "B0.0"): (5.3, 7.3)}
    assert result.makespan == pytest.approx(7.3)
    assert replay(schedule, COSTS, TRACE, overruns=True).makespan == pytest.approx(7.5)
    assert simulate(schedule, CostModel(forward=1.0, backward=2.0, host_compute=H, host_post=Q,
                                        p2p_latency=0.35)).makespan == pytest.approx(7.0)


def test_equal_measured_latencies_replay_as_the_constant():
    """Every message measured at the same latency: the replay is the simulation with that latency."""
    schedule = build_schedule("1f1b", 2, 1)
    same = [TRACE[0], _record([("F0.0", 0.2, 2.5, 1.3, 1.0), ("B0.0", 2.6, 4.6, 0.0, 2.0)],
                              [("recv", 0, 0.0), ("send", 0, 5.6 - 0.35 - Q)])]
    constant = simulate(schedule, CostModel(forward=1.0, backward=2.0, host_compute=H, host_post=Q, p2p_latency=0.35))
    assert replay(schedule, COSTS, same).timeline == constant.timeline


def test_replay_row_reads_the_measured_step_and_the_errors():
    """The row: the measured step (first compute start 0.0 to the last end 7.6), the replay (7.3), the calibrated
    simulation (its latency 350 ms, i.e. 0.35 in the trace's unit: 7.0) and the measured latencies' mean."""
    schedule = build_schedule("1f1b", 2, 1)
    calibration = {"host_compute_ms": 1e3 * H, "host_post_ms": 1e3 * Q, "p2p_latency_ms": 350.0}
    row = replay_row(schedule, CostModel(forward=1.0, backward=2.0), [TRACE], calibration)
    assert row["measured_step_s"] == pytest.approx(7.6)
    assert row["replayed_step_s"] == pytest.approx(7.3) and row["median_latency_step_s"] == pytest.approx(7.0)
    assert row["replayed_with_overruns_step_s"] == pytest.approx(7.5)
    assert row["replayed_error"] == pytest.approx(7.6 / 7.3 - 1)
    assert row["replayed_bubble"] == pytest.approx(1 - 3.0 / 7.3)  # each rank busy F + B = 3
    assert row["waited_latency_mean_ms"] == pytest.approx(500.0)  # both consumers were called before the send
    # Rank 0's gap F0 -> B0 (1.0 to 1.5) holds two posts (at 1.1; its first receive was posted at the start),
    # charged H + 2Q = 0.2; rank 1's F0 -> B0 (2.5 to 2.6) none, charged H.
    assert row["gap_ms_by_posts"] == {"0": [1, pytest.approx(100.0), pytest.approx(100.0)],
                                      "2": [1, pytest.approx(500.0), pytest.approx(200.0)]}


def test_waited_latencies_leave_out_consumers_called_after_the_send():
    """Rank 1's F0 called at 0.2, before its message left (1.15); rank 0's B0 at 1.5, before 4.95: both count.
    Called at 5.0 instead, B0's input (in at 5.6) gives no sample."""
    schedule = build_schedule("1f1b", 2, 1)
    assert waited_latencies(schedule, TRACE, Q) == [pytest.approx(0.65), pytest.approx(0.35)]
    late = [_record([("F0.0", 0.0, 1.0, 0.0, 1.0), ("B0.0", 5.0, 7.6, 0.6, 2.0)], TRACE[0]["posts"]), TRACE[1]]
    assert waited_latencies(schedule, late, Q) == [pytest.approx(0.35)]


def test_replay_end_to_end_and_its_bad_input(tmp_path, capsys):
    """`--emulate --replay` on the smallest run: one row, measured beside its replays (the numbers are the
    benchmark's, not this test's: here that the row is made from that run); --replay alone is refused."""
    import json
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                    "tools"))
    import trace_vs_sim

    assert trace_vs_sim.main(["--replay", "--pp", "2"]) == 2
    assert "--replay needs --emulate" in capsys.readouterr().err
    out = tmp_path / "replay.json"
    argv = ["--emulate", "--replay", "--pp", "2", "--schedules", "1f1b", "--microbatches", "2p", "--costs", "equal",
            "--unit-ms", "5", "--steps", "1", "--json", str(out)]
    assert trace_vs_sim.main(argv) == 0
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert (row["schedule"], row["pp"], row["microbatches"], row["costs"]) == ("1f1b", 2, 4, "equal")
    # Four microbatches of F + B = 3 units of 5 ms on the busiest rank: no step, measured or replayed, is shorter.
    assert min(row["measured_step_s"], row["replayed_step_s"], row["drawn_latency_step_s"]) >= 4 * 3 * 0.005
    assert row["replayed_error"] == pytest.approx(row["measured_step_s"] / row["replayed_step_s"] - 1)
    assert report["calibration"]["2"]["latency_ms_percentiles"]
