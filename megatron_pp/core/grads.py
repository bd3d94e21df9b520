"""Gradient reduction after a pipeline step, and the global gradient norm.

After every microbatch's backward has run, three reductions make each rank's gradients those of the
full model on the full global batch:

1. parameters that saw only a sequence shard under sequence parallelism (norm weights, row-parallel
   biases; marked `sequence_parallel=True`) are summed over the tensor-parallel group;
2. the tied word-embedding copy on the first and last pipeline stages (marked `shared_embedding=True`)
   is summed over the embedding group, so both copies step identically;
3. everything is summed over the data-parallel group. The executor scales each loss by
   1 / (tokens in the global batch), so a sum, not a mean, gives the global per-token mean's gradient.

Each reduction flattens the gradients into buckets of at most `bucket_bytes` and issues one all-reduce
per bucket: a handful of large collectives instead of one per tensor.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megatron_pp.core.parallel_state import ParallelState

DEFAULT_BUCKET_BYTES = 40 * 1024 * 1024


def _group_size(group: Optional[dist.ProcessGroup]) -> int:
    return 1 if group is None else dist.get_world_size(group)


def all_reduce_coalesced(
    tensors: Sequence[torch.Tensor], group: Optional[dist.ProcessGroup], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> None:
    """Sum `tensors` in place over `group`, a few flat buckets at a time (one per dtype and device)."""
    if _group_size(group) == 1 or not tensors:
        return
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for same_kind in by_kind.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for t in same_kind:
            bucket.append(t)
            size += t.numel() * t.element_size()
            if size >= bucket_bytes:
                _reduce_bucket(bucket, group)
                bucket, size = [], 0
        if bucket:
            _reduce_bucket(bucket, group)


def _reduce_bucket(bucket: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    flat = torch.cat([t.reshape(-1) for t in bucket])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in bucket:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def _grads(params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def unique_parameters(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    """Parameters of all chunks, each once (a tied weight may be shared by two local chunks)."""
    seen: dict[int, nn.Parameter] = {}
    for module in modules:
        for p in module.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())


def finalize_gradients(modules: Sequence[nn.Module], state: ParallelState) -> None:
    """Apply the three reductions above to every parameter of this rank's model chunks."""
    params = [p for p in unique_parameters(modules) if p.requires_grad]
    all_reduce_coalesced(_grads(p for p in params if getattr(p, "sequence_parallel", False)), state.tp_group)
    if len(state.embedding_ranks) > 1 and state.rank in state.embedding_ranks:
        all_reduce_coalesced(_grads(p for p in params if getattr(p, "shared_embedding", False)), state.embedding_group)
    all_reduce_coalesced(_grads(params), state.dp_group)


def global_grad_norm(modules: Sequence[nn.Module], state: ParallelState) -> float:
    """L2 norm of the full model's gradient across tp x pp (dp replicas hold identical gradients).

    Each parameter is counted once: tensor-parallel shards all count, parameters replicated across TP
    count on TP rank 0 only, and the tied embedding copy counts only on the first pipeline stage.
    """
    total = None
    for p in unique_parameters(modules):
        if p.grad is None:
            continue
        if not getattr(p, "tensor_model_parallel", False) and state.tp_rank != 0:
            continue
        if getattr(p, "shared_embedding", False) and not state.is_first_pp_rank:
            continue
        sq = p.grad.detach().float().pow(2).sum()
        total = sq if total is None else total + sq
    if total is None:
        total = torch.zeros((), dtype=torch.float32, device=state.device)
    if state.mp_group is not None and _group_size(state.mp_group) > 1:
        dist.all_reduce(total, group=state.mp_group)
    return math.sqrt(float(total))


def clip_gradients(modules: Sequence[nn.Module], max_norm: float, norm: float) -> None:
    """Scale every gradient by max_norm / norm when the global norm exceeds max_norm."""
    if max_norm <= 0 or not math.isfinite(norm) or norm <= max_norm:
        return
    coef = max_norm / (norm + 1e-6)
    for p in unique_parameters(modules):
        if p.grad is not None:
            p.grad.detach().mul_(coef)
