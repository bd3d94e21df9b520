"""Layout-independent initialisation: every parameter's full tensor is defined by a generator seeded by
(seed, parameter name), and `init_stage_weights` gives each rank exactly its slice of it (drawing only that
slice), so tp=1, tp=4, a 2-stage pipeline or an interleaved one all start from bit-identical weights."""
from __future__ import annotations

import functools
import hashlib
import math
from typing import Optional

import torch

from megatron_pp.core.host_read import has_data
from megatron_pp.core.tensor_parallel import param_is_partitioned, tp_rank, tp_size
from megatron_pp.models.config import TransformerConfig


def parameter_seed(seed: int, name: str) -> int:
    """A generator seed from (seed, parameter name) that is stable across processes and runs.

    Python's `hash` of a string is salted per process, so a cryptographic hash is used instead.
    """
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _init_rule(config: TransformerConfig, name: str) -> float | str:
    """"zeros", "ones", or the std of the normal init of parameter `name` (see `initial_value`)."""
    if name.endswith(".bias"):
        return "zeros"
    if "layernorm" in name:  # a zero-centred scale (--apply-layernorm-1p) starts at 0 and applies as 1 + 0
        return "zeros" if config.apply_layernorm_1p else "ones"
    std = config.init_method_std
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        std /= math.sqrt(2.0 * config.num_layers)
    return std


