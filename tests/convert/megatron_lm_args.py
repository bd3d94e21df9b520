"""The `args` a Megatron-LM training run saves in its checkpoints, for the import tests.

A checkpoint's `args` is Megatron-LM's whole parsed command line after `validate_args`: every field a
run did not set holds Megatron-LM's default, and some are then derived. Import tests that wrote only
the fields they thought of (and `num_query_groups=None` for multi-head attention, where Megatron-LM
writes its default 1 beside `group_query_attention=False`) passed on files no user has. Here each
model-related field starts at the default of Megatron-LM's `megatron/training/arguments.py` (read from
NVIDIA/Megatron-LM, not installed with megatron-core), a case sets what its run would have set on the
command line, and the derivations `validate_args` and tokenizer set-up make are applied after:

    kv_channels          None -> hidden_size // num_attention_heads
    ffn_hidden_size      None -> 4 * hidden_size, or with --swiglu int(4 * hidden_size * 2 / 3 / 64) * 64
    max_position_embeddings None -> seq_length (our reading; the cases set it)
    position_embedding_type 'rope' when --use-rotary-position-embeddings (deprecated spelling)
    params_dtype         torch.float (torch.half with --fp16, torch.bfloat16 with --bf16)
    padded_vocab_size    the tokenizer's size rounded up to make_vocab_size_divisible_by * tp
    vocab_size           stays None unless given (Megatron-LM does not record the tokenizer's size)

The table is ours, written from the documented flags; a field Megatron-LM adds later and the converter
starts to read needs a line here.
"""
from __future__ import annotations

import argparse
import math

import torch

# Model-shape and checkpoint fields a converter may read, at Megatron-LM's parser defaults.
MEGATRON_LM_DEFAULTS = {
    # network size
    "num_layers": None, "hidden_size": None, "ffn_hidden_size": None, "num_attention_heads": None,
    "kv_channels": None, "group_query_attention": False, "num_query_groups": 1, "max_position_embeddings": None,
    "position_embedding_type": "learned_absolute", "use_rotary_position_embeddings": False, "rotary_base": 10000,
    "rotary_percent": 1.0, "rotary_interleaved": False, "rotary_seq_len_interpolation_factor": None,
    "use_rope_scaling": False, "rope_scaling_factor": 8.0, "no_rope_freq": None, "add_position_embedding": True,
    "make_vocab_size_divisible_by": 128, "normalization": "LayerNorm", "norm_epsilon": 1e-5,
    "apply_layernorm_1p": False, "apply_residual_connection_post_layernorm": False, "openai_gelu": False,
    "squared_relu": False, "swiglu": False, "quick_geglu": False, "untie_embeddings_and_output_weights": False,
    "multi_latent_attention": False, "window_size": None, "softmax_type": "vanilla", "qk_layernorm": False,
    "num_experts": None, "mtp_num_layers": None,
    # training / regularization / init
    "add_bias_linear": True, "add_qkv_bias": False, "hidden_dropout": 0.1, "attention_dropout": 0.1,
    "init_method_std": 0.02, "seq_length": None, "fp16": False, "bf16": False,
    # parallelism and checkpoint
    "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
    "virtual_pipeline_model_parallel_size": None, "num_layers_per_virtual_pipeline_stage": None,
    "decoder_first_pipeline_num_layers": None, "decoder_last_pipeline_num_layers": None,
    "ckpt_format": "torch_dist", "use_legacy_models": False, "transformer_impl": "transformer_engine",
    "vocab_size": None, "tokenizer_type": None, "tokenizer_model": None, "consumed_train_samples": 0,
}


def megatron_lm_args(*, padded_for_vocab: int, **set_by_run) -> argparse.Namespace:
    """The `args` of a Megatron-LM run that set `set_by_run` (field names, as argparse stores them) and
    whose tokenizer has `padded_for_vocab` tokens; everything else at Megatron-LM's default, derived
    fields derived. E.g. a 4-layer, 64-wide, 4-head GPT at tp 2 with a 500-token tokenizer has
    num_query_groups 1, group_query_attention False, kv_channels 16, ffn_hidden_size 256 and
    padded_vocab_size 512 (500 rounded up to 128 x 2)."""
    unknown = sorted(set(set_by_run) - set(MEGATRON_LM_DEFAULTS))
    assert not unknown, f"not a Megatron-LM field of the table: {unknown}"
    args = argparse.Namespace(**{**MEGATRON_LM_DEFAULTS, **set_by_run})
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = (int(4 * args.hidden_size * 2 / 3 / 64) * 64 if args.swiglu
                                else 4 * args.hidden_size)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    args.params_dtype = torch.half if args.fp16 else torch.bfloat16 if args.bf16 else torch.float
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    args.padded_vocab_size = math.ceil(padded_for_vocab / multiple) * multiple
    return args


def args_for(config, *, tp: int = 1, pp: int = 1, vp: int = 1, **set_by_run) -> argparse.Namespace:
    """`megatron_lm_args` of the run that trained our `config`: only the flags that model needs are set
    (a multi-head model sets neither --group-query-attention nor --num-query-groups; a tied one does not
    say so; RoPE is --position-embedding-type rope), plus the case's `set_by_run`."""
    flags: dict = dict(num_layers=config.num_layers, hidden_size=config.hidden_size,
                       num_attention_heads=config.num_attention_heads, seq_length=config.seq_length,
                       max_position_embeddings=config.num_positions, tensor_model_parallel_size=tp,
                       pipeline_model_parallel_size=pp)
    if vp > 1:
        flags["virtual_pipeline_model_parallel_size"] = vp
    if config.query_groups != config.num_attention_heads:
        flags.update(group_query_attention=True, num_query_groups=config.query_groups)
    if config.head_dim * config.num_attention_heads != config.hidden_size:
        flags["kv_channels"] = config.head_dim
    flags["ffn_hidden_size"] = config.ffn_size
    if config.normalization != "LayerNorm":
        flags["normalization"] = config.normalization
    if config.norm_epsilon != 1e-5:
        flags["norm_epsilon"] = config.norm_epsilon
    if config.activation == "swiglu":
        flags["swiglu"] = True
    else:
        flags["openai_gelu"] = True  # our GELU is the tanh one; Megatron-LM's default is the erf GELU
    if config.position_embedding_type == "rope":
        flags["position_embedding_type"] = "rope"
        if config.rotary_base != 10000:
            flags["rotary_base"] = int(config.rotary_base)
    if not config.add_bias_linear:
        flags["add_bias_linear"] = False  # --disable-bias-linear
    if config.untie_embeddings_and_output_weights:
        flags["untie_embeddings_and_output_weights"] = True
    flags.update(set_by_run)
    return megatron_lm_args(padded_for_vocab=config.vocab_size, **flags)
