"""benchmarks/dry_run_vs_cuda.py off a GPU: its two runs' flags pass the job's validation, its dry run runs here
and peaks in step 2 (the step whose CUDA peak it is held to), and the comparison reads the right figures."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import dry_run_vs_cuda as bench  # noqa: E402
import gpu_check  # noqa: E402


def test_both_runs_pass_the_training_scripts_validation():
    real = bench.real_argv("python", bench.FLAGS, "m.jsonl")
    dry = bench.dry_argv("python", bench.FLAGS, "d.json")
    assert gpu_check.refusal(real[real.index("--model-preset"):]) is None
    assert gpu_check.refusal(dry[2:]) is None
    assert real[real.index("--model-preset"):real.index("--distributed-backend")] == dry[2:dry.index("--dry-run")]


def _dry(ranks):
    return {"ranks": [{"rank": r, "parameter_bytes": 1, "gradient_bytes": 2, "optimizer_bytes": 3,
                       "stash_peak_bytes": 4, "transient_peak_bytes": 5, "peak_bytes": peak, "peak_at": "step 2, B0.0"}
                      for r, peak in ranks]}


def test_comparison_takes_iteration_2s_peak_and_rank_0():
    rows = [{"iteration": 1, "loss": 9.0, "peak_memory_bytes": [1200]},
            {"iteration": 2, "loss": 8.0, "peak_memory_bytes": [1000]},
            {"iteration": 2, "eval_loss": 8.5}]
    result = bench.compare(rows, _dry([(1, 10), (0, 950)]))
    assert result["real_peak_bytes"] == 1000 and result["real_peak_bytes_per_iteration"] == [1200, 1000]
    assert result["dry_over_real"] == pytest.approx(0.95) and result["real_minus_dry_bytes"] == 50
    assert result["within_bounds"]
    assert not bench.compare(rows, _dry([(0, 1010)]))["within_bounds"]  # a dry run above the allocator invents bytes
    assert not bench.compare(rows, _dry([(0, 800)]))["within_bounds"]
    with pytest.raises(ValueError, match="1 iteration"):
        bench.compare(rows[:1], _dry([(0, 1000)]))


def test_off_cuda_it_says_so_and_exits_0(monkeypatch, capsys, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--json", str(tmp_path / "x.json")]) == 0
    assert "no CUDA device" in capsys.readouterr().out and not (tmp_path / "x.json").exists()


def test_the_dry_run_it_compares_runs_here_and_peaks_in_step_2(tmp_path):
    """The full-width stage's dry run on this CPU (fake tensors): what the GPU run will be held to."""
    out = tmp_path / "dry.json"
    proc = subprocess.run(bench.dry_argv(sys.executable, bench.FLAGS, str(out)), capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    (rank,) = json.loads(out.read_text())["ranks"]
    assert rank["peak_at"].startswith("step 2")
    assert rank["optimizer_bytes"] == 3 * rank["gradient_bytes"]  # fp32 main params + Adam's two moments
    assert 30 * 2**30 < rank["peak_bytes"] < 70 * 2**30  # fits one 80 GB GPU with room for what it cannot count
