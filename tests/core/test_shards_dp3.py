"""The distributed optimizer's shards at dp 3, where nothing divides evenly.

Parameters of 35, 5, 15, 3, 6 and 2 elements in buckets of 64 bytes (16 fp32 slots): every bucket is
padded to a multiple of 3 and most parameters straddle a shard boundary. After `finish()` the three
ranks' held pieces tile every parameter exactly once with the data-parallel sum, and `p.grad` is None
(the rest of the buffer is not reduced and must not be offered). Sharded weights over the same layout
report the peak of their gathered buffers. The world is the 6-rank pool of the exactness-edge tests,
laid out pp 2 x dp 3; each pipeline rank's dp group checks the same thing.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatron_pp.core.grads import GradientReducer
from megatron_pp.core.sharded_weights import ShardedWeights
from tests.dist import run_distributed


def _chunks():
    torch.manual_seed(0)  # the same weights on every rank
    return [nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3)), nn.Sequential(nn.Linear(3, 2))]


def _loss(chunks, rank):
    x = torch.linspace(-1.0, 1.0, 14).view(2, 7) * (rank + 1)
    return (chunks[1](chunks[0](x)) ** 2).sum()


def reduce_at_dp3(ctx):
    state = ctx.parallel_state(1, 2)
    reference = _chunks()
    _loss(reference, state.dp_rank).backward()
    expected = {name: p.grad.reshape(-1).clone() for c, chunk in enumerate(reference)
                for name, p in ((f"{c}.{n}", p) for n, p in chunk.named_parameters())}
    for g in expected.values():
        dist.all_reduce(g, group=state.dp_group)
    chunks = _chunks()
    names = {id(p): f"{c}.{n}" for c, chunk in enumerate(chunks) for n, p in chunk.named_parameters()}
    reducer = GradientReducer(chunks, state, overlap=True, bucket_bytes=64, distributed_optimizer=True)
    reducer.start_step(1)
    _loss(chunks, state.dp_rank).backward()
    reducer.finish()
    pieces = [(names[id(piece.param)], piece.start, piece.end,
               bool(torch.allclose(piece.grad, expected[names[id(piece.param)]][piece.start:piece.end],
                                   rtol=1e-6, atol=1e-7)))
              for piece in reducer.held_pieces()]
    out = {"pieces": pieces, "grads_none": all(p.grad is None for chunk in chunks for p in chunk.parameters()),
           "padded": [b.grad.numel() % 3 == 0 for b in reducer.buckets],
           "numel": {names[id(p)]: p.numel() for chunk in chunks for p in chunk.parameters()}}
    reducer.close()
    return out


def test_shards_tile_every_parameter_once_with_the_sum():
    results = run_distributed(6, reduce_at_dp3)
    for group in (results[:3], results[3:]):  # rank = dp_rank + 3 * pp_rank: one dp group per pipeline rank
        numel = group[0]["numel"]
        covered = {name: [] for name in numel}
        for r in group:
            assert r["grads_none"]
            assert all(r["padded"]) and len(r["padded"]) > 3
            for name, start, end, matches in r["pieces"]:
                assert matches, (name, start, end)
                covered[name].append((start, end))
        for name, spans in covered.items():
            spans.sort()
            assert spans[0][0] == 0 and spans[-1][1] == numel[name], (name, spans)
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), (name, spans)
        assert sum(len(s) > 1 for s in covered.values()) >= 2  # parameters really straddle shard boundaries


def weights_peak_at_dp3(ctx):
    state = ctx.parallel_state(1, 2)
    chunks = _chunks()
    reducer = GradientReducer(chunks, state, overlap=False, bucket_bytes=64, distributed_optimizer=True)
    weights = ShardedWeights(reducer, chunks)
    per_chunk = [sum(reducer.buckets[b].grad.numel() * 4 for b in weights.chunk_buckets[c]) for c in range(2)]
    weights.acquire(0)
    weights.wait(0)
    weights.acquire(1)
    weights.wait(1)
    both = weights.resident_bytes()
    weights.release(0)
    weights.release(1)
    out = (per_chunk, both, weights.peak_resident_bytes, weights.resident_bytes())
    reducer.close()
    return out


def test_sharded_weights_report_their_peak():
    for per_chunk, both, peak, after in run_distributed(6, weights_peak_at_dp3):
        assert both == sum(per_chunk) == peak and after == 0
