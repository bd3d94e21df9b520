"""The paper reproduction table: each seed paper's headline experiment predicted at full scale, and the
trend it claims measured at small scale on CPU next to the simulator's prediction for the same setting.

**Full scale.** A paper's model and layout come from its config in `launch/configs/` (the flags a cluster
run would get), its GPU from `launch/hardware/*.yaml`. Per-layer times are the layer's kernels
(`planning.efficiency.kernels`: FLOPs and bytes) on that GPU with the profile's achieved matmul
efficiency, i.e. `max(FLOPs / (peak · efficiency), bytes / HBM bandwidth)` per kernel. Where a paper
publishes an absolute figure for its *baseline* method (PipeOffload: 1F1B-I's MFU), compute time is
scaled by one factor per (model, sequence length) so the baseline's predicted MFU equals the published
one; every other method is then predicted with that factor, never fitted. Where it publishes only ratios
(BPipe, 2BW, breadth-first) the profile's efficiency is used as is. Step times come from the schedule
simulator (`schedules.simulate`) replaying the very lists `--pipeline-schedule NAME` runs; memory comes
from `planning.memory` (saved activations per stage, weights, gradients, optimizer state) and the
simulated stash curves. Each row prints the prediction next to the published figure with the relative
error `(predicted − published) / published`; a published range counts as error 0 inside it and as the
distance to its nearer end outside. Where no number is taken from the paper the row says so.

**Small scale.** A tiny GPT runs with the real executor on a local gloo world (`core.local_world`), one
training step per schedule; the executor's `ActivationStore` reports each rank's peak of resident stash
bytes. The prediction for the same setting is the simulator's stash curve weighed with
`planning.memory.stash_bytes` in the CPU fp32 profile. Timing trends (bubble against v) use the
executor's trace: busy = compute time minus receive waits, bubble = 1 − busy / step time. 2BW runs
through the real training loop (`training.train.pretrain`, which owns 2BW's delayed-update optimizer).
Worked example (pp 4, m 8, BPipe with K = 2, 8-layer GPT of h 64 and s 32 in fp32): the executor measures
778 / 774 / 772 / 819 KiB of peak stash on ranks 0-3, the simulator predicts 776 / 774 / 774 / 824 KiB;
1F1B measures and predicts 1034 / 774 / 516 / 307 KiB.

`tools/reproduce.py PAPER` prints the tables; docs/reproduction.md holds them with the discussion.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import math
import os
import statistics
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import yaml

from megatron_pp.models.config import TransformerConfig
from megatron_pp.models.layout import StageSpec, split_layers
from megatron_pp.planning.bpipe_estimator import Candidate, Estimate, Job, estimate
from megatron_pp.planning.efficiency import (BF16_BYTES, HardwareProfile, LayerShape, LayerTimes, MeasuredCurve,
                                             Roofline, head_times)
from megatron_pp.planning.memory import (CPU_FP32, attention_kind, stage_state_bytes, stash_bytes,
                                         transient_activation_bytes)
from megatron_pp.schedules.ir import Op
from megatron_pp.schedules.registry import build_schedule
from megatron_pp.schedules.simulate import CostModel, simulate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_DIR = os.path.join(ROOT, "launch", "configs")
HARDWARE_DIR = os.path.join(ROOT, "launch", "hardware")
GB = 1e9
GIB = 2 ** 30
PAPERS = ("bpipe", "bpipe-reeval", "pipeoffload", "2bw", "breadth-first")


# Rows -----------------------------------------------------------------------------------------------------


def relative_error(predicted: Optional[float], published: Optional[float | tuple[float, float]]) -> Optional[float]:
    """(predicted − published) / published; a (low, high) range gives 0 inside it, else the distance to the
    nearer end relative to that end. None when either side is missing."""
    if predicted is None or published is None or (isinstance(predicted, float) and math.isinf(predicted)):
        return None
    if isinstance(published, tuple):
        low, high = published
        if low <= predicted <= high:
            return 0.0
        end = low if predicted < low else high
        return (predicted - end) / end
    return (predicted - published) / published


@dataclass
class Row:
    """One full-scale claim: the published figure, our prediction, and the relative error."""

    claim: str
    published: str
    """The paper's figure as text, or why there is none ('no published figure used here')."""
    predicted: str
    error: Optional[float] = None


@dataclass
class Trend:
    """One small-scale trend: measured with the executor on CPU, predicted by the simulator + memory model."""

    trend: str
    setting: str
    measured: str
    predicted: str
    error: Optional[float] = None


@dataclass
class PaperReport:
    paper: str
    title: str
    calibration: str
    rows: list[Row] = field(default_factory=list)
    trends: list[Trend] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def format(self) -> str:
        def err(e: Optional[float]) -> str:
            return "—" if e is None else f"{100 * e:+.0f}%"

        out = [f"## {self.paper}: {self.title}", "", f"Calibration: {self.calibration}", ""]
        if self.rows:
            out += ["| Claim | Published | Predicted | Error |", "|---|---|---|---|"]
            out += [f"| {r.claim} | {r.published} | {r.predicted} | {err(r.error)} |" for r in self.rows]
            out.append("")
        if self.trends:
            out += ["| Small-scale trend | Setting | Measured (executor, CPU) | Predicted (simulator) | Error |",
                    "|---|---|---|---|---|"]
            out += [f"| {t.trend} | {t.setting} | {t.measured} | {t.predicted} | {err(t.error)} |"
                    for t in self.trends]
            out.append("")
        out += [f"- {n}" for n in self.notes]
        return "\n".join(out).rstrip() + "\n"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Hardware profiles and configs ------------------------------------------------------------------------------


