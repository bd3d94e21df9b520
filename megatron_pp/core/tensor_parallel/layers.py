"""Tensor-parallel linear and embedding layers, and the rules for how their parameters are sliced.

`ColumnParallelLinear` splits the output features across the TP group and `RowParallelLinear` the input
features, so the standard MLP `Row(act(Column(x)))` needs one all-reduce forward and one backward (or,
with sequence parallelism, an all-gather before the column layer and a reduce-scatter after the row
layer, with activations outside the pair split along the sequence). `VocabParallelEmbedding` splits the
vocabulary rows. Layers allocate parameters with `torch.empty` and never initialise them: the model
derives each full tensor from the seed and the parameter's global name and takes this rank's slice with
`shard_tensor`, so the initial model is the same whatever the TP size. Every parameter is tagged with
`tensor_model_parallel`, `partition_dim` and `partition_stride` (see `mark_partitioned`) so checkpoint
conversion, gradient-norm computation and tests can find the full tensor again with `gather_tensor`.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_pp.core.tensor_parallel.mappings import (
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)
from megatron_pp.core.tensor_parallel.utils import (
    ProcessGroup,
    all_gather,
    divide,
    start_all_gather,
    start_all_reduce_,
    start_reduce_scatter_dim0,
    tp_rank,
    tp_size,
)

# Parameter tagging ------------------------------------------------------------------------------------


def mark_partitioned(param: torch.Tensor, partition_dim: int, partition_stride: int = 1) -> None:
    """Tag `param` as split across the TP group along `partition_dim` (layout: see `shard_tensor`)."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = partition_stride


def mark_replicated(param: torch.Tensor) -> None:
    """Tag `param` as a full copy on every TP rank."""
    param.tensor_model_parallel = False


def param_is_partitioned(param: torch.Tensor) -> bool:
    """True when each TP rank holds a different slice of `param` (untagged tensors count as replicated)."""
    return getattr(param, "tensor_model_parallel", False)


def param_is_replicated_in_tp(param: torch.Tensor) -> bool:
    """True when every TP rank holds the whole of `param` (e.g. a norm weight, a row-parallel bias)."""
    return not param_is_partitioned(param)


