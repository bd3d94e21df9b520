"""The executor's per-step overhead: what it derives from a rank's action list is derived once per list.

Exactness of every path is tested in test_exactness.py (and the offload, BPipe and looped tests); here a
gloo pp=2 run counts how often the executor walks its list. Stepping goes through the list by index, so
any iteration over the whole list after construction is a re-derivation.
"""
from __future__ import annotations

import dataclasses

import torch

from megatron_pp.data.mock import MockData
from megatron_pp.models.presets import get_preset
from megatron_pp.schedules.ir import Action, Op
from megatron_pp.schedules.registry import build_schedule
from megatron_pp.training.train import build_pipeline, train_step
from tests.dist import run_distributed

SEED, MICRO_BATCH, M = 5, 2, 4


class CountedList(list):
    """A list that counts whole-list walks (`for`, `enumerate`, comprehensions)."""

    walks = 0

    def __iter__(self):
        self.walks += 1
        return super().__iter__()


def count_walks(ctx, name: str) -> dict:
    state = ctx.parallel_state(1, 2)
    config = dataclasses.replace(get_preset("gpt-tiny"), num_layers=4)
    schedule = build_schedule(name, 2, M, 1 if name == "1f1b" else 2)
    mine = CountedList(schedule.actions[state.pp_rank])
    schedule.actions[state.pp_rank] = mine
    pipe = build_pipeline(config, state, schedule, micro_batch_size=MICRO_BATCH, seed=SEED)
    assert pipe.executor.actions is mine and not pipe.executor.comm.batched
    data = MockData(SEED, config.seq_length, config.vocab_size, MICRO_BATCH, MICRO_BATCH * M)
    built = mine.walks
    losses = []
    for step in range(3):
        result, _ = train_step(pipe, data.step_microbatches(step, 0))
        losses.append(None if result.loss_sum is None else float(result.loss_sum))
    after_steps = mine.walks
    with torch.no_grad():
        for _ in range(3):
            pipe.executor.run(data.step_microbatches(0, 0), loss_scale=1.0, forward_only=True)
    return {"built": built, "after_steps": after_steps, "after_eval": mine.walks, "losses": losses}


def test_receive_plan_is_derived_once_per_list_not_per_step():
    for name in ("1f1b", "zb-v"):
        results = run_distributed(2, count_walks, name)
        for rank, r in enumerate(results):
            assert r["after_steps"] == r["built"], (name, rank, r)
            # The forward-only view (and its plan) is derived at the first evaluation, then reused.
            assert r["after_eval"] == r["built"] + 1, (name, rank, r)
        assert any(r["losses"][0] is not None for r in results)  # the steps really ran


def test_receive_plan_posts_the_first_receive_of_each_link_and_chains_the_rest():
    from megatron_pp.schedules.execute import ReceivePlan

    acts = [Action(Op.RECV_F, 0, 0, peer=0), Action(Op.F, 0, 0), Action(Op.RECV_B, 0, 0, peer=2),
            Action(Op.RECV_F, 1, 0, peer=0), Action(Op.RECV_B, 1, 0, peer=2), Action(Op.RECV_F, 2, 0, peer=0)]
    plan = ReceivePlan.of(acts)
    assert plan.first == (0, 2)
    assert dict(plan.after) == {0: 3, 3: 5, 2: 4}
