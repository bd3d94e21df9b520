"""LayeredGradientReducer in one process: per-chunk launches, intermediate reductions folded back, errors."""
from __future__ import annotations

import pytest
import torch

from megatron_pp.core.layered_grads import LayeredGradientReducer
from megatron_pp.core.parallel_state import ParallelState


class _Chunk(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 4))
        self.bias = torch.nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.weight + self.bias).square().sum()


def _setup(bucket_bytes: int = 1 << 20):
    torch.manual_seed(0)
    chunks = [_Chunk(), _Chunk()]
    return chunks, LayeredGradientReducer(chunks, ParallelState.build(), bucket_bytes=bucket_bytes)


def test_two_groups_give_the_step_sum_and_count_each_launch():
    chunks, reducer = _setup(bucket_bytes=64)  # weight and bias in separate buckets
    assert [len(reducer.chunk_buckets[c]) for c in (0, 1)] == [2, 2]
    for step in range(2):  # the second step counts and sums its own launches and gradients only
        inputs = [torch.randn(3, 4) for _ in range(4)]
        reducer.start_step(4)
        for group in (inputs[:2], inputs[2:]):  # breadth-first: chunk 1's backwards, then chunk 0's
            for chunk in (1, 0):
                for x in group:
                    chunks[chunk](x).backward()
                reducer.reduce_chunk(chunk)
        assert reducer.reductions == {0: 4, 1: 4}, step  # 2 buckets x 2 groups per chunk
        reducer.finish()
        for chunk in chunks:
            ref = torch.autograd.grad(sum(chunk(x) for x in inputs), [chunk.weight, chunk.bias])
            assert torch.allclose(chunk.weight.grad, ref[0]) and torch.allclose(chunk.bias.grad, ref[1])


def test_a_step_must_end_with_every_chunks_last_reduction():
    chunks, reducer = _setup()
    reducer.start_step(1)
    chunks[1](torch.randn(2, 4)).backward()
    reducer.reduce_chunk(1)
    with pytest.raises(RuntimeError, match="a second reduction of the same gradients"):
        reducer.reduce_chunk(1)
    chunks[0](torch.randn(2, 4)).backward()
    with pytest.raises(RuntimeError, match=r"ended before the last REDUCE_GRAD of chunk\(s\) \[0\]"):
        reducer.finish()
    with pytest.raises(ValueError, match="REDUCE_GRAD.2: this rank has chunks 0..1"):
        reducer.reduce_chunk(2)