def shard_tensor(
    full: torch.Tensor, partition_dim: int, partition_stride: int, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """The slice of `full` that TP rank `tp_rank` of `tp_size` holds, as a new contiguous tensor.

    Stride s views `partition_dim` as s equal blocks and gives each rank its piece of every block, in
    block order. Example, a fused SwiGLU weight `[gate; up]` of 8 rows (stride 2) over 2 ranks:

        full rows   g0 g1 g2 g3 | u0 u1 u2 u3
        rank 0      g0 g1 u0 u1
        rank 1      g2 g3 u2 u3

    so each rank can split its own shard into its gate and up halves.
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside a tensor-parallel group of size {tp_size}")
    divide(
        full.size(partition_dim),
        partition_stride * tp_size,
        f"size of dim {partition_dim} of a {tuple(full.shape)} tensor split into {partition_stride} blocks "
        f"over {tp_size} ranks",
    )
    blocks = full.chunk(partition_stride, dim=partition_dim)
    return torch.cat([block.chunk(tp_size, dim=partition_dim)[tp_rank] for block in blocks], dim=partition_dim)


def gather_tensor(
    shard: torch.Tensor, partition_dim: int, partition_stride: int, tp_group: Optional[ProcessGroup]
) -> torch.Tensor:
    """Inverse of `shard_tensor`: the full tensor from every rank's shard (collective, not differentiable)."""
    size = tp_size(tp_group)
    shard = shard.detach()
    if size == 1:
        return shard.clone()
    shards = all_gather(shard, partition_dim, tp_group).chunk(size, dim=partition_dim)
    pieces = [s.chunk(partition_stride, dim=partition_dim) for s in shards]
    return torch.cat([pieces[r][b] for b in range(partition_stride) for r in range(size)], dim=partition_dim)


# Linear layers ----------------------------------------------------------------------------------------


# Weight gradients straight into an fp32 main gradient ------------------------------------------------------

# A low-precision parameter whose gradient a `GradientReducer` accumulates carries `main_grad` (its fp32
# slot) and `main_grad_added()` (tells the reducer one contribution has arrived). The linear layers add
# their weight gradient there themselves, in fp32, instead of handing autograd a bf16 gradient that the
# reducer would then fold in: one fewer weight-sized bf16 tensor and add per microbatch, and no bf16
# rounding of each microbatch's contribution.


@functools.lru_cache(maxsize=None)
def _has_fp32_output_matmul(device_type: str, dtype: torch.dtype) -> bool:
    """Whether `torch.mm(a, b, out_dtype=torch.float32)` with `dtype` inputs runs on this device type
    (CUDA, recent PyTorch): a low-precision GEMM with fp32 accumulation and an fp32 result."""
    try:
        a = torch.ones(2, 2, dtype=dtype, device=device_type)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def folds_into_main_grad(weight: torch.Tensor) -> bool:
    """Whether a layer owning `weight` adds its gradient into `weight.main_grad` itself: on CPU (an fp32
    product of the upcast inputs) and where fp32-output low-precision GEMMs exist; a GPU without them
    keeps the bf16/fp16 gradient, as an fp32 GEMM there would cost far more than the fold saves."""
    if getattr(weight, "main_grad", None) is None:
        return False
    return weight.device.type == "cpu" or _has_fp32_output_matmul(weight.device.type, weight.dtype)


def add_to_main_grad(weight: torch.Tensor, grad_out: torch.Tensor, x: torch.Tensor) -> None:
    """`weight.main_grad += grad_out^T x` (summed over all leading dims) in fp32, then tell its owner."""
    g = grad_out.reshape(-1, grad_out.size(-1))
    i = x.reshape(-1, x.size(-1))
    if weight.device.type == "cpu":
        weight.main_grad.addmm_(g.t().float(), i.float())
    else:
        weight.main_grad.add_(torch.mm(g.t(), i, out_dtype=torch.float32))
    weight.main_grad_added()


# Weight gradients deferred from BI to BW (split backward) --------------------------------------------------

# Zero-bubble schedules split a chunk's backward in two: BI computes the gradient the previous stage needs
# (the chunk input's) and BW, later, the weight gradients, whose GEMMs then fill pipeline bubbles. While a
# `deferring_weight_grads(store, key)` block is active (the executor opens one around the forward and the
# BI of each (microbatch, chunk) whose list splits the backward), the linear layers below build their
# product on a detached weight, so autograd computes no weight gradient, and their backward hands
# (weight, grad_output, input) to `store` under `key`; `store.run(key)` (BW) computes the GEMMs, with the
# sequence-parallel gather they need, and accumulates them as autograd would have: into `.grad`, or into
# the fp32 `main_grad`, telling the gradient reducer through the parameter's `grad_added` /
# `main_grad_added`. Norm, bias and embedding gradients stay in BI (cheap, and not GEMMs).


class _DeferredGemm:
    """One layer's weight-gradient GEMM of one microbatch, held until BW."""

    def __init__(self, weight: nn.Parameter, grad_out: torch.Tensor, x: torch.Tensor, group: Optional[ProcessGroup],
                 sequence_parallel: bool) -> None:
        self.weight, self.grad_out, self.x = weight, grad_out.detach(), x.detach()
        self.group, self.sequence_parallel = group, sequence_parallel

    def run(self) -> None:
        total = all_gather(self.x, 0, self.group) if self.sequence_parallel else self.x
        weight = self.weight
        if folds_into_main_grad(weight):
            add_to_main_grad(weight, self.grad_out, total)
            return
        g_t = self.grad_out.reshape(-1, self.grad_out.size(-1)).t()
        x = total.reshape(-1, total.size(-1))
        if weight.grad is None:
            weight.grad = g_t.matmul(x).to(weight.dtype)
        else:  # accumulate in place: no weight-sized temporary per microbatch
            weight.grad.addmm_(g_t, x)
        notify = getattr(weight, "grad_added", None)
        if notify is not None:  # a GradientReducer counts this contribution (autograd's hook did not run)
            notify()


class WeightGradStore:
    """Weight-gradient GEMMs deferred by BI, by (microbatch, chunk) key, until that key's BW runs them."""

    def __init__(self) -> None:
        self._pending: dict[object, list[_DeferredGemm]] = {}

    def add(self, key: object, gemm: _DeferredGemm) -> None:
        self._pending.setdefault(key, []).append(gemm)

    def held(self, key: object) -> list[torch.Tensor]:
        """What `key`'s BW still needs: the output gradients, and the layer inputs, which are the forward's
        saved tensors except under recomputation, where BI made them again outside the forward's stash
        (the store counts a storage once, so naming both is safe)."""
        pending = self._pending.get(key, [])
        return [g.grad_out for g in pending] + [g.x for g in pending]

    def run(self, key: object) -> int:
        """Compute and accumulate `key`'s weight gradients; returns how many GEMMs ran."""
        gemms = self._pending.pop(key, [])
        count = len(gemms)
        gemms.reverse()
        with torch.no_grad():  # gradients are data here, as inside autograd's own accumulation
            while gemms:
                # In the order BI deferred them, each one's inputs freed as soon as its GEMM is done: the
                # next weight gradient then reuses that memory instead of growing the heap. Holding them
                # all to the end made the allocator return and re-fault pages every step (measured:
                # 40% more page faults than the whole backward, most of the split's extra time on CPU).
                gemms.pop().run()
        return count

    @property
    def pending(self) -> list[object]:
        return list(self._pending)


_DEFERRAL: Optional[tuple[WeightGradStore, object]] = None


@contextlib.contextmanager
def deferring_weight_grads(store: WeightGradStore, key: object) -> Iterator[None]:
    """Within the block, the linear layers defer their weight-gradient GEMMs to `store` under `key`."""
    global _DEFERRAL
    previous, _DEFERRAL = _DEFERRAL, (store, key)
    try:
        yield
    finally:
        _DEFERRAL = previous


def _deferral_for(weight: torch.Tensor) -> Optional[tuple[WeightGradStore, object]]:
    return _DEFERRAL if _DEFERRAL is not None and weight.requires_grad else None


# Linear layers ----------------------------------------------------------------------------------------


class _LinearFunction(torch.autograd.Function):
    """`y = x_full W^T + b` for this rank's rows W of a weight, saving only this rank's input.

    The input is either replicated (`[s, b, h]` on every rank) or sequence-parallel (`[s/tp, b, h]`,
    all-gathered along dim 0 here). In the sequence-parallel case only the shard is saved and the gather
    is repeated in backward: saving the gathered input would cost tp times the activation memory of the
    layer's input. Backward starts the input-gradient reduction (all-reduce, or reduce-scatter with
    sequence parallelism) before computing the weight gradient, so the two overlap. With a group of one
    (or None) it is a plain linear layer, used as such to add the weight gradient into `main_grad`
    (`fold`, see `folds_into_main_grad`).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group: ProcessGroup,
                sequence_parallel: bool, fold: bool = False,
                deferred: Optional[tuple[WeightGradStore, object, nn.Parameter]] = None) -> torch.Tensor:
        total = all_gather(x, 0, group) if sequence_parallel else x
        ctx.save_for_backward(x, weight)
        ctx.group = group
        ctx.sequence_parallel = sequence_parallel
        ctx.has_bias = bias is not None
        ctx.main_grad_owner = weight if fold else None
        ctx.deferred = deferred  # (store, key, the parameter whose detached data `weight` is)
        return F.linear(total, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        gathering = start_all_gather(x, 0, ctx.group) if ctx.sequence_parallel and need_weight else None

        reducing = None
        if need_input:
            grad_input = grad_out.matmul(weight)
            if ctx.sequence_parallel:
                reducing = start_reduce_scatter_dim0(grad_input, ctx.group, input_is_scratch=True)
            else:
                reducing = start_all_reduce_(grad_input, ctx.group)

        grad_weight = None
        if need_weight:
            total = gathering.wait() if gathering is not None else x
            if ctx.main_grad_owner is not None:
                add_to_main_grad(ctx.main_grad_owner, grad_out, total)
            else:
                grad_weight = grad_out.reshape(-1, grad_out.size(-1)).t().matmul(total.reshape(-1, total.size(-1)))
        if ctx.deferred is not None:  # BI of a split backward: the GEMM waits for BW
            store, key, parameter = ctx.deferred
            store.add(key, _DeferredGemm(parameter, grad_out, x, ctx.group, ctx.sequence_parallel))
        grad_bias = grad_out.sum(dim=tuple(range(grad_out.dim() - 1))) if ctx.has_bias and need_bias else None
        grad_input = reducing.wait() if reducing is not None else None
        return grad_input, grad_weight, grad_bias, None, None, None, None


def column_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    tp_group: Optional[ProcessGroup],
    *,
    sequence_parallel: bool = False,
    owns_weight: bool = False,
) -> torch.Tensor:
    """The product of `ColumnParallelLinear` with a weight owned elsewhere (e.g. a tied output layer that
    uses the word embedding's vocabulary shard `[V/tp, h]`): `[s, b, h]` (or `[s/tp, b, h]` with
    `sequence_parallel`) -> this rank's `[s, b, out/tp]`, saving only the sequence shard for backward.
    `owns_weight`: this product is the weight's only use, so its gradient may go straight into
    `main_grad` (a tied weight also gets the embedding's gradient through autograd)."""
    deferral = _deferral_for(weight) if owns_weight else None
    if deferral is not None:
        return _LinearFunction.apply(x, weight.detach(), bias, tp_group, sequence_parallel, False, (*deferral, weight))
    fold = owns_weight and folds_into_main_grad(weight)
    if tp_size(tp_group) == 1 and not fold:
        return F.linear(x, weight, bias)
    return _LinearFunction.apply(x, weight, bias, tp_group, sequence_parallel, fold)


class ColumnParallelLinear(nn.Module):
    """`y = x W^T + b` with the output features split across the TP group.

    Weight `[output_size / tp, input_size]`, bias `[output_size / tp]`, both partitioned on dim 0 with
    `partition_stride`. Input `[s, b, input_size]`, or `[s/tp, b, input_size]` with `sequence_parallel`
    (gathered along the sequence here). Output: this rank's `[s, b, output_size / tp]`, or the full
    `[s, b, output_size]` with `gather_output`.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        tp_group: Optional[ProcessGroup] = None,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        partition_stride: int = 1,
        params_dtype: torch.dtype = torch.float32,
        device: Optional[torch.device] = None,
    ):
        super().__init__()
        size = tp_size(tp_group)
        divide(
            output_size,
            size * partition_stride,
            f"ColumnParallelLinear output_size with partition_stride {partition_stride} over tp",
        )
        if gather_output and partition_stride != 1 and size > 1:
            # The gathered columns would come out in rank order, not in the [block0; block1] layout.
            raise ValueError("ColumnParallelLinear: gather_output is not supported with partition_stride > 1")
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_partition = output_size // size
        self.tp_group = tp_group
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel and size > 1
        self.weight = nn.Parameter(
            torch.empty(self.output_size_per_partition, input_size, dtype=params_dtype, device=device)
        )
        mark_partitioned(self.weight, 0, partition_stride)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size_per_partition, dtype=params_dtype, device=device))
            mark_partitioned(self.bias, 0, partition_stride)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = column_parallel_linear(x, self.weight, self.bias, self.tp_group, sequence_parallel=self.sequence_parallel,
                                   owns_weight=True)
        return gather_from_tp_region(y, self.tp_group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"input_size={self.input_size}, output_size={self.output_size}, "
                f"per_partition={self.output_size_per_partition}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """`y = x W^T + b` with the input features split across the TP group.

    Weight `[output_size, input_size / tp]` partitioned on dim 1; bias `[output_size]` replicated and
    added after the reduction (so it is counted once). Input: this rank's `[s, b, input_size / tp]`
    (`input_is_parallel`, the usual case after a column-parallel layer) or the full `[s, b, input_size]`,
    which is split here. Output: `[s, b, output_size]` all-reduced, or with `sequence_parallel` this
    rank's `[s/tp, b, output_size]` rows reduce-scattered. Then the bias sees only this rank's rows, its
    gradient is a partial sum, and it is tagged `sequence_parallel=True` so gradient reduction sums it
    over the TP group.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        tp_group: Optional[ProcessGroup] = None,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: Optional[torch.device] = None,
    ):
        super().__init__()
        size = tp_size(tp_group)
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_partition = divide(input_size, size, "RowParallelLinear input_size over tp")
        self.tp_group = tp_group
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel and size > 1
        self.weight = nn.Parameter(
            torch.empty(output_size, self.input_size_per_partition, dtype=params_dtype, device=device)
        )
        mark_partitioned(self.weight, 1)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=params_dtype, device=device))
            mark_replicated(self.bias)
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.tp_group)
        deferral = _deferral_for(self.weight)
        if deferral is not None:
            partial = _LinearFunction.apply(x, self.weight.detach(), None, None, False, False, (*deferral, self.weight))
        elif folds_into_main_grad(self.weight):
            partial = _LinearFunction.apply(x, self.weight, None, None, False, True)
        else:
            partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        else:
            y = reduce_from_tp_region(partial, self.tp_group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"input_size={self.input_size}, output_size={self.output_size}, "
                f"per_partition={self.input_size_per_partition}, sequence_parallel={self.sequence_parallel}")


