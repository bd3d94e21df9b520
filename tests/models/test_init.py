"""Initialisation that draws only this rank's slice: bit-identical to slicing the full tensor.

The full tensor of a normal-initialised parameter is `normal_(0, std)` from a CPU generator seeded by
(seed, name); every layout takes its slice of it. `initial_shard` draws just the slice (skipping the
generator over the other ranks' draws); these tests hold it to the full tensor's values, element for
element, for every parameter, tp size and rank, and for awkward sizes and ranges.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from megatron_pp.core.tensor_parallel import shard_tensor
from megatron_pp.models import init as transformer_init
from megatron_pp.models.presets import get_preset
from megatron_pp.models.init import initial_shard, initial_value, parameter_seed
from megatron_pp.models.transformer import build_model


def full_normal(seed: int, numel: int, std: float) -> torch.Tensor:
    """The definition: one CPU generator seeded `seed`, all `numel` values drawn at once."""
    return torch.empty(numel).normal_(0.0, std, generator=torch.Generator().manual_seed(seed))


def random_ranges(rng: random.Random, numel: int) -> list[tuple[int, int]]:
    cuts = sorted(rng.sample(range(numel + 1), min(numel + 1, 2 * rng.randint(1, 6))))
    return [(a, b) for a, b in zip(cuts[::2], cuts[1::2]) if a < b] or [(0, numel)]


@pytest.mark.parametrize("skipping", [True, False], ids=["skip-ahead", "fallback"])
def test_normal_ranges_equal_slices_of_the_full_draw(skipping, monkeypatch):
    if not skipping:
        monkeypatch.setattr(transformer_init, "_skipping_reproduces_normal", lambda: False)
    rng = random.Random(0)
    sizes = [1, 7, 15, 16, 17, 31, 32, 33, 100, 160, 1000, 4099]
    for numel in sizes + [rng.randint(1, 20000) for _ in range(20)]:
        full = full_normal(11, numel, 0.5)
        for ranges in ([(0, numel)], [(numel - 1, numel)], random_ranges(rng, numel), random_ranges(rng, numel)):
            got = transformer_init._normal_ranges(11, numel, 0.5, ranges)
            assert torch.equal(got, torch.cat([full[a:b] for a, b in ranges])), (numel, ranges)


def test_skip_over_a_chunk_boundary(monkeypatch):
    monkeypatch.setattr(transformer_init, "_SKIP_CHUNK", 5)  # skips of many chunks, odd draw counts
    full = full_normal(3, 999, 1.0)
    ranges = [(33, 40), (111, 130), (977, 999)]
    assert torch.equal(transformer_init._normal_ranges(3, 999, 1.0, ranges), torch.cat([full[a:b] for a, b in ranges]))


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny"])
def test_every_shard_equals_the_slice_of_the_full_tensor(preset):
    config = get_preset(preset)
    model = build_model(config, seed=5)
    for name, param in model.named_parameters():
        full = initial_value(config, name, tuple(param.shape), 5)
        assert torch.equal(param, full), name  # tp = 1: the whole tensor
        rule = transformer_init._init_rule(config, name)
        if isinstance(rule, float):  # the definition, written out independently of the module's code
            assert torch.equal(full.view(-1), full_normal(parameter_seed(5, name), full.numel(), rule)), name
        if not getattr(param, "tensor_model_parallel", False):
            continue
        partition = (param.partition_dim, param.partition_stride)
        for size in (2, 4):
            for rank in range(size):
                expected = shard_tensor(full, *partition, rank, size)
                got = initial_shard(config, name, tuple(param.shape), 5, partition, rank, size)
                assert got.shape == expected.shape and torch.equal(got, expected), (name, size, rank)


def test_built_weights_match_golden_values():
    # Pins the definition itself: a change of generator, rule or seed derivation breaks resumes.
    weight = build_model(get_preset("gpt-tiny"), seed=0).layers["0"].mlp.linear_fc1.weight.detach()
    assert weight.shape == (256, 64)
    assert [round(v, 6) for v in weight.view(-1)[:3].tolist()] == GOLDEN_FC1
    assert math.isclose(float(weight.double().sum()), GOLDEN_FC1_SUM, rel_tol=1e-9)


GOLDEN_FC1 = [0.016454, -0.006153, -0.011644]  # computed with the full-tensor init this replaced
GOLDEN_FC1_SUM = 5.333008086853681
