"""benchmarks/bench_vs_torch.py at its smallest (tiny GPT, 2 ranks, 1 round): every pair reports the same loss and
gradients as torch.distributed.pipelining, and every field the docs quote."""
import json
import os
import sys

import pytest

from tests.dist import pool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_vs_torch  # noqa: E402

TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--vocab-size", "128", "--microbatches", "4", "--rounds", "1"]


def test_tiny_run_every_pair_same_work_and_fields(tmp_path):
    out = tmp_path / "vs_torch.json"
    assert bench_vs_torch.main(TINY + ["--json", str(out)], pool=pool(2)) == 0
    report = json.loads(out.read_text())
    assert set(report["pairs"]) == {"1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v"}
    for name, pair in report["pairs"].items():
        check = pair["check"]
        assert check["ours_loss"] == pytest.approx(check["torch_loss"], rel=1e-5), name
        assert check["grad_rel_diff_max"] <= 1e-5, name
        assert len(pair["ratio_ours_over_torch"]["per_round"]) == 1
        ratio = pair["ratio_ours_over_torch"]["median"]
        assert ratio == pytest.approx(pair["ours"]["step_time_s"]["median"] / pair["torch"]["step_time_s"]["median"])
        assert pair["targets"]["time_met"] == (ratio <= 0.95)
        for side in ("ours", "torch"):
            assert len(pair[side]["cpu_s_per_rank_median"]) == 2 and min(pair[side]["cpu_s_per_rank_median"]) > 0
            assert len(pair[side]["peak_activation_bytes_per_rank"]) == 2
            assert min(pair[side]["peak_activation_bytes_per_rank"]) > 0, (name, side)
    assert report["pairs"]["zb-v"]["chunks_per_rank"] == 2 and report["pairs"]["zb-h1"]["chunks_per_rank"] == 1
    assert "zb_h1_over_our_1f1b" in report and report["command"].startswith("python benchmarks/bench_vs_torch.py")


def test_schedule_without_torch_counterpart_is_refused_before_any_work(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_vs_torch.main(["--schedules", "gpipe"])
    assert exit_info.value.code == 2
    assert "--schedules gpipe: no torch counterpart" in capsys.readouterr().err
