"""Hugging Face ↔ megatron_pp: configs, parameter names and tensor layouts, without any file I/O.

A megatron_pp model is one `TransformerConfig`; on the Hugging Face side it is a `LlamaForCausalLM`
(LLaMA-2/3 layout) or a `GPT2LMHeadModel`. This module maps the config both ways (`config_from_hf`,
`hf_config_from`) and every parameter both ways (`tensor_maps`: one `TensorMap` per megatron_pp
parameter, naming the Hugging Face tensors it is made of and converting between them). Every mapping
is a pure permutation, concatenation or transpose, so a round trip is bit-identical. Reading and
writing files, tensor-parallel sharding and pipeline layouts belong to `megatron_pp.convert`.

Conventions (worked for a model with 4 query heads of dimension d in 2 query groups, i.e. GQA with 2
key/value heads; "full" means the whole tensor, before any tensor-parallel split):

- **QKV.** Ours is one fused `linear_qkv` whose output rows are grouped per query group: the group's
  query heads, then its key head, then its value head. Hugging Face LLaMA keeps `q_proj` (all query
  heads in order), `k_proj` and `v_proj`; GPT-2 keeps one `c_attn` whose outputs are `[all q | all k |
  all v]`. In rows of d:

      ours           q0 q1 k0 v0 | q2 q3 k1 v1        (group 0 | group 1)
      HF LLaMA       q_proj: q0 q1 q2 q3   k_proj: k0 k1   v_proj: v0 v1

  The grouping is what lets a contiguous tensor-parallel split give each rank whole groups.
- **SwiGLU.** Our `linear_fc1` is `[gate; up]` (HF `gate_proj` rows, then `up_proj` rows); tensor
  parallelism splits it with partition stride 2, so each rank holds its own gate and up rows.
- **GPT-2's Conv1D** stores weights as `[in, out]`, the transpose of a linear layer's `[out, in]`.
- **Tied embeddings** (GPT-2, and LLaMA with `tie_word_embeddings`): the output layer is the word
  embedding; Hugging Face saves no `lm_head.weight` and neither do we (no `output_layer.weight`).
- **Vocabulary.** Hugging Face stores `vocab_size` rows. megatron_pp pads the embedding and output layer
  to `TransformerConfig.padded_vocab_size(tp)` rows; `resize_vocab_rows` adds zero rows on import and
  drops them on export. A padded row's logit takes part in the softmax, so losses on a padded model
  differ slightly from Hugging Face's while the logits of real tokens are equal.
- **RoPE.** Our `apply_rotary` rotates the pairs (x_i, x_{i+d/2}) ("rotate half"), exactly as Hugging
  Face's LLaMA does, so q and k need no permutation between the two. Meta's original LLaMA release and
  Megatron-LM with `--rotary-interleaved` rotate adjacent pairs (x_{2i}, x_{2i+1}) instead;
  `rotary_interleaved_to_half` reorders the rows of q and k so our rotation computes the same scores.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from megatron_pp.models.config import TransformerConfig

LLAMA = "llama"
GPT2 = "gpt2"
VOCAB_PARAMETERS = ("embedding.word_embeddings.weight", "output_layer.weight")
"""Parameters with one row per vocabulary entry (padded in megatron_pp, exact in Hugging Face)."""

# GPT-2's tanh-approximated GELU under its Hugging Face names; our MLP computes exactly this one.
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
# Config values that are not part of the architecture but that an export should keep (token ids).
_CARRIED_HF_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# Buffers some Hugging Face checkpoints hold that carry no weights: the causal mask of old GPT-2 files
# and the RoPE frequencies of old LLaMA files (both recomputed by the model).
_IGNORED_HF_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


# Configs ----------------------------------------------------------------------------------------------


def config_from_hf(hf_config: Any) -> TransformerConfig:
    """Our config for a Hugging Face `LlamaConfig` or `GPT2Config` (any object with their attributes).

    Raises ValueError naming the config.json field when the model uses something megatron_pp does not
    compute (RoPE scaling, another activation, attention scaled per layer, ...).
    """
    model_type = getattr(hf_config, "model_type", None)
    if model_type == LLAMA:
        return _llama_config(hf_config)
    if model_type == GPT2:
        return _gpt2_config(hf_config)
    raise ValueError(f"config.json: model_type {model_type!r} is not supported (supported: {LLAMA}, {GPT2})")


def _refuse(condition: bool, message: str) -> None:
    if condition:
        raise ValueError(f"config.json: {message}")


def _llama_config(cfg: Any) -> TransformerConfig:
    # transformers >= 5 keeps theta and the RoPE type in `rope_parameters`; 4.x in `rope_theta` and
    # `rope_scaling`. Either way only plain RoPE ("default") is what our model computes.
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    scaling = getattr(cfg, "rope_scaling", None) or {}
    rope_type = scaling.get("rope_type", scaling.get("type")) or rope.get("rope_type", "default")
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    _refuse(rope_type != "default", f"RoPE scaling {rope_type!r} is not implemented by megatron_pp (plain RoPE only)")
    _refuse(cfg.hidden_act != "silu", f"hidden_act {cfg.hidden_act!r}: LLaMA's MLP must be SwiGLU ('silu')")
    attention_bias, mlp_bias = bool(getattr(cfg, "attention_bias", False)), bool(getattr(cfg, "mlp_bias", False))
    _refuse(attention_bias != mlp_bias, f"attention_bias {attention_bias} and mlp_bias {mlp_bias} differ; megatron_pp "
            "has one switch for the biases of every linear layer")
    heads = cfg.num_attention_heads
    _refuse(cfg.hidden_size % heads != 0 and getattr(cfg, "head_dim", None) is None,
            f"hidden_size {cfg.hidden_size} is not divisible by num_attention_heads {heads}")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    groups = getattr(cfg, "num_key_value_heads", None) or heads
    _refuse(heads % groups != 0, f"num_attention_heads {heads} is not divisible by num_key_value_heads {groups}")
    return TransformerConfig(
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=heads,
        num_query_groups=None if groups == heads else groups,
        ffn_hidden_size=cfg.intermediate_size,
        kv_channels=None if head_dim * heads == cfg.hidden_size else head_dim,
        vocab_size=cfg.vocab_size,
        seq_length=cfg.max_position_embeddings,
        max_position_embeddings=cfg.max_position_embeddings,
        normalization="RMSNorm",
        norm_epsilon=cfg.rms_norm_eps,
        activation="swiglu",
        position_embedding_type="rope",
        rotary_base=float(theta),
        add_bias_linear=attention_bias,
        untie_embeddings_and_output_weights=not getattr(cfg, "tie_word_embeddings", False),
    )


def _gpt2_config(cfg: Any) -> TransformerConfig:
    _refuse(cfg.activation_function not in _TANH_GELUS,
            f"activation_function {cfg.activation_function!r}: megatron_pp's GELU is the tanh approximation "
            f"({', '.join(_TANH_GELUS)})")
    _refuse(getattr(cfg, "scale_attn_by_inverse_layer_idx", False), "scale_attn_by_inverse_layer_idx is not supported")
    _refuse(not getattr(cfg, "scale_attn_weights", True), "scale_attn_weights false is not supported")
    _refuse(not getattr(cfg, "tie_word_embeddings", True), "an untied GPT-2 output layer is not supported")
    _refuse(cfg.n_embd % cfg.n_head != 0, f"n_embd {cfg.n_embd} is not divisible by n_head {cfg.n_head}")
    return TransformerConfig(
        num_layers=cfg.n_layer,
        hidden_size=cfg.n_embd,
        num_attention_heads=cfg.n_head,
        ffn_hidden_size=cfg.n_inner,  # None means 4 * n_embd in both
        vocab_size=cfg.vocab_size,
        seq_length=cfg.n_positions,
        max_position_embeddings=cfg.n_positions,
        normalization="LayerNorm",
        norm_epsilon=cfg.layer_norm_epsilon,
        activation="gelu",
        position_embedding_type="learned_absolute",
        add_bias_linear=True,
        untie_embeddings_and_output_weights=False,
    )


def hf_architecture(config: TransformerConfig) -> str:
    """`LLAMA` or `GPT2`: the Hugging Face architecture that computes exactly what `config` does.

    Raises ValueError listing what keeps `config` from each architecture when neither fits.
    """
    llama = {
        "normalization": "RMSNorm",
        "activation": "swiglu",
        "position_embedding_type": "rope",
    }
    gpt2 = {
        "normalization": "LayerNorm",
        "activation": "gelu",
        "position_embedding_type": "learned_absolute",
        "add_bias_linear": True,
        "untie_embeddings_and_output_weights": False,
    }
    reasons = {}
    for name, wanted in ((LLAMA, llama), (GPT2, gpt2)):
        misses = [f"{key}={getattr(config, key)!r} (needs {value!r})" for key, value in wanted.items()
                  if getattr(config, key) != value]
        if config.rotary_percent != 1.0 and config.position_embedding_type == "rope":
            misses.append(f"rotary_percent={config.rotary_percent} (rotates the whole head)")
        if name == GPT2:
            if config.query_groups != config.num_attention_heads:
                misses.append(f"num_query_groups={config.query_groups} (GPT-2 has no grouped-query attention)")
            if config.head_dim * config.num_attention_heads != config.hidden_size:
                misses.append(f"kv_channels={config.head_dim} (GPT-2 needs hidden_size / num_attention_heads)")
        if not misses:
            return name
        reasons[name] = ", ".join(misses)
    raise ValueError("no Hugging Face architecture computes this model: " +
                     "; ".join(f"{name}: {why}" for name, why in reasons.items()))


def hf_config_from(config: TransformerConfig, base: Optional[dict] = None, dtype: Optional[torch.dtype] = None,
                   attn_implementation: Optional[str] = None) -> Any:
    """The `transformers` config object (`LlamaConfig` or `GPT2Config`) of `config`.

    `base` is the config.json the model was imported from, if known: its token ids are kept, since our
    config does not model them. Without it, default token ids outside the vocabulary are dropped.
    `attn_implementation` ("eager", "sdpa", "flash_attention_2") goes to the constructor, the one place
    transformers reads it: set on the object afterwards it is ignored.
    """
    from transformers import GPT2Config, LlamaConfig

    architecture = hf_architecture(config)
    chosen = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    if architecture == LLAMA:
        hf = LlamaConfig(
            **chosen,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.ffn_size,
            num_hidden_layers=config.num_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.query_groups,
            head_dim=config.head_dim,
            max_position_embeddings=config.num_positions,
            rms_norm_eps=config.norm_epsilon,
            rope_theta=config.rotary_base,
            attention_bias=config.add_bias_linear,
            mlp_bias=config.add_bias_linear,
            tie_word_embeddings=not config.untie_embeddings_and_output_weights,
            hidden_act="silu",
            architectures=["LlamaForCausalLM"],
        )
    else:
        hf = GPT2Config(
            **chosen,
            vocab_size=config.vocab_size,
            n_positions=config.num_positions,
            n_embd=config.hidden_size,
            n_layer=config.num_layers,
            n_head=config.num_attention_heads,
            n_inner=None if config.ffn_size == 4 * config.hidden_size else config.ffn_size,
            activation_function="gelu_new",
            layer_norm_epsilon=config.norm_epsilon,
            tie_word_embeddings=True,
            architectures=["GPT2LMHeadModel"],
        )
    for field in _CARRIED_HF_FIELDS:
        if base is not None and field in base:
            setattr(hf, field, base[field])
        elif isinstance(getattr(hf, field, None), int) and not 0 <= getattr(hf, field) < config.vocab_size:
            setattr(hf, field, None)
    if dtype is not None:
        hf.dtype = dtype
    return hf


# Parameters -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorMap:
    """One megatron_pp parameter (full, unsharded) and the Hugging Face tensors it is made of.

    `kind` says how they relate:
      same        one HF tensor, identical
      conv1d      one HF tensor, transposed (GPT-2's Conv1D keeps `[in, out]`)
      qkv         HF (q, k, v) weights or biases -> our grouped rows
      qkv_fused   one GPT-2 `c_attn` bias `[q | k | v]` -> our grouped rows
      qkv_conv1d  one GPT-2 `c_attn` weight `[in, q | k | v]` -> transposed, then grouped
      gate_up     HF (gate, up) -> our `[gate; up]`
      scale_1p    one HF norm scale s -> our zero-centred weight s - 1 (--apply-layernorm-1p; HF applies s)
    """

    name: str
    hf_names: tuple[str, ...]
    kind: str
    hf_fields: tuple[str, ...]
    """config.json fields that fix the shapes, named in errors about a tensor of the wrong shape."""

    def to_ours(self, hf_tensors: Sequence[torch.Tensor], config: TransformerConfig) -> torch.Tensor:
        if self.kind == "same":
            return hf_tensors[0]
        if self.kind == "conv1d":
            return hf_tensors[0].t()
        if self.kind == "qkv":
            return qkv_to_grouped(*hf_tensors, config)
        if self.kind in ("qkv_fused", "qkv_conv1d"):
            fused = hf_tensors[0].t() if self.kind == "qkv_conv1d" else hf_tensors[0]
            return qkv_to_grouped(*_split_rows(fused, _qkv_sizes(config)), config)
        if self.kind == "gate_up":
            return torch.cat(tuple(hf_tensors), dim=0)
        if self.kind == "scale_1p":
            return hf_tensors[0] - 1
        raise AssertionError(self.kind)

    def to_hf(self, tensor: torch.Tensor, config: TransformerConfig) -> list[torch.Tensor]:
        if self.kind == "same":
            return [tensor]
        if self.kind == "conv1d":
            return [tensor.t()]
        if self.kind == "qkv":
            return list(grouped_to_qkv(tensor, config))
        if self.kind in ("qkv_fused", "qkv_conv1d"):
            fused = torch.cat(grouped_to_qkv(tensor, config), dim=0)
            return [fused.t() if self.kind == "qkv_conv1d" else fused]
        if self.kind == "gate_up":
            return list(tensor.chunk(2, dim=0))
        if self.kind == "scale_1p":
            return [tensor + 1]
        raise AssertionError(self.kind)


def tensor_maps(config: TransformerConfig) -> list[TensorMap]:
    """Every megatron_pp parameter of the whole model with its Hugging Face tensors, in model order."""
    maps = _llama_maps(config) if hf_architecture(config) == LLAMA else _gpt2_maps(config)
    if config.apply_layernorm_1p:  # HF stores the scale itself: ours is the scale minus one
        maps = [dataclasses.replace(m, kind="scale_1p") if m.name.endswith("layernorm.weight") else m for m in maps]
    return maps


_LLAMA_ATTENTION = ("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size")
_LLAMA_MLP = ("intermediate_size", "hidden_size")
_LLAMA_VOCAB = ("vocab_size", "hidden_size")


def _llama_maps(config: TransformerConfig) -> list[TensorMap]:
    biases = ("weight", "bias") if config.add_bias_linear else ("weight",)
    maps = [TensorMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "same", _LLAMA_VOCAB)]
    for i in range(config.num_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        maps.append(TensorMap(ours + "input_layernorm.weight", (hf + "input_layernorm.weight",), "same",
                              ("hidden_size",)))
        for p in biases:
            maps.append(TensorMap(ours + f"self_attention.linear_qkv.{p}",
                                  tuple(hf + f"self_attn.{x}_proj.{p}" for x in "qkv"), "qkv", _LLAMA_ATTENTION))
        for p in biases:
            maps.append(TensorMap(ours + f"self_attention.linear_proj.{p}", (hf + f"self_attn.o_proj.{p}",), "same",
                                  _LLAMA_ATTENTION))
        maps.append(TensorMap(ours + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",), "same",
                              ("hidden_size",)))
        for p in biases:
            maps.append(TensorMap(ours + f"mlp.linear_fc1.{p}", (hf + f"mlp.gate_proj.{p}", hf + f"mlp.up_proj.{p}"),
                                  "gate_up", _LLAMA_MLP))
        for p in biases:
            maps.append(TensorMap(ours + f"mlp.linear_fc2.{p}", (hf + f"mlp.down_proj.{p}",), "same", _LLAMA_MLP))
    maps.append(TensorMap("final_layernorm.weight", ("model.norm.weight",), "same", ("hidden_size",)))
    if config.untie_embeddings_and_output_weights:
        maps.append(TensorMap("output_layer.weight", ("lm_head.weight",), "same", _LLAMA_VOCAB))
    return maps


_GPT2_ATTENTION = ("n_head", "n_embd")
_GPT2_MLP = ("n_inner", "n_embd")


def _gpt2_maps(config: TransformerConfig) -> list[TensorMap]:
    maps = [
        TensorMap("embedding.word_embeddings.weight", ("transformer.wte.weight",), "same", ("vocab_size", "n_embd")),
        TensorMap("embedding.position_embeddings.weight", ("transformer.wpe.weight",), "same",
                  ("n_positions", "n_embd")),
    ]
    for i in range(config.num_layers):
        ours, hf = f"layers.{i}.", f"transformer.h.{i}."
        for p in ("weight", "bias"):
            maps.append(TensorMap(ours + f"input_layernorm.{p}", (hf + f"ln_1.{p}",), "same", ("n_embd",)))
        maps += [
            TensorMap(ours + "self_attention.linear_qkv.weight", (hf + "attn.c_attn.weight",), "qkv_conv1d",
                      _GPT2_ATTENTION),
            TensorMap(ours + "self_attention.linear_qkv.bias", (hf + "attn.c_attn.bias",), "qkv_fused",
                      _GPT2_ATTENTION),
            TensorMap(ours + "self_attention.linear_proj.weight", (hf + "attn.c_proj.weight",), "conv1d",
                      _GPT2_ATTENTION),
            TensorMap(ours + "self_attention.linear_proj.bias", (hf + "attn.c_proj.bias",), "same", _GPT2_ATTENTION),
        ]
        for p in ("weight", "bias"):
            maps.append(TensorMap(ours + f"pre_mlp_layernorm.{p}", (hf + f"ln_2.{p}",), "same", ("n_embd",)))
        maps += [
            TensorMap(ours + "mlp.linear_fc1.weight", (hf + "mlp.c_fc.weight",), "conv1d", _GPT2_MLP),
            TensorMap(ours + "mlp.linear_fc1.bias", (hf + "mlp.c_fc.bias",), "same", _GPT2_MLP),
            TensorMap(ours + "mlp.linear_fc2.weight", (hf + "mlp.c_proj.weight",), "conv1d", _GPT2_MLP),
            TensorMap(ours + "mlp.linear_fc2.bias", (hf + "mlp.c_proj.bias",), "same", _GPT2_MLP),
        ]
    for p in ("weight", "bias"):
        maps.append(TensorMap(f"final_layernorm.{p}", (f"transformer.ln_f.{p}",), "same", ("n_embd",)))
    return maps


def canonical_hf_name(name: str, config: TransformerConfig) -> str:
    """The name `tensor_maps` uses for a tensor stored as `name`.

    GPT-2 files saved from the bare `GPT2Model` (the original OpenAI release among them) lack the
    `transformer.` prefix that `GPT2LMHeadModel` adds.
    """
    if hf_architecture(config) == GPT2 and name.split(".", 1)[0] in ("h", "wte", "wpe", "ln_f"):
        return "transformer." + name
    return name


def is_ignored_hf_name(name: str, config: TransformerConfig) -> bool:
    """True for tensors of a Hugging Face file that hold no weight of ours: recomputed buffers, and the
    `lm_head.weight` copy some files keep of a tied embedding."""
    if name.endswith(_IGNORED_HF_SUFFIXES):
        return True
    return name == "lm_head.weight" and not config.untie_embeddings_and_output_weights


# Layout helpers ---------------------------------------------------------------------------------------


def _qkv_sizes(config: TransformerConfig) -> list[int]:
    d = config.head_dim
    return [config.num_attention_heads * d, config.query_groups * d, config.query_groups * d]


def _split_rows(tensor: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    if tensor.shape[0] != sum(sizes):
        raise ValueError(f"a fused QKV tensor of shape {tuple(tensor.shape)} does not have {sum(sizes)} rows")
    return tuple(tensor.split(sizes, dim=0))


def qkv_to_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    """Separate q, k, v rows (weights `[rows, h]` or biases `[rows]`) -> our fused rows grouped per query group."""
    groups, d = config.query_groups, config.head_dim
    per_group = config.num_attention_heads // groups
    rest = q.shape[1:]
    return torch.cat(
        (q.reshape(groups, per_group, d, *rest), k.reshape(groups, 1, d, *rest), v.reshape(groups, 1, d, *rest)),
        dim=1,
    ).reshape(-1, *rest)


def grouped_to_qkv(fused: torch.Tensor, config: TransformerConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `qkv_to_grouped`: our fused grouped rows -> (q, k, v) rows in head order."""
    groups, d = config.query_groups, config.head_dim
    per_group = config.num_attention_heads // groups
    rest = fused.shape[1:]
    grouped = fused.reshape(groups, per_group + 2, d, *rest)
    return (grouped[:, :per_group].reshape(-1, *rest), grouped[:, per_group].reshape(-1, *rest),
            grouped[:, per_group + 1].reshape(-1, *rest))


def rotary_interleaved_to_half(fused_qkv: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    """Reorder the q and k rows of a grouped QKV weight or bias from interleaved RoPE pairs to rotate-half.

    Interleaved RoPE rotates the pair (x_{2i}, x_{2i+1}) of each head by angle_i; ours rotates
    (x_i, x_{i+d/2}). Moving row 2i of every q and k head to position i and row 2i+1 to i + d/2 makes our
    rotation act on the same pairs with the same angles, and since q and k are permuted alike, every
    attention score is unchanged. Value rows are not rotated and stay as they are. Example, d = 4:
    rows (0, 1, 2, 3) become (0, 2, 1, 3).
    """
    groups, d = config.query_groups, config.head_dim
    per_group = config.num_attention_heads // groups
    rest = fused_qkv.shape[1:]
    grouped = fused_qkv.reshape(groups, per_group + 2, d, *rest)
    rotated = grouped[:, : per_group + 1].reshape(groups, per_group + 1, d // 2, 2, *rest).transpose(2, 3)
    rotated = rotated.reshape(groups, per_group + 1, d, *rest)
    return torch.cat((rotated, grouped[:, per_group + 1:]), dim=1).reshape(fused_qkv.shape)


def resize_vocab_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """`tensor` with exactly `rows` rows: padding rows dropped, or zero rows appended."""
    have = tensor.shape[0]
    if have >= rows:
        return tensor[:rows]
    return torch.cat((tensor, tensor.new_zeros((rows - have, *tensor.shape[1:]))), dim=0)
