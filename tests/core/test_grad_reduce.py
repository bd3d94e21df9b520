"""Bucketed, overlapped gradient reduction and the distributed optimizer against plain data parallelism.

Each case trains a real pipeline (`build_pipeline`, gloo world of 4) for 3 Adam steps with clipping
active, in four ways from the same initial weights: the plain synchronous path (`finalize_gradients`,
`global_grad_norm`, `clip_gradients`, torch AdamW on the model's parameters), then `build_optimizer` with
overlapped buckets, with the distributed optimizer (overlapped and not). Buckets are small so every
chunk has several. Every rank's weights must match the plain path to rel 1e-6 per tensor. That bar
needs the same sums in the same order, not just the same maths: the attention key bias has an exactly
zero true gradient (softmax ignores a constant added to every score), so its gradient is rounding
noise, which Adam normalises into full-size updates. With dp = 2 (two-term sums are order-free) and
fp64 norms the paths in fact agree bitwise. The overlapped runs must really overlap: some buckets are
already in flight when the executor returns.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron_pp.core.grads import (
    GradientReducer,
    clip_gradients,
    cross_rank_tied,
    finalize_gradients,
    global_grad_norm,
    unique_parameters,
)
from megatron_pp.core.parallel_state import ParallelState, RankLayout
from megatron_pp.data.mock import MockData
from megatron_pp.models.presets import get_preset
from megatron_pp.schedules.registry import build_schedule
from megatron_pp.training.optimizer import OptimizerConfig, build_optimizer
from megatron_pp.training.train import build_pipeline
from tests.dist import run_distributed

SEED = 99
MICRO_BATCH = 2
STEPS = 3
LR = 1e-2
CLIP = 0.05  # below the tiny models' gradient norms, so clipping is active in every step
BUCKET_BYTES = 32 * 1024
TOL = 1e-6


def global_tokens(microbatches, state) -> float:
    count = torch.stack([mb["loss_mask"].sum() for mb in microbatches]).sum().double()
    if state.dp_size > 1:
        dist.all_reduce(count, group=state.dp_group)
    return float(count)


def make_pipeline(ctx, preset, layers, tp, pp, schedule_name, m, v, sp, **overrides):
    """A fresh pipeline (weights from SEED) and its mock data; `overrides` change model config fields."""
    state = ctx.parallel_state(tp, pp)
    config = dataclasses.replace(get_preset(preset), num_layers=layers, **overrides)
    schedule = build_schedule(schedule_name, pp, m, v)
    pipe = build_pipeline(config, state, schedule, micro_batch_size=MICRO_BATCH, seed=SEED, sequence_parallel=sp)
    global_batch = MICRO_BATCH * m * state.dp_size
    data = MockData(SEED, config.seq_length, config.vocab_size, MICRO_BATCH, global_batch, state.dp_size)
    return pipe, data


def local_weights(pipe) -> dict[str, torch.Tensor]:
    return {f"{c}:{n}": p.detach().clone() for c, chunk in enumerate(pipe.chunks) for n, p in chunk.named_parameters()}


def train_plain(pipe, data) -> dict:
    """The synchronous reference: per-step zero, run, finalize, norm, clip, AdamW on the model's parameters."""
    state = pipe.state
    params = unique_parameters(pipe.chunks)
    adam = torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1]},
                              {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}],
                             lr=LR, weight_decay=0.1, foreach=True)
    norms = []
    for step in range(STEPS):
        for p in params:
            p.grad = None
        mbs = data.step_microbatches(step, state.dp_rank)
        pipe.executor.run(mbs, loss_scale=1.0 / global_tokens(mbs, state))
        finalize_gradients(pipe.chunks, state)
        norms.append(global_grad_norm(pipe.chunks, state))
        clip_gradients(pipe.chunks, CLIP, norms[-1])
        adam.step()
    return {"weights": local_weights(pipe), "norms": norms}


