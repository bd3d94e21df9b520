"""The `args` namespace a Megatron-LM run saves in its checkpoints, for a model and target layout: what the
two Megatron-LM export formats (`torch`, megatron_lm.py; `torch_dist`, torch_dist.py) write beside the
weights. The other direction, `args` to a config, is `megatron_lm.config_from_megatron_args`.
"""
from __future__ import annotations

import argparse
from typing import Any, Optional

import torch

from megatron_pp.models.config import TransformerConfig
from megatron_pp.convert.core import TargetLayout


def _tokenizer_args(config: TransformerConfig, tokenizer_model: Optional[str]) -> dict[str, Any]:
    if tokenizer_model is not None:
        return {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": tokenizer_model}
    # Without tokenizer files there is nothing to point at; Megatron-LM's loaders still need a type.
    return {"tokenizer_type": "NullTokenizer", "tokenizer_model": None}


def megatron_lm_args(
    config: TransformerConfig,
    layout: TargetLayout,
    *,
    iteration: int,
    consumed_samples: int,
    ckpt_format: str,
    transformer_impl: str,
    tokenizer_model: Optional[str],
    dtype: torch.dtype,
) -> argparse.Namespace:
    """The `args` a Megatron-LM run of this model and layout would have saved, as far as loading reads them.

    Covers what `load_args_from_checkpoint` copies (model shape, position embedding, biases, norms,
    parallel sizes, tokenizer, padded vocabulary), what `check_checkpoint_args` compares, what
    `tools/checkpoint`'s loader requires (`fp16`, `bf16`, `params_dtype`, `tokenizer_type`, ...) and what
    `config_from_megatron_args` reads back. `no_save_optim` / `no_save_rng` tell Megatron-LM's torch_dist
    loader that the checkpoint has neither.
    """
    return argparse.Namespace(
        **_model_args(config),
        **_vocabulary_args(config, layout, tokenizer_model),
        **_parallel_args(config, layout),
        params_dtype=dtype,
        fp16=dtype == torch.float16,
        bf16=dtype == torch.bfloat16,
        transformer_impl=transformer_impl,
        use_legacy_models=False,
        ckpt_format=ckpt_format,
        iteration=iteration,
        consumed_train_samples=consumed_samples,
        skipped_train_samples=0,
        consumed_valid_samples=0,
        no_save_optim=True,
        no_save_rng=True,
    )


def _model_args(config: TransformerConfig) -> dict[str, Any]:
    """The model's shape, positions, norms, activation, biases, dropouts and initialisation as Megatron-LM's
    flags name them (the features we do not have set off)."""
    rope = config.position_embedding_type == "rope"
    return dict(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.ffn_size,
        num_attention_heads=config.num_attention_heads,
        group_query_attention=config.query_groups != config.num_attention_heads,
        num_query_groups=config.query_groups,
        kv_channels=config.head_dim,
        seq_length=config.seq_length,
        max_position_embeddings=config.num_positions,
        position_embedding_type=config.position_embedding_type,
        add_position_embedding=not rope,
        use_rotary_position_embeddings=rope,
        rotary_base=int(config.rotary_base) if float(config.rotary_base).is_integer() else config.rotary_base,
        rotary_percent=config.rotary_percent,
        rotary_interleaved=False,
        rotary_seq_len_interpolation_factor=None,
        normalization=config.normalization,
        norm_epsilon=config.norm_epsilon,
        apply_layernorm_1p=config.apply_layernorm_1p,
        apply_residual_connection_post_layernorm=False,
        swiglu=config.activation == "swiglu",
        # Our GELU is the tanh approximation, which Megatron-LM calls openai_gelu (its default is exact erf).
        openai_gelu=config.activation == "gelu",
        squared_relu=False,
        add_bias_linear=config.add_bias_linear,
        add_qkv_bias=config.add_bias_linear,
        untie_embeddings_and_output_weights=config.untie_embeddings_and_output_weights,
        qk_layernorm=False,
        multi_latent_attention=False,
        num_experts=None,
        apply_query_key_layer_scaling=False,
        attention_dropout=config.attention_dropout,
        hidden_dropout=config.hidden_dropout,
        init_method_std=config.init_method_std,
    )


def _vocabulary_args(config: TransformerConfig, layout: TargetLayout,
                     tokenizer_model: Optional[str]) -> dict[str, Any]:
    """The vocabulary, padded for the target's tp, and the tokenizer Megatron-LM loads."""
    return dict(
        vocab_size=config.vocab_size,
        padded_vocab_size=config.padded_vocab_size(layout.tp),
        make_vocab_size_divisible_by=config.make_vocab_size_divisible_by,
        **_tokenizer_args(config, tokenizer_model),
        vocab_file=None,
        merge_file=None,
    )


def _parallel_args(config: TransformerConfig, layout: TargetLayout) -> dict[str, Any]:
    """The target layout as Megatron-LM's parallel sizes and uneven-split flags (dp 1: model weights only)."""
    chunks = layout.num_chunks(config.num_layers)
    return dict(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=chunks if chunks > 1 else None,
        num_layers_per_virtual_pipeline_stage=layout.layers_per_virtual_stage,
        decoder_first_pipeline_num_layers=layout.first_stage_layers,
        decoder_last_pipeline_num_layers=layout.last_stage_layers,
        account_for_embedding_in_pipeline_split=layout.account_for_embedding,
        account_for_loss_in_pipeline_split=layout.account_for_loss,
        expert_model_parallel_size=1,
        context_parallel_size=1,
        sequence_parallel=False,
        world_size=layout.tp * layout.pp,
        data_parallel_size=1,
    )
