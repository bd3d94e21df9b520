"""What the planner plans and what it answers: a job (model, global batch, numerics), a cluster (GPUs,
links, host link), one configuration of the search space (layout, microbatch, recomputation, schedule and
its options), a prediction for it, and a plan (ranked predictions with what was left out and why).

Plain data shared by the cost model (`planning.cost`), the search (`planning.planner`) and the report
(`planning.report`); nothing here times or builds a schedule.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from megatron_pp.models.config import TransformerConfig
from megatron_pp.models.presets import get_preset
from megatron_pp.planning.efficiency import HardwareProfile
from megatron_pp.planning.memory import (CPU_FP32, DEFAULT_RESERVED_FRACTION, MEGATRON_BF16, OPTIMIZER_IMPLEMENTATIONS,
                                         WEIGHT_GRAD_FOLDS, Numerics, attention_kind)

GIB = 2 ** 30

HOST_LINK_GBPS = {"A100": 31.5, "H100": 63.0, "H200": 63.0}
"""Default host link (PCIe) per GPU and direction, GB/s, by GPU model in the hardware profile's name:
PCIe 4.0 x16 for A100 (16 GT/s × 16 lanes × 128/130 encoding / 8 = 31.5 GB/s) and PCIe 5.0 x16 for H100 and
H200 (63 GB/s), per the PCI-SIG base specifications. Theoretical; pinned copies reach about 80% of it,
so give the measured figure (`benchmarks/bench_offload.py`) with `host_link_gbps` when offload matters."""


def default_host_link_gbps(hardware: HardwareProfile) -> float:
    """`HOST_LINK_GBPS` for the profile's GPU model; PCIe 4.0 x16 when the name names none of them."""
    return next((gbps for model, gbps in HOST_LINK_GBPS.items() if model in hardware.name), HOST_LINK_GBPS["A100"])


# What is planned -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cluster:
    """The GPUs: how many, and the device and links (`HardwareProfile`: peak FLOP/s, memory, HBM and
    NVLink/network bandwidths, GPUs per node) plus the host link that offload copies use."""

    num_gpus: int
    hardware: HardwareProfile
    host_link_gbps: Optional[float] = None
    """Per GPU and direction, GB/s; None = `default_host_link_gbps(hardware)`."""
    reserved_fraction: float = DEFAULT_RESERVED_FRACTION

    def __post_init__(self) -> None:
        if self.num_gpus < 1:
            raise ValueError(f"--num-gpus must be >= 1, got {self.num_gpus}")
        if self.host_link_gbps is not None and self.host_link_gbps <= 0:
            raise ValueError(f"--host-link-gbps must be > 0, got {self.host_link_gbps}")
        if not 0 <= self.reserved_fraction < 1:
            raise ValueError(f"--reserved-memory-fraction must be in [0, 1), got {self.reserved_fraction}")

    @property
    def capacity_bytes(self) -> float:
        return self.hardware.memory_gib * GIB * (1 - self.reserved_fraction)

    @property
    def host_bytes_per_s(self) -> float:
        gbps = self.host_link_gbps if self.host_link_gbps is not None else default_host_link_gbps(self.hardware)
        return gbps * 1e9

    def link_bytes_per_s(self, ranks: int) -> float:
        """Bandwidth of a group spanning `ranks` consecutive ranks: NVLink inside a node, else the network."""
        gbps = self.hardware.tp_link_gbps if ranks <= self.hardware.gpus_per_node else self.hardware.pair_link_gbps
        return gbps * 1e9


