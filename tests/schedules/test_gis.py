"""GIS family (PipeOffload, arXiv 2503.01328, §3): group-interleaved warm-ups, the rank-0 peak table, the
uniform repeating building block, registry names and option errors."""
from pathlib import Path

import pytest

from megatron_pp.schedules import gis as gis_module
from megatron_pp.schedules.comm import HOIST_TO_SEND_ONLY_BATCHES
from megatron_pp.schedules.generators import group_order, looped_placement
from megatron_pp.schedules.gis import building_block, gis, gis_warmup, min_group_size, uniform_repeating
from megatron_pp.schedules.ir import Action, Op
from megatron_pp.schedules.registry import build_schedule, get_schedule
from megatron_pp.schedules.simulate import simulate


def test_docstring_tables_are_the_generated_lists():
    doc = "\n".join(line.strip() for line in gis_module.__doc__.splitlines())
    assert gis(4, 8, 2).format_table() in doc
    assert gis(4, 8, 2, 1).format_table() in doc
    block = building_block(4, 2)
    assert (block.interval, block.forward, block.backward) == (6, (0, 1, 2, 3, 9, 10, 11, 12),
                                                               (28, 26, 24, 22, 19, 17, 15, 13))


def test_docstring_simulated_numbers():
    # "all three take 57 time units; rank 0 holds 8 ... under GIS, 7 under the uniform order and 11 ..."
    runs = {
        "gis": simulate(build_schedule("gis", 4, 8, 2)),
        "uniform": simulate(build_schedule("gis", 4, 8, 2, interleave_group_size=1)),
        "interleaved": simulate(build_schedule("interleaved-1f1b", 4, 8, 2)),
    }
    assert {k: r.makespan for k, r in runs.items()} == {"gis": 54.0, "uniform": 57.0, "interleaved": 57.0}
    assert {k: r.peak_stash[0] for k, r in runs.items()} == {"gis": 8, "uniform": 7, "interleaved": 11}


def _leading_forwards(actions) -> int:
    return next((i for i, a in enumerate(actions) if a.op is not Op.F), len(actions))


@pytest.mark.parametrize("p, m, v, g", [(4, 8, 2, 4), (4, 8, 4, 2), (8, 16, 2, 4), (3, 6, 3, 2), (2, 4, 2, 2),
                                        (5, 10, 2, 3), (4, 3, 2, 4), (4, 8, 1, 4)])
def test_group_interleaved_warmup_orders_and_split_backward(p, m, v, g):
    s = gis(p, m, v, g)
    order = group_order(m, v, g)
    assert s.placement == looped_placement(p, v)
    assert s.options == {"interleave_group_size": g, HOIST_TO_SEND_ONLY_BATCHES: True}
    for r, acts in enumerate(s.actions):
        assert [(a.microbatch, a.chunk) for a in acts if a.op is Op.F] == order
        assert [(a.microbatch, a.chunk) for a in acts if a.op is Op.BI] == [(i, v - 1 - c) for i, c in order]
        # The count: p·v − r − 1 warm-up forwards for g = p, then one more forward, then a backward.
        warmup = min(g * (v - 1) + p - r - 1, m * v)
        assert gis_warmup(p, v, g, r) == g * (v - 1) + p - r - 1
        assert _leading_forwards(acts) == min(warmup + 1, m * v)
        for i, a in enumerate(acts):  # BW right after its BI, never B
            assert a.op is not Op.B
            if a.op is Op.BI:
                assert acts[i + 1] == Action(Op.BW, a.microbatch, a.chunk)


# (d, v, g) -> rank-0 peak in chunk stashes, g(v−1) + d (arXiv 2503.01328, §3; docs/schedules.md).
PEAK_TABLE = [(4, 2, 4, 8), (4, 2, 2, 6), (4, 4, 4, 16), (4, 4, 2, 10), (8, 2, 8, 16), (8, 2, 4, 12), (8, 4, 8, 32),
              (8, 4, 4, 20)]


@pytest.mark.parametrize("d, v, g, peak", PEAK_TABLE)
def test_rank0_peak_table(d, v, g, peak):
    result = simulate(build_schedule("gis", d, 2 * d, v, interleave_group_size=g))
    assert result.peak_stash[0] == peak == g * (v - 1) + d
    assert result.peak_stash == [g * (v - 1) + d - r for r in range(d)]


