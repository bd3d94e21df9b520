"""The planner's zero-bubble stash term (`memory.deferred_weight_grad_bytes`) against the executor's store on
CPU in fp32: one stage's forward and split BI run as the executor runs them (inside `deferring_weight_grads`,
the chunk input dropped after BI as the executor replaces it by its gradient), then the store holds what BW
needs. The stash after that hold is the stash's bytes plus the formula's change, to the byte."""
import dataclasses

import pytest
import torch

from megatron_pp.core.tensor_parallel.layers import WeightGradStore, deferring_weight_grads
from megatron_pp.core.tensor_parallel.random import model_parallel_seed
from megatron_pp.data.mock import MockData
from megatron_pp.models.layout import split_layers
from megatron_pp.models.presets import get_preset
from megatron_pp.models.recompute import RecomputeConfig
from megatron_pp.models.transformer import StageModel
from megatron_pp.planning.memory import CPU_FP32, attention_kind, deferred_weight_grad_bytes, stash_bytes
from megatron_pp.schedules.store import ActivationStore
from tests.dist import run_distributed

SEED = 1
RECOMPUTE = {"none": None, "full": RecomputeConfig("full", "uniform", 1), "selective": RecomputeConfig("selective")}


def _stages(config):
    first, last = split_layers(config.num_layers, 2)
    return {"first": first, "middle": dataclasses.replace(first, has_embedding=False), "last": last}


def _split_backward(config, spec, b, recompute="none", tp_group=None, sequence_parallel=False):
    """(stash after the forward, stash after BI and the hold) of one microbatch on one stage."""
    extra = {} if RECOMPUTE[recompute] is None else {"recompute": RECOMPUTE[recompute]}
    model = StageModel(config, spec, seed=SEED, tp_group=tp_group, sequence_parallel=sequence_parallel, **extra)
    model.train()
    store, grads = ActivationStore(list(model.parameters()) + list(model.buffers())), WeightGradStore()
    batch = MockData(SEED, config.seq_length, config.vocab_size, b, b).microbatch(0, 0, 0)
    x = None
    if not spec.has_embedding:
        rows = config.seq_length // (2 if sequence_parallel else 1)
        x = torch.randn(rows, b, config.hidden_size, requires_grad=True)
    with store.stash(0), deferring_weight_grads(grads, 0):
        y = model(x, batch)
        if spec.has_head:  # what the executor adds on the last stage
            y = (y.float() * batch["loss_mask"]).sum()
    forward = store.live_bytes
    with deferring_weight_grads(grads, 0):
        y.backward(None if spec.has_head else torch.ones_like(y))
    del x, y  # the executor keeps the chunk input's gradient, not the input
    store.hold(0, grads.held(0))
    return forward, store.live_bytes


@pytest.mark.parametrize("preset,backend", [("gpt-tiny", "sdpa"), ("gpt-tiny", "reference"),
                                            ("llama-tiny", "sdpa"), ("llama-tiny", "reference")])
@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_the_stash_after_bi_is_the_formulas_to_the_byte(preset, backend, recompute):
    config = dataclasses.replace(get_preset(preset), attention_backend=backend, hidden_dropout=0.0,
                                 attention_dropout=0.0)
    kind = attention_kind(backend, "cpu", 0.0)
    for where, spec in _stages(config).items():
        model_parallel_seed(SEED, 0, 0)
        forward, after_bi = _split_backward(config, spec, 2, recompute)
        stash = stash_bytes(config, spec, 2, attention=kind, recompute=recompute, numerics=CPU_FP32)
        change = deferred_weight_grad_bytes(config, spec, 2, attention=kind, recompute=recompute, numerics=CPU_FP32)
        assert forward == stash, (where, forward, stash)  # tests/planning/test_memory.py's check, here without dropout
        assert after_bi == stash + change, (where, after_bi, stash, change)
        if recompute != "full":
            assert change < 0, where  # BI frees more than BW's output gradients add


def _tp_split_backward(ctx, preset, recompute):
    model_parallel_seed(SEED, ctx.rank, 0)
    state = ctx.parallel_state(2, 1)
    config = dataclasses.replace(get_preset(preset), attention_backend="sdpa", hidden_dropout=0.0,
                                 attention_dropout=0.0)
    return {where: _split_backward(config, spec, 2, recompute, state.tp_group, sequence_parallel=True)
            for where, spec in _stages(config).items()}


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny"])
def test_tensor_and_sequence_parallel_stash_after_bi(preset):
    """tp 2 with sequence parallelism: the layer inputs BW keeps are sequence shards (its GEMM gathers them
    again), the token ids saved are the shifted local ids, which die in BI."""
    config = dataclasses.replace(get_preset(preset), attention_backend="sdpa", hidden_dropout=0.0, attention_dropout=0.0)
    for recompute in ("none", "full"):
        measured = run_distributed(2, _tp_split_backward, preset, recompute)
        for where, spec in _stages(config).items():
            kw = dict(tp=2, sequence_parallel=True, attention="flash", recompute=recompute, numerics=CPU_FP32)
            stash, change = stash_bytes(config, spec, 2, **kw), deferred_weight_grad_bytes(config, spec, 2, **kw)
            for rank in range(2):
                assert measured[rank][where] == (stash, stash + change), (recompute, where, rank, measured[rank][where])
