"""PipeOffload (arXiv 2503.01328): Figure 15's cells simulated from the paper's configs, and the
small-scale stash trends of its schedules."""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from megatron_pp.planning.efficiency import HardwareProfile, LayerShape, LayerTimes, Roofline
from megatron_pp.planning.memory import stage_state_bytes, stash_bytes
from megatron_pp.planning.papers.common import (GB, GIB, PaperReport, Row, Setting, chunk_costs, load_hardware_profile,
                                                load_setting, relative_error)
from megatron_pp.planning.papers.small import SmallScale, peak_trend, ratio_trend, tiny_config
from megatron_pp.schedules.ir import Op
from megatron_pp.schedules.registry import build_schedule
from megatron_pp.schedules.simulate import CostModel, simulate



PIPEOFFLOAD_METHODS = ("1f1b-i", "gis", "gis-h", "po-h", "po-f", "1f1b")


def _cells(*values: Optional[tuple[int, int]]) -> dict:
    return dict(zip(PIPEOFFLOAD_METHODS, values))


# PipeOffload's Figure 15 (arXiv 2503.01328; MFU %, activation GB, read from a figure). None = OOM / not run / SKIP.
FIGURE_15 = {
    ("10.5b", 4096): _cells((65, 15), (65, 13), (63, 8), (59, 3), None, (57, 12)),
    ("10.5b", 8192): _cells((68, 30), (68, 27), (65, 16), (61, 6), None, (59, 24)),
    ("10.5b", 16384): _cells(None, None, (68, 32), (63, 12), (59, 9), (62, 48)),
    ("18.1b", 4096): _cells((64, 24), (65, 19), (63, 13), (59, 4), None, (56, 18)),
    ("18.1b", 8192): _cells((66, 49), (67, 38), (66, 25), (62, 8), None, (58, 37)),
    ("42.9b", 4096): _cells((63, 49), (65, 34), (64, 25), (62, 10), (58, 5), (55, 33)),
}


def _model_flops(setting: Setting, layer: LayerTimes, m: int) -> float:
    """Model FLOPs of one step per pipeline (per tensor-parallel rank), Megatron's convention."""
    cfg = setting.config
    logits = 3 * 2 * cfg.seq_length * setting.micro_batch * cfg.hidden_size * cfg.padded_vocab_size(setting.tp)
    return m * (cfg.num_layers * layer.model_flops + logits / setting.tp)


def simulate_pipeoffload(model: str, seq: int, method: str, hw: HardwareProfile, pcie_gbps: float,
                         scale: float = 1.0, activation: Optional[str] = None) -> tuple[float, float, float]:
    """(MFU, activation bytes of the worst rank, total bytes of the worst rank) of one Figure 15 cell;
    `activation` replaces the config's MLP activation (a sensitivity check of the assumed SwiGLU)."""
    setting = load_setting(f"pipeoffload_{model}", method, **{"seq-length": seq})
    if activation is not None:
        setting.config = dataclasses.replace(setting.config, activation=activation)
    chunks = setting.chunks()
    specs = setting.stages(chunks)
    shape = LayerShape.from_config(setting.config, setting.tp, setting.args.sequence_parallel)
    layer = Roofline(shape, hw, "flash").layer_times(setting.micro_batch)
    m = setting.microbatches
    split = method not in ("1f1b-i", "1f1b")
    costs = chunk_costs(setting, hw, specs, layer, scale, split)
    stash = [stash_bytes(setting.config, s, setting.micro_batch, tp=setting.tp, attention="flash") for s in specs]
    options = {}
    if method in ("po-h", "po-f"):
        # One-way transfer of a one-layer chunk's stash over PCIe, against that chunk's forward time.
        typical = max(range(len(specs)), key=lambda s: specs[s].num_layers)
        seconds = stash[typical] / (pcie_gbps * GB)
        options["offload_time"] = seconds / costs[(Op.F, typical)]
        for s in range(len(specs)):
            costs[(Op.OFFLOAD, s)] = costs[(Op.RELOAD, s)] = stash[s] / (pcie_gbps * GB)
    name = {"1f1b-i": "interleaved-1f1b"}.get(method, method)
    schedule = build_schedule(name, setting.pp, m, chunks if name != "1f1b" else 1, **options)
    if name == "1f1b":
        specs = setting.stages(1)
        costs = chunk_costs(setting, hw, specs, layer, scale, False)
        stash = [stash_bytes(setting.config, s, setting.micro_batch, tp=setting.tp, attention="flash") for s in specs]
    sim = simulate(schedule, CostModel(measured=costs, stash_bytes=stash))
    mfu = _model_flops(setting, layer, m) / (setting.pp * sim.makespan * hw.peak_tflops * 1e12)
    per_rank_state = [0.0] * setting.pp
    for s in specs:
        per_rank_state[schedule.placement[s.stage][0]] += stage_state_bytes(setting.config, s, tp=setting.tp,
                                                                            dp=setting.dp, bf16=True)
    total = max(per_rank_state[r] + sim.peak_bytes[r] for r in range(setting.pp))
    return mfu, max(sim.peak_bytes), total


