"""Should BPipe be turned on for this job? Memory per stage with and without it, what fits, how fast.

Under 1F1B with flush, stage `s` of `p` holds `min(p − s, m)` stashes (one per in-flight microbatch):
`p` on stage 0, one on the last stage. BPipe (Kim et al., ICML 2023; `schedules/bpipe.py`) pairs stage `x`
with `p − 1 − x` and keeps at most `K` stashes resident on a stage between its actions (default
`⌈(p + 2)/2⌉`): an evictor parks the excess on its partner. Counted as the executor holds them, an
evicting stage peaks at `K + 1` (the forward that exceeds the bound) and its partner at its own plus the
parked ones plus one in flight. The F/B order, and so the bubble at equal `(b, m)`, is unchanged: BPipe
can only pay off indirectly, by letting a configuration fit that 1F1B cannot hold (no recomputation, a
larger microbatch `b`).

For each microbatch size `b` dividing the per-replica batch (`m = G / (dp·b)`) and each recompute
option, `estimate`:

1. computes every stage's peak memory, `weights + grads + optimizer state + stashes + transient`, from
   `planning.memory`, and keeps what fits in the GPU after a reserve for the CUDA context,
   communication buffers and allocator fragmentation. Stashes are `min(p − s, m)` × stash bytes under
   1F1B; under BPipe they are the byte peaks of the simulated `bpipe` schedule, with each stash at its
   owner's size, so a partner's guests and the evictor's transient are counted when they coincide;
2. times one step with the schedule simulator: stage `s` runs F = `L_s·t_F(b)` (+ embedding/head) and
   B = `L_s·(t_B(b) + recompute)`, layer times from `planning.efficiency` (a measured MFU(b) curve or
   the roofline), activations between stages taking `s·b·h·2 / inter-node bandwidth`;
3. for BPipe simulates the very action lists `--pipeline-schedule bpipe` runs, EVICT/LOAD taking
   stash bytes / pair bandwidth on the pair's link: transfers that do not hide behind compute show as a
   longer makespan (a backward waiting for its load, a forward waiting for the eviction that makes room).
   The bound is a knob (`--bpipe-max-resident`): each configuration uses the loosest `K < p` that fits,
   i.e. the fewest transfers that still make it BPipe. `K = p` would be plain 1F1B, so it is not a BPipe
   candidate: with it the best BPipe could never be slower than the best 1F1B and the answer would be
   forced to "on" or a tie. A job where 1F1B fits without recomputation therefore sees BPipe's transfers
   as a cost (S < 1 when they do not hide), and one where BPipe lets a configuration drop recomputation
   sees the gain (S > 1). At p ≤ 2 BPipe moves nothing (its bound ⌈(p+2)/2⌉ ≥ p) and the candidate is 1F1B;
4. compares the fastest configuration that fits with BPipe against the fastest that fits without:
   speedup `S = T_1F1B / T_BPipe`; turn BPipe on iff `S > 1`.

Not modelled (the same for every candidate of a layout, so they dilute speedups rather than change the
verdict): the data-parallel gradient reduction, the optimizer step, the embedding's compute, and
contention of BPipe's transfers with other traffic.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from megatron_pp.models.config import TransformerConfig
from megatron_pp.models.layout import StageSpec, split_layers
from megatron_pp.planning.cost import compute_costs
from megatron_pp.planning.efficiency import (BF16_BYTES, EfficiencyModel, HardwareProfile, LayerShape, LayerTimes,
                                             MeasuredCurve, Roofline)
from megatron_pp.planning.memory import (DEFAULT_RESERVED_FRACTION, MEGATRON_BF16, RECOMPUTE_OPTIONS, Numerics,
                                         stage_state_bytes, stash_bytes, transient_activation_bytes)
from megatron_pp.schedules.bpipe import add_bpipe, default_max_resident
from megatron_pp.schedules.comm import insert_communication
from megatron_pp.schedules.generators import one_f_one_b
from megatron_pp.schedules.ir import Op, Schedule
from megatron_pp.schedules.registry import build_schedule
from megatron_pp.schedules.simulate import CostModel, SimResult, simulate

GIB = 2 ** 30


# Stash counts ---------------------------------------------------------------------------------------------


def one_f_one_b_stashes(p: int, m: int) -> list[int]:
    """Peak stashes per stage under 1F1B with flush: `min(p − s, m)` (PipeDream-Flush, arXiv 2006.09503)."""
    return [min(p - s, m) for s in range(p)]


# The job ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """A training job to plan: model, parallel layout, batch, attention kind, optimizer sharding."""

    config: TransformerConfig
    tp: int
    pp: int
    dp: int
    global_batch_size: int
    attention: str
    """'unfused' (the s×s tensors are stored) or 'flash'."""
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    numerics: Numerics = MEGATRON_BF16

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "global_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        self.config.validate(self.tp)
        if self.global_batch_size % self.dp:
            raise ValueError(f"--global-batch-size {self.global_batch_size} is not divisible by "
                             f"--data-parallel-size {self.dp}")
        if self.sequence_parallel and self.config.seq_length % self.tp:
            raise ValueError(f"--seq-length {self.config.seq_length} is not divisible by "
                             f"--tensor-model-parallel-size {self.tp} (required by --sequence-parallel)")
        self.stages  # split_layers raises a one-line LayoutError if the layers do not split

    @property
    def stages(self) -> list[StageSpec]:
        return split_layers(self.config.num_layers, self.pp)

    @property
    def shape(self) -> LayerShape:
        return LayerShape.from_config(self.config, self.tp, self.sequence_parallel)

    def micro_batch_sizes(self, largest: int) -> list[int]:
        """Every b ≤ `largest` that divides the per-replica batch G / dp."""
        per_replica = self.global_batch_size // self.dp
        return [b for b in range(1, min(largest, per_replica) + 1) if per_replica % b == 0]


def efficiency_model(job: Job, hardware: HardwareProfile, efficiency_file: Optional[str] = None) -> EfficiencyModel:
    """A measured curve from `efficiency_file` (tools/bench_layer.py output) or else the roofline."""
    if efficiency_file:
        return MeasuredCurve.from_file(efficiency_file, job.shape, job.attention, hardware)
    return Roofline(job.shape, hardware, job.attention)


# Candidates ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """One (b, recompute, BPipe on/off) configuration of the job, its memory and predicted step time."""

    micro_batch_size: int
    num_microbatches: int
    recompute: str
    bpipe: bool
    resident_bound: int
    """BPipe's K for this configuration: the loosest bound that fits (p when BPipe is off)."""
    stage_peak_bytes: tuple[float, ...]
    fits: bool
    step_s: float
    """Predicted time of one optimizer step's pipeline (transfers included)."""
    transfer_overhead_s: float
    """Part of step_s spent waiting for BPipe evict/load transfers (0 when hidden or BPipe is off)."""
    bubble_fraction: float
    """Mean idle share of the ranks in the simulated step (fill, drain, stage imbalance)."""
    mfu: float
    """Model FLOPs (layers and output layer, Megatron's convention) per GPU / (step_s × peak)."""
    per_microbatch_s: float
    """F + B (+ recompute) of the slowest stage for one microbatch."""

    @property
    def peak_bytes(self) -> float:
        return max(self.stage_peak_bytes)

    @property
    def worst_stage(self) -> int:
        return self.stage_peak_bytes.index(self.peak_bytes)

    def label(self) -> str:
        bound = f" K={self.resident_bound}" if self.bpipe else ""
        return f"b={self.micro_batch_size} m={self.num_microbatches} recompute={self.recompute}{bound}"


