"""Activation-memory formulas against the bytes `ActivationStore` measures on CPU, and worked numbers.

On CPU in fp32 (`CPU_FP32`) the formulas mirror the model's saved tensors one by one, so they agree with
the measurement to the byte except for the data loader's token-id tensor: for b = 1 `MockData` hands the
model a `[1, s]` view of its `s + 1` sampled ids, so 8 bytes more storage stay alive than the formula's
`8·s·b`. The tolerance below (0.1%) covers that and nothing else; the observed error is at most 8 bytes.
"""
import dataclasses

import pytest
import torch

from megatron_pp.core.tensor_parallel.random import model_parallel_seed
from megatron_pp.data.mock import MockData
from megatron_pp.models.layout import split_layers
from megatron_pp.models.presets import get_preset
from megatron_pp.models.recompute import RecomputeConfig
from megatron_pp.models.transformer import StageModel
from megatron_pp.planning.memory import (CPU_FP32, MEGATRON_BF16, attention_kind, layer_activation_bytes,
                                         layer_activation_terms, stage_parameters_per_gpu, stash_bytes,
                                         state_bytes_per_parameter, transient_activation_bytes)
from megatron_pp.schedules.store import ActivationStore
from tests.dist import run_distributed

SEED = 1
TOLERANCE = 1e-3


def _config(preset, backend, dropout, **changes):
    return dataclasses.replace(get_preset(preset), attention_backend=backend, hidden_dropout=dropout,
                               attention_dropout=dropout, **changes)


def _stage_specs(config):
    """First (embedding), middle (layers only) and last (head) stage of a 2-way split."""
    first, last = split_layers(config.num_layers, 2)
    return {"first": first, "middle": dataclasses.replace(first, has_embedding=False), "last": last}


def _measure(config, spec, b, tp_group=None, sequence_parallel=False, recompute=None):
    """Bytes one microbatch's forward saves for backward on this stage, as the executor's store counts."""
    extra = {} if recompute is None else {"recompute": recompute}
    model = StageModel(config, spec, seed=SEED, tp_group=tp_group, sequence_parallel=sequence_parallel, **extra)
    model.train()
    store = ActivationStore(list(model.parameters()) + list(model.buffers()))
    batch = MockData(SEED, config.seq_length, config.vocab_size, b, b).microbatch(0, 0, 0)
    x = None
    if not spec.has_embedding:
        rows = config.seq_length // (2 if sequence_parallel else 1)
        x = torch.randn(rows, b, config.hidden_size, requires_grad=True)
    with store.stash(0):
        y = model(x, batch)
        if spec.has_head:  # what the executor adds on the last stage
            (y.float() * batch["loss_mask"]).sum()
    return store.live_bytes


CASES = [  # (preset, backend, dropout): sdpa on CPU is the flash formula only without dropout
    ("gpt-tiny", "reference", 0.0), ("gpt-tiny", "reference", 0.1), ("gpt-tiny", "sdpa", 0.0),
    ("llama-tiny", "reference", 0.0), ("llama-tiny", "reference", 0.1), ("llama-tiny", "sdpa", 0.0),
]


@pytest.mark.parametrize("preset,backend,dropout", CASES)
@pytest.mark.parametrize("b", [1, 3])
def test_stash_formula_matches_measured_cpu_bytes(preset, backend, dropout, b):
    model_parallel_seed(SEED, 0, 0)
    config = _config(preset, backend, dropout)
    kind = attention_kind(backend, "cpu", dropout)
    for where, spec in _stage_specs(config).items():
        measured = _measure(config, spec, b)
        predicted = stash_bytes(config, spec, b, attention=kind, numerics=CPU_FP32)
        assert abs(predicted - measured) <= TOLERANCE * measured, (where, predicted, measured)
        assert measured - predicted in (0, 8 if spec.has_embedding and b == 1 else 0), (where, predicted, measured)


def test_backend_mapping_and_the_s_squared_term():
    """reference = unfused (keeps b·a·s² probabilities), sdpa = flash (keeps b·a·s fp32 log-sum-exp)."""
    assert attention_kind("reference", "cpu") == "unfused"
    assert attention_kind("sdpa", "cpu") == "flash" and attention_kind("sdpa", "cuda", 0.1) == "flash"
    with pytest.raises(ValueError, match="math fallback"):
        attention_kind("sdpa", "cpu", 0.1)
    model_parallel_seed(SEED, 0, 0)
    # Quadrupling s multiplies the unfused extra by 16 per sequence-token product: measured, not assumed.
    short, long = (_config("gpt-tiny", "reference", 0.0, seq_length=s, max_position_embeddings=s) for s in (16, 64))
    spec = _stage_specs(short)["middle"]
    sdpa_short = dataclasses.replace(short, attention_backend="sdpa")
    sdpa_long = dataclasses.replace(long, attention_backend="sdpa")
    extra_short = _measure(short, spec, 2) - _measure(sdpa_short, spec, 2)
    extra_long = _measure(long, spec, 2) - _measure(sdpa_long, spec, 2)
    # per layer: b·a·s²·4 (probabilities) + s² (bool causal mask) - b·a·s·4 (flash's log-sum-exp)
    per_layer = lambda s: 2 * 4 * s * s * 4 + s * s - 2 * 4 * s * 4  # noqa: E731
    assert extra_short == 2 * per_layer(16) and extra_long == 2 * per_layer(64)


