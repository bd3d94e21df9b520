"""Logging and evaluation: console lines and progress bar, JSONL keys and MFU, TensorBoard events, a wandb
offline run directory that `wandb sync` accepts, and validation passes that match across layouts and
never change the training trajectory."""
from __future__ import annotations

import glob
import io
import json
import math
import os
import subprocess
import sys

import pytest

from megatron_pp.training.arguments import parse_args
from megatron_pp.training.metrics import MetricsLogger, wandb_mode
from megatron_pp.training.train import pretrain
from tests.dist import run_distributed

SINGLE = ["--model-preset", "gpt-tiny", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4",
          "--seed", "11"]


def _row(iteration, loss, skipped=False):
    return {"iteration": iteration, "consumed_samples": 4 * iteration, "loss": loss, "grad_norm": 0.5, "lr": 1e-3,
            "global_batch_size": 4, "loss_scale": 1.0, "skipped": skipped, "step_time_s": 0.1 * iteration,
            "tokens_per_s": 1000.0, "tflops_per_gpu": 2.0, "mfu": 0.25, "hfu": 0.25,
            "peak_stash_bytes": [2**20, 2**21], "peak_memory_bytes": None, "comm_wait_s": 0.0}


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_console_lines_average_over_the_log_interval():
    out = io.StringIO()
    logger = MetricsLogger(train_iters=4, log_interval=2, log_throughput=True, stream=out)
    logger.train(_row(1, 2.0))
    assert out.getvalue() == ""  # nothing until the interval is complete
    logger.train(_row(2, 4.0, skipped=True))
    logger.evaluation({"iteration": 2, "consumed_samples": 8, "eval_loss": 1.0, "eval_ppl": math.e})
    logger.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 4 and "\r" not in out.getvalue()  # not a terminal: no progress bar
    train = lines[0]
    for part in ("iteration        2/       4", "consumed samples:            8",
                 "elapsed time per iteration (ms): 150.0", "throughput per GPU (TFLOP/s/GPU): 2.000", "MFU: 25.00%",
                 "learning rate: 1.000000E-03", "global batch size:     4", "lm loss: 3.000000E+00",
                 "loss scale: 1.0", "grad norm: 0.500", "number of skipped iterations:   1",
                 "number of nan iterations:   0", "peak stash (MB) per pp rank: [1.0, 2.0]"):
        assert part in train, (part, train)
    assert lines[2] == " validation loss at iteration 2 | lm loss value: 1.000000E+00 | lm loss PPL: 2.718282E+00 |"

    quiet = io.StringIO()
    logger = MetricsLogger(train_iters=4, log_interval=1, log_throughput=False, stream=quiet)
    logger.train(_row(1, float("nan")))
    logger.close()
    assert "TFLOP/s" not in quiet.getvalue() and "number of nan iterations:   1" in quiet.getvalue()


def test_progress_bar_only_on_a_terminal():
    term = _Terminal()
    logger = MetricsLogger(train_iters=4, log_interval=2, log_throughput=False, stream=term)
    for i in range(1, 5):
        logger.train(_row(i, 1.0))
    logger.close()
    text = term.getvalue()
    assert "\r\x1b[K[" + "#" * 30 + "] 4/4" in text
    assert "\r\x1b[K[" + "#" * 7 + "." * 23 + "] 1/4" in text
    assert text.count("iteration        ") == 2  # the console lines are printed above the bar


def test_wandb_mode_is_offline_without_a_key():
    assert wandb_mode({}) == "offline"
    assert wandb_mode({"WANDB_API_KEY": "k"}) == "online"
    assert wandb_mode({"WANDB_API_KEY": "k", "WANDB_MODE": "offline"}) == "offline"
    assert wandb_mode({"WANDB_MODE": "disabled"}) == "disabled"


def test_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(train_iters=2, log_interval=1, log_throughput=False, tensorboard_dir=str(tmp_path),
                           stream=io.StringIO())
    logger.train(_row(1, 3.0))
    logger.train(_row(2, 2.5))
    logger.evaluation({"iteration": 2, "consumed_samples": 8, "eval_loss": 2.75, "eval_ppl": math.exp(2.75)})
    logger.close()
    assert glob.glob(str(tmp_path / "events.out.tfevents.*"))
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    # Megatron-LM's names where it has the scalar, so its dashboards read our runs.
    assert [(e.step, e.value) for e in events.Scalars("lm loss")] == [(1, 3.0), (2, 2.5)]
    assert [(e.step, e.value) for e in events.Scalars("lm loss validation")] == [(2, 2.75)]
    assert [(e.step, e.value) for e in events.Scalars("lm loss vs samples")] == [(4, 3.0), (8, 2.5)]
    assert {"learning-rate", "grad-norm", "iteration-time"} <= set(events.Tags()["scalars"])
    assert [e.value for e in events.Scalars("peak_stash_bytes/pp1")] == [2.0**21, 2.0**21]
    assert "peak_memory_bytes" not in " ".join(events.Tags()["scalars"])  # None: nothing written