def load_hardware_profile(name: str, dtype: str = "bf16") -> tuple[HardwareProfile, dict]:
    """`launch/hardware/NAME.yaml` as the estimator's `HardwareProfile` (peak of `dtype`, NVLink as the
    intra-node link, InfiniBand / network as the inter-node one) and the raw mapping (PCIe etc.)."""
    path = name if name.endswith(".yaml") else os.path.join(HARDWARE_DIR, name + ".yaml")
    if not os.path.exists(path):
        known = sorted(f[:-5] for f in os.listdir(HARDWARE_DIR) if f.endswith(".yaml"))
        raise ValueError(f"unknown hardware profile {name!r}; known: {', '.join(known)} (or a .yaml path)")
    with open(path) as f:
        raw = yaml.safe_load(f)
    peak = raw.get(f"peak_{dtype}_tflops")
    if peak is None:
        raise ValueError(f"{path}: no peak_{dtype}_tflops (the GPU has no {dtype} tensor cores)")
    missing = [k for k in raw if k not in ("sources", "name") and raw[k] is not None and k not in raw["sources"]]
    if missing:
        raise ValueError(f"{path}: numbers without a source: {', '.join(missing)}")
    profile = HardwareProfile(
        name=raw["name"], peak_tflops=float(peak), memory_gib=float(raw["memory_gib"]), hbm_gbps=float(raw["hbm_gbps"]),
        tp_link_gbps=float(raw["nvlink_gbps"]), pair_link_gbps=float(raw["ib_gbps"]),
        gpus_per_node=int(raw["gpus_per_node"]), matmul_efficiency=float(raw["matmul_efficiency"]),
        sources=dict(raw["sources"]))
    return profile, raw


def _flags(values: dict) -> list[str]:
    flags: list[str] = []
    for key, value in values.items():
        if value is True:
            flags.append(f"--{key}")
        elif value is not False and value is not None:
            flags += [f"--{key}", str(value)]
    return flags


@dataclass
class Setting:
    """One variant of a launch config, parsed as the training script would parse it."""

    name: str
    variant: str
    args: argparse.Namespace
    config: TransformerConfig
    world: int
    raw: dict

    @property
    def tp(self) -> int:
        return self.args.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.args.pipeline_model_parallel_size

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def micro_batch(self) -> int:
        return self.args.micro_batch_size

    @property
    def microbatches(self) -> int:
        return self.args.global_batch_size // (self.dp * self.micro_batch)

    @property
    def attention(self) -> str:
        return attention_kind(self.args.attention_backend or "auto")

    @property
    def recompute(self) -> str:
        granularity = self.args.recompute_granularity
        if granularity is None and self.args.pipeline_schedule == "looped-bfs":
            return "full"  # the schedule checkpoints layer inputs by default
        return granularity or "none"

    def stages(self, chunks: int = 1) -> list[StageSpec]:
        return split_layers(self.config.num_layers, self.pp, chunks,
                            first_stage_layers=self.args.decoder_first_pipeline_num_layers,
                            last_stage_layers=self.args.decoder_last_pipeline_num_layers,
                            account_for_embedding=self.args.account_for_embedding_in_pipeline_split,
                            account_for_loss=self.args.account_for_loss_in_pipeline_split)

    def chunks(self) -> int:
        from megatron_pp.training.arguments import num_chunks

        return num_chunks(self.args, self.config)


def load_setting(name: str, variant: str, **overrides: object) -> Setting:
    """Variant `variant` of `launch/configs/NAME.yaml` at full size, flags overridden by `overrides`
    (keys as in the YAML, e.g. `{'seq-length': 16384}`)."""
    from megatron_pp.training.arguments import build_parser, model_config_from_args

    with open(os.path.join(CONFIG_DIR, name + ".yaml")) as f:
        raw = yaml.safe_load(f)
    if variant not in raw["variants"]:
        raise ValueError(f"{name}.yaml has no variant {variant!r}; it has {', '.join(raw['variants'])}")
    values = {**raw["args"], **(raw["variants"][variant] or {}), **overrides}
    if values.get("seq-length") and "max-position-embeddings" in values:
        values["max-position-embeddings"] = values["seq-length"]
    args = build_parser().parse_args(_flags(values))
    config = model_config_from_args(args)
    world = int(raw["cluster"]["nodes"]) * int(raw["cluster"]["gpus_per_node"])
    return Setting(name, variant, args, config, world, raw)


class _StagedJob(Job):
    """A `Job` whose stages follow the config's split (uneven first/last stages), not an even one."""

    def __init__(self, setting: Setting, **kwargs: object) -> None:
        object.__setattr__(self, "_setting", setting)
        super().__init__(**kwargs)

    @property
    def stages(self) -> list[StageSpec]:
        return self._setting.stages()


def job_for(setting: Setting, attention: Optional[str] = None) -> Job:
    kwargs = dict(config=setting.config, tp=setting.tp, pp=setting.pp, dp=setting.dp,
                  global_batch_size=setting.args.global_batch_size, attention=attention or setting.attention,
                  sequence_parallel=setting.args.sequence_parallel,
                  distributed_optimizer=bool(setting.args.use_distributed_optimizer))
    return _StagedJob(setting, **kwargs)


