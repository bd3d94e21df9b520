"""Why `v-half`'s idle time grows with m at unequal costs (docs/schedules.md, "Emulated compute"): pure
simulation, no timing.

Its lists hold two loops in the steady state, fixed by the order and the memory budget: a rank near the
bottom of the V runs microbatch j + d's forward on its chunk 0 only after microbatch j has gone from there
down the V and back up to its chunk 1 (six forwards a microbatch; d, the microbatches in flight, is what
the budget allows: 1 at p = 4, 2 at p = 8), and the same with BIs in the other direction (six BIs a
microbatch). A rank's own work per microbatch is W = 2(T_F + T_BI + T_BW) per chunk costs, so each
microbatch adds max(0, 6·T_BI − W, 6·T_F − W) of idle time to every rank: none at equal costs (the order
was derived there, with no slack), and with it a linear growth in m whenever T_BI or T_F exceeds the mean of
the three. (Ours: read off the simulated critical path; the formula is checked here, not derived from
the generator.)"""
import pytest

from megatron_pp.benchmarks.emulate import cost_model, family_schedule
from megatron_pp.schedules.ir import Op
from megatron_pp.schedules.simulate import CostModel, simulate

COSTS = [(1, 1, 1), (1, 1.2, 0.8), (1, 0.8, 1.2), (1.2, 1, 1), (1.3, 1.2, 0.5), (1, 1.5, 0.5), (0.9, 1.05, 1.05)]


def growth_per_microbatch(p: int, costs: CostModel) -> float:
    """How much one more microbatch lengthens the simulated step beyond a rank's own work W."""
    steps = [simulate(family_schedule("v-half", p, m), costs).makespan for m in (4 * p, 6 * p)]
    work = sum(costs.duration(op, 0) for op in (Op.F, Op.BI, Op.BW)) * 2
    return (steps[1] - steps[0]) / (2 * p) - work


@pytest.mark.parametrize("p", [4, 8, 16])
@pytest.mark.parametrize("f,bi,bw", COSTS)
def test_v_half_step_grows_by_its_six_action_loops(p, f, bi, bw):
    costs = CostModel(forward=f, backward_input=bi, backward_weight=bw)
    work = 2 * (f + bi + bw)
    assert growth_per_microbatch(p, costs) == pytest.approx(max(0.0, 6 * bi - work, 6 * f - work), abs=1e-9)


def test_the_emulated_split_costs_give_v_half_a_growing_idle_and_zb_v_none():
    """The split costs measured here (BI 1.14, BW 0.95 per B = 2) are on the growing side: 0.32 units a
    microbatch at p = 4 with a rank's forward = 1 unit (0.5 a chunk); zb-v's idle stays flat."""
    costs = cost_model("split", 0.5)
    assert growth_per_microbatch(4, costs) == pytest.approx(4 * costs.backward_input - 2 * costs.forward
                                                            - 2 * costs.backward_weight)
    assert growth_per_microbatch(4, costs) > 0.3
    idle = [simulate(family_schedule("zb-v", 4, m), costs) for m in (16, 32)]
    assert [r.makespan - max(r.busy) for r in idle] == pytest.approx([idle[0].makespan - max(idle[0].busy)] * 2)
