"""The planner: every parallel layout, microbatch size, recomputation and registered schedule of a job,
what fits in GPU memory, and how fast each one runs (PipeDream-2BW's Algorithm 1, generalised).

PipeDream-2BW (Narayanan et al., ICML 2021, arXiv 2006.09503, §3.1 and Appendix A) plans a job by
brute force: for every width × depth split of the GPUs, take the largest microbatch and recompute flag
that fit memory, predict throughput with a closed-form cost model, keep the best. This module searches a
larger space and replaces both closed forms by the repository's own models:

    tp × pp × dp          every split of the GPUs with tp ≤ GPUs per node and valid for the model's heads,
                          groups and MLP width, pp dividing the layers, dp dividing the global batch
    micro_batch_size b    every divisor of the per-replica batch G / dp up to a bound; m = G / (dp·b)
    recompute             none, selective, full (`--recompute-granularity`)
    distributed optimizer on when dp > 1 (ZeRO-1: in this model it moves fewer bytes than a plain
                          all-reduce and holds less, so it is never worse), or as asked
    schedule              every schedule in `schedules.registry`, plugins included, with v ≥ 2 chunks per
                          rank (v dividing the layers per rank) for those that support virtual stages

**Nothing is special-cased by schedule name.** A schedule's memory and time come from its own action
lists, built through the registry and replayed by the simulator (`schedules.simulate`). What the
planner knows are a few *option names* of the registry (builder keywords), wherever they appear:

    offload_chunks            enumerated: 0 (not given), 1, ⌈v/2⌉ and v offloaded chunks per rank
    offload_time              set from the model (one-way copy of the worst stage's stash over its
                              forward time, rounded up to a power of 2 so builds are shared) when the
                              schedule offloads and the configuration does not give it
    checkpoint_layer_inputs   set to False with recompute "none": such a schedule recomputes by default,
                              and `--recompute-granularity` overrides it for "selective" and "full"
    steps                     planning only, never a launch flag: a schedule that can unroll several
                              optimizer steps into one list (PipeDream-2BW) is built with 2 and 3 steps and
                              its step time is the difference, one step in the steady state. A schedule
                              without a flush pays no fill and drain per step; a flushed one pays it in
                              each step and the difference is its ordinary step time

Other options keep their defaults.

**Time.** Global stage `s` (one chunk) runs `F_s = L_s·t_F(b)` and `B_s = L_s·(t_B(b) + recompute)`, plus
the output layer and cross-entropy on the last stage (`efficiency.head_times`). Layer times and what
recomputation re-runs come from a `tools/bench_layer.py` measurement (`efficiency.MeasuredCurve`) or the
roofline (`efficiency.Roofline`), tensor-parallel collectives included. A split backward is still timed
as BI = B_s and BW = 0 (our simplification, from before the executor split the weight GEMMs off into BW:
pessimistic for schedules that place BW in a bubble; tools/bench_split_backward.py measures the split). The embedding lookup is not timed (a gather, well under
1% of a stage). A stage boundary sends `s·b·h` activations (`s·b·h/tp` under sequence parallelism) over
NVLink when the whole job fits in one node, else over the network (Megatron's rank order puts pipeline
neighbours tp·dp ranks apart, so some hop crosses nodes). Offload copies take stash bytes / host link
(PCIe); peer transfers (BPipe's EVICT/LOAD) stash bytes / the pipeline link. After its last action each
rank reduces its gradients over dp (a ring all-reduce of fp32 gradients, `2(dp−1)/dp·4·P` bytes, or with
the distributed optimizer a reduce-scatter of the gradients and an all-gather of the parameters,
`(dp−1)/dp·(4 + parameter bytes)·P`), on NVLink when tp·dp fits in a node, else on the network (2BW's
`bw_width`); the ranks holding the tied embedding and head sum its gradient; then Adam runs at
device-memory speed (`ADAM_BYTES_PER_PARAMETER`). None of this overlaps the pipeline (the default,
without `--overlap-grad-reduce`). The step time is the latest rank's end of all that.

**Memory** per pipeline rank (every tp and dp rank of it holds the same):

    weights, gradients, Adam state    `memory.stage_parameters_per_gpu` of the rank's chunks (a tied
                                      embedding once per rank) × `memory.state_bytes_per_parameter`:
                                      18 bytes per parameter in bf16, 6 + 12/dp with ZeRO-1
    extra weight versions             (versions − 1) × parameters × parameter bytes, versions being the most
                                      `@v` weight versions alive at once in a rank's list
                                      (`live_weight_versions`): 2 for PipeDream-2BW, 1 for flushed schedules
    resident stashes                  the simulator's resident-stash curve, each (microbatch, chunk) weighted
                                      by its stage's `memory.stash_bytes`, at its peak: host-parked stashes
                                      do not count, a stash parked on a peer counts on the peer
                                      (`resident_peaks`; `list_order_peaks` when nothing moves)
    recomputation transient           one layer rebuilt during the backward (`transient_activation_bytes`)

A configuration fits when its worst rank is within the GPU memory minus a reserve (10%, as the BPipe
estimator assumes, for the CUDA context, NCCL buffers and fragmentation).

**Large m.** Above `m = 3p + r` (r = m mod p) the planner simulates `m1 = 2p + r` and `m2 = 3p + r` and
extends every per-rank quantity (end time, busy time, peak stash bytes) linearly to m: after the warm-up a
schedule repeats every p microbatches, so each further p microbatches add the same time, and peak
stashes are either flat (1F1B-like) or grow by the same amount (GPipe-like); a peak is never taken below
m2's. tests/planning/test_planner.py checks this against exact simulations for every registered
schedule; `evaluate(..., exact=True)` skips it.

**Search** (`Planner.plan`): best-first on lower bounds, so a large space costs little more than its best
rows. Each configuration gets schedule-free lower bounds of memory and step time (`Planner.bounds`);
those over memory are dropped. The rest are taken in order of their time bound: a configuration is
built (`prepare`: compute lists only, which settles memory when nothing moves stashes, and a tighter
bound), then simulated (`finish`), and the search stops when the lowest bound left cannot rank among
the `top`. A configuration is also skipped when one that differs only by fewer offloaded chunks and no
more recomputation, or the reverse, already fits: recomputation only adds compute and offload only adds
waits for copies (the compute order stays), so it cannot be faster.

Worked example (`Planner.evaluate`, GPT-3 13B on 64 A100-80GB, global batch 128, roofline layer times):
at tp 2 × pp 4 × dp 8 with ZeRO-1, b = 1, m = 16, no recomputation, 1F1B's rank 0 holds 10 layers and
the embedding (1.71 G parameters per GPU) at 6 + 12/8 = 7.5 bytes each = 11.96 GiB and peaks at 4 stashes
of 1.56 GiB = 6.26 GiB: 18.2 GiB. The step is 1.43 s of pipeline (20% bubble) plus 0.38 s of
data-parallel reduction over the network and Adam: 1.82 s. PipeDream-2BW holds a second bf16 copy of the
weights (+3.19 GiB on rank 0) and drops the fill and drain: 1.22 s of pipeline, 1.61 s per step.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Optional, Sequence

from megatron_pp.models.config import TransformerConfig, flag
from megatron_pp.models.layout import StageSpec, split_layers
from megatron_pp.models.presets import get_preset
from megatron_pp.planning.bpipe_estimator import DEFAULT_RESERVED_FRACTION
from megatron_pp.planning.efficiency import (EfficiencyModel, HardwareProfile, LayerShape, MeasuredCurve, Roofline,
                                             head_times)
from megatron_pp.planning.memory import (CPU_FP32, MEGATRON_BF16, RECOMPUTE_OPTIONS, Numerics, attention_kind,
                                         stage_parameters_per_gpu, state_bytes_per_parameter, stash_bytes,
                                         transient_activation_bytes)
from megatron_pp.schedules.comm import insert_communication
from megatron_pp.schedules.ir import TRANSFER_OPS, Op, Schedule
from megatron_pp.schedules.offload import OffloadWarning
from megatron_pp.schedules.registry import (ScheduleEntry, build_at_nominal_size, build_schedule, get_schedule,
                                           registered_schedules, schedule_options)
from megatron_pp.schedules.runtime import hosting_bound, runtime_needs
from megatron_pp.schedules.simulate import CostModel, SimResult, simulate
from megatron_pp.schedules.validate import validate
from megatron_pp.training.flops import iteration_flops

GIB = 2 ** 30
GRAD_BYTES = 4
"""Gradients accumulate and are reduced in fp32 whatever the parameter dtype (`core.grads.GRAD_DTYPE`)."""
ADAM_BYTES_PER_PARAMETER = {True: 34, False: 32}
"""Device-memory bytes Adam moves per parameter it updates, by bf16 (True) or fp32 (False) parameters:
the gradient-norm pass reads the fp32 gradient (4); the update reads gradient, main weight and both
moments (16) and writes main weight and moments (12); bf16 training then writes the bf16 copy (2)."""
DEFAULT_MAX_MICRO_BATCH = 8
TRANSFER_GRID_BASE = 2.0
"""`--offload-time` (a schedule option: where the offload pass places copies) is rounded up to a power of
this base, so that candidates with nearly equal ratios share one built schedule; rounding up places
reloads a little earlier, never later. The simulated copies themselves take their exact modelled time."""

HOST_LINK_GBPS = {"A100": 31.5, "H100": 63.0, "H200": 63.0}
"""Default host link (PCIe) per GPU and direction, GB/s, by GPU model in the hardware profile's name:
PCIe 4.0 x16 for A100 (16 GT/s × 16 lanes × 128/130 encoding / 8 = 31.5 GB/s) and PCIe 5.0 x16 for H100 and
H200 (63 GB/s), per the PCI-SIG base specifications. Theoretical; pinned copies reach about 80% of it,
so give the measured figure (`tools/bench_offload.py`) with `host_link_gbps` when offload matters."""


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

    def __post_init__(self) -> None:
        if self.global_batch_size < 1:
            raise ValueError(f"--global-batch-size must be >= 1, got {self.global_batch_size}")
        if self.device_type not in ("cuda", "cpu"):
            raise ValueError(f"device type must be cuda or cpu, got {self.device_type!r}")
        get_preset(self.preset)  # raises for an unknown name
        self.config.validate(1)
        object.__setattr__(self, "config", dataclasses.replace(self.config, attention_backend=self.attention_backend))
        self.attention  # raises for an unsupported backend / dropout combination

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
    """Every configuration of the search space."""
    over_memory: int
    """Configurations discarded because their modelled memory (or its lower bound) exceeds the budget."""
    skipped: dict[str, int]
    """Reason (a schedule refusing a size, an unsupported option...) -> how many configurations."""
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


# The planner ---------------------------------------------------------------------------------------------


@dataclass
class _Replay:
    """Per-rank results at one microbatch count: the inputs of (possible) extrapolation in m."""

    m: int
    stash_bytes: list[float]
    stash_count: list[float]
    end: list[float] = field(default_factory=list)
    """When each rank's last action ends (one optimizer step; empty before timing)."""
    busy: list[float] = field(default_factory=list)