# Embedding --------------------------------------------------------------------------------------------


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary rows split across the TP group.

    Weight `[num_embeddings / tp, embedding_dim]`, partitioned on dim 0; rank r holds ids
    `[r * V/tp, (r + 1) * V/tp)`. `num_embeddings` must divide by tp: pad the vocabulary first.

    Takes token ids `[b, s]` (the data loader's layout) and returns sequence-first `[s, b, h]`. Each rank
    looks up the ids it owns and writes zeros for the others; the sum over the TP group (all-reduce) is
    the full embedding. With `reduce_scatter_embeddings` (sequence parallelism) the sum is
    reduce-scattered along the sequence instead and each rank gets its `[s/tp, b, h]` rows.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp_group: Optional[ProcessGroup] = None,
        reduce_scatter_embeddings: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: Optional[torch.device] = None,
    ):
        super().__init__()
        size = tp_size(tp_group)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_group = tp_group
        self.reduce_scatter_embeddings = reduce_scatter_embeddings and size > 1
        self.num_embeddings_per_partition = divide(
            num_embeddings, size, "VocabParallelEmbedding num_embeddings (pad the vocabulary) over tp"
        )
        self.vocab_start_index = tp_rank(tp_group) * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=params_dtype, device=device)
        )
        mark_partitioned(self.weight, 0)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Transposing the small id tensor, not the output, makes the lookup write [s, b, h] directly.
        ids = input_ids.t()
        if tp_size(self.tp_group) == 1:
            return F.embedding(ids, self.weight)
        foreign = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local_ids = (ids - self.vocab_start_index).masked_fill_(foreign, 0)
        out = F.embedding(local_ids, self.weight).masked_fill_(foreign.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            return reduce_scatter_to_sequence_parallel_region(out, self.tp_group)
        return reduce_from_tp_region(out, self.tp_group)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"per_partition={self.num_embeddings_per_partition}")