def test_metrics_file_rows_mfu_and_wandb_offline_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    metrics = tmp_path / "m.jsonl"
    rows = pretrain(parse_args(SINGLE + ["--train-iters", "2", "--metrics-file", str(metrics), "--peak-tflops", "0.001",
                                         "--wandb-project", "tests", "--wandb-exp-name", "tiny",
                                         "--wandb-save-dir", str(tmp_path / "wb")]))
    written = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert written == json.loads(json.dumps(rows))
    for row in written:
        assert {"iteration", "loss", "grad_norm", "lr", "step_time_s", "tokens_per_s", "peak_stash_bytes",
                "comm_wait_s", "consumed_samples", "loss_scale", "tflops_per_gpu", "mfu", "skipped"} <= set(row)
        assert row["tflops_per_gpu"] > 0 and row["mfu"] == pytest.approx(row["tflops_per_gpu"] / 0.001)
        assert row["loss_scale"] == 1.0 and row["skipped"] is False and row["peak_memory_bytes"] is None
    assert [r["consumed_samples"] for r in written] == [4, 8]
    runs = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*"))
    assert len(runs) == 1
    assert glob.glob(os.path.join(runs[0], "run-*.wandb"))
    assert [json.loads(line)["loss"] for line in open(os.path.join(runs[0], "files", "metrics.jsonl"))] == \
        [r["loss"] for r in rows]
    dry = subprocess.run([sys.executable, "-m", "wandb", "sync", "--dry-run", runs[0]], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "WANDB_MODE": "offline"})
    assert dry.returncode == 0 and "Would sync 1 run" in dry.stdout + dry.stderr, dry.stdout + dry.stderr


def test_mfu_is_null_without_a_known_peak(tmp_path):
    rows = pretrain(parse_args(SINGLE + ["--train-iters", "1"]))
    assert rows[0]["mfu"] is None and rows[0]["hfu"] is None and rows[0]["tflops_per_gpu"] > 0


# Evaluation -------------------------------------------------------------------------------------------


def test_evaluation_rows_and_no_effect_on_training():
    dropout = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--train-iters", "5"]
    plain = pretrain(parse_args(SINGLE + dropout))
    rows = pretrain(parse_args(SINGLE + dropout + ["--eval-interval", "2", "--eval-iters", "2"]))
    evals = [r for r in rows if "eval_loss" in r]
    train = [r for r in rows if "loss" in r]
    assert [r["loss"] for r in train] == [r["loss"] for r in plain]  # bitwise: dropout streams untouched
    assert [r["iteration"] for r in evals] == [2, 4, 5]  # every interval, and once at the end
    for r in evals:
        assert "loss" not in r and r["eval_ppl"] == pytest.approx(math.exp(r["eval_loss"]))
        assert r["eval_tokens"] == 2 * 4 * 32  # eval-iters x global batch x seq length
    assert evals[0]["eval_loss"] != evals[1]["eval_loss"]  # the model changed in between


def test_evaluation_with_two_chunks_on_one_rank_matches_one_chunk():
    common = SINGLE + ["--train-iters", "1", "--eval-interval", "1", "--eval-iters", "1"]
    one = pretrain(parse_args(common))
    two = pretrain(parse_args(common + ["--pipeline-schedule", "interleaved-1f1b",
                                        "--num-virtual-stages-per-pipeline-rank", "2"]))
    assert two[-1]["eval_loss"] == pytest.approx(one[-1]["eval_loss"], rel=1e-6)


def _eval_losses(ctx, argv, tp, pp):
    rows = pretrain(parse_args(argv), state=ctx.parallel_state(tp, pp))
    return [r["eval_loss"] for r in rows if "eval_loss" in r]


def test_evaluation_through_a_tensor_and_pipeline_parallel_pipeline_matches_one_process():
    argv = ["--model-preset", "gpt-tiny", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--train-iters", "2", "--eval-interval", "1", "--eval-iters", "2", "--seed", "2"]
    reference = [r["eval_loss"] for r in pretrain(parse_args(argv)) if "eval_loss" in r]
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
              "--num-layers-per-virtual-pipeline-stage", "1", "--pipeline-schedule", "interleaved-1f1b"]
    pipelined = run_distributed(4, _eval_losses, argv + layout, 2, 2)[0]
    assert len(pipelined) == len(reference) == 2
    for got, want in zip(pipelined, reference):
        assert got == pytest.approx(want, rel=1e-5)


def test_metrics_file_starts_anew_unless_resumed(tmp_path):
    from megatron_pp.training.metrics import open_metrics_file

    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"iteration": i, "loss": 1.0}) + "\n" for i in (1, 2, 3, 4)) + '{"iterat')
    with open_metrics_file(str(path), resumed_at=2) as f:  # resumed from the checkpoint of iteration 2
        f.write(json.dumps({"iteration": 3, "loss": 0.5}) + "\n")
    assert [json.loads(line)["iteration"] for line in path.read_text().splitlines()] == [1, 2, 3]
    with open_metrics_file(str(path), resumed_at=None):  # a fresh run
        pass
    assert path.read_text() == ""


def test_wandb_scalars_take_megatron_lms_names_beside_ours():
    """wandb gets the names TensorBoard gets: Megatron-LM's where it has the scalar, ours beside them."""
    from megatron_pp.training.metrics import WandbSink

    logged = []
    sink = WandbSink.__new__(WandbSink)  # without wandb.init: only what write() sends matters here
    sink.run = type("Run", (), {"log": lambda self, values, step: logged.append((step, values))})()
    sink.rows = io.StringIO()
    sink.write({**_row(3, 2.5), "mfu": 0.4, "comm_wait_s": 0.01, "tflops_per_gpu": 12.0})
    step, values = logged[0]
    assert step == 3 and values["lm loss"] == 2.5 and values["throughput"] == 12.0
    assert {"learning-rate", "grad-norm", "iteration-time", "batch-size", "loss-scale"} <= set(values)
    assert {"mfu", "comm_wait_s", "peak_stash_bytes/pp0", "peak_stash_bytes/pp1"} <= set(values)
    assert "loss" not in values and "lr" not in values
    assert json.loads(sink.rows.getvalue())["loss"] == 2.5  # the run's files keep the row's own keys