def train_reducer(pipe, data, overlap: bool, distributed: bool) -> dict:
    state = pipe.state
    config = OptimizerConfig(lr=LR, weight_decay=0.1, clip_grad=CLIP, overlap_grad_reduce=overlap,
                             use_distributed_optimizer=distributed, bucket_bytes=BUCKET_BYTES)
    opt = build_optimizer(pipe.chunks, state, config)
    norms, in_flight = [], []
    for step in range(STEPS):
        mbs = data.step_microbatches(step, state.dp_rank)
        opt.reducer.start_step(len(mbs))
        pipe.executor.run(mbs, loss_scale=opt.loss_multiplier / global_tokens(mbs, state))
        in_flight.append(sum(b.pending is not None for b in opt.reducer.buckets))
        opt.reducer.finish()
        outcome = opt.step(LR)
        assert not outcome.skipped and outcome.loss_scale is None
        norms.append(outcome.grad_norm)
    return {"weights": local_weights(pipe), "norms": norms, "in_flight": in_flight,
            "buckets": len(opt.reducer.buckets), "shard_elements": sum(m.numel() for m in opt.main.params),
            "model_elements": sum(p.numel() for p in unique_parameters(pipe.chunks))}


MODES = {"overlap": (True, False), "distributed": (False, True), "distributed+overlap": (True, True)}


def check_embedding_sum_plan(pipe, case) -> None:
    """Before any collective, so a wrong plan fails at once instead of hanging: the tied word embedding is
    summed over the embedding group exactly where its two copies live on two ranks. In the V placement rank 0
    holds stage 0 and the last stage, so both of its chunks share one parameter and no rank joins the sum
    (rank 0 alone in that all-reduce would wait for the last pipeline rank forever)."""
    state, schedule_name = pipe.state, case[4]
    schedule = build_schedule(schedule_name, case[3], case[5], case[6])
    tied = [p for p in unique_parameters(pipe.chunks) if getattr(p, "shared_embedding", False)]
    ends_together = schedule.placement[0][0] == schedule.placement[-1][0]
    summed = cross_rank_tied(pipe.chunks)
    reducer = GradientReducer(pipe.chunks, state, overlap=False, bucket_bytes=BUCKET_BYTES)
    try:
        if ends_together or state.pp_size == 1:
            assert summed == [] and reducer.embedding_params == [], (state.rank, schedule_name)
            if state.is_first_pp_rank and pipe.config.untie_embeddings_and_output_weights:
                assert tied == [], schedule_name  # an untied model (LLaMA) shares nothing
            elif state.is_first_pp_rank:  # both ends here: one tensor, held by the first and the last chunk
                assert len(tied) == 1 and all(any(p is tied[0] for p in c.parameters()) for c in
                                              (pipe.chunks[0], pipe.chunks[-1])), schedule_name
        else:
            assert [id(p) for p in summed] == [id(p) for p in tied] == [id(p) for p in reducer.embedding_params]
    finally:
        reducer.close()


def compare_modes(ctx, case):
    """Worker: the plain run and each mode's run from the same initial weights."""
    pipe, data = make_pipeline(ctx, *case)
    check_embedding_sum_plan(pipe, case)
    initial = local_weights(pipe)
    results = {"plain": {**train_plain(pipe, data), "initial": initial}}
    for name, (overlap, distributed) in MODES.items():
        results[name] = train_reducer(*make_pipeline(ctx, *case), overlap, distributed)
    return results


