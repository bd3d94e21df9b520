"""What every paper's reproduction shares: the rows and trends of a report and their relative error, the
GPU profiles of `launch/hardware/*.yaml`, the paper configs of `launch/configs/*.yaml` parsed as the
training script parses them, and the BPipe estimator's job and layer model for such a config."""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Optional, Sequence

import yaml

from megatron_pp.models.config import TransformerConfig
from megatron_pp.models.layout import StageSpec, split_layers
from megatron_pp.planning.bpipe_estimator import Job
from megatron_pp.planning.cost import compute_costs
from megatron_pp.planning.efficiency import HARDWARE_PROFILES, HardwareProfile, LayerTimes, MeasuredCurve, Roofline
from megatron_pp.planning.memory import attention_kind
from megatron_pp.schedules.ir import Op

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CONFIG_DIR = os.path.join(ROOT, "launch", "configs")
HARDWARE_DIR = os.path.join(ROOT, "launch", "hardware")
GB = 1e9
GIB = 2 ** 30


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


def error_text(error: Optional[float]) -> str:
    return "—" if error is None else f"{100 * error:+.0f}%"


ROWS_HEADER = "| Claim | Published | Predicted | Error |"


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
    dry_runs: list = field(default_factory=list)
    """The jobs of the memory cells that show the dry run (papers/dry_run_cells.py `CellJob`); not in to_dict."""

    def row_cells(self) -> list[tuple[str, str, str, str]]:
        """The full-scale table as printed: (claim, published, predicted, error) per row."""
        return [(r.claim, r.published, r.predicted, error_text(r.error)) for r in self.rows]

    def format(self) -> str:
        out = [f"## {self.paper}: {self.title}", "", f"Calibration: {self.calibration}", ""]
        if self.rows:
            out += [ROWS_HEADER, "|---|---|---|---|"]
            out += ["| " + " | ".join(cells) + " |" for cells in self.row_cells()]
            out.append("")
        if self.trends:
            out += ["| Small-scale trend | Setting | Measured (executor, CPU) | Predicted (simulator) | Error |",
                    "|---|---|---|---|---|"]
            out += [f"| {t.trend} | {t.setting} | {t.measured} | {t.predicted} | {error_text(t.error)} |"
                    for t in self.trends]
            out.append("")
        out += [f"- {n}" for n in self.notes]
        return "\n".join(out).rstrip() + "\n"

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        del out["dry_runs"]
        return out


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
    sources = dict(raw["sources"])
    efficiency = builtin_efficiency(raw["name"])
    if efficiency is not None:
        if "matmul_efficiency" in raw:
            raise ValueError(f"{path}: matmul_efficiency of {raw['name']} lives in megatron_pp/planning/efficiency.py "
                             "(the planner's profile); remove it here")
        sources["matmul_efficiency"] = efficiency[1]
        efficiency_value = efficiency[0]
    elif "matmul_efficiency" in raw:
        efficiency_value = float(raw["matmul_efficiency"])
    else:
        raise ValueError(f"{path}: no matmul_efficiency, and the planner has no built-in profile named {raw['name']!r}")
    profile = HardwareProfile(
        name=raw["name"], peak_tflops=float(peak), memory_gib=float(raw["memory_gib"]), hbm_gbps=float(raw["hbm_gbps"]),
        tp_link_gbps=float(raw["nvlink_gbps"]), pair_link_gbps=float(raw["ib_gbps"]),
        gpus_per_node=int(raw["gpus_per_node"]), matmul_efficiency=efficiency_value, sources=sources)
    return profile, {**raw, "matmul_efficiency": efficiency_value, "sources": sources}


def builtin_efficiency(gpu: str) -> Optional[tuple[float, str]]:
    """(matmul efficiency, its source) of the planner's built-in profile for GPU `gpu` (a profile's `name`), or
    None. The achieved efficiency has one home, `planning.efficiency.HARDWARE_PROFILES`: a hardware YAML of a
    GPU the planner knows leaves it out, so the planner and the paper reproductions cannot disagree on it."""
    profile = next((p for p in HARDWARE_PROFILES.values() if p.name == gpu), None)
    return None if profile is None else (profile.matmul_efficiency, profile.sources["matmul_efficiency"])


def efficiency_home(hardware: str, gpu: str) -> str:
    """Where the matmul efficiency of launch/hardware/`hardware`.yaml (GPU `gpu`) comes from, for a report's
    calibration line."""
    if builtin_efficiency(gpu) is not None:
        return f"the planner's {gpu} profile, megatron_pp/planning/efficiency.py"
    return f"launch/hardware/{hardware}.yaml"


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
    """Variant `variant` of `launch/configs/NAME.yaml` (or of the YAML file at path `name`) at full size,
    flags overridden by `overrides` (keys as in the YAML, e.g. `{'seq-length': 16384}`)."""
    from megatron_pp.training.arguments import build_parser, model_config_from_args

    path = name if name.endswith(".yaml") else os.path.join(CONFIG_DIR, name + ".yaml")
    with open(path) as f:
        raw = yaml.safe_load(f)
    if variant not in raw["variants"]:
        raise ValueError(f"{os.path.basename(path)} has no variant {variant!r}; it has {', '.join(raw['variants'])}")
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


def gb_text(value: float) -> str:
    return f"{value / GB:.1f} GB"


def chunk_costs(setting: Setting, hw: HardwareProfile, specs: Sequence[StageSpec], layer: LayerTimes,
                scale: float, split: bool, recompute: str = "none") -> dict:
    """(op, global stage) -> seconds, from the planner's own cost function (`cost.compute_costs`: F, B and
    a split backward's BI and BW), compute × scale; BI and BW only where the schedule splits the backward."""
    costs = compute_costs(setting.config, specs, layer, hw, micro_batch=setting.micro_batch, tp=setting.tp,
                          sequence_parallel=setting.args.sequence_parallel, recompute=recompute)
    ops = (Op.F, Op.B, Op.BI, Op.BW) if split else (Op.F, Op.B)
    return {(op, s): max(t, 1e-6) * scale for (op, s), t in costs.items() if op in ops}
