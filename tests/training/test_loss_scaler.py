"""fp16 loss scaling: the scaler's rules (back-off, hysteresis, growth window, floor), and, through a real
fp16 pipeline (pp = 2 x dp = 2), that an inf injected into ONE rank's gradient skips the step on every
rank, leaves every rank's weights untouched and backs off the scale everywhere alike."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_pp.training.optimizer import LossScaler, OptimizerConfig, build_optimizer
from tests.core.test_grad_reduce import global_tokens, make_pipeline
from tests.dist import run_distributed


def scales_after(scaler: LossScaler, overflows: str) -> list[float]:
    """Scale after each step of `overflows` ('x' overflow, '.' clean)."""
    out = []
    for c in overflows:
        scaler.update(c == "x")
        out.append(scaler.scale)
    return out


def test_hysteresis_delays_backoff_and_growth_restores_it():
    scaler = LossScaler(8.0, hysteresis=2, window=3)
    assert scales_after(scaler, "xxx...x") == [8, 4, 2, 2, 2, 4, 4]


def test_overflow_resets_the_growth_window():
    scaler = LossScaler(8.0, hysteresis=1, window=2)
    assert scales_after(scaler, ".x.x..") == [8, 4, 4, 2, 2, 4]


def test_backoff_stops_at_the_minimum_and_static_scale_never_moves():
    assert scales_after(LossScaler(4.0, hysteresis=1, min_scale=1.0), "xxxx") == [2, 1, 1, 1]
    assert scales_after(LossScaler(128.0, dynamic=False, window=1), "x..x.") == [128] * 5


def test_a_fresh_scaler_grows_after_exactly_one_window():
    assert scales_after(LossScaler(8.0, hysteresis=2, window=3), "......") == [8, 8, 16, 16, 16, 32]
    assert scales_after(LossScaler(8.0, hysteresis=2, window=1), "..x") == [16, 32, 32]  # hysteresis 2 absorbs x


def test_the_scalers_defaults_are_the_configs():
    # Tools and tests build a LossScaler directly; its defaults must be the run's (Megatron-LM's).
    config, scaler = OptimizerConfig(), LossScaler(2.0**16)
    assert (scaler.window, scaler.hysteresis, scaler.min_scale, scaler.dynamic) == (
        config.loss_scale_window, config.hysteresis, config.min_loss_scale, True)


def test_scaler_state_round_trip():
    a = LossScaler(64.0, hysteresis=3, window=4)
    scales_after(a, "..x")
    b = LossScaler(64.0, hysteresis=3, window=4)
    b.load_state_dict(a.state_dict())
    assert scales_after(a, ".xx.....") == scales_after(b, ".xx.....")


INJECT_RANK = 3
INJECT_STEPS = (1, 2)


def fp16_run_with_injected_inf(ctx, distributed: bool, hysteresis: int) -> dict:
    """Five fp16 steps; steps 1 and 2 get an inf in one gradient element of rank INJECT_RANK only."""
    pipe, data = make_pipeline(ctx, "gpt-tiny", 4, 1, 2, "1f1b", 2, 1, False, params_dtype=torch.float16)
    config = OptimizerConfig(fp16=True, lr=1e-3, initial_loss_scale=4096.0, hysteresis=hysteresis,
                             loss_scale_window=2, use_distributed_optimizer=distributed, bucket_bytes=32 * 1024)
    opt = build_optimizer(pipe.chunks, pipe.state, config)
    rows = []
    for step in range(5):
        multiplier = opt.loss_multiplier
        mbs = data.step_microbatches(step, pipe.state.dp_rank)
        opt.reducer.start_step(len(mbs))
        pipe.executor.run(mbs, loss_scale=multiplier / global_tokens(mbs, pipe.state))
        opt.reducer.finish()
        if step in INJECT_STEPS and ctx.rank == INJECT_RANK:
            opt.reducer.held_pieces()[0].grad[0] = math.inf
        before = [p.detach().clone() for c in pipe.chunks for p in c.parameters()]
        outcome = opt.step(1e-3)
        after = [p.detach() for c in pipe.chunks for p in c.parameters()]
        rows.append({"multiplier": multiplier, "skipped": outcome.skipped, "scale": outcome.loss_scale,
                     "norm": outcome.grad_norm, "changed": any(not torch.equal(a, b) for a, b in zip(after, before))})
    return {"rows": rows, "fp32_norm": _fp32_first_norm(ctx)}


def _fp32_first_norm(ctx) -> float:
    """The same first step in fp32: the fp16 run's unscaled norm must match it."""
    pipe, data = make_pipeline(ctx, "gpt-tiny", 4, 1, 2, "1f1b", 2, 1, False)
    opt = build_optimizer(pipe.chunks, pipe.state, OptimizerConfig(lr=1e-3))
    mbs = data.step_microbatches(0, pipe.state.dp_rank)
    opt.reducer.start_step(len(mbs))
    pipe.executor.run(mbs, loss_scale=1.0 / global_tokens(mbs, pipe.state))
    opt.reducer.finish()
    return opt.step(1e-3).grad_norm


# Expected scale after each of the 5 steps (window 2; steps 1 and 2 overflow).
EXPECTED_SCALES = {1: [4096, 2048, 1024, 1024, 2048], 2: [4096, 4096, 2048, 2048, 4096]}


@pytest.mark.parametrize("distributed", [False, True], ids=["replicated", "distributed"])
def test_inf_on_one_rank_skips_the_step_everywhere(distributed):
    for hysteresis, expected in EXPECTED_SCALES.items():
        results = run_distributed(4, fp16_run_with_injected_inf, distributed, hysteresis)
        for rank, result in enumerate(results):
            rows = result["rows"]
            assert [r["skipped"] for r in rows] == [s in INJECT_STEPS for s in range(5)], rank
            assert [r["changed"] for r in rows] == [s not in INJECT_STEPS for s in range(5)], rank
            assert [r["scale"] for r in rows] == expected, (rank, hysteresis)
            # Each step's loss was multiplied by the scale the previous step left.
            assert [r["multiplier"] for r in rows] == [4096] + expected[:-1]
            assert all(math.isinf(r["norm"]) for r in rows if r["skipped"])
            assert rows[0]["norm"] == pytest.approx(result["fp32_norm"], rel=1e-2)  # unscaled correctly
