"""The decoder-only transformer, one pipeline stage at a time, readable top to bottom.

GPT (learned positions, LayerNorm, GELU, biases, tied output) and LLaMA (RoPE, RMSNorm, SwiGLU, grouped-
query attention, no biases, untied output) are the same architecture under different `TransformerConfig`
values. A `StageModel` holds what one global pipeline stage (`StageSpec`) owns: a range of layers, plus
the embedding on the first stage and the final norm, output layer and loss on the last. Layers sit in a
ModuleDict keyed by their *global* index, so a parameter is called e.g.
`layers.7.self_attention.linear_qkv.weight` whatever the pipeline split.

Tensors are sequence-first: hidden states are `[s, b, h]`, or this rank's `[s/tp, b, h]` rows under
sequence parallelism. Matrices are split over the tensor-parallel group Megatron-style: QKV and fc1
column-parallel, the attention output projection and fc2 row-parallel, the vocabulary split across ranks
for the embedding, the output layer and the cross-entropy.

Initialisation does not depend on the layout: every parameter's full tensor is defined by a generator
seeded by (seed, parameter name), and `init_stage_weights` gives each rank exactly its slice of it
(drawing only that slice), so tp=1, tp=4, a 2-stage pipeline or an interleaved one all start from
bit-identical weights.

Activation recomputation (`RecomputeConfig`, Megatron's `--recompute-*` flags) trades compute for
memory: a checkpointed span keeps only its inputs for the backward, which reruns it. It uses
non-reentrant `torch.utils.checkpoint`, whose inputs are saved through the ordinary saved-tensor
hooks, so the pipeline's activation store sees (and can offload) exactly what is kept; dropout
replays the same masks because both the default generator and the TP RNG tracker's streams are
restored for the rerun (`checkpoint_with_rng`).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Iterator, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils.checkpoint import checkpoint

from megatron_pp.core.tensor_parallel import (
    TENSOR_PARALLEL_RNG,
    ColumnParallelLinear,
    RNGTracker,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel_linear,
    gather_tensor,
    get_rng_tracker,
    mark_replicated,
    param_is_partitioned,
    scatter_to_sequence_parallel_region,
    tp_rank,
    tp_size,
    vocab_parallel_cross_entropy,
)
from megatron_pp.models.attention import attention
from megatron_pp.models.config import TransformerConfig
from megatron_pp.models.layout import StageSpec, split_layers

Rotary = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [s, b, 1, head_dim / 2] in fp32


# Building blocks ----------------------------------------------------------------------------------------


class Norm(nn.Module):
    """LayerNorm or RMSNorm over the hidden dim, computed in fp32 whatever the activation dtype.

    Weights are replicated on every TP rank. Under sequence parallelism each rank normalises only its
    rows, so its weight gradient is a partial sum: the parameters are tagged `sequence_parallel` and the
    training code sums their gradients over the TP group.

    With a bf16/fp16 input, autograd through the fp32 computation would keep the fp32 upcast of the
    input (4 bytes per element, twice the input itself) until the backward; `_LowPrecisionNorm` keeps
    only the input and recomputes the rest in the backward.
    """

    def __init__(self, config: TransformerConfig, sequence_parallel: bool, device: Optional[torch.device]):
        super().__init__()
        self.eps = config.norm_epsilon
        shape = (config.hidden_size,)
        self.weight = nn.Parameter(torch.empty(shape, dtype=config.params_dtype, device=device))
        if config.normalization == "LayerNorm":
            self.bias = nn.Parameter(torch.empty(shape, dtype=config.params_dtype, device=device))
        else:
            self.register_parameter("bias", None)
        for param in self.parameters():
            mark_replicated(param)
            param.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 and torch.is_grad_enabled():
            return _LowPrecisionNorm.apply(x, self.weight, self.bias, self.eps)
        return norm_fp32(x, self.weight, self.bias, self.eps)


def norm_fp32(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """RMSNorm (`bias` None) or LayerNorm of `x` over its last dim in fp32, returned in `x`'s dtype."""
    if bias is None:
        y = F.rms_norm(x.float(), weight.shape, weight.float(), eps)
    else:
        y = F.layer_norm(x.float(), weight.shape, weight.float(), bias.float(), eps)
    return y.to(x.dtype)


