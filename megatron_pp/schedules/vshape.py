"""V-shape schedules: two chunks per rank, stage r and stage 2p−1−r on rank r, backward split into BI and BW.

The V placement (Qi et al., arXiv 2401.10241, §6; arXiv 2405.15362) folds the pipeline back on itself: rank
r holds global stage r as local chunk 0 and stage 2p−1−r as local chunk 1, so a microbatch's forward runs
down the ranks and back up, and rank 0 holds both the first stage (embedding) and the last (head and loss).
Stage p−1 hands its output to stage p on the same rank, in memory. Each rank's two stashes have
complementary lifespans (the first chunk's is the longest of the pipeline, the second's the shortest), so
every rank holds about the same activation memory: the balance BPipe buys with transfers comes free.
Both generators return compute-only lists (`comm.insert_communication` adds the messages). Memory is
counted in chunk stashes (one microbatch on one chunk, half of a 1F1B stage's stash at equal layer
counts): 1F1B with p ranks peaks at p full stashes = 2p chunk stashes on rank 0. Times below are in chunk
units, T_F, T_B (= BI), T_W (= BW) of one chunk.

* **`zb-v`** (2401.10241, §6, the ZB-V schedule). Rank r runs 2(p−r)−1 forwards of chunk 0, then r pairs
  (chunk-1 forward, chunk-0 forward), then p−r triples (F, BI, BW of chunk 1); the steady state repeats
  F, BI, BW of chunk 0 then of chunk 1; the cool-down runs r pairs of BIs (chunk 0, chunk 1), then BI and
  BW of chunk 0, and leaves the remaining BWs to the end, where they fill the time the last input
  gradients take to come back. Every rank peaks at 2p chunk stashes (1F1B's p full ones) once m ≥ 2p−1.
  Simulated makespan with T_F = T_B ≥ T_W and m ≥ 2p−1: exactly 2m(T_F+T_B+T_W) + (p−1)·T_F, i.e. every
  rank idles (p−1)·T_F, the time the last rank waits for its first input (the paper's "zero bubble" counts
  a rank's time from its first action; the simulator counts from the step's start). At other costs
  (m ≥ 2p−1) the idle time per rank stays between (p−1)·T_F and (p−1)·(T_F + max(T_F, T_B, T_W)) (tested).
* **`v-half`** (ours, after 2405.15362's V-shape building blocks). One building block per microbatch,
  repeated every I = 6 slots (F, BI, BW of two chunks per rank, one slot each at T_F = T_B = T_W):
  forwards run down the V one slot apart, the input gradients come back up one slot apart, each BW takes
  the first slot after its BI; an action whose slot is already taken modulo I by another action of its
  rank moves to the next free one (`v_building_block`). Each rank's list is every microbatch's block
  actions sorted by block time. The tight block keeps lifespans short: peak 4 chunk stashes at p = 4
  (1F1B: 8) and 8 at p = 8 (1F1B: 16), at most ⌈(p+2)/2⌉ full stashes, the paper's V-Half memory. The
  bubble is the block's ramp: idle time per rank at T_F = T_B = T_W = 1 is 11 at p = 4 and 27 at p = 8
  against 1F1B's 6(p−1) = 18 and 42, the same for every m ≥ p (tested). The paper's V-Half gets about
  half of 1F1B's bubble (≈ p/(2m) of the step) by spending its memory budget on a squeezed warm-up and
  cool-down; this block does not squeeze (docs/schedules.md says so). The order is derived at equal
  times: with unequal T_F, T_B, T_W its idle time grows with m (tested), so it is for T_F ≈ T_B ≈ T_W.

p=4, m=8 (`zb-v`):

    rank 0 | F0.0  F1.0  F2.0  F3.0  F4.0  F5.0  F6.0  F0.1  BI0.1 BW0.1 F1.1  BI1.1 BW1.1 F2.1  BI2.1 BW2.1
    rank 1 | F0.0  F1.0  F2.0  F3.0  F4.0  F0.1  F5.0  F1.1  BI0.1 BW0.1 F2.1  BI1.1 BW1.1 F3.1  BI2.1 BW2.1
    rank 2 | F0.0  F1.0  F2.0  F0.1  F3.0  F1.1  F4.0  F2.1  BI0.1 BW0.1 F3.1  BI1.1 BW1.1 F5.0  BI0.0 BW0.0
    rank 3 | F0.0  F0.1  F1.0  F1.1  F2.0  F2.1  F3.0  F3.1  BI0.1 BW0.1 F4.0  BI0.0 BW0.0 F4.1  BI1.1 BW1.1

    rank 0 | F3.1  BI3.1 BW3.1 F7.0  BI0.0 BW0.0 F4.1  BI4.1 BW4.1 BI1.0 BW1.0 F5.1  BI5.1 BW5.1 BI2.0 BW2.0
    rank 1 | F6.0  BI0.0 BW0.0 F4.1  BI3.1 BW3.1 F7.0  BI1.0 BW1.0 F5.1  BI4.1 BW4.1 BI2.0 BW2.0 F6.1  BI5.1
    rank 2 | F4.1  BI2.1 BW2.1 F6.0  BI1.0 BW1.0 F5.1  BI3.1 BW3.1 F7.0  BI2.0 BW2.0 F6.1  BI4.1 BW4.1 BI3.0
    rank 3 | F5.0  BI1.0 BW1.0 F5.1  BI2.1 BW2.1 F6.0  BI2.0 BW2.0 F6.1  BI3.1 BW3.1 F7.0  BI3.0 BW3.0 F7.1

    rank 0 | F6.1  BI6.1 BW6.1 BI3.0 BW3.0 F7.1  BI7.1 BW7.1 BI4.0 BW4.0 BI5.0 BW5.0 BI6.0 BW6.0 BI7.0 BW7.0
    rank 1 | BW5.1 BI3.0 BW3.0 F7.1  BI6.1 BW6.1 BI4.0 BI7.1 BI5.0 BW4.0 BI6.0 BW5.0 BI7.0 BW6.0 BW7.1 BW7.0
    rank 2 | BW3.0 F7.1  BI5.1 BW5.1 BI4.0 BI6.1 BI5.0 BI7.1 BI6.0 BW4.0 BI7.0 BW5.0 BW6.1 BW7.1 BW6.0 BW7.0
    rank 3 | BI4.1 BW4.1 BI4.0 BI5.1 BI5.0 BI6.1 BI6.0 BI7.1 BI7.0 BW4.0 BW5.1 BW6.1 BW7.1 BW5.0 BW6.0 BW7.0

p=4, m=8 (`v-half`; block: forwards of stages 0..7 at slots 0..7, BI at 15 14 13 12 11 10 9 8, BW at
17 17 15 14 13 12 10 10):

    rank 0 | F0.0  F1.0  F0.1  BI0.1 BW0.1 F2.0  F1.1  BI1.1 BI0.0 BW1.1 BW0.0 F3.0  F2.1  BI2.1 BI1.0 BW2.1
    rank 1 | F0.0  F0.1  F1.0  BI0.1 BW0.1 F1.1  F2.0  BI0.0 BI1.1 BW1.1 BW0.0 F2.1  F3.0  BI1.0 BI2.1 BW2.1
    rank 2 | F0.0  F0.1  F1.0  BI0.1 F1.1  BW0.1 BI0.0 F2.0  BW0.0 BI1.1 F2.1  BW1.1 BI1.0 F3.0  BW1.0 BI2.1
    rank 3 | F0.0  F0.1  F1.0  F1.1  BI0.1 BI0.0 BW0.1 BW0.0 F2.0  F2.1  BI1.1 BI1.0 BW1.1 BW1.0 F3.0  F3.1

    rank 0 | BW1.0 F4.0  F3.1  BI3.1 BI2.0 BW3.1 BW2.0 F5.0  F4.1  BI4.1 BI3.0 BW4.1 BW3.0 F6.0  F5.1  BI5.1
    rank 1 | BW1.0 F3.1  F4.0  BI2.0 BI3.1 BW3.1 BW2.0 F4.1  F5.0  BI3.0 BI4.1 BW4.1 BW3.0 F5.1  F6.0  BI4.0
    rank 2 | F3.1  BW2.1 BI2.0 F4.0  BW2.0 BI3.1 F4.1  BW3.1 BI3.0 F5.0  BW3.0 BI4.1 F5.1  BW4.1 BI4.0 F6.0
    rank 3 | BI2.1 BI2.0 BW2.1 BW2.0 F4.0  F4.1  BI3.1 BI3.0 BW3.1 BW3.0 F5.0  F5.1  BI4.1 BI4.0 BW4.1 BW4.0

    rank 0 | BI4.0 BW5.1 BW4.0 F7.0  F6.1  BI6.1 BI5.0 BW6.1 BW5.0 F7.1  BI7.1 BI6.0 BW7.1 BW6.0 BI7.0 BW7.0
    rank 1 | BI5.1 BW5.1 BW4.0 F6.1  F7.0  BI5.0 BI6.1 BW6.1 BW5.0 F7.1  BI6.0 BI7.1 BW7.1 BW6.0 BI7.0 BW7.0
    rank 2 | BW4.0 BI5.1 F6.1  BW5.1 BI5.0 F7.0  BW5.0 BI6.1 F7.1  BW6.1 BI6.0 BW6.0 BI7.1 BW7.1 BI7.0 BW7.0
    rank 3 | F6.0  F6.1  BI5.1 BI5.0 BW5.1 BW5.0 F7.0  F7.1  BI6.1 BI6.0 BW6.1 BW6.0 BI7.1 BI7.0 BW7.1 BW7.0

Simulated at T_F = T_B = T_W = 1 (p=4, m=8; 1F1B and interleaved 1F1B with the same model, i.e. stages of
two chunks, F = 2, B = 4, and v = 2 chunks, F = 1, B = 2): makespan and rank-0 peak in chunk stashes:
zb-v 51 and 8, v-half 59 and 4, 1F1B 66 and 8, interleaved 1F1B 57 and 11.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_pp.schedules.ir import Action, Op, Schedule, positive_int

CHUNKS_PER_RANK = 2
"""The V places exactly two stages on every rank."""
_SLOTS = 3 * CHUNKS_PER_RANK
"""Block interval of `v-half`: F, BI and BW of both chunks of a rank, one slot each."""


def v_placement(num_ranks: int) -> list[tuple[int, int]]:
    """Stage s on (rank s, chunk 0) for s < p and on (rank 2p−1−s, chunk 1) after the turn."""
    p = num_ranks
    return [(s, 0) if s < p else (2 * p - 1 - s, 1) for s in range(2 * p)]


def check_chunks(name: str, num_chunks: int) -> None:
    """One-line error unless `num_chunks` is the V's two chunks per rank."""
    if num_chunks != CHUNKS_PER_RANK:
        raise ValueError(
            f"--pipeline-schedule {name} places exactly 2 stages on every pipeline rank (stages r and 2p-1-r), "
            f"got {num_chunks} per rank: leave out --num-layers-per-virtual-pipeline-stage or set it to "
            f"num-layers / (2 x pipeline-model-parallel-size) (--num-virtual-stages-per-pipeline-rank 2)")