@pytest.mark.parametrize("preset,backend,dropout", CASES)
def test_recompute_formulas_match_measured_cpu_bytes(preset, backend, dropout):
    """Full (uniform, one layer per checkpoint): each layer keeps its input. Selective: the attention
    core keeps q, k, v unexpanded and nothing of its own (not even flash's log-sum-exp)."""
    model_parallel_seed(SEED, 0, 0)
    config = _config(preset, backend, dropout)
    kind = attention_kind(backend, "cpu", dropout)
    settings = {"full": RecomputeConfig("full", "uniform", 1), "selective": RecomputeConfig("selective")}
    for recompute, setting in settings.items():
        for where, spec in _stage_specs(config).items():
            measured = _measure(config, spec, 2, recompute=setting)
            predicted = stash_bytes(config, spec, 2, attention=kind, recompute=recompute, numerics=CPU_FP32)
            assert predicted == measured, (recompute, where, predicted, measured)


def _tp_stashes(ctx, preset):
    group = ctx.parallel_state(tp=2).tp_group
    model_parallel_seed(SEED, ctx.rank, 0)
    config = _config(preset, "reference", 0.1)
    out = {}
    for sp in (False, True):
        for where, spec in _stage_specs(config).items():
            out[(sp, where)] = _measure(config, spec, 2, tp_group=group, sequence_parallel=sp)
    return out


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny"])
def test_tensor_and_sequence_parallel_division(preset):
    """tp = 2 on a 2-process gloo world, with and without sequence parallelism, every stage kind."""
    results = run_distributed(2, _tp_stashes, preset)
    config = _config(preset, "reference", 0.1)
    for (sp, where), measured in results[0].items():
        assert results[1][(sp, where)] == measured  # both ranks hold the same amount
        spec = _stage_specs(config)[where]
        predicted = stash_bytes(config, spec, 2, tp=2, sequence_parallel=sp, attention="unfused", numerics=CPU_FP32)
        assert predicted == measured, (sp, where, predicted, measured)


def test_korthikanti_gpt3_numbers():
    """GPT-3 175B in bf16 with dropout: s·b·h·(34 + 5·a·s/h) plus 16 bytes per token of norm statistics
    (Korthikanti et al. 2022, eq. 1 and its tp / sequence-parallel forms)."""
    config = dataclasses.replace(get_preset("gpt3-175b"), hidden_dropout=0.1, attention_dropout=0.1)
    s, h, a = 2048, 12288, 96
    sbh = s * h
    stats = 2 * 2 * 4 * s
    got = layer_activation_bytes(config, 1, attention="unfused")
    assert got == sbh * 34 + 5 * a * s * s + stats
    # tp = 8 without SP: sbh (10 + 24/t + 5as/(ht)); with SP everything / t.
    assert layer_activation_bytes(config, 1, tp=8, attention="unfused") == (
        sbh * 10 + sbh * 24 // 8 + 5 * a * s * s // 8 + stats)
    assert layer_activation_bytes(config, 1, tp=8, sequence_parallel=True, attention="unfused") == (
        (sbh * 34 + 5 * a * s * s + stats) // 8)
    # Selective recompute and flash both remove the 5as²b term (flash keeps its fp32 log-sum-exp).
    assert layer_activation_bytes(config, 1, attention="unfused", recompute="selective") == sbh * 34 + stats
    assert transient_activation_bytes(config, 1, attention="unfused", recompute="selective") == 5 * a * s * s
    assert layer_activation_bytes(config, 1, attention="flash") == sbh * 34 + stats + a * s * 4
    # Full recompute: the layer input only, 2sbh; rebuilding one layer is transient.
    assert layer_activation_bytes(config, 1, attention="unfused", recompute="full") == 2 * sbh
    assert transient_activation_bytes(config, 1, attention="unfused", recompute="full") == (
        sbh * 34 + 5 * a * s * s + stats)
    terms = layer_activation_terms(config, 1, attention="unfused", numerics=MEGATRON_BF16)
    assert terms["core dropout mask"] == a * s * s and terms["mlp"] == 16 * sbh


def test_parameters_and_optimizer_state():
    config = get_preset("gpt3-175b")
    specs = split_layers(config.num_layers, 8)
    per_gpu = sum(stage_parameters_per_gpu(config, spec, 8) for spec in specs)
    # Replicated norms, row biases and the position table are held by every TP rank, the tied embedding
    # twice (first and last stage): per-GPU totals x 8 exceed the unique count by exactly that.
    replicated = config.num_layers * 6 * 12288 + 2 * 12288 + 2048 * 12288
    tied_copy = config.padded_vocab_size(8) * 12288
    assert per_gpu * 8 == config.num_parameters(8) + 7 * replicated + tied_copy
    assert state_bytes_per_parameter() == 18 and state_bytes_per_parameter(dp=4, distributed_optimizer=True) == 9
    assert state_bytes_per_parameter(bf16=False) == 16
