"""V-shape schedules (schedules/vshape.py): the docstring's tables and numbers, the zb-v formulas and
v-half's bubble and memory on the simulator at equal and unequal costs, the V placement's local hand-off,
chunk-count and BPipe refusals, offload of the V's first chunk, and the layer split's flags under the V placement."""
import argparse

import pytest

from megatron_pp.models.layout import LayoutError, split_layers
from megatron_pp.schedules import vshape
from megatron_pp.schedules.ir import COMM_OPS, Op
from megatron_pp.schedules.registry import build_schedule, get_schedule
from megatron_pp.schedules.simulate import CostModel, simulate
from megatron_pp.schedules.vshape import v_half, v_half_budget, v_placement, zb_v
from megatron_pp.training.arguments import build_parser, num_chunks, validate_args


def _parse(argv):
    return build_parser().parse_args(argv)


def _idle(result, work):
    """Idle time of the busiest rank: makespan minus its compute (every V rank computes the same)."""
    return result.makespan - work


def test_docstring_tables_block_and_numbers():
    doc = "\n".join(line.strip() for line in vshape.__doc__.splitlines())
    assert zb_v(4, 8).format_table() in doc
    assert v_half(4, 8).format_table() in doc
    # "zb-v 51 and 8, v-half 55 and 6, 1F1B 66 and 8, interleaved 1F1B 57 and 11"
    runs = {name: simulate(build_schedule(name, 4, 8, 2)) for name in ("zb-v", "v-half")}
    runs["1f1b"] = simulate(build_schedule("1f1b", 4, 8), CostModel(forward=2, backward=4))
    runs["interleaved-1f1b"] = simulate(build_schedule("interleaved-1f1b", 4, 8, 2))
    # 1F1B counts full stashes; one is two chunk stashes of the V.
    peaks = {k: r.peak_stash[0] * (2 if k == "1f1b" else 1) for k, r in runs.items()}
    assert {k: r.makespan for k, r in runs.items()} == {"zb-v": 51, "v-half": 55, "1f1b": 66, "interleaved-1f1b": 57}
    assert peaks == {"zb-v": 8, "v-half": 6, "1f1b": 8, "interleaved-1f1b": 11}


@pytest.mark.parametrize("name", ["zb-v", "v-half"])
@pytest.mark.parametrize("p, m", [(2, 1), (2, 5), (3, 4), (4, 3), (4, 8), (5, 9), (8, 16)])
def test_v_placement_lists_and_local_hand_off(name, p, m):
    s = build_schedule(name, p, m, 2)
    assert s.placement == v_placement(p) and s.location(0) == s.location(2 * p - 1)[:1] + (0,)
    for r, acts in enumerate(s.actions):
        for op in (Op.F, Op.BI, Op.BW):
            assert sorted((a.microbatch, a.chunk) for a in acts if a.op is op) == [(j, c) for j in range(m)
                                                                                  for c in (0, 1)]
        assert not any(a.op is Op.B for a in acts)
    # Stage p-1 -> p is the turn of the V on rank p-1: handed over in memory, no message on any link.
    turn = [a for a in s.actions[p - 1] if a.op in COMM_OPS and
            ((a.op in (Op.RECV_F, Op.SEND_B) and a.chunk == 1) or (a.op in (Op.SEND_F, Op.RECV_B) and a.chunk == 0))]
    assert turn == []


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_zb_v_formula_at_equal_costs(p):
    """m >= 2p-1, T_F = T_B >= T_W: makespan 2m(T_F+T_B+T_W) + (p-1) T_F, every rank peaks at 2p."""
    for m in (2 * p - 1, 2 * p, 3 * p + 1):
        s = build_schedule("zb-v", p, m, 2)
        for t_f, t_w in ((1.0, 1.0), (1.0, 0.5), (2.0, 1.5)):
            r = simulate(s, CostModel(forward=t_f, backward_input=t_f, backward_weight=t_w))
            assert r.makespan == pytest.approx(2 * m * (2 * t_f + t_w) + (p - 1) * t_f), (p, m, t_f, t_w)
            assert r.peak_stash == [2 * p] * p


