"""The cost of one configuration: its memory per pipeline rank and its step time, from the schedule's own
action lists replayed by the simulator, the layer times of `planning.efficiency` and the closed forms of
`planning.memory`. `Evaluator` does this for any `planning.job.Configuration`; the search over
configurations (`planning.planner.Planner`) is built on it.

Nothing is special-cased by schedule name: memory and time come from the schedule's own lists. The
options the evaluator fills in when a configuration does not give them (`with_planned_options`) and the
unrolled `steps` of a flush-free schedule follow the option rules of `planning.planner`'s docstring.

**Time.** Global stage `s` (one chunk) runs `F_s = L_s·t_F(b)` and `B_s = L_s·(t_B(b) + recompute)`, plus
the output layer and cross-entropy on the last stage (`efficiency.head_times`); `compute_costs` is the one
place these are computed, for the planner, the BPipe estimator and the paper reproductions alike. Layer
times and what recomputation re-runs come from a `tools/bench_layer.py` measurement (`efficiency.MeasuredCurve`) or the
roofline (`efficiency.Roofline`), tensor-parallel collectives included. Where a list splits a backward,
BW_s is the stage's weight-gradient GEMMs (`LayerTimes.weight_grad_s` per layer, plus an untied output
layer's, `efficiency.head_weight_grad_s`) and BI_s = B_s − BW_s keeps the rest (recomputation and the
collectives included); which op a list runs decides which cost applies, never the schedule's name. The
embedding lookup is not timed (a gather, well under 1% of a stage). A stage boundary sends `s·b·h` activations (`s·b·h/tp` under sequence parallelism) over
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
    extra weight versions             (versions − 1) × parameters × (parameter bytes + 4), versions being the
                                      most `@v` weight versions alive at once in a rank's list
                                      (`live_weight_versions`): 2 for PipeDream-2BW, 1 for flushed schedules.
                                      Each extra version is a copy of the weights plus the fp32 gradient its
                                      deferred update holds (`training.weight_versions`: the pending buffer):
                                      24 bytes per parameter for 2BW in bf16 or fp32, against 18 and 16
    resident stashes                  the simulator's resident-stash curve, each (microbatch, chunk) weighted
                                      by its stage's `memory.stash_bytes`, at its peak: host-parked stashes
                                      do not count, a stash parked on a peer counts on the peer
                                      (`resident_peaks`; `list_order_peaks` when nothing moves)
    deferred weight gradients         a (microbatch, chunk) whose BW does not follow its BI in the rank's list
                                      (`schedules.execute.deferred_backwards`, the executor's own rule)
                                      changes by `memory.deferred_weight_grad_bytes` from its BI to its BW:
                                      BI frees what BW does not read and adds the output gradients of its
                                      linear layers, as the executor's store counts them
    recomputation transient           one layer rebuilt during the backward (`transient_activation_bytes`)
    backward working set              per rank, its largest chunk's `memory.backward_transient_bytes` (ours): the
                                      residual gradient plus the largest linear layer's backward while it
                                      adds its weight gradient into the fp32 main gradient, less what autograd
                                      has freed of that microbatch's stash by then; under layered accumulation
                                      with several groups, plus each chunk's intermediate reduction (a copy of
                                      its fp32 buckets, and the 1/dp reduce-scatter output with ZeRO-1) held
                                      from one group's REDUCE_GRAD to the next's
    optimizer step                    a rank's peak is max(all of the above, state + what the step allocates:
                                      `memory.optimizer_step_transient_bytes`, foreach AdamW's sqrt(v) of the
                                      larger parameter group or the distributed optimizer's gathered buckets);
                                      a schedule whose lists step while stashes are held (2BW) adds the two

A configuration fits when its worst rank is within the GPU memory minus a reserve (10%, as the BPipe
estimator assumes, for the CUDA context, NCCL buffers and fragmentation).

**Large m.** Above `m = 3p + r` (r = m mod p) the planner simulates `m1 = 2p + r` and `m2 = 3p + r` and
extends every per-rank quantity (end time, busy time, peak stash bytes) linearly to m: after the warm-up a
schedule repeats every p microbatches, so each further p microbatches add the same time, and peak
stashes are either flat (1F1B-like) or grow by the same amount (GPipe-like); a peak is never taken below
m2's. tests/planning/test_planner.py checks this against exact simulations for every registered
schedule; `evaluate(..., exact=True)` skips it.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from typing import Optional, Sequence

from megatron_pp.models.config import TransformerConfig
from megatron_pp.models.layout import StageSpec, split_layers
from megatron_pp.planning.efficiency import (EfficiencyModel, HardwareProfile, LayerShape, LayerTimes, MeasuredCurve,
                                             Roofline, head_times, head_weight_grad_s)
from megatron_pp.planning.job import Cluster, Configuration, Job, Prediction, ScheduleUnavailable
from megatron_pp.planning.memory import (backward_transient_bytes, deferred_weight_grad_bytes,
                                         optimizer_step_transient_bytes, overlapped_gather_companions_bytes,
                                         stage_parameters_per_gpu, stage_vector_parameters_per_gpu,
                                         state_bytes_per_parameter, stash_bytes, transient_activation_bytes)
from megatron_pp.schedules.comm import insert_communication
from megatron_pp.schedules.ir import TRANSFER_OPS, Op, Schedule
from megatron_pp.schedules.offload import OffloadWarning
from megatron_pp.schedules.registry import build_schedule, get_schedule
from megatron_pp.schedules.simulate import CostModel, SimResult, simulate
from megatron_pp.planning.stash_curve import list_order_peaks, live_weight_versions, resident_peaks  # noqa: F401 (re-exported)
from megatron_pp.schedules.validate import validate
from megatron_pp.training.flops import iteration_flops

GRAD_BYTES = 4
"""Gradients accumulate and are reduced in fp32 whatever the parameter dtype (`core.grads.GRAD_DTYPE`)."""
ADAM_BYTES_PER_PARAMETER = {True: 34, False: 32}
"""Device-memory bytes Adam moves per parameter it updates, by bf16 (True) or fp32 (False) parameters:
the gradient-norm pass reads the fp32 gradient (4); the update reads gradient, main weight and both
moments (16) and writes main weight and moments (12); bf16 training then writes the bf16 copy (2)."""
TRANSFER_GRID_BASE = 2.0
"""`--offload-time` (a schedule option: where the offload pass places copies) is rounded up to a power of
this base, so that candidates with nearly equal ratios share one built schedule; rounding up places
reloads a little earlier, never later. The simulated copies themselves take their exact modelled time."""


def compute_costs(config: TransformerConfig, specs: Sequence[StageSpec], layer: LayerTimes, hardware: HardwareProfile,
                  *, micro_batch: int, tp: int, sequence_parallel: bool,
                  recompute: str = "none") -> dict[tuple[Op, int], float]:
    """Seconds of F, B, and of a split backward's BI and BW, of every global stage in `specs` for one
    microbatch (the module docstring's **Time**): `layer` times per transformer layer, the head on the last
    stage, BW = the weight-gradient GEMMs (an untied output layer's included) and BI = B − BW."""
    head_f, head_b = head_times(config, micro_batch, tp, sequence_parallel, hardware)
    head_w = (head_weight_grad_s(config, micro_batch, tp, hardware)
              if config.untie_embeddings_and_output_weights else 0.0)
    backward = layer.compute_s(recompute) - layer.forward_s
    out: dict[tuple[Op, int], float] = {}
    for spec in specs:
        s, head = spec.stage, spec.has_head
        f = spec.num_layers * layer.forward_s + (head_f if head else 0.0)
        b = spec.num_layers * backward + (head_b if head else 0.0)
        w = min(spec.num_layers * layer.weight_grad_s + (head_w if head else 0.0), b)
        out.update({(Op.F, s): f, (Op.B, s): b, (Op.BI, s): b - w, (Op.BW, s): w})
    return out


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
    held: list[int]
    """Per global stage, how a stash changes from a deferred BW's BI until it runs (`memory.deferred_weight_grad_bytes`)."""
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
    optimizer: tuple[float, ...] = ()
    """Per rank, the optimizer step's transient above the state (`memory.optimizer_step_transient_bytes`)."""
    backward: tuple[float, ...] = ()
    """Per rank, the backward's working set beside state and stashes (`memory.backward_transient_bytes`)."""
    early_gathers: tuple[float, ...] = ()
    """Per rank, --overlap-param-gather's later chunks: stashes beside gathers still in flight
    (`Evaluator.rank_early_gather_bytes`)."""

    @property
    def sizes(self) -> list[int]:
        return [group[0].num_microbatches // group[0].options.get("steps", 1) for group in self.groups]


class Evaluator:
    """Memory and step time of configurations of `job` on `cluster` (module docstring).

    `efficiency_file` is a `tools/bench_layer.py` report (layer times per microbatch size, scaled by FLOPs
    to each tp shard), else the roofline of `cluster.hardware` at its achieved matmul efficiency. Built
    schedules and per-stage figures are cached, so evaluating many configurations of one job is cheap.
    """

    def __init__(self, job: Job, cluster: Cluster, *, efficiency_file: Optional[str] = None) -> None:
        self.job, self.cluster = job, cluster
        self.efficiency_file = efficiency_file
        self.warnings: list[str] = []
        self._efficiency: dict[int, EfficiencyModel] = {}
        self._schedules: dict[tuple, Schedule | ScheduleUnavailable] = {}
        self._per_stage: dict[tuple, object] = {}

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

    def _activation_bytes_per_stage(self, c: Configuration, kind: str, formula) -> list[int]:
        """`formula(config, spec, b, ...)` (a `planning.memory` byte count) for every global stage, cached:
        a search asks for the same few stage kinds (layer count, embedding, head) thousands of times."""
        out = []
        for spec in self.stages(c):
            key = (kind, c.tp, c.micro_batch_size, c.recompute, spec.num_layers, spec.has_embedding, spec.has_head)
            if key not in self._per_stage:
                job = self.job
                self._per_stage[key] = formula(job.config, spec, c.micro_batch_size, tp=c.tp,
                                               sequence_parallel=c.sequence_parallel, recompute=c.recompute,
                                               numerics=job.numerics)
            out.append(self._per_stage[key])
        return out

    def stage_stash_bytes(self, c: Configuration) -> list[int]:
        """Bytes of one (microbatch, stage) stash for every global stage."""
        return self._activation_bytes_per_stage(
            c, "stash", lambda *args, **kw: stash_bytes(*args, attention=self.job.attention, **kw))

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

    def rank_optimizer_step_bytes(self, c: Configuration, schedule: Schedule, params: Sequence[int]) -> tuple[float, ...]:
        """Per pipeline rank, what its optimizer step allocates above the state, for the `params` it holds."""
        job, specs = self.job, self.stages(c)
        out = []
        for rank, n in enumerate(params):
            vectors = sum(stage_vector_parameters_per_gpu(job.config, specs[schedule.stage_of(rank, chunk)], c.tp)
                          for chunk in range(c.num_chunks))
            held = overlapped_gather_companions_bytes(
                job.config, c.micro_batch_size, tp=c.tp, sequence_parallel=c.sequence_parallel,
                receives_input=not specs[schedule.stage_of(rank, 0)].has_embedding,
                param_bytes=job.param_bytes) if c.overlap_param_gather and c.dp > 1 else 0
            out.append(optimizer_step_transient_bytes(
                n, vectors, dp=c.dp, distributed_optimizer=c.distributed_optimizer, param_bytes=job.param_bytes,
                implementation=job.optimizer, held_into_next_step=held))
        return tuple(out)

    def rank_early_gather_bytes(self, c: Configuration, schedule: Schedule, stash: Sequence[int]) -> tuple[float, ...]:
        """Per pipeline rank, with --overlap-param-gather on a rank of several chunks: a later chunk's gathered
        parameters (each bucket's shard and gathered copy, `memory.optimizer_step_transient_bytes`) are held
        until its first forward, beside the stashes the rank's list made before it (list order, as
        `list_order_peaks`) and that forward's received input: the largest such sum (ours; 0 elsewhere)."""
        if not (c.overlap_param_gather and c.distributed_optimizer and c.dp > 1 and c.num_chunks > 1):
            return (0.0,) * c.pp
        job, specs, params = self.job, self.stages(c), self.stage_parameters(c)
        per_param = job.param_bytes * (1 + 1 / c.dp)
        out = []
        for rank, acts in enumerate(schedule.actions):
            pending = {k: params[schedule.stage_of(rank, k)] * per_param for k in range(c.num_chunks)}
            level = worst = 0.0
            for a in acts:
                stage = schedule.stage_of(rank, a.chunk)
                if a.op is Op.F:
                    if a.chunk in pending:
                        pending.pop(a.chunk)
                        if a.chunk > 0:  # earlier chunks' gathers ended at their own first forwards
                            held = overlapped_gather_companions_bytes(
                                job.config, c.micro_batch_size, tp=c.tp, sequence_parallel=c.sequence_parallel,
                                receives_input=not specs[stage].has_embedding, param_bytes=job.param_bytes)
                            worst = max(worst, level + params[stage] * per_param + sum(pending.values()) + held)
                    level += stash[stage]
                elif a.op is Op.B or a.op is Op.BW:
                    level -= stash[stage]
            out.append(worst)
        return tuple(out)

    def rank_backward_bytes(self, c: Configuration, schedule: Schedule) -> tuple[float, ...]:
        """Per pipeline rank, what its backward holds beside state and stashes: the working set of its largest
        chunk (`memory.backward_transient_bytes`), plus the intermediate layered reductions it carries."""
        job, specs = self.job, self.stages(c)
        rebuilt = int(self._transient(c))  # a recomputing backward's rebuilt layer, which `_memory` adds apart

        def per_stage(stage: int, freed: bool) -> float:
            spec = specs[stage]
            key = ("backward", job.fold, c.tp, c.micro_batch_size, c.recompute, freed, spec.num_layers,
                   spec.has_embedding, spec.has_head)
            if key not in self._per_stage:
                self._per_stage[key] = backward_transient_bytes(
                    job.config, spec, c.micro_batch_size, tp=c.tp, sequence_parallel=c.sequence_parallel,
                    numerics=job.numerics, weight_grad_fold=job.fold, rebuilt=rebuilt, freed=freed)
            return self._per_stage[key]
        params = self.stage_parameters(c)
        # Layered accumulation with several groups: an intermediate reduction copies a chunk's fp32 buckets
        # and the copy (with the distributed optimizer also the reduce-scatter's 1/dp output) is held until
        # the next group's REDUCE_GRAD of that chunk folds it in (core.layered_grads; NCCL's works keep their
        # inputs until waited on), across that group's backwards.
        carried_per_param = GRAD_BYTES * (1 + 1 / c.dp if c.distributed_optimizer and c.dp > 1 else 1)
        out = []
        for rank in range(c.pp):
            reductions = [0] * c.num_chunks
            offloaded = set()  # a reloaded stash is held by the offload store until its backward ends
            for a in schedule.actions[rank]:
                if a.op is Op.REDUCE_GRAD:
                    reductions[a.chunk] += 1
                elif a.op is Op.OFFLOAD:
                    offloaded.add(a.chunk)
            carried = sum(params[schedule.stage_of(rank, k)] * carried_per_param
                          for k in range(c.num_chunks) if reductions[k] > 1)
            working = max(per_stage(schedule.stage_of(rank, k), k not in offloaded) for k in range(c.num_chunks))
            out.append(float(working + carried))
        return tuple(out)

    def stage_compute_costs(self, c: Configuration) -> dict[tuple[Op, int], float]:
        """`compute_costs` of every global stage of `c` (F, B with what recompute re-runs, BI, BW)."""
        return compute_costs(self.job.config, self.stages(c), self.efficiency(c.tp).layer_times(c.micro_batch_size),
                             self.cluster.hardware, micro_batch=c.micro_batch_size, tp=c.tp,
                             sequence_parallel=c.sequence_parallel, recompute=c.recompute)

    def stage_times(self, c: Configuration) -> list[tuple[float, float]]:
        """(F, B) seconds of every global stage for one microbatch (B includes what recompute re-runs)."""
        costs = self.stage_compute_costs(c)
        return [(costs[(Op.F, s)], costs[(Op.B, s)]) for s in range(c.pp * c.num_chunks)]

    def stage_held_bytes(self, c: Configuration) -> list[int]:
        """How a (microbatch, stage) stash changes from a deferred BW's BI until that BW (either sign)."""
        return self._activation_bytes_per_stage(
            c, "held", lambda *args, **kw: deferred_weight_grad_bytes(*args, attention=self.job.attention, **kw))

    def costs(self, c: Configuration, stash: Sequence[float]) -> CostModel:
        """The simulator's cost model of `c` (see the module docstring)."""
        job, cluster = self.job, self.cluster
        # Some pipeline hop crosses nodes as soon as the job does (Megatron's rank order: tp, dp, then pp).
        pipeline_link = cluster.link_bytes_per_s(cluster.num_gpus)
        measured = self.stage_compute_costs(c)
        for s in range(len(stash)):
            host, peer = stash[s] / cluster.host_bytes_per_s, stash[s] / pipeline_link
            measured.update({(Op.OFFLOAD, s): host, (Op.RELOAD, s): host, (Op.EVICT, s): peer, (Op.LOAD, s): peer})
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
        # Each extra weight version comes with a deferred update, which holds its batch's reduced fp32
        # gradient (the pending buffer) while the next batch accumulates into the reducer's own.
        state = tuple(n * (per_param + (versions - 1) * (job.param_bytes + GRAD_BYTES)) for n in params)
        costs = self.costs(c, stash)
        after = self.after_pipeline_s(c, params, self._tied_ranks(c, reference))
        # Each (microbatch, chunk) gets one forward and one backward (B, or BI + BW) per step, so a rank
        # computes at least m × Σ(F + B) over its chunks before its reduction and optimizer step.
        work = [m * sum(costs.duration(op, reference.stage_of(rank, chunk))
                        for op in (Op.F, Op.B) for chunk in range(c.num_chunks)) for rank in range(c.pp)]
        transfers = any(a.op in TRANSFER_OPS for group in groups for s in group for acts in s.actions for a in acts)
        prepared = _Prepared(c, m, stash, self.stage_held_bytes(c), self._transient(c), versions, groups, params, state, costs, transfers,
                             after, max(w + a for w, a in zip(work, after)),
                             optimizer=self.rank_optimizer_step_bytes(c, reference, params),
                             backward=self.rank_backward_bytes(c, reference),
                             early_gathers=self.rank_early_gather_bytes(c, reference, stash))
        if not transfers:
            # Without stash transfers the resident stashes follow list order alone, whatever the timing,
            # so the memory is known now and a configuration that cannot fit is never simulated.
            prepared.memory = self._memory(prepared, [
                _Replay(size, list_order_peaks(group[-1], stash, prepared.held),
                        list_order_peaks(group[-1], [1] * len(stash)))
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
                stash = resident_peaks(group[-1], sims[-1], prepared.stash, prepared.held)
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
        state, optimizer = prepared.state, prepared.optimizer
        backward = prepared.backward or (0.0,) * c.pp
        pipeline = [state[r] + resident[r] + prepared.transient + backward[r] for r in range(c.pp)]
        if prepared.versions > 1:  # the lists step while stashes are held: charge both (a bound)
            memory = tuple(pipeline[r] + optimizer[r] for r in range(c.pp))
        else:  # a flushed step: the optimizer runs after the last backward, when no stash is left
            early = prepared.early_gathers or (0.0,) * c.pp
            memory = tuple(max(pipeline[r], state[r] + optimizer[r], state[r] + early[r]) for r in range(c.pp))
        return Prediction(c, m, prepared.versions, state, tuple(resident), tuple(counts),
                          prepared.transient, memory, self.cluster.capacity_bytes,
                          extrapolated=all(r.m != m for r in replays), optimizer_step_bytes=optimizer,
                          backward_bytes=tuple(backward))

    @staticmethod
    def _simulate(schedule: Schedule, costs: CostModel) -> SimResult:
        try:
            return simulate(schedule, costs)
        except Exception as err:  # noqa: BLE001 - e.g. a plugin's op the simulator does not know
            raise ScheduleUnavailable(f"{schedule.name}: simulation failed: {type(err).__name__}: {err}") from None


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