@dataclass
class _Prepared:
    """A configuration between `Planner.prepare` and `Planner.finish`."""

    configuration: Configuration
    m: int
    stash: list[int]
    transient: float
    versions: int
    groups: list[tuple[Schedule, ...]]
    """Per simulated microbatch count, compute lists: the schedule, or (2 steps, 3 steps) for schedules
    that unroll steps (`Planner.schedule`, not runnable)."""
    params: list[int]
    state: tuple[float, ...]
    costs: CostModel
    transfers: bool
    after: list[float]
    bound_s: float
    """Lower bound of the step time: the busiest rank's compute plus what follows its last action."""
    memory: Optional[Prediction] = None
    """The memory, when it does not depend on timing (the schedule moves no stashes)."""

    @property
    def sizes(self) -> list[int]:
        return [group[0].num_microbatches // group[0].options.get("steps", 1) for group in self.groups]


class Planner:
    """Enumerate, evaluate and rank the configurations of `job` on `cluster`.

    `efficiency_file` is a `tools/bench_layer.py` report (layer times per microbatch size, scaled by FLOPs
    to each tp shard), else the roofline of `cluster.hardware`. `schedules` limits the search to those
    names (default: all registered); unknown names are reported in `Plan.skipped`, not raised.
    """

    def __init__(
        self,
        job: Job,
        cluster: Cluster,
        *,
        efficiency_file: Optional[str] = None,
        schedules: Optional[Sequence[str]] = None,
        recompute_options: Sequence[str] = RECOMPUTE_OPTIONS,
        max_micro_batch_size: int = DEFAULT_MAX_MICRO_BATCH,
        max_virtual_stages: Optional[int] = None,
        distributed_optimizer: Sequence[bool] = (True,),
    ) -> None:
        for option in recompute_options:
            if option not in RECOMPUTE_OPTIONS:
                raise ValueError(f"recompute option {option!r} is not one of {', '.join(RECOMPUTE_OPTIONS)}")
        if max_micro_batch_size < 1:
            raise ValueError(f"--max-micro-batch-size must be >= 1, got {max_micro_batch_size}")
        if max_virtual_stages is not None and max_virtual_stages < 1:
            raise ValueError(f"--max-virtual-stages must be >= 1, got {max_virtual_stages}")
        self.job, self.cluster = job, cluster
        self.efficiency_file = efficiency_file
        self.schedule_names = None if schedules is None else list(schedules)
        self.recompute_options = tuple(recompute_options)
        self.max_micro_batch_size = max_micro_batch_size
        self.max_virtual_stages = max_virtual_stages
        self.distributed_optimizer = tuple(distributed_optimizer)
        self.warnings: list[str] = []
        self._efficiency: dict[int, EfficiencyModel] = {}
        self._schedules: dict[tuple, Schedule | ScheduleUnavailable] = {}
        self._per_stage: dict[tuple, int] = {}

    # Search space --------------------------------------------------------------------------------------
    def layouts(self) -> list[tuple[int, int, int]]:
        """Every (tp, pp, dp) of the cluster's GPUs that the model and the global batch allow."""
        config, n = self.job.config, self.cluster.num_gpus
        out = []
        for tp in range(1, min(n, self.cluster.hardware.gpus_per_node) + 1):
            if n % tp:
                continue
            try:
                config.validate(tp)
            except ValueError:
                continue
            if tp > 1 and config.seq_length % tp:  # sequence parallelism splits the sequence
                continue
            for pp in range(1, n // tp + 1):
                dp = n // (tp * pp)
                if n % (tp * pp) or config.num_layers % pp or self.job.global_batch_size % dp:
                    continue
                out.append((tp, pp, dp))
        return out

    def entries(self) -> tuple[list[ScheduleEntry], list[str]]:
        """Registered schedules to plan, and the requested names that are not registered."""
        registered = registered_schedules()
        if self.schedule_names is None:
            return registered, []
        by_name = {name: e for e in registered for name in (e.name, *e.aliases)}
        chosen, unknown = [], []
        for name in self.schedule_names:
            if name in by_name:
                if by_name[name] not in chosen:
                    chosen.append(by_name[name])
            else:
                unknown.append(name)
        return chosen, unknown

    def variants(self, entry: ScheduleEntry, pp: int) -> list[tuple[int, tuple[tuple[str, object], ...]]]:
        """(chunks per rank, options) of `entry` to try at pipeline size `pp` (option rules: the module docstring)."""
        per_rank = self.job.config.num_layers // pp
        if entry.supports_virtual:
            limit = per_rank if self.max_virtual_stages is None else min(per_rank, self.max_virtual_stages)
            chunks = [v for v in range(2, limit + 1) if per_rank % v == 0]
        else:
            chunks = [1]
        out = []
        for v in chunks:
            if "offload_chunks" in entry.options:
                for k in sorted({0, 1, math.ceil(v / 2), v}):
                    out.append((v, (("offload_chunks", k),) if k else ()))
            else:
                out.append((v, ()))
        return out

    def carries_weight_versions(self, entry: ScheduleEntry, pp: int) -> bool:
        """Whether `entry`'s lists carry weight versions (a fact of its lists, as the trainer reads it)."""
        key = ("versions", entry.name, pp)
        if key not in self._per_stage:
            try:
                self._per_stage[key] = runtime_needs(build_at_nominal_size(entry.name, pp)).weight_versions
            except Exception:  # noqa: BLE001 - a plugin may fail any way; its configurations are skipped later
                self._per_stage[key] = False
        return self._per_stage[key]

    def configurations(self) -> Iterator[Configuration]:
        """The search space, each configuration after those that dominate it (same everything, fewer
        offloaded chunks and no more recomputation, or the reverse: see `plan`)."""
        entries, _ = self.entries()
        recompute = sorted(self.recompute_options, key=RECOMPUTE_OPTIONS.index)
        for tp, pp, dp in self.layouts():
            per_replica = self.job.global_batch_size // dp
            sizes = [b for b in range(1, min(self.max_micro_batch_size, per_replica) + 1) if per_replica % b == 0]
            for zero in sorted({z and dp > 1 for z in self.distributed_optimizer}):
                for entry in entries:
                    if zero and self.carries_weight_versions(entry, pp):
                        # A deferred update (2BW) keeps whole fp32 main weights per stage: validate_args refuses
                        # --use-distributed-optimizer with it, so the row could not be launched.
                        continue
                    for v, options in self.variants(entry, pp):
                        for b in sizes:
                            for r in recompute:
                                yield Configuration(tp, pp, dp, b, r, entry.name, v, options, zero)

    # Models --------------------------------------------------------------------------------------------
    def efficiency(self, tp: int) -> EfficiencyModel:
        """Layer times of the tp shard (with sequence parallelism when tp > 1), cached per tp."""
        if tp not in self._efficiency:
            shape = LayerShape.from_config(self.job.config, tp, sequence_parallel=tp > 1,
                                           activation_bytes=self.job.numerics.activation_bytes)
            hw = self.cluster.hardware
            if self.efficiency_file:
                model = MeasuredCurve.from_file(self.efficiency_file, shape, self.job.attention, hw)
                self.warnings += [w for w in model.warnings if w not in self.warnings]
            else:
                model = Roofline(shape, hw, self.job.attention)
            self._efficiency[tp] = model
        return self._efficiency[tp]

    def stages(self, c: Configuration) -> list[StageSpec]:
        return split_layers(self.job.config.num_layers, c.pp, c.num_chunks)

    def stage_stash_bytes(self, c: Configuration) -> list[int]:
        """Bytes of one (microbatch, stage) stash for every global stage."""
        out = []
        for spec in self.stages(c):
            # A search asks for the same few stage kinds (layer count, embedding, head) thousands of times.
            key = ("stash", c.tp, c.micro_batch_size, c.recompute, spec.num_layers, spec.has_embedding, spec.has_head)
            if key not in self._per_stage:
                job = self.job
                self._per_stage[key] = stash_bytes(job.config, spec, c.micro_batch_size, tp=c.tp,
                                                   sequence_parallel=c.sequence_parallel, attention=job.attention,
                                                   recompute=c.recompute, numerics=job.numerics)
            out.append(self._per_stage[key])
        return out

    def stage_parameters(self, c: Configuration) -> list[int]:
        """Parameters one GPU of every global stage holds."""
        out = []
        for spec in self.stages(c):
            key = ("params", c.tp, spec.num_layers, spec.has_embedding, spec.has_head)
            if key not in self._per_stage:
                self._per_stage[key] = stage_parameters_per_gpu(self.job.config, spec, c.tp)
            out.append(self._per_stage[key])
        return out

    def rank_parameters(self, c: Configuration, schedule: Schedule) -> list[int]:
        """Parameters one GPU of each pipeline rank holds (a tied embedding counted once per rank)."""
        specs, params = self.stages(c), self.stage_parameters(c)
        config = self.job.config
        out = []
        for rank in range(c.pp):
            held = [schedule.stage_of(rank, chunk) for chunk in range(c.num_chunks)]
            count = sum(params[s] for s in held)
            # Embedding and head as different chunks of one rank share one tied parameter (training/model.py).
            tied = not config.untie_embeddings_and_output_weights
            if tied and len(held) > 1 and any(specs[s].has_embedding for s in held) and any(
                    specs[s].has_head for s in held):
                count -= config.padded_vocab_size(c.tp) // c.tp * config.hidden_size
            out.append(count)
        return out

    def stage_times(self, c: Configuration) -> list[tuple[float, float]]:
        """(F, B) seconds of every global stage for one microbatch (B includes what recompute re-runs)."""
        layer = self.efficiency(c.tp).layer_times(c.micro_batch_size)
        head_f, head_b = head_times(self.job.config, c.micro_batch_size, c.tp, c.sequence_parallel,
                                    self.cluster.hardware)
        backward = layer.compute_s(c.recompute) - layer.forward_s
        return [(spec.num_layers * layer.forward_s + (head_f if spec.has_head else 0.0),
                 spec.num_layers * backward + (head_b if spec.has_head else 0.0)) for spec in self.stages(c)]

    def costs(self, c: Configuration, stash: Sequence[float]) -> CostModel:
        """The simulator's cost model of `c` (see the module docstring)."""
        job, cluster = self.job, self.cluster
        # Some pipeline hop crosses nodes as soon as the job does (Megatron's rank order: tp, dp, then pp).
        pipeline_link = cluster.link_bytes_per_s(cluster.num_gpus)
        measured: dict[tuple[Op, int], float] = {}
        for s, (forward, backward) in enumerate(self.stage_times(c)):
            host, peer = stash[s] / cluster.host_bytes_per_s, stash[s] / pipeline_link
            measured.update({(Op.F, s): forward, (Op.B, s): backward, (Op.BI, s): backward, (Op.BW, s): 0.0,
                             (Op.OFFLOAD, s): host, (Op.RELOAD, s): host, (Op.EVICT, s): peer, (Op.LOAD, s): peer})
        rows = job.config.seq_length * c.micro_batch_size // (c.tp if c.sequence_parallel else 1)
        boundary = rows * job.config.hidden_size * job.numerics.activation_bytes / pipeline_link
        return CostModel(measured=measured, p2p_latency=boundary)

    def offload_time(self, c: Configuration, stash: Sequence[float]) -> float:
        """The `offload_time` option for `c`: one-way copy over forward time, worst stage, rounded up."""
        ratio = max(stash[s] / self.cluster.host_bytes_per_s / max(f, 1e-12)
                    for s, (f, _) in enumerate(self.stage_times(c)))
        return TRANSFER_GRID_BASE ** math.ceil(math.log(max(ratio, 1e-6), TRANSFER_GRID_BASE))

    def with_planned_options(self, c: Configuration, stash: Sequence[float]) -> Configuration:
        """`c` with the options the planner derives from the job (option rules: the module docstring),
        unless `c` gives them."""
        entry = get_schedule(c.schedule)
        options = dict(c.options)
        offloads = "offload_chunks" not in entry.options or options.get("offload_chunks", 0) > 0
        if "offload_time" in entry.options and offloads and "offload_time" not in options:
            options["offload_time"] = self.offload_time(c, stash)
        if "checkpoint_layer_inputs" in entry.options and c.recompute == "none":
            options["checkpoint_layer_inputs"] = False
        return dataclasses.replace(c, options=tuple(sorted(options.items())))

    def after_pipeline_s(self, c: Configuration, params: Sequence[int], tied: Sequence[bool]) -> list[float]:
        """Per rank, seconds after its last action: dp reduction, the tied embedding's sum (where `tied`),
        and Adam over the `params` it holds."""
        job, cluster, config = self.job, self.cluster, self.job.config
        dp_link = cluster.link_bytes_per_s(c.tp * c.dp)
        pipeline_link = cluster.link_bytes_per_s(cluster.num_gpus)
        tied_bytes = config.padded_vocab_size(c.tp) // c.tp * config.hidden_size * GRAD_BYTES
        out = []
        for n, holds_tied in zip(params, tied):
            if c.distributed_optimizer:
                volume = (c.dp - 1) / c.dp * (GRAD_BYTES + job.param_bytes) * n
            else:
                volume = 2 * (c.dp - 1) / c.dp * GRAD_BYTES * n
            seconds = volume / dp_link
            if holds_tied:
                seconds += tied_bytes / pipeline_link  # a two-rank ring all-reduce moves the buffer once
            owned = n / c.dp if c.distributed_optimizer else n
            seconds += owned * ADAM_BYTES_PER_PARAMETER[job.bf16] / (cluster.hardware.hbm_gbps * 1e9)
            out.append(seconds)
        return out

    def _tied_ranks(self, c: Configuration, schedule: Schedule) -> list[bool]:
        """Which ranks sum the tied embedding's gradient with another rank (the embedding's and the head's)."""
        if self.job.config.untie_embeddings_and_output_weights:
            return [False] * c.pp
        first, last = schedule.location(0)[0], schedule.location(schedule.num_stages - 1)[0]
        return [first != last and rank in (first, last) for rank in range(c.pp)]

    # Schedules -----------------------------------------------------------------------------------------
    def schedule(self, c: Configuration, m: int, steps: Optional[int] = None, *, runnable: bool = True) -> Schedule:
        """`c`'s schedule at `m` microbatches per step (`steps` unrolled when given), cached. `runnable`:
        from `build_schedule` (communication inserted, validated), as the simulator needs; otherwise the
        registered builder's compute lists alone, which is all memory and placement need and several
        times cheaper, so configurations that turn out not to fit never pay for the rest. Raises
        ScheduleUnavailable."""
        options = dict(c.options, **({} if steps is None else {"steps": steps}))
        key = (c.schedule, c.pp, m, c.num_chunks, tuple(sorted(options.items())), runnable)
        if key not in self._schedules:
            entry = get_schedule(c.schedule)
            try:
                with warnings.catch_warnings():
                    # The offload pass warns about copies it cannot place; those stashes stay on the device,
                    # which the simulated memory of the built schedule shows.
                    warnings.simplefilter("ignore", OffloadWarning)
                    if not runnable:
                        sizes = (c.pp, m, c.num_chunks) if entry.supports_virtual else (c.pp, m)
                        built = entry.builder(*sizes, **options)
                    elif (c.schedule, c.pp, m, c.num_chunks, key[4], False) in self._schedules:
                        # The compute lists are built already: finish them as `build_schedule` does.
                        compute = self.schedule(c, m, steps, runnable=False)
                        built = insert_communication(dataclasses.replace(compute, name=entry.name))
                        validate(built)
                    else:
                        built = build_schedule(c.schedule, c.pp, m, c.num_chunks, **options)
                self._schedules[key] = built
            except Exception as err:  # noqa: BLE001 - a plugin's builder may fail any way; skip, do not abort
                self._schedules[key] = ScheduleUnavailable(f"{c.schedule}: {type(err).__name__}: {err}")
        built = self._schedules[key]
        if isinstance(built, ScheduleUnavailable):
            raise built
        return built

    def simulation_sizes(self, c: Configuration) -> list[int]:
        """Microbatch counts to simulate: m itself, or m1 < m2 for linear extrapolation (module docstring)."""
        m, p = c.num_microbatches(self.job.global_batch_size), c.pp
        r = m % p
        return [m] if m <= 3 * p + r else [2 * p + r, 3 * p + r]

    def _group(self, c: Configuration, m: int, runnable: bool) -> tuple[Schedule, ...]:
        """The schedule of `c` at m, or for a schedule that unrolls optimizer steps its lists of two and
        three steps: their difference is one step in the steady state (the module docstring)."""
        if "steps" in get_schedule(c.schedule).options:
            return (self.schedule(c, m, 2, runnable=runnable), self.schedule(c, m, 3, runnable=runnable))
        return (self.schedule(c, m, runnable=runnable),)

    # Evaluation ----------------------------------------------------------------------------------------
    def bounds(self, c: Configuration) -> tuple[float, float]:
        """(memory, step time) lower bounds of `c` that need no schedule: the mean rank's state, one stash
        and the recompute transient; the mean rank's compute plus the least any rank does after it."""
        job = self.job
        m = c.num_microbatches(job.global_batch_size)
        stash, params = self.stage_stash_bytes(c), self.stage_parameters(c)
        per_param = state_bytes_per_parameter(dp=c.dp, distributed_optimizer=c.distributed_optimizer, bf16=job.bf16)
        memory = sum(params) / c.pp * per_param + min(stash) + self._transient(c)
        work = m * sum(f + b for f, b in self.stage_times(c)) / c.pp
        after = self.after_pipeline_s(c, [c.num_chunks * min(params)], [False])[0]
        return memory, work + after

    def _transient(self, c: Configuration) -> float:
        job = self.job
        return float(transient_activation_bytes(
            job.config, c.micro_batch_size, tp=c.tp, sequence_parallel=c.sequence_parallel,
            attention=job.attention, recompute=c.recompute, numerics=job.numerics))

    def prepare(self, c: Configuration, *, exact: bool = False) -> _Prepared:
        """Everything about `c` short of timing: its built schedules, state bytes, a tighter step-time
        bound, and its memory when that does not depend on timing (no stash transfers). `exact` builds
        m itself rather than the two sizes of the linear extension. Raises ScheduleUnavailable."""
        job = self.job
        m = c.num_microbatches(job.global_batch_size)
        if m < 1 or job.global_batch_size % (c.dp * c.micro_batch_size):
            raise ValueError(f"--global-batch-size {job.global_batch_size} is not divisible by "
                             f"--micro-batch-size {c.micro_batch_size} x data-parallel size {c.dp}")
        stash = self.stage_stash_bytes(c)
        c = self.with_planned_options(c, stash)
        groups = [self._group(c, size, runnable=False) for size in ([m] if exact else self.simulation_sizes(c))]
        versions = max(live_weight_versions(group[-1]) for group in groups)
        reference = groups[-1][-1]
        params = self.rank_parameters(c, reference)
        per_param = state_bytes_per_parameter(dp=c.dp, distributed_optimizer=c.distributed_optimizer, bf16=job.bf16)
        state = tuple(n * (per_param + (versions - 1) * job.param_bytes) for n in params)
        costs = self.costs(c, stash)
        after = self.after_pipeline_s(c, params, self._tied_ranks(c, reference))
        # Each (microbatch, chunk) gets one forward and one backward (B, or BI + BW) per step, so a rank
        # computes at least m × Σ(F + B) over its chunks before its reduction and optimizer step.
        work = [m * sum(costs.duration(op, reference.stage_of(rank, chunk))
                        for op in (Op.F, Op.B) for chunk in range(c.num_chunks)) for rank in range(c.pp)]
        transfers = any(a.op in TRANSFER_OPS for group in groups for s in group for acts in s.actions for a in acts)
        prepared = _Prepared(c, m, stash, self._transient(c), versions, groups, params, state, costs, transfers,
                             after, max(w + a for w, a in zip(work, after)))
        if not transfers:
            # Without stash transfers the resident stashes follow list order alone, whatever the timing,
            # so the memory is known now and a configuration that cannot fit is never simulated.
            prepared.memory = self._memory(prepared, [
                _Replay(size, list_order_peaks(group[-1], stash), list_order_peaks(group[-1], [1] * len(stash)))
                for size, group in zip(prepared.sizes, groups)])
        return prepared

    def finish(self, prepared: _Prepared) -> Prediction:
        """Simulate a prepared configuration: step time, bubble, MFU, and the memory of schedules that
        move stashes. A configuration that does not fit comes back untimed (`step_s` None)."""
        if prepared.memory is not None and not prepared.memory.fits:
            return prepared.memory
        job, cluster, c, m = self.job, self.cluster, prepared.configuration, prepared.m
        replays = []
        for size in prepared.sizes:
            group = self._group(c, size, runnable=True)
            sims = [self._simulate(s, prepared.costs) for s in group]
            if prepared.memory is None:
                stash = resident_peaks(group[-1], sims[-1], prepared.stash)
                count = [float(n) for n in sims[-1].peak_stash]
            else:
                stash, count = list(prepared.memory.stash_bytes), list(prepared.memory.peak_stashes)
            ends = [[max((end for _, _, end in line), default=0.0) for line in sim.timeline] for sim in sims]
            if len(sims) == 1:
                end, busy = ends[0], list(sims[0].busy)
            else:  # steps unrolled: the third step alone, in the steady state
                end = [b - a for a, b in zip(*ends)]
                busy = [b - a for a, b in zip(sims[0].busy, sims[1].busy)]
            replays.append(_Replay(size, stash, count, end, busy))
        prediction = prepared.memory or self._memory(prepared, replays)
        if not prediction.fits:
            return prediction
        ends, busy = _extend(replays, m, "end"), _extend(replays, m, "busy")
        pipeline = max(ends)
        step = max(end + extra for end, extra in zip(ends, prepared.after))
        flops = iteration_flops(job.config, job.global_batch_size, tp=c.tp).model
        return dataclasses.replace(
            prediction, step_s=step, pipeline_s=pipeline, reduce_s=max(prepared.after),
            bubble_fraction=max(0.0, sum(pipeline - b for b in busy) / (len(busy) * pipeline)) if pipeline else 0.0,
            mfu=flops / (step * cluster.num_gpus * cluster.hardware.peak_tflops * 1e12),
            tokens_per_s=job.global_batch_size * job.config.seq_length / step)

    def evaluate(self, c: Configuration, *, exact: bool = False) -> Prediction:
        """Memory of `c` and, when it fits, its simulated step time. `exact` simulates m itself instead of
        extending smaller simulations. Raises ScheduleUnavailable."""
        return self.finish(self.prepare(c, exact=exact))

    def _memory(self, prepared: _Prepared, replays: list[_Replay]) -> Prediction:
        c, m = prepared.configuration, prepared.m
        resident = _extend(replays, m, "stash_bytes", floor=True)
        counts = _extend(replays, m, "stash_count", floor=True)
        memory = tuple(prepared.state[r] + resident[r] + prepared.transient for r in range(c.pp))
        return Prediction(c, m, prepared.versions, prepared.state, tuple(resident), tuple(counts),
                          prepared.transient, memory, self.cluster.capacity_bytes,
                          extrapolated=all(r.m != m for r in replays))

    @staticmethod
    def _simulate(schedule: Schedule, costs: CostModel) -> SimResult:
        try:
            return simulate(schedule, costs)
        except Exception as err:  # noqa: BLE001 - e.g. a plugin's op the simulator does not know
            raise ScheduleUnavailable(f"{schedule.name}: simulation failed: {type(err).__name__}: {err}") from None

    # Search --------------------------------------------------------------------------------------------
    def plan(self, top: Optional[int] = None, fold: bool = False) -> Plan:
        """The `top` fastest configurations that fit (all of them when None), ranked by `ranking_key`;
        with `fold`, the `top` fastest classes of `equivalence_key` (every member of them is returned).

        Best-first: every configuration gets schedule-free lower bounds of its memory and step time
        (`bounds`); those over memory are dropped, the rest wait in order of their time bound. Taking
        the lowest, the search builds its schedule (`prepare`, which tightens the bound and settles the
        memory where timing does not matter) and puts it back, or, already prepared, simulates it
        (`finish`). Once the lowest bound exceeds the `top`-th best step time found, nothing left can
        rank among the `top`. A configuration is also skipped when one that differs only by fewer
        offloaded chunks and no more recomputation (or the reverse) fits: recomputation only adds
        compute and offload only adds waits for copies (the compute order is unchanged), so it cannot be
        faster; `configurations` yields the dominating ones first, which the bound order keeps.
        """
        _, unknown = self.entries()
        skipped: dict[str, int] = {f"schedule {name!r} is not registered": 1 for name in unknown}
        fitting: dict[Configuration, list[tuple[int, int]]] = {}
        waiting: list[tuple[float, int, Configuration | _Prepared]] = []
        over = evaluated = dominated = untimed = considered = 0
        for order, c in enumerate(self.configurations()):
            considered += 1
            memory, time_bound = self.bounds(c)
            if memory > self.cluster.capacity_bytes:
                over += 1
            else:
                waiting.append((time_bound, order, c))
        heapq.heapify(waiting)

        def fits(c: Configuration) -> None:
            group, level = _ladder(c)
            fitting.setdefault(group, []).append(level)

        ranked: list[Prediction] = []
        leaders: list[Prediction] = []
        while waiting:
            bound, order, item = heapq.heappop(waiting)
            if top is not None and len(leaders) >= top and _rounded(bound) > _rounded(leaders[top - 1].step_s):
                untimed = 1 + len(waiting)
                break
            try:
                if isinstance(item, Configuration):
                    group, level = _ladder(item)
                    if any(k <= level[0] and r <= level[1] for k, r in fitting.get(group, ())):
                        dominated += 1
                        continue
                    evaluated += 1
                    prepared = self.prepare(item)
                    if prepared.memory is not None:
                        if not prepared.memory.fits:
                            over += 1
                            continue
                        fits(item)
                    heapq.heappush(waiting, (prepared.bound_s, order, prepared))
                    continue
                prediction = self.finish(item)
            except ScheduleUnavailable as err:
                skipped[str(err)] = skipped.get(str(err), 0) + 1
                continue
            if not prediction.fits:
                over += 1
                continue
            if item.memory is None:
                fits(item.configuration)
            ranked.append(prediction)
            ranked.sort(key=ranking_key)
            leaders = _leaders(ranked) if fold else ranked
        if top is not None:
            kept = {equivalence_key(p) for p in leaders[:top]} if fold else None
            ranked = [p for p in ranked if equivalence_key(p) in kept] if fold else ranked[:top]
        description = self.efficiency(1).describe() if self.layouts() else ""
        return Plan(self.job, self.cluster, ranked, considered, over, skipped, evaluated, dominated, untimed,
                    list(self.warnings), description)


def equivalence_key(p: Prediction) -> tuple:
    """Configurations with the same layout, batch split, recomputation and (rounded) step time: e.g. at
    pp = 1 every schedule runs the same step. A table shows one row per class."""
    c = p.configuration
    return (c.tp, c.pp, c.dp, c.micro_batch_size, c.recompute, c.distributed_optimizer, _rounded(p.step_s))


def _leaders(ranked: list[Prediction]) -> list[Prediction]:
    """The first (best-ranked) member of every equivalence class, in rank order."""
    seen: set[tuple] = set()
    out = []
    for p in ranked:
        key = equivalence_key(p)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def _ladder(c: Configuration) -> tuple[Configuration, tuple[int, int]]:
    """`c` without its memory-saving knobs, and their levels (offloaded chunks, recomputation)."""
    options = dict(c.options)
    level = (int(options.pop("offload_chunks", 0)), RECOMPUTE_OPTIONS.index(c.recompute))
    # Options the planner derives from the recompute choice or the copy time are not part of the group.
    for derived in ("offload_time", "checkpoint_layer_inputs"):
        options.pop(derived, None)
    return dataclasses.replace(c, recompute="none", options=tuple(sorted(options.items()))), level


RANKING_DIGITS = 4
"""Step times equal to this many significant digits (0.1%, far below the model's accuracy) count as a tie."""


def _rounded(seconds: float) -> float:
    return float(f"{seconds:.{RANKING_DIGITS}g}")


def ranking_key(p: Prediction) -> tuple:
    """Fastest first; ties go to the simpler configuration (one weight version, fewer chunks, fewer
    schedule options), then to the one with more memory to spare."""
    c = p.configuration
    return (_rounded(p.step_s), p.weight_versions, c.num_chunks, len(c.options), p.peak_memory_bytes)


def _extend(replays: list[_Replay], m: int, name: str, floor: bool = False) -> list[float]:
    """Per-rank `name` at m: a replay's own values when one was taken at m, else the line through two
    replays (m1 < m2) evaluated at m. `floor` keeps a peak from falling below the larger replay's (a peak
    never shrinks as m grows)."""
    for replay in replays:
        if replay.m == m:
            return list(getattr(replay, name))
    first, last = getattr(replays[0], name), getattr(replays[-1], name)
    m1, m2 = replays[0].m, replays[-1].m
    out = [b + (m - m2) * (b - a) / (m2 - m1) for a, b in zip(first, last)]
    return [max(x, b) for x, b in zip(out, last)] if floor else out


# Memory of a schedule ------------------------------------------------------------------------------------


def live_weight_versions(schedule: Schedule) -> int:
    """Weight copies a rank keeps at once. A version tag (`@v`) is alive on a rank from its first
    appearance in the rank's list (the STEP@v that creates it, or its first use) to its last use; the most
    versions alive together on any rank, at least 1, is applied to every rank: a two-version schedule
    keeps two parameter buffers on every stage (PipeDream-2BW at pp = 1 still updates W(t) while batch t
    runs on W(t − 1)). A flushed schedule tags nothing and keeps one."""
    most = 1
    for acts in schedule.actions:
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for index, a in enumerate(acts):
            if a.version is not None:
                first.setdefault(a.version, index)
                last[a.version] = index
        # One action carries one version, so no interval starts where another ends: order is unambiguous.
        edges = sorted([(i, 1) for i in first.values()] + [(i, -1) for i in last.values()], key=lambda e: (e[0], -e[1]))
        alive = 0
        for _, delta in edges:
            alive += delta
            most = max(most, alive)
    return most


def list_order_peaks(schedule: Schedule, stage_bytes: Sequence[float]) -> list[float]:
    """Peak stash bytes per rank of a schedule that moves no stashes: walking each rank's list, + a
    stash at its F, − at its B (or BW). Compute runs in list order on a rank, so this is the simulator's
    curve under any cost model (`resident_peaks` of any simulation; tested)."""
    peaks = []
    for rank, acts in enumerate(schedule.actions):
        level = peak = 0.0
        for a in acts:
            if a.op is Op.F:
                level += stage_bytes[schedule.stage_of(rank, a.chunk)]
                peak = max(peak, level)
            elif a.op is Op.B or a.op is Op.BW:
                level -= stage_bytes[schedule.stage_of(rank, a.chunk)]
        peaks.append(peak)
    return peaks


def resident_peaks(schedule: Schedule, sim: SimResult, stage_bytes: Sequence[float]) -> list[float]:
    """Peak device-resident stash bytes per rank: the simulator's stash curve with each (microbatch,
    chunk) weighted by its stage's bytes.

    The accounting is the simulator's (schedules/simulate.py): + a stash when its F starts, − when its B
    (or BW) ends, − when an OFFLOAD/EVICT copy completes and + when the RELOAD/LOAD back starts; a parked
    stash counts on its peer from the peer's ACCEPT until the LOAD has delivered it back. Events of a
    rank's own actions at equal times keep list order, as the simulator records them; a peer's events
    at equal times are taken pessimistically (arrivals first, departures last). With unit bytes this
    reproduces `SimResult.peak_stash` (tested).

    A rank that hosts a peer's stashes allocates them at its ACCEPT but frees them only when the peer's
    LOAD has taken them back (`schedules.peer_store.AcceptorStore`), which on a real machine depends on
    the peer's pace, so they can overlap its own stashes differently from the simulated timeline. The
    store holds at most `peer_store.hosting_bound` of its list at once, so such a rank is charged the
    larger of its simulated peak and (its own peak + that many guests), a bound that holds whatever the
    timing.
    """
    events: list[list[tuple[float, float, float]]] = [[] for _ in range(schedule.num_ranks)]
    for rank, line in enumerate(sim.timeline):
        for index, (action, start, end) in enumerate(line):
            op = action.op
            if action.chunk is None or action.microbatch is None:
                continue
            size = float(stage_bytes[schedule.stage_of(rank, action.chunk)])
            if op is Op.F:
                events[rank].append((start, index, size))
            elif op in (Op.B, Op.BW):
                events[rank].append((end, index, -size))
            elif op in (Op.OFFLOAD, Op.EVICT):
                events[rank].append((end, index, -size))
            elif op is Op.ACCEPT:  # the buffers of the peer's stash, from their allocation
                events[rank].append((start, -math.inf, float(stage_bytes[schedule.stage_of(action.peer,
                                                                                         action.chunk)])))
            elif op in (Op.RELOAD, Op.LOAD):
                events[rank].append((start, index, size))
                if op is Op.LOAD:
                    events[action.peer].append((end, math.inf, -size))
    def peak_of(rank_events) -> float:
        level = peak = 0.0
        for _, _, delta in sorted(rank_events):
            level += delta
            peak = max(peak, level)
        return peak

    peaks = []
    for rank, rank_events in enumerate(events):
        peak = peak_of(rank_events)
        hosted = [a for a in schedule.actions[rank] if a.op is Op.ACCEPT]
        if hosted:
            guest = float(stage_bytes[schedule.stage_of(hosted[0].peer, hosted[0].chunk)])
            own = peak_of([e for e in rank_events if not math.isinf(e[1])])
            peak = max(peak, own + hosting_bound(schedule.actions[rank]) * guest)
        peaks.append(peak)
    return peaks


# Launch flags --------------------------------------------------------------------------------------------


def entry_point(config: TransformerConfig) -> str:
    """pretrain_llama.py for the LLaMA family (RoPE), else pretrain_gpt.py; both accept every preset."""
    return "pretrain_llama.py" if config.position_embedding_type == "rope" else "pretrain_gpt.py"


def _model_flags(job: Job) -> list[str]:
    """`--model-preset` plus a flag for every config field the job changes from the preset."""
    flags = ["--model-preset", job.preset]
    base = get_preset(job.preset)
    for f in dataclasses.fields(TransformerConfig):
        if f.name == "params_dtype":
            continue
        value, default = getattr(job.config, f.name), getattr(base, f.name)
        if value == default:
            continue
        if f.name == "add_bias_linear" and value is False:
            flags.append("--disable-bias-linear")
        elif f.name == "untie_embeddings_and_output_weights" and value is True:
            flags.append("--untie-embeddings-and-output-weights")
        elif isinstance(value, bool) or value is None:
            raise ValueError(f"{flag(f.name)}: the launch flags cannot switch this preset's value back; use "
                             "another preset")
        else:
            flags += [flag(f.name), str(value)]
    return flags


def launch_flags(job: Job, c: Configuration) -> list[str]:
    """The training flags of configuration `c` (add data and length flags: `--data-path`/`--mock-data`,
    `--train-iters`/`--train-samples`)."""
    option_flags = {o.name: o.flag for o in schedule_options()}
    flags = _model_flags(job)
    flags += ["--tensor-model-parallel-size", str(c.tp), "--pipeline-model-parallel-size", str(c.pp)]
    if c.num_chunks > 1:
        flags += ["--num-layers-per-virtual-pipeline-stage", str(job.config.num_layers // (c.pp * c.num_chunks))]
    for plugin in job.plugins:
        flags += ["--schedule-plugin", plugin]
    files = dict(job.schedule_files)
    flags += ["--pipeline-schedule-file", files[c.schedule]] if c.schedule in files else ["--pipeline-schedule",
                                                                                          c.schedule]
    for name, value in c.options:
        if name not in option_flags:
            raise ValueError(f"schedule option {name!r} has no registered flag (registry.register_option)")
        if isinstance(value, bool):  # on/off options are --flag / --no-flag (training.arguments)
            flags.append(option_flags[name] if value else "--no-" + option_flags[name][2:])
        else:
            flags += [option_flags[name], f"{value:g}" if isinstance(value, float) else str(value)]
    if c.sequence_parallel:
        flags.append("--sequence-parallel")
    if c.distributed_optimizer:
        flags.append("--use-distributed-optimizer")
    flags += ["--micro-batch-size", str(c.micro_batch_size), "--global-batch-size", str(job.global_batch_size)]
    if c.recompute == "full":
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    elif c.recompute == "selective":
        flags += ["--recompute-granularity", "selective"]
    if job.bf16:
        flags.append("--bf16")
    return flags


def launch_command(job: Job, cluster: Cluster, c: Configuration) -> str:
    """A shell line that starts `c`: launch/local.sh on one node, launch/slurm/pretrain.sbatch beyond."""
    per_node = cluster.hardware.gpus_per_node
    script = entry_point(job.config)
    flags = " ".join(launch_flags(job, c))
    if cluster.num_gpus <= per_node:
        return f"NPROC={cluster.num_gpus} bash launch/local.sh {script} {flags}"
    nodes = -(-cluster.num_gpus // per_node)
    return f"GPUS_PER_NODE={per_node} sbatch --nodes {nodes} launch/slurm/pretrain.sbatch {script} {flags}"


def summary_row(p: Prediction) -> Mapping[str, object]:
    """The columns of the ranked table, as plain values (also the JSON rows of tools/plan.py)."""
    c = p.configuration
    return {
        "schedule": c.schedule, "v": c.num_chunks, "options": dict(c.options), "tp": c.tp, "pp": c.pp, "dp": c.dp,
        "micro_batch_size": c.micro_batch_size, "num_microbatches": p.num_microbatches, "recompute": c.recompute,
        "distributed_optimizer": c.distributed_optimizer, "weight_versions": p.weight_versions,
        "peak_memory_gib": p.peak_memory_bytes / GIB, "worst_rank": p.worst_rank,
        "stash_gib": [b / GIB for b in p.stash_bytes], "peak_stashes": list(p.peak_stashes),
        "step_s": p.step_s, "pipeline_s": p.pipeline_s, "reduce_s": p.reduce_s,
        "bubble_fraction": p.bubble_fraction, "mfu": p.mfu, "tokens_per_s": p.tokens_per_s,
        "extrapolated": p.extrapolated,
    }
