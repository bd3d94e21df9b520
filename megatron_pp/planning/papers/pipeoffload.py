"""PipeOffload (arXiv 2503.01328): the cells of Figures 10, 11 and 15 that the paper's configs reproduce,
simulated from those configs with one calibration for all of them, and the small-scale stash trends of its
schedules.

The one calibration is the A100 profile's matmul efficiency, PipeOffload's own 220 TFLOP/s (the constant of
its Eq. 1 for k); nothing is fitted to a figure. Offload copies take a stash's bytes over the profile's
one-way PCIe bandwidth against those same compute times, so k (Figure 1) comes out of the model rather than
being set by a fit. Where the paper leaves a model choice open (the MLP shape), the rows show what the
alternative would change."""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

from megatron_pp.planning.efficiency import HardwareProfile, LayerShape, LayerTimes, Roofline
from megatron_pp.planning.memory import layer_activation_terms, stage_state_bytes, stash_bytes
from megatron_pp.planning.papers.common import (GB, GIB, PaperReport, Row, Setting, chunk_costs, load_hardware_profile,
                                                load_setting, relative_error)
from megatron_pp.planning.papers.dry_run_cells import CellJob, cell_text, find_cell, job_flags
from megatron_pp.planning.papers.small import SmallScale, peak_trend, ratio_trend, tiny_config
from megatron_pp.schedules.ir import Op
from megatron_pp.schedules.registry import build_schedule
from megatron_pp.schedules.simulate import CostModel, simulate

PIPEOFFLOAD_METHODS = ("1f1b-i", "gis", "gis-h", "po-h", "po-f", "1f1b")
RESERVE = 0.9
"""Share of HBM a configuration may fill and still count as fitting (the other reproductions' 10% reserve)."""

Cell = Union[tuple[int, int], str]
"""A published cell: (MFU %, activation GB), or why there is none ('OOM', 'no result', 'SKIP', 'OOM (host)')."""


def _cells(*values: Cell) -> dict[str, Cell]:
    return dict(zip(PIPEOFFLOAD_METHODS, values))


NO = "no result"  # the figure has no bar: OOM or not run
# Figure 15 (arXiv 2503.01328; MFU %, activation GB, read from a figure). SKIP: PO-F not run because k > 1.
FIGURE_15: dict[tuple[str, int], dict[str, Cell]] = {
    ("10.5b", 4096): _cells((65, 15), (65, 13), (63, 8), (59, 3), "SKIP", (57, 12)),
    ("10.5b", 8192): _cells((68, 30), (68, 27), (65, 16), (61, 6), "SKIP", (59, 24)),
    ("10.5b", 16384): _cells("OOM", "OOM", (68, 32), (63, 12), (59, 9), (62, 48)),
    ("10.5b", 32768): _cells(NO, NO, NO, (65, 24), (64, 14), NO),
    ("18.1b", 4096): _cells((64, 24), (65, 19), (63, 13), (59, 4), "SKIP", (56, 18)),
    ("18.1b", 8192): _cells((66, 49), (67, 38), (66, 25), (62, 8), "SKIP", (58, 37)),
    ("18.1b", 16384): _cells(NO, NO, (59, 51), (64, 15), (61, 9), NO),
    ("18.1b", 32768): _cells(NO, NO, NO, (65, 27), (65, 15), NO),
    ("42.9b", 4096): _cells((63, 49), (65, 34), (64, 25), (62, 10), (58, 5), (55, 33)),
    ("42.9b", 8192): _cells(NO, NO, (62, 51), (63, 20), (60, 8), NO),
    ("42.9b", 16384): _cells(NO, NO, NO, (63, 41), (65, 12), NO),
    ("42.9b", 32768): _cells("OOM", "OOM", "OOM", "OOM", "OOM (host)", "OOM"),
}

