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
    for row in rows.values():
        # The calibrated host costs only add time: the ideal simulation is the shorter.
        assert row["ideal_step_s"] <= row["simulated_step_s"], row
        assert report["within_target"].endswith(f"of {len(rows)}")
    assert {(r["ratio"], r["costs"]) for r in report["ratios"]} >= {("zb-h1 / 1f1b", "equal"), ("zb-h1 / 1f1b", "split")}