class _LowPrecisionNorm(torch.autograd.Function):
    """`norm_fp32` that saves only its (bf16/fp16) input and parameters.

    The backward rebuilds the very same fp32 graph from them and differentiates it, so its gradients
    are bit-identical to autograd through `norm_fp32`; the fp32 upcast lives only inside the backward.
    Recomputing a norm is one read of the input, small beside the matmuls around it.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
        ctx.eps = eps
        ctx.save_for_backward(x, weight, bias)
        return norm_fp32(x, weight, bias, eps)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        inputs = [None if t is None else t.detach().requires_grad_(need)
                  for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad)]
        wanted = [t for t in inputs if t is not None and t.requires_grad]
        with torch.enable_grad():
            y = norm_fp32(*inputs, ctx.eps)
        found = iter(torch.autograd.grad(y, wanted, grad))
        return (*(next(found) if t is not None and t.requires_grad else None for t in inputs), None)


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, base: float) -> Rotary:
    """cos and sin of RoPE's angles `position * base^(-2i/d)` for positions `[b, s]`, as `[s, b, 1, d/2]`."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=position_ids.device) / head_dim)
    angles = position_ids.t().float().unsqueeze(-1) * inv_freq  # [s, b, d/2]
    return angles.cos().unsqueeze(2), angles.sin().unsqueeze(2)


