"""The layers of one transformer block and the embedding: `Embedding` (vocabulary-parallel, learned
positions for GPT), `SelfAttention` (fused QKV column-parallel, grouped-query heads, RoPE, the output
projection row-parallel), `MLP` (GELU or SwiGLU; fc1 column-, fc2 row-parallel) and `TransformerLayer`
(pre-norm residual block of the two). Tensors are sequence-first, `[s, b, h]`."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from megatron_pp.core.tensor_parallel import (
    ColumnParallelLinear,
    RNGTracker,
    RowParallelLinear,
    VocabParallelEmbedding,
    mark_replicated,
    scatter_to_sequence_parallel_region,
    tp_size,
)
from megatron_pp.models.attention import attention
from megatron_pp.models.config import TransformerConfig
from megatron_pp.models.ops import Norm, Rotary, _fork_if, apply_rotary, hidden_dropout
from megatron_pp.models.recompute import checkpoint_with_rng


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


def _linear_options(config: TransformerConfig, tp_group: Optional[ProcessGroup], sequence_parallel: bool,
                    device: Optional[torch.device]) -> dict:
    """What every parallel linear layer of a transformer layer (attention's and the MLP's) is built with."""
    return dict(tp_group=tp_group, bias=config.add_bias_linear, sequence_parallel=sequence_parallel,
                params_dtype=config.params_dtype, device=device)


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
        common = _linear_options(config, tp_group, sequence_parallel, device)
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
        common = _linear_options(config, tp_group, sequence_parallel, device)
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