@dataclass(frozen=True)
class Job:
    """A training job: model (a preset, possibly with overrides), global batch, attention backend, device.

    `device_type` 'cuda' plans Megatron-style bf16 training (`memory.MEGATRON_BF16`); 'cpu' plans this
    repository's fp32 CPU path (`memory.CPU_FP32`), which is what the CPU validation runs.
    """

    preset: str
    config: TransformerConfig
    global_batch_size: int
    attention_backend: str = "flash"
    device_type: str = "cuda"
    plugins: tuple[str, ...] = ()
    """`--schedule-plugin` values that registered schedules the plan may pick (repeated in its commands)."""
    schedule_files: tuple[tuple[str, str], ...] = ()
    """(registered name, path) of schedules read from `--pipeline-schedule-file` (their commands name the file)."""
    optimizer_implementation: Optional[str] = None
    """How AdamW runs, which decides the optimizer step's transient (`memory.optimizer_step_transient_bytes`):
    None = what the job picks on its device, `fused` on cuda and `foreach` on cpu; set to compare with a dry
    run that built the other kernel (`--dry-run-optimizer`; `planning.verify.optimizer_of`)."""

    weight_grad_fold: Optional[str] = None
    """How bf16 linear layers add their weight gradient into the fp32 main gradient, which sizes the
    backward's working set (`memory.backward_transient_bytes`): None = what the job's device does,
    `fp32-output` on cuda and `upcast` on cpu; `upcast` to compare with a dry run (its fake tensors are CPU
    tensors)."""

    def __post_init__(self) -> None:
        if self.global_batch_size < 1:
            raise ValueError(f"--global-batch-size must be >= 1, got {self.global_batch_size}")
        if self.device_type not in ("cuda", "cpu"):
            raise ValueError(f"device type must be cuda or cpu, got {self.device_type!r}")
        get_preset(self.preset)  # raises for an unknown name
        self.config.validate(1)
        object.__setattr__(self, "config", dataclasses.replace(self.config, attention_backend=self.attention_backend))
        self.attention  # raises for an unsupported backend / dropout combination
        if self.optimizer_implementation not in (None, *OPTIMIZER_IMPLEMENTATIONS):
            raise ValueError(f"optimizer implementation {self.optimizer_implementation!r} is not one of "
                             f"{', '.join(OPTIMIZER_IMPLEMENTATIONS)}")
        if self.weight_grad_fold not in (None, *WEIGHT_GRAD_FOLDS):
            raise ValueError(f"weight-gradient fold {self.weight_grad_fold!r} is not one of "
                             f"{', '.join(WEIGHT_GRAD_FOLDS)}")

    @property
    def optimizer(self) -> str:
        """The AdamW implementation the step runs (`optimizer_implementation`, or the device's)."""
        return self.optimizer_implementation or ("fused" if self.device_type == "cuda" else "foreach")

    @property
    def fold(self) -> str:
        """How the weight gradient reaches the fp32 main gradient (`weight_grad_fold`, or the device's)."""
        return self.weight_grad_fold or ("fp32-output" if self.device_type == "cuda" else "upcast")

    @property
    def attention(self) -> str:
        """'unfused' or 'flash' (`memory.attention_kind`)."""
        return attention_kind(self.attention_backend, self.device_type, self.config.attention_dropout)

    @property
    def bf16(self) -> bool:
        return self.device_type == "cuda"

    @property
    def numerics(self) -> Numerics:
        return MEGATRON_BF16 if self.bf16 else CPU_FP32

    @property
    def param_bytes(self) -> int:
        return 2 if self.bf16 else 4


@dataclass(frozen=True)
class Configuration:
    """One point of the search space: everything the launch flags say."""

    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    recompute: str
    schedule: str
    num_chunks: int = 1
    options: tuple[tuple[str, object], ...] = ()
    """Schedule options (builder keywords) other than defaults, sorted by name."""
    distributed_optimizer: bool = False
    overlap_param_gather: bool = False
    """--overlap-param-gather (with the distributed optimizer): each update's gathered parameters are held
    until the chunk's first forward (`memory.overlapped_gather_companions_bytes`)."""

    @property
    def sequence_parallel(self) -> bool:
        """Always on with tensor parallelism: it only removes replicated activations (Korthikanti et al.)."""
        return self.tp > 1

    def num_microbatches(self, global_batch_size: int) -> int:
        return global_batch_size // (self.dp * self.micro_batch_size)

    def label(self) -> str:
        opts = "".join(f" {k}={v:g}" if isinstance(v, float) else f" {k}={v}" for k, v in self.options)
        v = f" v={self.num_chunks}" if self.num_chunks > 1 else ""
        zero = " zero1" if self.distributed_optimizer else ""
        zero += " overlap-gather" if self.overlap_param_gather else ""
        return (f"{self.schedule}{v}{opts} tp{self.tp} pp{self.pp} dp{self.dp} b={self.micro_batch_size} "
                f"recompute={self.recompute}{zero}")


