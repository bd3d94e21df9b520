"""Breadth-first pipeline parallelism (arXiv 2211.05953): its claims at full scale from the paper's
config, and the small-scale stash, bubble and reduction-count trends."""
from __future__ import annotations

import statistics

from megatron_pp.planning.efficiency import BF16_BYTES, HardwareProfile, LayerShape, Roofline
from megatron_pp.planning.memory import stage_state_bytes
from megatron_pp.planning.papers.common import (GB, PaperReport, Row, Setting, Trend, chunk_costs,
                                                load_hardware_profile, load_setting, relative_error)
from megatron_pp.planning.papers.small import SmallScale, peak_trend, ratio_trend, simulated_bubble, tiny_config
from megatron_pp.schedules.ir import Op
from megatron_pp.schedules.registry import build_schedule
from megatron_pp.schedules.simulate import CostModel, simulate




def _bfs_step(setting: Setting, hw: HardwareProfile) -> tuple[float, float, float]:
    """(step seconds, bubble, exposed DP seconds) of one breadth-first config variant."""
    from megatron_pp.schedules.looped import exposed_reduction

    name = setting.args.pipeline_schedule
    chunks = setting.chunks()
    specs = setting.stages(chunks)
    shape = LayerShape.from_config(setting.config, setting.tp, setting.args.sequence_parallel)
    layer = Roofline(shape, hw, setting.attention).layer_times(setting.micro_batch)
    costs = chunk_costs(setting, hw, specs, layer, 1.0, False, recompute=setting.recompute)
    rows = setting.config.seq_length * setting.micro_batch
    latency = rows * setting.config.hidden_size * BF16_BYTES / (hw.pair_link_gbps * GB)
    options = {"layered_grad_accumulation": True} if name == "looped-bfs" else {}
    schedule = build_schedule(name, setting.pp, setting.microbatches, chunks, **options)
    model = CostModel(measured=costs, p2p_latency=latency)
    sim = simulate(schedule, model)
    # Data parallelism inside a node (Megatron's rank order puts dp inside pp): ring reduce-scatter of fp32
    # gradients, plus for ZeRO-3 an all-gather of bf16 weights per pass (forward and backward).
    params = [stage_state_bytes(setting.config, s, tp=setting.tp, dp=1) / 18 for s in specs]
    w = setting.dp
    ring = (w - 1) / w / (hw.tp_link_gbps * GB)
    per_chunk = [p * (4 + (2 * 2 if name == "looped-bfs" else 2)) * ring for p in params]
    if name == "looped-bfs":
        exposed = max(exposed_reduction(schedule, max(per_chunk), model))
    else:
        exposed = sum(per_chunk[s.stage] for s in specs if s.stage % setting.pp == 0)
    return sim.makespan + exposed, sim.bubble_fraction, exposed


def predict_breadth_first(hardware: str = "a100-80gb") -> PaperReport:
    hw, _ = load_hardware_profile(hardware)
    report = PaperReport(
        "breadth-first", "Breadth-first pipeline parallelism, 52B on 64 A100 (Lamy-Poirier, MLSys 2023)",
        f"no absolute figure taken from the paper; roofline on {hw.name} with matmul efficiency "
        f"{hw.matmul_efficiency}. Nothing fitted.")
    steps = {v: _bfs_step(load_setting("breadth_first_52b", v), hw) for v in ("looped-bfs", "interleaved-1f1b", "1f1b")}
    for baseline in ("1f1b", "interleaved-1f1b"):
        gain = steps[baseline][0] / steps["looped-bfs"][0] - 1
        report.rows.append(Row(f"52B, 1 sample per GPU: looped-bfs throughput gain over {baseline}",
                               "up to +43% over Megatron-LM (its best configuration, not used here)",
                               f"{100 * gain:+.0f}% (bubble {100 * steps['looped-bfs'][1]:.0f}% vs "
                               f"{100 * steps[baseline][1]:.0f}%, exposed DP {steps['looped-bfs'][2] * 1e3:.0f} vs "
                               f"{steps[baseline][2] * 1e3:.0f} ms)", relative_error(1 + gain, 1.43)))
    report.notes.append("The comparison is at one layout (pp 8 × dp 8); the paper's Megatron-LM baseline was "
                        "tuned separately (tensor parallelism, microbatch), which is not modelled.")
    return report


def small_scale_breadth_first(report: PaperReport, small: SmallScale, quick: bool = True) -> None:
    """Breadth-first's trends at small scale."""
    cfg = tiny_config()
    peaks = peak_trend(report, small, "breadth-first", cfg, [
        ("1f1b", "1f1b", 4, 8, 1, {}, "none"),
        ("looped-bfs v=2", "looped-bfs", 4, 8, 2, {"checkpoint_layer_inputs": False}, "none")])
    ratio_trend(report, "breadth-first: worst-rank stash, looped-bfs / 1F1B", "pp 4, m 8", peaks["looped-bfs v=2"],
                 peaks["1f1b"])
    wide = tiny_config(hidden=256, heads=8, seq=128, vocab=2048)
    for v in ((1, 4) if quick else (1, 2, 4)):
        name = "1f1b" if v == 1 else "looped-bfs"
        options = {} if v == 1 else {"checkpoint_layer_inputs": False}
        measured = small.run(wide, name, 2, 4, v, options, 1, 3, world=2)
        bubble = statistics.median(1 - r["busy_s"] / r["wall_s"] for r in measured if r["wall_s"] > 0)
        predicted = simulated_bubble(name, 2, 4, v, options)
        report.trends.append(Trend(f"bubble vs v ({name})", f"pp 2, m 4, v {v}, h 256, s 128 (2 processes)",
                                   f"{100 * bubble:.0f}%", f"{100 * predicted:.0f}%", None))
    counts = []
    for m in (4, 8, 16):
        lists = build_schedule("looped-bfs", 4, m, 2, layered_grad_accumulation=True).actions
        counts.append(f"m={m}: {sum(a.op == Op.REDUCE_GRAD for a in lists[0])}")
    report.trends.append(Trend(
        "DP reductions per step vs m (layered accumulation)", "looped-bfs, pp 4, v 2, one group",
        "bytes measured by tools/bench_layered.py traffic (docs/layered.md), not by this tool",
        "REDUCE_GRAD per rank in the lists: " + ", ".join(counts) + " (one per chunk: independent of m)"))