def layer_model(job: Job, hw: HardwareProfile, attention: str, efficiency_file: Optional[str] = None):
    """Where layer times come from: a `tools/bench_layer.py` measurement when given, else the roofline."""
    if efficiency_file:
        return MeasuredCurve.from_file(efficiency_file, job.shape, attention, hw)
    return Roofline(job.shape, hw, attention)


def _gb(value: float) -> str:
    return f"{value / GB:.1f} GB"


# BPipe ----------------------------------------------------------------------------------------------------


def _candidate(est: Estimate, b: int, recompute: str, bpipe: bool) -> Optional[Candidate]:
    for c in est.candidates:
        if (c.micro_batch_size, c.recompute, c.bpipe) == (b, recompute, bpipe):
            return c
    return None


def _variant_candidate(est: Estimate, setting: Setting) -> Optional[Candidate]:
    return _candidate(est, setting.micro_batch, setting.recompute, setting.args.pipeline_schedule == "bpipe")


def _describe(c: Optional[Candidate]) -> str:
    if c is None:
        return "not evaluated"
    verdict = "fits" if c.fits else "OOM"
    return (f"{c.label()}: worst stage {c.peak_bytes / GIB:.1f} GiB ({verdict}), step {c.step_s:.2f} s, "
            f"MFU {100 * c.mfu:.0f}%")


def predict_bpipe(hardware: str = "a100-80gb", models: Sequence[str] = ("96b", "134b"),
                  efficiency_file: Optional[str] = None) -> PaperReport:
    hw, _ = load_hardware_profile(hardware)
    source = (f"measured layer times from {efficiency_file}" if efficiency_file else
              f"the roofline on {hw.name} with the profile's matmul efficiency {hw.matmul_efficiency} "
              f"(launch/hardware/{hardware}.yaml)")
    report = PaperReport(
        "bpipe", "BPipe, GPT-3 96B / 134B on 48 A100-80GB (Kim et al., ICML 2023)",
        f"no absolute figure taken from the paper, so layer times are {source}; nothing is fitted to BPipe. Memory: "
        "planning.memory, Megatron bf16 numerics, 10% reserve.")
    for model in models:
        settings = {v: load_setting(f"bpipe_gpt3_{model}", v) for v in ("1f1b", "bpipe", "bpipe-mb2")}
        base = settings["1f1b"]
        job = job_for(base)
        layers = layer_model(job, hw, base.attention, efficiency_file)
        est = estimate(job, hw, layers, max_micro_batch_size=4)
        chosen = {v: _variant_candidate(est, s) for v, s in settings.items()}
        report.notes += [w for w in est.warnings if w not in report.notes]
        for v, c in chosen.items():
            report.rows.append(Row(f"GPT-3 {model.upper()}, variant `{v}` of bpipe_gpt3_{model}.yaml",
                                   "trained in the paper (settings not taken from it)", _describe(c)))
        for v in ("bpipe", "bpipe-mb2"):
            a, b = chosen["1f1b"], chosen[v]
            if a is not None and b is not None and a.fits and b.fits:
                ratio = a.step_s / b.step_s
                report.rows.append(Row(f"GPT-3 {model.upper()}: speedup of `{v}` over Megatron-LM `1f1b`",
                                       "1.25×–2.17× (range over the paper's settings)", f"{ratio:.2f}×",
                                       relative_error(ratio, (1.25, 2.17))))
            else:
                report.rows.append(Row(f"GPT-3 {model.upper()}: speedup of `{v}` over Megatron-LM `1f1b`",
                                       "1.25×–2.17× (range over the paper's settings)",
                                       "a variant does not fit: no speedup predicted"))
        speedup = est.speedup
        report.rows.append(Row(
            f"GPT-3 {model.upper()}: best BPipe configuration over best 1F1B (b ≤ 4, any recompute)",
            "1.25×–2.17×", f"{speedup:.2f}× ({est.best_bpipe.label()} vs {est.best_plain.label()})"
            if speedup not in (None, math.inf) else str(speedup), relative_error(speedup, (1.25, 2.17))))
        # Sensitivity: the two assumptions the verdict hinges on (which recompute the baseline may use,
        # and whether BPipe's pairs talk over InfiniBand or NVLink).
        for what, options in (("without selective recompute (Megatron-LM before Korthikanti et al.)",
                               dict(recompute_options=("none", "full"))),
                              ("pairs x and p−1−x on one node (evict/load over NVLink)", dict(pairs_on_node=True)),
                              ("no selective recompute and pairs on one node",
                               dict(recompute_options=("none", "full"), pairs_on_node=True))):
            value = estimate(job, hw, layers, max_micro_batch_size=4,
                             **options).speedup
            text = "inf (only BPipe fits)" if value == math.inf else f"{value:.2f}×" if value else "none fits"
            report.rows.append(Row(f"GPT-3 {model.upper()}: same, {what}", "1.25×–2.17×", text,
                                   relative_error(value, (1.25, 2.17))))
        plain = _candidate(est, 1, "none", False)
        balanced = _candidate(est, 1, "none", True)
        if plain and balanced:
            stash = [stash_bytes(base.config, s, 1, tp=base.tp, sequence_parallel=base.args.sequence_parallel,
                                 attention=base.attention) for s in base.stages()]
            sim = simulate(build_schedule("bpipe", base.pp, base.microbatches),
                           CostModel(stash_bytes=stash, transfer=0.0))
            ratio = max(sim.peak_bytes) / (base.pp * stash[0])
            report.rows.append(Row(
                f"GPT-3 {model.upper()}: worst-stage activation, BPipe / 1F1B (b=1, no recompute)",
                "no published figure used here (mechanism bound ⌈(p+2)/2⌉/p = "
                f"{math.ceil((base.pp + 2) / 2)}/{base.pp})",
                f"{ratio:.2f} (simulated stash bytes; {max(sim.peak_bytes) / GB:.1f} vs "
                f"{base.pp * stash[0] / GB:.1f} GB)"))
    report.notes.append("Model shapes, layout (tp 4 × pp 12), global batch and the baseline's recompute are "
                        "assumed (see the configs); the paper's per-setting table is not used here, so each "
                        "speedup is compared with the published range only.")
    return report


