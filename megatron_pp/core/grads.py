"""Gradient reduction after (and during) a pipeline step, and the global gradient norm.

After every microbatch's backward has run, three sums make each rank's gradients those of the full
model on the full global batch, in this order (Megatron-LM's):

1. everything is summed over the data-parallel group. The executor scales each loss by
   1 / (tokens in the global batch), so a sum, not a mean, gives the global per-token mean's gradient;
2. parameters that saw only a sequence shard under sequence parallelism (norm weights, row-parallel
   biases; marked `sequence_parallel=True`) are summed over the tensor-parallel group;
3. the tied word-embedding copy on the first and last pipeline stages (marked `shared_embedding=True`)
   is summed over the embedding group, so both copies step identically.

`GradientReducer` is the training path. It gives every parameter a slot in a flat fp32 gradient buffer,
split into buckets of about `bucket_bytes`; gradients always accumulate in fp32, into the slots. fp32
parameters use their slot as `.grad`, so autograd adds in place. Lower-precision ones carry their slot
as `param.main_grad`: the linear layers add their weight gradient there themselves, in fp32
(`tensor_parallel.layers.add_to_main_grad`), and report it through `param.main_grad_added()`; the
others' bf16/fp16 `.grad` is added in by a hook. Each parameter's contributions are counted (by its
post-accumulate-grad hook, or by `main_grad_added`): with m microbatches a
parameter held by k local chunks receives exactly k * m of them, the last during its chunk's last
backward. When every parameter of a bucket is complete the bucket's data-parallel sum starts
asynchronously (`overlap=True`), while the backward of earlier layers and other microbatches goes on.
Buckets start strictly in index order, so every data-parallel replica issues the same collectives in
the same order whatever order its hooks fire in. With the distributed optimizer the data-parallel sum
is a reduce-scatter: each rank keeps only its contiguous 1/dp shard of every bucket, which is what its
optimizer shard updates. Sums 2 and 3 run in `finish()`, on the slice each rank holds: TP peers share
one buffer layout, and each cross-rank tied embedding sits alone in its bucket so the first and last
pipeline rank hold the same shard of it.

Gradient norms accumulate squares in fp64, so the norm does not depend (beyond 1e-15) on how the
gradient is cut into tensors, shards and ranks: every layout and the distributed optimizer clip by the
same factor as one process would. All of a step's tensors go through one multi-tensor norm kernel
(`squared_norms_fp64`) and one stacked sum, with no host synchronisation; the step's single
synchronisation is reading the (flag, sum of squares) pair after the world all-reduce.

`finalize_gradients` is the plain synchronous path (the same sums on `.grad`, after the backward), kept
as the simple reference the reducer is tested against.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megatron_pp.core.host_read import read_values
from megatron_pp.core.parallel_state import ParallelState
from megatron_pp.core.storage import same_memory
from megatron_pp.core.tensor_parallel.utils import (
    PendingCollective,
    start_all_reduce_,
    start_reduce_scatter_dim0,
)

DEFAULT_BUCKET_BYTES = 40 * 1024 * 1024
GRAD_DTYPE = torch.float32  # gradients accumulate and are reduced in fp32 whatever the model's dtype
# Elements per fp64 norm view: 2^22 on every device. Each view is a Python object and a kernel argument
# per step, so small pieces cost in proportion to the model: 8192-element pieces made 146k views and 19 s
# per optimizer step for a LLaMA-3-70B rank (tp 8 x pp 8, fake tensors), 0.1 s with 2^22. The CPU kernel's
# fp64 temporary is then 32 MiB per piece; on the 2-core dev machine one thread took 0.20 s for 2^25
# elements in 2^22 pieces against 0.22 s in 2^13 pieces (best of 3, noisy machine), so small pieces bought
# nothing there either. Only the fp64 summation order depends on the size (relative 1e-16 per term).
_NORM_CHUNK = 1 << 22


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


def squared_norms_fp64(groups: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
    """Sum of squares of each group of tensors, accumulated in fp64, as an fp64 vector `[len(groups)]`.

    Every tensor is cut into views of at most `_NORM_CHUNK` elements (see there), all views of all
    groups go through one `torch._foreach_norm` (one multi-tensor kernel on CUDA instead of three
    launches per tensor), and the squared norms are summed per group from one stacked vector. No host
    synchronisation.
    Compared with accumulating tensor by tensor, only the fp64 summation order changes (relative
    difference of order 1e-16 per term).
    """
    pieces: list[torch.Tensor] = []
    sizes: list[int] = []
    device = None
    for group in groups:
        before = len(pieces)
        for t in group:
            device = t.device
            pieces.extend(t.detach().reshape(-1).split(_NORM_CHUNK))
        sizes.append(len(pieces) - before)
    if not pieces:
        return torch.zeros(len(groups), dtype=torch.float64, device=device)
    squares = torch.stack(torch._foreach_norm(pieces, 2, dtype=torch.float64)).square()
    return torch.stack([part.sum() for part in squares.split(sizes)])


def squared_norm_fp64(t: torch.Tensor) -> torch.Tensor:
    """Sum of squares of `t` as an fp64 scalar (see `squared_norms_fp64`)."""
    return squared_norms_fp64([[t]])[0]


def _grads(params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def unique_parameters(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    """Parameters of all chunks, each once (a tied weight may be shared by two local chunks)."""
    seen: dict[int, nn.Parameter] = {}
    for module in modules:
        for p in module.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())


def counts_once_in_model(param: nn.Parameter, state: ParallelState) -> bool:
    """Whether this rank's copy of `param` is the one that represents it in the full model's gradient.

    Tensor-parallel shards all count; parameters replicated across TP count on TP rank 0 only; the tied
    embedding copy counts only on the first pipeline stage. (Data-parallel replicas are the caller's
    business: they hold identical reduced gradients, or disjoint shards under the distributed optimizer.)
    """
    if not getattr(param, "tensor_model_parallel", False) and state.tp_rank != 0:
        return False
    return not (getattr(param, "shared_embedding", False) and not state.is_first_pp_rank)


def finalize_gradients(modules: Sequence[nn.Module], state: ParallelState) -> None:
    """Apply the three reductions above to every parameter's `.grad`, synchronously, after the backward."""
    params = [p for p in unique_parameters(modules) if p.requires_grad]
    all_reduce_coalesced(_grads(params), state.dp_group)
    all_reduce_coalesced(_grads(p for p in params if getattr(p, "sequence_parallel", False)), state.tp_group)
    if len(state.embedding_ranks) > 1 and state.rank in state.embedding_ranks:
        all_reduce_coalesced(_grads(cross_rank_tied(modules)), state.embedding_group)


