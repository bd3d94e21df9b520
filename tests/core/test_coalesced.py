"""`all_reduce_coalesced`: every tensor summed exactly once, in flat buckets of at most `bucket_bytes` past
the tensor that fills them, one bucket per dtype and device; nothing sent for a group of one.

The collective is stood in for in-process (a sum over a group of 3 identical replicas is 3 x, and each
call is recorded), so the bucketing arithmetic is checked at sizes no multi-rank test reaches: the
default bucket (40 MiB) is larger than any tiny model's gradient."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_pp.core import grads
from megatron_pp.core.grads import all_reduce_coalesced, global_grad_norm


class StandIn:
    """Replaces `dist` in `grads`: a group of `size` ranks holding the same values."""

    def __init__(self, size: int):
        self.size, self.calls = size, []

    def get_world_size(self, group):
        return self.size

    def all_reduce(self, flat, group=None):
        self.calls.append((flat.dtype, flat.numel()))
        flat.mul_(self.size)


@pytest.fixture
def dist3(monkeypatch):
    stand_in = StandIn(3)
    monkeypatch.setattr(grads, "dist", stand_in)
    return stand_in


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(5, generator=g), torch.randn(2, 3, generator=g), torch.randn(4, generator=g).double(),
            torch.randn(7, generator=g), torch.randn(1, generator=g)]


@pytest.mark.parametrize("bucket_bytes, buckets", [
    (1, [(torch.float32, 5), (torch.float32, 6), (torch.float32, 7), (torch.float32, 1), (torch.float64, 4)]),
    (44, [(torch.float32, 11), (torch.float32, 8), (torch.float64, 4)]),  # 20 + 24 bytes fill one; 28 + 4 left
    (48, [(torch.float32, 18), (torch.float32, 1), (torch.float64, 4)]),
    (45, [(torch.float32, 18), (torch.float32, 1), (torch.float64, 4)]),  # 44 bytes stay one short
    (28, [(torch.float32, 11), (torch.float32, 7), (torch.float32, 1), (torch.float64, 4)]),  # 28 fills the 2nd
    (29, [(torch.float32, 11), (torch.float32, 8), (torch.float64, 4)]),  # ... and is one short of 29
    (10**6, [(torch.float32, 19), (torch.float64, 4)]),
])
def test_each_tensor_is_summed_once_in_buckets_of_the_given_size(dist3, bucket_bytes, buckets):
    tensors = _tensors()
    expected = [3 * t for t in tensors]
    all_reduce_coalesced(tensors, object(), bucket_bytes=bucket_bytes)
    assert dist3.calls == buckets
    for got, want in zip(tensors, expected):
        assert torch.equal(got, want) and got.shape == want.shape


def test_a_group_of_one_or_no_tensors_sends_nothing(monkeypatch):
    one = StandIn(1)
    monkeypatch.setattr(grads, "dist", one)
    tensors = _tensors()
    before = [t.clone() for t in tensors]
    all_reduce_coalesced(tensors, object())
    all_reduce_coalesced(tensors, None)
    assert one.calls == [] and all(torch.equal(a, b) for a, b in zip(tensors, before))
    three = StandIn(3)
    monkeypatch.setattr(grads, "dist", three)
    all_reduce_coalesced([], object())
    assert three.calls == []


def _modules():
    g = torch.Generator().manual_seed(1)
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(2, 2, bias=False)
    for p in (*a.parameters(), *b.parameters()):
        p.grad = torch.randn(p.shape, generator=g)
    b.weight.tensor_model_parallel = True  # a shard: counts on every tp rank
    return [a, b]


def test_global_norm_counts_each_parameter_once_and_sums_over_model_parallel_ranks(dist3):
    modules = _modules()
    a, b = modules
    every = torch.cat([p.grad.reshape(-1) for p in (*a.parameters(), b.weight)])
    tp0 = SimpleNamespace(tp_rank=0, is_first_pp_rank=True, mp_group=None, device=torch.device("cpu"))
    assert global_grad_norm(modules + [a], tp0) == pytest.approx(float(every.double().norm()), rel=1e-12)
    # On tp rank 1 only the shard counts, and the model-parallel sum (3 identical ranks here) is taken.
    tp1 = SimpleNamespace(tp_rank=1, is_first_pp_rank=True, mp_group=object(), device=torch.device("cpu"))
    assert global_grad_norm(modules, tp1) == pytest.approx(float(b.weight.grad.double().norm()) * 3**0.5, rel=1e-12)
    assert len(dist3.calls) == 1


@pytest.mark.parametrize("max_norm, norm, scaled", [
    (1.0, 2.0, 1.0 / (2.0 + 1e-6)), (1.0, 1.0, None), (1.0, 0.5, None), (0.0, 5.0, None),
    (1.0, float("inf"), None), (1.0, float("nan"), None)])
def test_clipping_scales_only_above_the_limit(max_norm, norm, scaled):
    from megatron_pp.core.grads import clip_gradients

    modules = _modules()
    before = [p.grad.clone() for m in modules for p in m.parameters()]
    clip_gradients(modules, max_norm, norm)
    after = [p.grad for m in modules for p in m.parameters()]
    for got, was in zip(after, before):
        assert torch.allclose(got, was * scaled, rtol=0, atol=1e-7) if scaled else torch.equal(got, was)


@pytest.mark.parametrize("size", [1, 2])
def test_global_norm_sums_over_a_model_parallel_group_only_when_it_has_peers(monkeypatch, size):
    stand_in = StandIn(size)
    monkeypatch.setattr(grads, "dist", stand_in)
    modules = _modules()
    shard = modules[1].weight.grad
    tp1 = SimpleNamespace(tp_rank=1, is_first_pp_rank=True, mp_group=object(), device=torch.device("cpu"))
    assert global_grad_norm(modules, tp1) == pytest.approx(float(shard.double().norm()) * size**0.5, rel=1e-12)
    assert len(stand_in.calls) == (size > 1)  # a group of one needs no collective
