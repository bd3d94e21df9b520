"""Sharded weights (ZeRO-3): residency and reference counting, write-back, the traffic of layered vs depth-first
order counted on the data-parallel group, and the counter itself."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron_pp.core.comm_counter import CommCounter
from megatron_pp.data.mock import MockData
from megatron_pp.models.presets import get_preset
from megatron_pp.models.transformer import build_model
from megatron_pp.schedules.registry import build_schedule
from megatron_pp.training.layered import connect_optimizer
from megatron_pp.training.optimizer import OptimizerConfig, build_optimizer
from megatron_pp.training.train import build_pipeline, train_step
from tests.dist import run_distributed

SEED = 11
BUCKET_BYTES = 16 * 1024


def _sharded(ctx, pp: int, schedule_name: str, m: int, v: int, layers: int, **options):
    state = ctx.parallel_state(1, pp)
    config = dataclasses.replace(get_preset("gpt-tiny"), num_layers=layers)
    schedule = build_schedule(schedule_name, pp, m, v, **options)
    pipe = build_pipeline(config, state, schedule, micro_batch_size=2, seed=SEED)
    optimizer = build_optimizer(pipe.chunks, state, OptimizerConfig(
        use_distributed_optimizer=True, data_parallel_sharding_strategy="optim_grads_params",
        layered_grad_accumulation=bool(options.get("layered_grad_accumulation")), bucket_bytes=BUCKET_BYTES,
        clip_grad=0.0))
    connect_optimizer(pipe.executor, optimizer)
    return pipe, optimizer


def residency(ctx) -> dict:
    """Worker, dp = 2, pp = 1: two chunks of one layer; the tied embedding is one parameter in both."""
    pipe, optimizer = _sharded(ctx, 1, "looped-bfs", 1, 2, 2)
    weights = optimizer.sharded_weights
    chunks = pipe.chunks
    initial = dict(build_model(pipe.config, seed=SEED).named_parameters())
    shared = chunks[0].embedding.word_embeddings.weight
    assert chunks[1].embedding.word_embeddings.weight is shared
    out = {"freed_at_start": all(p.untyped_storage().nbytes() == 0 for c in chunks for p in c.parameters()),
           "resident_at_start": weights.resident_bytes(), "shard_bytes": weights.shard_bytes(),
           "model_bytes": sum(p.numel() * 4 for p in {p for c in chunks for p in c.parameters()})}
    weights.acquire(1)
    weights.wait(1)
    out["chunk1_values"] = all(torch.equal(p, initial[n]) for n, p in chunks[1].named_parameters())
    out["chunk0_layer_freed"] = all(p.untyped_storage().nbytes() == 0 for p in chunks[0].layers.parameters())
    weights.acquire(0)
    weights.wait(0)
    weights.release(1)
    out["shared_kept_by_chunk0"] = shared.untyped_storage().nbytes() > 0
    out["chunk1_own_freed"] = all(p.untyped_storage().nbytes() == 0 for p in chunks[1].layers.parameters())
    weights.release(0)
    out["resident_at_end"] = weights.resident_bytes()
    with weights.gathered(write_back=True), torch.no_grad():
        for c in chunks:
            for p in c.layers.parameters():
                p.add_(1.0)
    with weights.gathered():
        out["written_back"] = all(torch.equal(p, initial[f"layers.{n}"] + 1.0)
                                  for n, p in chunks[0].layers.named_parameters())
    for call, message in ((lambda: weights.wait(0), "before acquire"), (lambda: weights.release(1), "without a matching")):
        try:
            call()
        except RuntimeError as err:
            out.setdefault("errors", []).append(message in str(err))
    return out


def test_weights_exist_only_while_acquired():
    for r in run_distributed(2, residency):
        assert r["freed_at_start"] and r["resident_at_start"] == 0 and r["resident_at_end"] == 0
        # Each of the 2 ranks keeps half of every (padded) bucket.
        assert abs(r["shard_bytes"] - r["model_bytes"] / 2) <= 4 * 8, (r["shard_bytes"], r["model_bytes"])
        assert r["chunk1_values"] and r["chunk0_layer_freed"]
        assert r["shared_kept_by_chunk0"] and r["chunk1_own_freed"]
        assert r["written_back"] and r["errors"] == [True, True]


def counted_steps(ctx, schedule_name: str, m: int, steps: int, **options) -> dict:
    """Worker, pp 2 x dp 2, 2 chunks of one layer: dp collectives of `steps` training steps (the optimizer
    step included), and whether the weights after them equal those of plain dp with the same updates."""
    pipe, optimizer = _sharded(ctx, 2, schedule_name, m, 2, 4, **options)
    state = pipe.state
    config = pipe.config
    data = MockData(SEED, config.seq_length, config.vocab_size, 2, 2 * m * 2, 2)
    with CommCounter(state.dp_group) as counter:
        for step in range(steps):
            train_step(pipe, data.step_microbatches(step, state.dp_rank), optimizer)
            optimizer.step(1e-3)
    return {"totals": counter.totals(), "gathers": optimizer.sharded_weights.gathers,
            "gather_wait_s": optimizer.sharded_weights.gather_wait_s}


def test_layered_traffic_is_constant_in_m_and_depth_first_grows_with_it():
    layered, depth_first = {}, {}
    for m in (2, 4, 8):
        layered[m] = run_distributed(4, counted_steps, "looped-bfs", m, 1, layered_grad_accumulation=True)[0]
        depth_first[m] = run_distributed(4, counted_steps, "interleaved-1f1b", m, 1)[0]
    gathers = {m: r["totals"]["all_gather"] for m, r in layered.items()}
    assert gathers[2] == gathers[4] == gathers[8]  # calls and bytes
    # Reductions: one per bucket per step in both orders; scalars (token count, loss) are 8 bytes each.
    reduced = {m: r["totals"]["all_reduce"][1] for m, r in layered.items()}
    assert reduced[2] == reduced[4] == reduced[8] == depth_first[2]["totals"]["all_reduce"][1]
    df = [depth_first[m]["totals"]["all_gather"] for m in (2, 4, 8)]
    assert df[0][0] < df[1][0] < df[2][0] and df[0][1] < df[1][1] < df[2][1]
    assert df[2][1] >= 3 * gathers[8][1]  # m = 8: at least 3x the bytes of layered


def counter_worker(ctx) -> dict:
    state = ctx.parallel_state(1, 1)
    x = torch.ones(10)
    with CommCounter(state.dp_group) as counter:
        dist.all_reduce(x, group=state.dp_group)
        dist.all_reduce(torch.ones(3))  # the world group: not counted
        parts = [torch.empty(4) for _ in range(2)]
        dist.all_gather(parts, torch.ones(4), group=state.dp_group)
    patched_back = dist.all_reduce.__name__ == "all_reduce"
    return {"calls": [(c.op, c.nbytes) for c in counter.calls], "patched_back": patched_back, "x": x[0].item()}


def test_counter_records_only_its_group_and_unpatches():
    for r in run_distributed(2, counter_worker):
        assert r["calls"] == [("all_reduce", 40), ("all_gather", 32)]
        assert r["patched_back"] and r["x"] == 2.0


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_sharding_strategies_need_the_distributed_optimizer(strategy):
    with pytest.raises(ValueError, match=f"--data-parallel-sharding-strategy {strategy} shards the optimizer"):
        OptimizerConfig(data_parallel_sharding_strategy=strategy)


def stash_bytes(ctx, sharding: str) -> int:
    """Worker, pp 2 x dp 2: peak activation-stash bytes of one looped-bfs step without layer recompute, so
    the head stage saves its weights for the backward (they must not count as activations)."""
    state = ctx.parallel_state(1, 2)
    config = dataclasses.replace(get_preset("gpt-tiny"), num_layers=4)
    schedule = build_schedule("looped-bfs", 2, 2, 2, checkpoint_layer_inputs=False)
    pipe = build_pipeline(config, state, schedule, micro_batch_size=2, seed=SEED)
    optimizer = build_optimizer(pipe.chunks, state, OptimizerConfig(
        use_distributed_optimizer=sharding != "no_shard", data_parallel_sharding_strategy=sharding))
    connect_optimizer(pipe.executor, optimizer)
    data = MockData(SEED, config.seq_length, config.vocab_size, 2, 8, 2)
    result, _ = train_step(pipe, data.step_microbatches(0, state.dp_rank), optimizer)
    return result.peak_stash_bytes


def test_gathered_weights_never_count_as_activations():
    assert run_distributed(4, stash_bytes, "optim_grads_params") == run_distributed(4, stash_bytes, "no_shard")
