"""Single-chunk zero-bubble schedules ZB-H1 and ZB-H2 (Qi et al., "Zero Bubble Pipeline Parallelism",
arXiv 2401.10241, §2.1 and §2.2): stage r on rank r, every backward split into BI (input gradient, sent
upstream at once) and BW (weight gradient), and BW moved to where the pipeline would otherwise idle.

* **`zb_h1`.** Rank r runs 1F1B's min(p−r−1, m) warm-up forwards, then F/BI pairs, then the remaining
  BIs, and every BW trails its BI by r backwards (rank 0 runs each BW right after its BI, the last rank
  p − 1 BIs later), the leftover BWs closing the list. BIs therefore travel upstream without waiting for weight
  gradients, and the deferred BWs fill the cool-down. Every rank keeps the same number of microbatches
  in flight as 1F1B's rank 0: a stash counts from its F until its BW ends (as the simulator and the
  executor count it), so each rank peaks at min(p, m) stashes, 1F1B's rank-0 peak, where 1F1B's rank r
  holds p − r. The paper counts what BW still needs as smaller than a whole stash, which is how its
  first worker stays at 1F1B's peak; we count the whole stash, so the later ranks' extra in-flight
  microbatches show.
* **`zb_h2`.** More warm-up forwards (2(p−r−1) + 1 on rank r) fill the wait for the first gradient,
  and the BWs left at the end fill the tail, so that for m ≥ 2p − 1 each rank works without a gap from
  its first F to its last BW: rank r runs from r·T_F to r·T_F + m·(T_F + T_B + T_W) at unit costs (the
  paper's parallelogram). The order is read off a replay in unit slots (T_F = T_B = T_W = 1) where in
  each slot each rank runs, by priority: its next BI if the gradient is in; its next F if the
  activation is in and fewer than 2p − 1 stashes are live; its oldest waiting BW. Every rank peaks at
  min(2p − 1, m) stashes, the paper's (2p − 1)·M_B: under 2 × 1F1B's rank-0 peak.

Bubble of one flushed step, per rank (idle time; the makespan is m·(T_F + T_B + T_W) plus it; T_B is
BI's time; **ours**, derived from the lists and pinned by tests/schedules/test_zero_bubble.py for
p ∈ {2, 3, 4, 8}, m ∈ {p, p + 1, 2p, 3p − 1} and eight cost ratios):

    1f1b    (p−1)·(T_F + T_B + T_W)
    zb-h1   (p−1)·max(T_F, T_F + T_B − T_W)            the paper's (p−1)(T_F + T_B − T_W) when T_W ≤ T_B
    zb-h2   between (p−1)·T_F and (p−1)·max(T_F, T_B, T_F + T_B − T_W); (p−1)·T_F, the fill that no
            flushed step avoids, when T_B ≤ min(T_F, T_W) (unit costs included)

zb-h2 is zero-bubble in the paper's sense: its only idle time is the fill and drain triangles at the
two ends of the step, which the paper removes by letting the next step start before this step's
optimizer step is validated (its optimizer post-validation). Steps here are flushed (the optimizer step
waits for every gradient), so the triangles stay, and at T_F = T_B = T_W zb-h2 takes as long as zb-h1,
whose idle time is instead the first ranks' wait for their first gradient, inside the step; zb-h2 gains
in one step where T_B > T_W, and would gain all of zb-h1's bubble once steps overlap.

p=4, m=8, zb-h1:

    rank 0 | F0.0  F1.0  F2.0  F3.0  BI0.0 BW0.0 F4.0  BI1.0 BW1.0 F5.0  BI2.0 BW2.0 F6.0  BI3.0 BW3.0 F7.0
    rank 1 | F0.0  F1.0  F2.0  BI0.0 F3.0  BI1.0 BW0.0 F4.0  BI2.0 BW1.0 F5.0  BI3.0 BW2.0 F6.0  BI4.0 BW3.0
    rank 2 | F0.0  F1.0  BI0.0 F2.0  BI1.0 F3.0  BI2.0 BW0.0 F4.0  BI3.0 BW1.0 F5.0  BI4.0 BW2.0 F6.0  BI5.0
    rank 3 | F0.0  BI0.0 F1.0  BI1.0 F2.0  BI2.0 F3.0  BI3.0 BW0.0 F4.0  BI4.0 BW1.0 F5.0  BI5.0 BW2.0 F6.0

    rank 0 | BI4.0 BW4.0 BI5.0 BW5.0 BI6.0 BW6.0 BI7.0 BW7.0
    rank 1 | F7.0  BI5.0 BW4.0 BI6.0 BW5.0 BI7.0 BW6.0 BW7.0
    rank 2 | BW3.0 F7.0  BI6.0 BW4.0 BI7.0 BW5.0 BW6.0 BW7.0
    rank 3 | BI6.0 BW3.0 F7.0  BI7.0 BW4.0 BW5.0 BW6.0 BW7.0

p=4, m=8, zb-h2:

    rank 0 | F0.0  F1.0  F2.0  F3.0  F4.0  F5.0  F6.0  BI0.0 BW0.0 BI1.0 F7.0  BI2.0 BW1.0 BI3.0 BW2.0 BI4.0
    rank 1 | F0.0  F1.0  F2.0  F3.0  F4.0  BI0.0 F5.0  BI1.0 F6.0  BI2.0 BW0.0 BI3.0 F7.0  BI4.0 BW1.0 BI5.0
    rank 2 | F0.0  F1.0  F2.0  BI0.0 F3.0  BI1.0 F4.0  BI2.0 F5.0  BI3.0 F6.0  BI4.0 BW0.0 BI5.0 F7.0  BI6.0
    rank 3 | F0.0  BI0.0 F1.0  BI1.0 F2.0  BI2.0 F3.0  BI3.0 F4.0  BI4.0 F5.0  BI5.0 F6.0  BI6.0 BW0.0 F7.0

    rank 0 | BW3.0 BI5.0 BW4.0 BI6.0 BW5.0 BW6.0 BI7.0 BW7.0
    rank 1 | BW2.0 BI6.0 BW3.0 BW4.0 BI7.0 BW5.0 BW6.0 BW7.0
    rank 2 | BW1.0 BW2.0 BI7.0 BW3.0 BW4.0 BW5.0 BW6.0 BW7.0
    rank 3 | BI7.0 BW1.0 BW2.0 BW3.0 BW4.0 BW5.0 BW6.0 BW7.0

Simulated at T_F = T_B = T_W = 1 (1F1B's B = 2), p=4, m=8: 1f1b takes 33 time units (bubble 0.273),
zb-h1 and zb-h2 27 (0.111); peaks 4 3 2 1 (1f1b), 4 4 4 4 (zb-h1), 7 7 7 7 (zb-h2). At T_F = 1,
T_B = 1.5, T_W = 1 (B = 2.5): 38.5, 32.5 and 31 (zb-h2 at its floor (p−1)·T_F here).
"""
from __future__ import annotations

