"""megatron_pp.models.hf without files: config mapping both ways and its refusals, tensor layouts (QKV
grouping, SwiGLU, Conv1D, vocabulary padding) against `transformers` models, and the RoPE permutation."""
import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from megatron_pp.models.hf import (  # noqa: E402
    VOCAB_PARAMETERS,
    config_from_hf,
    grouped_to_qkv,
    hf_architecture,
    hf_config_from,
    is_ignored_hf_name,
    qkv_to_grouped,
    resize_vocab_rows,
    rotary_interleaved_to_half,
    tensor_maps,
)
from megatron_pp.models.layout import split_layers  # noqa: E402
from megatron_pp.models.presets import get_preset  # noqa: E402
from megatron_pp.models.ops import apply_rotary, rotary_cos_sin  # noqa: E402
from megatron_pp.models.transformer import StageModel, build_model

SEED = 99
CONFIGS = {
    "llama-gqa": dataclasses.replace(get_preset("llama-tiny"), rotary_base=500000.0, vocab_size=500),
    "llama-tied-bias-kv": dataclasses.replace(get_preset("llama-tiny"), untie_embeddings_and_output_weights=False,
                                              add_bias_linear=True, kv_channels=16, num_query_groups=2),
    "llama-mha": dataclasses.replace(get_preset("llama-tiny"), num_query_groups=None),
    "gpt2": get_preset("gpt-tiny"),
    "gpt2-ffn-vocab": dataclasses.replace(get_preset("gpt-tiny"), ffn_hidden_size=96, vocab_size=300),
}


def hf_model(config):
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    hf_config = hf_config_from(config)
    hf_config.attn_implementation = "eager"
    cls = LlamaForCausalLM if hf_architecture(config) == "llama" else GPT2LMHeadModel
    for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
        setattr(hf_config, name, 0.0)
    return cls(hf_config).eval()


def ours_into_hf(config, ours, hf):
    """Load our model's full weights into `hf` through the package's mapping (vocabulary unpadded)."""
    params = dict(ours.named_parameters())
    state = {}
    for tensor_map in tensor_maps(config):
        tensor = params[tensor_map.name].detach()
        if tensor_map.name in VOCAB_PARAMETERS:
            tensor = resize_vocab_rows(tensor, config.vocab_size)
        state.update(zip(tensor_map.hf_names, (t.clone() for t in tensor_map.to_hf(tensor, config))))
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected
    assert all(is_ignored_hf_name(name, config) for name in missing), missing


def our_logits(model, tokens):
    """Logits `[b, s, V]` of the single-stage model (the head computed by hand: the model returns losses)."""
    captured = {}
    handle = model.final_layernorm.register_forward_hook(lambda m, i, out: captured.setdefault("h", out))
    labels = torch.zeros_like(tokens)
    with torch.no_grad():
        model(None, {"tokens": tokens, "labels": labels})
    handle.remove()
    weight = model.output_layer.weight if model.output_layer is not None else model.embedding.word_embeddings.weight
    return F.linear(captured["h"], weight).transpose(0, 1)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_round_trip(name):
    config = CONFIGS[name]
    hf_config = hf_config_from(config)
    assert config_from_hf(hf_config) == config
    assert hf_config.architectures == ["LlamaForCausalLM" if name.startswith("llama") else "GPT2LMHeadModel"]


def test_llama_config_values():
    hf = hf_config_from(CONFIGS["llama-gqa"])
    assert (hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim, hf.intermediate_size) == (8, 4, 8, 176)
    assert hf.tie_word_embeddings is False and hf.vocab_size == 500
    rope = getattr(hf, "rope_parameters", None) or {"rope_theta": hf.rope_theta}
    assert rope["rope_theta"] == 500000.0
    # Default token ids outside the vocabulary are dropped; a source config's ids are kept.
    assert hf_config_from(dataclasses.replace(CONFIGS["gpt2"], vocab_size=100)).eos_token_id is None
    assert hf_config_from(CONFIGS["gpt2"], base={"eos_token_id": 7, "bos_token_id": 5}).eos_token_id == 7


BAD_HF = [
    ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "RoPE scaling 'llama3'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "RoPE scaling 'linear'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"attention_bias": True, "mlp_bias": False}, "attention_bias True and mlp_bias False differ"),
    ({"num_key_value_heads": 3}, "num_attention_heads 8 is not divisible by num_key_value_heads 3"),
]


@pytest.mark.parametrize("change,needle", BAD_HF, ids=[b[1][:24] for b in BAD_HF])
def test_unsupported_llama_configs_are_refused(change, needle):
    values = hf_config_from(CONFIGS["llama-gqa"]).to_dict()
    values.update(change)
    with pytest.raises(ValueError, match="config.json: " + needle.replace("(", r"\(")):
        config_from_hf(SimpleNamespace(**values))


