"""The training optimizer: LR schedules (golden values), configuration from Megatron's flags, global
gradient-norm clipping across tp x pp x dp against one process, bf16 main weights, and exact resume
from `state_dict` (plain and distributed optimizer)."""
from __future__ import annotations

import argparse
import dataclasses
import io
import math

import pytest
import torch

from megatron_pp.core.parallel_state import ParallelState
from megatron_pp.data.mock import MockData
from megatron_pp.models.presets import get_preset
from megatron_pp.models.transformer import build_model, full_named_parameters
from megatron_pp.training.optimizer import LRSchedule, OptimizerConfig, build_optimizer
from tests.core.test_grad_reduce import global_tokens, make_pipeline
from tests.dist import run_distributed

SEED = 99  # make_pipeline's seed
MICRO_BATCH = 2
CLIP = 0.05


# LR schedules ---------------------------------------------------------------------------------------------


def lrs(schedule: LRSchedule, steps) -> list[float]:
    return [schedule.learning_rate(t) for t in steps]


def test_lr_warmup_then_constant():
    s = LRSchedule(lr=1e-3, warmup_steps=4)
    assert lrs(s, [1, 2, 4, 5, 100]) == pytest.approx([2.5e-4, 5e-4, 1e-3, 1e-3, 1e-3])


def test_lr_linear_and_cosine_decay():
    linear = LRSchedule(lr=1e-3, min_lr=1e-4, decay_style="linear", warmup_steps=2, decay_steps=12)
    assert lrs(linear, [1, 2, 7, 12, 20]) == pytest.approx([5e-4, 1e-3, 5.5e-4, 1e-4, 1e-4])
    cosine = LRSchedule(lr=1e-3, min_lr=1e-4, decay_style="cosine", warmup_steps=2, decay_steps=10)
    # t=4: a quarter of the decay, (1 + cos(pi/4)) / 2 = 0.853553...
    assert lrs(cosine, [2, 4, 6, 10]) == pytest.approx([1e-3, 1e-4 + 9e-4 * 0.8535533905932737, 5.5e-4, 1e-4])


@pytest.mark.parametrize("style,at_half", [
    ("linear", 0.5), ("cosine", 0.5), ("exponential", 2 * 0.5**0.5 - 1), ("minus_sqrt", 1 - 0.5**0.5),
])
def test_lr_wsd(style, at_half):
    # Warmup 2, stable until 10 - 4 = 6, then the last 4 steps decay from 1e-3 to 0.
    s = LRSchedule(lr=1e-3, decay_style="WSD", warmup_steps=2, decay_steps=10, wsd_decay_steps=4, wsd_decay_style=style)
    expected = [5e-4, 1e-3, 1e-3, 1e-3, 1e-3 * at_half, 0.0, 0.0]
    assert lrs(s, [1, 2, 5, 6, 8, 10, 11]) == pytest.approx(expected, abs=1e-12)


def test_lr_schedule_from_megatron_flags():
    args = argparse.Namespace(lr=2e-3, min_lr=2e-4, lr_decay_style="cosine", lr_warmup_iters=10, lr_decay_iters=None,
                              train_iters=110)
    s = LRSchedule.from_args(args)
    assert (s.warmup_steps, s.decay_steps, s.by_samples) == (10, 110, False)
    assert s.learning_rate(60) == pytest.approx(1.1e-3)
    samples = argparse.Namespace(lr=1e-3, lr_decay_style="WSD", lr_warmup_samples=64, lr_wsd_decay_samples=128,
                                 lr_wsd_decay_style="linear", train_samples=1024, train_iters=None)
    s = LRSchedule.from_args(samples)
    assert (s.warmup_steps, s.decay_steps, s.wsd_decay_steps, s.by_samples) == (64, 1024, 128, True)
    assert s.learning_rate(iteration=4, consumed_samples=32) == pytest.approx(5e-4)
    assert s.learning_rate(iteration=120, consumed_samples=960) == pytest.approx(5e-4)
    with pytest.raises(ValueError, match="consumed_samples"):
        s.learning_rate(3)


