"""The executor posts every receive before its send (gloo): pure, on the simulated timeline, no timing.

The executor keeps K receives posted ahead per incoming link (`simulate.receives_ahead`, used by
`execute.ReceivePlan`): receive j of a link is posted when the rank reaches receive j - K, the first K at
the start. Here each receive's posting time is read off the simulated timeline of the executor's own plan
and compared with its send's, for every schedule family the emulation runs, at p = 4, 8, 16, under the
emulated cost sets (`split` is not one of the probes `receives_ahead` derives K from)."""
from collections import defaultdict

import pytest

from megatron_pp.benchmarks.emulate import FAMILIES, cost_model, family_schedule
from megatron_pp.schedules.execute import ReceivePlan
from megatron_pp.schedules.ir import Action, Op
from megatron_pp.schedules.simulate import CostModel, receives_ahead, simulate


def late_receives(schedule, costs: CostModel, ahead: list[dict[int, int]]) -> list[str]:
    """Messages whose receive `ReceivePlan.of(list, ahead[rank])` posts at or after its send."""
    sim = simulate(schedule, costs)
    sends = defaultdict(list)
    for rank, timeline in enumerate(sim.timeline):
        for a, start, _ in timeline:
            if a.op in (Op.SEND_F, Op.SEND_B):
                sends[rank, a.peer].append(start)
    late = []
    for rank, timeline in enumerate(sim.timeline):
        reached = [start for _, start, _ in timeline]
        plan = ReceivePlan.of(schedule.actions[rank], ahead[rank])
        posted = {i: 0.0 for i in plan.first}
        posted.update({i: reached[before] for before, i in plan.after.items()})
        k = defaultdict(int)
        for i, a in enumerate(schedule.actions[rank]):
            if a.op in (Op.RECV_F, Op.RECV_B):
                sent = sends[a.peer, rank][k[a.peer]]
                k[a.peer] += 1
                # Posted at the start (after the step's barrier) counts as before any send.
                if not (posted[i] < sent or i in plan.first):
                    late.append(f"rank {rank} {a} posted at {posted[i]}, sent at {sent}")
    return late


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("p", [4, 8, 16])
def test_every_receive_is_posted_before_its_send(name, p):
    for m in (2 * p, 4 * p) if p < 16 else (2 * p,):
        schedule = family_schedule(name, p, m)
        ahead = receives_ahead(schedule)
        for kind in ("equal", "split"):
            assert late_receives(schedule, cost_model(kind, 1.0 / schedule.num_chunks), ahead) == [], (m, kind)


@pytest.mark.parametrize("name", ["interleaved-1f1b", "gis", "looped-bfs"])
def test_one_receive_ahead_was_not_enough(name):
    """The lists that needed more than one: with one receive ahead per link some receive is posted after
    its send (the executor's rule before `receives_ahead`), so the test above can fail."""
    schedule = family_schedule(name, 8, 16)
    assert late_receives(schedule, CostModel(), [{} for _ in range(8)])
    assert max(k for per_rank in receives_ahead(schedule) for k in per_rank.values()) > 1


def test_receives_ahead_is_bounded_by_the_link_and_one_for_1f1b():
    for p in (4, 8, 16):
        assert all(set(k.values()) <= {1} for k in receives_ahead(family_schedule("1f1b", p, 2 * p)))
        schedule = family_schedule("looped-bfs", p, 2 * p)
        for rank, per_link in enumerate(receives_ahead(schedule)):
            for peer, k in per_link.items():
                assert 1 <= k <= sum(a.op.value.startswith("RECV") and a.peer == peer for a in schedule.actions[rank])


def test_receive_plan_posts_k_ahead_per_link_in_link_order():
    acts = [Action(Op.RECV_F, m, 0, peer=0) for m in range(5)] + [Action(Op.RECV_B, 0, 0, peer=2)]
    plan = ReceivePlan.of(acts, {0: 2})
    assert plan.first == (0, 1, 5)
    assert dict(plan.after) == {0: 2, 1: 3, 2: 4}