@pytest.mark.parametrize("change,needle", [
    ({"activation_function": "gelu"}, "activation_function 'gelu'"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({"tie_word_embeddings": False}, "untied GPT-2 output layer"),
])
def test_unsupported_gpt2_configs_are_refused(change, needle):
    values = hf_config_from(CONFIGS["gpt2"]).to_dict()
    values.update(change)
    with pytest.raises(ValueError, match=needle):
        config_from_hf(SimpleNamespace(**values))


def test_model_without_hf_architecture_is_refused():
    config = dataclasses.replace(get_preset("gpt-tiny"), activation="swiglu")
    with pytest.raises(ValueError) as err:
        hf_architecture(config)
    message = str(err.value)
    assert "llama: normalization='LayerNorm' (needs 'RMSNorm')" in message
    assert "gpt2: activation='swiglu' (needs 'gelu')" in message


def test_qkv_grouping_worked_example():
    # 4 query heads in 2 groups, head_dim 1: rows named by value.
    config = dataclasses.replace(get_preset("llama-tiny"), hidden_size=4, num_attention_heads=4, num_query_groups=2)
    q, k, v = torch.tensor([0.0, 1, 2, 3]), torch.tensor([10.0, 11]), torch.tensor([20.0, 21])
    grouped = qkv_to_grouped(q, k, v, config)
    assert grouped.tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert [t.tolist() for t in grouped_to_qkv(grouped, config)] == [q.tolist(), k.tolist(), v.tolist()]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tensor_maps_cover_the_hf_model_and_round_trip_exactly(name):
    config = CONFIGS[name]
    hf = hf_model(config)
    hf_state = hf.state_dict()
    maps = tensor_maps(config)
    mapped = [n for m in maps for n in m.hf_names]
    assert len(mapped) == len(set(mapped))
    assert set(mapped) == {n for n in hf_state if not is_ignored_hf_name(n, config)}
    # Every parameter of ours, in model order.
    ours = [n for n, _ in StageModel(config, split_layers(config.num_layers, 1)[0], device=torch.device("meta"))
            .named_parameters()]
    assert [m.name for m in maps] == ours
    for tensor_map in maps:
        originals = [torch.randn(hf_state[n].shape) for n in tensor_map.hf_names]
        back = tensor_map.to_hf(tensor_map.to_ours(originals, config), config)
        assert all(torch.equal(a, b) for a, b in zip(originals, back)), tensor_map.name


@pytest.mark.parametrize("name", ["llama-gqa", "llama-tied-bias-kv", "gpt2", "gpt2-ffn-vocab"])
def test_mapped_weights_give_transformers_logits(name):
    config = CONFIGS[name]
    ours = build_model(config, SEED)
    if config.add_bias_linear:  # zero-initialised biases would not test their mapping
        with torch.no_grad():
            for param_name, param in ours.named_parameters():
                if param_name.endswith(".bias"):
                    param.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(len(param_name)))
    hf = hf_model(config)
    ours_into_hf(config, ours, hf)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_length), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf(tokens).logits
    logits = our_logits(ours, tokens)
    assert logits.shape[-1] == config.padded_vocab_size() >= config.vocab_size
    torch.testing.assert_close(logits[..., : config.vocab_size], expected, rtol=1e-5, atol=1e-5)


def _interleaved_rotary(x, positions, base):
    """RoPE rotating adjacent pairs (x_{2i}, x_{2i+1}) (Meta's original LLaMA, Megatron --rotary-interleaved)."""
    d = x.shape[-1]
    angles = positions[:, None].float() * base ** (-torch.arange(0, d, 2).float() / d)  # [s, d/2]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)


def test_rotary_interleaved_to_half_keeps_attention_scores():
    config = dataclasses.replace(get_preset("llama-tiny"), num_query_groups=2)
    d, heads, groups, s = config.head_dim, config.num_attention_heads, config.query_groups, 6
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(config.qkv_size, config.hidden_size, dtype=torch.float64, generator=g)
    x = torch.randn(s, config.hidden_size, dtype=torch.float64, generator=g)
    positions = torch.arange(s)

    def scores(w, rotate):
        q, k, _ = (t.view(s, -1, d) for t in (F.linear(x, p) for p in grouped_to_qkv(w, config)))
        q, k = rotate(q), rotate(k)
        k = k.repeat_interleave(heads // groups, dim=1)
        return torch.einsum("qhd,khd->hqk", q, k)

    def half(t):
        cos, sin = rotary_cos_sin(positions[None], d, config.rotary_base)
        return apply_rotary(t[:, None].float(), (cos, sin))[:, 0].double()

    expected = scores(weight, lambda t: _interleaved_rotary(t, positions, config.rotary_base))
    permuted = rotary_interleaved_to_half(weight, config)
    # `half` rotates in fp32 (as the model does), the interleaved reference in fp64: fp32-level tolerance.
    torch.testing.assert_close(scores(permuted, half), expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(scores(weight, half), expected, atol=1e-3)  # the permutation is needed
    # Value rows are untouched; q and k rows of each head go (0, 2, 4, ..., 1, 3, 5, ...).
    _, _, v0 = grouped_to_qkv(weight, config)
    q1, k1, v1 = grouped_to_qkv(permuted, config)
    q0, k0, _ = grouped_to_qkv(weight, config)
    assert torch.equal(v0, v1)
    order = list(range(0, d, 2)) + list(range(1, d, 2))
    assert torch.equal(q1[:d], q0[order]) and torch.equal(k1[d:2 * d], k0[[d + i for i in order]])


def test_resize_vocab_rows():
    table = torch.arange(6.0).view(3, 2)
    assert resize_vocab_rows(table, 2).tolist() == [[0, 1], [2, 3]]
    assert resize_vocab_rows(table, 5).tolist() == [[0, 1], [2, 3], [4, 5], [0, 0], [0, 0]]