def initial_value(config: TransformerConfig, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The full (unsharded) fp32 initial value of parameter `name`, on CPU: the definition every layout
    takes its slice of.

    Megatron's rules: biases zero, norm scales one, weights normal(0, init_method_std), except the two
    projections that write into the residual stream (attention output, fc2), scaled by 1/sqrt(2 * layers)
    so the residual's variance does not grow with depth. The normal draws come from a CPU generator
    seeded by `parameter_seed(seed, name)`.
    """
    rule = _init_rule(config, name)
    if rule == "zeros":
        return torch.zeros(shape)
    if rule == "ones":
        return torch.ones(shape)
    generator = torch.Generator().manual_seed(parameter_seed(seed, name))
    return torch.empty(shape).normal_(0.0, rule, generator=generator)


def initial_shard(
    config: TransformerConfig, name: str, full_shape: tuple[int, ...], seed: int,
    partition: Optional[tuple[int, int]] = None, rank: int = 0, size: int = 1,
) -> torch.Tensor:
    """This TP rank's slice of `initial_value(config, name, full_shape, seed)`, equal to it bit for bit
    (`shard_tensor` of it for a `partition` `(dim, stride)`), without drawing the other ranks' values
    or materialising the full tensor; fp32 on CPU."""
    ranges = _shard_ranges(full_shape, partition, rank, size)
    shard_shape = list(full_shape)
    if partition is not None:
        shard_shape[partition[0]] //= size
    rule = _init_rule(config, name)
    if rule in ("zeros", "ones"):
        return (torch.zeros if rule == "zeros" else torch.ones)(shard_shape)
    values = _normal_ranges(parameter_seed(seed, name), math.prod(full_shape), rule, ranges)
    return values.view(shard_shape)


def _shard_ranges(
    full_shape: tuple[int, ...], partition: Optional[tuple[int, int]], rank: int, size: int
) -> list[tuple[int, int]]:
    """The `[start, end)` ranges of the flattened full tensor that make up a shard, in the shard's order
    (`shard_tensor`'s layout: every block of `stride` gives each rank a contiguous run of rows)."""
    numel = math.prod(full_shape)
    if partition is None or size == 1:
        return [(0, numel)]
    dim, stride = partition
    rows, inner = full_shape[dim], math.prod(full_shape[dim + 1 :])
    outer = math.prod(full_shape[:dim])
    block, piece = rows // stride, rows // (stride * size)
    ranges = []
    for o in range(outer):
        for j in range(stride):
            first = o * rows + j * block + rank * piece
            ranges.append((first * inner, (first + piece) * inner))
    return ranges


# torch's CPU normal_ for a contiguous fp32 tensor of n >= 16 elements draws n uniforms (one 32-bit
# Mersenne-twister output each), turns each aligned group of 16 into 16 normals (Box-Muller on pairs
# i, i+8), and, when 16 does not divide n, draws 16 more uniforms for the last 16 elements. So any
# 16-aligned run of the body can be drawn alone once the generator has skipped the draws before it;
# `_skipping_reproduces_normal` checks this on the running torch and a mismatch falls back to drawing
# the full tensor.
_GROUP = 16
_SKIP_CHUNK = 1 << 20


def _skip_draws(generator: torch.Generator, count: int) -> None:
    """Advance `generator` by `count` 32-bit draws (an int64 draw takes two, an int32 draw one)."""
    scratch = torch.empty(min(count // 2, _SKIP_CHUNK), dtype=torch.int64)
    left = count // 2
    while left:
        n = min(left, _SKIP_CHUNK)
        scratch[:n].random_(generator=generator)
        left -= n
    if count % 2:
        torch.empty(1, dtype=torch.int32).random_(generator=generator)


def _draw_normal_ranges(seed: int, numel: int, std: float, ranges: list[tuple[int, int]]) -> torch.Tensor:
    out = torch.empty(sum(end - start for start, end in ranges))
    generator = torch.Generator().manual_seed(seed)
    body_end = numel - _GROUP if numel % _GROUP else numel  # the last 16 are redrawn after the body
    segments: list[list[int]] = []  # 16-aligned runs of the body to draw, merged where they touch
    for start, end in ranges:
        if start < min(end, body_end):
            lo, hi = start // _GROUP * _GROUP, -(-min(end, body_end) // _GROUP) * _GROUP
            if segments and lo <= segments[-1][1]:
                segments[-1][1] = max(segments[-1][1], hi)
            else:
                segments.append([lo, hi])
    drawn: list[tuple[int, torch.Tensor]] = []
    position = 0
    for lo, hi in segments:
        _skip_draws(generator, lo - position)
        drawn.append((lo, torch.empty(hi - lo).normal_(0.0, std, generator=generator)))
        position = hi
    tail = None
    if any(end > body_end for _, end in ranges):
        _skip_draws(generator, numel - position)
        tail = torch.empty(_GROUP).normal_(0.0, std, generator=generator)  # elements [numel - 16, numel)
    offset, k = 0, 0
    for start, end in ranges:
        body = min(end, body_end)
        if start < body:
            while drawn[k][0] + drawn[k][1].numel() < body:
                k += 1
            lo, values = drawn[k]
            out[offset : offset + body - start] = values[start - lo : body - lo]
            offset += body - start
        if end > body_end:
            first = max(start, body_end)
            out[offset : offset + end - first] = tail[first - (numel - _GROUP) : end - (numel - _GROUP)]
            offset += end - first
    return out


@functools.lru_cache(maxsize=None)
def _skipping_reproduces_normal() -> bool:
    cases = [(77, [(0, 5), (21, 40), (60, 77)]), (96, [(16, 48), (50, 51)]), (40, [(3, 9), (30, 40)])]
    for numel, ranges in cases:
        full = torch.empty(numel).normal_(0.0, 1.0, generator=torch.Generator().manual_seed(7))
        expected = torch.cat([full[a:b] for a, b in ranges])
        if not torch.equal(_draw_normal_ranges(7, numel, 1.0, ranges), expected):
            return False
    return True


def _normal_ranges(seed: int, numel: int, std: float, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """Elements `ranges` (ascending, disjoint) of `torch.empty(numel).normal_(0, std, generator)` with
    the generator seeded `seed`, concatenated: bit-identical, at the cost of the draws up to the last
    range (skipped draws are about half the price of normal ones) and of only the ranges' memory."""
    if numel < _GROUP or not _skipping_reproduces_normal():
        full = torch.empty(numel).normal_(0.0, std, generator=torch.Generator().manual_seed(seed))
        return torch.cat([full[a:b] for a, b in ranges])
    return _draw_normal_ranges(seed, numel, std, ranges)


@torch.no_grad()
def init_stage_weights(model: torch.nn.Module, seed: int) -> None:
    """Set every parameter of `model` (a `transformer.StageModel`: its `config`, `tp_group` and parameters) to its
    slice of the layout-independent initial value (see `initial_value`).

    Constant parameters are filled where they live; normal ones draw only this rank's elements
    (`initial_shard`) on CPU, the only place the defining generator runs, and are copied once.
    """
    if not all(has_data(p) for p in model.parameters()):
        return  # fake or meta parameters (the dry run, `training.dry_run`): there are no values to set
    size, rank = tp_size(model.tp_group), tp_rank(model.tp_group)
    for name, param in model.named_parameters():
        rule = _init_rule(model.config, name)
        if rule == "zeros":
            param.zero_()
        elif rule == "ones":
            param.fill_(1.0)
        elif param_is_partitioned(param):
            full_shape = list(param.shape)
            full_shape[param.partition_dim] *= size
            partition = (param.partition_dim, param.partition_stride)
            param.copy_(initial_shard(model.config, name, tuple(full_shape), seed, partition, rank, size))
        else:
            param.copy_(initial_shard(model.config, name, tuple(param.shape), seed))
