"""The split backward: inside `deferring_weight_grads` the linear layers' backward computes only the input
gradient (BI); the store's `run` (BW) then adds exactly the weight gradients a whole backward gives, with
tensor and sequence parallelism too."""
from __future__ import annotations

import pytest
import torch

from megatron_pp.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, WeightGradStore,
                                                     deferring_weight_grads)
from tests.dist import run_distributed


def _mlp(tp_group=None, sequence_parallel=False, seed=0):
    torch.manual_seed(seed)
    up = ColumnParallelLinear(16, 32, tp_group=tp_group, sequence_parallel=sequence_parallel)
    down = RowParallelLinear(32, 16, tp_group=tp_group, input_is_parallel=True, sequence_parallel=sequence_parallel)
    for p in [*up.parameters(), *down.parameters()]:
        torch.nn.init.normal_(p, std=0.2)
    return up, down


def _grads(modules):
    return {f"{i}.{n}": (p.grad.clone() if p.grad is not None else None)
            for i, m in enumerate(modules) for n, p in m.named_parameters()}


def _backward(modules, x, deferred: bool):
    up, down = modules
    for m in modules:
        m.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    store = WeightGradStore()
    if deferred:
        with deferring_weight_grads(store, "mb0"):
            y = down(torch.nn.functional.gelu(up(x)))
            y.square().sum().backward()
    else:
        y = down(torch.nn.functional.gelu(up(x)))
        y.square().sum().backward()
    return x.grad, store


def test_bi_leaves_weight_gemms_to_bw_and_bw_adds_them_exactly():
    modules = _mlp()
    x = torch.randn(4, 2, 16)
    ref_input, _ = _backward(modules, x, deferred=False)
    reference = _grads(modules)
    input_grad, store = _backward(modules, x, deferred=True)
    torch.testing.assert_close(input_grad, ref_input, rtol=0, atol=0)
    after_bi = _grads(modules)
    assert after_bi["0.weight"] is None and after_bi["1.weight"] is None  # the GEMMs wait
    torch.testing.assert_close(after_bi["0.bias"], reference["0.bias"], rtol=0, atol=0)  # biases stay in BI
    assert store.pending == ["mb0"] and len(store.held("mb0")) == 4  # two output gradients, two inputs
    assert store.run("mb0") == 2 and store.pending == []
    for name, grad in _grads(modules).items():
        torch.testing.assert_close(grad, reference[name], rtol=1e-6, atol=0, msg=name)


def test_bw_accumulates_into_an_existing_gradient_and_tells_the_reducer():
    modules = _mlp()
    up = modules[0]
    calls = []
    up.weight.grad_added = lambda: calls.append("up")
    x = torch.randn(4, 2, 16)
    _, store = _backward(modules, x, deferred=True)
    store.run("mb0")
    once = up.weight.grad.clone()
    with deferring_weight_grads(store, "mb1"):
        y = modules[1](torch.nn.functional.gelu(up(x.detach().requires_grad_())))
        y.square().sum().backward()
    store.run("mb1")
    torch.testing.assert_close(up.weight.grad, 2 * once, rtol=1e-6, atol=0)
    assert calls == ["up", "up"]
    del up.weight.grad_added


def _tp_split(ctx, sequence_parallel: bool):
    state = ctx.parallel_state(2, 1)
    modules = _mlp(state.tp_group, sequence_parallel, seed=1)
    torch.manual_seed(7)
    x = torch.randn(4, 2, 16)
    if sequence_parallel:
        x = x.chunk(2, dim=0)[state.tp_rank].contiguous()
    ref_input, _ = _backward(modules, x, deferred=False)
    reference = _grads(modules)
    input_grad, store = _backward(modules, x, deferred=True)
    store.run("mb0")
    errors = {name: float((grad - reference[name]).norm() / reference[name].norm())
              for name, grad in _grads(modules).items()}
    return float((input_grad - ref_input).abs().max()), errors


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_and_sequence_parallel_weight_gradients_after_bw(sequence_parallel):
    for input_error, errors in run_distributed(2, _tp_split, sequence_parallel):
        assert input_error == 0.0
        assert all(e <= 1e-6 for e in errors.values()), errors


def test_only_a_bw_separated_from_its_bi_waits():
    from megatron_pp.schedules.execute import deferred_backwards
    from megatron_pp.schedules.ir import Action

    actions = [Action.parse(t) for t in "F0.0 F1.0 BI0.0 SEND_B0.0>0 BW0.0 BI1.0 F2.0 BW1.0 B2.0".split()]
    assert deferred_backwards(actions) == {(1, 0)}  # BW0.0 is BI0.0's next compute; BW1.0 is not


def test_recomputed_inputs_held_for_bw_count_in_the_stash():
    """With full recomputation the layer inputs BW needs are made again in BI, outside the forward's
    stash; `held` names them so that the store counts them until BW, as it counts them without it."""
    from torch.utils.checkpoint import checkpoint

    from megatron_pp.schedules.store import ActivationStore

    modules = _mlp()
    params = [p for m in modules for p in m.parameters()]

    def held_bytes(recompute):
        store, grads = ActivationStore(params), WeightGradStore()
        x = torch.randn(4, 2, 16, requires_grad=True)
        def run(t):
            return modules[1](torch.nn.functional.gelu(modules[0](t)))
        with deferring_weight_grads(grads, "mb0"):
            with store.stash("mb0"):
                y = checkpoint(run, x, use_reentrant=False) if recompute else run(x)
            y.square().sum().backward()
        before = store.live_bytes
        store.hold("mb0", grads.held("mb0"))
        return store.live_bytes - before, store.live_bytes

    grown_plain, total_plain = held_bytes(False)
    grown_recomputed, total_recomputed = held_bytes(True)
    gradients = (4 * 2 * 32 + 4 * 2 * 16) * 4  # output gradients of up and down, fp32
    recomputed = 4 * 2 * 32 * 4  # down's input, made again in BI (up's is the span input the forward kept)
    assert grown_plain == gradients  # the inputs were saved by the forward already
    assert grown_recomputed == gradients + recomputed
    # After BI the stash is what BW reads, saved by the forward or rebuilt: the rest died in BI and stopped
    # counting, so both hold the same bytes.
    assert total_recomputed == total_plain


def test_bw_frees_each_gemms_inputs_once_it_has_run(monkeypatch):
    # Holding every deferred GEMM's inputs until the last one ran grew the heap past what the whole
    # backward needs, and the allocator gave pages back and faulted them in again every step.
    import weakref

    from megatron_pp.core.tensor_parallel import layers

    modules = _mlp()
    store = WeightGradStore()
    with deferring_weight_grads(store, "mb0"):
        x = torch.randn(4, 2, 16, requires_grad=True)
        modules[1](torch.nn.functional.gelu(modules[0](x))).square().sum().backward()
    alive_at_run, done = [], []
    real_run = layers._DeferredGemm.run

    def run(gemm):
        alive_at_run.append([ref() is not None for ref in done])
        real_run(gemm)
        done.append(weakref.ref(gemm.grad_out))

    monkeypatch.setattr(layers._DeferredGemm, "run", run)
    assert store.run("mb0") == 2
    assert alive_at_run == [[], [False]]
