"""End to end: pretrain_*.py under torchrun and in-process, metrics/trace files, layout-independent
training, and argument errors that stop before any work."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from megatron_pp.training.arguments import build_parser, validate_args
from tests.dist import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMON = ["--mock-data", "--micro-batch-size", "2", "--train-iters", "3", "--lr", "1e-3", "--seed", "7",
          "--clip-grad", "1.0"]


def test_torchrun_pipeline_run_writes_metrics_and_trace(tmp_path):
    metrics, trace = tmp_path / "m.jsonl", tmp_path / "t.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "pretrain_gpt.py"), *COMMON, "--pipeline-model-parallel-size", "2",
           "--global-batch-size", "8", "--pipeline-schedule", "1f1b",
           "--metrics-file", str(metrics), "--trace-file", str(trace)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert {"iteration", "loss", "grad_norm", "lr", "step_time_s", "tokens_per_s", "peak_stash_bytes"} <= set(r)
        assert len(r["peak_stash_bytes"]) == 2 and all(b > 0 for b in r["peak_stash_bytes"])
        assert 0 < r["loss"] < 20 and r["grad_norm"] > 0
    assert rows[-1]["loss"] < rows[0]["loss"]
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    # 3 steps x m=4 microbatches: every F and B of every step is in the trace of each rank.
    assert sum(1 for e in events if e["pid"] == 0 and e["name"].startswith("F")) == 12
    assert sum(1 for e in events if e["pid"] == 1 and e["name"].startswith("B")) == 12


def _pretrain_losses(ctx, argv):
    from megatron_pp.training.arguments import parse_args
    from megatron_pp.training.train import pretrain

    args = parse_args(argv)
    # The worker's cached groups: new_group is collective and slow, and the pool outlives this call.
    state = ctx.parallel_state(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    rows = pretrain(args, state=state)
    return [r["loss"] for r in rows] if rows else None


def _single_process_losses(argv):
    return [r["loss"] for r in _single_process_rows(argv)]


@pytest.mark.parametrize("flavour,layout", [
    ("gpt-tiny", ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"]),
    ("llama-tiny", ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                    "--pipeline-schedule", "interleaved-1f1b"]),
    ("llama-tiny", ["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "gpipe"]),
    # dp = 2: ZeRO-1 sharded update with bucketed reduction overlapping the backward.
    ("gpt-tiny", ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer", "--overlap-grad-reduce"]),
    ("llama-tiny", ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                    "--sequence-parallel", "--recompute-granularity", "full", "--recompute-method", "uniform"]),
    ("gpt-tiny", ["--pipeline-model-parallel-size", "4", "--recompute-granularity", "selective"]),
    # V placement, dp = 2, sharded weights: BW's deferred GEMMs report into the reducer of a tied embedding
    # that rank 0's two chunks share.
    ("gpt-tiny", ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-v", "--overlap-grad-reduce",
                  "--use-distributed-optimizer", "--data-parallel-sharding-strategy", "optim_grads_params"]),
])
def test_training_is_layout_independent(flavour, layout):
    """Three optimizer steps give the same losses as one process (exact schedules, fp32, Adam + clipping)."""
    argv = ["--model-preset", flavour, *COMMON, "--global-batch-size", "8"]
    reference = _single_process_losses(argv)
    pipelined = run_distributed(4, _pretrain_losses, argv + layout)[0]
    assert len(pipelined) == 3
    for step, (a, b) in enumerate(zip(pipelined, reference)):
        assert abs(a - b) <= 1e-5 * abs(b), (step, pipelined, reference)


def test_bf16_pipeline_tracks_fp32():
    """bf16 weights with fp32 main weights: a pipelined run stays within bf16 rounding of fp32."""
    argv = ["--model-preset", "llama-tiny", *COMMON, "--global-batch-size", "8"]
    reference = _single_process_losses(argv)
    bf16 = run_distributed(4, _pretrain_losses, argv + ["--bf16", "--pipeline-model-parallel-size", "2"])[0]
    for step, (a, b) in enumerate(zip(bf16, reference)):
        assert abs(a - b) <= 2e-2 * abs(b), (step, bf16, reference)
    assert bf16 != reference  # it really ran in bf16


def test_fp16_with_dynamic_loss_scale_tracks_fp32():
    """fp16 weights, dynamic loss scaling and fp32 main weights through a pipeline stay near fp32."""
    argv = ["--model-preset", "gpt-tiny", *COMMON, "--global-batch-size", "8"]
    reference = _single_process_losses(argv)
    fp16 = run_distributed(4, _pretrain_losses, argv + ["--fp16", "--pipeline-model-parallel-size", "2"])[0]
    for step, (a, b) in enumerate(zip(fp16, reference)):
        assert abs(a - b) <= 1e-2 * abs(b), (step, fp16, reference)
    assert fp16 != reference


BAD = [
    (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size must be >= 1"),
    (["--pipeline-schedule", "nope"], "unknown --pipeline-schedule 'nope'"),
    (["--model-preset", "gpt-tiny", "--num-attention-heads", "3"], "--num-attention-heads"),
    (["--model-preset", "gpt-tiny", "--tensor-model-parallel-size", "8"], "--tensor-model-parallel-size"),
    (["--model-preset", "gpt-tiny", "--pipeline-model-parallel-size", "3"], "--pipeline-model-parallel-size 3"),
    (["--bf16", "--fp16"], "mutually exclusive"),
    (["--rampup-batch-size", "16", "16", "1000"], "--rampup-batch-size 16 16 1000 needs --train-samples"),
    (["--num-layers-per-virtual-pipeline-stage", "3"], "--num-layers-per-virtual-pipeline-stage 3"),
    (["--pipeline-schedule", "1f1b", "--num-virtual-stages-per-pipeline-rank", "0"], "must be >= 1"),
    (["--pipeline-schedule", "1f1b", "--microbatch-group-size-per-vp-stage", "4"],
     "--microbatch-group-size-per-vp-stage does not apply to --pipeline-schedule 1f1b"),
]


@pytest.mark.parametrize("extra,needle", BAD, ids=[b[1][:30] for b in BAD])
def test_bad_arguments_are_reported_by_flag(extra, needle):
    argv = ["--model-preset", "gpt-tiny", "--mock-data", *extra]
    errors = validate_args(build_parser().parse_args(argv))
    assert errors, argv
    assert any(needle in e for e in errors), errors
    assert all("\n" not in e for e in errors)


def test_bad_arguments_exit_2_without_traceback():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--mock-data", "--train-iters", "3",
         "--pipeline-schedule", "nope", "--tensor-model-parallel-size", "0"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 2, proc.stderr
    assert "Traceback" not in proc.stderr


def test_file_dataset_with_validation_split_and_exact_resume(tmp_path):
    """--data-path: the tokenizer sets the vocabulary, the valid split feeds evaluation, and a resumed
    run reads the same samples as an uninterrupted one."""
    import numpy as np

    from megatron_pp.data.indexed import write_dataset
    from megatron_pp.training.checkpointing import read_metadata

    rng = np.random.default_rng(0)
    eod = 300  # NullTokenizer --vocab-size 300: ids 0..299 and the end-of-document id 300
    write_dataset(str(tmp_path / "corpus"), [np.append(rng.integers(0, eod, rng.integers(20, 80)), eod)
                                             for _ in range(40)], np.uint16)
    argv = ["--model-preset", "gpt-tiny", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3",
            "--data-path", str(tmp_path / "corpus"), "--split", "80,20,0", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "300", "--eval-interval", "3", "--eval-iters", "1"]
    straight = _single_process_rows(argv)
    assert [r["iteration"] for r in straight] == [1, 2, 3, 3] and math.isfinite(straight[-1]["eval_loss"])
    first = _single_process_rows(argv + ["--save", str(tmp_path / "ck"), "--exit-interval", "2"])
    assert read_metadata(str(tmp_path / "ck" / "iter_0000002"))["model"]["vocab_size"] == 301
    resumed = _single_process_rows(argv + ["--load", str(tmp_path / "ck")])
    assert [r["loss"] for r in first + resumed[:1]] == [r["loss"] for r in straight[:3]]
    assert resumed[-1]["eval_loss"] == straight[-1]["eval_loss"]


def _single_process_rows(argv):
    from megatron_pp.training.arguments import parse_args
    from megatron_pp.training.train import pretrain

    return pretrain(parse_args(argv))


def test_exit_interval_without_save_stops_and_writes_nothing(tmp_path, monkeypatch):
    """--exit-interval needs no --save: the run stops after that iteration with nothing to save."""
    monkeypatch.chdir(tmp_path)
    rows = _single_process_rows(["--model-preset", "gpt-tiny", *COMMON, "--global-batch-size", "2",
                                 "--exit-interval", "2"])
    assert [r["iteration"] for r in rows] == [1, 2]
    assert os.listdir(tmp_path) == []