# BPipe re-evaluation ---------------------------------------------------------------------------------------


def formula_speedup(est: Estimate, b0: int, r0: str, b1: int, r1: str, bpipe1: bool = True) -> Optional[float]:
    """S = [(m0+p−1)/(m0+f(p−1))]·[MFU1(b1)/MFU1(b0)]·[r0/r1] (our form of the MFU-based estimate of the
    re-evaluation, arXiv 2401.02088; docs/schedules.md, "Formulas and their sources") from the
    single-stage curves only (no simulation): what the re-evaluation proposes to compute in advance."""
    c0, c1 = _candidate(est, b0, r0, False), _candidate(est, b1, r1, bpipe1)
    if c0 is None or c1 is None:
        return None
    p, m0, f = est.job.pp, c0.num_microbatches, b1 / b0
    # Per-microbatch stage time per sample: MFU_1(b)/r in the formula is flops/time, so use time per sample.
    t0, t1 = c0.per_microbatch_s / b0, c1.per_microbatch_s / b1
    return (m0 + p - 1) / (m0 + f * (p - 1)) * (t0 / t1)


def predict_bpipe_reeval(hardware: str = "a100-80gb", efficiency_file: Optional[str] = None) -> PaperReport:
    hw, _ = load_hardware_profile(hardware)
    source = (f"measured layer times from {efficiency_file}" if efficiency_file else
              f"roofline on {hw.name} with matmul efficiency {hw.matmul_efficiency} (launch/hardware/{hardware}.yaml)")
    report = PaperReport(
        "bpipe-reeval", "Re-evaluating BPipe: GPT-3 with and without FlashAttention, LLaMA (Huang et al., 2024)",
        f"{source}; "
        "the re-evaluation's model sizes, cluster and tables are not used here, so its findings are "
        "qualitative targets and every row's error is left blank.")
    cases = [("GPT-3 96B, unfused attention", "bpipe_reeval_gpt3", "1f1b", "bpipe-mb2",
              "gain confirmed (finding i)", lambda s: s is not None and s > 1.1),
             ("GPT-3 96B, FlashAttention", "bpipe_reeval_gpt3", "1f1b-flash", "bpipe-flash-mb2",
              "negligible gain (finding iii)", lambda s: s is not None and s < 1.1),
             ("LLaMA-65B, FlashAttention", "bpipe_reeval_llama", "1f1b", "bpipe-mb2",
              "no gain, may degrade (finding ii)", lambda s: s is not None and s < 1.05)]
    for label, name, v0, v1, published, agrees in cases:
        s0, s1 = load_setting(name, v0), load_setting(name, v1)
        job = job_for(s0)
        layers = layer_model(job, hw, s0.attention, efficiency_file)
        est = estimate(job, hw, layers, max_micro_batch_size=4)
        c0, c1 = _variant_candidate(est, s0), _variant_candidate(est, s1)
        report.notes += [w for w in est.warnings if w not in report.notes]
        pair = (f"{c0.step_s / c1.step_s:.2f}× (`{v1}` vs `{v0}`)" if c0 and c1 and c0.fits and c1.fits
                else f"`{v0}` {'fits' if c0 and c0.fits else 'OOM'}, `{v1}` {'fits' if c1 and c1.fits else 'OOM'}")
        best = est.speedup
        best_text = ("inf (only BPipe fits)" if best == math.inf else "none fits" if best is None else
                     f"{best:.2f}× ({est.best_bpipe.label()} vs {est.best_plain.label()})")
        formula = formula_speedup(est, s0.micro_batch, s0.recompute, s1.micro_batch, s1.recompute)
        verdict = "agrees" if agrees(best if best != math.inf else 10.0) else "disagrees"
        formula_text = f"; S formula {formula:.2f}×" if formula else ""
        report.rows.append(Row(f"{label}: BPipe speedup", published,
                               f"config pair {pair}; best-vs-best {best_text} ({verdict}){formula_text}"))
        curve = ", ".join(f"b={b} {100 * layers.layer_times(b).mfu(hw.peak_tflops):.0f}%" for b in (1, 2, 4))
        report.rows.append(Row(f"{label}: single-layer MFU(b) without recompute", "no published figure used here",
                               curve))
    report.notes.append("Finding (iv), the MFU-based estimate, is the S formula column (our form of it, "
                        "docs/schedules.md); it uses only single-stage times and the bubble term, and is compared "
                        "with the simulated speedup.")
    return report


