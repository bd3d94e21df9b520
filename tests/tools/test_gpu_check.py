"""tools/gpu_check.py off a GPU: one line and exit 0; its plan is made of commands that run."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import gpu_check  # noqa: E402


def test_without_cuda_it_says_so_in_one_line_and_exits_0(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "no CUDA device" in out[0]


def test_plan_lists_every_step(capsys):
    assert gpu_check.main(["--plan"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 + len(gpu_check.FAMILIES) + 4
    assert "pytest" in lines[0] and "bench_mfu.py" in lines[-4] and "bench_offload.py" in lines[-3]
    assert "bench_split_backward.py" in lines[-2] and "dry_run_vs_cuda.py" in lines[-1]
    assert all("--distributed-backend nccl" in line for line in lines[1:-4])


@pytest.mark.parametrize("schedule,extra", gpu_check.FAMILIES, ids=[name for name, _ in gpu_check.FAMILIES])
def test_every_family_it_runs_is_accepted_and_trains_on_one_rank(schedule, extra):
    """The same flags, less the GPU-only two, pass the training script's validation and train on CPU."""
    from megatron_pp.training.arguments import parse_args
    from megatron_pp.training.train import pretrain

    flags = gpu_check.pretrain_argv(schedule, extra)
    assert gpu_check.refusal(flags) is None
    cpu = [f for f in flags if f not in ("--bf16", "--distributed-backend", "nccl")]
    cpu[cpu.index("--train-iters") + 1] = "1"
    rows = pretrain(parse_args(cpu))
    assert rows and 0 < rows[-1]["loss"] < 20