def cross_rank_tied(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    """Tied-embedding parameters whose other copy lives on another pipeline rank: those held by one local
    chunk only. When one rank holds both ends of the pipeline (the V placement puts stages 0 and 2p-1 on
    rank 0), both chunks share the one parameter and the embedding group has nothing to sum; its other rank
    (the last pipeline rank) holds no copy either, so neither side joins the collective."""
    holders: dict[int, int] = {}
    for module in modules:
        for p in set(module.parameters()):
            holders[id(p)] = holders.get(id(p), 0) + 1
    return [p for p in unique_parameters(modules)
            if p.requires_grad and getattr(p, "shared_embedding", False) and holders[id(p)] == 1]


def global_grad_norm(modules: Sequence[nn.Module], state: ParallelState) -> float:
    """L2 norm of the full model's `.grad` across tp x pp after `finalize_gradients` (dp replicas agree)."""
    grads = [p.grad for p in unique_parameters(modules) if p.grad is not None and counts_once_in_model(p, state)]
    total = squared_norms_fp64([grads])[0].to(state.device)
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


# Bucketed, overlapped reduction ---------------------------------------------------------------------------


@dataclass
class GradBucket:
    """Some parameters' fp32 gradient slots, contiguous in `grad`, reduced by one collective.

    `grad` is padded to a multiple of the data-parallel size; this rank's shard (what it holds reduced
    after `finish()`) is `grad[shard_start:shard_end]`: all of it without the distributed optimizer.
    """

    index: int
    params: list[nn.Parameter]
    offsets: list[int]
    grad: torch.Tensor
    shard_start: int
    shard_end: int
    waiting: int = 0  # parameters whose gradient is not complete yet this step
    pending: Optional[PendingCollective] = None


@dataclass
class GradPiece:
    """The part `[start, end)` of flattened `param` whose reduced gradient this rank holds, as `grad`,
    found at `bucket.grad[bucket_offset : bucket_offset + end - start]`."""

    param: nn.Parameter
    bucket: GradBucket
    bucket_offset: int
    start: int
    end: int
    grad: torch.Tensor = field(repr=False)


class GradientReducer:
    """Owns the gradient buffers of a rank's model chunks and their data-parallel reduction.

    Per step: `start_step(num_microbatches)` before the first backward, the executor's backwards, then
    `finish()`. Gradients are then final: `grad_view(p)` is parameter `p`'s full reduced gradient
    (fp32 parameters also have it as `p.grad`), or, with `distributed_optimizer=True`, `held_pieces()`
    are this rank's reduced shards (`p.grad` is then None: the rest of the buffer is not reduced).
    """

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        state: ParallelState,
        *,
        overlap: bool,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        distributed_optimizer: bool = False,
        grad_dtype: torch.dtype = GRAD_DTYPE,
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"gradient bucket size must be >= 1 byte, got {bucket_bytes}")
        self.state = state
        self.overlap = overlap
        self.distributed_optimizer = distributed_optimizer
        self.grad_dtype = grad_dtype
        """Dtype of the buffers: fp32, or bf16 under --grad-reduce-in-bf16 (Megatron-LM's bf16 grad buffers:
        microbatches accumulate and the data-parallel sum runs in bf16; the optimizer reads fp32 copies)."""
        self.grads_reduced = False
        self._step_open = False

        # How many local chunks hold each parameter, in the order gradients complete: the last chunk's
        # backward finishes first on a rank (later stages run their backward earlier), and within a
        # chunk the backward runs from the output back to the embedding.
        holders: dict[int, int] = {}
        order: list[tuple[int, nn.Parameter]] = []
        for c in reversed(range(len(chunks))):
            for p in reversed(list(chunks[c].parameters())):
                if not p.requires_grad:
                    continue
                if id(p) not in holders:
                    order.append((c, p))
                    holders[id(p)] = 0
                holders[id(p)] += 1
        if not order:
            raise ValueError("the model chunks have no trainable parameters")
        self._holders = holders
        # A tied embedding whose other copy lives on another pipeline rank needs the embedding-group sum;
        # one held by two local chunks (both ends of the pipeline on this rank) is already a single tensor.
        cross_rank = {id(p) for p in cross_rank_tied(chunks)}
        self._embedding_params = [p for _, p in order if id(p) in cross_rank] if len(state.embedding_ranks) > 1 else []
        trailing_ids = {id(p) for p in self._embedding_params} | {id(p) for _, p in order if holders[id(p)] > 1}
        self.buckets = self._make_buckets(order, trailing_ids, bucket_bytes)
        self._views: dict[int, torch.Tensor] = {}
        self._bucket_of: dict[int, GradBucket] = {}
        for bucket in self.buckets:
            for p, offset in zip(bucket.params, bucket.offsets):
                self._views[id(p)] = bucket.grad[offset : offset + p.numel()].view_as(p)
                self._bucket_of[id(p)] = bucket
        self._pieces = self._make_pieces()
        self._norm_views = self._make_norm_views()
        self._sequence_parallel_grads = [g.grad for g in self._pieces if getattr(g.param, "sequence_parallel", False)]
        embedding_ids = {id(p) for p in self._embedding_params}
        self._embedding_grads = [g.grad for g in self._pieces if id(g.param) in embedding_ids]
        self._arrived: dict[int, int] = {i: 0 for i in holders}
        self._expected: dict[int, int] = {i: 0 for i in holders}
        self._next_launch = 0
        # Kept so that `close()` can remove them: a hook holds the reducer, which holds the parameters, so
        # without removal a model and its buffers outlive their job in a process that trains again.
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._on_grad_accumulated) for _, p in order]
        # A split backward's BW adds a deferred weight gradient to `.grad` itself, outside autograd, and
        # reports it here (tensor_parallel.layers.WeightGradStore) as the hook would have.
        self._grad_added = [p for _, p in order]
        for p in self._grad_added:
            p.grad_added = functools.partial(self._on_grad_accumulated, p)
        self._low_precision = [p for _, p in order if p.dtype != self.grad_dtype]
        for p in self._low_precision:
            p.main_grad = self._views[id(p)]
            p.main_grad_added = functools.partial(self._on_main_grad_added, p)

    def close(self) -> None:
        """Detach from the parameters (remove the gradient hooks and main gradients). The reducer is
        unusable afterwards."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        for p in self._grad_added:
            notify = getattr(p, "grad_added", None)
            if isinstance(notify, functools.partial) and notify.func == self._on_grad_accumulated:
                del p.grad_added
        self._grad_added.clear()
        for p in self._low_precision:
            if getattr(p, "main_grad", None) is self._views[id(p)]:  # not since taken over by another reducer
                del p.main_grad, p.main_grad_added
        self._low_precision.clear()

    # Layout -----------------------------------------------------------------------------------------------
    def _make_buckets(
        self, order: list[tuple[int, nn.Parameter]], trailing_ids: set[int], bucket_bytes: int
    ) -> list[GradBucket]:
        """Pack parameters in gradient-completion order; a bucket never spans two chunks or dtypes, and
        parameters completing last (shared by chunks) or needing the embedding sum come at the end."""
        groups: list[list[nn.Parameter]] = []
        current: list[nn.Parameter] = []
        size = 0
        key = None
        for c, p in order:
            if id(p) in trailing_ids:
                continue
            nbytes = p.numel() * GRAD_DTYPE.itemsize
            if current and ((c, p.dtype, p.device) != key or size + nbytes > bucket_bytes):
                groups.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
            key = (c, p.dtype, p.device)
        if current:
            groups.append(current)
        embedding_ids = {id(p) for p in self._embedding_params}
        shared = [p for _, p in order if id(p) in trailing_ids and id(p) not in embedding_ids]
        if shared:
            groups.append(shared)
        groups += [[p] for p in self._embedding_params]  # alone, so both pipeline ends shard it alike

        dp = self.state.dp_size if self.distributed_optimizer else 1
        dp_rank = self.state.dp_rank if self.distributed_optimizer else 0
        buckets = []
        for index, params in enumerate(groups):
            offsets, total = [], 0
            for p in params:
                offsets.append(total)
                total += p.numel()
            padded = -(-total // dp) * dp
            shard = padded // dp
            grad = torch.zeros(padded, dtype=self.grad_dtype, device=params[0].device)
            buckets.append(GradBucket(index, params, offsets, grad, dp_rank * shard, (dp_rank + 1) * shard))
        return buckets

    def _make_pieces(self) -> list[GradPiece]:
        pieces = []
        for bucket in self.buckets:
            for p, offset in zip(bucket.params, bucket.offsets):
                start = max(offset, bucket.shard_start)
                end = min(offset + p.numel(), bucket.shard_end)
                if start < end:
                    pieces.append(GradPiece(p, bucket, start, start - offset, end - offset, bucket.grad[start:end]))
        return pieces

    def _make_norm_views(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(what this rank's norm counts, the rest) as views of the buckets: adjacent pieces on the
        same side merge into one view, so the norm kernel sees a few long tensors, not every parameter.
        Each parameter counts once over tp x pp x dp (see `counts_once_in_model`; without the
        distributed optimizer dp replicas are identical and only dp rank 0 counts)."""
        state = self.state
        sides: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        runs: list[tuple[int, GradBucket, int, int]] = []  # (side, bucket, start, end) in bucket offsets
        for piece in self._pieces:
            counts = counts_once_in_model(piece.param, state) and (self.distributed_optimizer or state.dp_rank == 0)
            side = 0 if counts else 1
            start, end = piece.bucket_offset, piece.bucket_offset + piece.grad.numel()
            if runs and runs[-1][0] == side and runs[-1][1] is piece.bucket and runs[-1][3] == start:
                runs[-1] = (side, piece.bucket, runs[-1][2], end)
            else:
                runs.append((side, piece.bucket, start, end))
        for side, bucket, start, end in runs:
            sides[side].append(bucket.grad[start:end])
        return sides

    @property
    def embedding_params(self) -> list[nn.Parameter]:
        """The tied-embedding copies whose gradient `finish()` sums with the other end of the pipeline."""
        return list(self._embedding_params)

    def grad_view(self, param: nn.Parameter) -> torch.Tensor:
        """`param`'s fp32 gradient slot (fully reduced after `finish()` without the distributed optimizer)."""
        return self._views[id(param)]

    def held_pieces(self) -> list[GradPiece]:
        """The gradient slices this rank holds reduced after `finish()`, in bucket order: every
        parameter whole, or with the distributed optimizer the parts inside this rank's shards."""
        return list(self._pieces)

    # One step ---------------------------------------------------------------------------------------------
    def start_step(self, num_microbatches: int) -> None:
        """Zero the buffers and expect `num_microbatches` backward contributions per chunk and parameter."""
        if num_microbatches < 1:
            raise ValueError(f"a step needs at least one microbatch, got {num_microbatches}")
        if any(b.pending is not None for b in self.buckets):
            raise RuntimeError("start_step() while the previous step's reductions are in flight; call finish() first")
        for bucket in self.buckets:
            bucket.grad.zero_()
            bucket.waiting = len(bucket.params)
        for bucket in self.buckets:
            for p in bucket.params:
                self._arrived[id(p)] = 0
                self._expected[id(p)] = self._holders[id(p)] * num_microbatches
                # fp32 parameters accumulate straight into their slot: autograd adds in place to `.grad`.
                p.grad = self._views[id(p)] if p.dtype == self.grad_dtype else None
        self._next_launch = 0
        self._step_open = True
        self.grads_reduced = False

    def _on_grad_accumulated(self, p: nn.Parameter) -> None:
        if p.grad is None:
            # Autograd got no gradient for `p` (PyTorch still runs the hook): a layer added it to
            # `p.main_grad` itself and has counted it through `main_grad_added`.
            return
        self._check_step_open()
        view = self._views[id(p)]
        if not same_memory(p.grad, view):
            # A low-precision gradient (or a `.grad` someone reset): fold it into the fp32 slot.
            view.add_(p.grad)
            p.grad = view if p.dtype == self.grad_dtype else None
        self._count(p)

    def _on_main_grad_added(self, p: nn.Parameter) -> None:
        """A layer added its contribution to `p.main_grad` (the slot) itself."""
        self._check_step_open()
        self._count(p)

    def _check_step_open(self) -> None:
        if not self._step_open:
            raise RuntimeError(
                "a gradient arrived outside a step: call GradientReducer.start_step() before the backward"
            )

    def _count(self, p: nn.Parameter) -> None:
        key = id(p)
        self._arrived[key] += 1
        if self._arrived[key] > self._expected[key]:
            raise RuntimeError(
                f"parameter of shape {tuple(p.shape)} received {self._arrived[key]} gradient contributions in a "
                f"step declared with {self._expected[key] // self._holders[key]} microbatches: start_step() was "
                "given the wrong count, or a backward ran twice"
            )
        if self._arrived[key] == self._expected[key]:
            bucket = self._bucket_of[key]
            bucket.waiting -= 1
            if self.overlap and bucket.waiting == 0:
                self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        """Start the reductions of complete buckets (all remaining ones with `force`), in index order."""
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if bucket.waiting and not force:
                return
            if self.distributed_optimizer:
                # The buffer is scratch until the next step, so the all-reduce fallback may use it in place.
                bucket.pending = start_reduce_scatter_dim0(bucket.grad, self.state.dp_group, input_is_scratch=True)
            else:
                bucket.pending = start_all_reduce_(bucket.grad, self.state.dp_group)
            self._next_launch += 1

    def finish(self, reduce_embedding: bool = True) -> None:
        """Complete the data-parallel reductions, then the sequence-parallel and tied-embedding sums.

        `reduce_embedding=False` leaves the tied-embedding sum (between the first and last pipeline rank)
        to the caller: 2BW starts it asynchronously, since the two ranks finish a batch at different times.
        """
        if not self._step_open:
            raise RuntimeError("finish() without start_step(): no step is accumulating gradients")
        self._launch_ready(force=True)
        for bucket in self.buckets:
            reduced = bucket.pending.wait()
            bucket.pending = None
            shard = bucket.grad[bucket.shard_start : bucket.shard_end]
            if not same_memory(reduced, shard):
                shard.copy_(reduced)
        all_reduce_coalesced(self._sequence_parallel_grads, self.state.tp_group)
        if self._embedding_grads and reduce_embedding:
            all_reduce_coalesced(self._embedding_grads, self.state.embedding_group)
        if self.distributed_optimizer:
            for bucket in self.buckets:
                for p in bucket.params:
                    p.grad = None  # only this rank's shard of the buffer is reduced: do not offer the rest
        self._step_open = False
        self.grads_reduced = True

    # After the reduction ---------------------------------------------------------------------------------
    def norm_and_found_inf(self) -> tuple[float, bool]:
        """(L2 norm of the full model's reduced gradient, whether any rank holds an inf or NaN).

        Each parameter counts once over tp x pp x dp (see `_make_norm_views`). One all-reduce over the
        world carries both the fp64 sum of squares and an overflow flag, so every rank reaches the same
        skip decision; reading it back is the step's one host synchronisation.
        """
        if not self.grads_reduced:
            raise RuntimeError("gradient norm before finish(): the gradients are not reduced yet")
        sumsq, rest = squared_norms_fp64(self._norm_views)  # uncounted copies may overflow too
        stats = torch.stack([(~torch.isfinite(sumsq + rest)).double(), sumsq])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(stats)
        found_inf, total = read_values(stats, "found-inf")
        return math.sqrt(total) if found_inf == 0 else math.inf, found_inf > 0

    @torch.no_grad()
    def scale_(self, factor: float) -> None:
        """Multiply every gradient this rank holds by `factor` (unscaling and clipping in one pass)."""
        for bucket in self.buckets:
            bucket.grad[bucket.shard_start : bucket.shard_end].mul_(factor)