def predict_pipeoffload(hardware: str = "a100-80gb", cells: Optional[Sequence[tuple[str, int]]] = None) -> PaperReport:
    hw, raw = load_hardware_profile(hardware, "fp16")
    cells = list(cells or FIGURE_15)
    report = PaperReport(
        "pipeoffload", "PipeOffload Figure 15, MFU and activation memory (Wan et al., ICML 2025)",
        f"roofline on {hw.name} (fp16 peak {hw.peak_tflops:g} TFLOP/s), then one compute-time factor per (model, "
        "sequence) chosen so that the paper's **1F1B-I** (Megatron interleaved, its baseline) MFU is matched; GIS, "
        f"GIS-H, PO-H, PO-F and 1F1B are predicted with that factor. PCIe {raw['pcie_gbps']} GB/s one-way "
        "(PipeOffload's A100 constant). Activation memory: planning.memory (Megatron numerics, flash attention, "
        "no recompute) weighed by the simulated stash curve.")
    for model, seq in cells:
        published = FIGURE_15[(model, seq)]
        base_mfu, base_act, _ = simulate_pipeoffload(model, seq, "1f1b-i", hw, raw["pcie_gbps"])
        reference = published["1f1b-i"]
        scale = base_mfu / (reference[0] / 100) if reference else 1.0
        if reference:
            _, gelu_act, _ = simulate_pipeoffload(model, seq, "1f1b-i", hw, raw["pcie_gbps"], activation="gelu")
            setting = load_setting(f"pipeoffload_{model}", "1f1b-i", **{"seq-length": seq})
            layer = next(s for s in setting.stages(setting.chunks()) if s.num_layers == 1 and not s.has_head
                         and not s.has_embedding)
            tokens_h = seq * setting.micro_batch * setting.config.hidden_size
            # Saved bytes per token per h of one layer: our formula's, and what the published figure implies
            # when its stash count is the simulated one (published / predicted scales the per-layer bytes).
            ours = stash_bytes(setting.config, layer, setting.micro_batch, tp=setting.tp, attention="flash") / tokens_h
            implied = ours * reference[1] * GB / base_act
            report.rows.append(Row(
                f"{model.upper()} seq {seq // 1024}k 1f1b-i: saved bytes per token per h of a layer",
                f"≈ {implied:.0f} (implied by {reference[1]} GB)",
                f"{ours:.0f} with the config's SwiGLU (ffn 4h); {gelu_act / base_act * ours:.0f} with GELU "
                f"(activation {gelu_act / GB:.1f} GB)", relative_error(ours, implied)))
        for method in PIPEOFFLOAD_METHODS:
            mfu, act, total = simulate_pipeoffload(model, seq, method, hw, raw["pcie_gbps"], scale)
            cell = published[method]
            fits = total <= hw.memory_gib * GIB * 0.9
            pred = f"MFU {100 * mfu:.0f}%, activation {act / GB:.1f} GB{'' if fits else ', OOM'}"
            if cell is None:
                pub = "OOM / not run / SKIP"
                report.rows.append(Row(f"{model.upper()} seq {seq // 1024}k {method}", pub, pred))
                continue
            pub = f"MFU {cell[0]}%, activation {cell[1]} GB"
            if method == "1f1b-i":
                pred += " (MFU calibrated)"
            report.rows.append(Row(f"{model.upper()} seq {seq // 1024}k {method} MFU", pub, pred,
                                   None if method == "1f1b-i" else relative_error(mfu, cell[0] / 100)))
            report.rows.append(Row(f"{model.upper()} seq {seq // 1024}k {method} activation", f"{cell[1]} GB",
                                   f"{act / GB:.1f} GB", relative_error(act / GB, float(cell[1]))))
            if method != "1f1b-i" and reference:
                ratio, published_ratio = act / base_act, cell[1] / reference[1]
                report.rows.append(Row(f"{model.upper()} seq {seq // 1024}k {method} activation / 1F1B-I",
                                       f"{published_ratio:.2f}", f"{ratio:.2f}",
                                       relative_error(ratio, published_ratio)))
    report.notes.append("Cells where 1F1B-I has no published result (OOM at 16k) use the uncalibrated roofline "
                        f"(matmul efficiency {hw.matmul_efficiency}).")
    report.notes.append("Figure 15's cells are read from a figure (arXiv 2503.01328); single cells are "
                        "indicative. The paper recomputes LayerNorm/GeLU/dropout in its offloading runs "
                        "(34 → 20·s·b·h bytes per layer), which planning.memory does not model.")
    return report


def small_scale_pipeoffload(report: PaperReport, small: SmallScale, quick: bool = True) -> None:
    """PipeOffload's stash trends at small scale against 1F1B-I."""
    cfg = tiny_config()
    runs = [("1f1b-i", "interleaved-1f1b", 4, 8, 2, {}, "none"), ("gis-h", "gis-h", 4, 8, 2, {}, "none"),
            ("po-h", "po-h", 4, 8, 2, {}, "none"), ("po-f", "po-f", 4, 8, 2, {}, "none")]
    peaks = peak_trend(report, small, "PipeOffload", cfg, runs)
    for key in ("gis-h", "po-h", "po-f"):
        ratio_trend(report, f"PipeOffload: worst-rank stash, {key} / 1F1B-I", "pp 4, m 8, v 2", peaks[key],
                     peaks["1f1b-i"])
