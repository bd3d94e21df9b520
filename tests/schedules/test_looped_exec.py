"""looped-bfs at run time: when the data-parallel collectives happen (counted on the dp group), and training
end to end with dp > 1, layered accumulation and sharded weights, against one process."""
from __future__ import annotations

import dataclasses
import math

import pytest

from megatron_pp.core.comm_counter import CommCounter
from megatron_pp.data.mock import MockData
from megatron_pp.models.presets import get_preset
from megatron_pp.schedules.ir import COMPUTE_OPS, Action, Op
from megatron_pp.schedules.registry import build_schedule
from megatron_pp.training.layered import WeightResidency, connect_optimizer
from megatron_pp.training.optimizer import OptimizerConfig, build_optimizer
from megatron_pp.training.train import build_pipeline, global_token_count
from tests.dist import run_distributed
from tests.training.test_pretrain import COMMON, _pretrain_losses, _single_process_losses, _single_process_rows

SEED = 5
BUCKET_BYTES = 16 * 1024


def counted_step(ctx, sharding: str, m: int, group: int) -> dict:
    """Worker: one layered looped-bfs step (pp 2 x dp 2, v 2) with every executed action and every
    collective on the dp group logged in order."""
    state = ctx.parallel_state(1, 2)
    config = dataclasses.replace(get_preset("gpt-tiny"), num_layers=4)
    schedule = build_schedule("looped-bfs", 2, m, 2, breadth_first_microbatches=group, layered_grad_accumulation=True)
    pipe = build_pipeline(config, state, schedule, micro_batch_size=2, seed=SEED)
    optimizer = build_optimizer(pipe.chunks, state, OptimizerConfig(
        use_distributed_optimizer=sharding != "no_shard", data_parallel_sharding_strategy=sharding,
        layered_grad_accumulation=True, bucket_bytes=BUCKET_BYTES))
    connect_optimizer(pipe.executor, optimizer)
    log: list = []
    for op in COMPUTE_OPS | {Op.REDUCE_GRAD}:
        inner = pipe.executor.handlers[op]

        def logged(action, inner=inner):
            log.append(str(action))
            inner(action)
        pipe.executor.handlers[op] = logged
    mbs = MockData(SEED, config.seq_length, config.vocab_size, 2, 2 * m * 2, 2).step_microbatches(0, state.dp_rank)
    tokens = global_token_count(mbs, state)
    reducer = optimizer.reducer
    reducer.start_step(m)
    with CommCounter(state.dp_group, log=log):
        pipe.executor.run(mbs, loss_scale=1.0 / tokens)
        reducer.finish()
    weights = optimizer.sharded_weights
    return {
        "log": [e if isinstance(e, str) else (e.op, e.nbytes) for e in log],
        "grad_bytes": {c: [b.grad.numel() * 4 for b in buckets] for c, buckets in reducer.chunk_buckets.items()},
        "weight_bytes": None if weights is None else [
            [reducer.buckets[b].grad.numel() * 4 for b in buckets] for buckets in weights.chunk_buckets],
        "runs": None if weights is None else WeightResidency(pipe.executor.actions, weights).runs,
        "reductions": reducer.reductions,
    }


@pytest.mark.parametrize("sharding", ["no_shard", "optim", "optim_grads_params"])
def test_each_chunk_is_reduced_once_per_group_right_after_its_last_backward(sharding):
    m, group = 4, 2
    for rank, r in enumerate(run_distributed(4, counted_step, sharding, m, group)):
        log = r["log"]
        # Attribute every collective to the action it follows.
        after: list[tuple[str, list]] = []
        for entry in log:
            if isinstance(entry, str):
                after.append((entry, []))
            else:
                after[-1][1].append(tuple(entry))
        reductions = [(i, a) for i, (a, _) in enumerate(after) if a.startswith("REDUCE_GRAD")]
        assert [a for _, a in reductions] == ["REDUCE_GRAD.1", "REDUCE_GRAD.0"] * (m // group), rank
        assert r["reductions"] == {0: 2 * len(r["grad_bytes"][0]), 1: 2 * len(r["grad_bytes"][1])}
        for k, (i, action) in enumerate(reductions):
            chunk, g = int(action.split(".")[1]), k // 2
            # Each bucket of the chunk, once, in bucket order; nothing else reduces gradients.
            assert [c for c in after[i][1] if c[0] == "all_reduce"] == [("all_reduce", n) for n in r["grad_bytes"][chunk]]
            done = {a for a, _ in after[:i]}
            assert {f"B{mb}.{chunk}" for mb in range(g * group, (g + 1) * group)} <= done  # the group's backwards ran
            assert not any(f"B{mb}.{chunk}" in done for mb in range((g + 1) * group, m))  # later groups' did not
        assert all(c[0] != "all_reduce" for a, calls in after if not a.startswith("REDUCE_GRAD") for c in calls)
        gathers = [(a, [c for c in calls if c[0] == "all_gather"]) for a, calls in after]
        if sharding != "optim_grads_params":
            assert all(not g for _, g in gathers)
            continue
        # Runs F*.0 | F*.1 B*.1 | B*.0 F*.0 | F*.1 B*.1 | B*.0: one gather per bucket per run, each started at
        # the previous run's first action (prefetch), the first run's at its own first action.
        assert r["runs"] == [0, 1, 0, 1, 0]
        expected = [("F0.0", r["weight_bytes"][0] + r["weight_bytes"][1]), ("F0.1", r["weight_bytes"][0]),
                    ("B0.0", r["weight_bytes"][1]), ("F2.1", r["weight_bytes"][0]), ("B2.0", [])]
        started = [(a, [n for _, n in g]) for a, g in gathers if g]
        assert started == [(a, n) for a, n in expected if n], rank


def test_training_runs_end_to_end_and_matches_one_process():
    """Three Adam steps (clipping on) with dp = 2: losses equal one process's. Layered accumulation with two
    breadth-first groups and sharded weights; the distributed optimizer alone; and depth-first ZeRO-3."""
    argv = ["--model-preset", "gpt-tiny", *COMMON, "--global-batch-size", "16"]
    reference = _single_process_losses(argv)
    looped = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "looped-bfs",
              "--num-layers-per-virtual-pipeline-stage", "1"]
    for layout in (
        looped + ["--layered-grad-accumulation", "--breadth-first-microbatches", "2",
                  "--data-parallel-sharding-strategy", "optim_grads_params"],
        looped + ["--layered-grad-accumulation", "--use-distributed-optimizer", "--no-checkpoint-layer-inputs"],
        ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "interleaved-1f1b",
         "--num-layers-per-virtual-pipeline-stage", "1", "--data-parallel-sharding-strategy", "optim_grads_params"],
    ):
        pipelined = run_distributed(4, _pretrain_losses, argv + layout)[0]
        assert len(pipelined) == 3
        for step, (a, b) in enumerate(zip(pipelined, reference)):
            assert abs(a - b) <= 1e-5 * abs(b), (layout, step, pipelined, reference)