@pytest.mark.parametrize("kwargs,flag", [
    (dict(lr=1e-3, min_lr=2e-3), "--min-lr"),
    (dict(lr=1e-3, decay_style="step"), "--lr-decay-style"),
    (dict(lr=1e-3, decay_style="cosine", warmup_steps=10, decay_steps=10), "--lr-decay-iters"),
    (dict(lr=1e-3, decay_style="WSD", decay_steps=10), "--lr-wsd-decay-iters"),
    (dict(lr=1e-3, decay_style="WSD", decay_steps=10, wsd_decay_steps=2, wsd_decay_style="sqrt"),
     "--lr-wsd-decay-style"),
    (dict(lr=1e-3, decay_style="linear", decay_steps=5, warmup_steps=8, by_samples=True), "--lr-decay-samples"),
])
def test_lr_schedule_rejects_bad_values(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        LRSchedule(**kwargs)


def test_lr_schedule_rejects_mixed_units():
    args = argparse.Namespace(lr=1e-3, lr_warmup_iters=5, lr_decay_samples=100, lr_decay_style="linear")
    with pytest.raises(ValueError, match="--lr-warmup-iters and --lr-decay-samples"):
        LRSchedule.from_args(args)


# Configuration ----------------------------------------------------------------------------------------------


def test_optimizer_config_from_megatron_flags():
    args = argparse.Namespace(optimizer="sgd", lr=0.1, weight_decay=0.0, sgd_momentum=0.5, clip_grad=0.0, fp16=True,
                              bf16=False, loss_scale=None, initial_loss_scale=65536.0, hysteresis=1,
                              use_distributed_optimizer=True, overlap_grad_reduce=True, unrelated_flag=3)
    config = OptimizerConfig.from_args(args)
    assert (config.optimizer, config.lr, config.sgd_momentum, config.fp16) == ("sgd", 0.1, 0.5, True)
    assert config.initial_loss_scale == 65536.0
    assert config.use_distributed_optimizer and config.overlap_grad_reduce and config.hysteresis == 1
    assert config.loss_scale_window == 1000 and config.adam_beta2 == 0.999  # absent flags keep the defaults


@pytest.mark.parametrize("kwargs,flag", [
    (dict(optimizer="lamb"), "--optimizer"), (dict(bf16=True, fp16=True), "--bf16 and --fp16"),
    (dict(adam_beta2=1.0), "--adam-beta2"), (dict(loss_scale=0.0), "--loss-scale"),
    (dict(min_loss_scale=8.0, initial_loss_scale=4.0), "--min-loss-scale"), (dict(hysteresis=0), "--hysteresis"),
    (dict(clip_grad=-1.0), "--clip-grad"),
])
def test_optimizer_config_rejects_bad_values(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        OptimizerConfig(**kwargs)


def test_precision_must_match_the_model():
    model = build_model(get_preset("gpt-tiny"), seed=SEED)
    with pytest.raises(ValueError, match="--bf16"):
        build_optimizer([model], ParallelState.build(), OptimizerConfig(bf16=True))


# Clipping across tp x pp x dp ----------------------------------------------------------------------------------

# (tp, pp, microbatches, sequence_parallel, distributed optimizer): global batch 4 x MICRO_BATCH in every layout.
CLIP_LAYOUTS = [(2, 2, 4, False, False), (1, 2, 2, False, True), (2, 1, 2, True, True)]


def sgd_step_with_clipping(ctx, tp, pp, m, sp, distributed):
    """One SGD step (lr 1, no momentum or decay): the weights move by exactly minus the clipped gradient."""
    pipe, data = make_pipeline(ctx, "gpt-tiny", 4, tp, pp, "1f1b", m, 1, sp)
    config = OptimizerConfig(optimizer="sgd", lr=1.0, sgd_momentum=0.0, weight_decay=0.0, clip_grad=CLIP,
                             use_distributed_optimizer=distributed)
    opt = build_optimizer(pipe.chunks, pipe.state, config)
    mbs = data.step_microbatches(0, pipe.state.dp_rank)
    opt.reducer.start_step(len(mbs))
    pipe.executor.run(mbs, loss_scale=opt.loss_multiplier / global_tokens(mbs, pipe.state))
    opt.reducer.finish()
    outcome = opt.step(1.0)
    weights = full_named_parameters(pipe.chunks)
    keep = pipe.state.tp_rank == 0 and pipe.state.dp_rank == 0
    return {"norm": outcome.grad_norm, "weights": weights if keep else {}}


def single_process_clipped_step():
    """Reference: the whole model, the global batch, torch's clip_grad_norm_, then w - g."""
    config = get_preset("gpt-tiny")
    model = build_model(config, seed=SEED)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    batches = MockData(SEED, config.seq_length, config.vocab_size, MICRO_BATCH, 4 * MICRO_BATCH).step_microbatches(0, 0)
    tokens = sum(float(b["loss_mask"].sum()) for b in batches)
    for batch in batches:
        ((model(None, batch).float() * batch["loss_mask"]).sum() / tokens).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
    return norm, initial, {n: initial[n] - p.grad for n, p in model.named_parameters()}


def test_clipping_uses_the_global_norm_of_every_layout():
    ref_norm, initial, ref_weights = single_process_clipped_step()
    assert ref_norm > 2 * CLIP  # clipping is active
    for layout in CLIP_LAYOUTS:
        results = run_distributed(4, sgd_step_with_clipping, *layout)
        for r in results:
            assert r["norm"] == pytest.approx(ref_norm, rel=1e-5), layout
        merged = {n: w for r in results for n, w in r["weights"].items()}
        assert set(merged) == set(ref_weights), layout
        for name, ref in ref_weights.items():
            step, ref_step = merged[name] - initial[name], ref - initial[name]
            if ref_step.norm() == 0:  # padded vocabulary rows, the attention key bias
                assert step.abs().max() <= 1e-9, (layout, name)
                continue
            err = ((step - ref_step).norm() / ref_step.norm()).item()
            assert err <= 1e-5, f"{layout}: update of {name} off by {err:.2e}"


# bf16 main weights -------------------------------------------------------------------------------------------


def test_bf16_keeps_fp32_main_weights_and_gradients():
    config = dataclasses.replace(get_preset("llama-tiny"), params_dtype=torch.bfloat16)
    model = build_model(config, seed=SEED)
    opt = build_optimizer([model], ParallelState.build(), OptimizerConfig(bf16=True, lr=1e-3, clip_grad=0.0))
    batches = MockData(SEED, config.seq_length, config.vocab_size, MICRO_BATCH, 2 * MICRO_BATCH).step_microbatches(0, 0)
    opt.reducer.start_step(len(batches))
    for batch in batches:
        ((model(None, batch).float() * batch["loss_mask"]).sum() / 100).backward()
    opt.reducer.finish()
    params = list(model.parameters())
    assert all(p.grad is None and opt.reducer.grad_view(p).dtype == torch.float32 for p in params)
    before = [m.detach().clone() for m in opt.main.params]
    outcome = opt.step(1e-6)  # Adam's first step moves every weight by ~lr: far below bf16's resolution
    assert not outcome.skipped and outcome.loss_scale is None
    assert all(m.dtype == torch.float32 for m in opt.main.params) and all(p.dtype == torch.bfloat16 for p in params)
    total = sum(m.numel() for m in before)
    # The fp32 main weights took the small update (all but the embedding rows of unseen tokens) ...
    assert sum(int((m != b).sum()) for m, b in zip(opt.main.params, before)) > 0.8 * total
    # ... which the bf16 weights could not have accumulated by themselves (only weights near 0 moved).
    assert sum(int((p != b.to(torch.bfloat16)).sum()) for p, b in zip(params, before)) < 0.05 * total
    for main, p in zip(opt.main.params, params):
        assert torch.equal(p, main.to(torch.bfloat16))


def bf16_distributed_step(ctx):
    pipe, data = make_pipeline(ctx, "gpt-tiny", 4, 1, 2, "1f1b", 2, 1, False, params_dtype=torch.bfloat16)
    opt = build_optimizer(pipe.chunks, pipe.state, OptimizerConfig(bf16=True, lr=1e-2, use_distributed_optimizer=True,
                                                                  bucket_bytes=32 * 1024))
    mbs = data.step_microbatches(0, pipe.state.dp_rank)
    opt.reducer.start_step(len(mbs))
    pipe.executor.run(mbs, loss_scale=1.0 / global_tokens(mbs, pipe.state))
    opt.reducer.finish()
    opt.step(1e-2)
    exact = all(
        torch.equal(piece.param.detach().view(-1)[piece.start : piece.end], main.to(torch.bfloat16))
        for main, piece in zip(opt.main.params, opt.main.pieces)
    )
    return {"main_dtypes": {str(m.dtype) for m in opt.main.params}, "model_is_main": exact,
            "weights": {n: p.detach().float() for c in pipe.chunks for n, p in c.named_parameters()},
            "pp_rank": pipe.state.pp_rank}


def test_bf16_distributed_optimizer_shards_fp32_main_weights():
    results = run_distributed(4, bf16_distributed_step)
    for r in results:
        assert r["main_dtypes"] == {"torch.float32"} and r["model_is_main"]
    by_pp = {}
    for r in results:  # dp replicas received every other rank's updated pieces
        by_pp.setdefault(r["pp_rank"], []).append(r["weights"])
    for a, b in by_pp.values():
        assert all(torch.equal(a[n], b[n]) for n in a)


# Exact resume from state_dict ----------------------------------------------------------------------------------


def _train(pipe, data, opt, steps):
    for step in steps:
        mbs = data.step_microbatches(step, pipe.state.dp_rank)
        opt.reducer.start_step(len(mbs))
        pipe.executor.run(mbs, loss_scale=opt.loss_multiplier / global_tokens(mbs, pipe.state))
        opt.reducer.finish()
        opt.step(1e-2)


def resume_is_exact(ctx, distributed: bool, dtype: torch.dtype):
    config = OptimizerConfig(lr=1e-2, use_distributed_optimizer=distributed, bf16=dtype == torch.bfloat16,
                             bucket_bytes=32 * 1024)
    pipe, data = make_pipeline(ctx, "gpt-tiny", 4, 1, 2, "1f1b", 2, 1, False, params_dtype=dtype)
    opt = build_optimizer(pipe.chunks, pipe.state, config)
    _train(pipe, data, opt, [0])
    buffer = io.BytesIO()
    torch.save({"model": [c.state_dict() for c in pipe.chunks], "optimizer": opt.state_dict()}, buffer)
    _train(pipe, data, opt, [1, 2])

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    fresh, _ = make_pipeline(ctx, "gpt-tiny", 4, 1, 2, "1f1b", 2, 1, False, params_dtype=dtype)
    for chunk, state in zip(fresh.chunks, saved["model"]):
        chunk.load_state_dict(state)
    resumed = build_optimizer(fresh.chunks, fresh.state, config)
    resumed.load_state_dict(saved["optimizer"])
    _train(fresh, data, resumed, [1, 2])
    return all(torch.equal(a, b) for c, d in zip(pipe.chunks, fresh.chunks)
               for a, b in zip(c.parameters(), d.parameters()))


@pytest.mark.parametrize("distributed,dtype", [(True, torch.float32), (False, torch.bfloat16), (False, torch.float32)],
                         ids=["distributed-fp32", "replicated-bf16", "replicated-fp32"])
def test_resume_from_state_dict_is_exact(distributed, dtype):
    assert all(run_distributed(4, resume_is_exact, distributed, dtype))


def test_distributed_state_rejects_another_layout():
    """A shard saved under one bucket layout is refused by another, with the reason."""
    results = run_distributed(4, _load_into_other_buckets)
    assert all("data-parallel size" in r for r in results)


def _load_into_other_buckets(ctx):
    pipe, _ = make_pipeline(ctx, "gpt-tiny", 4, 1, 2, "1f1b", 2, 1, False)
    small = build_optimizer(pipe.chunks, pipe.state,
                            OptimizerConfig(use_distributed_optimizer=True, bucket_bytes=32 * 1024))
    other, _ = make_pipeline(ctx, "gpt-tiny", 4, 1, 2, "1f1b", 2, 1, False)
    large = build_optimizer(other.chunks, other.state, OptimizerConfig(use_distributed_optimizer=True))
    try:
        large.load_state_dict(small.state_dict())
    except ValueError as exc:
        return str(exc)
    return "loaded"


def test_step_requires_reduced_gradients():
    model = build_model(get_preset("gpt-tiny"), seed=SEED)
    opt = build_optimizer([model], ParallelState.build(), OptimizerConfig())
    with pytest.raises(RuntimeError, match="finish"):
        opt.step(1e-3)
    assert math.isclose(opt.loss_multiplier, 1.0)


def test_lr_schedule_defaults_are_no_warmup_and_no_decay():
    # The dataclass defaults are what a run without LR flags trains with: the peak from the first step.
    s = LRSchedule(lr=1e-3)
    assert lrs(s, [0, 1, 1000]) == [1e-3, 1e-3, 1e-3]
    assert LRSchedule(lr=1e-3, decay_style="linear", decay_steps=10).learning_rate(0) == 1e-3


def test_wsd_without_its_decay_length_names_the_flag_and_what_was_given():
    args = argparse.Namespace(lr=1e-3, lr_decay_style="WSD", train_iters=100)
    with pytest.raises(ValueError, match=r"--lr-decay-style WSD needs --lr-wsd-decay-iters in \[1, 100\] "
                                         r"\(decay end minus warmup\), got 0$"):
        LRSchedule.from_args(args)


# Each check of LRSchedule at its boundary: the edge accepted, one step past it refused naming the flag ---------


@pytest.mark.parametrize("kwargs", [
    dict(lr=0.0), dict(lr=1e-3, min_lr=0.0), dict(lr=1e-3, min_lr=1e-3, decay_style="linear", decay_steps=2),
    dict(lr=1e-3, warmup_steps=0, decay_style="linear", decay_steps=1),
    dict(lr=1e-3, warmup_steps=4, decay_steps=5), dict(lr=1e-3, warmup_steps=4, decay_style="cosine", decay_steps=5),
    dict(lr=1e-3, decay_style="WSD", warmup_steps=2, decay_steps=5, wsd_decay_steps=3),
    dict(lr=1e-3, decay_style="WSD", decay_steps=5, wsd_decay_steps=1)],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_lr_schedule_accepts_each_edge(kwargs):
    LRSchedule(**kwargs)


@pytest.mark.parametrize("kwargs,message", [
    (dict(lr=-0.5), "--lr must be >= 0, got -0.5"),
    (dict(lr=1e-3, min_lr=-0.5), r"--min-lr -0.5 must be in \[0, --lr 0.001\]"),
    (dict(lr=1e-3, warmup_steps=-1), "--lr-warmup-iters must be >= 0, got -1"),
    (dict(lr=1e-3, warmup_steps=4, decay_steps=4), "--lr-warmup-iters 4 must be less than --lr-decay-iters"),
    (dict(lr=1e-3, decay_style="linear", decay_steps=0), "--lr-decay-style linear needs --lr-decay-iters"),
    (dict(lr=1e-3, decay_style="cosine"), r"needs --lr-decay-iters .* greater than --lr-warmup-iters 0, got None"),
    (dict(lr=1e-3, decay_style="WSD", decay_steps=5), r"--lr-wsd-decay-iters in \[1, 5\] .*, got 0$"),
    (dict(lr=1e-3, decay_style="WSD", warmup_steps=2, decay_steps=5, wsd_decay_steps=4),
     r"--lr-wsd-decay-iters in \[1, 3\] .*, got 4$")],
    ids=lambda v: v if isinstance(v, str) else None)
def test_lr_schedule_refuses_one_step_past_each_edge(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LRSchedule(**kwargs)


@pytest.mark.parametrize("given,by_samples", [
    (dict(train_iters=10), False), (dict(train_samples=640), True), (dict(), False),
    (dict(train_samples=640, lr_warmup_samples=64), True), (dict(train_iters=10, lr_warmup_iters=2), False)])
def test_lr_schedule_counts_samples_only_for_a_sample_based_run(given, by_samples):
    # Iterations unless the run is measured in samples (--train-samples without --train-iters) or a *-samples
    # LR flag is given; a run with no length at all (a constant LR) counts iterations.
    args = argparse.Namespace(**{"lr": 1e-3, "train_iters": None, "train_samples": None, **given})
    assert LRSchedule.from_args(args).by_samples is by_samples


def test_lr_at_the_edges_of_its_positions():
    one = LRSchedule(lr=1e-3, warmup_steps=1, decay_style="linear", decay_steps=3)
    assert lrs(one, [0, 1, 2, 3, 4]) == pytest.approx([0.0, 1e-3, 5e-4, 0.0, 0.0])  # a warm-up of one step
    with pytest.raises(ValueError, match="LR schedule position must be >= 0, got -1"):
        one.learning_rate(-1)


def test_the_parsers_defaults_are_the_configs():
    # Two places hold the defaults (the flags and the dataclass that tools and tests build directly): a run
    # without optimizer flags and an OptimizerConfig() must be the same optimizer, Megatron-LM's defaults.
    from megatron_pp.training.arguments import build_parser

    assert OptimizerConfig.from_args(build_parser().parse_args([])) == OptimizerConfig()
    assert (OptimizerConfig().sgd_momentum, OptimizerConfig().initial_loss_scale, OptimizerConfig().hysteresis) == (
        0.9, 2.0**32, 2)


@pytest.mark.parametrize("edge,past,message", [
    (dict(lr=0.0), dict(lr=-0.01), "--lr must be >= 0, got -0.01"),
    (dict(weight_decay=0.0), dict(weight_decay=-0.01), "--weight-decay must be >= 0"),
    (dict(clip_grad=0.0), dict(clip_grad=-0.01), "--clip-grad must be >= 0"),
    (dict(sgd_momentum=0.0), dict(sgd_momentum=-0.01), "--sgd-momentum must be >= 0"),
    (dict(adam_beta1=0.0), dict(adam_beta1=-0.01), r"--adam-beta1 must be in \[0, 1\), got -0.01"),
    (dict(adam_beta2=0.9999), dict(adam_beta2=1.0), r"--adam-beta2 must be in \[0, 1\), got 1.0"),
    (dict(adam_eps=1e-30), dict(adam_eps=0.0), "--adam-eps must be > 0, got 0.0"),
    (dict(adam_eps=1e-30), dict(adam_eps=-0.5), "--adam-eps must be > 0, got -0.5"),
    (dict(fp16=True, loss_scale=0.5), dict(fp16=True, loss_scale=0.0), "--loss-scale must be > 0, got 0.0"),
    (dict(fp16=True, loss_scale=1.0), dict(fp16=True, loss_scale=-1.0), "--loss-scale must be > 0"),
    (dict(min_loss_scale=4.0, initial_loss_scale=4.0), dict(min_loss_scale=0.0), r"--min-loss-scale 0.0 must be in \(0,"),
    (dict(loss_scale_window=1), dict(loss_scale_window=0), "--loss-scale-window must be >= 1, got 0"),
    (dict(hysteresis=1), dict(hysteresis=0), "--hysteresis must be >= 1, got 0"),
    (dict(bucket_bytes=1), dict(bucket_bytes=0), "--bucket-bytes must be >= 1, got 0"),
    (dict(use_distributed_optimizer=True, data_parallel_sharding_strategy="optim"),
     dict(data_parallel_sharding_strategy="optim"), "--data-parallel-sharding-strategy optim shards the optimizer"),
    (dict(data_parallel_sharding_strategy="no_shard"), dict(data_parallel_sharding_strategy="full"),
     "--data-parallel-sharding-strategy 'full' is not one of no_shard, optim, optim_grads_params$"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_optimizer_config_accepts_each_edge_and_refuses_one_step_past_it(edge, past, message):
    OptimizerConfig(**edge)
    with pytest.raises(ValueError, match=message):
        OptimizerConfig(**past)


def test_optimizer_config_lists_every_problem_at_once():
    with pytest.raises(ValueError, match="^--optimizer 'lamb' is not one of adam, sgd; --adam-eps must be > 0, got 0.0$"):
        OptimizerConfig(optimizer="lamb", adam_eps=0.0)