# Figure 1 (left): k = offload round trip / F+B compute of one layer on A100, by hidden size and sequence.
FIGURE_1_K = {
    4096: {4096: 1.70, 8192: 1.46, 16384: 1.15, 32768: 0.80},
    5120: {4096: 1.40, 8192: 1.23, 16384: 1.00, 32768: 0.72},
    6144: {4096: 1.19, 8192: 1.07, 16384: 0.88, 32768: 0.66},
    8192: {4096: 0.92, 8192: 0.84, 16384: 0.72, 32768: 0.56},
    10240: {4096: 0.74, 8192: 0.69, 16384: 0.61, 32768: 0.49},
}

# Figure 11: 32-way PP with PO-H / PO-F against 1F1B-I with TP8 (+SP) x PP4, these models and sequences.
FIGURE_11 = (("42.9b", 16384), ("66.6b", 16384), ("83.8b", 8192))
FIGURE_11_GAIN = (0.12, 0.19)
# Figure 10: PO-F's per-device activation stays about this many layers' worth as the pipeline grows (5.8B).
FIGURE_10_LAYERS = 4
# Table 2's model sizes (the names), in parameters.
TABLE_2_SIZE = {"5.8b": 5.8e9, "10.5b": 10.5e9, "18.1b": 18.1e9, "42.9b": 42.9e9, "66.6b": 66.6e9, "83.8b": 83.8e9}

LLAMA_MLP = "swiglu-8h/3"
"""The alternative MLP Table 2's sizes allow: LLaMA's SwiGLU at ffn 8h/3 (rounded up to 256), 8h^2 parameters."""


@dataclasses.dataclass
class Cellular:
    """One simulated cell: MFU, the worst rank's activation bytes, the worst rank's total bytes."""

    mfu: float
    activation: float
    total: float
    k: float
    rank_activation: tuple[float, ...] = ()
    """Activation bytes per pipeline rank (the simulated stash peaks); `activation` is their maximum."""

    def fits(self, hw: HardwareProfile) -> bool:
        return self.total <= hw.memory_gib * GIB * RESERVE

    def text(self, hw: HardwareProfile) -> str:
        return f"MFU {100 * self.mfu:.0f}%, activation {self.activation / GB:.1f} GB, " + \
            ("fits" if self.fits(hw) else "OOM")


