"""Freeing sent activations: the data goes, the autograd node and the gradient stay correct."""
import torch

from megatron_pp.core import p2p
from megatron_pp.data.mock import MockData
from megatron_pp.models.presets import get_preset
from megatron_pp.schedules.registry import build_schedule
from megatron_pp.training.train import build_pipeline, train_step
from tests.dist import run_distributed


def test_release_storage_keeps_backward_exact():
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, 3)
    out = torch.tanh(x @ w) + x  # a stage ends in a residual add, which saves nothing
    release_ref = x.detach().clone().requires_grad_()
    (torch.tanh(release_ref @ w) + release_ref).backward(torch.ones(4, 3))
    p2p.release_storage(out)
    assert out.shape == (4, 3) and out.untyped_storage().nbytes() == out.element_size()
    torch.autograd.backward(out, torch.ones(4, 3))
    assert torch.equal(x.grad, release_ref.grad)


def _count_released(ctx):
    state = ctx.parallel_state(1, 2)
    config = get_preset("gpt-tiny")
    pipe = build_pipeline(config, state, build_schedule("1f1b", 2, 4), micro_batch_size=2, seed=3)
    released = []
    original = p2p.release_storage
    import megatron_pp.schedules.execute as execute

    execute.release_storage = lambda t: (released.append(t.shape), original(t))
    try:
        data = MockData(3, config.seq_length, config.vocab_size, 2, 8 * state.dp_size, state.dp_size)
        train_step(pipe, data.step_microbatches(0, state.dp_rank))
    finally:
        execute.release_storage = original
    return state.pp_rank, len(released)


def test_executor_frees_every_sent_activation():
    results = dict(run_distributed(2, _count_released))
    assert results == {0: 4, 1: 0}  # rank 0 sends 4 activations downstream; the last stage sends none