@pytest.mark.parametrize("p, m", [(2, 4), (4, 9), (8, 16)])
@pytest.mark.parametrize("t_f, t_b, t_w", [(1, 2, 1), (2, 1, 1), (1, 1.5, 0.5), (1, 0.8, 1.2), (1, 1.16, 0.96)])
def test_zb_v_bounds_at_unequal_costs(p, m, t_f, t_b, t_w):
    """Idle per rank within [(p-1) T_F, (p-1)(T_F + max(T_F, T_B, T_W))], also with unequal stage costs
    (heavier first and last stages: embedding, head and loss), where T is the largest stage's time."""
    s = build_schedule("zb-v", p, m, 2)
    for weights in (None, [1.3] + [1.0] * (2 * p - 2) + [1.6]):
        r = simulate(s, CostModel(forward=t_f, backward_input=t_b, backward_weight=t_w, stage_weights=weights))
        scale_hi = 1.0 if weights is None else max(weights)
        idle = _idle(r, max(r.busy))
        assert idle <= (p - 1) * (t_f + max(t_f, t_b, t_w)) * scale_hi + 1e-9, (weights, idle)
        if weights is None:
            assert idle >= (p - 1) * t_f - 1e-9
        # Never worse than 1F1B on the same model (its stage s is the V's stages s and 2p-1-s).
        merged = None if weights is None else [weights[k] + weights[2 * p - 1 - k] for k in range(p)]
        one_f_one_b = simulate(build_schedule("1f1b", p, m), CostModel(
            forward=t_f if merged else 2 * t_f, backward=(t_b + t_w) if merged else 2 * (t_b + t_w),
            stage_weights=merged))
        assert r.makespan <= one_f_one_b.makespan


def _one_f_one_b_idle(p, m):
    """1F1B's idle time per rank on the V's model: its stage s is the V's stages s and 2p-1-s (F 2, B 4)."""
    r = simulate(build_schedule("1f1b", p, m), CostModel(forward=2, backward=4))
    return r.makespan - max(r.busy)


def _list_peak(actions):
    """Most stashes a rank's list holds at once: one from each F until its BW (whatever the durations, as
    one compute stream runs the list in order)."""
    live = peak = 0
    for a in actions:
        live += {Op.F: 1, Op.BW: -1}.get(a.op, 0)
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("p, m, idle, peak", [(4, 8, 7, 6), (4, 9, 7, 6), (4, 16, 7, 6), (4, 32, 7, 6),
                                              (8, 16, 21, 10), (8, 17, 21, 10), (8, 32, 21, 10), (10, 20, 27, 12)])
def test_v_half_pinned_bubble_and_memory_at_equal_costs(p, m, idle, peak):
    """The documented numbers (ours): idle per rank 7 at p = 4 and 21 at p = 8 (1F1B: 18 and 42), every
    rank at the paper's V-Half memory, ceil((p+2)/2) full stashes = 6 and 10 chunk stashes. p = 10 (27,
    1F1B 54) is where the warm-up reserve's growth with the rank shows (2 + r // 3 gives 29 there)."""
    r = simulate(build_schedule("v-half", p, m, 2))
    assert (_idle(r, 6 * m), r.peak_stash) == (idle, [peak] * p)
    assert _one_f_one_b_idle(p, m) == 6 * (p - 1)


@pytest.mark.parametrize("p", range(2, 9))
def test_v_half_halves_1f1b_bubble_within_the_v_half_budget(p):
    """m >= 2p: idle time per rank at most 0.55 x 1F1B's on the same model, every rank's peak within the
    paper's V-Half memory (2405.15362: ceil((p+2)/2) microbatches' activations, twice that in chunk stashes)."""
    assert v_half_budget(p) == 2 * -(-(p + 2) // 2)
    for m in (2 * p, 2 * p + 1, 3 * p, 4 * p):
        r = simulate(build_schedule("v-half", p, m, 2))
        assert _idle(r, 6 * m) <= 0.55 * _one_f_one_b_idle(p, m), m
        assert max(r.peak_stash) <= v_half_budget(p), m


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8, 12])
def test_v_half_every_m_completes_within_the_budget(p):
    """The replay never stalls and never exceeds the budget, small m included (m < 2p: the first ranks
    wait for the first round trip, as in every flushed schedule)."""
    for m in range(1, 3 * p + 2):
        s = v_half(p, m)
        assert all(len(acts) == 6 * m for acts in s.actions), m
        assert max(_list_peak(acts) for acts in s.actions) == min(v_half_budget(p), 2 * m), m


def test_v_half_assumes_equal_operation_costs():
    """Ours, and documented: the replay derives the order at T_F = T_B = T_W, and its steady state runs at
    the memory budget with no slack, so with unequal costs its idle time grows with m (zb-v's, with twice
    the memory, does not). If this starts failing, the docs' warning can go."""
    costs = CostModel(forward=1, backward_input=1.2, backward_weight=0.8)
    idle = {m: _idle(simulate(build_schedule("v-half", 4, m, 2), costs), 6 * m) for m in (8, 16)}
    assert idle[16] > idle[8] + 1
    zb = {m: _idle(simulate(build_schedule("zb-v", 4, m, 2), costs), 6 * m) for m in (8, 16)}
    assert zb[16] == pytest.approx(zb[8])


