"""The emulated executor's host costs, calibrated per pipeline size on a run of its own, for the simulator's
`CostModel.host_compute`, `host_post` and `p2p_latency` (`tools/trace_vs_sim.py --emulate`).

On this host the executor runs its list on the CPU that would, on a GPU, only post work ahead of the device's
stream: between two compute actions of a rank it polls its sends, posts the batch the list has there (gloo's
isend and irecv, one call each) and any receives it keeps posted ahead, and loops; a received input is in
some time after its sender posted it (gloo's copy, the receiver's wake-up). These are costs the executor
really pays here, and the simulator had none of them. They are read off calibration runs that are none of
the grid's rows: the list's own family at m = 3p (the grid has 2p and 4p) under the row's cost set, and
`1f1b` at m = 3p under equal costs as the grid's common one, at the grid's unit (so the ranks sleep as much
as in the grid, and the host is loaded alike), `steps` measured steps after a warm-up each.

- Gaps: per rank, from a compute action's end to the next one's call, against the number of sends and
  receives posted in that gap (`Emulator.posts`). host_post is the least-squares slope of the per-count
  median gaps (weighted by how many gaps have that count), host_compute its intercept (ours: a line through
  medians, so a preempted gap does not pull it).
- Latency: per received input whose consumer was called before its send was posted (so it was blocked in
  the wait when the data came), the time from the send's post being done (the sender's record, plus
  host_post) to the consumer's input being in; the median. That is the simulator's `p2p_latency`: data
  in at the send's post plus it. (A gloo receive reports itself complete only once waited for, so every
  consumer "waits" some microseconds: a consumer called after the send would measure its own lateness.)

Each list calibrated on its own run (ours, stated before the grids that use it were run): the host's latency
depends on the list's pattern of messages, not only on the host. With 16 ranks on 2 cores a message waits
for a core behind the other ranks' host work, and a list whose ranks end their compute actions together
(V-Half's and ZB-V's loops at equal costs, which leave no slack to spread them) makes that queue longer:
the waited latencies grow with the number of compute actions that ended, on any rank, in the
`RECENT_ENDS_WINDOW_S` before the send (`latency_ms_by_recent_ends` in each block), and V-Half's lists end
more of them together than 1F1B's ever do (docs/schedules.md has the blocks; a probe of the emulation's last
`SPIN_S` of a wait, spun, spun yielding the core or slept, left the latencies as they were). A calibration
on `1f1b` therefore charges other lists too little. So each (schedule, cost set) of a grid gets a
calibration of its own: the same list family at m = 3p (none of the grid's rows), under the same costs
(`list_calibration_key`: a list without a split backward has the same costs under both sets and is
calibrated once), and its rows are simulated with that block's host terms and latencies. The `1f1b` block
stays the grid's common calibration; each row keeps its simulation with it beside (`common_*`).

The simulated step a row's targets compare (`drawn_simulation`, the rule is ours, stated before the grids it
was applied to were run): each message's latency drawn at random from the calibration's waited-input
latencies (their percentiles, `latency_ms_percentiles`, linear between), independently per message, the
row's step and bubble the means over `LATENCY_DRAWS` simulations with seeds 0, 1, ... A step whose lists
leave no slack pays every hop it crosses as it comes, and on two near-critical paths the later of the two:
one constant latency (the median, kept beside it as `p2p_latency_ms`) gives neither the mean nor that
maximum (`emulate_replay`: with each message's measured latency the simulation lands on the measured step).

Nothing here reads a grid row's step time. Late wake-ups (an action outlasting its cost by the scheduler's
latency, median `overrun_ms`) are the emulation's sleeps, not the executor's work: recorded, not charged.
"""
from __future__ import annotations

import bisect
import random
import statistics
from dataclasses import replace

from megatron_pp.benchmarks.emulate import consumed_messages, cost_model, family_schedule, worker_emulate
from megatron_pp.schedules.ir import Op, Schedule
from megatron_pp.schedules.simulate import CostModel, MessageLatency, simulate

CALIBRATION_SCHEDULE = "1f1b"
"""The grid's common calibration (every row keeps its simulation with it beside its own list's)."""
CALIBRATION_STEPS = 3
CALIBRATION_MICROBATCHES = 3
"""m = 3p: none of the grid's rows (2p, 4p), mostly steady state."""
LATENCY_DRAWS = 16
"""Simulations per row with drawn latencies (`drawn_simulation`)."""
RECENT_ENDS_WINDOW_S = 4e-3
"""How far before a send's post the compute actions that ended are counted (`recent_ends`): about the
longest queue of host work seen on 2 cores at p = 16 (16 ranks of a few tenths of a millisecond each)."""