# PipeOffload ------------------------------------------------------------------------------------------------

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


def _chunk_costs(setting: Setting, hw: HardwareProfile, specs: Sequence[StageSpec], layer: LayerTimes,
                 scale: float, split: bool, recompute: str = "none") -> dict:
    """(op, global stage) -> seconds: layers × layer time (+ the head on the last stage), compute × scale."""
    head_f, head_b = head_times(setting.config, setting.micro_batch, setting.tp, setting.args.sequence_parallel, hw)
    costs = {}
    for spec in specs:
        f = spec.num_layers * layer.forward_s + (head_f if spec.has_head else 0.0)
        b = spec.num_layers * (layer.compute_s(recompute) - layer.forward_s) + (head_b if spec.has_head else 0.0)
        f, b = max(f, 1e-6) * scale, max(b, 1e-6) * scale
        costs[(Op.F, spec.stage)], costs[(Op.B, spec.stage)] = f, b
        if split:
            costs[(Op.BI, spec.stage)], costs[(Op.BW, spec.stage)] = b / 2, b / 2
    return costs


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
    costs = _chunk_costs(setting, hw, specs, layer, scale, split)
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
        costs = _chunk_costs(setting, hw, specs, layer, scale, False)
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


# PipeDream-2BW ------------------------------------------------------------------------------------------------


def _2bw_step(setting: Setting, hw: HardwareProfile, method: str) -> tuple[float, float]:
    """(seconds per optimizer step, bubble) of `method` ('2bw', '1f1b', 'gpipe') for a 2BW config: the
    simulated pipeline (2BW: the steady period between steps) plus the data-parallel all-reduce of the
    stage's fp16 gradients, exposed after the flush for Flush and GPipe and hidden behind the next step's
    compute for 2BW when shorter (the paper's throughput model takes max(compute, DP/m))."""
    shape = LayerShape.from_config(setting.config, 1, False)
    layer = Roofline(shape, hw, "unfused").layer_times(setting.micro_batch)
    specs = setting.stages()
    costs = _chunk_costs(setting, hw, specs, layer, 1.0, False, recompute="full")
    # Replicas of a stage share a server (the paper's placement when w <= 8), so the pipeline crosses
    # servers: each boundary activation goes over the network link.
    boundary = 2 * setting.config.seq_length * setting.micro_batch * setting.config.hidden_size  # fp16 bytes
    latency = boundary / (hw.pair_link_gbps * GB)
    model = CostModel(measured=costs, p2p_latency=latency)
    p, m = setting.pp, setting.microbatches
    if method == "2bw":
        one = simulate(build_schedule("2bw", p, m, steps=1), model).makespan
        three = simulate(build_schedule("2bw", p, m, steps=3), model).makespan
        pipeline = (three - one) / 2
    else:
        pipeline = simulate(build_schedule(method, p, m), model).makespan
    params = max(stage_state_bytes(setting.config, s, tp=1, dp=1) / 18 for s in specs)
    w = setting.dp
    dp_s = 2 * (w - 1) / w * params * 2 / (hw.tp_link_gbps * GB) if w > 1 else 0.0
    step = max(pipeline, dp_s) if method == "2bw" else pipeline + dp_s
    busy = m * max(costs[(Op.F, s)] + costs[(Op.B, s)] for s in range(p))
    return step, 1 - busy / step


def predict_2bw(hardware: str = "v100-16gb-p3.16xlarge") -> PaperReport:
    hw, raw = load_hardware_profile(hardware, "fp16")
    report = PaperReport(
        "2bw", "PipeDream-2BW, GPT 2.2B / 3.8B on 64 V100-16GB (Narayanan et al., ICML 2021)",
        f"no absolute baseline figure taken from the paper; roofline on {hw.name} (fp16 {hw.peak_tflops:g} "
        f"TFLOP/s) with matmul efficiency {hw.matmul_efficiency} (the paper's ≈45 TFLOP/s per worker on "
        "GPT-355M). Nothing fitted.")
    for model in ("2.2b", "3.8b"):
        s = load_setting(f"pipedream_2bw_gpt_{model}", "2bw")
        times = {meth: _2bw_step(s, hw, meth) for meth in ("2bw", "1f1b", "gpipe")}
        ratio = times["1f1b"][0] / times["2bw"][0]
        report.rows.append(Row(f"GPT {model.upper()}, d={s.pp} w={s.dp} m={s.microbatches}: 2BW / PipeDream-Flush "
                               "throughput", "up to 1.6× (at low batch; Fig. 6)", f"{ratio:.2f}× (Flush bubble "
                               f"{100 * times['1f1b'][1]:.0f}%)", relative_error(ratio, 1.6)))
        ratio = times["gpipe"][0] / times["2bw"][0]
        report.rows.append(Row(f"GPT {model.upper()}: 2BW / GPipe throughput", "up to 3.2× (Fig. 6)", f"{ratio:.2f}×",
                               relative_error(ratio, 3.2)))
    # Figure 7: memory on one server.
    s = load_setting("pipedream_2bw_gpt_2.2b_1node", "2bw")
    specs = s.stages()
    worst = {}
    for method, stashes, extra in (("pipedream-flush", s.pp, 0), ("2bw", s.pp, 4), ("gpipe", s.microbatches, 0)):
        per_stage = []
        for spec in specs:
            params = stage_state_bytes(s.config, spec, tp=1, dp=1) / 18
            act = stash_bytes(s.config, spec, s.micro_batch, attention="unfused", recompute="full")
            transient = transient_activation_bytes(s.config, s.micro_batch, attention="unfused", recompute="full")
            count = min(s.pp - spec.stage, s.microbatches) if method != "gpipe" else stashes
            per_stage.append(params * (18 + extra) + count * act + transient)
        worst[method] = max(per_stage)
    for method, published in (("pipedream-flush", 6.0), ("2bw", 9.0)):
        report.rows.append(Row(f"GPT 2.2B on 8 V100, worst-worker memory, {method} (b=8, m=8)",
                               f"≈ {published:g} GB (Fig. 7, read from a figure)", _gb(worst[method]),
                               relative_error(worst[method] / GB, published)))
    report.rows.append(Row("GPT 2.2B on 8 V100, GPipe (b=8, m=8)", "OOM at batch 64, ≈ 15 GB at 256 (Fig. 7)",
                           f"{_gb(worst['gpipe'])}, {'fits' if worst['gpipe'] <= hw.memory_gib * GIB else 'OOM'} "
                           "in 16 GB"))
    report.notes.append("2BW's second version is counted as a second fp32 master (+4 bytes per parameter, as "
                        "the public 2BW code, msr-fiddle/pipedream, keeps two); optimizer state 18 bytes per "
                        "parameter (fp16 weights, fp32 gradients, master and two Adam moments).")
    return report


