"""PipeOffload's generalized interleaved schedules (GIS, GIS-H and the uniform repeating order of PO).

All of them place stage c·p + r on (rank r, chunk c), as Megatron's interleaved 1F1B does, and split each
backward into BI (input gradient, sent upstream at once) and BW (weight gradient) with BW right after
its BI, so a stash lives from its F to its BW and no weight gradient is left waiting (PipeOffload, arXiv
2503.01328, §3 and Table 1).

* **Group-interleaved (`gis`, ⌈p/2⌉ ≤ g ≤ p, g ≥ 2).** Forwards take microbatches in groups of g, chunk by
  chunk inside a group (`generators.group_order`); backwards use the same order on the reversed chunk.
  Rank r runs g·(v−1) + p − r − 1 warm-up chunk-forwards, then one forward and one backward at a time,
  then the cool-down. For g = p (GIS) that is p·v − r − 1, i.e. Megatron's warm-up minus p − r − 1,
  so rank 0 holds p·v chunk stashes (= M) instead of p·v + p − 1; in general rank 0 holds
  g·(v−1) + p. g = ⌈p/2⌉ is GIS-H, about half of interleaved 1F1B's memory. Smaller groups (other than
  1) deadlock with this warm-up and are refused.
* **Uniform repeating (`gis` with g = 1, the order PO-H and PO-F offload).** One building block per
  microbatch, repeated every I = 3v slots (v forwards, v BI and v BW of one microbatch per rank, one slot
  each), so the steady state has no bubble. In the block every rank cycles F, BI, BW with its neighbour
  one slot later, which gives forward hops of one slot and backward hops of two (the upstream BI
  follows this rank's BW). Crossing from rank p−1 back to rank 0 costs a small shift when 3 does not
  divide p, and further shifts of 3 keep the v forwards (and the v backwards) of one rank on distinct
  slots modulo I. Each rank's list is every microbatch's block actions sorted by their block time. A
  chunk's stash then lives about 3·(p·v − stage) slots, proportional to how early the stage comes, so
  offloading the first chunks saves far more than their share (better than linear: PipeOffload, Figs. 2
  and 3); unoffloaded rank 0 holds about p·(v+1)/2 stashes, like GIS-H (p=8, v=4: 20, exactly GIS-H's
  g·(v−1) + p; p=4, v=4: 12 against GIS-H's 10, the ring-closing shifts lengthen every lifespan a little).

p=4, m=8, v=2 (GIS, g=4; warm-up 7, 6, 5, 4):

    rank 0 | F0.0  F1.0  F2.0  F3.0  F0.1  F1.1  F2.1  F3.1  BI0.1 BW0.1 F4.0  BI1.1 BW1.1 F5.0  BI2.1 BW2.1
    rank 1 | F0.0  F1.0  F2.0  F3.0  F0.1  F1.1  F2.1  BI0.1 BW0.1 F3.1  BI1.1 BW1.1 F4.0  BI2.1 BW2.1 F5.0
    rank 2 | F0.0  F1.0  F2.0  F3.0  F0.1  F1.1  BI0.1 BW0.1 F2.1  BI1.1 BW1.1 F3.1  BI2.1 BW2.1 F4.0  BI3.1
    rank 3 | F0.0  F1.0  F2.0  F3.0  F0.1  BI0.1 BW0.1 F1.1  BI1.1 BW1.1 F2.1  BI2.1 BW2.1 F3.1  BI3.1 BW3.1

    rank 0 | F6.0  BI3.1 BW3.1 F7.0  BI0.0 BW0.0 F4.1  BI1.0 BW1.0 F5.1  BI2.0 BW2.0 F6.1  BI3.0 BW3.0 F7.1
    rank 1 | BI3.1 BW3.1 F6.0  BI0.0 BW0.0 F7.0  BI1.0 BW1.0 F4.1  BI2.0 BW2.0 F5.1  BI3.0 BW3.0 F6.1  BI4.1
    rank 2 | BW3.1 F5.0  BI0.0 BW0.0 F6.0  BI1.0 BW1.0 F7.0  BI2.0 BW2.0 F4.1  BI3.0 BW3.0 F5.1  BI4.1 BW4.1
    rank 3 | F4.0  BI0.0 BW0.0 F5.0  BI1.0 BW1.0 F6.0  BI2.0 BW2.0 F7.0  BI3.0 BW3.0 F4.1  BI4.1 BW4.1 F5.1

    rank 0 | BI4.1 BW4.1 BI5.1 BW5.1 BI6.1 BW6.1 BI7.1 BW7.1 BI4.0 BW4.0 BI5.0 BW5.0 BI6.0 BW6.0 BI7.0 BW7.0
    rank 1 | BW4.1 F7.1  BI5.1 BW5.1 BI6.1 BW6.1 BI7.1 BW7.1 BI4.0 BW4.0 BI5.0 BW5.0 BI6.0 BW6.0 BI7.0 BW7.0
    rank 2 | F6.1  BI5.1 BW5.1 F7.1  BI6.1 BW6.1 BI7.1 BW7.1 BI4.0 BW4.0 BI5.0 BW5.0 BI6.0 BW6.0 BI7.0 BW7.0
    rank 3 | BI5.1 BW5.1 F6.1  BI6.1 BW6.1 F7.1  BI7.1 BW7.1 BI4.0 BW4.0 BI5.0 BW5.0 BI6.0 BW6.0 BI7.0 BW7.0

p=4, m=8, v=2, g=1 (uniform repeating; block: forwards of stages 0..7 at slots 0 1 2 3 9 10 11 12,
BI at 28 26 24 22 19 17 15 13, interval 6):

    rank 0 | F0.0  F1.0  F0.1  F2.0  F1.1  F3.0  BI0.1 BW0.1 F2.1  F4.0  BI1.1 BW1.1 F3.1  BI0.0 BW0.0 F5.0
    rank 1 | F0.0  F1.0  F0.1  F2.0  F1.1  BI0.1 BW0.1 F3.0  F2.1  BI1.1 BW1.1 F4.0  BI0.0 BW0.0 F3.1  BI2.1
    rank 2 | F0.0  F1.0  F0.1  F2.0  BI0.1 BW0.1 F1.1  F3.0  BI1.1 BW1.1 F2.1  BI0.0 BW0.0 F4.0  BI2.1 BW2.1
    rank 3 | F0.0  F1.0  F0.1  BI0.1 BW0.1 F2.0  F1.1  BI1.1 BW1.1 F3.0  BI0.0 BW0.0 F2.1  BI2.1 BW2.1 F4.0

    rank 0 | BI2.1 BW2.1 F4.1  BI1.0 BW1.0 F6.0  BI3.1 BW3.1 F5.1  BI2.0 BW2.0 F7.0  BI4.1 BW4.1 F6.1  BI3.0
    rank 1 | BW2.1 F5.0  BI1.0 BW1.0 F4.1  BI3.1 BW3.1 F6.0  BI2.0 BW2.0 F5.1  BI4.1 BW4.1 F7.0  BI3.0 BW3.0
    rank 2 | F3.1  BI1.0 BW1.0 F5.0  BI3.1 BW3.1 F4.1  BI2.0 BW2.0 F6.0  BI4.1 BW4.1 F5.1  BI3.0 BW3.0 F7.0
    rank 3 | BI1.0 BW1.0 F3.1  BI3.1 BW3.1 F5.0  BI2.0 BW2.0 F4.1  BI4.1 BW4.1 F6.0  BI3.0 BW3.0 F5.1  BI5.1

    rank 0 | BW3.0 BI5.1 BW5.1 F7.1  BI4.0 BW4.0 BI6.1 BW6.1 BI5.0 BW5.0 BI7.1 BW7.1 BI6.0 BW6.0 BI7.0 BW7.0
    rank 1 | F6.1  BI5.1 BW5.1 BI4.0 BW4.0 F7.1  BI6.1 BW6.1 BI5.0 BW5.0 BI7.1 BW7.1 BI6.0 BW6.0 BI7.0 BW7.0
    rank 2 | BI5.1 BW5.1 F6.1  BI4.0 BW4.0 BI6.1 BW6.1 F7.1  BI5.0 BW5.0 BI7.1 BW7.1 BI6.0 BW6.0 BI7.0 BW7.0
    rank 3 | BW5.1 F7.0  BI4.0 BW4.0 F6.1  BI6.1 BW6.1 BI5.0 BW5.0 F7.1  BI7.1 BW7.1 BI6.0 BW6.0 BI7.0 BW7.0

Communication: a receive that must move earlier goes, where it can, into a batch of a peer that only
sends (`comm.HOIST_TO_SEND_ONLY_BATCHES`, as for looped-bfs). With GIS's shorter warm-up, the default
choice couples a rank's send with a receive its peer cannot yet serve and stalls every chunk-0
backward; over p ∈ {2, 3, 4, 8}, v ∈ {2..5}, g ∈ {1, ⌈p/2⌉, p} and m from p to 8p this choice is never
slower and shorter in 48 of 261 cases (p = 8, v = 5, m = 64 at F = BI = BW = 1: bubble 0.255 → 0.061;
interleaved 1F1B is 0.021 there, so GIS's rendezvous batches still cost more than the paper's
asynchronous sends).

Simulated with F = BI = BW = 1, GIS takes 54 time units and the uniform order and interleaved 1F1B 57; rank 0 holds 8 = p·v chunk stashes under
GIS, 7 under the uniform order and 11 under interleaved 1F1B.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_pp.schedules.comm import HOIST_TO_SEND_ONLY_BATCHES, insert_communication
from megatron_pp.schedules.generators import group_order, looped_placement
from megatron_pp.schedules.ir import Action, Op, Schedule, ScheduleError, positive_int


def _check_sizes(num_ranks: int, num_microbatches: int, num_chunks: int) -> None:
    positive_int("num_ranks", num_ranks)
    positive_int("num_microbatches", num_microbatches)
    positive_int("num_chunks", num_chunks)


def min_group_size(num_ranks: int) -> int:
    """Smallest group size of the group-interleaved order, ⌈p/2⌉ (g = 1 is the uniform order instead)."""
    return (num_ranks + 1) // 2


def check_group_size(num_ranks: int, group_size: object) -> int:
    """`group_size` if it is 1 or within ⌈p/2⌉..p, else a ValueError naming the flag and the valid values."""
    lo = min_group_size(num_ranks)
    if (not isinstance(group_size, int) or isinstance(group_size, bool)
            or not (group_size == 1 or lo <= group_size <= num_ranks)):
        raise ValueError(
            f"--interleave-group-size must be 1 (uniform repeating order, PO) or between ceil(p/2) = {lo} and "
            f"p = {num_ranks} (group-interleaved; {lo} is GIS-H, {num_ranks} is GIS), got {group_size!r}")
    return group_size


def gis_warmup(num_ranks: int, num_chunks: int, group_size: int, rank: int) -> int:
    """Warm-up chunk-forwards of `rank` in the group-interleaved order: g·(v−1) + p − rank − 1."""
    return group_size * (num_chunks - 1) + num_ranks - rank - 1


def gis(num_ranks: int, num_microbatches: int, num_chunks: int, group_size: int | None = None) -> Schedule:
    """GIS family: group-interleaved with group size g (default p), or the uniform repeating order for g=1.

    See the module docstring for both orders and their p=4, m=8 tables. Raises ValueError for a group
    size outside {1} ∪ [⌈p/2⌉, p], and for a last partial group that deadlocks (replayed, as for
    interleaved 1F1B; m a multiple of g or m ≤ g always builds).
    """
    _check_sizes(num_ranks, num_microbatches, num_chunks)
    p, m, v = num_ranks, num_microbatches, num_chunks
    g = check_group_size(p, p if group_size is None else group_size)
    if g == 1:
        return uniform_repeating(p, m, v)
    order = group_order(m, v, g)
    forwards = [[Action(Op.F, i, c)] for i, c in order]
    backwards = [[Action(Op.BI, i, v - 1 - c), Action(Op.BW, i, v - 1 - c)] for i, c in order]
    actions = []
    for r in range(p):
        warmup = min(gis_warmup(p, v, g, r), m * v)
        steady = m * v - warmup
        acts = [a for step in forwards[:warmup] for a in step]
        for k in range(steady):
            acts += forwards[warmup + k] + backwards[k]
        acts += [a for step in backwards[steady:] for a in step]
        actions.append(acts)
    schedule = Schedule("gis", p, m, v, looped_placement(p, v), actions,
                        {"interleave_group_size": g, HOIST_TO_SEND_ONLY_BATCHES: True})
    if v > 1 and m > g and m % g:
        # A short last group reaches its next chunk sooner than the warm-up assumes; some such orders
        # still complete, so replay instead of refusing them all.
        try:
            insert_communication(schedule)
        except ScheduleError as err:
            raise ValueError(
                f"gis with p={p}, m={m}, v={v}, group size {g} deadlocks: its last group holds {m % g} "
                f"microbatch(es); use m a multiple of {g} or m <= {g} ({err})") from None
    return schedule


@dataclass(frozen=True)
class BuildingBlock:
    """One microbatch of the uniform repeating order, in unit slots (F = BI = BW = 1).

    `forward[s]` and `backward[s]` are the slots of global stage s's F and BI (its BW is the next slot);
    microbatch j runs every action `j · interval` slots later.
    """

    interval: int
    forward: tuple[int, ...]
    backward: tuple[int, ...]


def building_block(num_ranks: int, num_chunks: int) -> BuildingBlock:
    """The uniform order's block: rank r owns slots ≡ r (F), r+1 (BI), r+2 (BW) mod 3, interval 3v.

    Forward of stage s follows stage s−1 one slot later and backward of s follows s+1 two slots later,
    except where the ring closes (rank p−1 to rank 0 forward, rank 0 to rank p−1 backward): there the
    next slot of the right phase is 1 to 3 slots on, unless 3 divides p. Where that slot is already taken
    modulo the interval by another chunk of the same rank, the action moves 3 slots on. p=4, v=2:
    forward 0 1 2 3 9 10 11 12 (chunk 1 of rank 0 needs a slot ≡ 0 mod 3 that is free mod 6: 6 is not),
    backward 28 26 24 22 19 17 15 13.
    """
    p, v = num_ranks, num_chunks
    stages, interval = p * v, 3 * v
    forward: list[int] = []
    taken_f: list[set[int]] = [set() for _ in range(p)]
    t = 0
    for s in range(stages):
        r = s % p
        t += (r - t) % 3  # the next slot of rank r's forward phase
        while t % interval in taken_f[r]:
            t += 3
        taken_f[r].add(t % interval)
        forward.append(t)
        t += 1
    backward = [0] * stages
    taken_b: list[set[int]] = [set() for _ in range(p)]
    t = forward[-1] + 1
    for s in reversed(range(stages)):
        r = s % p
        t += (r + 1 - t) % 3  # rank r's BI phase; its BW takes the slot after
        while t % interval in taken_b[r]:
            t += 3
        taken_b[r].add(t % interval)
        backward[s] = t
        t += 1
    return BuildingBlock(interval, tuple(forward), tuple(backward))


def uniform_repeating(num_ranks: int, num_microbatches: int, num_chunks: int) -> Schedule:
    """The g = 1 order: microbatch j runs the building block shifted by j·3v slots (see module docstring)."""
    _check_sizes(num_ranks, num_microbatches, num_chunks)
    p, m, v = num_ranks, num_microbatches, num_chunks
    block = building_block(p, v)
    timed: list[list[tuple[int, Action]]] = [[] for _ in range(p)]
    for j in range(m):
        shift = j * block.interval
        for s in range(p * v):
            r, c = s % p, s // p
            timed[r].append((shift + block.forward[s], Action(Op.F, j, c)))
            timed[r].append((shift + block.backward[s], Action(Op.BI, j, c)))
            timed[r].append((shift + block.backward[s] + 1, Action(Op.BW, j, c)))
    # Slots of one rank are distinct modulo the interval, so no two actions share a time: sorting is total.
    actions = [[a for _, a in sorted(row, key=lambda item: item[0])] for row in timed]
    return Schedule("gis", p, m, v, looped_placement(p, v), actions,
                    {"interleave_group_size": 1, HOIST_TO_SEND_ONLY_BATCHES: True})
