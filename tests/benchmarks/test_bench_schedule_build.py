"""benchmarks/bench_schedule_build.py at small sizes: every phase timed, action counts and growth reported."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_schedule_build  # noqa: E402


def test_small_run_reports_every_phase(tmp_path):
    out = tmp_path / "build.json"
    assert bench_schedule_build.main(["--pp", "4", "--chunks", "2", "--microbatches", "8", "16",
                                      "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    first, second = report["rows"]
    assert (first["actions"], second["actions"]) == (352, 704)  # m=8: 8 stages x 8 x (F, B) + 7 boundaries x 8 x 4 messages
    for row in report["rows"]:
        assert row["total_s"] == pytest.approx(row["build_s"] + row["simulate_s"])
        assert row["total_cpu_s"] == pytest.approx(row["build_cpu_s"] + row["simulate_cpu_s"])
        assert 0 < row["bubble_fraction"] < 1
    assert "growth_vs_linear" in second and "growth_vs_linear" not in first
    assert report["command"].startswith("python benchmarks/bench_schedule_build.py")


def test_bad_sizes_are_refused_in_one_line(capsys):
    with pytest.raises(SystemExit):
        bench_schedule_build.main(["--microbatches", "0"])
    assert "--microbatches" in capsys.readouterr().err
