"""benchmarks/bench_split_backward.py on CPU with tiny shapes: a complete report whose medians come from its rounds."""
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_split_backward  # noqa: E402


def test_tiny_cpu_run_writes_a_consistent_report(tmp_path):
    out = tmp_path / "split.json"
    argv = ["--hidden", "64", "--seq", "32", "--layers", "1", "--rounds", "3", "--steps", "1", "--json", str(out)]
    assert bench_split_backward.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["command"] == "python benchmarks/bench_split_backward.py " + " ".join(argv)
    assert len(report["rounds"]) == 3 and all(r["b_s"] > 0 and r["bi_s"] > 0 and r["bw_s"] > 0 for r in report["rounds"])
    for key in ("split_over_whole", "input_over_whole", "split_over_whole_cpu"):
        assert report[key] == statistics.median(r[key] for r in report["rounds"])
        values = [r[key] for r in report["rounds"]]
        assert report["round_range"][key] == [min(values), max(values)]
    assert all(r["split_over_whole_cpu"] == r["split_cpu_s"] / r["b_cpu_s"] for r in report["rounds"])
    assert report["targets_met"]["input_over_whole"] == (report["input_over_whole"] <= 0.65)


def test_threads_below_one_is_refused_in_one_line(capsys):
    assert bench_split_backward.main(["--threads", "0"]) == 2
    assert capsys.readouterr().err.strip() == "bench_split_backward.py: error: --threads must be >= 1, got 0"
