"""The simulator's host costs (`CostModel.host_compute`, `host_post`) with `p2p_latency`: hand-timed cases, and
the zero default leaving every timeline as it was."""
import pytest

from megatron_pp.schedules.registry import build_schedule
from megatron_pp.schedules.simulate import CostModel, simulate


def _times(result, rank):
    return [(str(a), round(s, 9), round(e, 9)) for a, s, e in result.timeline[rank]]


def test_one_f_one_b_p2_m2_by_hand():
    """h = 0.1 before each compute action, q = 0.01 per posted send or receive, latency L = 0.5, F = 1, B = 2.

    Rank 0: F0 at 0 + h = 0.1 to 1.1; SEND_F0 posted 1.1 to 1.11 (arrives 1.61); F1 at 1.11 + h = 1.21 to 2.21;
    then one batch, SEND_F1 posted 2.21 to 2.22 (arrives 2.72) and RECV_B0 to 2.23. Rank 1: RECV_F0 posted to
    0.01, F0 waits for 1.61 (its h overlaps the wait) to 2.61, B0 at 2.71 to 4.71, one batch: SEND_B0 posted to
    4.72 (arrives 5.22), RECV_F1 to 4.73, F1 at 4.83 (its input came at 2.72) to 5.83, B1 at 5.93 to 7.93, SEND_B1 posted to 7.94
    (arrives 8.44). Rank 0: B0 waits for 5.22, to 7.22; RECV_B1 posted to 7.23, B1 waits for 8.44, to 10.44."""
    costs = CostModel(host_compute=0.1, host_post=0.01, p2p_latency=0.5)
    result = simulate(build_schedule("1f1b", 2, 2), costs)
    compute0 = [(a, s, e) for a, s, e in _times(result, 0) if not a.startswith(("SEND", "RECV"))]
    compute1 = [(a, s, e) for a, s, e in _times(result, 1) if not a.startswith(("SEND", "RECV"))]
    assert compute0 == [("F0.0", 0.1, 1.1), ("F1.0", 1.21, 2.21), ("B0.0", 5.22, 7.22), ("B1.0", 8.44, 10.44)]
    assert compute1 == [("F0.0", 1.61, 2.61), ("B0.0", 2.71, 4.71), ("F1.0", 4.83, 5.83), ("B1.0", 5.93, 7.93)]
    receives0 = [(a, s, e) for a, s, e in _times(result, 0) if a.startswith("RECV")]
    assert receives0 == [("RECV_B0.0<1", 2.21, 5.22), ("RECV_B1.0<1", 7.22, 8.44)]
    assert result.makespan == pytest.approx(10.44)
    assert result.busy == [6.0, 6.0]  # host time is not compute: it counts in the bubble
    assert result.bubble_fraction == pytest.approx(1 - 6.0 / 10.44)


def test_a_single_rank_pays_one_host_compute_per_action():
    """At p = 1 there is nothing to post (q plays no part) and the host time is exactly one h per compute
    action: m·(F + B) + 2m·h."""
    for m in (1, 3, 7):
        result = simulate(build_schedule("1f1b", 1, m), CostModel(host_compute=0.25, host_post=9.0))
        assert result.makespan == pytest.approx(3 * m + 2 * m * 0.25)


def test_each_send_of_a_batch_leaves_after_its_own_post():
    """GPipe at p = 3, m = 1 with q = 1, L = 0 and free compute (F = B = 0): rank 0's F0 at 0, its SEND_F
    leaves at 1; rank 1 posts RECV_F (to 1), runs F0 at 1, its SEND_F leaves at 2, RECV_B posted to 3;
    rank 2's F0 and B0 at 2, its SEND_B leaves at 3; rank 1's B0 at 3, its SEND_B leaves at 4; rank 0's B0
    (its RECV_B posted 1 to 2) at 4: the makespan is the chain of posts, 4."""
    costs = CostModel(forward=0.0, backward=0.0, host_post=1.0)
    result = simulate(build_schedule("gpipe", 3, 1), costs)
    starts = {(r, a): s for r in range(3) for a, s, _ in _times(result, r) if not a.startswith(("SEND", "RECV"))}
    assert starts[1, "F0.0"] == 1.0 and starts[2, "F0.0"] == 2.0
    assert starts[2, "B0.0"] == 2.0 and starts[1, "B0.0"] == 3.0 and starts[0, "B0.0"] == 4.0
    assert result.makespan == pytest.approx(4.0)


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("zb-v", 2), ("po-h", 2), ("bpipe", 1), ("looped-bfs", 2)])
def test_zero_host_costs_change_nothing(name, v):
    schedule = build_schedule(name, 4, 8, v)
    plain, zero = simulate(schedule, CostModel(p2p_latency=0.3)), simulate(
        schedule, CostModel(p2p_latency=0.3, host_compute=0.0, host_post=0.0))
    assert plain.timeline == zero.timeline and plain.makespan == zero.makespan


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "interleaved-1f1b"])
def test_host_costs_never_shorten_a_step(name):
    schedule = build_schedule(name, 4, 8, 2 if name == "interleaved-1f1b" else 1)
    base = simulate(schedule).makespan
    assert simulate(schedule, CostModel(host_compute=0.05)).makespan > base
    assert simulate(schedule, CostModel(host_post=0.05)).makespan > base


@pytest.mark.parametrize("field", ["host_compute", "host_post"])
def test_host_costs_refuse_negative_values(field):
    CostModel(**{field: 0.0})
    with pytest.raises(ValueError, match=f"CostModel.{field} must be >= 0"):
        CostModel(**{field: -1e-9})
