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
                          all-reduce and holds less, so it is never worse), or as asked; where the
                          training script refuses it (2BW: its deferred update keeps whole fp32 main
                          weights per stage), the same configuration with plain data parallelism instead
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

**Every ranked configuration runs**: before a configuration is ranked, or used to rule out another
(below), its launch flags go through `pretrain_gpt.py`'s own argument check (`report.refusal`, which calls
`training.arguments.validate_args`: the one function, at the cluster's world size). A configuration it
refuses is left out with the script's reason in `Plan.skipped`; a refused ZeRO-1 configuration is replaced
by its plain-data-parallel twin unless that one is in the search already. The check runs on the few
configurations that reach the ranking, not on the whole space: it builds the job's full action lists.

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
import itertools
import math
from typing import Iterator, Optional, Sequence

from megatron_pp.planning.cost import Evaluator, _Prepared
from megatron_pp.planning.job import Cluster, Configuration, Job, Plan, Prediction, ScheduleUnavailable
from megatron_pp.planning.memory import RECOMPUTE_OPTIONS
from megatron_pp.planning.report import entry_point, refusal
from megatron_pp.schedules.registry import ScheduleEntry, registered_schedules

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
        self._refusals: dict[Configuration, Optional[str]] = {}
        self._parser = None

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

    def refusal(self, c: Configuration) -> Optional[str]:
        """Why the training script would refuse `c`'s launch flags (`report.refusal`), or None; cached."""
        if c not in self._refusals:
            if self._parser is None:
                from megatron_pp.training.arguments import build_parser

                self._parser = build_parser()
            self._refusals[c] = refusal(self.job, self.cluster, c, self._parser)
        return self._refusals[c]

    def configurations(self) -> Iterator[Configuration]:
        """The search space, each configuration after those that dominate it (same everything, fewer
        offloaded chunks and no more recomputation, or the reverse: see `plan`)."""
        entries, _ = self.entries()
        recompute = sorted(self.recompute_options, key=RECOMPUTE_OPTIONS.index)
        for tp, pp, dp in self.layouts():
            per_replica = self.job.global_batch_size // dp
            sizes = [b for b in range(1, min(self.max_micro_batch_size, per_replica) + 1) if per_replica % b == 0]
            for entry in entries:
                for zero in sorted({z and dp > 1 for z in self.distributed_optimizer}):
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
        search = _Search(self, top, fold)
        for c in self.configurations():
            search.enqueue(c)
        ranked = search.run()
        description = self.efficiency(1).describe() if self.layouts() else ""
        return Plan(self.job, self.cluster, ranked, search.considered, search.over, search.skipped,
                    search.evaluated, sum(map(len, search.parked.values())), search.untimed, list(self.warnings),
                    description)