@dataclass
class Estimate:
    """What `estimate` found: all candidates, the best with and without BPipe, and the speedup."""

    job: Job
    hardware: HardwareProfile
    efficiency: str
    capacity_bytes: float
    candidates: list[Candidate]
    best_plain: Optional[Candidate]
    best_bpipe: Optional[Candidate]
    warnings: list[str] = field(default_factory=list)

    @property
    def speedup(self) -> Optional[float]:
        """T(best 1F1B) / T(best BPipe): inf when only BPipe fits, None when BPipe fits nothing."""
        if self.best_bpipe is None:
            return None
        if self.best_plain is None:
            return math.inf
        return self.best_plain.step_s / self.best_bpipe.step_s

    @property
    def turn_on(self) -> bool:
        return self.speedup is not None and self.speedup > 1.0


@functools.lru_cache(maxsize=256)
def _schedule(p: int, m: int) -> Schedule:
    return build_schedule("1f1b", p, m)


@functools.lru_cache(maxsize=256)
def _bpipe_schedule(p: int, m: int, bound: int) -> Schedule:
    """The lists `--pipeline-schedule bpipe --bpipe-max-resident bound` runs (validated in the schedule
    tests; not again here, the estimator builds many)."""
    return insert_communication(add_bpipe(one_f_one_b(p, m), bound))


