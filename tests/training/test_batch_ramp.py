"""--rampup-batch-size START INCREMENT SAMPLES (`training.batch_ramp`): each step's global batch, the run's
length, the samples each step reads and the learning rate each step uses are Megatron-LM's, checked against
megatron-core 0.16.1's own microbatch calculator and LR scheduler; a run resumed in the middle of the ramp
continues identically; pipeline and data-parallel layouts give a single process's losses; a ramp that cannot
run is one line."""
from __future__ import annotations

import pytest

from megatron_pp.core.local_world import WorkerPool
from megatron_pp.training.arguments import build_parser, parse_args, validate_args
from megatron_pp.training.batch_ramp import BatchSizes
from megatron_pp.training.step_data import MockSplit
from megatron_pp.training.train import pretrain
from tests.dist import run_distributed


@pytest.fixture(scope="module")
def mcore_run():
    pool = WorkerPool(1)  # megatron-core is imported in a worker of this module only
    yield lambda fn, *args: pool.run(fn, *args, timeout=600)[0]
    pool.close()


def _megatron_lm_steps(ctx, start, increment, samples, gbs, mbs, dp, train_samples):
    """What Megatron-LM does with megatron-core's calculator: its run length (update_train_iters: the ramp's
    iterations while consumed <= SAMPLES, then whole full batches), then per iteration update(consumed,
    consistency_check=True) and consume num_microbatches x mbs x dp samples. Returns (train_iters, [(global
    batch, microbatches, consumed before)])."""
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

    calculator = RampupBatchsizeNumMicroBatchesCalculator(gbs, mbs, dp, False, 1, start, increment, samples)
    iterations, consumed = 0, 0
    while consumed <= samples:
        calculator.update(consumed, consistency_check=False)
        consumed += calculator.get_current_global_batch_size()
        iterations += 1
    iterations += (train_samples - consumed) // gbs
    steps, consumed = [], 0
    for _ in range(iterations):
        calculator.update(consumed, consistency_check=True)
        steps.append((calculator.get_current_global_batch_size(), calculator.get(), consumed))
        consumed += calculator.get() * mbs * dp
    return iterations, steps


