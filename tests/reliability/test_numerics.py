"""Numerics: a NaN gradient on one rank is seen by every rank in the same step (the step is skipped
everywhere); bf16/fp32 stop after --max-consecutive-nonfinite with the last checkpoint intact; fp16
overflows skip the step and back the loss scale off without stopping; loss spikes are logged.
NaNs are injected with MEGATRON_PP_INJECT_FAULTS (megatron_pp/training/faults.py)."""
from __future__ import annotations

import math
import os
import types

import pytest
import torch

from megatron_pp.training.arguments import parse_args
from megatron_pp.training.checkpointing import TRACKER_FILE, read_tracker
from megatron_pp.training.faults import ENV_VAR
from megatron_pp.training.train import Trainer, TrainingStopped, pretrain
from tests.dist import run_distributed

TINY = ["--model-preset", "gpt-tiny", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "2",
        "--seed", "11", "--lr", "1e-3"]


def _run_with_faults(ctx, argv, faults):
    """Every rank's (iteration, skipped, loss) rows, and the TrainingStopped message if one was raised."""
    os.environ[ENV_VAR] = faults
    seen = []
    try:
        args = parse_args(argv)
        state = ctx.parallel_state(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
        pretrain(args, state=state, on_iteration=lambda r: seen.append((r["iteration"], r["skipped"], r["loss"])))
        stopped = None
    except TrainingStopped as exc:
        stopped = str(exc)
    finally:
        del os.environ[ENV_VAR]
    return {"rows": seen, "stopped": stopped}


@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16"])
def test_nan_gradient_on_one_rank_skips_the_step_on_every_rank(tmp_path, precision):
    argv = TINY + precision + ["--pipeline-model-parallel-size", "2", "--train-iters", "5",
                               "--max-consecutive-nonfinite", "3", "--save", str(tmp_path / "ck")]
    results = run_distributed(2, _run_with_faults, argv, "nan_grad@2:1,nan_grad@3:1")  # rank 1 only
    for rank, result in enumerate(results):
        assert result["stopped"] is None, rank
        assert [(i, s) for i, s, _ in result["rows"]] == [(1, False), (2, True), (3, True), (4, False), (5, False)]
        assert all(math.isfinite(loss) for _, _, loss in result["rows"])  # the NaN never reached the weights
    assert results[0]["rows"] == results[1]["rows"]  # the same losses on both ranks, every step


def test_consecutive_nonfinite_steps_stop_the_run_with_the_last_checkpoint_intact(tmp_path):
    ck = tmp_path / "ck"
    argv = TINY + ["--pipeline-model-parallel-size", "2", "--train-iters", "8", "--max-consecutive-nonfinite", "2",
                   "--save", str(ck), "--save-interval", "2"]
    results = run_distributed(2, _run_with_faults, argv, "nan_grad@3:0,nan_grad@4:1,nan_grad@5:0")
    for result in results:  # both ranks stop at iteration 4, the second NaN step in a row
        assert [i for i, _, _ in result["rows"]] == [1, 2, 3, 4]
        assert result["stopped"].startswith("iteration 4: loss or gradients not finite for 2 consecutive step(s)")
        assert "newest checkpoint: iteration" in result["stopped"]
    # The stop comes before iteration 4's save: the newest checkpoint stays the last good one (2).
    assert read_tracker(str(ck)) == 2 and sorted(os.listdir(ck)) == ["iter_0000002", TRACKER_FILE]
    weights = torch.load(ck / "iter_0000002" / "model_stage000_tp00.pt", weights_only=True)["model"]
    assert all(torch.isfinite(v).all() for v in weights.values())
    # A resumed run (without the faults) goes on from there.
    rows = run_distributed(2, _run_with_faults, argv + ["--load", str(ck)], "")[0]["rows"]
    assert [i for i, _, _ in rows] == [3, 4, 5, 6, 7, 8]


def test_2bw_stops_on_every_rank_after_consecutive_nonfinite_steps():
    """PipeDream-2BW has its own loop (training.twobw): a diverging run (learning rate 1e30, no clipping)
    stops on both pipeline ranks after the same row, the second non-finite step in a row."""
    argv = TINY[:-1] + ["1e30", "--clip-grad", "0", "--pipeline-schedule", "2bw", "--global-batch-size", "4",
                        "--pipeline-model-parallel-size", "2", "--train-iters", "12", "--max-consecutive-nonfinite", "2"]
    results = run_distributed(2, _run_with_faults, argv, "")
    for result in results:
        assert "loss or gradients not finite for 2 consecutive step(s)" in result["stopped"]
        assert [s for _, s, _ in result["rows"][-2:]] == [True, True]
        assert len(result["rows"]) < 12
    assert [r[:2] for r in results[0]["rows"]] == [r[:2] for r in results[1]["rows"]]


def test_fp16_overflow_skips_and_backs_off_without_stopping(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "nan_grad@2:0")
    rows = pretrain(parse_args(TINY + ["--fp16", "--train-iters", "4", "--initial-loss-scale", "1024",
                                       "--hysteresis", "1", "--max-consecutive-nonfinite", "1"]))
    assert [r["skipped"] for r in rows] == [False, True, False, False]
    assert [r["loss_scale"] for r in rows] == [1024, 512, 512, 512]


def _spike_checker(factor, window):
    log = []
    fake = types.SimpleNamespace(args=types.SimpleNamespace(fp16=False, max_consecutive_nonfinite=3,
                                                            loss_spike_factor=factor, loss_spike_window=window,
                                                            save=None),
                                 nonfinite_streak=0, recent_losses=[], log=log.append)
    return fake, log


def test_loss_spikes_are_marked_and_logged():
    fake, log = _spike_checker(3.0, 6)
    losses = [4.0, 3.9, 3.8, 3.9, 30.0, 3.7, 3.6]
    rows = [{"iteration": i + 1, "loss": loss, "skipped": False} for i, loss in enumerate(losses)]
    assert all(Trainer.check_numerics(fake, row) is None for row in rows)
    assert [r["loss_spike"] for r in rows] == [False, False, False, False, True, False, False]
    assert log == ["warning: loss spike at iteration 5: 30.0000 is 7.7x the median 3.9000 of the last 4 losses "
                   "(--loss-spike-factor 3)"]
    assert len(fake.recent_losses) == 6  # the window is bounded


def test_loss_spike_flag_in_a_real_run_marks_nothing_on_a_smooth_curve():
    rows = pretrain(parse_args(TINY + ["--train-iters", "4", "--loss-spike-factor", "5", "--loss-spike-window", "2"]))
    assert [r["loss_spike"] for r in rows] == [False, False, False, False]


def test_a_short_window_judges_from_two_losses_on():
    # Half of a window of 4 is 2: the third step is the first judged, against the median of two.
    fake, log = _spike_checker(3.0, 4)
    rows = [{"iteration": i + 1, "loss": loss, "skipped": False} for i, loss in enumerate([4.0, 3.8, 40.0])]
    assert all(Trainer.check_numerics(fake, row) is None for row in rows)
    assert [r["loss_spike"] for r in rows] == [False, False, True]
    assert log and log[0].startswith("warning: loss spike at iteration 3: 40.0000 is 10.3x the median 3.9000")


def test_a_window_judges_once_half_of_it_is_filled():
    # Half of a window of 8 is 4: the fifth step is the first judged, against the median of four.
    fake, log = _spike_checker(3.0, 8)
    rows = [{"iteration": i + 1, "loss": loss, "skipped": False} for i, loss in enumerate([4.0, 3.8, 3.9, 4.1, 40.0])]
    assert all(Trainer.check_numerics(fake, row) is None for row in rows)
    assert [r["loss_spike"] for r in rows] == [False, False, False, False, True]
    assert log and log[0].startswith("warning: loss spike at iteration 5: 40.0000 is 10.1x the median 3.9500")


def test_a_window_shorter_than_four_still_needs_two_losses():
    # Half of a window of 3 is 1, but one loss is no median: the second step is not judged, the third is.
    fake, log = _spike_checker(3.0, 3)
    rows = [{"iteration": i + 1, "loss": loss, "skipped": False} for i, loss in enumerate([4.0, 40.0, 400.0])]
    assert all(Trainer.check_numerics(fake, row) is None for row in rows)
    assert [r["loss_spike"] for r in rows] == [False, False, True]


def test_a_finite_step_ends_the_streak_and_nonfinite_losses_stay_out_of_the_spike_window():
    # Limit 2: isolated bad steps never stop the run; two in a row do, on the second, and say how many.
    fake, log = _spike_checker(3.0, 4)
    fake.args.max_consecutive_nonfinite = 2
    nan = float("nan")
    verdicts = [Trainer.check_numerics(fake, {"iteration": i + 1, "loss": loss, "skipped": not math.isfinite(loss)})
                for i, loss in enumerate([4.0, nan, 4.1, nan, 3.9, nan, nan])]
    assert verdicts[:6] == [None] * 6
    assert verdicts[6].startswith("iteration 7: loss or gradients not finite for 2 consecutive step(s) "
                                  "(--max-consecutive-nonfinite 2)")
    assert fake.nonfinite_streak == 2
    assert fake.recent_losses == [4.0, 4.1, 3.9]  # the NaNs neither judged nor remembered
    assert [line.split(":")[1] for line in log] == [" iteration 2", " iteration 4", " iteration 6", " iteration 7"]
    # A skipped step with a finite loss (bf16/fp32: a non-finite gradient) counts as well; under fp16 it is
    # the loss scaler's overflow and counts for nothing.
    fake.nonfinite_streak, fake.args.max_consecutive_nonfinite = 0, 1
    assert Trainer.check_numerics(fake, {"iteration": 8, "loss": 3.8, "skipped": True}) is not None
    fake.nonfinite_streak, fake.args.fp16 = 0, True
    assert Trainer.check_numerics(fake, {"iteration": 9, "loss": 3.8, "skipped": True}) is None
    assert fake.nonfinite_streak == 0