# Breadth-first ------------------------------------------------------------------------------------------------


def _bfs_step(setting: Setting, hw: HardwareProfile) -> tuple[float, float, float]:
    """(step seconds, bubble, exposed DP seconds) of one breadth-first config variant."""
    from megatron_pp.schedules.looped import exposed_reduction

    name = setting.args.pipeline_schedule
    chunks = setting.chunks()
    specs = setting.stages(chunks)
    shape = LayerShape.from_config(setting.config, setting.tp, setting.args.sequence_parallel)
    layer = Roofline(shape, hw, setting.attention).layer_times(setting.micro_batch)
    costs = _chunk_costs(setting, hw, specs, layer, 1.0, False, recompute=setting.recompute)
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


# Small-scale measurements ------------------------------------------------------------------------------------


def tiny_config(layers: int = 8, hidden: int = 64, heads: int = 4, seq: int = 32, vocab: int = 256,
                **overrides: object) -> TransformerConfig:
    from megatron_pp.models.presets import get_preset

    return dataclasses.replace(get_preset("gpt-tiny"), num_layers=layers, hidden_size=hidden,
                               num_attention_heads=heads, seq_length=seq, max_position_embeddings=seq,
                               vocab_size=vocab, **overrides)


def measure_worker(ctx, config: TransformerConfig, name: str, pp: int, m: int, v: int, options: dict,
                   micro_batch: int, steps: int = 1) -> dict:
    """One rank: build `name` on pp ranks (dp = world / pp), run `steps` training steps, return the peak
    of resident stash bytes and the traced busy and wall seconds of the last step."""
    import time

    from megatron_pp.core import comm
    from megatron_pp.data.mock import MockData
    from megatron_pp.training.train import build_pipeline, train_step

    state = ctx.parallel_state(1, pp)
    schedule = build_schedule(name, pp, m, v, **options) if v > 1 else build_schedule(name, pp, m, **options)
    pipe = build_pipeline(config, state, schedule, micro_batch_size=micro_batch, seed=1234, trace=True)
    data = MockData(1234, config.seq_length, config.vocab_size, micro_batch, micro_batch * m * state.dp_size,
                    state.dp_size)
    micro = data.step_microbatches(0, state.dp_rank, state.device)
    result = None
    wall = 0.0
    for _ in range(steps):
        comm.barrier()
        start = time.perf_counter()
        result, _ = train_step(pipe, micro)
        wall = time.perf_counter() - start
    # Compute actions print as F/B/BI/BW; communication as SEND_/RECV_ (benchmark.COMPUTE_PREFIXES).
    compute = sum(end - begin for label, begin, end in result.events if label.startswith(("F", "B")))
    return {"peak_stash_bytes": result.peak_stash_bytes, "busy_s": max(compute - result.comm_wait_s, 0.0),
            "wall_s": wall}


def predicted_stash_peaks(config: TransformerConfig, name: str, pp: int, m: int, v: int, options: dict,
                          micro_batch: int, recompute: str = "none") -> list[float]:
    """Per rank, the simulator's peak resident stash bytes for the CPU fp32 executor: the stash curve of
    the schedule weighed with `stash_bytes` per global stage (transfers instant, as they are synchronous on
    CPU; the attention formula follows the config's backend on CPU)."""
    schedule = build_schedule(name, pp, m, v, **options) if v > 1 else build_schedule(name, pp, m, **options)
    specs = split_layers(config.num_layers, pp, v)
    attention = attention_kind(config.attention_backend, "cpu", config.attention_dropout)
    stash = [stash_bytes(config, s, micro_batch, attention=attention, recompute=recompute, numerics=CPU_FP32)
             for s in specs]
    return list(simulate(schedule, CostModel(stash_bytes=stash, transfer=0.0)).peak_bytes)


