"""Autograd-aware communication at the borders of tensor-parallel regions.

Each function is a pair of collectives, one in forward and its adjoint in backward, so that gradients
stay correct when activations enter or leave a region where they are split across the TP group:

    function                               forward                      backward
    copy_to_tp_region                      identity                     all-reduce
    reduce_from_tp_region                  all-reduce                   identity
    scatter_to_tp_region                   split last dim               all-gather last dim
    gather_from_tp_region                  all-gather last dim          split last dim
    scatter_to_sequence_parallel_region    split dim 0                  all-gather dim 0
    gather_from_sequence_parallel_region   all-gather dim 0             reduce-scatter dim 0 (or split)
    reduce_scatter_to_sequence_parallel_region  reduce-scatter dim 0    all-gather dim 0

Activations are sequence-first `[s, b, h]`, so the sequence-parallel functions work on dim 0. With
`tp_group=None` or a size-1 group every function is the identity and adds no autograd node.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_pp.core.tensor_parallel.utils import (
    ProcessGroup,
    all_gather,
    all_reduce,
    reduce_scatter_dim0,
    split_along_dim,
    tp_size,
)


class _CopyToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        # Reduce into a copy: the input may be saved by another autograd node or used by the caller.
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return split_along_dim(x, x.dim() - 1, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather(grad, grad.dim() - 1, ctx.group), None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return all_gather(x, x.dim() - 1, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return split_along_dim(grad, grad.dim() - 1, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return split_along_dim(x, 0, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather(grad, 0, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, tensor_parallel_output_grad: bool) -> torch.Tensor:
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return all_gather(x, 0, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.tensor_parallel_output_grad:
            # Each rank's gradient is a partial sum (it fed a TP-split computation): sum, keep my rows.
            return reduce_scatter_dim0(grad, ctx.group), None, None
        # The gradient is already complete on every rank: my rows are all I need.
        return split_along_dim(grad, 0, ctx.group), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather(grad, 0, ctx.group), None


def copy_to_tp_region(x: torch.Tensor, tp_group: Optional[ProcessGroup]) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient (the input feeds every rank's partial computation)."""
    if tp_size(tp_group) == 1:
        return x
    return _CopyToTensorParallelRegion.apply(x, tp_group)


def reduce_from_tp_region(x: torch.Tensor, tp_group: Optional[ProcessGroup]) -> torch.Tensor:
    """All-reduce forward (sum of the ranks' partial outputs); identity backward."""
    if tp_size(tp_group) == 1:
        return x
    return _ReduceFromTensorParallelRegion.apply(x, tp_group)


def scatter_to_tp_region(x: torch.Tensor, tp_group: Optional[ProcessGroup]) -> torch.Tensor:
    """Keep this rank's chunk of the last dim; backward all-gathers the gradient along the last dim."""
    if tp_size(tp_group) == 1:
        return x
    return _ScatterToTensorParallelRegion.apply(x, tp_group)


def gather_from_tp_region(x: torch.Tensor, tp_group: Optional[ProcessGroup]) -> torch.Tensor:
    """Concatenate the ranks' chunks along the last dim; backward keeps this rank's chunk of the gradient."""
    if tp_size(tp_group) == 1:
        return x
    return _GatherFromTensorParallelRegion.apply(x, tp_group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, tp_group: Optional[ProcessGroup]) -> torch.Tensor:
    """`[s, b, h]` -> this rank's `[s/tp, b, h]`; backward all-gathers the gradient along dim 0."""
    if tp_size(tp_group) == 1:
        return x
    return _ScatterToSequenceParallelRegion.apply(x, tp_group)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, tp_group: Optional[ProcessGroup], tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """`[s/tp, b, h]` -> `[s, b, h]` by all-gather along dim 0.

    Backward: when the gathered tensor feeds a tensor-parallel computation (`tensor_parallel_output_grad`,
    the usual case, e.g. a column-parallel linear) each rank holds a partial gradient of the full
    sequence, which is reduce-scattered; otherwise every rank holds the full gradient and keeps its rows.
    """
    if tp_size(tp_group) == 1:
        return x
    return _GatherFromSequenceParallelRegion.apply(x, tp_group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, tp_group: Optional[ProcessGroup]) -> torch.Tensor:
    """Partial `[s, b, h]` -> this rank's rows of the sum, `[s/tp, b, h]`; backward all-gathers along dim 0."""
    if tp_size(tp_group) == 1:
        return x
    return _ReduceScatterToSequenceParallelRegion.apply(x, tp_group)
