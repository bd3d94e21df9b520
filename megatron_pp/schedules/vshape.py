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
* **`v-half`** (ours, within the V-Half memory of arXiv 2405.15362). The paper repeats one building block
  per microbatch, whose lifespans set the peak at ⌈(p+2)/2⌉ microbatches' activations (1F1B: p), and
  squeezes the repeats at warm-up and cool-down. We keep that budget, `v_half_budget(p)` = 2⌈(p+2)/2⌉
  chunk stashes, and read the order off a replay in unit slots (T_F = T_B = T_W = 1) instead: in each
  slot every rank runs, by priority, its next BI whose output gradient is in; else its next F whose input
  is in, if memory admits it; else its oldest waiting BW (BIs and Fs oldest microbatch first, chunk 1
  at a tie; BWs chunk 0 at a tie). A
  stash counts from its F to its BW. An F is admitted only while the rank stays within the budget, and
  a chunk-0 F also keeps a slot free for the chunk-1 forward of every chunk-0 stash still waiting for
  one, itself included (at most 2 + ⌊r/2⌋ of them on rank r until its first chunk-0 BI,
  `_warmup_reserve`): chunk-0 stashes never fill a rank, and chunk 1's are freed without any chunk-0
  backward, so the replay does not stall (checked for every p ≤ 16, m ≤ 4p + 3; any m ≥ 1 is
  accepted). Every rank decides on the slot's starting state and the picks are applied after, as in
  ZB-H2's replay (schedules/zero_bubble.py). At T_F = T_B = T_W and m ≥ 2p each rank idles 7 time
  units at p = 4 and 21 at p = 8, against 1F1B's 6(p−1) = 18 and 42 (0.39 and 0.50 of it;
  at most 0.55 for p = 2..8), and every rank peaks at the budget, 6 and 10 chunk stashes (1F1B: 8 and
  16 on rank 0); all tested. The order is derived at equal times and its steady state runs at the
  budget with no slack, so with unequal T_F, T_B, T_W (e.g. BI 1.2, BW 0.8 × F) its idle time grows
  with m (tested): it is for T_F ≈ T_B ≈ T_W, and `zb-v` is the choice otherwise.

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

p=4, m=8 (`v-half`, budget 6 chunk stashes):

    rank 0 | F0.0  F1.0  F2.0  F3.0  F0.1  BI0.1 F1.1  BI1.1 BW0.1 BW1.1 F2.1  BI2.1 BI0.0 BW0.0 BI1.0 BW1.0
    rank 1 | F0.0  F1.0  F2.0  F3.0  F0.1  F1.1  BI0.1 BW0.1 BI1.1 F2.1  BW1.1 BI0.0 BI2.1 BI1.0 BW0.0 BW1.0
    rank 2 | F0.0  F1.0  F2.0  F0.1  F1.1  F2.1  BI0.1 BW0.1 BI1.1 BI0.0 BW0.0 BI1.0 BI2.1 F3.0  BW1.0 BI2.0
    rank 3 | F0.0  F0.1  F1.0  F1.1  F2.0  F2.1  BI0.1 BI0.0 BI1.1 BI1.0 BW0.0 BW0.1 BI2.1 BI2.0 F3.0  F3.1

    rank 0 | F4.0  BW2.1 BI2.0 BW2.0 F3.1  BI3.1 F5.0  BW3.1 F4.1  BI4.1 BW4.1 F6.0  BI3.0 BW3.0 F5.1  BI5.1
    rank 1 | BW2.1 BI2.0 F4.0  F3.1  BW2.0 BI3.1 F4.1  F5.0  BW3.1 BI4.1 BI3.0 BW3.0 F5.1  F6.0  BI4.0 BI5.1
    rank 2 | BW1.1 F3.1  F4.0  BW2.0 BW2.1 F4.1  BI3.1 BW3.1 F5.0  BI3.0 BI4.1 F5.1  BW3.0 BI4.0 F6.0  BW4.0
    rank 3 | BW1.0 BW1.1 F4.0  F4.1  BW2.0 BW2.1 BI3.1 BI3.0 F5.0  F5.1  BI4.1 BI4.0 BW3.0 BW3.1 F6.0  F6.1

    rank 0 | BI4.0 BW4.0 F7.0  BW5.1 F6.1  BI6.1 BI5.0 BW5.0 BW6.1 F7.1  BI7.1 BI6.0 BW6.0 BW7.1 BI7.0 BW7.0
    rank 1 | BW4.0 BW4.1 F6.1  F7.0  BI5.0 BI6.1 BW5.0 BW5.1 F7.1  BW6.1 BI6.0 BI7.1 BW6.0 BW7.1 BI7.0 BW7.0
    rank 2 | BI5.1 F6.1  BW4.1 BI5.0 F7.0  BW5.0 BI6.1 F7.1  BW5.1 BI6.0 BW6.0 BW6.1 BI7.1 BW7.1 BI7.0 BW7.0
    rank 3 | BI5.1 BI5.0 BW4.0 BW4.1 F7.0  F7.1  BI6.1 BI6.0 BW5.0 BW5.1 BW6.0 BW6.1 BI7.1 BI7.0 BW7.0 BW7.1

