"""The one description of a decoder-only transformer: `TransformerConfig`.

GPT and LLaMA are not separate model classes here, only different values of this dataclass (norm,
activation, position embedding, biases, tying, query groups). The config knows the closed-form parameter
count, the padded vocabulary size, and which sizes a tensor-parallel degree can split; `validate(tp)`
raises a one-line error naming the command-line flag to change. Derived sizes (`ffn_size`, `head_dim`,
`query_groups`) are properties rather than fields filled in `__post_init__`, so `dataclasses.replace`
on `hidden_size` or `num_attention_heads` never leaves a stale derived value behind.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_pp.core.parallel_state import LayoutError

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ACTIVATIONS = ("gelu", "swiglu")
POSITION_EMBEDDINGS = ("learned_absolute", "rope")
ATTENTION_BACKENDS = ("auto", "flash", "sdpa", "reference")


def flag(field_name: str) -> str:
    """Command-line flag of a config field (Megatron-LM's spelling: underscores become dashes)."""
    return "--" + field_name.replace("_", "-")


@dataclass
class TransformerConfig:
    """Shape and numerics of a pre-norm decoder-only transformer (GPT-3 and LLaMA are both instances)."""

    num_layers: int
    """Number of transformer layers."""
    hidden_size: int
    """Width of the residual stream (h)."""
    num_attention_heads: int
    """Number of query heads."""
    vocab_size: int
    """Size of the tokenizer's vocabulary; the embedding is padded up to `padded_vocab_size(tp)`."""
    seq_length: int
    """Training sequence length in tokens."""
    max_position_embeddings: Optional[int] = None
    """Rows of the learned position table (None = seq_length); unused with RoPE."""
    num_query_groups: Optional[int] = None
    """Key/value heads for grouped-query attention; None = one per query head (multi-head attention)."""
    ffn_hidden_size: Optional[int] = None
    """Width of the MLP's hidden layer; None = 4 * hidden_size. LLaMA presets give theirs explicitly."""
    kv_channels: Optional[int] = None
    """Per-head dimension; None = hidden_size / num_attention_heads."""
    make_vocab_size_divisible_by: int = 128
    """The padded vocabulary is a multiple of this times the tensor-parallel size (Megatron's rule)."""
    normalization: str = "LayerNorm"
    """'LayerNorm' (GPT: scale and shift) or 'RMSNorm' (LLaMA: scale only)."""
    norm_epsilon: float = 1e-5
    """Epsilon added to the variance in every norm."""
    activation: str = "gelu"
    """MLP activation: 'gelu' (GPT, tanh approximation as in GPT-2) or 'swiglu' (LLaMA: silu(gate) * up)."""
    position_embedding_type: str = "learned_absolute"
    """'learned_absolute' (GPT: a trained table added to the embedding) or 'rope' (LLaMA: rotary)."""
    rotary_base: float = 10000.0
    """RoPE frequency base theta (LLaMA-2: 10000, LLaMA-3: 500000)."""
    rotary_percent: float = 1.0
    """Share of each head's channels that RoPE rotates (Megatron-LM's partial rotary): the first
    int(head_dim * this) channels, with frequencies base^(-2i/that width); the rest pass unrotated."""
    apply_layernorm_1p: bool = False
    """Zero-centred norm scales (Megatron-LM's layernorm-1p): each norm's weight w is stored and
    initialised as 0 and applied as 1 + w, so weight decay pulls the scale towards 1, not 0."""
    add_bias_linear: bool = True
    """Biases in the attention and MLP linear layers (GPT yes, LLaMA no)."""
    untie_embeddings_and_output_weights: bool = False
    """Separate output projection (LLaMA) instead of reusing the word embedding (GPT)."""
    hidden_dropout: float = 0.0
    """Dropout on the embedding output and on each residual branch."""
    attention_dropout: float = 0.0
    """Dropout on the attention probabilities."""
    init_method_std: float = 0.02
    """Std of the normal init of weights; output projection and fc2 use std / sqrt(2 * num_layers)."""
    attention_backend: str = "auto"
    """'auto' (flash-attn on CUDA fp16/bf16 when installed, else SDPA), 'flash', 'sdpa' or 'reference'."""
    params_dtype: torch.dtype = torch.float32
    """Dtype in which parameters are stored."""

    # Derived sizes ------------------------------------------------------------------------------------
    @property
    def query_groups(self) -> int:
        return self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Channels per head that RoPE rotates: int(head_dim * rotary_percent), e.g. 64 of 128 at 0.5."""
        return int(self.head_dim * self.rotary_percent)

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    @property
    def num_positions(self) -> int:
        return self.max_position_embeddings if self.max_position_embeddings is not None else self.seq_length

    @property
    def qkv_size(self) -> int:
        """Output width of the fused QKV projection: every query head plus one key and one value per group."""
        return (self.num_attention_heads + 2 * self.query_groups) * self.head_dim

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Vocabulary rounded up to a multiple of make_vocab_size_divisible_by * tp.

        E.g. GPT-2's 50257 tokens: 50304 at tp 1 (multiple of 128), 51200 at tp 8 (multiple of 1024).
        Padding keeps every TP shard of the embedding equal and its matmuls aligned.
        """
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def num_parameters(self, tp: int = 1) -> int:
        """Unique parameters of the whole model, in closed form (nothing is allocated).

        Counts the vocabulary *padded for `tp`*, i.e. exactly what `build_model` allocates (summed over
        the shards of a tp-way split); padding adds < 0.1% to the published sizes, which count the real
        vocabulary. A tied output layer is counted once, although a pipeline split holds a second copy
        of the word embedding on its last stage.
        """
        h, f, layers = self.hidden_size, self.ffn_size, self.num_layers
        bias = self.add_bias_linear
        norm = 2 * h if self.normalization == "LayerNorm" else h
        attention = h * self.qkv_size + self.num_attention_heads * self.head_dim * h
        if bias:
            attention += self.qkv_size + h
        fc1 = 2 * f if self.activation == "swiglu" else f
        mlp = h * fc1 + f * h + ((fc1 + h) if bias else 0)
        per_layer = 2 * norm + attention + mlp

        vocab = self.padded_vocab_size(tp)
        embedding = vocab * h
        if self.position_embedding_type == "learned_absolute":
            embedding += self.num_positions * h
        output = vocab * h if self.untie_embeddings_and_output_weights else 0
        return embedding + layers * per_layer + norm + output

    def validate(self, tp: int = 1) -> None:
        """Raise a one-line error naming the flag if this config cannot run with tensor parallelism `tp`."""
        for name, allowed in (
            ("normalization", NORMALIZATIONS),
            ("activation", ACTIVATIONS),
            ("position_embedding_type", POSITION_EMBEDDINGS),
            ("attention_backend", ATTENTION_BACKENDS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{flag(name)} {getattr(self, name)!r} is not one of {', '.join(allowed)}")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{flag(name)} must be in [0, 1), got {getattr(self, name)}")

        heads, groups = self.num_attention_heads, self.query_groups
        if self.kv_channels is None and self.hidden_size % heads != 0:
            raise ValueError(
                f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads {heads}; "
                f"set --kv-channels explicitly"
            )
        if heads % groups != 0:
            raise ValueError(f"--num-attention-heads {heads} is not divisible by --num-query-groups {groups}")
        if self.position_embedding_type == "rope" and self.head_dim % 2 != 0:
            raise ValueError(f"RoPE needs an even head dimension, got --kv-channels {self.head_dim}")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"--rotary-percent must be in (0, 1], got {self.rotary_percent}")
        if self.position_embedding_type == "rope" and (self.rotary_dim < 2 or self.rotary_dim % 2 != 0):
            raise ValueError(f"--rotary-percent {self.rotary_percent} rotates {self.rotary_dim} of {self.head_dim} "
                             "channels per head; RoPE needs an even number >= 2")
        if self.position_embedding_type == "learned_absolute" and self.num_positions < self.seq_length:
            raise ValueError(
                f"--max-position-embeddings {self.num_positions} is smaller than --seq-length {self.seq_length}"
            )

        tp_flag = f"--tensor-model-parallel-size {tp}"
        if tp < 1:
            raise LayoutError(f"{tp_flag} must be >= 1")
        if heads % tp != 0:
            raise LayoutError(f"--num-attention-heads {heads} is not divisible by {tp_flag}")
        # Each rank must own whole query groups: its q heads and the k/v they read.
        if groups % tp != 0:
            raise LayoutError(f"--num-query-groups {groups} is not divisible by {tp_flag}")
        if self.ffn_size % tp != 0:
            raise LayoutError(f"--ffn-hidden-size {self.ffn_size} is not divisible by {tp_flag}")
