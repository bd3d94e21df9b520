"""`tools/trace_vs_sim.py --emulate` end to end on the smallest grid: one row per schedule, pipeline size,
microbatch count and cost set, each with a measured and a simulated step, in the JSON it writes. What the
numbers are is docs/schedules.md's (benchmarks, not this test): here only that every row of the grid is
there, made from that run. (A run that measured nothing used to write an empty report and exit 0.)"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import trace_vs_sim  # noqa: E402


def test_an_emulated_grid_reports_every_row(tmp_path):
    out = tmp_path / "emulate.json"
    argv = ["--emulate", "--pp", "2", "--schedules", "1f1b,zb-h1", "--microbatches", "2p", "--costs", "equal,split",
            "--unit-ms", "5", "--steps", "1", "--json", str(out)]
    assert trace_vs_sim.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["command"] == "python tools/trace_vs_sim.py " + " ".join(argv)
    rows = {(r["schedule"], r["pp"], r["microbatches"], r["costs"]): r for r in report["rows"]}
    assert sorted(rows) == sorted((s, 2, 4, c) for s in ("1f1b", "zb-h1") for c in ("equal", "split"))
    for row in rows.values():
        # Four microbatches of at least F + B = 3 units of 5 ms on the busiest rank: no step is shorter.
        assert row["measured_step_s"] >= 4 * 3 * 0.005 and row["simulated_step_s"] > 0, row
    calibration = report["calibration"]["2"]
    assert calibration["command"] == "python tools/trace_vs_sim.py --emulate --calibrate-only --pp 2 --unit-ms 5"
    assert calibration["schedule"] == "1f1b" and calibration["microbatches"] == 6 and calibration["gaps"] > 0
    # Each row is simulated with its own list's calibration (the family at m = 3p under its costs); 1f1b has no
    # split backward, so its one calibration is the common one, and zb-h1 has one per cost set.
    lists = report["list_calibrations"]["2"]
    assert sorted(lists) == ["1f1b/equal", "zb-h1/equal", "zb-h1/split"]
    assert lists["1f1b/equal"] == calibration
    assert lists["zb-h1/split"]["schedule"] == "zb-h1" and lists["zb-h1/split"]["costs"] == "split"
    assert lists["zb-h1/split"]["microbatches"] == 6
    assert lists["zb-h1/split"]["command"].endswith("--unit-ms 5 --schedules zb-h1 --costs split")
    assert {(s, c): r["calibrated_on"] for (s, _, _, c), r in rows.items()} == {
        ("1f1b", "equal"): "1f1b/equal", ("1f1b", "split"): "1f1b/equal", ("zb-h1", "equal"): "zb-h1/equal",
        ("zb-h1", "split"): "zb-h1/split"}
    for row in rows.values():
        assert row["common_step_s"] > 0
        # The calibrated host costs only add time: the ideal simulation is the shorter.
        assert row["ideal_step_s"] <= row["simulated_step_s"], row
        assert report["within_target"].endswith(f"of {len(rows)}")
    assert {(r["ratio"], r["costs"]) for r in report["ratios"]} >= {("zb-h1 / 1f1b", "equal"), ("zb-h1 / 1f1b", "split")}


def test_calibrate_only_runs_the_common_calibration_and_the_named_lists(tmp_path):
    """The command a list calibration's block records is the one that makes it again: the common 1f1b block
    and, for each named list and cost set, its own (a list without a split backward once, as 'equal')."""
    out = tmp_path / "calibration.json"
    argv = ["--emulate", "--calibrate-only", "--pp", "2", "--unit-ms", "5", "--schedules", "zb-h1,gpipe",
            "--costs", "split", "--steps", "1", "--json", str(out)]
    assert trace_vs_sim.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["rows"] == [] and sorted(report["calibration"]) == ["2"]
    lists = report["list_calibrations"]["2"]
    assert sorted(lists) == ["1f1b/equal", "gpipe/equal", "zb-h1/split"]
    assert lists["zb-h1/split"]["command"] == ("python tools/trace_vs_sim.py --emulate --calibrate-only --pp 2 "
                                               "--unit-ms 5 --schedules zb-h1 --costs split")
    assert lists["gpipe/equal"]["costs"] == "equal" and lists["gpipe/equal"]["latency_samples"] >= 0