from megatron_pp.schedules.generators import looped_placement
from megatron_pp.schedules.ir import Action, Op, Schedule, positive_int


def _check_sizes(num_ranks: int, num_microbatches: int) -> None:
    positive_int("num_ranks", num_ranks)
    positive_int("num_microbatches", num_microbatches)


def _single_chunk(name: str, num_ranks: int, num_microbatches: int, actions: list[list[Action]]) -> Schedule:
    return Schedule(name, num_ranks, num_microbatches, 1, looped_placement(num_ranks, 1), actions, {})


def _compute_actions(num_microbatches: int) -> dict[Op, list[Action]]:
    """F, BI and BW of every microbatch on chunk 0, built once and shared by all ranks' lists (actions
    are immutable, and building ~10^5 of them per rank dominates at p = 32, m = 1024)."""
    return {op: [Action(op, i, 0) for i in range(num_microbatches)] for op in (Op.F, Op.BI, Op.BW)}


def h1_order(num_ranks: int, num_microbatches: int, rank: int, actions: dict[Op, list[Action]]) -> list[Action]:
    """ZB-H1's list for `rank`: 1F1B's warm-up and F/BI pairs, each BW `rank` backwards after its BI;
    `actions` from `_compute_actions`, shared by all ranks."""
    p, m, r = num_ranks, num_microbatches, rank
    F, BI, BW = actions[Op.F], actions[Op.BI], actions[Op.BW]
    warmup = min(p - r - 1, m)
    acts = F[:warmup]
    done_bi = done_bw = 0

    def backward() -> None:
        nonlocal done_bi, done_bw
        acts.append(BI[done_bi])
        done_bi += 1
        if done_bi - done_bw > r:
            acts.append(BW[done_bw])
            done_bw += 1

    for i in range(warmup, m):
        acts.append(F[i])
        backward()
    while done_bi < m:
        backward()
    return acts + BW[done_bw:]