@pytest.mark.parametrize("p, v", [(4, 2), (4, 4), (8, 2), (8, 4)])
def test_gis_and_gis_h_against_interleaved(p, v):
    m = 2 * p
    interleaved = simulate(build_schedule("interleaved-1f1b", p, m, v)).peak_stash[0]
    assert interleaved == v * p + p - 1
    assert simulate(build_schedule("gis", p, m, v)).peak_stash[0] == v * p  # = M, p − 1 fewer
    gis_h = simulate(build_schedule("gis-h", p, m, v)).peak_stash[0]
    assert gis_h == (p // 2) * (v - 1) + p  # (v+1)/(2v)·M for even p
    assert gis_h / interleaved < 0.6


def test_every_small_grid_point_builds_or_is_refused_with_a_reason():
    rejected = []
    for p in (1, 2, 3, 4, 5, 8):
        for v in (1, 2, 3):
            for m in sorted({1, 2, 3, p - 1, p, p + 1, 2 * p} - {0}):
                for g in sorted({1, *range(max(min_group_size(p), 2), p + 1)}):
                    try:
                        build_schedule("gis", p, m, v, interleave_group_size=g)
                    except ValueError as err:
                        assert "deadlocks: its last group holds" in str(err)
                        rejected.append((p, m, v, g))
    # Only short last groups are ever refused; m a multiple of g, m <= g, and g = 1 always build.
    assert all(g > 1 and m > g and m % g for p, m, v, g in rejected)


def test_uniform_order_runs_each_weight_gradient_right_after_its_input_gradient():
    # BW takes the slot after its BI, so nothing of the rank can come between them in its list.
    for p in (2, 3, 4, 5, 8):
        for v in (1, 2, 3, 4):
            for m in (1, p, 2 * p + 1):
                for acts in uniform_repeating(p, m, v).actions:
                    for i, a in enumerate(acts):
                        if a.op is Op.BI:
                            assert acts[i + 1] == Action(Op.BW, a.microbatch, a.chunk), (p, v, m, i)


def test_a_short_last_group_that_deadlocks_is_refused_up_front():
    # The small grid above has none; p = 6, v = 3, groups of 3 and m = 4 (a last group of one) is the first.
    with pytest.raises(ValueError, match=r"^gis with p=6, m=4, v=3, group size 3 deadlocks: its last group holds 1 "
                                         r"microbatch\(es\); use m a multiple of 3 or m <= 3 \(schedule 'gis' deadlocks: rank 0"):
        build_schedule("gis", 6, 4, 3, interleave_group_size=3)
    for m in (3, 6):  # m <= g and a multiple of g build
        build_schedule("gis", 6, m, 3, interleave_group_size=3)
    # Two chunks per rank: p = 8, groups of 4, m = 6.
    with pytest.raises(ValueError, match=r"^gis with p=8, m=6, v=2, group size 4 deadlocks: its last group holds 2 "):
        build_schedule("gis", 8, 6, 2, interleave_group_size=4)


@pytest.mark.parametrize("p, v", [(1, 1), (1, 4), (2, 2), (2, 4), (3, 2), (4, 1), (4, 2), (4, 4), (5, 3), (8, 4),
                                  (8, 16), (6, 5)])
def test_building_block_packs_every_slot(p, v):
    block = building_block(p, v)
    interval, f, b = block.interval, block.forward, block.backward
    assert interval == 3 * v
    stages = p * v
    assert f[0] == 0 and all(f[s] > f[s - 1] for s in range(1, stages))
    assert b[-1] == f[-1] + 1 and all(b[s] >= b[s + 1] + 1 for s in range(stages - 1))
    for r in range(p):
        slots = [f[s] % interval for s in range(r, stages, p)]
        slots += [t % interval for s in range(r, stages, p) for t in (b[s], b[s] + 1)]
        assert sorted(slots) == list(range(interval)), (p, v, r)  # every slot used once: no steady bubble
        assert all(f[s] % 3 == r % 3 and b[s] % 3 == (r + 1) % 3 for s in range(r, stages, p))


@pytest.mark.parametrize("p, m, v", [(8, 16, 4), (8, 16, 2), (3, 6, 2), (4, 8, 4), (4, 8, 2), (2, 4, 4)])
def test_uniform_order_has_no_steady_state_bubble(p, m, v):
    s = build_schedule("gis", p, m, v, interleave_group_size=1)
    block = building_block(p, v)
    result = simulate(s)
    assert result.busy == [3.0 * m * v] * p
    # Running as soon as inputs allow is never later than the block's timing, which has waits built in.
    assert result.makespan <= (m - 1) * block.interval + block.backward[0] + 2
    # One more microbatch costs exactly one interval, 3v slots: every rank is busy in the steady state.
    longer = simulate(build_schedule("gis", p, m + 1, v, interleave_group_size=1))
    assert longer.makespan - result.makespan == 3 * v


def test_uniform_order_peaks_like_gis_h():
    # Unoffloaded, the uniform order holds what GIS-H holds on rank 0 when the ring needs no long shifts.
    assert simulate(build_schedule("gis", 8, 16, 4, interleave_group_size=1)).peak_stash[0] == 20 == 4 * 3 + 8
    assert simulate(build_schedule("gis", 8, 24, 16, interleave_group_size=1)).peak_stash[0] == 68 == 4 * 15 + 8
    assert simulate(build_schedule("gis", 4, 8, 4, interleave_group_size=1)).peak_stash[0] == 12


def test_registry_names_options_and_aliases():
    assert get_schedule("gis").options == ("interleave_group_size", "offload_chunks", "offload_fraction",
                                           "offload_time")
    assert get_schedule("gis-h").options == ("offload_chunks", "offload_fraction", "offload_time")
    assert get_schedule("po-h").options == get_schedule("po-f").options == ("offload_time",)
    assert build_schedule("gis", 4, 8, 2).options == {"interleave_group_size": 4, HOIST_TO_SEND_ONLY_BATCHES: True}
    assert build_schedule("gis-h", 5, 6, 2).options == {"interleave_group_size": 3, HOIST_TO_SEND_ONLY_BATCHES: True}
    gis_h = build_schedule("gis-h", 4, 8, 4)
    assert gis_h.name == "gis-h" and gis_h.actions == build_schedule("gis", 4, 8, 4, interleave_group_size=2).actions
    # p = 2: ceil(p/2) = 1, so GIS-H is the uniform order.
    assert build_schedule("gis-h", 2, 4, 2).actions == build_schedule("gis", 2, 4, 2, interleave_group_size=1).actions
    assert build_schedule("po-h", 4, 8, 4).options == {"interleave_group_size": 1, HOIST_TO_SEND_ONLY_BATCHES: True,
                                                       "offload_chunks": 2,
                                                       "offload_time": 0.25}
    assert build_schedule("po-f", 4, 8, 3).options["offload_chunks"] == 3


@pytest.mark.parametrize("g", [0, 2, 3, 9, True, 4.0])
def test_group_size_errors_name_the_flag(g):
    with pytest.raises(ValueError, match=r"--interleave-group-size must be 1 .* between ceil\(p/2\) = 4 and p = 8"):
        build_schedule("gis", 8, 16, 2, interleave_group_size=g)


def test_one_layer_per_chunk_places_layer_i_on_rank_i_mod_p():
    from megatron_pp.models.layout import split_layers

    s = build_schedule("po-f", 4, 4, 3)
    layout = split_layers(12, 4, 3)
    for rank in range(4):
        layers = sorted(i for c in range(3) for i in layout[s.stage_of(rank, c)].layers)
        assert layers == [i for i in range(12) if i % 4 == rank]


def test_docs_page_has_the_gis_sections_and_matrix_rows():
    page = (Path(__file__).resolve().parents[2] / "docs" / "schedules.md").read_text()
    for name in ("`gis`", "`gis-h`", "`po-h`", "`po-f`"):
        assert f"| {name}" in page, name
    assert gis(4, 8, 2).format_table() in page


def test_docs_figures_offload_gain_and_bubble_at_p8():
    """docs/schedules.md quotes these simulated figures: at p = 8, v = 4, offloading chunk 0 cuts rank 0's
    peak 35% under the uniform order (its first chunks hold most of its memory) and 25% under the group
    order; at p = 8, v = 5, m = 64 GIS's bubble is 0.014 against interleaved 1F1B's 0.021."""
    def cut(**options):
        before = simulate(build_schedule("gis", 8, 8, 4, **options)).peak_stash[0]
        after = simulate(build_schedule("gis", 8, 8, 4, offload_chunks=1, **options)).peak_stash[0]
        return round(1 - after / before, 2)

    assert cut(interleave_group_size=1) == 0.35 and cut() == 0.25
    bubble = {name: round(simulate(build_schedule(name, 8, 64, 5)).bubble_fraction, 3)
              for name in ("gis", "interleaved-1f1b")}
    assert bubble == {"gis": 0.014, "interleaved-1f1b": 0.021}
