"""Schedule generators: pure functions of (ranks, microbatches, chunks, options) returning compute-only lists.

Every generator here is built from two pieces: a placement of global stages on (rank, local chunk) and,
per rank, the order of its forwards, the order of its backwards and a warm-up count. `flush_order`
then lays out warm-up forwards, steady one-forward-one-backward pairs and cool-down backwards, which is
the shape shared by GPipe (warm-up = everything), 1F1B and Megatron's interleaved 1F1B. Later generators
(group-interleaved / GIS, looped-BFS, 2BW) slot in beside them by choosing a different forward order,
warm-up count or version tags. Communication is not emitted here: `comm.insert_communication` adds it,
so a generator states only what each rank computes and in which order.
"""
from __future__ import annotations

from typing import Sequence

from megatron_pp.schedules.comm import insert_communication
from megatron_pp.schedules.ir import Action, Op, Schedule, ScheduleError, positive_int


def looped_placement(num_ranks: int, num_chunks: int) -> list[tuple[int, int]]:
    """Stage k on (rank k mod p, chunk k // p): contiguous for one chunk, Megatron's interleaving for more.

    p=4, v=2: stages 0..3 -> chunk 0 of ranks 0..3, stages 4..7 -> chunk 1 of ranks 0..3.
    """
    return [(stage % num_ranks, stage // num_ranks) for stage in range(num_ranks * num_chunks)]


def flush_order(forwards: Sequence[Action], backwards: Sequence[Action], num_warmup: int) -> list[Action]:
    """Warm-up forwards, then (forward, backward) pairs, then the remaining backwards: one flushed step."""
    steady = len(forwards) - num_warmup
    actions = list(forwards[:num_warmup])
    for i in range(steady):
        actions += [forwards[num_warmup + i], backwards[i]]
    actions += backwards[steady:]
    return actions


def _check_sizes(num_ranks: int, num_microbatches: int, num_chunks: int = 1) -> None:
    positive_int("num_ranks", num_ranks)
    positive_int("num_microbatches", num_microbatches)
    positive_int("num_chunks", num_chunks)


def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """GPipe: every rank runs all m forwards, then all m backwards in microbatch order 0..m-1.

    This is 1F1B with every forward in the warm-up (Megatron's `--gpipe` in PipeDream's fork), so every
    rank holds m stashes at its peak. p=4, m=8:

        rank 0 | F0.0 F1.0 F2.0 F3.0 F4.0 F5.0 F6.0 F7.0 B0.0 B1.0 B2.0 B3.0 B4.0 B5.0 B6.0 B7.0
        rank 1 | F0.0 F1.0 F2.0 F3.0 F4.0 F5.0 F6.0 F7.0 B0.0 B1.0 B2.0 B3.0 B4.0 B5.0 B6.0 B7.0
        rank 2 | F0.0 F1.0 F2.0 F3.0 F4.0 F5.0 F6.0 F7.0 B0.0 B1.0 B2.0 B3.0 B4.0 B5.0 B6.0 B7.0
        rank 3 | F0.0 F1.0 F2.0 F3.0 F4.0 F5.0 F6.0 F7.0 B0.0 B1.0 B2.0 B3.0 B4.0 B5.0 B6.0 B7.0
    """
    _check_sizes(num_ranks, num_microbatches)
    m = num_microbatches
    forwards = [Action(Op.F, i, 0) for i in range(m)]
    backwards = [Action(Op.B, i, 0) for i in range(m)]
    return Schedule(
        name="gpipe",
        num_ranks=num_ranks,
        num_microbatches=m,
        num_chunks=1,
        placement=looped_placement(num_ranks, 1),
        actions=[flush_order(forwards, backwards, m) for _ in range(num_ranks)],
        options={},
    )


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """1F1B with flush (PipeDream-Flush, Megatron's non-interleaved schedule, DAPPLE); stage s on rank s.

    Rank s runs w_s = min(p-s-1, m) warm-up forwards, then F(w_s+j), B(j) pairs, then the remaining
    backwards, so it holds at most min(p-s, m) stashes. p=4, m=8:

        rank 0 | F0.0 F1.0 F2.0 F3.0 B0.0 F4.0 B1.0 F5.0 B2.0 F6.0 B3.0 F7.0 B4.0 B5.0 B6.0 B7.0
        rank 1 | F0.0 F1.0 F2.0 B0.0 F3.0 B1.0 F4.0 B2.0 F5.0 B3.0 F6.0 B4.0 F7.0 B5.0 B6.0 B7.0
        rank 2 | F0.0 F1.0 B0.0 F2.0 B1.0 F3.0 B2.0 F4.0 B3.0 F5.0 B4.0 F6.0 B5.0 F7.0 B6.0 B7.0
        rank 3 | F0.0 B0.0 F1.0 B1.0 F2.0 B2.0 F3.0 B3.0 F4.0 B4.0 F5.0 B5.0 F6.0 B6.0 F7.0 B7.0
    """
    _check_sizes(num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    forwards = [Action(Op.F, i, 0) for i in range(m)]
    backwards = [Action(Op.B, i, 0) for i in range(m)]
    return Schedule(
        name="1f1b",
        num_ranks=p,
        num_microbatches=m,
        num_chunks=1,
        placement=looped_placement(p, 1),
        actions=[flush_order(forwards, backwards, min(p - r - 1, m)) for r in range(p)],
        options={},
    )


def group_order(num_microbatches: int, num_chunks: int, group_size: int) -> list[tuple[int, int]]:
    """Forward order as (microbatch, chunk): groups of `group_size` microbatches, chunks outer within a
    group, microbatches inner; a last partial group keeps the same shape with fewer microbatches.

    m=5, v=2, g=2: (0,0) (1,0) (0,1) (1,1) (2,0) (3,0) (2,1) (3,1) (4,0) (4,1).
    """
    order: list[tuple[int, int]] = []
    for start in range(0, num_microbatches, group_size):
        members = range(start, min(start + group_size, num_microbatches))
        order += [(i, c) for c in range(num_chunks) for i in members]
    return order


def interleaved_1f1b(num_ranks: int, num_microbatches: int, num_chunks: int,
                     group_size: int | None = None) -> Schedule:
    """Megatron's interleaved 1F1B: stage c·p + r on (rank r, chunk c), v chunks per rank.

    Forward virtual step k runs the k-th entry of `group_order(m, v, g)` (g = `group_size`, Megatron's
    `microbatch_group_size_per_vp_stage`, default p); backward step k runs the same microbatch on the
    reversed chunk v-1-c. Rank r runs min(2·(p-r-1) + (v-1)·g, m·v) warm-up forwards (so rank 0 peaks at
    v·p + p - 1 stashes for g = p), then 1F1B pairs, then the cool-down. With v = 1 the warm-up is 1F1B's
    p-r-1 (Megatron runs its non-interleaved schedule then), so the result equals `one_f_one_b`.
    Requires g ≥ p when v > 1 (smaller groups are GIS). Any m ≥ 1 is accepted when the order completes:
    m a multiple of g, m ≤ g (one group, so m < p works) or a last group of at least p microbatches always
    do (tested for p ≤ 8, m ≤ 16, v ≤ 4); a shorter last group is replayed here and rejected with a
    ValueError if it deadlocks (e.g. p=4, m=5, v=3), where Megatron rejects all of them. p=4, m=8, v=2:

        rank 0 | F0.0 F1.0 F2.0 F3.0 F0.1 F1.1 F2.1 F3.1 F4.0 F5.0 F6.0 B0.1 F7.0 B1.1 F4.1 B2.1
        rank 1 | F0.0 F1.0 F2.0 F3.0 F0.1 F1.1 F2.1 F3.1 F4.0 B0.1 F5.0 B1.1 F6.0 B2.1 F7.0 B3.1
        rank 2 | F0.0 F1.0 F2.0 F3.0 F0.1 F1.1 F2.1 B0.1 F3.1 B1.1 F4.0 B2.1 F5.0 B3.1 F6.0 B0.0
        rank 3 | F0.0 F1.0 F2.0 F3.0 F0.1 B0.1 F1.1 B1.1 F2.1 B2.1 F3.1 B3.1 F4.0 B0.0 F5.0 B1.0

        rank 0 | F5.1 B3.1 F6.1 B0.0 F7.1 B1.0 B2.0 B3.0 B4.1 B5.1 B6.1 B7.1 B4.0 B5.0 B6.0 B7.0
        rank 1 | F4.1 B0.0 F5.1 B1.0 F6.1 B2.0 F7.1 B3.0 B4.1 B5.1 B6.1 B7.1 B4.0 B5.0 B6.0 B7.0
        rank 2 | F7.0 B1.0 F4.1 B2.0 F5.1 B3.0 F6.1 B4.1 F7.1 B5.1 B6.1 B7.1 B4.0 B5.0 B6.0 B7.0
        rank 3 | F6.0 B2.0 F7.0 B3.0 F4.1 B4.1 F5.1 B5.1 F6.1 B6.1 F7.1 B7.1 B4.0 B5.0 B6.0 B7.0
    """
    _check_sizes(num_ranks, num_microbatches, num_chunks)
    p, m, v = num_ranks, num_microbatches, num_chunks
    g = p if group_size is None else group_size
    if not isinstance(g, int) or isinstance(g, bool) or g < 1:
        raise ValueError(f"microbatch group size must be a positive int, got {group_size!r}")
    if v > 1 and g < p:
        # Groups smaller than p need GIS's shorter warm-up; with Megatron's warm-up most such orders deadlock.
        raise ValueError(f"interleaved-1f1b needs a microbatch group size of at least the pipeline size "
                         f"({p}), got {g}; smaller groups are the group-interleaved (GIS) schedule")
    order = group_order(m, v, g)
    forwards = [Action(Op.F, i, c) for i, c in order]
    backwards = [Action(Op.B, i, v - 1 - c) for i, c in order]
    actions = []
    for r in range(p):
        warmup = p - r - 1 if v == 1 else 2 * (p - r - 1) + (v - 1) * g
        actions.append(flush_order(forwards, backwards, min(warmup, m * v)))
    schedule = Schedule(
        name="interleaved-1f1b",
        num_ranks=p,
        num_microbatches=m,
        num_chunks=v,
        placement=looped_placement(p, v),
        actions=actions,
        options={"microbatch_group_size": g},
    )
    remainder = m % g
    if v > 1 and m > g and 0 < remainder < p:
        # Megatron rejects every such m. A short last group sends its microbatches round the ring with
        # less than p steps between chunks; some of these orders still complete, so replay to decide.
        try:
            insert_communication(schedule)
        except ScheduleError as err:
            raise ValueError(
                f"interleaved-1f1b with p={p}, m={m}, v={v}, group size {g} deadlocks: its last group holds "
                f"{remainder} microbatch(es), fewer than p={p}; use m a multiple of {g}, or with a remainder "
                f"of at least {p}, or m <= {g} ({err})") from None
    return schedule