def test_the_v_balances_memory_so_bpipe_is_refused():
    for p, m in ((4, 8), (8, 32)):
        for name in ("zb-v", "v-half"):
            peaks = simulate(build_schedule(name, p, m, 2)).peak_stash
            assert max(peaks) - min(peaks) <= 2, (name, peaks)
    with pytest.raises(ValueError, match="--bpipe-max-resident does not apply to --pipeline-schedule zb-v"):
        build_schedule("zb-v", 4, 8, 2, bpipe_max_resident=3)


@pytest.mark.parametrize("name", ["zb-v", "v-half"])
def test_offload_takes_the_first_chunk_of_the_v(name):
    s = build_schedule(name, 4, 8, 2, offload_chunks=1)
    moved = {(r, a.chunk) for r, acts in enumerate(s.actions) for a in acts if a.op is Op.OFFLOAD}
    assert moved and {c for _, c in moved} == {0}
    assert (0, 0) in moved  # rank 0's first chunk, stage 0, lives longest
    before, after = simulate(build_schedule(name, 4, 8, 2)), simulate(s)
    assert after.peak_stash[0] < before.peak_stash[0]
    # The figures docs/schedules.md quotes (copies of 0.25 forward), makespans unchanged.
    assert (before.peak_stash, after.peak_stash) == {"zb-v": ([8] * 4, [2, 4, 6, 7]),
                                                     "v-half": ([6] * 4, [3, 4, 5, 6])}[name]
    assert after.makespan == before.makespan


def test_two_chunks_per_rank_by_default_and_one_line_errors():
    assert get_schedule("zb-v").chunks_per_rank == 2 and get_schedule("v-half").chunks_per_rank == 2
    with pytest.raises(ValueError, match="--num-layers-per-virtual-pipeline-stage") as err:
        build_schedule("zb-v", 4, 8, 1)
    assert "\n" not in str(err.value)
    base = ["--model-preset", "gpt-tiny", "--mock-data", "--num-layers", "8", "--micro-batch-size", "1",
            "--global-batch-size", "8", "--pipeline-model-parallel-size", "2", "--train-iters", "1"]
    args = _parse(base + ["--pipeline-schedule", "v-half"])
    assert num_chunks(args, argparse.Namespace(num_layers=8)) == 2
    assert validate_args(args, world_size=2) == []
    # 8 layers, 1 per virtual stage: 4 chunks per rank, not the V's 2.
    errors = validate_args(_parse(base + ["--pipeline-schedule", "zb-v", "--num-layers-per-virtual-pipeline-stage",
                                              "1"]), world_size=2)
    assert len(errors) == 1 and "--num-layers-per-virtual-pipeline-stage" in errors[0] and "got 4" in errors[0]
    ok = _parse(base + ["--pipeline-schedule", "zb-v", "--num-layers-per-virtual-pipeline-stage", "2"])
    assert validate_args(ok, world_size=2) == []


def test_uneven_layer_flags_follow_the_v_placement():
    """The first/last-stage flags count the layers of the rank holding the embedding / the head: under the V
    that is rank 0 for both, so one flag at most; given alone it sizes rank 0's two stages."""
    v = v_placement(2)
    specs = split_layers(10, 2, 2, first_stage_layers=2, placement=v)
    assert [s.num_layers for s in specs] == [1, 4, 4, 1]  # rank 0: stages 0 and 3; rank 1: stages 1 and 2
    assert [s.num_layers for s in split_layers(10, 2, 2, first_stage_layers=2)] == [1, 4, 1, 4]
    with pytest.raises(LayoutError, match="V placement"):
        split_layers(10, 2, 2, first_stage_layers=2, last_stage_layers=2, placement=v)
    base = ["--model-preset", "gpt-tiny", "--mock-data", "--num-layers", "10", "--micro-batch-size", "1",
            "--global-batch-size", "8", "--pipeline-model-parallel-size", "2", "--train-iters", "1",
            "--pipeline-schedule", "zb-v", "--decoder-first-pipeline-num-layers", "2"]
    assert validate_args(_parse(base), world_size=2) == []
    errors = validate_args(_parse(base + ["--decoder-last-pipeline-num-layers", "2"]), world_size=2)
    assert any("name the same rank" in e for e in errors)
