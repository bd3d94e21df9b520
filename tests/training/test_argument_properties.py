"""Properties of argument validation: what it accepts trains what it says, what it refuses it names.

`validate_args` reads the world size from the launcher's environment, so these run without processes
for any world (RANK / WORLD_SIZE set as torchrun would). For random tp, pp, dp, micro-batch and global
batch sizes: an accepted combination cuts every global batch into microbatches that cover the samples
[consumed, consumed + B) exactly once over the data-parallel replicas, with B the increment that
`consumed_samples` records, and the schedule is built for that microbatch count (or refused by flag
when pretrain builds it, before any data or model: the validator does not build schedules, which takes
seconds at large m); a refused one names the flags. For random learning-rate flags: an accepted
combination builds its `LRSchedule` (a refusal then would come only after the model is built) and the
schedule keeps its invariants at every iteration of the run, boundaries included (zero warm-up, warm-up
one short of the decay, one iteration). The multi-rank counterpart is
tests/training/test_exactness_edges.py: a world of 6 trains three steps and matches a single process
fed samples [i·B, (i+1)·B).
"""
from __future__ import annotations

import math
import os
from unittest import mock

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from megatron_pp.schedules.registry import build_schedule
from megatron_pp.training.arguments import build_parser, derive_args, validate_args
from megatron_pp.training.optimizer import LRSchedule
from megatron_pp.training.step_data import TrainingData

PROPERTY = settings(max_examples=80, deadline=None, derandomize=True, database=None)
BASE = ["--model-preset", "gpt-tiny", "--mock-data"]


def errors_for(argv, world):
    with mock.patch.dict(os.environ, {"RANK": "0", "WORLD_SIZE": str(world)}):
        args = build_parser().parse_args(BASE + argv)
        return validate_args(args), args


class RecordingSplit:
    """A split that remembers which samples were asked for."""

    def __init__(self):
        self.samples: list[int] = []

    def get_batch(self, sample_indices, device="cpu"):
        self.samples += list(sample_indices)
        return {}


@st.composite
def batch_geometry(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([1, 2, 3, 4]))
    dp = draw(st.integers(1, 4))
    mbs = draw(st.integers(1, 4))
    if draw(st.booleans()):
        gbs = mbs * dp * draw(st.integers(1, 6))  # a multiple: m microbatches
    else:
        gbs = draw(st.integers(1, 40))
    return tp, pp, dp, mbs, gbs


@PROPERTY
@given(batch_geometry(), st.sampled_from(["1f1b", "gpipe", "interleaved-1f1b", "looped-bfs", "2bw"]))
# The edges of the divisibility check, always tried: a micro-batch of 1 and a global batch of 1 that the
# replicas cannot share.
@example((1, 1, 2, 1, 1), "1f1b")
@example((1, 2, 3, 1, 4), "1f1b")
@example((2, 1, 2, 1, 3), "gpipe")
def test_accepted_batch_geometry_trains_exactly_the_consumed_samples(geometry, schedule):
    tp, pp, dp, mbs, gbs = geometry
    layers = 2 * pp
    argv = ["--num-layers", str(layers), "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size",
            str(pp), "--micro-batch-size", str(mbs), "--global-batch-size", str(gbs), "--train-iters", "2",
            "--pipeline-schedule", schedule]
    v = 2 if schedule in ("interleaved-1f1b", "looped-bfs") else 1
    if v > 1:
        argv += ["--num-layers-per-virtual-pipeline-stage", "1"]
    errors, args = errors_for(argv, tp * pp * dp)
    if gbs % (mbs * dp):
        assert any("--global-batch-size" in e and "--micro-batch-size" in e for e in errors), errors
        return
    if errors:  # only a schedule that refuses this m (interleaved needs m >= p or a multiple of p)
        assert all(e.startswith("--pipeline-schedule") or "microbatch" in e for e in errors), errors
        return
    args = derive_args(args, world_size=tp * pp * dp)
    data = TrainingData(RecordingSplit(), None, mbs, args.global_batch_size, dp)
    m = data.num_microbatches
    assert m * mbs * dp == args.global_batch_size == gbs
    consumed = 0
    for _ in range(args.train_iters):  # what Trainer.train_iteration reads and then records
        split = data.train
        split.samples.clear()
        for rank in range(dp):
            batches = data.microbatches(split, consumed, rank, "cpu")
            assert len(batches) == m
        assert sorted(split.samples) == list(range(consumed, consumed + args.global_batch_size))
        consumed += args.global_batch_size
    # pretrain builds the schedule for this m before any data or model: built, or refused by flag there.
    try:
        assert build_schedule(schedule, pp, m, v).num_microbatches == m
    except ValueError as exc:
        assert "--" in str(exc), exc