def _stage_times(job: Job, layer: LayerTimes, b: int, recompute: str,
                 hardware: HardwareProfile) -> list[tuple[float, float]]:
    """(F, B) seconds of each stage for one microbatch (the planner's `cost.compute_costs`); B includes what
    recomputation re-runs."""
    costs = compute_costs(job.config, job.stages, layer, hardware, micro_batch=b, tp=job.tp,
                          sequence_parallel=job.sequence_parallel, recompute=recompute)
    return [(costs[(Op.F, spec.stage)], costs[(Op.B, spec.stage)]) for spec in job.stages]


def _boundary_seconds(job: Job, b: int, link_gbps: float) -> float:
    """Time for one stage's output activation (its sequence shard under SP) to reach the next stage."""
    rows = job.config.seq_length * b // (job.tp if job.sequence_parallel else 1)
    return rows * job.config.hidden_size * BF16_BYTES / (link_gbps * 1e9)


def estimate(
    job: Job,
    hardware: HardwareProfile,
    efficiency: EfficiencyModel,
    *,
    gpu_memory_gib: Optional[float] = None,
    reserved_fraction: float = DEFAULT_RESERVED_FRACTION,
    recompute_options: Sequence[str] = RECOMPUTE_OPTIONS,
    max_micro_batch_size: int = 16,
    pairs_on_node: bool = False,
) -> Estimate:
    """Evaluate every (b, recompute) with and without BPipe; see the module docstring for the method.

    `gpu_memory_gib` overrides the hardware's memory. A pipeline of `tp·pp ≤ gpus_per_node` GPUs sends
    activations and BPipe transfers over the intra-node link, a larger one over the network unless
    `pairs_on_node` says a folded placement puts stages x and p − 1 − x on one node.
    """
    for option in recompute_options:
        if option not in RECOMPUTE_OPTIONS:
            raise ValueError(f"recompute option {option!r} is not one of {', '.join(RECOMPUTE_OPTIONS)}")
    if not 0 <= reserved_fraction < 1:
        raise ValueError(f"reserved memory fraction must be in [0, 1), got {reserved_fraction}")
    memory_gib = hardware.memory_gib if gpu_memory_gib is None else gpu_memory_gib
    if memory_gib <= 0:
        raise ValueError(f"--gpu-memory-gb must be > 0, got {memory_gib}")
    capacity = memory_gib * GIB * (1 - reserved_fraction)
    p, stages = job.pp, job.stages
    state = [stage_state_bytes(job.config, spec, tp=job.tp, dp=job.dp,
                               distributed_optimizer=job.distributed_optimizer) for spec in stages]
    # A pipeline that fits in one node talks over the intra-node link; otherwise neighbouring stages and
    # BPipe's pairs are taken to sit on different nodes, unless `pairs_on_node` folds the pairs together.
    one_node = job.tp * job.pp <= hardware.gpus_per_node
    boundary_gbps = hardware.tp_link_gbps if one_node else hardware.pair_link_gbps
    pair_gbps = hardware.tp_link_gbps if one_node or pairs_on_node else hardware.pair_link_gbps
    common = dict(tp=job.tp, sequence_parallel=job.sequence_parallel, attention=job.attention, numerics=job.numerics)

    candidates: list[Candidate] = []
    for b in job.micro_batch_sizes(max_micro_batch_size):
        m = job.global_batch_size // (job.dp * b)
        layer = efficiency.layer_times(b)
        for recompute in recompute_options:
            stash = [stash_bytes(job.config, spec, b, recompute=recompute, **common) for spec in stages]
            transient = transient_activation_bytes(job.config, b, recompute=recompute, **common)
            times = _stage_times(job, layer, b, recompute, hardware)
            costs = {}
            for s, (forward, backward) in enumerate(times):
                costs[(Op.F, s)], costs[(Op.B, s)] = forward, backward
            latency = _boundary_seconds(job, b, boundary_gbps)
            sim = simulate(_schedule(p, m), CostModel(measured=costs, p2p_latency=latency))
            # Model FLOPs per pipeline (per tensor-parallel rank): layers plus the output layer, 3 x forward.
            logits = 3 * 2 * job.config.seq_length * b * job.config.hidden_size * job.config.padded_vocab_size(job.tp)
            flops = m * (sum(spec.num_layers for spec in stages) * layer.model_flops + logits / job.tp)
            slowest = max(f + bw for f, bw in times)

            plain = tuple(state[s] + n * stash[s] + transient for s, n in enumerate(one_f_one_b_stashes(p, m)))
            bpipe_costs = CostModel(measured=costs, p2p_latency=latency, stash_bytes=stash,
                                    peer_bandwidth=pair_gbps * 1e9)
            bound, peaks, timed = _loosest_bound(p, m, plain, sim, capacity, state, stash, transient, bpipe_costs)
            for bpipe, stage_peaks, result in ((False, plain, sim), (True, peaks, timed)):
                step = result.makespan
                candidates.append(Candidate(
                    micro_batch_size=b, num_microbatches=m, recompute=recompute, bpipe=bpipe,
                    resident_bound=bound if bpipe else p, stage_peak_bytes=stage_peaks,
                    fits=max(stage_peaks) <= capacity, step_s=step,
                    transfer_overhead_s=max(0.0, step - sim.makespan),
                    bubble_fraction=result.bubble_fraction, mfu=flops / (p * step * hardware.peak_tflops * 1e12),
                    per_microbatch_s=slowest,
                ))

    def best(bpipe: bool) -> Optional[Candidate]:
        fitting = [c for c in candidates if c.bpipe == bpipe and c.fits]
        return min(fitting, key=lambda c: c.step_s) if fitting else None

    return Estimate(job=job, hardware=hardware, efficiency=efficiency.describe(), capacity_bytes=capacity,
                    candidates=candidates, best_plain=best(False), best_bpipe=best(True),
                    warnings=list(getattr(efficiency, "warnings", [])))


