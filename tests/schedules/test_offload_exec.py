"""PipeOffload in the executor: measured device-resident stashes against interleaved 1F1B and the simulator
(p=4, v=4, one layer per chunk), and exact gradients when every copy is slow (a delayed copy stream)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_pp.data.mock import MockData
from megatron_pp.models.layout import split_layers
from megatron_pp.models.presets import get_preset
from megatron_pp.models.transformer import StageModel
from megatron_pp.schedules.execute import PipelineExecutor
from megatron_pp.schedules.offload_store import OffloadStore
from megatron_pp.schedules.registry import build_schedule
from megatron_pp.schedules.simulate import simulate
from megatron_pp.schedules.store import ActivationStore
from megatron_pp.training.train import build_pipeline, train_step
from tests.dist import run_distributed
from tests.schedules.test_offload_store import ThreadedCopies

SEED = 7
MICRO_BATCH = 2
P, V, M = 4, 4, 8
LAYERS = P * V  # one transformer layer per chunk: layer i on rank i mod p


def _config(layers: int):
    return dataclasses.replace(get_preset("gpt-tiny"), num_layers=layers)


def measure(ctx, name: str) -> dict:
    """Worker: one step of `name`; rank 0's resident-stash peak (count, bytes) and its bytes per stash."""
    state = ctx.parallel_state(1, P)
    config = _config(LAYERS)
    schedule = build_schedule(name, P, M, V)
    pipe = build_pipeline(config, state, schedule, micro_batch_size=MICRO_BATCH, seed=SEED)
    data = MockData(SEED, config.seq_length, config.vocab_size, MICRO_BATCH, MICRO_BATCH * M)
    result, _ = train_step(pipe, data.step_microbatches(0, 0))
    per_stash = []
    batch = data.microbatch(0, 0, 0)
    for chunk in pipe.chunks:  # what one microbatch saves on each of this rank's chunks, measured alone
        store = ActivationStore(list(chunk.parameters()) + list(chunk.buffers()))
        x = None if chunk.spec.has_embedding else torch.randn(config.seq_length, MICRO_BATCH, config.hidden_size,
                                                              requires_grad=True)
        with store.stash(0):
            y = chunk(x, batch)
            if chunk.spec.has_head:
                (y.float() * batch["loss_mask"]).sum()
        per_stash.append(store.live_bytes)
    return {"pp_rank": state.pp_rank, "count": result.peak_stash_count, "bytes": result.peak_stash_bytes,
            "per_stash": sum(per_stash) / len(per_stash), "host": result.peak_host_bytes}


def test_measured_resident_stashes_on_rank0_against_interleaved_and_the_simulator():
    measured, simulated = {}, {}
    for name in ("interleaved-1f1b", "gis-h", "po-h", "po-f"):
        rank0 = next(r for r in run_distributed(P, measure, name) if r["pp_rank"] == 0)
        measured[name] = (rank0["count"], rank0["bytes"] / rank0["per_stash"])
        simulated[name] = simulate(build_schedule(name, P, M, V)).peak_stash[0]
        count, from_bytes = measured[name]
        assert abs(count - simulated[name]) <= 1, (name, count, simulated[name])
        assert abs(from_bytes - count) <= 1, (name, from_bytes, count)
        assert (rank0["host"] > 0) == name.startswith("po-")
    base_count, base_bytes = measured["interleaved-1f1b"]
    assert base_count == V * P + P - 1 == simulated["interleaved-1f1b"]
    for name, limit in (("gis-h", 0.6), ("po-h", 0.3)):
        count, from_bytes = measured[name]
        assert count <= limit * base_count and from_bytes <= limit * base_bytes, (name, measured[name])
    assert measured["po-f"][0] <= 4 and measured["po-f"][1] <= 4


def _single_process_run(name: str, store=None, steps: int = 1, **options):
    """p = 1, every chunk on one process (no communication): loss, gradients, results and the executor."""
    config = dataclasses.replace(get_preset("llama-tiny"), num_layers=4)
    schedule = build_schedule(name, 1, 4, 4, **options)
    layout = split_layers(4, 1, 4)
    chunks = [StageModel(config, layout[schedule.stage_of(0, c)], seed=SEED) for c in range(4)]
    executor = PipelineExecutor(schedule, 0, chunks, comm=None, activation_shape=(config.seq_length, MICRO_BATCH,
                                config.hidden_size), dtype=torch.float32, device=torch.device("cpu"), store=store)
    data = MockData(SEED, config.seq_length, config.vocab_size, MICRO_BATCH, MICRO_BATCH * 4)
    results, host_allocations = [], []
    for step in range(steps):
        for chunk in chunks:
            chunk.zero_grad(set_to_none=True)
        batches = data.step_microbatches(step, 0)
        results.append(executor.run(batches, 1.0 / sum(float(b["loss_mask"].sum()) for b in batches)))
        host_allocations.append(getattr(executor.store, "pool", None) and executor.store.pool.allocations)
    executor.host_allocations = host_allocations
    grads = {n: p.grad.clone() for chunk in chunks for n, p in chunk.named_parameters()}
    return results, grads, executor


