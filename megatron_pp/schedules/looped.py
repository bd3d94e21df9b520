"""The modular (looping, breadth-first) pipeline and layered gradient accumulation
(arXiv 2106.02679, arXiv 2211.05953; docs/layered.md).

**Placement.** S = p·v global stages of `--num-layers-per-virtual-pipeline-stage` layers each (1 is the
paper's layer-wise layout); stage k lives on (rank k mod p, local chunk k // p), Megatron's interleaved
placement, so a microbatch loops round the ring of ranks v times.

**Order.** The m microbatches are cut into m/B sequential *depth-first groups* of B consecutive
microbatches (`breadth_first_microbatches`, default B = m). Within a group every rank runs, chunk by
chunk in increasing order, the forwards of all B microbatches, then, chunk by chunk in decreasing
order, their backwards; the next group starts when the rank has finished the previous one. A rank
therefore holds at most v·B stashes (memory bounded by B, not m) and the step costs
(m/B)·(v·B + p − 1) chunk-slots of F + B on every rank: the bubble is the fill and drain of each group,
(p − 1)/(v·B + p − 1), i.e. (p − 1)/(v·m + p − 1) for one group against 1F1B's (p − 1)/(m + p − 1).

**Why B ≥ p.** Microbatch 0 leaves rank r after its chunk-c forward and comes back for chunk c + 1
after p − 1 hops; the rank is busy with the other B − 1 forwards of chunk c meanwhile, so it never
waits only when B ≥ p. Smaller groups do not deadlock, they stall every loop; they are refused.

**Layered gradient accumulation** (`layered_grad_accumulation=True`): the `add_layered_reduction` pass
puts a REDUCE_GRAD.c right after chunk c's last backward of every group. Within a group a chunk's
gradient is final once its B backwards have run, so its data-parallel reduction is launched there and
overlaps the backward of the chunks below it (and the next group); depth-first, a gradient is final
only in the last microbatch's backward. Across groups the reductions accumulate into the reduced
gradient (`core.layered_grads.LayeredGradientReducer`), so data-parallel traffic is one reduction per
chunk per group: independent of m for a fixed number of groups.

**Exposure model.** `exposed_reduction` replays a schedule in the simulator with each REDUCE_GRAD.c
starting a reduction of r time units on one lane per rank and returns what is left after the rank's last
compute; `depth_first_accumulation` is plain gradient accumulation on one rank, which with
`add_layered_reduction` stands for overlapped DDP (a chunk's reduction starts in the last microbatch's
backward). docs/layered.md compares the two.

**Memory mode.** Breadth-first keeps B microbatches per chunk alive, so the schedule's default is to
keep only each layer's input and recompute the layer in its backward (`checkpoint_layer_inputs`,
applied by `training.train.build_pipeline` as full/uniform recompute of 1 layer): stash memory is
v·B·(layers per chunk)·(s·b·h) layer inputs instead of v·B full chunk activations, for one extra
forward per layer. `--recompute-granularity` overrides it; `--no-checkpoint-layer-inputs` keeps every
activation.

p=4, m=8, v=2 (8 layers, one per stage; every rank runs the same list, the ring staggers them in time):

    rank 0 | F0.0 F1.0 F2.0 F3.0 F4.0 F5.0 F6.0 F7.0 F0.1 F1.1 F2.1 F3.1 F4.1 F5.1 F6.1 F7.1
    rank 1 | F0.0 F1.0 F2.0 F3.0 F4.0 F5.0 F6.0 F7.0 F0.1 F1.1 F2.1 F3.1 F4.1 F5.1 F6.1 F7.1
    rank 2 | F0.0 F1.0 F2.0 F3.0 F4.0 F5.0 F6.0 F7.0 F0.1 F1.1 F2.1 F3.1 F4.1 F5.1 F6.1 F7.1
    rank 3 | F0.0 F1.0 F2.0 F3.0 F4.0 F5.0 F6.0 F7.0 F0.1 F1.1 F2.1 F3.1 F4.1 F5.1 F6.1 F7.1

    rank 0 | B0.1 B1.1 B2.1 B3.1 B4.1 B5.1 B6.1 B7.1 B0.0 B1.0 B2.0 B3.0 B4.0 B5.0 B6.0 B7.0
    rank 1 | B0.1 B1.1 B2.1 B3.1 B4.1 B5.1 B6.1 B7.1 B0.0 B1.0 B2.0 B3.0 B4.0 B5.0 B6.0 B7.0
    rank 2 | B0.1 B1.1 B2.1 B3.1 B4.1 B5.1 B6.1 B7.1 B0.0 B1.0 B2.0 B3.0 B4.0 B5.0 B6.0 B7.0
    rank 3 | B0.1 B1.1 B2.1 B3.1 B4.1 B5.1 B6.1 B7.1 B0.0 B1.0 B2.0 B3.0 B4.0 B5.0 B6.0 B7.0

Simulated with F = 1, B = 2 per chunk, every rank is busy 48 of 57 time units: bubble 9/57 = 15.8%
= (p − 1)/(v·m + p − 1), against 27.3% for 1F1B on the same 4 ranks; each rank holds v·m = 16 stashes
at its peak. With B = 4 and layered accumulation the step is two groups of 4, each chunk is reduced
once per group, a rank holds 8 stashes at its peak and the makespan is 66 (bubble 3/11 = 27.3% of
each group). Rank 0's list (every rank's is the same):

    rank 0 | F0.0 F1.0 F2.0 F3.0 F0.1 F1.1 F2.1 F3.1 B0.1 B1.1 B2.1 B3.1 REDUCE_GRAD.1
             B0.0 B1.0 B2.0 B3.0 REDUCE_GRAD.0 F4.0 F5.0 F6.0 F7.0 F4.1 F5.1 F6.1 F7.1
             B4.1 B5.1 B6.1 B7.1 REDUCE_GRAD.1 B4.0 B5.0 B6.0 B7.0 REDUCE_GRAD.0

(`tests/schedules/test_looped.py` checks the tables and numbers against `Schedule.format_table` and
the simulator.)
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

from megatron_pp.schedules.comm import HOIST_TO_SEND_ONLY_BATCHES
from megatron_pp.schedules.generators import looped_placement
from megatron_pp.schedules.ir import Action, Op, Schedule, positive_int
from megatron_pp.schedules.simulate import CostModel, SimResult, simulate

__all__ = ["looped_bfs", "add_layered_reduction", "depth_first_accumulation", "exposed_reduction"]

# Actions after which a chunk's weight gradient for that microbatch is complete (BI leaves it to BW).
_WEIGHT_GRAD_OPS = frozenset({Op.B, Op.BW})


def looped_bfs(num_ranks: int, num_microbatches: int, num_chunks: int,
               breadth_first_microbatches: int | None = None, layered_grad_accumulation: bool = False,
               checkpoint_layer_inputs: bool = True) -> Schedule:
    """The modular pipeline in breadth-first order, optionally with layered gradient accumulation.

    See the module docstring for the order, the worked p=4, m=8 tables and the bubble. Raises
    ValueError when a group holds fewer than p microbatches (every loop would stall) or B does not
    divide m.
    """
    p = positive_int("num_ranks", num_ranks)
    m = positive_int("num_microbatches", num_microbatches)
    v = positive_int("num_chunks", num_chunks)
    group = m if breadth_first_microbatches is None else positive_int(
        "--breadth-first-microbatches", breadth_first_microbatches)
    if m % group != 0:
        raise ValueError(f"--breadth-first-microbatches {group} does not divide the {m} microbatches per step "
                         "into equal depth-first groups")
    if group < p:
        what = (f"{m} microbatches per step" if group == m
                else f"--breadth-first-microbatches {group}")
        raise ValueError(f"looped-bfs needs at least --pipeline-model-parallel-size {p} microbatches per "
                         f"breadth-first group, got {what}: a microbatch comes back to its rank after {p} hops, so "
                         f"with fewer the rank idles on every loop; raise the global batch size or the group size")
    rank_list: list[Action] = []
    for start in range(0, m, group):
        members = range(start, start + group)
        rank_list += [Action(Op.F, i, c) for c in range(v) for i in members]
        rank_list += [Action(Op.B, i, c) for c in reversed(range(v)) for i in members]
    # Rank p-1 sends each microbatch back round the ring while rank 0 is still busy with the group's
    # other forwards: rank 0 must post those receives early, beside its own sends (see comm.py).
    options: dict = {"breadth_first_microbatches": group, "checkpoint_layer_inputs": bool(checkpoint_layer_inputs),
                     HOIST_TO_SEND_ONLY_BATCHES: True}
    schedule = Schedule(
        name="looped-bfs",
        num_ranks=p,
        num_microbatches=m,
        num_chunks=v,
        placement=looped_placement(p, v),
        actions=[list(rank_list) for _ in range(p)],
        options=options,
    )
    if layered_grad_accumulation:
        schedule = add_layered_reduction(schedule, group)
    return schedule


def add_layered_reduction(schedule: Schedule, microbatches_per_reduction: int | None = None) -> Schedule:
    """Insert REDUCE_GRAD.c right after chunk c's last weight-gradient backward (B, or BW of a split one)
    of every group of `microbatches_per_reduction` consecutive microbatches (default: all m, once per step).

    Works on any compute-only schedule. The group size is recorded as the schedule option
    `microbatches_per_reduction`, which the validator reads to check that reduction k of chunk c comes
    after every backward of group k on that chunk and before any later group's.
    """
    m = schedule.num_microbatches
    group = m if microbatches_per_reduction is None else positive_int(
        "microbatches_per_reduction", microbatches_per_reduction)
    if any(a.op is Op.REDUCE_GRAD for acts in schedule.actions for a in acts):
        raise ValueError(f"schedule {schedule.name!r} already reduces gradients (it has REDUCE_GRAD actions)")
    actions = []
    for acts in schedule.actions:
        # Index of the last weight-gradient action of each (group, chunk): the reduction goes after it.
        closing: dict[tuple[int, int], int] = {}
        for i, a in enumerate(acts):
            if a.op in _WEIGHT_GRAD_OPS:
                closing[a.microbatch // group, a.chunk] = i
        after = {i: Action(Op.REDUCE_GRAD, chunk=chunk) for (_, chunk), i in closing.items()}
        out: list[Action] = []
        for i, a in enumerate(acts):
            out.append(a)
            if i in after:
                out.append(after[i])
        actions.append(out)
    options = {**schedule.options, "layered_grad_accumulation": True, "microbatches_per_reduction": group}
    return dataclasses.replace(schedule, actions=actions, options=options)


def depth_first_accumulation(num_microbatches: int, num_chunks: int) -> Schedule:
    """Plain (depth-first) gradient accumulation on one pipeline rank: microbatch i runs forward through
    chunks 0..v-1 and back before microbatch i+1 starts. With `add_layered_reduction` it models
    overlapped data parallelism (DDP): a chunk's reduction starts during the last microbatch's backward.
    m=2, v=2: F0.0 F0.1 B0.1 B0.0 F1.0 F1.1 B1.1 B1.0."""
    m = positive_int("num_microbatches", num_microbatches)
    v = positive_int("num_chunks", num_chunks)
    actions = [Action(op, i, c) for i in range(m)
               for op, c in [(Op.F, c) for c in range(v)] + [(Op.B, c) for c in reversed(range(v))]]
    return Schedule("depth-first", 1, m, v, looped_placement(1, v), [actions], {})


def exposed_reduction(schedule: Schedule, reduce_time: float | Mapping[int, float],
                      costs: Optional[CostModel] = None, *, result: Optional[SimResult] = None,
                      from_backward_start: bool = False) -> list[float]:
    """Per rank, the data-parallel reduction time left after its last compute action ends, in the cost
    model's units: each REDUCE_GRAD.c of the simulated timeline starts a reduction of `reduce_time` (one
    number for every chunk, or a mapping from global stage, as `schedule.placement` numbers them, to its
    time) on one lane per rank (the collectives of a group run one after another). `schedule` is what
    `simulate` takes: with its communication when it has more than one rank; `result`, its simulation
    under `costs` when the caller already has it. `from_backward_start` lets a chunk's reduction start
    when its last backward starts, as bucketed reducers (Megatron's overlapped gradient reduction) begin
    on the first buckets ready: an upper bound on that overlap.

    Depth-first (`depth_first_accumulation` + `add_layered_reduction`), chunk c's reduction starts c
    backwards before the end, so v chunks leave about v·r − 2·(v − 1) exposed (F = 1, B = 2); layered,
    it starts c·m backwards before the end and only the last chunk's r is left while r ≤ 2·m.
    """
    result = result if result is not None else simulate(schedule, costs)
    stage_of = {where: stage for stage, where in enumerate(schedule.placement)}
    exposed = []
    for rank, timeline in enumerate(result.timeline):
        lane, last_compute = 0.0, 0.0
        backward_start: dict[int, float] = {}
        for action, start, end in timeline:
            if action.is_compute:
                last_compute = max(last_compute, end)
                if action.op in (Op.B, Op.BW):
                    backward_start[action.chunk] = start
            elif action.op is Op.REDUCE_GRAD:
                begin = backward_start.get(action.chunk, start) if from_backward_start else start
                lane = max(lane, begin) + (reduce_time[stage_of[(rank, action.chunk)]]
                                           if isinstance(reduce_time, Mapping) else reduce_time)
        exposed.append(max(0.0, lane - last_compute))
    return exposed
