"""Megatron-LM flags with an effect on the numbers: --lr-warmup-fraction and --decoupled-lr /
--decoupled-min-lr against megatron-core's own OptimizerParamScheduler, the embedding and output layer in
their own optimizer groups, and the one-line refusals of training/megatron_compat.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_pp.core.local_world import WorkerPool
from megatron_pp.core.parallel_state import ParallelState
from megatron_pp.data.mock import MockData
from megatron_pp.models.presets import get_preset
from megatron_pp.models.transformer import build_model
from megatron_pp.training.arguments import build_parser, derive_args, validate_args
from megatron_pp.training.optimizer import LRSchedule, OptimizerConfig, build_optimizer

GBS = 8


def _mcore_lrs(ctx, warmup_samples: float, decay_samples: int, steps: int) -> list[tuple[float, float]]:
    """megatron-core's scheduler, stepped by one global batch of samples at a time as Megatron-LM's
    train_step does, with a param group of --decoupled-lr's overrides: (lr, decoupled lr) after each step."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class Groups:
        param_groups = [{"params": []}, {"params": [], "max_lr": 5e-4, "min_lr": 4.5e-5}]

    scheduler = OptimizerParamScheduler(
        Groups(), init_lr=0.0, max_lr=1.5e-4, min_lr=1e-5, lr_warmup_steps=warmup_samples,
        lr_decay_steps=decay_samples, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
        wd_incr_steps=decay_samples, wd_incr_style="constant")
    rates = []
    for _ in range(steps):
        scheduler.step(GBS)
        rates.append(tuple(group["lr"] for group in Groups.param_groups))
    return rates


@pytest.fixture(scope="module")
def mcore_run():
    pool = WorkerPool(1)  # megatron-core is imported in a worker of this module only
    yield lambda fn, *args: pool.run(fn, *args, timeout=600)[0]  # megatron-core's import is slow on a busy machine
    pool.close()


# Megatron-LM's get_optimizer_param_scheduler counts in samples: warm-up = fraction x decay samples
# (iterations x global batch with --train-iters), so .1 of 50 iterations of 8 is 40 samples.
CASES = [
    (["--train-iters", "60", "--lr-decay-iters", "50", "--lr-warmup-fraction", ".1"], 0.1 * 50 * GBS, 50 * GBS),
    (["--train-samples", "480", "--lr-decay-samples", "400", "--lr-warmup-fraction", ".1"], 0.1 * 400, 400),
    (["--train-iters", "60", "--lr-decay-iters", "50", "--lr-warmup-fraction", ".03"], 0.03 * 50 * GBS, 50 * GBS),
]


@pytest.mark.parametrize("flags,warmup,decay", CASES, ids=["iters", "samples", "fractional-warmup"])
def test_warmup_fraction_and_decoupled_lr_follow_megatron_cores_scheduler(mcore_run, flags, warmup, decay):
    argv = ["--model-preset", "gpt-tiny", "--mock-data", "--global-batch-size", str(GBS), "--lr", "1.5e-4",
            "--min-lr", "1e-5", "--lr-decay-style", "cosine", "--decoupled-lr", "5e-4", "--decoupled-min-lr", "4.5e-5",
            *flags]
    args = build_parser().parse_args(argv)
    assert validate_args(args, world_size=GBS) == []
    schedule = LRSchedule.from_args(derive_args(args, world_size=GBS))
    expected = mcore_run(_mcore_lrs, warmup, decay, 60)
    for step, (lr, decoupled) in enumerate(expected, start=1):
        # Our position of step i is i global batches (see LRSchedule); megatron-core's after i increments.
        assert schedule.learning_rate(step, step * GBS) == pytest.approx(lr, rel=1e-12, abs=1e-18), step
        assert schedule.decoupled_rate(step, step * GBS) == pytest.approx(decoupled, rel=1e-12, abs=1e-18), step
    assert expected[0][0] < expected[10][0] and expected[-1] == pytest.approx((1e-5, 4.5e-5))


def test_decoupled_min_lr_defaults_to_min_lr():
    args = build_parser().parse_args(["--model-preset", "gpt-tiny", "--mock-data", "--train-iters", "10",
                                      "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "linear",
                                      "--decoupled-lr", "2e-3"])
    schedule = LRSchedule.from_args(derive_args(args, world_size=1))
    assert schedule.decoupled.min_lr == 1e-4 and schedule.decoupled.lr == 2e-3
    assert schedule.decoupled_rate(10) == pytest.approx(1e-4) and schedule.decoupled_rate(5) > schedule.learning_rate(5)
    assert LRSchedule.from_args(derive_args(build_parser().parse_args(
        ["--model-preset", "gpt-tiny", "--mock-data", "--train-iters", "10"]), world_size=1)).decoupled_rate(3) is None