def simulated_bubble(name: str, pp: int, m: int, v: int, options: Optional[dict] = None) -> float:
    schedule = build_schedule(name, pp, m, v, **(options or {})) if v > 1 else build_schedule(name, pp, m,
                                                                                              **(options or {}))
    return simulate(schedule).bubble_fraction


def train_worker(ctx, argv: list[str], pp: int) -> Optional[list[dict]]:
    """One rank of a short training run through the real loop (`training.train.pretrain`, which picks
    the 2BW trainer for `--pipeline-schedule 2bw`); rank 0 returns its metric rows."""
    from megatron_pp.training.arguments import parse_args
    from megatron_pp.training.train import pretrain

    with contextlib.redirect_stdout(io.StringIO()):  # the loop's log lines; the rows carry the numbers
        rows = pretrain(parse_args(argv), state=ctx.parallel_state(1, pp))
    return rows if ctx.rank == 0 else None


class SmallScale:
    """Local gloo worlds for the small-scale measurements, started lazily, one per world size."""

    def __init__(self) -> None:
        self._pools: dict = {}

    def _pool(self, world: int):
        from megatron_pp.core.local_world import WorkerPool

        if world not in self._pools:
            self._pools[world] = WorkerPool(world)
        return self._pools[world]

    def run(self, *args: object, world: int = 4) -> list[dict]:
        """`measure_worker(*args)` on every rank of a `world`-process world."""
        return self._pool(world).run(measure_worker, *args)

    def train(self, argv: list[str], pp: int, world: int) -> list[dict]:
        """Rank 0's metric rows of `pretrain(argv)` on a `world`-process world."""
        return self._pool(world).run(train_worker, argv, pp)[0]

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools = {}


def _peak_trend(report: PaperReport, small: SmallScale, label: str, config: TransformerConfig, runs: Sequence[tuple],
                micro_batch: int = 1) -> dict:
    """Measured vs predicted worst-rank stash peaks for several (name, pp, m, v, options, recompute) runs;
    one Trend per run (worst rank) plus the returned {name: (measured, predicted)} for ratio rows."""
    out = {}
    for key, name, pp, m, v, options, recompute in runs:
        measured = small.run(config, name, pp, m, v, options, micro_batch)
        per_rank_measured = [r["peak_stash_bytes"] for r in measured][:pp]
        predicted = predicted_stash_peaks(config, name, pp, m, v, options, micro_batch, recompute)
        errors = [relative_error(pr, me) for pr, me in zip(predicted, per_rank_measured) if me]
        worst = max(errors, key=abs) if errors else None
        report.trends.append(Trend(
            f"{label}: peak stash per rank, {key}", f"pp {pp}, m {m}, v {v}, b {micro_batch}",
            " / ".join(f"{x / 1024:.0f}" for x in per_rank_measured) + " KiB",
            " / ".join(f"{x / 1024:.0f}" for x in predicted) + " KiB", worst))
        out[key] = (max(per_rank_measured), max(predicted), per_rank_measured, predicted)
    return out


def _ratio_trend(report: PaperReport, label: str, setting: str, a: tuple, b: tuple) -> None:
    measured, predicted = a[0] / b[0], a[1] / b[1]
    report.trends.append(Trend(label, setting, f"{measured:.2f}", f"{predicted:.2f}",
                               relative_error(predicted, measured)))


