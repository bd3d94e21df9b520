"""Evaluation runs the schedule's own forwards through the executor: every schedule and placement gives the
single-process validation loss, and evaluating leaves the training trajectory untouched."""
from __future__ import annotations

import os
import sys

import pytest

from tests.dist import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMON = ["--model-preset", "llama-tiny", "--num-layers", "8", "--mock-data", "--micro-batch-size", "1",
          "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3", "--seed", "11", "--eval-interval", "1",
          "--eval-iters", "2"]


def _rows(ctx, argv):
    from megatron_pp.training.arguments import parse_args
    from megatron_pp.training.train import pretrain

    args = parse_args(argv)
    return pretrain(args, state=ctx.parallel_state(1, args.pipeline_model_parallel_size))


@pytest.fixture(scope="module")
def reference():
    from megatron_pp.training.arguments import parse_args
    from megatron_pp.training.train import pretrain

    return pretrain(parse_args(COMMON))


def _csv(tmp_path) -> list[str]:
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from torch_schedule_csv import write_torch_csv

    return ["--pipeline-schedule-file", write_torch_csv(str(tmp_path / "zbv.csv"), "ZBVZeroBubble", 2, 8)]


@pytest.mark.parametrize("layout", [
    ["--pipeline-schedule", "interleaved-1f1b", "--num-virtual-stages-per-pipeline-rank", "2"],
    ["--pipeline-schedule", "po-h", "--num-virtual-stages-per-pipeline-rank", "2"],
    ["--pipeline-schedule", "looped-bfs", "--num-virtual-stages-per-pipeline-rank", "2"],
    ["--pipeline-schedule", "2bw"],
    "zbv-file",
    ["--pipeline-schedule", "zb-v"],  # V placement: rank 0 holds the head, the last rank does not
], ids=["interleaved", "po-h", "looped-bfs", "2bw", "torch-zbv-file", "zb-v"])
def test_every_schedule_evaluates_like_one_process(tmp_path, reference, layout):
    layout = _csv(tmp_path) if layout == "zbv-file" else layout
    rows = run_distributed(2, _rows, COMMON + ["--pipeline-model-parallel-size", "2", *layout])[0]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    expected = [r["eval_loss"] for r in reference if "eval_loss" in r]
    assert len(evals) == len(expected) == 2
    # Iteration 1's evaluation sees the same weights everywhere; 2BW's first update is deferred, so from
    # then on only its own trajectory is comparable (checked in tests/training/test_2bw.py).
    checked = evals[:1] if "2bw" in layout else evals
    for a, b in zip(checked, expected):
        assert abs(a - b) <= 1e-5 * abs(b), (layout, evals, expected)
    if "2bw" not in layout:
        train, train_ref = [r["loss"] for r in rows if "loss" in r], [r["loss"] for r in reference if "loss" in r]
        for a, b in zip(train, train_ref):
            assert abs(a - b) <= 1e-5 * abs(b)


def test_data_parallel_ranks_split_the_validation_batches_and_sum_them(reference):
    # dp = 2: each replica evaluates half of every global batch; the validation loss is the token-weighted
    # mean over both halves (summed across replicas), the single-process loss.
    rows = run_distributed(2, _rows, COMMON + ["--pipeline-model-parallel-size", "1"])[0]
    expected = [r["eval_loss"] for r in reference if "eval_loss" in r]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert len(evals) == len(expected) == 2
    for a, b in zip(evals, expected):
        assert abs(a - b) <= 1e-5 * abs(b), (evals, expected)
    tokens = [r["eval_tokens"] for r in rows if "eval_tokens" in r]
    assert tokens == [r["eval_tokens"] for r in reference if "eval_tokens" in r]
