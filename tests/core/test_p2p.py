"""Point-to-point: freeing sent activations keeps the backward exact, and on gloo receives are posted ahead
of their batches in each link's order, and a receive already in costs no wait."""
import time

import pytest
import torch

from megatron_pp.core import p2p
from megatron_pp.data.mock import MockData
from megatron_pp.models.presets import get_preset
from megatron_pp.schedules.ir import batches
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


def _held_after_backward(ctx):
    """Per rank: its number of forwards, and before each compute action how many forward outputs whose
    backward has already run still hold their data. A sent output's storage is released once its send
    completes while the output is alive, and the output itself goes once its backward has run (gloo's sends
    report completion only when waited for, at the step's end, so nothing may hold the output until then)."""
    import weakref

    from megatron_pp.schedules.execute import ExecutorHooks
    from megatron_pp.schedules.ir import Op

    state = ctx.parallel_state(1, 2)
    config = get_preset("gpt-tiny")
    pipe = build_pipeline(config, state, build_schedule("1f1b", 2, 4), micro_batch_size=2, seed=3)
    outputs, done, running, held = [], [], [], []

    def holds_data(ref):
        t = ref()
        return t is not None and t.untyped_storage().nbytes() > t.element_size()

    class Watch(ExecutorHooks):
        def before_compute(self, action):
            done.extend(running)
            running.clear()
            if action.op in (Op.B, Op.BI):
                running.append(action.microbatch)
            held.append(sum(holds_data(outputs[mb]) for mb in done))

    hook = pipe.chunks[0].register_forward_hook(lambda module, args, out: outputs.append(weakref.ref(out)))
    pipe.executor._install(Watch())
    try:
        data = MockData(3, config.seq_length, config.vocab_size, 2, 8 * state.dp_size, state.dp_size)
        train_step(pipe, data.step_microbatches(0, state.dp_rank))
    finally:
        hook.remove()
    return state.pp_rank, (len(outputs), max(held))


def test_executor_frees_every_sent_activation():
    results = dict(run_distributed(2, _held_after_backward))
    # Rank 0 sends its 4 activations downstream; none holds its data once its backward has run.
    assert results[0] == (4, 0)


def _posted_receives(ctx):
    import dataclasses

    import megatron_pp.schedules.execute as execute

    state = ctx.parallel_state(1, 2)
    config = dataclasses.replace(get_preset("gpt-tiny"), num_layers=4)
    schedule = build_schedule("interleaved-1f1b", 2, 4, 2)
    pipe = build_pipeline(config, state, schedule, micro_batch_size=2, seed=3)
    ahead, in_batches = [], []
    original_ahead, original_post = execute.PipelineExecutor._post_ahead, p2p.PipelineComm.post

    def post_ahead(self, actions, index):
        ahead.append((actions[index].peer, index))
        return original_ahead(self, actions, index)

    def post(self, sends, recvs):
        in_batches.extend(recvs)
        return original_post(self, sends, recvs)

    execute.PipelineExecutor._post_ahead, p2p.PipelineComm.post = post_ahead, post
    try:
        data = MockData(3, config.seq_length, config.vocab_size, 2, 8, 1)
        train_step(pipe, data.step_microbatches(0, 0))
    finally:
        execute.PipelineExecutor._post_ahead, p2p.PipelineComm.post = original_ahead, original_post
    acts = schedule.actions[state.pp_rank]
    batch_of = {i: start for start, end in batches(acts) for i in range(start, end)}
    receives = [i for i, a in enumerate(acts) if a.op.value.startswith("RECV")]  # one peer at p = 2
    # K receives are kept posted ahead on the link (`receives_ahead`): a receive whose K-th predecessor on
    # the link sits in the same batch is posted with that batch.
    k = pipe.executor.receives_ahead.get(1 - state.pp_rank, 1)
    with_predecessor = [i for prev, i in zip(receives, receives[k:]) if batch_of[prev] == batch_of[i]]
    return p2p.needs_batches(state.pp_group), ahead, len(in_batches), receives, with_predecessor