# (preset, layers, tp, pp, schedule, m, v, sequence_parallel); all with dp = 2 in a world of 4.
CASES = [
    # Tied embedding across pipeline ranks (embedding-group sum) and two chunks per rank.
    ("gpt-tiny", 4, 1, 2, "interleaved-1f1b", 4, 2, False),
    # pp = 1 with tensor and sequence parallelism (sequence-parallel sums after the dp reduce-scatter).
    ("llama-tiny", 2, 2, 1, "1f1b", 2, 1, True),
    # A split backward whose BW runs apart from its BI: the deferred weight GEMMs report their gradients to
    # the reducer themselves (`grad_added`), so buckets still launch inside the step.
    ("gpt-tiny", 2, 1, 2, "zb-h1", 4, 1, False),
    # The V placement with a tied embedding: rank 0 holds both ends of the pipeline (stages 0 and 3), so the
    # embedding-group sum must be skipped on both pipeline ranks; a regression hung with rank 0 alone in it.
    ("gpt-tiny", 4, 1, 2, "zb-v", 4, 2, False),
    ("gpt-tiny", 4, 1, 2, "v-half", 4, 2, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-tp{c[2]}-pp{c[3]}-dp2-{c[4]}")
def test_bucketed_and_distributed_match_plain_data_parallel(case):
    results = run_distributed(4, compare_modes, case)
    for rank, by_mode in enumerate(results):
        plain = by_mode["plain"]
        for mode in MODES:
            run = by_mode[mode]
            assert run["buckets"] >= 4, (mode, run["buckets"])
            for a, b in zip(run["norms"], plain["norms"]):
                assert abs(a - b) <= 1e-6 * b, (rank, mode, run["norms"], plain["norms"])
            assert set(run["weights"]) == set(plain["weights"])
            for name, ref in plain["weights"].items():
                err = ((run["weights"][name] - ref).norm() / ref.norm()).item()
                assert err <= TOL, f"rank {rank} {mode}: {name} off by {err:.2e}"
            if mode != "distributed":
                # Every gradient is final when the pipeline's last backward ends: all buckets are on their way.
                assert run["in_flight"] == [run["buckets"]] * STEPS, f"{mode}: buckets left for finish()"
            if mode.startswith("distributed"):
                # Each dp rank owns about half the elements; padding is under dp elements per bucket.
                half = run["model_elements"] / 2
                assert abs(run["shard_elements"] - half) <= run["buckets"], (run["shard_elements"], half)
    # Training moved the weights, and data-parallel replicas hold the same model.
    layout = RankLayout(4, tp=case[2], pp=case[3])
    for rank, by_mode in enumerate(results):
        plain = by_mode["plain"]
        assert all(not torch.equal(plain["initial"][n], w) for n, w in plain["weights"].items() if w.dim() > 1)
        c = layout.coords(rank)
        peer = results[layout.rank(c.tp, 1 - c.dp, c.pp)]["distributed+overlap"]["weights"]
        for name, w in by_mode["distributed+overlap"]["weights"].items():
            assert torch.equal(w, peer[name]), (rank, name)


# Contribution counting, one process ------------------------------------------------------------------------


class _Chunk(torch.nn.Module):
    def __init__(self, shared: torch.nn.Parameter):
        super().__init__()
        self.shared = shared
        self.own = torch.nn.Parameter(torch.randn(3))

    def forward(self, x):
        return (x * self.shared * self.own).sum()


def test_parameter_shared_by_two_chunks_waits_for_both():
    """A parameter held by two local chunks expects 2 x m contributions; the accumulated fp32 gradient
    equals plain autograd's; a surplus contribution or a backward outside a step is an error."""
    torch.manual_seed(0)
    shared = torch.nn.Parameter(torch.randn(3))
    chunks = [_Chunk(shared), _Chunk(shared)]
    reducer = GradientReducer(chunks, ParallelState.build(), overlap=True, bucket_bytes=8)
    assert [len(b.params) for b in reducer.buckets] == [1, 1, 1]  # shared one last: it completes last
    assert reducer.buckets[-1].params[0] is shared
    inputs = [torch.randn(3) for _ in range(4)]
    reducer.start_step(2)
    for x, chunk in zip(inputs, [chunks[1], chunks[1], chunks[0], chunks[0]]):
        chunk(x).backward()
    assert [b.waiting for b in reducer.buckets] == [0, 0, 0]
    reducer.finish()
    expected = sum(x * c.own for x, c in zip(inputs, [chunks[1], chunks[1], chunks[0], chunks[0]])).detach()
    assert torch.allclose(shared.grad, expected) and shared.grad.data_ptr() == reducer.grad_view(shared).data_ptr()
    with pytest.raises(RuntimeError, match="outside a step"):
        chunks[0](inputs[0]).backward()
    reducer.start_step(1)
    chunks[0](inputs[0]).backward()
    with pytest.raises(RuntimeError, match="received 2 gradient contributions"):
        chunks[0](inputs[0]).backward()


def test_close_lets_the_model_be_collected():
    """The gradient hooks hold the reducer and the reducer holds the parameters: without `close()` that
    cycle keeps a finished job's model alive (pretrain closes its reducer; tests/reliability/test_soak.py)."""
    import gc
    import weakref

    def build():
        shared = torch.nn.Parameter(torch.randn(3))
        chunks = [_Chunk(shared), _Chunk(shared)]
        return weakref.ref(shared), GradientReducer(chunks, ParallelState.build(), overlap=True, bucket_bytes=8)

    closed, reducer = build()
    reducer.close()
    del reducer
    gc.collect()
    assert closed() is None