def small_scale(paper: str, report: PaperReport, small: SmallScale, quick: bool = True) -> None:
    """Append the paper's small-scale trends (executor on CPU vs simulator) to `report`."""
    cfg = tiny_config()
    if paper == "bpipe":
        peaks = _peak_trend(report, small, "BPipe", cfg, [
            ("1f1b", "1f1b", 4, 8, 1, {}, "none"), ("bpipe K=2", "bpipe", 4, 8, 1, {"bpipe_max_resident": 2}, "none")])
        _ratio_trend(report, "BPipe: worst-rank stash, BPipe (K=2) / 1F1B", "pp 4, m 8", peaks["bpipe K=2"],
                     peaks["1f1b"])
    elif paper == "bpipe-reeval":
        sdpa = dataclasses.replace(cfg, attention_backend="sdpa")
        ref = dataclasses.replace(cfg, attention_backend="reference")
        a = _peak_trend(report, small, "unfused attention", ref, [("1f1b b=2", "1f1b", 4, 4, 1, {}, "none")],
                        micro_batch=2)
        b = _peak_trend(report, small, "flash (SDPA on CPU)", sdpa, [("1f1b b=2", "1f1b", 4, 4, 1, {}, "none")],
                        micro_batch=2)
        _ratio_trend(report, "stash per microbatch, unfused / flash attention", "pp 4, b 2, s 32",
                     a["1f1b b=2"], b["1f1b b=2"])
    elif paper == "pipeoffload":
        runs = [("1f1b-i", "interleaved-1f1b", 4, 8, 2, {}, "none"), ("gis-h", "gis-h", 4, 8, 2, {}, "none"),
                ("po-h", "po-h", 4, 8, 2, {}, "none"), ("po-f", "po-f", 4, 8, 2, {}, "none")]
        peaks = _peak_trend(report, small, "PipeOffload", cfg, runs)
        for key in ("gis-h", "po-h", "po-f"):
            _ratio_trend(report, f"PipeOffload: worst-rank stash, {key} / 1F1B-I", "pp 4, m 8, v 2", peaks[key],
                         peaks["1f1b-i"])
    elif paper == "2bw":
        tiny = ["--model-preset", "gpt-tiny", "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
                "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "256", "--mock-data",
                "--lr", "1e-4", "--log-interval", str(10 ** 6), "--micro-batch-size", "1"]
        peaks = {}
        for name in ("1f1b", "2bw"):
            rows = small.train(tiny + ["--pipeline-model-parallel-size", "4", "--global-batch-size", "4",
                                       "--train-iters", "3", "--pipeline-schedule", name], pp=4, world=4)
            measured = [float(b) for b in rows[-1]["peak_stash_bytes"]]
            predicted = predicted_stash_peaks(cfg, name, 4, 4, 1, {}, 1)
            errors = [relative_error(pr, me) for pr, me in zip(predicted, measured) if me]
            report.trends.append(Trend(f"2BW: peak stash per rank, {name} (training loop)", "pp 4, m 4 = p, b 1",
                                       " / ".join(f"{x / 1024:.0f}" for x in measured) + " KiB",
                                       " / ".join(f"{x / 1024:.0f}" for x in predicted) + " KiB",
                                       max(errors, key=abs) if errors else None))
            peaks[name] = (max(measured), max(predicted))
        _ratio_trend(report, "2BW: worst-rank stash, 2BW / Flush at m = p (weights excluded)", "pp 4, m 4",
                     peaks["2bw"], peaks["1f1b"])
        # Step time at m = p on 2 processes (one per vCPU of a small machine), larger layers so that
        # compute dominates the per-action overheads.
        wide = ["--model-preset", "gpt-tiny", "--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8",
                "--ffn-hidden-size", "1024", "--seq-length", "128", "--max-position-embeddings", "128",
                "--vocab-size", "2048", "--mock-data", "--lr", "1e-4", "--log-interval", str(10 ** 6),
                "--micro-batch-size", "2", "--pipeline-model-parallel-size", "2", "--global-batch-size", "4"]
        iterations = 6 if quick else 10
        ratios = []
        for round_ in range(1 if quick else 3):
            step = {}
            for name in (("1f1b", "2bw") if round_ % 2 == 0 else ("2bw", "1f1b")):
                rows = small.train(wide + ["--train-iters", str(iterations), "--pipeline-schedule", name],
                                   pp=2, world=2)
                step[name] = statistics.median(r["step_time_s"] for r in rows[2:-1])
            ratios.append(step["1f1b"] / step["2bw"])
        one = simulate(build_schedule("2bw", 2, 2, steps=1)).makespan
        three = simulate(build_schedule("2bw", 2, 2, steps=3)).makespan
        flush = simulate(build_schedule("1f1b", 2, 2)).makespan
        predicted = flush / ((three - one) / 2)
        measured = statistics.median(ratios)
        report.trends.append(Trend("2BW vs Flush: step time ratio Flush / 2BW at m = p",
                                   f"pp 2, m 2, b 2, h 256, s 128; median of {len(ratios)} paired round(s)",
                                   f"{measured:.2f}×", f"{predicted:.2f}× (simulated, F:B = 1:2)",
                                   relative_error(predicted, measured)))
    elif paper == "breadth-first":
        peaks = _peak_trend(report, small, "breadth-first", cfg, [
            ("1f1b", "1f1b", 4, 8, 1, {}, "none"),
            ("looped-bfs v=2", "looped-bfs", 4, 8, 2, {"checkpoint_layer_inputs": False}, "none")])
        _ratio_trend(report, "breadth-first: worst-rank stash, looped-bfs / 1F1B", "pp 4, m 8", peaks["looped-bfs v=2"],
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
    else:
        raise ValueError(f"unknown paper {paper!r}; one of {', '.join(PAPERS)}")


PREDICTORS: dict[str, Callable[..., PaperReport]] = {
    "bpipe": predict_bpipe, "bpipe-reeval": predict_bpipe_reeval, "pipeoffload": predict_pipeoffload,
    "2bw": predict_2bw, "breadth-first": predict_breadth_first,
}


def reproduce(paper: str, *, quick: bool = False, small: Optional[SmallScale] = None, measure: bool = True,
              hardware: Optional[str] = None, efficiency_file: Optional[str] = None) -> PaperReport:
    """Full-scale rows (quick: the smallest model/cells only) and, with `measure`, the small-scale trends.
    `hardware` replaces the paper's GPU profile (a launch/hardware name); `efficiency_file` (BPipe and its
    re-evaluation) takes layer times from a tools/bench_layer.py report instead of the roofline."""
    if paper not in PREDICTORS:
        raise ValueError(f"unknown paper {paper!r}; one of {', '.join(PAPERS)}")
    kwargs: dict = {}
    if quick and paper == "bpipe":
        kwargs["models"] = ("96b",)
    if quick and paper == "pipeoffload":
        kwargs["cells"] = [("10.5b", 4096)]
    if hardware:
        kwargs["hardware"] = hardware
    if efficiency_file:
        if paper not in ("bpipe", "bpipe-reeval"):
            raise ValueError(f"--efficiency-file applies to bpipe and bpipe-reeval, not {paper}")
        kwargs["efficiency_file"] = efficiency_file
    report = PREDICTORS[paper](**kwargs)
    if measure:
        own = small is None
        small = small or SmallScale()
        try:
            small_scale(paper, report, small, quick=quick)
        finally:
            if own:
                small.close()
    return report
