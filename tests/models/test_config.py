"""TransformerConfig: closed-form parameter counts against published sizes and built models, vocabulary
padding, validation messages, and the preset registry."""
import dataclasses

import pytest

from megatron_pp.core.parallel_state import LayoutError
from megatron_pp.models.config import TransformerConfig
from megatron_pp.models.presets import get_preset, llama_ffn_hidden_size, preset_names
from megatron_pp.models.transformer import build_model

PUBLISHED = {
    "gpt3-125m": 125e6,
    "gpt3-350m": 350e6,
    "gpt3-760m": 760e6,
    "gpt3-1.3b": 1.3e9,
    "gpt3-2.7b": 2.7e9,
    "gpt3-6.7b": 6.7e9,
    "gpt3-13b": 13.0e9,
    "gpt3-175b": 175.0e9,
    "llama2-7b": 6.74e9,
    "llama2-13b": 13.0e9,
    "llama2-70b": 68.98e9,
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.6e9,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_matches_published_size(name):
    count = get_preset(name).num_parameters()
    assert abs(count - PUBLISHED[name]) / PUBLISHED[name] < 0.02, f"{name}: {count / 1e9:.3f}B"


def test_parameter_counts_golden():
    # Exact closed-form values (vocabulary padded to 128), so a changed formula shows as a diff.
    assert get_preset("gpt3-125m").num_parameters() == 125_262_336
    assert get_preset("gpt3-175b").num_parameters() == 174_604_836_864
    assert get_preset("llama2-7b").num_parameters() == 6_738_415_616
    assert get_preset("llama2-70b").num_parameters() == 68_976_648_192
    assert get_preset("llama3-8b").num_parameters() == 8_030_261_248


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_tiny_parameter_count_equals_built_model(name):
    config = get_preset(name)
    model = build_model(config, seed=0)
    assert sum(p.numel() for p in model.parameters()) == config.num_parameters()


def test_llama_ffn_rule_reproduces_published_sizes():
    assert llama_ffn_hidden_size(4096, 256) == 11008
    assert llama_ffn_hidden_size(5120, 256) == 13824
    assert llama_ffn_hidden_size(8192, 4096, 1.3) == 28672
    assert llama_ffn_hidden_size(4096, 1024, 1.3) == 14336
    expected = {"llama2-7b": 11008, "llama2-13b": 13824, "llama2-70b": 28672, "llama3-8b": 14336, "llama3-70b": 28672}
    for name, ffn in expected.items():
        assert get_preset(name).ffn_hidden_size == ffn


def test_preset_shapes():
    gpt13 = get_preset("gpt3-1.3b")
    assert (gpt13.hidden_size, gpt13.num_attention_heads, gpt13.head_dim) == (2048, 16, 128)
    assert get_preset("gpt3-13b").hidden_size == 5120
    shape = lambda c: (c.query_groups, c.rotary_base, c.vocab_size, c.seq_length)  # noqa: E731
    assert shape(get_preset("llama2-70b")) == (8, 10000.0, 32000, 4096)
    assert shape(get_preset("llama3-8b")) == (8, 500000.0, 128256, 8192)
    assert get_preset("llama2-7b").query_groups == 32  # multi-head attention
    for name in preset_names():
        config = get_preset(name)
        gpt = name.startswith("gpt")
        assert config.add_bias_linear == gpt
        assert config.untie_embeddings_and_output_weights == (not gpt)
        assert config.normalization == ("LayerNorm" if gpt else "RMSNorm")
        config.validate(1)


def test_padded_vocab_size():
    config = get_preset("gpt3-125m")
    assert [config.padded_vocab_size(tp) for tp in (1, 2, 4, 8)] == [50304, 50432, 50688, 51200]
    tiny = get_preset("gpt-tiny")
    assert [tiny.padded_vocab_size(tp) for tp in (1, 2, 4)] == [512, 512, 512]
    # num_parameters counts what a tp-way build allocates.
    assert config.num_parameters(8) - config.num_parameters(1) == (51200 - 50304) * 768


def test_get_preset_returns_a_copy_and_rejects_unknown_names():
    a = get_preset("gpt-tiny")
    a.num_layers = 99
    assert get_preset("gpt-tiny").num_layers == 4
    with pytest.raises(ValueError, match="known presets: .*gpt3-125m.*llama3-70b"):
        get_preset("gpt4")


def test_derived_sizes_follow_replace():
    config = dataclasses.replace(get_preset("gpt-tiny"), hidden_size=128)
    assert (config.ffn_size, config.head_dim, config.query_groups) == (512, 32, 4)


@pytest.mark.parametrize(
    "changes,tp,message",
    [
        ({"num_attention_heads": 12, "hidden_size": 768}, 8,
         "--num-attention-heads 12 is not divisible by --tensor-model-parallel-size 8"),
        ({"num_attention_heads": 8, "num_query_groups": 2}, 4,
         "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4"),
        ({"num_attention_heads": 8, "num_query_groups": 3}, 1,
         "--num-attention-heads 8 is not divisible by --num-query-groups 3"),
        ({"ffn_hidden_size": 175}, 2, "--ffn-hidden-size 175 is not divisible by --tensor-model-parallel-size 2"),
        ({"hidden_size": 66}, 1, "--hidden-size 66 is not divisible by --num-attention-heads 4"),
        ({"normalization": "BatchNorm"}, 1, "--normalization 'BatchNorm' is not one of LayerNorm, RMSNorm"),
        ({"max_position_embeddings": 16}, 1, "--max-position-embeddings 16 is smaller than --seq-length 32"),
        ({"hidden_dropout": 1.0}, 1, r"--hidden-dropout must be in \[0, 1\)"),
    ],
)
def test_validate_names_the_flag(changes, tp, message):
    config = dataclasses.replace(get_preset("gpt-tiny"), **changes)
    with pytest.raises(ValueError, match=message) as info:
        config.validate(tp)
    assert "\n" not in str(info.value)


def test_parallel_errors_are_layout_errors():
    with pytest.raises(LayoutError):
        get_preset("gpt3-125m").validate(8)
    get_preset("llama2-70b").validate(8)
    with pytest.raises(LayoutError, match="--num-query-groups 8 is not divisible by --tensor-model-parallel-size 16"):
        get_preset("llama2-70b").validate(16)


def test_defaults():
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100, seq_length=16)
    assert (config.ffn_size, config.head_dim, config.query_groups, config.num_positions) == (256, 16, 4, 16)
    assert config.padded_vocab_size() == 128
