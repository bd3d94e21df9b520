"""papers/layered.py (arXiv 2106.02679): sharded weights are gathered per run of a chunk, so layered
accumulation's data-parallel bytes do not grow with m while depth-first ZeRO-3's do; the link the
network rows report is the one that leaves 5% of the step exposed."""

from megatron_pp.planning.papers.common import load_hardware_profile
from megatron_pp.planning.papers.layered import Timed, dp_bytes, load_variants, weight_runs
from megatron_pp.schedules.registry import build_schedule


def test_weight_runs_are_two_per_chunk_breadth_first_and_grow_with_m_depth_first():
    for m in (4, 8):
        bfs = build_schedule("looped-bfs", 4, m, 2, layered_grad_accumulation=True).actions[0]
        assert weight_runs(bfs) == {0: 2, 1: 1}  # F*.0 | F*.1 B*.1 | B*.0
    runs = [sum(weight_runs(build_schedule("interleaved-1f1b", 4, m, 2).actions[0]).values()) for m in (4, 8, 16)]
    assert runs[0] < runs[1] < runs[2]


def test_layered_traffic_is_constant_in_m_and_depth_first_zero3_grows():
    layered = [dp_bytes(load_variants(m)["looped-bfs"], m) for m in (8, 16)]
    depth_first = [dp_bytes(load_variants(m)["interleaved-1f1b"], m, sharded=True) for m in (8, 16)]
    zero1 = [dp_bytes(load_variants(m)["interleaved-1f1b"], m, sharded=False) for m in (8, 16)]
    assert layered[0] == layered[1] and zero1[0] == zero1[1]
    assert depth_first[1] > 2 * depth_first[0] > 0
    # ZeRO-3 sends the gradients once and gathers each chunk about twice: more bytes than ZeRO-1's one gather.
    assert zero1[0] < layered[0] < 2 * zero1[0]


def test_needed_link_leaves_five_percent_exposed():
    hw, _ = load_hardware_profile("a100-80gb")
    timed = Timed(load_variants(8)["looped-bfs"], hw, 8)
    need = timed.needed_gbps()
    at, below = timed.at(need), timed.at(need * 0.95)
    assert at["exposed"] <= 0.05 * at["step"] and below["exposed"] > 0.05 * below["step"]
    assert timed.at(10 * need)["step"] < at["step"] < timed.at(need / 10)["step"]
