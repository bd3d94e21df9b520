"""Activation recomputation: identical gradients to keeping activations (bitwise, fp32, with and without
dropout), the bytes the activation store sees shrink as Megatron's methods say they should, and the
same holds under every pipeline schedule with tensor and sequence parallelism (world of 4)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_pp.core.grads import finalize_gradients, unique_parameters
from megatron_pp.core.tensor_parallel import model_parallel_seed
from megatron_pp.data.mock import MockData
from megatron_pp.models.layout import StageSpec
from megatron_pp.models.presets import get_preset
from megatron_pp.models.recompute import RecomputeConfig
from megatron_pp.models.transformer import StageModel, build_model
from megatron_pp.schedules.store import ActivationStore
from tests.core.test_grad_reduce import global_tokens, make_pipeline
from tests.dist import run_distributed

SEED = 21
MICRO_BATCH = 2
NONE = RecomputeConfig()
VARIANTS = {
    "uniform-1": RecomputeConfig("full", "uniform", 1),
    "uniform-3": RecomputeConfig("full", "uniform", 3),  # spans of 3 and 1 layers
    "block-2": RecomputeConfig("full", "block", 2),
    "selective": RecomputeConfig("selective"),
}


def _config(preset: str, dropout: float, layers: int = 4):
    return dataclasses.replace(get_preset(preset), num_layers=layers, hidden_dropout=dropout, attention_dropout=dropout)


def gradients(preset: str, recompute: RecomputeConfig, dropout: float) -> dict[str, torch.Tensor]:
    """Two microbatches' accumulated gradients of the whole model, dropout streams seeded alike."""
    config = _config(preset, dropout)
    model_parallel_seed(SEED, tp_rank=0, pp_rank=0)
    model = build_model(config, seed=SEED)
    model.recompute = recompute
    data = MockData(SEED, config.seq_length, config.vocab_size, MICRO_BATCH, 2 * MICRO_BATCH)
    for batch in data.step_microbatches(0, 0):
        (model(None, batch) * batch["loss_mask"]).sum().backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_recompute_gives_identical_gradients(preset, dropout):
    reference = gradients(preset, NONE, dropout)
    for name, variant in VARIANTS.items():
        grads = gradients(preset, variant, dropout)
        for param, ref in reference.items():
            assert torch.equal(grads[param], ref), f"{name}: gradient of {param} differs"
    if dropout:  # the masks were real: without them the gradients differ
        plain = gradients(preset, NONE, 0.0)
        assert not torch.equal(plain["layers.0.mlp.linear_fc1.weight"], reference["layers.0.mlp.linear_fc1.weight"])


def stash_bytes(recompute: RecomputeConfig, dropout: float = 0.0) -> int:
    """What one microbatch's forward of a middle stage (4 layers, no embedding or head) saves for backward."""
    config = _config("gpt-tiny", dropout, layers=12)
    model = StageModel(config, StageSpec(1, 4, 8, has_embedding=False, has_head=False), seed=SEED, recompute=recompute)
    model_parallel_seed(SEED, tp_rank=0, pp_rank=0)
    store = ActivationStore(list(model.parameters()))
    batch = MockData(SEED, config.seq_length, config.vocab_size, MICRO_BATCH, MICRO_BATCH).microbatch(0, 0, 0)
    x = torch.randn(config.seq_length, MICRO_BATCH, config.hidden_size, requires_grad=True)
    with store.stash(0):
        out = model(x, batch)  # held, as the executor holds a forward's output until its backward
    held = store.live_bytes  # the store counts a saved storage while it lives, so while `out`'s graph does
    del out
    return held


