"""Tensor-parallel model against the single-process reference, on real gloo worlds of 4 ranks.

For gpt-tiny and llama-tiny, tp 2 and 4, with and without sequence parallelism: the initial weights,
gathered from the shards, equal the tp=1 build bit for bit; per-token losses and every parameter's
gradient match (gradients of `sequence_parallel` parameters summed over TP first, as training does).
A tp=2 interleaved pipeline split run by hand matches too, and impossible layouts raise one-line errors.
All checks of a world run in one `run_distributed` call; the ranks report numbers and the test asserts.
"""
import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron_pp.core.parallel_state import LayoutError
from megatron_pp.core.tensor_parallel import param_is_partitioned
from megatron_pp.models.layout import split_layers
from megatron_pp.models.presets import get_preset
from megatron_pp.models.transformer import StageModel, build_model, full_named_parameters
from tests.dist import run_distributed

SEED = 1234
PRESETS = ("gpt-tiny", "llama-tiny")
TOLERANCE = 1e-5


def _batch(config, b=2):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (b, config.seq_length + 1), generator=g)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}


def _weights(config, b=2):
    return torch.linspace(0.5, 1.5, b * config.seq_length).view(b, config.seq_length)


def _run(stages, batch, weights, tp_group):
    """Forward through the stages in order, backward, and reduce sequence-parallel grads like training."""
    hidden = None
    for stage in stages:
        hidden = stage(hidden, batch)
    (hidden * weights).sum().backward()
    for stage in stages:
        for param in stage.parameters():
            if getattr(param, "sequence_parallel", False):
                dist.all_reduce(param.grad, group=tp_group)
    return hidden.detach()


def _compare(stages, reference):
    """Relative gradient error per parameter, and whether every gathered weight equals the reference exactly."""
    ref_params, ref_grads = reference
    params = full_named_parameters(stages)
    grads = full_named_parameters(stages, grads=True)
    assert params.keys() == ref_params.keys() == grads.keys()
    return {
        "params_equal": all(torch.equal(params[k], ref_params[k]) for k in ref_params),
        "grad_rel_err": {k: ((grads[k] - g).norm() / g.norm()).item() for k, g in ref_grads.items()},
    }


def _tp_checks(ctx):
    results = {}
    for name in PRESETS:
        config = get_preset(name)
        batch, weights = _batch(config), _weights(config)
        single = build_model(config, SEED)
        ref_loss = _run([single], batch, weights, None)
        reference = (full_named_parameters([single]), full_named_parameters([single], grads=True))

        for tp in (2, 4):
            group = ctx.parallel_state(tp=tp).tp_group
            for sp in (False, True):
                stage = StageModel(config, split_layers(config.num_layers, 1)[0], tp_group=group,
                                   sequence_parallel=sp, seed=SEED)
                loss = _run([stage], batch, weights, group)
                report = _compare([stage], reference)
                report["loss_err"] = (loss - ref_loss).abs().max().item()
                # Partitioned parameters summed over ranks plus replicated ones once = the closed form.
                split = torch.tensor([sum(p.numel() for p in stage.parameters() if param_is_partitioned(p))])
                dist.all_reduce(split, group=group)
                replicated = sum(p.numel() for p in stage.parameters() if not param_is_partitioned(p))
                report["num_parameters"] = (split.item() + replicated, config.num_parameters(tp))
                results[(name, tp, sp)] = report

        # tp=2 x an interleaved 2x2 pipeline, with sequence parallelism, all four stages run by hand here.
        group = ctx.parallel_state(tp=2).tp_group
        stages = [StageModel(config, spec, tp_group=group, sequence_parallel=True, seed=SEED)
                  for spec in split_layers(config.num_layers, 2, 2)]
        loss = _run(stages, batch, weights, group)
        report = _compare(stages, reference)
        report["loss_err"] = (loss - ref_loss).abs().max().item()
        results[(name, "pp2-vp2", True)] = report
    return results


def _layout_errors(ctx):
    group = ctx.parallel_state(tp=4).tp_group
    spec = split_layers(4, 1)[0]
    bad = {
        "query_groups": dataclasses.replace(get_preset("llama-tiny"), num_query_groups=2),
        "heads": dataclasses.replace(get_preset("gpt-tiny"), hidden_size=48, num_attention_heads=6),
        "ffn": dataclasses.replace(get_preset("llama-tiny"), ffn_hidden_size=174),
    }
    messages = {}
    for key, config in bad.items():
        try:
            StageModel(config, spec, tp_group=group)
        except LayoutError as error:
            messages[key] = str(error)
    try:
        StageModel(dataclasses.replace(get_preset("gpt-tiny"), seq_length=30), spec, tp_group=group,
                   sequence_parallel=True)
    except ValueError as error:
        messages["sequence_parallel"] = str(error)
    return messages


def test_tensor_parallel_equals_single_process():
    results = run_distributed(4, _tp_checks)
    assert all(r == results[0] for r in results[1:])  # every rank saw the same numbers
    for key, report in results[0].items():
        assert report["params_equal"], key
        assert report["loss_err"] <= TOLERANCE, (key, report["loss_err"])
        worst = max(report["grad_rel_err"].items(), key=lambda item: item[1])
        assert worst[1] <= TOLERANCE, (key, worst)
        if "num_parameters" in report:
            assert report["num_parameters"][0] == report["num_parameters"][1], key
    assert len(results[0]) == len(PRESETS) * 5


@pytest.mark.parametrize(
    "key,message",
    [
        ("query_groups", "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4"),
        ("heads", "--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4"),
        ("ffn", "--ffn-hidden-size 174 is not divisible by --tensor-model-parallel-size 4"),
        ("sequence_parallel",
         "--seq-length 30 is not divisible by --tensor-model-parallel-size 4 (required by --sequence-parallel)"),
    ],
)
def test_bad_tensor_parallel_layouts(key, message):
    messages = _bad_layout_messages()
    assert messages[key] == message


_MESSAGES: dict = {}


def _bad_layout_messages() -> dict:
    # One world call for all the cases of the parametrized test above.
    if not _MESSAGES:
        _MESSAGES.update(run_distributed(4, _layout_errors)[0])
    return _MESSAGES