def gap_samples(per_rank: list[dict]) -> list[tuple[int, float]]:
    """(posts in the gap, gap seconds) for every two consecutive compute actions of every rank of one step."""
    out = []
    for record in per_rank:
        times = sorted(when for _, _, when in record["posts"])
        for before, after in zip(record["compute"], record["compute"][1:]):
            end, begin = before[2], after[1]
            out.append((sum(end <= t <= begin for t in times), begin - end))
    return out


def line_through_medians(samples: list[tuple[int, float]]) -> tuple[float, float, dict]:
    """(intercept, slope, {count: [gaps, median]}): the weighted least-squares line through the median gap of
    each post count. One count only: slope 0, the median. Worked: counts 1, 1, 1, 3, 3 with gaps 0.2, 0.3,
    0.3, 0.7, 0.7 have medians 0.3 (3 gaps) and 0.7 (2): slope (0.7 - 0.3) / 2 = 0.2, intercept 0.1."""
    groups: dict[int, list[float]] = {}
    for n, gap in samples:
        groups.setdefault(n, []).append(gap)
    table = {n: [len(g), statistics.median(g)] for n, g in sorted(groups.items())}
    weight = sum(w for w, _ in table.values())
    mean_n = sum(n * w for n, (w, _) in table.items()) / weight
    mean_y = sum(y * w for _, (w, y) in table.items()) / weight
    spread = sum(w * (n - mean_n) ** 2 for n, (w, _) in table.items())
    slope = sum(w * (n - mean_n) * (y - mean_y) for n, (w, y) in table.items()) / spread if spread else 0.0
    slope = max(slope, 0.0)
    return max(mean_y - slope * mean_n, 0.0), slope, table


def waited_inputs(schedule: Schedule, per_rank: list[dict], host_post: float) -> list[tuple[float, float]]:
    """(when the send was posted, latency) per received input whose consumer was waiting before its send was
    posted; the latency runs from the send's post done (its post plus `host_post`) to the consumer's input
    in."""
    sends: dict = {}
    for rank, record in enumerate(per_rank):
        for kind, peer, when in record["posts"]:
            if kind == "send":
                sends.setdefault((rank, peer), []).append(when)
    out = []
    for rank, record in enumerate(per_rank):
        inputs = consumed_messages(schedule, rank)
        for label, begin, _, waited, *_ in record["compute"]:
            for peer, k in inputs.get(label, ()):
                if k < len(sends.get((peer, rank), ())) and begin <= sends[peer, rank][k]:
                    posted = sends[peer, rank][k]
                    out.append((posted, begin + waited - (posted + host_post)))
    return out


def latency_samples(schedule: Schedule, per_rank: list[dict], host_post: float) -> list[float]:
    """Per received input whose consumer was waiting before its send was posted: the send's post done to the
    consumer's input in."""
    return [latency for _, latency in waited_inputs(schedule, per_rank, host_post)]


def recent_ends(schedule: Schedule, per_rank: list[dict], host_post: float) -> list[tuple[int, float]]:
    """(compute actions of any rank that ended in the `RECENT_ENDS_WINDOW_S` up to the send's post, latency) per
    waited input (`waited_inputs`): how crowded the host was when the message left. Worked: ends at 0.0, 1.0
    and 5.0 ms and a send posted at 5.0 ms count 2 (1.0 and 5.0; 0.0 is more than 4 ms before)."""
    ends = sorted(c[2] for record in per_rank for c in record["compute"])
    return [(bisect.bisect_right(ends, posted) - bisect.bisect_left(ends, posted - RECENT_ENDS_WINDOW_S), latency)
            for posted, latency in waited_inputs(schedule, per_rank, host_post)]


def list_calibration_key(name: str, schedule: Schedule, kind: str) -> str:
    """'family/costs' of the calibration a grid row of family `name` under cost set `kind` is simulated with:
    a list without a split backward (no BI or BW) has the same costs under both sets, so 'equal' for it."""
    splits = any(a.op in (Op.BI, Op.BW) for actions in schedule.actions for a in actions)
    return f"{name}/{kind if splits else 'equal'}"


def calibrate(pool, pp: int, unit_s: float, steps: int, name: str = CALIBRATION_SCHEDULE, kind: str = "equal") -> dict:
    """Run the calibration of family `name` under cost set `kind` (m = 3p, a forward of a rank's share taking
    `unit_s`, as in the grid) on `pool` (pp workers) and return its block for the JSON (times in ms)."""
    import os

    schedule = family_schedule(name, pp, CALIBRATION_MICROBATCHES * pp)
    load = os.getloadavg()
    runs = pool.run(worker_emulate, schedule, [cost_model(kind, unit_s / schedule.num_chunks)], steps + 1,
                    timeout=900)
    return calibration_block(schedule, [[runs[r][0][k] for r in range(pp)] for k in range(1, steps + 1)],
                             unit_s, [load[0], os.getloadavg()[0]], kind)