def test_gloo_receives_are_posted_ahead_in_link_order():
    # gloo needs no batches: every other receive of the list is posted ahead of its batch, right after
    # its K-th predecessor on the link (the first K at the start), so the order of receives on the link (what matches them to sends) is
    # the list's.
    for needs, ahead, in_batches, receives, with_predecessor in run_distributed(2, _posted_receives):
        assert not needs
        assert [index for _, index in ahead] == [i for i in receives if i not in with_predecessor]
        assert in_batches == len(with_predecessor)


def test_post_receive_is_refused_where_batches_are_needed():
    comm = p2p.PipelineComm(None, [0, 1], batched=True)
    with pytest.raises(RuntimeError, match="posted with its batch"):
        comm.post_receive(torch.empty(1), 1)


class _Work:
    def __init__(self, done: bool):
        self.done, self.waited = done, False

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> None:
        if not self.done:
            time.sleep(0.01)  # the data arrives while the consumer is blocked
        self.waited = True


def test_a_receive_already_in_is_not_counted_as_a_wait():
    # The executor's wait slices and `comm_wait_s` count only receives the consumer actually blocked on.
    arrived, late = p2p.Transfer(torch.zeros(1), _Work(True)), p2p.Transfer(torch.zeros(1), _Work(False))
    (_, none), (_, some) = arrived.wait(), late.wait()
    assert none == 0.0 and some >= 0.01
    assert arrived.work is None and late.work is None


def _traced_events(ctx):
    import megatron_pp.schedules.execute as execute

    state = ctx.parallel_state(1, 2)
    config = get_preset("gpt-tiny")
    pipe = build_pipeline(config, state, build_schedule("1f1b", 2, 4), micro_batch_size=2, seed=3, trace=True)
    original = execute.PipelineExecutor._post_batch
    if state.pp_rank == 0:  # a slow first stage: the last stage blocks on every activation it receives
        def slow_post(self, actions, first, end):
            time.sleep(0.02)
            return original(self, actions, first, end)

        execute.PipelineExecutor._post_batch = slow_post
    try:
        data = MockData(3, config.seq_length, config.vocab_size, 2, 8, 1)
        steps = [train_step(pipe, data.step_microbatches(s, 0))[0].events for s in range(2)]
    finally:
        execute.PipelineExecutor._post_batch = original
    return state.pp_rank, steps


def test_each_wait_slice_sits_inside_the_action_that_waited_once():
    # The executor nests the time an action blocked on its input in that action's slice; a wait is reported
    # once, by the action that waited, in the step it waited in.
    for rank, steps in run_distributed(2, _traced_events):
        for events in steps:
            waits = 0
            for (label, start, end), previous in zip(events[1:], events):
                if label.startswith("wait "):
                    waits += 1
                    assert label == f"wait {previous[0]}" or previous[0].startswith("wait "), (label, previous)
                    owner = next(e for e in reversed(events[:events.index((label, start, end))])
                                 if not e[0].startswith("wait "))
                    assert owner[1] <= start <= end <= owner[2] + 1e-6, (owner, (label, start, end))
            if rank == 1:
                assert 1 <= waits <= 4  # at most one per received activation (4 per step)


def test_a_send_is_retired_after_an_explicit_wait_of_its_work():
    """A batch coalesced into one work (NCCL) is done once its receive was waited for, even where the work
    never reports completion (the fake backend): the send's callback runs at the next poll, not at drain."""
    class NeverCompletes:
        def is_completed(self):
            return False

        def wait(self):
            return True

    work, retired = NeverCompletes(), []
    link = p2p.PipelineComm(None, [0, 1], batched=True)
    link.pending.append(p2p.PendingSend(work, torch.zeros(2), lambda: retired.append(1)))
    link.poll()
    assert retired == []
    p2p.Transfer(torch.zeros(2), work, link.note_waited).wait()
    link.poll()
    assert retired == [1] and not link.pending