@pytest.mark.parametrize("flavour", ["gpt-tiny", "llama-tiny"])
def test_embedding_and_output_layer_step_with_the_decoupled_lr(flavour):
    """SGD without momentum or decay moves each weight by lr x gradient: the tagged weights (the word
    embedding, and LLaMA's untied output layer) by the decoupled LR, every other weight by the main one."""
    config = get_preset(flavour)
    model = build_model(config, seed=5)
    opt = build_optimizer([model], ParallelState.build(),
                          OptimizerConfig(optimizer="sgd", sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.0,
                                          decoupled_lr=1.0))
    batches = MockData(5, config.seq_length, config.vocab_size, 2, 2).step_microbatches(0, 0)
    opt.reducer.start_step(len(batches))
    for batch in batches:
        ((model(None, batch) * batch["loss_mask"]).sum() / 100).backward()
    opt.reducer.finish()
    named = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in named.items()}
    grads = {n: opt.reducer.grad_view(p).clone() for n, p in named.items()}
    opt.step(1e-3, 1e-1)
    tagged = {n for n, p in named.items() if getattr(p, "is_embedding_or_output_parameter", False)}
    untied = config.untie_embeddings_and_output_weights
    assert tagged == {"embedding.word_embeddings.weight", *(["output_layer.weight"] if untied else [])}
    for name, param in named.items():
        lr = 1e-1 if name in tagged else 1e-3
        torch.testing.assert_close(param.detach(), before[name] - lr * grads[name], rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="decoupled"):
        opt.step(1e-3)


BAD = [
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"], "--lr-warmup-fraction and --lr-warmup-iters cannot"),
    (["--lr-warmup-fraction", "1.5"], "--lr-warmup-fraction must be in [0, 1)"),
    (["--decoupled-min-lr", "1e-5"], "--decoupled-min-lr needs --decoupled-lr"),
    (["--decoupled-lr", "1e-5", "--decoupled-min-lr", "1e-4"], "--decoupled-lr 1e-05 is below its floor"),
    (["--grad-reduce-in-bf16"], "--grad-reduce-in-bf16 applies only to --bf16"),
    (["--overlap-param-gather"], "--overlap-param-gather needs --use-distributed-optimizer"),
    (["--context-parallel-size", "2"], "--context-parallel-size 2: context parallelism is not implemented"),
    (["--fp8-param-gather"], "--fp8-param-gather: fp8 training needs TransformerEngine"),
    (["--empty-unused-memory-level", "3"], "--empty-unused-memory-level must be 0, 1 or 2"),
    (["--ckpt-format", "zarr"], "--ckpt-format"),
]


@pytest.mark.parametrize("extra,needle", BAD, ids=[b[1][:32] for b in BAD])
def test_megatron_flags_that_cannot_be_honoured_are_one_line_each(extra, needle):
    argv = ["--model-preset", "gpt-tiny", "--mock-data", "--train-iters", "4", *extra]
    try:
        errors = validate_args(build_parser().parse_args(argv), world_size=1)
    except Exception as exc:  # argparse's choices: one line through the parser's own error
        errors = [str(exc)]
    assert any(needle in e for e in errors), errors
    assert all("\n" not in e for e in errors)


def test_megatron_attention_backend_names_run_ours():
    from megatron_pp.training.arguments import model_config_from_args

    for megatron, ours in (("fused", "sdpa"), ("unfused", "reference"), ("local", "reference"), ("auto", "auto")):
        args = build_parser().parse_args(["--model-preset", "gpt-tiny", "--attention-backend", megatron])
        assert model_config_from_args(args).attention_backend == ours
        assert dataclasses.replace(model_config_from_args(args)).attention_backend == ours