def test_stash_shrinks_to_the_checkpointed_inputs():
    config = get_preset("gpt-tiny")
    layer_input = config.seq_length * MICRO_BATCH * config.hidden_size * 4  # one [s, b, h] fp32 tensor
    full = stash_bytes(NONE)
    assert full % 4 == 0 and full > 8 * layer_input
    per_layer = full // 4
    assert stash_bytes(RecomputeConfig("full", "uniform", 1)) == 4 * layer_input  # each layer's input
    assert stash_bytes(RecomputeConfig("full", "uniform", 2)) == 2 * layer_input  # inputs of layers 0 and 2
    assert stash_bytes(RecomputeConfig("full", "uniform", 8)) == layer_input  # one span: the stage input
    # block 1: layer 0 keeps only its input; layers 1-3 keep everything (their inputs included).
    assert stash_bytes(RecomputeConfig("full", "block", 1)) == layer_input + 3 * per_layer
    assert stash_bytes(RecomputeConfig("full", "block", 5)) == 4 * layer_input  # more than the chunk has: all
    # selective drops at least the attention probabilities, [b, heads, s, s] fp32 per layer.
    probs = MICRO_BATCH * config.num_attention_heads * config.seq_length**2 * 4
    assert stash_bytes(NONE, dropout=0.1) - stash_bytes(RecomputeConfig("selective"), dropout=0.1) >= 4 * probs


@pytest.mark.parametrize("kwargs,flag", [
    (dict(granularity="partial"), "--recompute-granularity"),
    (dict(granularity="full", num_layers=1), "--recompute-method"),
    (dict(granularity="full", method="uniform"), "--recompute-num-layers"),
    (dict(granularity="full", method="block", num_layers=0), "--recompute-num-layers"),
    (dict(granularity="selective", method="uniform"), "apply only to --recompute-granularity full"),
])
def test_recompute_config_rejects_bad_combinations(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        RecomputeConfig(**kwargs)


# Under the pipeline schedules ------------------------------------------------------------------------------

# (name, microbatches, chunks per rank, layers): two layers per chunk, so block 1 differs from uniform 1.
SCHEDULES = [("gpipe", 3, 1, 4), ("1f1b", 4, 1, 4), ("interleaved-1f1b", 4, 2, 8)]
PIPELINE_VARIANTS = {"none": NONE, "uniform-1": VARIANTS["uniform-1"], "block-1": RecomputeConfig("full", "block", 1),
                     "selective": VARIANTS["selective"]}


def recompute_under_schedules(ctx):
    """Per schedule and variant: do the gradients equal those without recompute, and the peak stash."""
    out = {}
    for name, m, v, layers in SCHEDULES:
        reference = None
        for variant, recompute in PIPELINE_VARIANTS.items():
            pipe, data = make_pipeline(ctx, "gpt-tiny", layers, 2, 2, name, m, v, True, hidden_dropout=0.1,
                                       attention_dropout=0.1)
            for chunk in pipe.chunks:
                chunk.recompute = recompute
            model_parallel_seed(SEED, pipe.state.tp_rank, pipe.state.pp_rank)
            mbs = data.step_microbatches(0, pipe.state.dp_rank)
            result = pipe.executor.run(mbs, loss_scale=1.0 / global_tokens(mbs, pipe.state))
            finalize_gradients(pipe.chunks, pipe.state)
            grads = [p.grad.clone() for p in unique_parameters(pipe.chunks)]
            if reference is None:
                reference = grads
            out[(name, variant)] = {"equal": all(torch.equal(a, b) for a, b in zip(grads, reference)),
                                    "peak": result.peak_stash_bytes}
    return out


def test_recompute_is_exact_under_every_schedule_with_tp_and_dropout():
    for rank, result in enumerate(run_distributed(4, recompute_under_schedules)):
        for name, *_ in SCHEDULES:
            for variant in PIPELINE_VARIANTS:
                assert result[(name, variant)]["equal"], (rank, name, variant)
            peaks = {variant: result[(name, variant)]["peak"] for variant in PIPELINE_VARIANTS}
            assert peaks["uniform-1"] < peaks["block-1"] < peaks["none"], (rank, name, peaks)
            assert peaks["selective"] < peaks["none"], (rank, name, peaks)
