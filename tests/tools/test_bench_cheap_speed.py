"""tools/bench_cheap_speed.py on CPU, one round of the light cases: a complete report whose exact figures
(saved bytes, merged views) are what the new paths promise. The timings themselves are not checked."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import bench_cheap_speed  # noqa: E402

TIMING = {"old_s", "new_s", "ratio_new_over_old", "ratio_min", "ratio_max"}


def test_light_cases_write_a_complete_report(tmp_path):
    out = tmp_path / "cheap.json"
    argv = ["--cases", "grad_norm", "norm", "rope", "--rounds", "1", "--device", "cpu", "--json", str(out)]
    bench_cheap_speed.main(argv)
    report = json.loads(out.read_text())
    assert report["command"] == "python tools/bench_cheap_speed.py " + " ".join(argv) and report["device"] == "cpu"
    assert TIMING <= report["grad_norm"].keys() and TIMING <= report["norm"].keys()
    assert TIMING <= report["rope"]["eager"].keys() and "fused" not in report["rope"]
    assert report["grad_norm"]["tensors_new"] == report["grad_norm"]["buckets"] < report["grad_norm"]["tensors_old"]
    assert report["norm"]["saved_bytes_new"] == report["norm"]["input_bytes"] < report["norm"]["saved_bytes_old"] / 3
    assert "init" not in report and "main_grad" not in report