@PROPERTY
@given(st.integers(1, 8), st.integers(1, 4), st.integers(1, 64))
def test_train_samples_become_whole_iterations(dp, mbs, samples):
    gbs = mbs * dp * 2
    errors, args = errors_for(["--micro-batch-size", str(mbs), "--global-batch-size", str(gbs),
                               "--train-samples", str(samples)], dp)
    if samples < gbs:
        assert any("--train-samples" in e and "--global-batch-size" in e for e in errors), errors
        return
    assert errors == []
    args = derive_args(args, world_size=dp)
    assert args.train_iters == samples // gbs >= 1
    assert args.train_iters * gbs <= samples  # never more samples than asked for


@PROPERTY
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 12))
def test_layers_that_do_not_split_evenly_are_refused_by_flag(pp, v, layers):
    argv = ["--num-layers", str(layers), "--pipeline-model-parallel-size", str(pp), "--train-iters", "1",
            "--num-virtual-stages-per-pipeline-rank", str(v),
            "--pipeline-schedule", "interleaved-1f1b" if v > 1 else "1f1b"]
    errors, _ = errors_for(argv, pp)
    layout = [e for e in errors if e.startswith("--num-layers")]
    if layers % (pp * v):
        assert layout and "pipeline stages" in layout[0], errors
    else:
        assert layout == [], errors


def test_batch_refusal_at_dp3_names_the_flags():
    """The issue's example: divisible by the micro-batch size, not by micro-batch x dp."""
    errors, _ = errors_for(["--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "1"], 3)
    assert errors == ["--global-batch-size 8 is not divisible by --micro-batch-size 2 x data-parallel size 3"]


# Learning-rate schedule -----------------------------------------------------------------------------------


@st.composite
def lr_flags(draw):
    """Iteration- or sample-based lengths (one global batch is 2 samples), every style, lengths near each
    other so that the boundaries come up."""
    unit = draw(st.sampled_from(["iters", "samples"]))
    scale = 2 if unit == "samples" else 1
    length = draw(st.integers(1, 12)) * scale
    style = draw(st.sampled_from(["constant", "linear", "cosine", "WSD"]))
    argv = [f"--train-{unit}", str(length), "--lr-decay-style", style, "--lr", "0.01", "--micro-batch-size", "2",
            "--min-lr", str(draw(st.sampled_from([0.0, 0.001, 0.01])))]
    argv += [f"--lr-warmup-{unit}", str(draw(st.integers(0, 13)) * scale)]
    if draw(st.booleans()):
        argv += [f"--lr-decay-{unit}", str(draw(st.integers(0, 14)) * scale)]
    if style == "WSD" and draw(st.booleans()):
        argv += [f"--lr-wsd-decay-{unit}", str(draw(st.integers(0, 14)) * scale)]
        argv += ["--lr-wsd-decay-style", draw(st.sampled_from(["linear", "cosine", "exponential", "minus_sqrt"]))]
    return argv


def _check_invariants(schedule: LRSchedule, iters: int, batch: int = 1) -> None:
    """LR of every step of a run of `iters` steps (positions in samples when the schedule counts them)."""
    step = batch if schedule.by_samples else 1
    lrs = [schedule.learning_rate(i, i * batch) for i in range(1, iters + 1)]
    peak, floor, warmup = schedule.lr, schedule.min_lr, schedule.warmup_steps
    for i, lr in enumerate(lrs, start=1):
        t = i * step
        assert 0.0 <= lr <= peak * (1 + 1e-12), (t, lrs)
        if t <= warmup:
            assert lr == pytest.approx(peak * t / warmup), (t, lrs)  # linear from 0, the peak at W
        elif schedule.decay_style == "constant":
            assert lr == peak, (t, lrs)
        else:
            assert lr >= floor * (1 - 1e-12), (t, lrs)
            assert i == 1 or lr <= lrs[i - 2] * (1 + 1e-12), (t, lrs)  # never rises after the warm-up
            if t >= schedule.decay_steps:
                assert lr == floor, (t, lrs)


@PROPERTY
@given(lr_flags())
def test_accepted_lr_flags_build_a_schedule_that_keeps_its_invariants(argv):
    errors, args = errors_for(argv, 1)
    if errors:
        assert all("--" in e for e in errors), errors
        return
    args = derive_args(args, world_size=1)
    schedule = LRSchedule.from_args(args)  # refused here would mean: after the model is built
    _check_invariants(schedule, args.train_iters, args.global_batch_size)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "WSD"])