# (START, INCREMENT, SAMPLES, --global-batch-size, --micro-batch-size, dp, --train-samples)
CASES = [
    (2, 2, 8, 6, 1, 1, 26),  # the module docstring's worked example
    (3, 3, 10, 12, 3, 1, 50),  # 10/3 samples per increment: float boundaries
    (4, 4, 7, 16, 2, 2, 60),  # increments shorter than a batch: sizes 12 skipped
    (16, 16, 5859375, 1536, 1, 8, 6_000_000),  # Megatron-LM's GPT-3 175B ramp at dp 8
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:4])))
def test_each_step_follows_megatron_cores_calculator(mcore_run, case):
    start, increment, samples, gbs, mbs, dp, train_samples = case
    iterations, expected = mcore_run(_megatron_lm_steps, *case)
    sizes = BatchSizes(gbs, start, increment, samples)
    assert sizes.train_iters(train_samples) == iterations
    consumed, ours = 0, []
    for _ in range(iterations):
        batch = sizes.at(consumed)
        ours.append((batch, batch // (mbs * dp), consumed))
        consumed += batch
    assert ours == expected
    assert sizes.distinct_sizes() == sorted({b for b, _, _ in expected})


TINY = ["--model-preset", "gpt-tiny", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "6",
        "--rampup-batch-size", "2", "2", "8", "--train-samples", "26", "--seed", "7", "--lr", "1e-3",
        "--lr-warmup-samples", "4", "--lr-decay-style", "cosine", "--min-lr", "1e-4"]


def _megatron_lrs(ctx, batches):
    """megatron-core's scheduler as Megatron-LM's train loop uses it (samples: warm-up 4, cosine decay over 26):
    the rate each step runs at, then step(increment=that step's global batch)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class Groups:
        param_groups = [{"params": []}]

    scheduler = OptimizerParamScheduler(
        Groups(), init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=4, lr_decay_steps=26,
        lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=26, wd_incr_style="constant")
    rates = []
    for batch in batches:
        rates.append(Groups.param_groups[0]["lr"])
        scheduler.step(batch)
    return rates


def test_tiny_run_reads_megatron_lms_batches_at_megatron_lms_rates(mcore_run, monkeypatch):
    read: list[list[int]] = []
    original = MockSplit.get_batch

    def recording(self, sample_indices, device="cpu"):
        if self.first_sample == 0:  # the training split
            read.append(list(sample_indices))
        return original(self, sample_indices, device)

    monkeypatch.setattr(MockSplit, "get_batch", recording)
    rows = pretrain(parse_args(TINY))
    iterations, expected = mcore_run(_megatron_lm_steps, 2, 2, 8, 6, 1, 1, 26)
    assert [r["iteration"] for r in rows] == list(range(1, iterations + 1))
    assert [(r["global_batch_size"], r["consumed_samples"] - r["global_batch_size"]) for r in rows] == [
        (batch, consumed) for batch, _, consumed in expected]
    # Sequential from consumed_samples, one read per microbatch of one sample: 0..25 in order.
    assert read == [[i] for i in range(26)]
    rates = mcore_run(_megatron_lrs, [b for b, _, _ in expected])
    assert [r["lr"] for r in rows] == pytest.approx(rates, rel=1e-12, abs=1e-18)
    assert rows[0]["lr"] == 0.0  # Megatron-LM's first warm-up step runs at LR 0


def test_resume_in_the_middle_of_the_ramp_continues_identically(tmp_path, capsys):
    whole = pretrain(parse_args(TINY))
    ck = str(tmp_path / "ck")
    first = pretrain(parse_args(TINY + ["--save", ck, "--save-interval", "2", "--exit-interval", "2"]))
    assert [(r["iteration"], r["global_batch_size"]) for r in first] == [(1, 2), (2, 2)]
    rest = pretrain(parse_args(TINY + ["--load", ck]))
    assert "loaded checkpoint" in capsys.readouterr().out
    keys = ("iteration", "consumed_samples", "global_batch_size", "loss", "grad_norm", "lr")
    assert [[r[k] for k in keys] for r in first + rest] == [[r[k] for k in keys] for r in whole]


def _ramp_losses(ctx, argv, tp, pp):
    args = parse_args(argv)
    rows = pretrain(args, state=ctx.parallel_state(tp, pp))
    return [(r["global_batch_size"], r["loss"]) for r in rows]


LAYOUTS = {
    "pp2-1f1b": ([], ["--pipeline-model-parallel-size", "2"]),
    "pp2-interleaved": (["--num-layers", "4"], ["--pipeline-model-parallel-size", "2", "--pipeline-schedule",
                                                "interleaved-1f1b", "--num-layers-per-virtual-pipeline-stage", "1"]),
    "dp2-distributed-optimizer": ([], ["--use-distributed-optimizer", "--overlap-grad-reduce"]),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_ramp_under_pipeline_and_data_parallelism_gives_one_process_losses(name):
    """pp 2 runs a separate list for 2, 4 and 6 microbatches (1F1B, and interleaved over 2 chunks per rank);
    dp 2 steps 1, 2 and 3 microbatches per replica through the distributed optimizer's overlapped reduction."""
    model, layout = LAYOUTS[name]
    argv = TINY + model + ["--train-samples", "20"]
    reference = [(r["global_batch_size"], r["loss"]) for r in pretrain(parse_args(argv))]
    pp = 2 if "--pipeline-model-parallel-size" in layout else 1
    ranked = run_distributed(2, _ramp_losses, argv + layout, 1, pp)[0]
    assert [b for b, _ in ranked] == [b for b, _ in reference] == [2, 2, 4, 6, 6]
    assert [loss for _, loss in ranked] == pytest.approx([loss for _, loss in reference], rel=1e-5)


BAD = [
    (["--train-samples", "10"], "--train-samples 10 ends inside the ramp-up, which consumes 14 samples"),
    (["--rampup-batch-size", "6", "2", "8"], "START must be below --global-batch-size 6"),
    (["--rampup-batch-size", "2", "3", "8"], "differ from it by a multiple of INCREMENT"),
    (["--rampup-batch-size", "2", "2", "0"], "START, INCREMENT and SAMPLES must be >= 1"),
    (["--pipeline-schedule", "2bw"], "is not supported with --pipeline-schedule 2bw"),
    (["--micro-batch-size", "2", "--rampup-batch-size", "3", "3", "8"], "its global batch 3 is not divisible"),
]


@pytest.mark.parametrize("extra,needle", BAD, ids=[b[1][:30] for b in BAD])
def test_a_ramp_that_cannot_run_is_one_line(extra, needle):
    argv = [a for a in TINY if a not in ("--train-samples", "26", "--lr-warmup-samples", "4")]
    argv += [] if "--train-samples" in extra else ["--train-samples", "26"]
    errors = validate_args(build_parser().parse_args(argv + extra), world_size=1)
    assert any(needle in e for e in errors), errors
    assert all("\n" not in e for e in errors)


def test_megatron_lm_refuses_a_ramp_with_train_iters_and_so_do_we():
    argv = ["--model-preset", "gpt-tiny", "--mock-data", "--global-batch-size", "4", "--train-iters", "3"]
    errors = validate_args(build_parser().parse_args(argv + ["--rampup-batch-size", "2", "2", "4"]), world_size=1)
    assert errors == ["--rampup-batch-size 2 2 4 needs --train-samples (a sample-counted run, as Megatron-LM "
                      "requires: it refuses a ramp-up with --train-iters)"]


def test_every_microbatch_count_of_the_ramp_is_validated_before_the_run():
    argv = ["--model-preset", "gpt-tiny", "--num-layers", "4", "--mock-data", "--micro-batch-size", "1",
            "--global-batch-size", "4", "--rampup-batch-size", "1", "1", "4", "--train-samples", "20",
            "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
            "--pipeline-schedule", "looped-bfs"]
    errors = validate_args(build_parser().parse_args(argv), world_size=2)
    assert len(errors) == 1 and errors[0].startswith(
        "--rampup-batch-size: the ramp's global batch 1 (1 microbatches per step): looped-bfs needs at least"), errors


def test_the_decoupled_rate_is_read_where_the_rate_is(monkeypatch):
    """--decoupled-lr's rate is the schedule's at the same position as the main rate (before the step, as
    Megatron-LM's scheduler reads both): 0 at the first warm-up step, and per step what `LRSchedule` gives at
    the samples consumed before it. Reading it one step late would give the embedding a non-zero first step."""
    from megatron_pp.training.arguments import derive_args
    from megatron_pp.training.optimizer import LRSchedule, TrainingOptimizer

    seen: list[tuple[float, float]] = []
    original = TrainingOptimizer.step

    def recording(self, lr, decoupled_lr=None):
        seen.append((lr, decoupled_lr))
        return original(self, lr, decoupled_lr)

    monkeypatch.setattr(TrainingOptimizer, "step", recording)
    # Counted in iterations (a ramp counts in samples, where the iteration argument is not read).
    argv = ["--model-preset", "gpt-tiny", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "2",
            "--train-iters", "6", "--seed", "7", "--lr", "1e-3", "--lr-warmup-iters", "2", "--lr-decay-style",
            "cosine", "--min-lr", "1e-4", "--decoupled-lr", "5e-3", "--decoupled-min-lr", "5e-4"]
    rows = pretrain(parse_args(argv))
    schedule = LRSchedule.from_args(derive_args(build_parser().parse_args(argv), world_size=1))
    assert seen[0] == (0.0, 0.0)
    for (lr, decoupled), row in zip(seen, rows, strict=True):
        before = row["consumed_samples"] - row["global_batch_size"]
        assert lr == pytest.approx(schedule.learning_rate(row["iteration"] - 1, before), rel=1e-12, abs=1e-18)
        assert decoupled == pytest.approx(schedule.decoupled_rate(row["iteration"] - 1, before), rel=1e-12, abs=1e-18)
    assert max(d for _, d in seen) > max(lr for lr, _ in seen)  # the override is in effect