def apply_rotary(x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """Rotate `[s, b, heads, d]` pairs (x_i, x_{i+d/2}) by RoPE's angles (the "rotate half" convention of
    Hugging Face's LLaMA, so converted checkpoints need no permutation of q and k).

    A rotation's backward is the rotation by the opposite angle, so `_Rotary` runs one function each way
    (about nine elementwise kernels op by op, one after `use_fused_rotary`) and keeps only cos and sin.
    """
    cos, sin = rotary
    if torch.is_grad_enabled() and not (cos.requires_grad or sin.requires_grad):
        return _Rotary.apply(x, cos, sin)
    return rotate(x, cos, sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE's rotation of `x` by the angles whose cos and sin are given, computed in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


_rotate_kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = rotate
"""What `_Rotary` runs, forward and backward: `rotate` op by op, or one fused kernel after
`use_fused_rotary()`."""


def use_fused_rotary(enabled: bool = True) -> None:
    """Run RoPE's rotation as one `torch.compile`-generated kernel each way instead of about nine.

    Compilation happens lazily, on the first rotation (seconds, once per process and shape). The fused
    kernel may contract multiply-adds, so its results can differ from the op-by-op path in the last bit
    of fp32; the op-by-op path (the default, and what the CPU tests run) matches the plain autograd
    formula exactly.
    """
    global _rotate_kernel
    _rotate_kernel = torch.compile(rotate, dynamic=None) if enabled else rotate


class _Rotary(torch.autograd.Function):
    """`rotate(x, cos, sin)`, saving only cos and sin: the gradient is `rotate(grad, cos, -sin)`, which
    is bit-identical to what autograd derives from `rotate` (negating a product is exact)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate_kernel(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate_kernel(grad, cos, -sin), None, None


def hidden_dropout(
    x: torch.Tensor, p: float, *, training: bool, sequence_parallel: bool, rng_tracker: RNGTracker
) -> torch.Tensor:
    """Dropout on the residual stream. Replicated across TP ranks it must draw the same mask everywhere
    (the default generator, seeded alike on all TP ranks); split by sequence it must differ per rank."""
    if not training or p == 0.0:
        return x
    with _fork_if(sequence_parallel, rng_tracker):
        return F.dropout(x, p)


def _fork_if(condition: bool, rng_tracker: RNGTracker) -> ContextManager:
    return rng_tracker.fork(TENSOR_PARALLEL_RNG) if condition else contextlib.nullcontext()


# Activation recomputation -------------------------------------------------------------------------------

RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")


@dataclass(frozen=True)
class RecomputeConfig:
    """Which activations the backward recomputes instead of keeping (default: none).

    `full` checkpoints whole transformer layers of each model chunk. `method="uniform"` cuts the chunk's
    layers into spans of `num_layers` (the last may be shorter) and keeps only each span's input;
    `method="block"` checkpoints each of the chunk's first `num_layers` layers on its own and runs the
    rest normally, a way to spend memory left over. Example, a chunk of 4 layers: uniform 2 keeps the
    inputs of layers 0 and 2; block 1 keeps the input of layer 0 and everything layers 1-3 save.
    `selective` checkpoints only the attention core (scores, softmax, dropout, weighted sum), whose
    saved tensors grow with the square of the sequence length while its FLOPs are a small share.
    """

    granularity: Optional[str] = None
    """None, "full" or "selective" (--recompute-granularity)."""
    method: Optional[str] = None
    """"uniform" or "block", full granularity only (--recompute-method)."""
    num_layers: Optional[int] = None
    """Span length (uniform) or number of checkpointed layers (block) (--recompute-num-layers)."""

    def __post_init__(self) -> None:
        if self.granularity is not None and self.granularity not in RECOMPUTE_GRANULARITIES:
            raise ValueError(
                f"--recompute-granularity {self.granularity!r} is not one of {', '.join(RECOMPUTE_GRANULARITIES)}"
            )
        if self.granularity == "full":
            if self.method not in RECOMPUTE_METHODS:
                raise ValueError(
                    f"--recompute-granularity full needs --recompute-method {' or '.join(RECOMPUTE_METHODS)}, "
                    f"got {self.method!r}"
                )
            if self.num_layers is None or self.num_layers < 1:
                raise ValueError(
                    f"--recompute-granularity full needs --recompute-num-layers >= 1, got {self.num_layers}"
                )
        elif self.method is not None or self.num_layers is not None:
            raise ValueError("--recompute-method and --recompute-num-layers apply only to --recompute-granularity full")

    def checkpointed_spans(self, num_layers: int) -> list[tuple[int, int, bool]]:
        """`(start, end, checkpointed)` spans covering a chunk's `num_layers` layers, in order."""
        if self.granularity != "full" or num_layers == 0:
            return [(0, num_layers, False)]
        n = self.num_layers
        if self.method == "uniform":
            return [(i, min(i + n, num_layers), True) for i in range(0, num_layers, n)]
        spans = [(i, i + 1, True) for i in range(min(n, num_layers))]
        return spans + ([(n, num_layers, False)] if n < num_layers else [])


def checkpoint_with_rng(fn: Callable[..., torch.Tensor], rng_tracker: RNGTracker, *args: Any) -> torch.Tensor:
    """`fn(*args)`, keeping only `args` for the backward, which reruns `fn` to rebuild what it saved.

    The rerun must draw the same dropout masks. `torch.utils.checkpoint` restores the default generators
    (`preserve_rng_state`); the tracker's named streams (TP-split dropout) have moved on by the time the
    backward runs, so they are snapshot when the forward starts, swapped in for the rerun, and the
    streams' current states put back after it.
    """
    snapshot: dict = {}

    @contextlib.contextmanager
    def forward_context() -> Iterator[None]:
        snapshot.update(rng_tracker.get_states())
        yield

    @contextlib.contextmanager
    def recompute_context() -> Iterator[None]:
        current = rng_tracker.get_states()
        rng_tracker.set_states(snapshot)
        try:
            yield
        finally:
            rng_tracker.set_states(current)

    return checkpoint(fn, *args, use_reentrant=False, context_fn=lambda: (forward_context(), recompute_context()))


class Embedding(nn.Module):
    """Word embedding (vocabulary split over TP) plus, for GPT, a learned position table.

    Returns `[s, b, h]`, or this rank's `[s/tp, b, h]` under sequence parallelism: the word embedding is
    then reduce-scattered instead of all-reduced, and the position embedding, replicated on every rank,
    contributes its matching rows (its gradient comes back whole through the scatter's all-gather, so it
    needs no `sequence_parallel` tag). `with_positions=False` builds only the word embedding: the copy
    that the last stage of a pipeline keeps for a tied output layer.
    """

    def __init__(
        self,
        config: TransformerConfig,
        tp_group: Optional[ProcessGroup],
        sequence_parallel: bool,
        device: Optional[torch.device],
        with_positions: bool = True,
    ):
        super().__init__()
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.word_embeddings = VocabParallelEmbedding(
            config.padded_vocab_size(tp_size(tp_group)),
            config.hidden_size,
            tp_group=tp_group,
            reduce_scatter_embeddings=sequence_parallel,
            params_dtype=config.params_dtype,
            device=device,
        )
        self.position_embeddings: Optional[nn.Embedding] = None
        if with_positions and config.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(
                config.num_positions, config.hidden_size, dtype=config.params_dtype, device=device
            )
            mark_replicated(self.position_embeddings.weight)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.word_embeddings(tokens)
        if self.position_embeddings is not None:
            positions = self.position_embeddings(position_ids).transpose(0, 1)  # [s, b, h]
            if self.sequence_parallel:
                positions = scatter_to_sequence_parallel_region(positions, self.tp_group)
            hidden = hidden + positions
        return hidden


class SelfAttention(nn.Module):
    """Causal self-attention with grouped query heads.

    The fused QKV weight is laid out per query group: the group's q heads, then its one k head, then its
    one v head. A contiguous column-parallel split therefore hands each TP rank whole groups, with the
    keys and values its query heads read, and no communication inside attention.
    """

    def __init__(
        self,
        config: TransformerConfig,
        tp_group: Optional[ProcessGroup],
        sequence_parallel: bool,
        rng_tracker: RNGTracker,
        device: Optional[torch.device],
    ):
        super().__init__()
        self.head_dim = config.head_dim
        self.heads_per_group = config.num_attention_heads // config.query_groups
        self.local_groups = config.query_groups // tp_size(tp_group)
        self.dropout = config.attention_dropout
        self.backend = config.attention_backend
        self.rng_tracker = rng_tracker
        common = dict(tp_group=tp_group, bias=config.add_bias_linear, sequence_parallel=sequence_parallel,
                      params_dtype=config.params_dtype, device=device)
        self.linear_qkv = ColumnParallelLinear(config.hidden_size, config.qkv_size, **common)
        self.linear_proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim, config.hidden_size, input_is_parallel=True, **common
        )

    def forward(
        self,
        x: torch.Tensor,
        rotary: Optional[Rotary],
        cu_seqlens: Optional[torch.Tensor],
        max_seqlen: Optional[int],
        recompute_core: bool = False,
    ) -> torch.Tensor:
        qkv = self.linear_qkv(x)  # [s, b, local_groups * (heads_per_group + 2) * d], s the full sequence
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.local_groups, self.heads_per_group + 2, self.head_dim)
        q = qkv[:, :, :, : self.heads_per_group].reshape(s, b, -1, self.head_dim)
        k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]
        if rotary is not None:
            q, k = apply_rotary(q, rotary), apply_rotary(k, rotary)
        if recompute_core and torch.is_grad_enabled():
            out = checkpoint_with_rng(self._core, self.rng_tracker, q, k, v, cu_seqlens, max_seqlen)
        else:
            out = self._core(q, k, v, cu_seqlens, max_seqlen)
        return self.linear_proj(out.transpose(0, 1).reshape(s, b, -1))

    def _core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
        max_seqlen: Optional[int],
    ) -> torch.Tensor:
        """Attention of `[s, b, heads, d]` q, k, v; returns `[b, s, heads, d]`."""
        dropout_p = self.dropout if self.training else 0.0
        # Each TP rank holds different heads, so their probability dropout masks must differ.
        with _fork_if(dropout_p > 0.0, self.rng_tracker):
            return attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                causal=True, dropout_p=dropout_p, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                backend=self.backend,
            )


