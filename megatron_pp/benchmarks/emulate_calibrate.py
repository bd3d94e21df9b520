"""The emulated executor's host costs, calibrated per pipeline size on a run of its own, for the simulator's
`CostModel.host_compute`, `host_post` and `p2p_latency` (`tools/trace_vs_sim.py --emulate`).

On this host the executor runs its list on the CPU that would, on a GPU, only post work ahead of the device's
stream: between two compute actions of a rank it polls its sends, posts the batch the list has there (gloo's
isend and irecv, one call each) and any receives it keeps posted ahead, and loops; a received input is in
some time after its sender posted it (gloo's copy, the receiver's wake-up). These are costs the executor
really pays here, and the simulator had none of them. They are read off a calibration run that is none of
the grid's rows: `1f1b` at m = 3p (the grid has 2p and 4p), equal costs, at the grid's unit (so the ranks
sleep as much as in the grid, and the host is loaded alike), `steps` measured steps after a warm-up.

- Gaps: per rank, from a compute action's end to the next one's call, against the number of sends and
  receives posted in that gap (`Emulator.posts`). host_post is the least-squares slope of the per-count
  median gaps (weighted by how many gaps have that count), host_compute its intercept (ours: a line through
  medians, so a preempted gap does not pull it).
- Latency: per received input whose consumer was called before its send was posted (so it was blocked in
  the wait when the data came), the time from the send's post being done (the sender's record, plus
  host_post) to the consumer's input being in; the median. That is the simulator's `p2p_latency`: data
  in at the send's post plus it. (A gloo receive reports itself complete only once waited for, so every
  consumer "waits" some microseconds: a consumer called after the send would measure its own lateness.)

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

import random
import statistics
from dataclasses import replace

from megatron_pp.benchmarks.emulate import consumed_messages, cost_model, family_schedule, worker_emulate
from megatron_pp.schedules.ir import Schedule
from megatron_pp.schedules.simulate import CostModel, MessageLatency, simulate

CALIBRATION_SCHEDULE = "1f1b"
CALIBRATION_STEPS = 3
CALIBRATION_MICROBATCHES = 3
"""m = 3p: none of the grid's rows (2p, 4p), mostly steady state."""
LATENCY_DRAWS = 16
"""Simulations per row with drawn latencies (`drawn_simulation`)."""


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


def latency_samples(schedule: Schedule, per_rank: list[dict], host_post: float) -> list[float]:
    """Per received input whose consumer was waiting before its send was posted: the send's post done to the
    consumer's input in."""
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
                    out.append(begin + waited - (sends[peer, rank][k] + host_post))
    return out


def calibrate(pool, pp: int, unit_s: float, steps: int) -> dict:
    """Run the calibration on `pool` (pp workers) and return its block for the JSON (times in ms)."""
    import os

    schedule = family_schedule(CALIBRATION_SCHEDULE, pp, CALIBRATION_MICROBATCHES * pp)
    load = os.getloadavg()
    runs = pool.run(worker_emulate, schedule, [cost_model("equal", unit_s)], steps + 1, timeout=900)
    return calibration_block(schedule, [[runs[r][0][k] for r in range(pp)] for k in range(1, steps + 1)],
                             unit_s, [load[0], os.getloadavg()[0]])


def calibration_block(schedule: Schedule, steps: list[list[dict]], unit_s: float, load: list[float]) -> dict:
    """The calibration's figures from its measured steps (each a list of the ranks' records)."""
    gaps = [s for step in steps for s in gap_samples(step)]
    host_compute, host_post, table = line_through_medians(gaps)
    hops = [h for step in steps for h in latency_samples(schedule, step, host_post)]
    overrun = [c[2] - c[1] - c[3] - c[5] for step in steps for r in step for c in r["compute"]]
    return {"schedule": schedule.name, "pp": schedule.num_ranks, "microbatches": schedule.num_microbatches,
            "costs": "equal", "unit_ms": 1e3 * unit_s, "steps_measured": len(steps),
            "host_compute_ms": 1e3 * host_compute, "host_post_ms": 1e3 * host_post,
            "p2p_latency_ms": 1e3 * statistics.median(hops) if hops else 0.0,
            "p2p_latency_mean_ms": 1e3 * statistics.fmean(hops) if hops else 0.0,
            "latency_ms_percentiles": [1e3 * x for x in percentiles(hops)] if len(hops) > 1 else [],
            "gaps": len(gaps), "gap_ms_by_posts": {str(n): [w, 1e3 * y] for n, (w, y) in table.items()},
            "latency_samples": len(hops),
            "latency_ms_quartiles": [1e3 * q for q in statistics.quantiles(hops, n=4)] if len(hops) > 1 else [],
            "overrun_ms": 1e3 * statistics.median(overrun), "load_average": load}


def with_host_costs(costs: CostModel, calibration: dict | None) -> CostModel:
    """`costs` with the calibration's host costs and latency (seconds); unchanged without a calibration."""
    if calibration is None:
        return costs
    return replace(costs, host_compute=calibration["host_compute_ms"] / 1e3,
                   host_post=calibration["host_post_ms"] / 1e3, p2p_latency=calibration["p2p_latency_ms"] / 1e3)


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
