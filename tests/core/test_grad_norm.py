"""The multi-tensor fp64 gradient norm against the per-tensor loop it replaced.

The loop summed, tensor by tensor and chunk by chunk, each chunk's fp64 `vector_norm` squared. The
multi-tensor version computes the same per-chunk norms in one `_foreach_norm` and sums them in one
stacked reduction, so only the fp64 summation order differs: the two agree to 1e-14 relative, and both
keep the fp64 accuracy that makes the norm independent of how the gradient is cut.
"""
from __future__ import annotations

import math

import pytest
import torch

from megatron_pp.core import grads
from megatron_pp.core.grads import GradientReducer, squared_norm_fp64, squared_norms_fp64
from megatron_pp.core.parallel_state import ParallelState
from megatron_pp.data.mock import MockData
from megatron_pp.models.presets import get_preset
from megatron_pp.models.transformer import build_model


CHUNK = 1 << 22  # the loop's chunk


def loop_reference(tensors) -> float:
    """The norm as computed before: one fp64 reduction per chunk of every tensor, accumulated in order."""
    total = torch.zeros((), dtype=torch.float64)
    for t in tensors:
        flat = t.detach().reshape(-1)
        for start in range(0, flat.numel(), CHUNK):
            total += torch.linalg.vector_norm(flat[start : start + CHUNK], dtype=torch.float64).square()
    return float(total)


def test_matches_the_per_tensor_loop(monkeypatch):
    monkeypatch.setattr(grads, "_NORM_CHUNK", 1000)  # so the big tensors are cut into chunks
    g = torch.Generator().manual_seed(0)
    counted = [torch.randn(3, 5000, generator=g), torch.randn(7, generator=g), torch.randn(1, generator=g)]
    rest = [torch.randn(2500, generator=g).to(torch.bfloat16), torch.randn(4, 4, generator=g) * 1e3]
    got = squared_norms_fp64([counted, rest, []])
    assert got.dtype == torch.float64 and got.shape == (3,)
    assert got[0].item() == pytest.approx(loop_reference(counted), rel=1e-14)
    assert got[1].item() == pytest.approx(loop_reference(rest), rel=1e-14)
    assert got[2].item() == 0.0
    assert squared_norm_fp64(counted[0]).item() == pytest.approx(loop_reference(counted[:1]), rel=1e-14)


def test_accumulates_in_fp64():
    # 2^21 values whose fp32 sum of squares would be off by far more than 1e-12.
    t = torch.full((1 << 21,), 1.0 + 2.0**-12)
    exact = math.fsum([float(t[0]) ** 2] * t.numel())
    assert squared_norms_fp64([[t]])[0].item() == pytest.approx(exact, rel=1e-14)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_inf_and_nan_propagate(bad):
    t = torch.ones(10)
    t[3] = bad
    total = squared_norms_fp64([[torch.ones(5)], [t]]).sum()
    assert not torch.isfinite(total)


def test_reducer_norm_matches_the_loop_over_held_pieces():
    config = get_preset("llama-tiny")
    model = build_model(config, seed=5)
    reducer = GradientReducer([model], ParallelState.build(), overlap=False, bucket_bytes=256 * 1024)
    batches = MockData(5, config.seq_length, config.vocab_size, 2, 4).step_microbatches(0, 0)
    reducer.start_step(len(batches))
    for batch in batches:
        ((model(None, batch) * batch["loss_mask"]).sum() / 100).backward()
    reducer.finish()
    norm, found_inf = reducer.norm_and_found_inf()
    pieces = [p.grad for p in reducer.held_pieces()]
    assert not found_inf and len(reducer.buckets) > 2
    assert norm == pytest.approx(math.sqrt(loop_reference(pieces)), rel=1e-14)
    counted, rest = reducer._norm_views
    assert not rest and len(counted) == len(reducer.buckets) < len(pieces)  # adjacent pieces merged
    reducer.buckets[-1].grad[0] = math.nan
    assert reducer.norm_and_found_inf() == (math.inf, True)