def _mlp(setting: Setting, mlp: Optional[str]) -> None:
    if mlp == LLAMA_MLP:
        h = setting.config.hidden_size
        ffn = -(-8 * h // 3 // 256) * 256
        setting.config = dataclasses.replace(setting.config, activation="swiglu", ffn_hidden_size=ffn)
    elif mlp is not None:
        raise ValueError(f"unknown MLP alternative {mlp!r}")


def _model_flops(setting: Setting, layer: LayerTimes, m: int) -> float:
    """Model FLOPs of one step per pipeline (per tensor-parallel rank), Megatron's convention."""
    cfg = setting.config
    logits = 3 * 2 * cfg.seq_length * setting.micro_batch * cfg.hidden_size * cfg.padded_vocab_size(setting.tp)
    return m * (cfg.num_layers * layer.model_flops + logits / setting.tp)


def simulate_pipeoffload(model: str, seq: int, variant: str, hw: HardwareProfile, pcie_gbps: float,
                         mlp: Optional[str] = None) -> Cellular:
    """One cell: variant `variant` of `pipeoffload_MODEL.yaml` at sequence `seq`, timed by the simulator on
    the roofline of `hw` (no fitted factor) and weighed by planning.memory. `mlp` replaces the config's MLP
    (`LLAMA_MLP`) to show what that assumption changes."""
    setting = load_setting(f"pipeoffload_{model}", variant, **{"seq-length": seq})
    _mlp(setting, mlp)
    name = setting.args.pipeline_schedule
    chunks = setting.chunks() if name != "1f1b" else 1
    specs = setting.stages(chunks)
    shape = LayerShape.from_config(setting.config, setting.tp, setting.args.sequence_parallel)
    layer = Roofline(shape, hw, "flash").layer_times(setting.micro_batch)
    m = setting.microbatches
    split = name not in ("interleaved-1f1b", "1f1b")
    costs = chunk_costs(setting, hw, specs, layer, 1.0, split)
    stash = [stash_bytes(setting.config, s, setting.micro_batch, tp=setting.tp,
                         sequence_parallel=setting.args.sequence_parallel, attention="flash") for s in specs]
    typical = max(range(len(specs)), key=lambda s: specs[s].num_layers)
    one_way = stash[typical] / (pcie_gbps * GB)
    # k as Eq. 1 defines it: the round trip of a chunk's stash over its forward and backward compute.
    k = 2 * one_way / (costs[(Op.F, typical)] + costs[(Op.B, typical)])
    options = {}
    if name in ("po-h", "po-f"):
        options["offload_time"] = one_way / costs[(Op.F, typical)]
        for s in range(len(specs)):
            costs[(Op.OFFLOAD, s)] = costs[(Op.RELOAD, s)] = stash[s] / (pcie_gbps * GB)
    schedule = build_schedule(name, setting.pp, m, chunks, **options)
    sim = simulate(schedule, CostModel(measured=costs, stash_bytes=stash))
    mfu = _model_flops(setting, layer, m) / (setting.pp * sim.makespan * hw.peak_tflops * 1e12)
    per_rank_state = [0.0] * setting.pp
    for s in specs:
        per_rank_state[schedule.placement[s.stage][0]] += stage_state_bytes(setting.config, s, tp=setting.tp,
                                                                            dp=setting.dp, bf16=True)
    total = max(per_rank_state[r] + sim.peak_bytes[r] for r in range(setting.pp))
    return Cellular(mfu, max(sim.peak_bytes), total, k, tuple(sim.peak_bytes))


def _label(model: str, seq: Optional[int] = None) -> str:
    return model.upper() + (f" seq {seq // 1024}k" if seq else "")


def _bytes_per_token_h(model: str, seq: int, mlp: Optional[str] = None) -> float:
    """Saved bytes per token per h of one transformer layer, as planning.memory counts them."""
    setting = load_setting(f"pipeoffload_{model}", "1f1b-i", **{"seq-length": seq})
    _mlp(setting, mlp)
    terms = layer_activation_terms(setting.config, setting.micro_batch, tp=setting.tp, attention="flash")
    return sum(terms.values()) / (seq * setting.micro_batch * setting.config.hidden_size)


def _assumption_rows(report: PaperReport, model: str, seq: int, hw: HardwareProfile, pcie: float,
                     base: Cellular, published: tuple[int, int]) -> None:
    """What Table 2 fixes (the parameter count) and the memory error of the MLP alternative it leaves open."""
    config = load_setting(f"pipeoffload_{model}", "1f1b-i").config
    size = config.num_parameters() / 1e9
    swiglu_4h = dataclasses.replace(config, activation="swiglu").num_parameters() / 1e9
    llama = load_setting(f"pipeoffload_{model}", "1f1b-i")
    _mlp(llama, LLAMA_MLP)
    report.rows.append(Row(
        f"{_label(model)} parameters (Table 2 size; fixes the MLP at 8h² per layer)", f"{model.upper()}",
        f"{size:.1f}B with the assumed GELU ffn 4h; {llama.config.num_parameters() / 1e9:.1f}B with LLaMA's SwiGLU "
        f"ffn {llama.config.ffn_size}; SwiGLU ffn 4h would be {swiglu_4h:.1f}B",
        relative_error(size, TABLE_2_SIZE[model] / 1e9)))
    ours = _bytes_per_token_h(model, seq)
    implied = ours * published[1] * GB / base.activation
    report.rows.append(Row(
        f"{_label(model, seq)} 1f1b-i: saved bytes per token per h of a layer",
        f"≈ {implied:.0f} (implied by {published[1]} GB at our stash count)",
        f"{ours:.0f} with GELU ffn 4h (assumed); {_bytes_per_token_h(model, seq, LLAMA_MLP):.0f} with LLaMA's "
        "SwiGLU ffn 8h/3", relative_error(ours, implied)))
    alt = simulate_pipeoffload(model, seq, "1f1b-i", hw, pcie, mlp=LLAMA_MLP)
    report.rows.append(Row(f"{_label(model, seq)} 1f1b-i activation if the MLP were LLaMA's SwiGLU ffn 8h/3",
                           f"{published[1]} GB", f"{alt.activation / GB:.1f} GB (assumed GELU ffn 4h: "
                           f"{base.activation / GB:.1f} GB)", relative_error(alt.activation / GB, float(published[1]))))


def _dry_run(report: PaperReport, model: str, seq: int, method: str, got: Cellular) -> str:
    """'; dry run ...' for a cell that shows the dry run of its job, '' for the others."""
    cell = find_cell("pipeoffload", f"pipeoffload_{model}", method, {"seq-length": seq})
    if cell is None:
        return ""
    setting = load_setting(cell.config, method, **dict(cell.sets))
    flags, world = job_flags(cell)
    worst = got.rank_activation.index(got.activation)
    job = CellJob(cell, flags, world, setting.tp, setting.dp, worst, list(got.rank_activation))
    report.dry_runs.append(job)
    return "; " + cell_text(job)


def _figure_15(report: PaperReport, model: str, seq: int, hw: HardwareProfile, pcie: float,
               assumption_rows: bool) -> dict[str, Cellular]:
    published = FIGURE_15[(model, seq)]
    results = {method: simulate_pipeoffload(model, seq, method, hw, pcie) for method in PIPEOFFLOAD_METHODS}
    base, reference = results["1f1b-i"], published["1f1b-i"]
    h = load_setting(f"pipeoffload_{model}", "1f1b-i").config.hidden_size
    report.rows.append(Row(f"{_label(model, seq)}: k, PCIe round trip over F+B of one layer (Fig. 1)",
                           f"{FIGURE_1_K[h][seq]:.2f}", f"{base.k:.2f}", relative_error(base.k, FIGURE_1_K[h][seq])))
    if assumption_rows and isinstance(reference, tuple):
        _assumption_rows(report, model, seq, hw, pcie, base, reference)
    for method in PIPEOFFLOAD_METHODS:
        cell, got = published[method], results[method]
        label = f"{_label(model, seq)} {method}"
        if isinstance(cell, str):
            report.rows.append(Row(label, cell, got.text(hw)))
            continue
        report.rows.append(Row(f"{label} MFU", f"MFU {cell[0]}%, activation {cell[1]} GB", got.text(hw),
                               relative_error(got.mfu, cell[0] / 100)))
        report.rows.append(Row(f"{label} activation", f"{cell[1]} GB", f"{got.activation / GB:.1f} GB"
                               + _dry_run(report, model, seq, method, got),
                               relative_error(got.activation / GB, float(cell[1]))))
        if method != "1f1b-i" and isinstance(reference, tuple):
            ratio, published_ratio = got.activation / base.activation, cell[1] / reference[1]
            report.rows.append(Row(f"{label} activation / 1F1B-I", f"{published_ratio:.2f}", f"{ratio:.2f}",
                                   relative_error(ratio, published_ratio)))
    return results


def _figure_10(report: PaperReport, hw: HardwareProfile, pcie: float) -> None:
    """Figure 10's point the 5.8B config reproduces (2 GPUs): PO-F's activation in layers' worth."""
    setting = load_setting("pipeoffload_5.8b", "po-f")
    seq = setting.config.seq_length
    got = simulate_pipeoffload("5.8b", seq, "po-f", hw, pcie)
    layer = next(s for s in setting.stages(setting.chunks()) if s.num_layers == 1 and not s.has_head
                 and not s.has_embedding)
    one = stash_bytes(setting.config, layer, setting.micro_batch, tp=setting.tp, attention="flash")
    base = simulate_pipeoffload("5.8b", seq, "1f1b-i", hw, pcie)
    report.rows.append(Row(
        f"5.8B seq {seq // 1024}k on {setting.pp} GPUs (Fig. 10): po-f activation per device in layers",
        f"≈ {FIGURE_10_LAYERS} layers' worth, flat as the pipeline grows",
        f"{got.activation / one:.1f} layers ({got.activation / GB:.1f} GB; 1f1b-i {base.activation / one:.1f} "
        f"layers); {'fits' if got.fits(hw) else 'OOM'}", relative_error(got.activation / one, FIGURE_10_LAYERS)))


def _figure_11(report: PaperReport, hw: HardwareProfile, pcie: float, fig15: dict) -> None:
    """Figure 11: the better of PO-H and PO-F at 32-way PP against 1F1B-I at TP8 x PP4."""
    for model, seq in FIGURE_11:
        cells = fig15.get((model, seq)) or {m: simulate_pipeoffload(model, seq, m, hw, pcie) for m in ("po-h", "po-f")}
        tp8 = simulate_pipeoffload(model, seq, "1f1b-i-tp8", hw, pcie)
        best = max(("po-h", "po-f"), key=lambda m: cells[m].mfu)
        gain = cells[best].mfu / tp8.mfu - 1
        label = f"{_label(model, seq)} (Fig. 11)"
        report.rows.append(Row(
            f"{label}: MFU gain of PO at pp {load_setting(f'pipeoffload_{model}', best).pp} over 1F1B-I tp 8 × pp 4",
            "+12% to +19% (range over Fig. 11's settings)",
            f"{100 * gain:+.0f}% ({best} {100 * cells[best].mfu:.0f}%, {'fits' if cells[best].fits(hw) else 'OOM'}; "
            f"tp 8 {100 * tp8.mfu:.0f}%, {'fits' if tp8.fits(hw) else 'OOM'})",
            relative_error(gain, FIGURE_11_GAIN)))
        less = cells["po-f"].activation < tp8.activation
        report.rows.append(Row(
            f"{label}: po-f activation against 1F1B-I tp 8 × pp 4", "po-f needs less",
            f"po-f {cells['po-f'].activation / GB:.1f} GB, tp 8 {tp8.activation / GB:.1f} GB "
            f"({'agrees' if less else 'disagrees'})"))


def predict_pipeoffload(hardware: str = "a100-80gb", cells: Optional[Sequence[tuple[str, int]]] = None,
                        figures: Sequence[int] = (10, 11, 15)) -> PaperReport:
    hw, raw = load_hardware_profile(hardware, "fp16")
    pcie = float(raw["pcie_gbps"])
    cells = list(FIGURE_15 if cells is None else cells)
    report = PaperReport(
        "pipeoffload", "PipeOffload Figures 10, 11 and 15, MFU and activation memory (Wan et al., ICML 2025)",
        f"one for every cell: the roofline on {hw.name} (fp16 peak {hw.peak_tflops:g} TFLOP/s) at the profile's "
        f"matmul efficiency {hw.matmul_efficiency} (PipeOffload's own 220 TFLOP/s, the constant of its Eq. 1); "
        "nothing is fitted to a figure. Offload copies are a stash's bytes over PCIe at "
        f"{pcie:g} GB/s one-way (PipeOffload's A100 constant) against those compute times, so k is predicted, "
        "not set. Activation memory: planning.memory (Megatron numerics, flash attention, no recompute) weighed "
        f"by the simulated stash curve; a cell fits when weights, optimizer state and activations stay under "
        f"{RESERVE:.0%} of HBM.")
    fig15: dict = {}
    if 15 in figures:
        seen: set[str] = set()
        for model, seq in cells:
            fig15[(model, seq)] = _figure_15(report, model, seq, hw, pcie,
                                             model not in seen and isinstance(FIGURE_15[(model, seq)]["1f1b-i"], tuple))
            seen.add(model)
    if 10 in figures:
        _figure_10(report, hw, pcie)
    if 11 in figures:
        _figure_11(report, hw, pcie, fig15)
    report.notes.append("Figures 10, 11 and 15 are read from figures (arXiv 2503.01328); single cells are "
                        "indicative. 'no result' is a bar the figure does not have (OOM or not run), SKIP a PO-F "
                        "run the paper skipped because k > 1.")
    report.notes.append("The paper's runs recompute LayerNorm, GeLU and dropout in the backward (its 34 → 20·s·b·h "
                        "bytes per layer, §3 and Fig. 16); this framework does not, and neither does the memory "
                        "model, so the activation columns predict the configs as this framework runs them.")
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
