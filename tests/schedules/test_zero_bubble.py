"""ZB-H1 and ZB-H2 (arXiv 2401.10241, §2.1, §2.2): the docstring tables and numbers, the bubble and peak
formulas of the module docstring against the simulator, m < p and m not a multiple of p, registry."""
from functools import lru_cache

import pytest

from megatron_pp.schedules import zero_bubble
from megatron_pp.schedules.ir import Op
from megatron_pp.schedules.registry import build_schedule, get_schedule
from megatron_pp.schedules.runtime import runtime_needs
from megatron_pp.schedules.simulate import CostModel, simulate
from megatron_pp.schedules.zero_bubble import zb_h1, zb_h2

# (T_F, T_B, T_W): equal; B slower than F; F slower; W cheap; W dear; and the mixes between.
COSTS = [(1, 1, 1), (1, 1.5, 1), (1.2, 1, 1), (1, 1, 0.5), (1, 1, 2), (2, 1, 1), (1, 2, 1), (1, 0.8, 1.2)]
SIZES = [(p, m) for p in (2, 3, 4, 8) for m in (p, p + 1, 2 * p, 3 * p - 1)]


@lru_cache(maxsize=None)
def _built(name, p, m):
    return build_schedule(name, p, m)


def _costs(tf, tb, tw):
    return CostModel(forward=tf, backward=tb + tw, backward_input=tb, backward_weight=tw)


def bubble_per_rank(name, p, tf, tb, tw):
    """The module docstring's per-rank idle time of one flushed step (m ≥ p): (low, high) bounds."""
    if name == "zb-h2":
        return (p - 1) * tf, (p - 1) * max(tf, tb, tf + tb - tw)
    exact = (p - 1) * {"1f1b": tf + tb + tw, "zb-h1": max(tf, tf + tb - tw)}[name]
    return exact, exact


def peaks(name, p, m):
    return [min(p if name == "zb-h1" else 2 * p - 1, m)] * p


def test_docstring_tables_are_the_generated_lists():
    doc = "\n".join(line.strip() for line in zero_bubble.__doc__.splitlines())
    assert zb_h1(4, 8).format_table() in doc
    assert zb_h2(4, 8).format_table() in doc


def test_docstring_simulated_numbers():
    unit = {n: simulate(build_schedule(n, 4, 8)) for n in ("1f1b", "zb-h1", "zb-h2")}
    assert {n: r.makespan for n, r in unit.items()} == {"1f1b": 33.0, "zb-h1": 27.0, "zb-h2": 27.0}
    assert {n: round(r.bubble_fraction, 3) for n, r in unit.items()} == {"1f1b": 0.273, "zb-h1": 0.111,
                                                                        "zb-h2": 0.111}
    assert {n: r.peak_stash for n, r in unit.items()} == {"1f1b": [4, 3, 2, 1], "zb-h1": [4, 4, 4, 4],
                                                         "zb-h2": [7, 7, 7, 7]}
    slow_b = {n: simulate(build_schedule(n, 4, 8), _costs(1, 1.5, 1)).makespan for n in unit}
    assert slow_b == {"1f1b": 38.5, "zb-h1": 32.5, "zb-h2": 31.0}


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h2"])
@pytest.mark.parametrize("tf, tb, tw", COSTS)
def test_bubble_formula(name, tf, tb, tw):
    for p, m in SIZES:
        result = simulate(_built(name, p, m), _costs(tf, tb, tw))
        low, high = bubble_per_rank(name, p, tf, tb, tw)
        # Every rank is busy m·(T_F+T_B+T_W), so the bubble is the same on each.
        assert result.busy == pytest.approx([m * (tf + tb + tw)] * p)
        idle = result.makespan - m * (tf + tb + tw)
        assert low - 1e-9 <= idle <= high + 1e-9, (name, p, m, idle)
        if name == "zb-h2":  # never slower than zb-h1 on these costs
            assert result.makespan <= simulate(_built("zb-h1", p, m), _costs(tf, tb, tw)).makespan + 1e-9


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])
@pytest.mark.parametrize("p, m", SIZES + [(4, 1), (4, 2), (4, 3), (8, 5)])
def test_peak_formula(name, p, m):
    assert simulate(_built(name, p, m)).peak_stash == peaks(name, p, m)
    assert max(peaks(name, p, m)) <= 2 * min(p, m)  # zb-h2: at most twice 1F1B's rank-0 peak


def _gaps(timeline):
    """Idle time between a rank's first compute start and its last compute end."""
    spans = [(s, e) for a, s, e in timeline if a.is_compute]
    return sum(b[0] - a[1] for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("p, m", [(4, 8), (8, 32), (8, 15), (3, 7)])
def test_zb_h2_is_a_parallelogram_and_zb_h1_waits_inside(p, m):
    """zb-h2 (m ≥ 2p − 1, unit costs): rank r works without a gap from r to r + 3m, so its idle time is
    only the fill before its first F and the drain after its last BW; zb-h1's rank 0 instead waits
    p − 1 inside the step for its first gradient."""
    h2 = simulate(build_schedule("zb-h2", p, m))
    for r, timeline in enumerate(h2.timeline):
        spans = [(s, e) for a, s, e in timeline if a.is_compute]
        assert (spans[0][0], spans[-1][1], _gaps(timeline)) == (r, r + 3 * m, 0)
    h1 = simulate(build_schedule("zb-h1", p, m))
    assert _gaps(h1.timeline[0]) == p - 1


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])
@pytest.mark.parametrize("m", [1, 2, 3, 5])
def test_fewer_microbatches_than_ranks_build_and_beat_1f1b(name, m):
    p = 4
    schedule = build_schedule(name, p, m)
    assert simulate(schedule).makespan < simulate(build_schedule("1f1b", p, m)).makespan
    for acts in schedule.actions:
        assert [a.microbatch for a in acts if a.op is Op.F] == list(range(m))


def test_zb_h1_bw_trails_bi_by_rank_and_splits_for_real():
    p, m = 4, 8
    schedule = zb_h1(p, m)
    for r, acts in enumerate(schedule.actions):
        compute = [a for a in acts if a.is_compute]
        for a in compute:
            if a.op is Op.BW and a.microbatch < m - r:  # the ones placed inside the loop, not the closing run
                ahead = [b for b in compute[:compute.index(a)] if b.op is Op.BI]
                assert len(ahead) == a.microbatch + 1 + r
    needs = runtime_needs(build_schedule("zb-h1", p, m))
    assert needs.split_backward and not needs.host_offload


def test_registry_entries_and_refusals():
    for name in ("zb-h1", "zb-h2"):
        entry = get_schedule(name)
        assert not entry.supports_virtual and entry.description
        assert set(entry.options) == {"offload_chunks", "offload_fraction", "offload_time"}
        with pytest.raises(ValueError, match="has no virtual stages"):
            build_schedule(name, 4, 8, 2)
        with pytest.raises(ValueError, match="rejects options"):
            build_schedule(name, 4, 8, bpipe_max_resident=3)
        with pytest.raises(ValueError, match="num_microbatches must be a positive int"):
            build_schedule(name, 4, 0)


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])
def test_offload_moves_stashes_off_the_first_ranks(name):
    plain = simulate(build_schedule(name, 4, 8))
    offloaded = simulate(build_schedule(name, 4, 8, offload_chunks=1))
    assert offloaded.peak_parked[0] > 0
    assert offloaded.peak_stash[0] < plain.peak_stash[0]
    assert runtime_needs(build_schedule(name, 4, 8, offload_chunks=1)).host_offload