def _pretrain_rows(ctx, argv):
    from megatron_pp.training.arguments import parse_args
    from megatron_pp.training.train import pretrain

    args = parse_args(argv)
    return pretrain(args, state=ctx.parallel_state(1, args.pipeline_model_parallel_size))


def test_sharded_weights_evaluate_save_and_resume_exactly(tmp_path):
    """Evaluation and checkpoints gather the sharded weights; a resumed run continues the same trajectory."""
    argv = ["--model-preset", "gpt-tiny", "--mock-data", "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3",
            "--seed", "7", "--clip-grad", "1.0", "--global-batch-size", "8",
            "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "looped-bfs", "--layered-grad-accumulation",
            "--num-layers-per-virtual-pipeline-stage", "1", "--data-parallel-sharding-strategy", "optim_grads_params",
            "--eval-interval", "2", "--eval-iters", "1"]
    straight = run_distributed(4, _pretrain_rows, argv)[0]
    first = run_distributed(4, _pretrain_rows, argv + ["--save", str(tmp_path), "--exit-interval", "2"])[0]
    resumed = run_distributed(4, _pretrain_rows, argv + ["--load", str(tmp_path)])[0]
    losses = [r.get("loss", r.get("eval_loss")) for r in straight]
    assert [r.get("loss", r.get("eval_loss")) for r in first + resumed] == losses
    assert [r["iteration"] for r in straight] == [1, 2, 2, 3, 4, 4]
    single = _single_process_rows(argv[:argv.index("--pipeline-model-parallel-size")] + ["--eval-interval", "2",
                                                                                          "--eval-iters", "1"])
    for a, b in zip(losses, [r.get("loss", r.get("eval_loss")) for r in single]):
        assert math.isclose(a, b, rel_tol=1e-5), (losses, single)


@pytest.mark.parametrize("precision, tol", [("--bf16", 2e-2), ("--fp16", 1e-2)])
def test_low_precision_with_sharded_weights_tracks_fp32(precision, tol):
    """bf16 / fp16 (dynamic loss scale) weights, sharded and gathered in that dtype, fp32 main weights."""
    argv = ["--model-preset", "gpt-tiny", *COMMON, "--global-batch-size", "8"]
    reference = _single_process_losses(argv)
    layout = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "looped-bfs", "--layered-grad-accumulation",
              "--num-layers-per-virtual-pipeline-stage", "1", "--data-parallel-sharding-strategy", "optim_grads_params"]
    low = run_distributed(4, _pretrain_losses, argv + layout + [precision])[0]
    for step, (a, b) in enumerate(zip(low, reference)):
        assert abs(a - b) <= tol * abs(b), (step, low, reference)
    assert low != reference


def test_weight_residency_gathers_one_run_ahead_and_releases_at_each_runs_end():
    # A fake store records the protocol: the step's first run is gathered and waited for at its first
    # action, each run prefetches the next run's chunk, and a chunk is released after its run's last action.
    class Recorder:
        def __init__(self):
            self.calls = []

        def acquire(self, chunk):
            self.calls.append(("acquire", chunk))

        def wait(self, chunk):
            self.calls.append(("wait", chunk))

        def release(self, chunk):
            self.calls.append(("release", chunk))

    weights = Recorder()
    actions = [Action.parse(t) for t in "F0.0 F1.0 SEND_F1.0>1 F0.1 F1.1 RECV_B1.1<1 B1.1 B0.1 B1.2".split()]
    residency = WeightResidency(actions, weights)
    assert residency.runs == [0, 1, 2]
    for a in actions:
        if a.op in COMPUTE_OPS:
            residency.before(a)
            residency.after(a)
    assert weights.calls == [("acquire", 0), ("wait", 0), ("acquire", 1), ("release", 0),
                             ("wait", 1), ("acquire", 2), ("release", 1),
                             ("wait", 2), ("release", 2)]