def calibration_block(schedule: Schedule, steps: list[list[dict]], unit_s: float, load: list[float],
                      kind: str = "equal") -> dict:
    """The calibration's figures from its measured steps (each a list of the ranks' records)."""
    gaps = [s for step in steps for s in gap_samples(step)]
    host_compute, host_post, table = line_through_medians(gaps)
    crowded = [x for step in steps for x in recent_ends(schedule, step, host_post)]
    hops = [h for _, h in crowded]
    by_ends: dict[int, list[float]] = {}
    for n, h in crowded:
        by_ends.setdefault(n, []).append(h)
    overrun = [c[2] - c[1] - c[3] - c[5] for step in steps for r in step for c in r["compute"]]
    return {"schedule": schedule.name, "pp": schedule.num_ranks, "microbatches": schedule.num_microbatches,
            "costs": kind, "unit_ms": 1e3 * unit_s, "steps_measured": len(steps),
            "host_compute_ms": 1e3 * host_compute, "host_post_ms": 1e3 * host_post,
            "p2p_latency_ms": 1e3 * statistics.median(hops) if hops else 0.0,
            "p2p_latency_mean_ms": 1e3 * statistics.fmean(hops) if hops else 0.0,
            "latency_ms_percentiles": [1e3 * x for x in percentiles(hops)] if len(hops) > 1 else [],
            "gaps": len(gaps), "gap_ms_by_posts": {str(n): [w, 1e3 * y] for n, (w, y) in table.items()},
            "latency_samples": len(hops),
            "latency_ms_quartiles": [1e3 * q for q in statistics.quantiles(hops, n=4)] if len(hops) > 1 else [],
            "latency_ms_by_recent_ends": {str(n): [len(h), 1e3 * statistics.median(h)] for n, h in sorted(by_ends.items())},
            "overrun_ms": 1e3 * statistics.median(overrun),
            "overrun_ms_p90": 1e3 * statistics.quantiles(overrun, n=10)[-1] if len(overrun) > 1 else 0.0,
            "load_average": load}


def with_host_costs(costs: CostModel, calibration: dict | None) -> CostModel:
    """`costs` with the calibration's host costs and latency (seconds); unchanged without a calibration. A
    median latency below 0 (where a core per rank delivers a message faster than `host_post`, the estimate of
    when its send was done: at p = 2) is timing noise and taken as 0, as every drawn latency is."""
    if calibration is None:
        return costs
    return replace(costs, host_compute=calibration["host_compute_ms"] / 1e3,
                   host_post=calibration["host_post_ms"] / 1e3,
                   p2p_latency=max(0.0, calibration["p2p_latency_ms"] / 1e3))


def percentiles(samples: list[float]) -> list[float]:
    """101 points: the least sample, the 1st to 99th percentiles (linear between order statistics), the largest."""
    ordered = sorted(samples)
    return [ordered[0], *statistics.quantiles(ordered, n=100, method="inclusive"), ordered[-1]]


def latency_draw(percentiles_ms: list[float], seed: int) -> MessageLatency:
    """A latency per message (seconds), each drawn independently: a uniform u in [0, 100) read off the 101
    percentile points, linear between them, and never below 0."""
    rng = random.Random(seed)
    table = [x / 1e3 for x in percentiles_ms]

    def draw(sender: int, receiver: int, k: int) -> float:
        u = rng.random() * (len(table) - 1)
        i = int(u)
        return max(0.0, table[i] + (u - i) * (table[i + 1] - table[i]))  # a sample below 0 is timing noise
    return draw


def drawn_simulation(schedule: Schedule, costs: CostModel, calibration: dict,
                     draws: int = LATENCY_DRAWS) -> tuple[float, float]:
    """(mean makespan, mean bubble) of `draws` simulations of `schedule` under `costs` with the calibration's
    host terms and each message's latency drawn from its percentiles (module docstring), seeds 0 to draws - 1."""
    model = with_host_costs(costs, calibration)
    runs = [simulate(schedule, model, latencies=latency_draw(calibration["latency_ms_percentiles"], seed))
            for seed in range(draws)]
    return statistics.fmean(r.makespan for r in runs), statistics.fmean(r.bubble_fraction for r in runs)