def _loosest_bound(p: int, m: int, plain: tuple[float, ...], plain_sim: SimResult, capacity: float,
                   state: Sequence[float], stash: Sequence[float], transient: float,
                   costs: CostModel) -> tuple[int, tuple[float, ...], SimResult]:
    """BPipe's bound for one configuration: (K, peak bytes per stage, simulated step) for the loosest
    K < p whose simulated peaks fit, and the default bound when none fits (module docstring: K = p is
    1F1B, not a BPipe candidate, except at p ≤ 2 where BPipe moves nothing). Bounds that provably cannot
    fit are not simulated: an evicting stage peaks at exactly K + 1 of its own stashes and its partner
    holds at least the parked `min(p − x, m) − K` at once."""
    counts = one_f_one_b_stashes(p, m)

    def floor(bound: int) -> float:
        lowest = 0.0
        for x in range(p):
            y = p - 1 - x
            if x < y and counts[x] > bound:
                lowest = max(lowest, state[x] + (bound + 1) * stash[x] + transient,
                             state[y] + (counts[x] - bound) * stash[x] + transient)
            else:
                lowest = max(lowest, state[x] + counts[x] * stash[x] + transient)
        return lowest

    def simulated(bound: int) -> tuple[int, tuple[float, ...], SimResult]:
        result = simulate(_bpipe_schedule(p, m, bound), costs)
        return bound, tuple(state[s] + result.peak_bytes[s] + transient for s in range(p)), result

    for bound in range(p - 1, 0, -1):
        if floor(bound) <= capacity:
            found = simulated(bound)
            if max(found[1]) <= capacity:
                return found
    default = default_max_resident(p)
    return simulated(default) if default < p else (p, plain, plain_sim)


def layouts(config: TransformerConfig, gpus: int) -> list[tuple[int, int, int]]:
    """Every (tp, pp, dp) with tp·pp·dp = gpus, tp ≤ 8 (one node) and valid for the model's heads,
    groups and MLP width, pp ≥ 2 dividing the layers: the layouts `tools/estimate_bpipe.py --all-layouts`
    compares."""
    out = []
    for tp in (1, 2, 4, 8):
        if gpus % tp:
            continue
        try:
            config.validate(tp)
        except ValueError:
            continue
        for pp in range(2, gpus // tp + 1):
            if (gpus // tp) % pp == 0 and config.num_layers % pp == 0:
                out.append((tp, pp, gpus // (tp * pp)))
    return out