def test_lr_boundaries(style):
    wsd = ["--lr-wsd-decay-iters", "1"] if style == "WSD" else []
    common = ["--lr", "0.01", "--lr-decay-style", style, *wsd]
    # Warm-up equal to the decay length: refused, naming both.
    errors, _ = errors_for(common + ["--train-iters", "4", "--lr-warmup-iters", "4"], 1)
    assert any("--lr-warmup-iters 4" in e and "--lr-decay-iters" in e for e in errors), errors
    # Warm-up one short of it: the last warm-up step reaches the peak exactly.
    errors, args = errors_for(common + ["--train-iters", "4", "--lr-warmup-iters", "3"], 1)
    assert errors == []
    schedule = LRSchedule.from_args(derive_args(args, world_size=1))
    assert [schedule.learning_rate(t) for t in (1, 2, 3)] == pytest.approx([0.01 / 3, 0.02 / 3, 0.01])
    # Zero warm-up: the first step is not in a warm-up (no division by zero, no LR of 0 for constant).
    errors, args = errors_for(common + ["--train-iters", "5"], 1)
    assert errors == []
    schedule = LRSchedule.from_args(derive_args(args, world_size=1))
    first = schedule.learning_rate(1)
    assert math.isfinite(first) and (first == 0.01 if style in ("constant", "WSD") else 0 < first < 0.01)
    # One iteration.
    errors, args = errors_for(common[:4] + ["--train-iters", "1"], 1)
    assert errors == [] or style == "WSD"
    if not errors:
        _check_invariants(LRSchedule.from_args(derive_args(args, world_size=1)), 1)



@pytest.mark.parametrize("style", ["constant", "linear"])
def test_a_zero_decay_length_is_the_run_length_for_the_warmup_check_too(style):
    # LRSchedule reads --lr-decay-iters 0 as "the run's length"; the warm-up check must read it the same
    # way, neither refusing a warm-up the schedule runs nor accepting one it would refuse.
    argv = ["--lr", "0.01", "--lr-decay-style", style, "--train-iters", "4", "--lr-decay-iters", "0"]
    errors, args = errors_for(argv + ["--lr-warmup-iters", "3"], 1)
    assert errors == []
    schedule = LRSchedule.from_args(derive_args(args, world_size=1))
    assert (schedule.warmup_steps, schedule.decay_steps) == (3, 4)
    errors, _ = errors_for(argv + ["--lr-warmup-iters", "4"], 1)
    assert errors == ["--lr-warmup-iters 4 must be less than the decay length 4 "
                      "(--lr-decay-iters, default --train-iters)"]


@pytest.mark.parametrize("decay", [None, "0", "6"])
def test_a_warmup_counted_in_samples_is_checked_as_one_counted_in_iterations(decay):
    # The samples rule mirrors the iterations rule: a warm-up LRSchedule would refuse is refused up front,
    # before any model is built, and one it runs is accepted.
    argv = ["--lr", "0.01", "--lr-decay-style", "constant", "--global-batch-size", "2", "--micro-batch-size", "1",
            "--train-samples", "8"] + ([] if decay is None else ["--lr-decay-samples", decay])
    length = 6 if decay == "6" else 8
    errors, args = errors_for(argv + ["--lr-warmup-samples", str(length - 1)], 1)
    assert errors == []
    schedule = LRSchedule.from_args(derive_args(args, world_size=1))
    assert (schedule.warmup_steps, schedule.decay_steps) == (length - 1, length)
    errors, args = errors_for(argv + ["--lr-warmup-samples", str(length)], 1)
    assert errors == [f"--lr-warmup-samples {length} must be less than the decay length {length} "
                      "(--lr-decay-samples, default --train-samples)"]
    with pytest.raises(ValueError):
        LRSchedule.from_args(derive_args(args, world_size=1))