def _check_sizes(num_ranks: int, num_microbatches: int) -> None:
    positive_int("num_ranks", num_ranks)
    positive_int("num_microbatches", num_microbatches)


class _RankList:
    """One rank's list built by counts: each call appends the next action of its kind if its own
    dependencies on this rank allow it (a backward after its forward, a BW after its BI) and m is not
    exhausted, so that the phase rules below stay valid for every m, including m < 2p−1."""

    def __init__(self, num_microbatches: int) -> None:
        self.m = num_microbatches
        self.actions: list[Action] = []
        self.count = {(op, c): 0 for op in (Op.F, Op.BI, Op.BW) for c in (0, 1)}

    def add(self, op: Op, chunk: int) -> None:
        j = self.count[op, chunk]
        before = {Op.F: None, Op.BI: Op.F, Op.BW: Op.BI}[op]
        if j >= self.m or (before is not None and self.count[before, chunk] <= j):
            return
        self.count[op, chunk] += 1
        self.actions.append(Action(op, j, chunk))

    def repeat(self, op: Op, chunk: int, times: int) -> None:
        for _ in range(times):
            self.add(op, chunk)

    def pending(self, op: Op, chunk: int) -> bool:
        return self.count[op, chunk] < self.m


def _zb_v_rank(p: int, m: int, r: int) -> list[Action]:
    acts = _RankList(m)
    acts.repeat(Op.F, 0, 2 * (p - r) - 1)
    for _ in range(r):
        acts.add(Op.F, 1)
        acts.add(Op.F, 0)
    for _ in range(p - r):
        for op in (Op.F, Op.BI, Op.BW):
            acts.add(op, 1)
    while acts.pending(Op.F, 0) or acts.pending(Op.F, 1):
        for c in (0, 1):
            for op in (Op.F, Op.BI, Op.BW):
                acts.add(op, c)
    for _ in range(r):
        acts.add(Op.BI, 0)
        acts.add(Op.BI, 1)
    while acts.pending(Op.BI, 0):
        acts.add(Op.BI, 0)
        acts.add(Op.BW, 0)
    acts.repeat(Op.BI, 1, m)
    acts.repeat(Op.BW, 1, m)
    acts.repeat(Op.BW, 0, m)
    return acts.actions