@dataclass
class Prediction:
    """What the model says about one configuration. Per-rank tuples are indexed by pipeline rank."""

    configuration: Configuration
    num_microbatches: int
    weight_versions: int
    state_bytes: tuple[float, ...]
    """Weights, gradients, optimizer state and extra weight versions."""
    stash_bytes: tuple[float, ...]
    """Peak device-resident stash bytes (what the executor's activation store measures)."""
    peak_stashes: tuple[float, ...]
    """Peak device-resident (microbatch, chunk) stashes, as the simulator counts them."""
    transient_bytes: float
    memory_bytes: tuple[float, ...]
    capacity_bytes: float
    step_s: Optional[float] = None
    """None when the configuration does not fit (its timing is not simulated)."""
    pipeline_s: Optional[float] = None
    """Simulated makespan of the schedule alone (the flushed step without gradient reduction)."""
    reduce_s: float = 0.0
    """Slowest rank's gradient reduction (dp and tied embedding) plus optimizer step."""
    bubble_fraction: Optional[float] = None
    mfu: Optional[float] = None
    tokens_per_s: Optional[float] = None
    extrapolated: bool = False
    """Whether the schedule was simulated at smaller m and extended linearly (see the module docstring)."""
    optimizer_step_bytes: tuple[float, ...] = ()
    """Per rank, what the optimizer step allocates above the state (`memory.optimizer_step_transient_bytes`);
    `memory_bytes` is the larger of the backward's peak and state plus this."""
    backward_bytes: tuple[float, ...] = ()
    """Per rank, the backward's working set beside state and stashes (`memory.backward_transient_bytes`,
    the largest over the rank's chunks), in the backward's peak."""

    def peak_phase(self, rank: int) -> str:
        """'optimizer' where the optimizer step sets the rank's peak, else 'pipeline'."""
        if rank < len(self.optimizer_step_bytes) and (
                self.state_bytes[rank] + self.optimizer_step_bytes[rank] >= self.memory_bytes[rank]):
            return "optimizer"
        return "pipeline"

    @property
    def fits(self) -> bool:
        return max(self.memory_bytes) <= self.capacity_bytes

    @property
    def peak_memory_bytes(self) -> float:
        return max(self.memory_bytes)

    @property
    def worst_rank(self) -> int:
        return self.memory_bytes.index(self.peak_memory_bytes)


@dataclass
class Plan:
    """The outcome of a search: fitting configurations ranked by predicted step time, and what was left out."""

    job: Job
    cluster: Cluster
    ranked: list[Prediction]
    considered: int
    """Every configuration of the search space, and the plain-data-parallel twin of each ZeRO-1 one the
    training script refused (`Planner.plan`)."""
    over_memory: int
    """Configurations discarded because their modelled memory (or its lower bound) exceeds the budget."""
    skipped: dict[str, int]
    """Reason (a schedule refusing a size, an unsupported option, the training script's `validate_args`
    refusing the flags...) -> how many configurations."""
    evaluated: int
    """Configurations whose schedules were built (`Planner.prepare`)."""
    dominated: int
    """Configurations skipped: a faster one that differs only by less recompute or offload fits."""
    untimed: int
    """Configurations never examined: their step-time lower bound ranks them below `ranked`."""
    warnings: list[str] = field(default_factory=list)
    efficiency: str = ""


class ScheduleUnavailable(ValueError):
    """A registered schedule cannot be built (or simulated) for a configuration; the planner skips it."""
