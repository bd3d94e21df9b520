"""Group-size helpers and the raw collectives that tensor parallelism is built from.

Every tensor-parallel function takes an optional process group; `None` or a size-1 group means "one
rank, no communication", so `tp_size`/`tp_rank` are the only place that distinction is made. The
collectives here (all-reduce, all-gather along any dim, reduce-scatter along dim 0) hide the
difference between backends: NCCL gets its single-tensor all-gather and reduce-scatter kernels, while
gloo (the CPU test backend, which older torch builds give no reduce-scatter) and any other backend get
list all-gather and all-reduce plus a slice, which every backend supports. The choice is made from the
group's backend name in one function, never from device strings. Each collective also exists in a
`start_*` form that returns a `PendingCollective`, so the backward of a linear layer can overlap a
gradient's communication with the weight-gradient matmul.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_pp.core import comm

ProcessGroup = dist.ProcessGroup

# Backends with single-tensor all-gather / reduce-scatter kernels worth using. Anything else falls back
# to list all-gather and all-reduce + slice, which every backend supports.
_BACKENDS_WITH_SINGLE_TENSOR_COLLECTIVES = frozenset(
    name for name, needs in comm.BACKEND_NEEDS.items() if needs.single_tensor_collectives)

# torch renamed all_gather_into_tensor / reduce_scatter_tensor to *_single; take whichever exists.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def tp_size(group: Optional[ProcessGroup]) -> int:
    """Number of ranks in `group`; 1 for `None`."""
    return 1 if group is None else dist.get_world_size(group)


def tp_rank(group: Optional[ProcessGroup]) -> int:
    """This process's rank inside `group`; 0 for `None`."""
    return 0 if group is None else dist.get_rank(group)


def divide(numerator: int, denominator: int, what: str) -> int:
    """`numerator / denominator`, raising a message naming `what` when it does not divide evenly."""
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by {denominator}")
    return numerator // denominator


class PendingCollective:
    """A collective that has been started; `wait()` completes it and returns its result. `inputs` stay
    referenced until then, as NCCL's and gloo's works keep them (the fake backend's works keep nothing, so
    without this a dry run freed an in-flight input at once: ShardedMainParams.copy_to_model's bucket shards)."""

    def __init__(self, work: Optional[dist.Work], finish: Callable[[], torch.Tensor], inputs: tuple = ()):
        self._work = work
        self._finish = finish
        self._inputs = inputs

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
        self._inputs = ()
        return self._finish()


def _done(x: torch.Tensor) -> PendingCollective:
    return PendingCollective(None, lambda: x)


def _single_tensor_kernels(group: ProcessGroup) -> bool:
    # A backend named per device type ("cpu:fake,meta:fake": the meta dry run's world) by what it runs.
    return (dist.get_backend(group) in _BACKENDS_WITH_SINGLE_TENSOR_COLLECTIVES
            or comm.backend_needs(group).single_tensor_collectives)


def split_along_dim(x: torch.Tensor, dim: int, group: Optional[ProcessGroup]) -> torch.Tensor:
    """This rank's equal chunk of `x` along `dim`, as a fresh contiguous tensor.

    A copy rather than a view: a view of the full tensor would keep all of it alive as long as the shard.
    """
    size = tp_size(group)
    if size == 1:
        return x
    chunk = divide(x.size(dim), size, f"size of dim {dim} of a {tuple(x.shape)} tensor split over {size} ranks")
    return x.narrow(dim, tp_rank(group) * chunk, chunk).clone(memory_format=torch.contiguous_format)


def start_all_reduce_(x: torch.Tensor, group: Optional[ProcessGroup]) -> PendingCollective:
    """Start summing `x` in place over `group`; `x` must be contiguous and owned by the caller."""
    if tp_size(group) == 1:
        return _done(x)
    return PendingCollective(dist.all_reduce(x, group=group, async_op=True), lambda: x)


def all_reduce(x: torch.Tensor, group: Optional[ProcessGroup]) -> torch.Tensor:
    """Sum of `x` over `group`; the input is never modified (it is returned as is for one rank)."""
    if tp_size(group) == 1:
        return x
    return start_all_reduce_(x.clone(memory_format=torch.contiguous_format), group).wait()


def start_all_gather(x: torch.Tensor, dim: int, group: Optional[ProcessGroup]) -> PendingCollective:
    """Start concatenating every rank's `x` (all the same shape) along `dim`, in rank order."""
    size = tp_size(group)
    if size == 1:
        return _done(x)
    x = x.contiguous()
    if _single_tensor_kernels(group):
        out = torch.empty((size * x.size(0),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        work = _all_gather_single(out, x, group=group, async_op=True)
        if dim == 0:
            return PendingCollective(work, lambda: out, (x,))
        return PendingCollective(work, lambda: torch.cat(out.chunk(size, dim=0), dim=dim), (x,))
    parts = [torch.empty_like(x) for _ in range(size)]
    work = dist.all_gather(parts, x, group=group, async_op=True)
    return PendingCollective(work, lambda: torch.cat(parts, dim=dim), (x,))


def all_gather(x: torch.Tensor, dim: int, group: Optional[ProcessGroup]) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in rank order."""
    return start_all_gather(x, dim, group).wait()


def start_reduce_scatter_dim0(
    x: torch.Tensor, group: Optional[ProcessGroup], *, input_is_scratch: bool = False
) -> PendingCollective:
    """Start summing `x` over `group` and keeping this rank's chunk of dim 0.

    `input_is_scratch=True` says the caller no longer needs `x`, so the all-reduce fallback may reduce in
    it instead of in a copy.
    """
    size = tp_size(group)
    if size == 1:
        return _done(x)
    chunk = divide(x.size(0), size, f"size of dim 0 of a {tuple(x.shape)} tensor reduce-scattered over {size} ranks")
    if _single_tensor_kernels(group):
        x = x.contiguous()
        out = torch.empty((chunk,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        return PendingCollective(_reduce_scatter_single(out, x, group=group, async_op=True), lambda: out, (x,))
    buf = x if input_is_scratch and x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)
    work = dist.all_reduce(buf, group=group, async_op=True)
    start = tp_rank(group) * chunk
    # Clone the slice so the full-size reduced buffer can be freed.
    return PendingCollective(work, lambda: buf[start : start + chunk].clone())


def reduce_scatter_dim0(
    x: torch.Tensor, group: Optional[ProcessGroup], *, input_is_scratch: bool = False
) -> torch.Tensor:
    """Sum of `x` over `group`, keeping this rank's chunk of dim 0."""
    return start_reduce_scatter_dim0(x, group, input_is_scratch=input_is_scratch).wait()