def _one_step_grads(bf16_buffers: bool):
    config = dataclasses.replace(get_preset("llama-tiny"), params_dtype=torch.bfloat16)
    model = build_model(config, seed=6)
    opt = build_optimizer([model], ParallelState.build(),
                          OptimizerConfig(bf16=True, clip_grad=0.5, grad_reduce_in_bf16=bf16_buffers))
    batches = MockData(6, config.seq_length, config.vocab_size, 2, 4).step_microbatches(0, 0)
    opt.reducer.start_step(len(batches))
    for batch in batches:
        ((model(None, batch).float() * batch["loss_mask"]).sum() / 100).backward()
    opt.reducer.finish()
    buffers = {b.grad.dtype for b in opt.reducer.buckets}
    outcome = opt.step(1e-3)
    return buffers, outcome, [m.grad.clone() for m in opt.main.params]


def test_grad_reduce_in_bf16_accumulates_in_bf16_and_steps_on_fp32_copies():
    buffers, outcome, grads = _one_step_grads(True)
    reference_buffers, reference, reference_grads = _one_step_grads(False)
    assert buffers == {torch.bfloat16} and reference_buffers == {torch.float32}
    assert all(g.dtype == torch.float32 for g in grads)
    # Four microbatches summed in bf16 instead of fp32: the same gradient to bf16's precision, not exactly.
    flat, ref = torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in reference_grads])
    assert 0 < (flat - ref).norm() / ref.norm() < 2e-2
    assert outcome.grad_norm == pytest.approx(reference.grad_norm, rel=2e-2) and reference.grad_norm > 0.5


def _loss_normalisations(ctx, masks):
    """Gradients of one step at dp 2 (pp 1) through `train_step`, on microbatches whose loss masks hold unequal
    token counts; and, in one process over the whole global batch, Megatron-LM's two normalisations: with
    --calculate-per-token-loss (every loss token summed, divided by the global batch's token count: its
    finalize_model_grads divides by the tokens all-reduced over dp, and the dp reduction sums), and without
    it (each microbatch's per-token mean, / microbatches, averaged over dp)."""
    from megatron_pp.training.pipeline import build_pipeline
    from megatron_pp.schedules.registry import build_schedule
    from megatron_pp.training.step import train_step
    from megatron_pp.training.step_data import MockSplit

    config = dataclasses.replace(get_preset("gpt-tiny"), num_layers=2)
    state = ctx.parallel_state(1, 1)
    split = MockSplit(3, config.seq_length, config.vocab_size)
    per_rank = len(masks) // state.dp_size

    def batch(i):
        b = split.get_batch([i])
        b["loss_mask"] = masks[i].reshape(1, -1).clone()
        return b

    pipe = build_pipeline(config, state, build_schedule("1f1b", 1, per_rank), micro_batch_size=1, seed=3)
    # Global sample i is microbatch i // dp of replica i % dp (micro-batch size 1).
    _, tokens = train_step(pipe, [batch(j * state.dp_size + state.dp_rank) for j in range(per_rank)])
    ours = {n: p.grad.clone() for n, p in pipe.chunks[0].named_parameters()}

    def one_process(normalise):
        model = build_model(config, seed=3)
        normalise(model).backward()
        return {n: p.grad for n, p in model.named_parameters()}

    def per_token(model):
        losses = [(model(None, batch(i)).float() * masks[i]).sum() for i in range(len(masks))]
        return sum(losses) / sum(m.sum() for m in masks)

    def per_microbatch(model):
        means = [(model(None, batch(i)).float() * masks[i]).sum() / masks[i].sum() for i in range(len(masks))]
        return sum(means) / len(masks)

    return float(tokens), ours, one_process(per_token), one_process(per_microbatch)


def test_the_loss_is_megatron_lms_calculate_per_token_loss():
    """Ours is --calculate-per-token-loss's normalisation whether the flag is given or not; without the flag
    Megatron-LM's differs when microbatches hold different numbers of loss tokens, by more than the tolerance."""
    from tests.dist import run_distributed

    seq = get_preset("gpt-tiny").seq_length
    counts = [seq, 3, seq // 2, 7]  # loss tokens of global samples 0..3
    masks = [torch.cat([torch.ones(c), torch.zeros(seq - c)]) for c in counts]
    results = run_distributed(2, _loss_normalisations, masks)
    for tokens, ours, per_token, per_microbatch in results:
        assert tokens == sum(counts)
        for name, grad in ours.items():
            assert torch.allclose(grad, per_token[name], rtol=1e-5, atol=1e-7), name
        assert any(not torch.allclose(per_token[n], per_microbatch[n], rtol=1e-3, atol=1e-6) for n in ours)