def zb_h1(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H1: 1F1B's warm-up and its rank-0 peak on every rank, BW trailing BI by r on rank r (module
    docstring). Any m ≥ 1: with m < p the warm-up is all m forwards, as in 1F1B."""
    _check_sizes(num_ranks, num_microbatches)
    actions = _compute_actions(num_microbatches)
    return _single_chunk("zb-h1", num_ranks, num_microbatches,
                         [h1_order(num_ranks, num_microbatches, r, actions) for r in range(num_ranks)])


def h2_orders(num_ranks: int, num_microbatches: int) -> list[list[Action]]:
    """ZB-H2's lists, read off the unit-slot replay of the module docstring."""
    p, m = num_ranks, num_microbatches
    # f_done[r][i]: F(i) of rank r has run. Every rank decides on the state at the start of the slot and the
    # picks are applied after, so whatever is done is done by the end of an earlier slot: no times are needed.
    f_done = [[False] * m for _ in range(p)]
    bi_done = [[False] * m for _ in range(p)]
    nf, nbi, nbw = [0] * p, [0] * p, [0] * p
    acts: list[list[Action]] = [[] for _ in range(p)]
    shared = _compute_actions(m)
    while any(n < m for n in nbw):
        picks = []
        for r in range(p):
            i = nbi[r]
            bi_ready = i < nf[r] and f_done[r][i] and (r == p - 1 or bi_done[r + 1][i])
            f_ready = nf[r] < m and (r == 0 or f_done[r - 1][nf[r]])
            f_ready = f_ready and nf[r] - nbw[r] < 2 * p - 1
            if bi_ready:
                picks.append(Op.BI)
            elif f_ready:
                picks.append(Op.F)
            elif nbi[r] > nbw[r]:
                picks.append(Op.BW)
            else:
                picks.append(None)
        # Decide every rank on the same state, then apply: a slot's results are visible from the next slot.
        for r, op in enumerate(picks):
            if op is Op.F:
                acts[r].append(shared[Op.F][nf[r]])
                f_done[r][nf[r]] = True
                nf[r] += 1
            elif op is Op.BI:
                acts[r].append(shared[Op.BI][nbi[r]])
                bi_done[r][nbi[r]] = True
                nbi[r] += 1
            elif op is Op.BW:
                acts[r].append(shared[Op.BW][nbw[r]])
                nbw[r] += 1
    return acts


def zb_h2(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H2: a longer warm-up and BWs filling the tail, every rank peaking at min(2p − 1, m) stashes
    (module docstring). Any m ≥ 1; for m < 2p − 1 the warm-up cannot cover the first gradient's round
    trip and the first ranks wait for it, as in zb-h1."""
    _check_sizes(num_ranks, num_microbatches)
    return _single_chunk("zb-h2", num_ranks, num_microbatches, h2_orders(num_ranks, num_microbatches))