class _Search:
    """The state of one `Planner.plan`: the configurations waiting in order of their step-time bound, the
    fitting ones (which may rule out others), those parked behind one that rules them out, and what was
    left out and why.

    The training script's check (`Planner.refusal`) costs a build of the job's full action lists, so it
    runs only where its answer matters: on each configuration that would be returned (the leaders, and with
    `fold` every member of their classes), which also decides when the search may stop. A configuration that
    rules out another is not checked when it does so: the one it rules out is parked behind it, and put back
    in the queue if the script refuses it. Parked behind one that does not rank, it could not rank either.
    """

    def __init__(self, planner: Planner, top: Optional[int], fold: bool) -> None:
        self.planner, self.top, self.fold = planner, top, fold
        _, unknown = planner.entries()
        self.skipped: dict[str, int] = {f"schedule {name!r} is not registered": 1 for name in unknown}
        self.waiting: list[tuple[float, int, Configuration | _Prepared]] = []
        self.fitting: dict[Configuration, list[tuple[tuple[int, int], Configuration]]] = {}
        self.parked: dict[Configuration, list[tuple[float, int, Configuration]]] = {}
        self.ranked: list[Prediction] = []
        self.orders = itertools.count()
        self.considered = self.over = self.evaluated = self.untimed = 0

    def enqueue(self, c: Configuration) -> None:
        self.considered += 1
        memory, time_bound = self.planner.bounds(c)
        if memory > self.planner.cluster.capacity_bytes:
            self.over += 1
        else:
            heapq.heappush(self.waiting, (time_bound, next(self.orders), c))

    def refused(self, c: Configuration) -> bool:
        """Whether the training script refuses `c`. A refusal is counted once; it brings back what `c`
        ruled out and, for a ZeRO-1 configuration, its plain-data-parallel twin."""
        planner = self.planner
        new = c not in planner._refusals
        reason = planner.refusal(c)
        if reason is not None and new:
            key = f"{entry_point(planner.job.config)} refuses its flags: {reason}"
            self.skipped[key] = self.skipped.get(key, 0) + 1
            if c.distributed_optimizer and False not in planner.distributed_optimizer:
                self.enqueue(dataclasses.replace(c, distributed_optimizer=False))
            for item in self.parked.pop(c, ()):
                heapq.heappush(self.waiting, item)
        return reason is not None

    def fits(self, c: Configuration) -> None:
        group, level = _ladder(c)
        self.fitting.setdefault(group, []).append((level, c))

    def dominator(self, c: Configuration) -> Optional[Configuration]:
        """A fitting configuration, not known to be refused, that differs from `c` only by fewer offloaded
        chunks and no more recomputation."""
        group, level = _ladder(c)
        for (k, r), other in self.fitting.get(group, ()):
            if k <= level[0] and r <= level[1] and self.planner._refusals.get(other) is None:
                return other
        return None

    def leaders(self) -> list[Prediction]:
        """The `top` best-ranked accepted predictions (with `fold`, the first accepted member of each of
        the `top` best classes, every member of which is checked as it will be returned)."""
        leaders: list[Prediction] = []
        classes: set[tuple] = set()
        for p in self.ranked:
            key = equivalence_key(p)
            if self.fold and key in classes:
                self.refused(p.configuration)
            elif self.top is None or len(leaders) < self.top:
                if not self.refused(p.configuration):
                    leaders.append(p)
                    classes.add(key)
            elif not self.fold:
                break
        return leaders

    def run(self) -> list[Prediction]:
        top, planner = self.top, self.planner
        leaders: list[Prediction] = []
        stopped = False
        while not stopped:
            while self.waiting:
                bound, order, item = heapq.heappop(self.waiting)
                if top is not None and len(leaders) >= top and _rounded(bound) > _rounded(leaders[top - 1].step_s):
                    self.untimed = 1 + len(self.waiting)
                    stopped = True
                    break
                try:
                    if isinstance(item, Configuration):
                        other = self.dominator(item)
                        if other is not None:
                            self.parked.setdefault(other, []).append((bound, order, item))
                            continue
                        self.evaluated += 1
                        prepared = planner.prepare(item)
                        if prepared.memory is not None:
                            if not prepared.memory.fits:
                                self.over += 1
                                continue
                            self.fits(prepared.configuration)
                        heapq.heappush(self.waiting, (prepared.bound_s, order, prepared))
                        continue
                    prediction = planner.finish(item)
                except ScheduleUnavailable as err:
                    self.skipped[str(err)] = self.skipped.get(str(err), 0) + 1
                    continue
                if not prediction.fits:
                    self.over += 1
                    continue
                if item.memory is None:
                    self.fits(item.configuration)
                self.ranked.append(prediction)
                self.ranked.sort(key=ranking_key)
                if top is not None:  # the stopping rule needs them now
                    leaders = self.leaders()
            leaders = self.leaders()  # a refusal found here puts configurations back in the queue
            stopped = stopped or not self.waiting
        kept = {equivalence_key(p) for p in leaders}
        return [p for p in self.ranked if planner._refusals.get(p.configuration, "unchecked") is None
                and (equivalence_key(p) in kept if self.fold else any(p is q for q in leaders))]


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