Simulated at T_F = T_B = T_W = 1 (p=4, m=8; 1F1B and interleaved 1F1B with the same model, i.e. stages of
two chunks, F = 2, B = 4, and v = 2 chunks, F = 1, B = 2): makespan and rank-0 peak in chunk stashes:
zb-v 51 and 8, v-half 55 and 6, 1F1B 66 and 8, interleaved 1F1B 57 and 11.
"""
from __future__ import annotations

from typing import Callable

from megatron_pp.schedules.ir import Action, Op, Schedule, positive_int

CHUNKS_PER_RANK = 2
"""The V places exactly two stages on every rank."""


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


def v_half_budget(num_ranks: int) -> int:
    """The paper's V-Half memory, ⌈(p+2)/2⌉ microbatches' activations (2405.15362), in chunk stashes."""
    return 2 * -(-(num_ranks + 2) // 2)


def _warmup_reserve(rank: int) -> int:
    """Chunk-1 slots a chunk-0 forward keeps free on `rank` before the rank's first chunk-0 BI (ours).

    Keeping one slot for every chunk-0 stash still waiting for its chunk-1 forward leaves rank 0 idle for
    most of the first round trip (5 forwards in the first 15 slots at p = 8, budget 10), though its chunk-1
    stashes live 3 slots. On rank r a chunk-1 stash lives at least 2r + 3 (r forwards to the loss stage,
    r + 1 BIs back, its BW), hence a reserve growing with r. 2 + ⌊r/2⌋ was picked by simulation: the
    lowest worst idle time over p = 2..10, m ∈ {2p, 2p + 1, 3p, 4p, 6p} among the rules tried (1, 2,
    r + 1, 1 + ⌊(r+1)/2⌋, 2 + ⌊r/3⌋, 3 + ⌊r/2⌋, no cap); tests/schedules/test_vshape.py pins what it
    gives, not the rule."""
    return 2 + rank // 2


def v_half_orders(num_ranks: int, num_microbatches: int) -> list[list[Action]]:
    """`v-half`'s lists, read off the memory-capped unit-slot replay of the module docstring."""
    p, m = num_ranks, num_microbatches
    stages = 2 * p
    cap = v_half_budget(p)

    def stage(rank: int, chunk: int) -> int:
        return rank if chunk == 0 else stages - 1 - rank

    # Done flags per (microbatch, global stage); every rank decides on the slot's starting state and the
    # picks are applied after, so a result is usable from the next slot on, as in ZB-H2's replay.
    f_done = [[False] * stages for _ in range(m)]
    bi_done = [[False] * stages for _ in range(m)]
    nf, nbi, nbw = ([[0, 0] for _ in range(p)] for _ in range(3))
    acts: list[list[Action]] = [[] for _ in range(p)]
    while any(nbw[r][c] < m for r in range(p) for c in (0, 1)):
        picks: list[tuple[Op, int] | None] = []
        for r in range(p):
            picks.append(_pick(r, m, cap, stage, f_done, bi_done, nf[r], nbi[r], nbw[r]))
        if not any(picks):
            # Not reached for any p <= 16, m <= 4p + 3 (nor p = 24, 32): a chunk-0 forward always leaves a slot
            # free, and a chunk-1 stash is freed without any chunk-0 backward. Kept so a stall raises, never hangs.
            raise RuntimeError(f"v-half replay stalled at p={p}, m={m}")
        for r, pick in enumerate(picks):
            if pick is None:
                continue
            op, c = pick
            count = {Op.F: nf, Op.BI: nbi, Op.BW: nbw}[op][r]
            j = count[c]
            count[c] += 1
            if op is Op.F:
                f_done[j][stage(r, c)] = True
            elif op is Op.BI:
                bi_done[j][stage(r, c)] = True
            acts[r].append(Action(op, j, c))
    return acts


def _pick(r: int, m: int, cap: int, stage: Callable[[int, int], int], f_done: list[list[bool]],
          bi_done: list[list[bool]], nf: list[int], nbi: list[int], nbw: list[int]) -> tuple[Op, int] | None:
    """Rank r's action in this slot: (op, chunk) by the replay's priorities, None to idle."""
    last = len(f_done[0]) - 1  # the loss stage, 2p - 1
    live = nf[0] + nf[1] - nbw[0] - nbw[1]
    waiting = nf[0] - nf[1]  # chunk-0 stashes whose chunk-1 forward has not run
    ready: dict[Op, list[tuple[int, int]]] = {Op.BI: [], Op.F: []}
    for c in (0, 1):
        j, s = nbi[c], stage(r, c)
        if j < nf[c] and f_done[j][s] and (s == last or bi_done[j][s + 1]):
            ready[Op.BI].append((j, -c))
        j = nf[c]
        if j < m and (s == 0 or f_done[j][s - 1]):
            reserve = 0 if c == 1 else waiting + 1
            if c == 0 and nbi[0] == 0:
                reserve = min(reserve, _warmup_reserve(r))
            if live + 1 + reserve <= cap:
                ready[Op.F].append((j, -c))
    # Oldest microbatch first, chunk 1 (nearer the loss) at a tie; BWs only fill what is left.
    for op in (Op.BI, Op.F):
        if ready[op]:
            return op, -min(ready[op])[1]
    pending = [(nbw[c], c) for c in (0, 1) if nbw[c] < nbi[c]]
    return (Op.BW, min(pending)[1]) if pending else None


def v_half(num_ranks: int, num_microbatches: int) -> Schedule:
    """`v-half`: V placement within the paper's V-Half memory (see the module docstring). Any m ≥ 1."""
    _check_sizes(num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    return Schedule("v-half", p, m, CHUNKS_PER_RANK, v_placement(p), v_half_orders(p, m))