def test_slow_copies_keep_the_executor_exact_and_host_buffers_are_reused():
    plain, ref_grads, _ = _single_process_run("gis", steps=2, interleave_group_size=1)
    engine = ThreadedCopies(delay_s=0.002)
    runs, grads, executor = _single_process_run("po-f", store=OffloadStore(copies=engine), steps=2)
    assert isinstance(executor.store, OffloadStore)
    assert [r.loss_sum for r in runs] == [r.loss_sum for r in plain]
    assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[n], ref_grads[n]) for n in grads)
    # Resident peaks depend on when the slow copies finish (memory goes only then); host buffers were used.
    assert all(r.peak_host_bytes > 0 for r in runs)
    # After the first step every host buffer comes from the pool.
    first, second = executor.host_allocations
    assert first > 0 and second == first and executor.store.host_bytes == 0


def test_executor_picks_an_offload_store_and_refuses_a_plain_one():
    plain, _, _ = _single_process_run("gis", interleave_group_size=1)
    runs, _, executor = _single_process_run("po-f")
    assert isinstance(executor.store, OffloadStore)
    # Synchronous copies: p = 1, v = 4 keeps chunk 3 (too short-lived) and one stash being computed.
    assert (plain[0].peak_stash_count, runs[0].peak_stash_count) == (4, 2)
    assert runs[0].peak_stash_bytes < 0.6 * plain[0].peak_stash_bytes
    with pytest.raises(ValueError, match="offloads stashes, which needs an OffloadStore"):
        _single_process_run("po-h", store=ActivationStore())


def _pretrain_losses(ctx, argv):
    from megatron_pp.training.arguments import parse_args
    from megatron_pp.training.train import pretrain

    args = parse_args(argv)
    rows = pretrain(args, state=ctx.parallel_state(args.tensor_model_parallel_size, args.pipeline_model_parallel_size))
    return [r["loss"] for r in rows if "loss" in r] if rows else None


TRAIN = ["--model-preset", "llama-tiny", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "16",
         "--train-iters", "3", "--lr", "1e-3", "--seed", "7", "--clip-grad", "1.0"]


@pytest.mark.parametrize("flags", [
    pytest.param(["--num-layers", "8", "--pipeline-schedule", "gis", "--offload-chunks", "1"], id="gis-offload"),
    pytest.param(["--num-layers", "8", "--pipeline-schedule", "gis-h", "--offload-fraction", "0.5"],
                 id="gis-h-offload"),
    pytest.param(["--num-layers", "8", "--pipeline-schedule", "po-h", "--offload-time", "0.5"], id="po-h"),
    pytest.param(["--num-layers", "8", "--pipeline-schedule", "po-f"], id="po-f"),
    # PipeOffload's own layout: v·p − 2 layers, the embedding and the head in the freed slots.
    pytest.param(["--num-layers", "6", "--pipeline-schedule", "po-f", "--account-for-embedding-in-pipeline-split",
                  "--account-for-loss-in-pipeline-split"], id="po-f-paper-layout"),
])
def test_trains_end_to_end_like_one_process(flags):
    """Three Adam steps with clipping, one layer per chunk on 4 ranks: the losses of one process."""
    layers = flags[1]
    reference = _pretrain_losses_single(TRAIN + ["--num-layers", layers])
    argv = TRAIN + flags + ["--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "1"]
    losses = next(r for r in run_distributed(4, _pretrain_losses, argv) if r is not None)
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, reference)), (losses, reference)


_SINGLE: dict = {}


def _pretrain_losses_single(argv):
    from megatron_pp.training.arguments import parse_args
    from megatron_pp.training.train import pretrain

    key = tuple(argv)
    if key not in _SINGLE:
        _SINGLE[key] = [r["loss"] for r in pretrain(parse_args(argv)) if "loss" in r]
    return _SINGLE[key]