class MLP(nn.Module):
    """fc1 (column-parallel) -> GELU or SwiGLU -> fc2 (row-parallel).

    SwiGLU's gate and up projections are one fc1 weight `[gate; up]` split with partition stride 2, so
    each rank's shard is `[its gate rows; its up rows]` and splits locally into the two halves.
    """

    def __init__(
        self,
        config: TransformerConfig,
        tp_group: Optional[ProcessGroup],
        sequence_parallel: bool,
        device: Optional[torch.device],
    ):
        super().__init__()
        self.swiglu = config.activation == "swiglu"
        common = dict(tp_group=tp_group, bias=config.add_bias_linear, sequence_parallel=sequence_parallel,
                      params_dtype=config.params_dtype, device=device)
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size, config.ffn_size * (2 if self.swiglu else 1),
            partition_stride=2 if self.swiglu else 1, **common,
        )
        self.linear_fc2 = RowParallelLinear(config.ffn_size, config.hidden_size, input_is_parallel=True, **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear_fc1(x)
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        else:
            y = F.gelu(y, approximate="tanh")  # GPT-2's GELU, so converted GPT-2 checkpoints match
        return self.linear_fc2(y)


class TransformerLayer(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then x + mlp(norm(x)), dropout on each branch."""

    def __init__(
        self,
        config: TransformerConfig,
        tp_group: Optional[ProcessGroup],
        sequence_parallel: bool,
        rng_tracker: RNGTracker,
        device: Optional[torch.device],
    ):
        super().__init__()
        self.hidden_dropout = config.hidden_dropout
        self.sequence_parallel = sequence_parallel
        self.rng_tracker = rng_tracker
        self.input_layernorm = Norm(config, sequence_parallel, device)
        self.self_attention = SelfAttention(config, tp_group, sequence_parallel, rng_tracker, device)
        self.pre_mlp_layernorm = Norm(config, sequence_parallel, device)
        self.mlp = MLP(config, tp_group, sequence_parallel, device)

    def forward(
        self,
        x: torch.Tensor,
        rotary: Optional[Rotary],
        cu_seqlens: Optional[torch.Tensor],
        max_seqlen: Optional[int],
        recompute_attention_core: bool = False,
    ) -> torch.Tensor:
        attn = self.self_attention(self.input_layernorm(x), rotary, cu_seqlens, max_seqlen, recompute_attention_core)
        x = x + self._dropout(attn)
        return x + self._dropout(self.mlp(self.pre_mlp_layernorm(x)))

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return hidden_dropout(x, self.hidden_dropout, training=self.training, sequence_parallel=self.sequence_parallel,
                              rng_tracker=self.rng_tracker)


# One pipeline stage -------------------------------------------------------------------------------------


class StageModel(nn.Module):
    """The layers, and possibly embedding and head, of one global pipeline stage.

    `forward(hidden, batch)`:
      - `batch["tokens"]` `[b, s]` int64 and `batch["labels"]` `[b, s]` int64; optional
        `batch["position_ids"]` `[b, s]` (default 0..s-1) and, for packed documents, `batch["cu_seqlens"]`
        (int32 boundaries over the flattened `b * s` tokens, see `models.attention`) with optional
        `batch["max_seqlen"]`.
      - the first stage ignores `hidden` (pass None) and embeds the tokens; other stages take `hidden`
        `[s, b, h]` (`[s/tp, b, h]` under sequence parallelism) from the previous stage.
      - a stage without the head returns hidden states in the same layout; the last stage returns the
        per-token loss `[b, s]` in fp32, unreduced (masking and averaging belong to the pipeline executor).

    With tied embeddings and the head on a different stage than the embedding, the head stage keeps its
    own copy of the word embedding under the same name, `embedding.word_embeddings.weight`; both copies
    are tagged `shared_embedding=True` and the training code must sum their gradients (all-reduce over
    the embedding group) so they stay equal. On a stage holding both, it is a single parameter.

    Weights are left uninitialised unless `seed` is given (then `init_stage_weights(self, seed)`), so a
    model about to load a checkpoint pays nothing for initialisation. `recompute` (see `RecomputeConfig`)
    is read at every forward, so it may also be changed on a built model.
    """

    def __init__(
        self,
        config: TransformerConfig,
        spec: StageSpec,
        *,
        tp_group: Optional[ProcessGroup] = None,
        sequence_parallel: bool = False,
        device: Optional[torch.device] = None,
        seed: Optional[int] = None,
        rng_tracker: Optional[RNGTracker] = None,
        recompute: Optional[RecomputeConfig] = None,
    ):
        super().__init__()
        tp = tp_size(tp_group)
        config.validate(tp)
        if not 0 <= spec.layer_start <= spec.layer_end <= config.num_layers:
            raise ValueError(
                f"stage {spec.stage} holds layers [{spec.layer_start}, {spec.layer_end}) outside --num-layers "
                f"{config.num_layers}"
            )
        sequence_parallel = sequence_parallel and tp > 1
        if sequence_parallel and config.seq_length % tp != 0:
            raise ValueError(
                f"--seq-length {config.seq_length} is not divisible by --tensor-model-parallel-size {tp} "
                f"(required by --sequence-parallel)"
            )
        self.config = config
        self.spec = spec
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.rng_tracker = rng_tracker if rng_tracker is not None else get_rng_tracker()
        self.recompute = recompute if recompute is not None else RecomputeConfig()
        tied = not config.untie_embeddings_and_output_weights

        self.embedding: Optional[Embedding] = None
        if spec.has_embedding or (spec.has_head and tied):
            self.embedding = Embedding(config, tp_group, sequence_parallel, device, with_positions=spec.has_embedding)
            if tied and not (spec.has_embedding and spec.has_head):
                self.embedding.word_embeddings.weight.shared_embedding = True

        self.layers = nn.ModuleDict(
            {
                str(i): TransformerLayer(config, tp_group, sequence_parallel, self.rng_tracker, device)
                for i in spec.layers
            }
        )

        self.final_layernorm: Optional[Norm] = None
        self.output_layer: Optional[ColumnParallelLinear] = None
        if spec.has_head:
            self.final_layernorm = Norm(config, sequence_parallel, device)
            if not tied:
                self.output_layer = ColumnParallelLinear(
                    config.hidden_size, config.padded_vocab_size(tp), tp_group=tp_group, bias=False,
                    sequence_parallel=sequence_parallel, params_dtype=config.params_dtype, device=device,
                )
        if seed is not None:
            init_stage_weights(self, seed)

    def forward(self, hidden: Optional[torch.Tensor], batch: Mapping[str, Any]) -> torch.Tensor:
        tokens = batch["tokens"]
        position_ids = batch.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)

        if self.spec.has_embedding:
            hidden = self.embedding(tokens, position_ids)
            hidden = hidden_dropout(hidden, self.config.hidden_dropout, training=self.training,
                                    sequence_parallel=self.sequence_parallel, rng_tracker=self.rng_tracker)
        rotary = None
        if self.config.position_embedding_type == "rope":
            rotary = rotary_cos_sin(position_ids, self.config.head_dim, self.config.rotary_base)
        hidden = self._run_layers(hidden, rotary, batch.get("cu_seqlens"), batch.get("max_seqlen"))
        if not self.spec.has_head:
            return hidden

        logits = self._logits(self.final_layernorm(hidden))  # [s, b, V/tp]
        return vocab_parallel_cross_entropy(logits, batch["labels"].t(), self.tp_group).t()

    def _run_layers(
        self, hidden: torch.Tensor, rotary: Optional[Rotary], cu_seqlens: Optional[torch.Tensor],
        max_seqlen: Optional[int],
    ) -> torch.Tensor:
        layers = list(self.layers.values())
        selective = self.recompute.granularity == "selective"
        cos, sin = rotary if rotary is not None else (None, None)

        def span(start: int, end: int) -> Callable[..., torch.Tensor]:
            # Tensors travel as separate arguments so a checkpoint saves (and the store counts) each one.
            def run(x: torch.Tensor, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
                    cu_seqlens: Optional[torch.Tensor], max_seqlen: Optional[int]) -> torch.Tensor:
                rot = None if cos is None else (cos, sin)
                for layer in layers[start:end]:
                    x = layer(x, rot, cu_seqlens, max_seqlen, selective)
                return x
            return run

        for start, end, checkpointed in self.recompute.checkpointed_spans(len(layers)):
            args = (hidden, cos, sin, cu_seqlens, max_seqlen)
            if checkpointed and torch.is_grad_enabled():
                hidden = checkpoint_with_rng(span(start, end), self.rng_tracker, *args)
            else:
                hidden = span(start, end)(*args)
        return hidden

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.output_layer is not None:
            return self.output_layer(hidden)
        # Tied: the same column-parallel product, with the word embedding's vocabulary shard as weight
        # (under sequence parallelism it saves only this rank's sequence shard, not the gathered input).
        return column_parallel_linear(
            hidden, self.embedding.word_embeddings.weight, None, self.tp_group, sequence_parallel=self.sequence_parallel
        )


def build_model(config: TransformerConfig, seed: int, device: Optional[torch.device] = None) -> StageModel:
    """The whole model as one stage on one process: the single-process reference for every layout."""
    (spec,) = split_layers(config.num_layers, 1)
    return StageModel(config, spec, device=device, seed=seed)


# Layout-independent initialisation ------------------------------------------------------------------------


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
    if "layernorm" in name:
        return "ones"
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
def init_stage_weights(model: StageModel, seed: int) -> None:
    """Set every parameter to its slice of the layout-independent initial value (see `initial_value`).

    Constant parameters are filled where they live; normal ones draw only this rank's elements
    (`initial_shard`) on CPU, the only place the defining generator runs, and are copied once.
    """
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


def full_named_parameters(stage_models: Iterable[StageModel], *, grads: bool = False) -> dict[str, torch.Tensor]:
    """Full (TP-gathered) parameters, or their gradients, of some stages, by global name, on CPU.

    Collective over the stages' TP group: every TP rank must call it with the same stages. A name held by several
    stages (the tied word embedding's copy on the head stage) appears once: for parameters the first
    stage's value, for gradients the sum, which is what the training code's embedding all-reduce
    produces. Gradients of parameters tagged `sequence_parallel` are returned as this rank holds them;
    sum them over TP first, as the training code does.
    """
    full: dict[str, torch.Tensor] = {}
    for model in stage_models:
        for name, param in model.named_parameters():
            tensor = param.grad if grads else param
            if tensor is None:
                raise ValueError(f"parameter {name} has no gradient; run a backward first")
            if param_is_partitioned(param):
                tensor = gather_tensor(tensor, param.partition_dim, param.partition_stride, model.tp_group)
            tensor = tensor.detach().cpu().clone()
            if name not in full:
                full[name] = tensor
            elif grads:
                full[name] += tensor
    return full
