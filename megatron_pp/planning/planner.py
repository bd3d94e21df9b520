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
                          all-reduce and holds less, so it is never worse), or as asked; never for a
                          schedule whose lists carry weight versions (2BW's deferred update keeps whole
                          fp32 main weights per stage, and `validate_args` refuses the pair)
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

The cost of each configuration (memory per rank, step time) is `planning.cost`; its launch flags and
the table row are `planning.report`.

**Search** (`Planner.plan`): best-first on lower bounds, so a large space costs little more than its best
rows. Each configuration gets schedule-free lower bounds of memory and step time (`Planner.bounds`);
those over memory are dropped. The rest are taken in order of their time bound: a configuration is
built (`prepare`: compute lists only, which settles memory when nothing moves stashes, and a tighter
bound), then simulated (`finish`), and the search stops when the lowest bound left cannot rank among
the `top`. A configuration is also skipped when one that differs only by fewer offloaded chunks and no
more recomputation, or the reverse, already fits: recomputation only adds compute and offload only adds
waits for copies (the compute order stays), so it cannot be faster.

Worked example (`Planner.evaluate`, GPT-3 13B on 64 A100-80GB, global batch 128, roofline layer times at
the profile's matmul efficiency 0.705): at tp 2 × pp 4 × dp 8 with ZeRO-1, b = 1, m = 16, no
recomputation, 1F1B's rank 0 holds 10 layers and the embedding (1.71 G parameters per GPU) at 6 + 12/8 =
7.5 bytes each = 11.96 GiB and peaks at 4 stashes of 1.56 GiB = 6.26 GiB: 18.2 GiB. The step is 1.98 s of
pipeline (20% bubble) plus 0.38 s of data-parallel reduction over the network and Adam: 2.36 s.
PipeDream-2BW runs without ZeRO-1 (whole fp32 main weights per stage) and holds a second bf16 copy of the
weights and the pending fp32 gradient: 24 bytes per parameter, 38.3 GiB of state on rank 0; it drops the
fill and drain (1.69 s of pipeline, 6% bubble) but reduces with an all-reduce (0.53 s): 2.22 s per step.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Iterator, Optional, Sequence

from megatron_pp.planning.cost import Evaluator, _Prepared
from megatron_pp.planning.job import Cluster, Configuration, Job, Plan, Prediction, ScheduleUnavailable
from megatron_pp.planning.memory import RECOMPUTE_OPTIONS
from megatron_pp.schedules.registry import (ScheduleEntry, build_at_nominal_size, registered_schedules)
from megatron_pp.schedules.runtime import runtime_needs

DEFAULT_MAX_MICRO_BATCH = 8


class Planner(Evaluator):
    """Enumerate, evaluate (`Evaluator`) and rank the configurations of `job` on `cluster`.

    `schedules` limits the search to those names (default: all registered); unknown names are reported in
    `Plan.skipped`, not raised. `efficiency_file`: see `Evaluator`.
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
        super().__init__(job, cluster, efficiency_file=efficiency_file)
        self.schedule_names = None if schedules is None else list(schedules)
        self.recompute_options = tuple(recompute_options)
        self.max_micro_batch_size = max_micro_batch_size
        self.max_virtual_stages = max_virtual_stages
        self.distributed_optimizer = tuple(distributed_optimizer)

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
        if entry.chunks_per_rank is not None:  # the V shapes: their count or nothing
            chunks = [entry.chunks_per_rank] if per_rank % entry.chunks_per_rank == 0 else []
        elif entry.supports_virtual:
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
            for entry in entries:
                zeros = {z and dp > 1 for z in self.distributed_optimizer}
                if self.carries_weight_versions(entry, pp):
                    # A deferred update (2BW) keeps whole fp32 main weights per stage: validate_args refuses
                    # --use-distributed-optimizer with it, so it is planned with plain data parallelism.
                    zeros = {False}
                for zero in sorted(zeros):
                    for v, options in self.variants(entry, pp):
                        for b in sizes:
                            for r in recompute:
                                yield Configuration(tp, pp, dp, b, r, entry.name, v, options, zero)

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