def zb_v(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-V (arXiv 2401.10241, §6): see the module docstring for the phases, the table and the formulas."""
    _check_sizes(num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    return Schedule("zb-v", p, m, CHUNKS_PER_RANK, v_placement(p), [_zb_v_rank(p, m, r) for r in range(p)])


@dataclass(frozen=True)
class VBlock:
    """One microbatch of `v-half` in unit slots: `forward[s]`, `backward[s]` (BI) and `weight[s]` (BW) of
    global stage s; microbatch j runs every action `j · interval` slots later."""

    interval: int
    forward: tuple[int, ...]
    backward: tuple[int, ...]
    weight: tuple[int, ...]


def v_building_block(num_ranks: int) -> VBlock:
    """The tight V block: each action at the first slot on or after its dependency that its rank has free
    modulo the interval. p=4: forward 0..7, BI 15 14 13 12 11 10 9 8, BW 17 17 15 14 13 12 10 10."""
    p = num_ranks
    stages = 2 * p
    placement = v_placement(p)
    taken: list[set[int]] = [set() for _ in range(p)]

    def place(stage: int, earliest: int) -> int:
        rank = placement[stage][0]
        t = earliest
        while t % _SLOTS in taken[rank]:
            t += 1
        taken[rank].add(t % _SLOTS)
        return t

    forward, backward, weight = [0] * stages, [0] * stages, [0] * stages
    t = 0
    for s in range(stages):
        forward[s] = place(s, t)
        t = forward[s] + 1
    for s in reversed(range(stages)):
        backward[s] = place(s, t)
        t = backward[s] + 1
    for s in reversed(range(stages)):
        weight[s] = place(s, backward[s] + 1)
    return VBlock(_SLOTS, tuple(forward), tuple(backward), tuple(weight))


def v_half(num_ranks: int, num_microbatches: int) -> Schedule:
    """`v-half`: the V building block repeated once per microbatch (see the module docstring)."""
    _check_sizes(num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    block = v_building_block(p)
    placement = v_placement(p)
    timed: list[list[tuple[int, int, int, Action]]] = [[] for _ in range(p)]
    for j in range(m):
        shift = j * block.interval
        for s, (rank, chunk) in enumerate(placement):
            for kind, (op, slots) in enumerate(((Op.F, block.forward), (Op.BI, block.backward),
                                                (Op.BW, block.weight))):
                timed[rank].append((shift + slots[s], kind, j, Action(op, j, chunk)))
    # Slots of one rank are distinct modulo the interval, so the block times order each list totally.
    actions = [[a for *_, a in sorted(row, key=lambda item: item[:3])] for row in timed]
    return Schedule("v-half", p, m, CHUNKS_PER_RANK, placement, actions)
