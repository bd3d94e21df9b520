"""Replay of one emulated step in the simulator with its measured transfers: is a row's excess over the
calibrated simulation the executor's (a stall the lists do not have) or the transfers' spread?

The simulation with one latency charges every point-to-point message the calibration run's median
(`emulate_calibrate`; the grids' rows now draw one per message from its percentiles). Here each message gets the latency it was measured to take in one emulated
step instead: from when its sender posted it (the sender's post record, plus `host_post` for each send
of its batch up to it, as `simulate` lets sends leave) to when its consumer's input was in (the consumer's
call plus its wait: `Emulator.compute`), never below 0. Where the consumer was called after the data was
in, that is an upper bound which cannot delay the replayed consumer beyond its measured call. Everything
else stays the calibrated simulation's: the costs, `host_compute`, `host_post`. Optionally each compute
action also keeps its measured overrun (its end beyond its start, waits and cost: a late wake-up), as
`simulate` takes it through a per-action duration.

`tools/trace_vs_sim.py --emulate --replay` runs each (schedule, m, costs) of its grid once (`steps` measured
steps after a warm-up, after the grid's calibration) and writes these rows (`run_replay`).

If the replay lands on the measured step, the executor added nothing the measured transfers and overruns
do not account for; the part of the excess the replay recovers is theirs (the rest, either sign, is not).
"""
from __future__ import annotations

import statistics

from megatron_pp.benchmarks.emulate import consumed_messages
from megatron_pp.schedules.ir import Schedule
from megatron_pp.schedules.simulate import CostModel, SimResult, simulate


def send_leave_times(per_rank: list[dict], host_post: float) -> dict[tuple[int, int], list[float]]:
    """(sender, receiver) -> when each message on that link left, in order: its batch's post time plus
    `host_post` per send of the batch up to and including it (sends are posted first, as `simulate` has it).
    A batch is the posts a rank recorded at one instant (`Emulator._record_posts`)."""
    out: dict[tuple[int, int], list[float]] = {}
    for rank, record in enumerate(per_rank):
        batch_at, index = None, 0
        for kind, peer, when in record["posts"]:
            if kind != "send":
                continue
            index = index + 1 if when == batch_at else 1
            batch_at = when
            out.setdefault((rank, peer), []).append(when + index * host_post)
    return out


def measured_latencies(schedule: Schedule, per_rank: list[dict], host_post: float) -> dict[tuple[int, int, int], float]:
    """(sender, receiver, k) -> the k-th message's measured latency on that link (module docstring)."""
    left = send_leave_times(per_rank, host_post)
    out = {}
    for rank, record in enumerate(per_rank):
        inputs = consumed_messages(schedule, rank)
        for label, begin, _, waited, *_ in record["compute"]:
            for peer, k in inputs.get(label, ()):
                out[peer, rank, k] = max(0.0, begin + waited - left[peer, rank][k])
    return out


def measured_overruns(per_rank: list[dict]) -> dict[tuple[int, str], float]:
    """(rank, compute label) -> how long the action outlasted its start, waits and cost (>= 0)."""
    return {(rank, c[0]): max(0.0, c[2] - c[1] - c[3] - c[5]) for rank, r in enumerate(per_rank) for c in r["compute"]}


def replay(schedule: Schedule, costs: CostModel, per_rank: list[dict], overruns: bool = False) -> SimResult:
    """`simulate(schedule, costs)` with each message's measured latency (and, with `overruns`, each compute
    action's measured overrun added to its duration). `costs` carries the calibrated host terms."""
    latency = measured_latencies(schedule, per_rank, costs.host_post)
    extra = measured_overruns(per_rank) if overruns else None
    return simulate(schedule, costs, latencies=lambda s, r, k: latency[s, r, k], extra=extra)


def replay_row(schedule: Schedule, costs: CostModel, steps: list[list[dict]], calibration: dict) -> dict:
    """One row of the replay table from a row's measured steps (after the warm-up): the measured step and
    bubble, the simulations with the calibration's median latency and with drawn latencies (once, not per
    step), the replays' (measured latencies; and overruns too), the waited latencies' median and mean beside
    the calibration's median (ms), the gaps per post count. Medians over the steps."""
    from megatron_pp.benchmarks.emulate_calibrate import drawn_simulation, with_host_costs
    from megatron_pp.benchmarks.emulate_measure import measure

    model = with_host_costs(costs, calibration)
    simulated = simulate(schedule, model)
    drawn = drawn_simulation(schedule, costs, calibration) if calibration.get("latency_ms_percentiles") else None
    per_step = []
    for step in steps:
        measured, plain, slow = measure(step), replay(schedule, model, step), replay(schedule, model, step, True)
        waited = waited_latencies(schedule, step, model.host_post)
        per_step.append({"measured": measured["step_s"], "measured_bubble": measured["bubble"],
                         "replayed": plain.makespan, "replayed_bubble": plain.bubble_fraction,
                         "replayed_overruns": slow.makespan, "replayed_overruns_bubble": slow.bubble_fraction,
                         "waited_median": statistics.median(waited), "waited_mean": statistics.fmean(waited)})
    med = {key: statistics.median(s[key] for s in per_step) for key in per_step[0]}
    return {"pp": schedule.num_ranks, "schedule": schedule.name, "microbatches": schedule.num_microbatches,
            "measured_step_s": med["measured"], "median_latency_step_s": simulated.makespan,
            "replayed_step_s": med["replayed"], "replayed_with_overruns_step_s": med["replayed_overruns"],
            "median_latency_error": med["measured"] / simulated.makespan - 1,
            "replayed_error": med["measured"] / med["replayed"] - 1,
            "replayed_with_overruns_error": med["measured"] / med["replayed_overruns"] - 1,
            "measured_bubble": med["measured_bubble"], "median_latency_bubble": simulated.bubble_fraction,
            "replayed_bubble": med["replayed_bubble"], "replayed_with_overruns_bubble": med["replayed_overruns_bubble"],
            "drawn_latency_step_s": drawn and drawn[0], "drawn_latency_bubble": drawn and drawn[1],
            "drawn_latency_error": drawn and med["measured"] / drawn[0] - 1,
            "gap_ms_by_posts": gap_table(steps, model),
            "calibrated_latency_ms": calibration["p2p_latency_ms"],
            "waited_latency_median_ms": 1e3 * med["waited_median"], "waited_latency_mean_ms": 1e3 * med["waited_mean"],
            "steps": per_step}


def gap_table(steps: list[list[dict]], model: CostModel) -> dict[str, list[float]]:
    """Per number of posts in a gap between two compute actions of a rank: [gaps, their median ms, what the
    calibrated simulation charges, host_compute + n * host_post, in ms], over the measured steps."""
    from megatron_pp.benchmarks.emulate_calibrate import gap_samples

    groups: dict[int, list[float]] = {}
    for step in steps:
        for n, gap in gap_samples(step):
            groups.setdefault(n, []).append(gap)
    return {str(n): [len(g), 1e3 * statistics.median(g), 1e3 * (model.host_compute + n * model.host_post)]
            for n, g in sorted(groups.items())}


def waited_latencies(schedule: Schedule, per_rank: list[dict], host_post: float) -> list[float]:
    """The measured latencies of the messages whose consumer was called before the message left (it waited for
    them: the calibration's kind of sample); the others' are upper bounds."""
    left = send_leave_times(per_rank, host_post)
    out = []
    for rank, record in enumerate(per_rank):
        inputs = consumed_messages(schedule, rank)
        for label, begin, _, waited, *_ in record["compute"]:
            out += [begin + waited - left[peer, rank][k] for peer, k in inputs.get(label, ())
                    if begin <= left[peer, rank][k]]
    return out or [0.0]


def run_replay(args, plan, argv: list[str]) -> int:
    """`tools/trace_vs_sim.py --emulate --replay`: per pipeline size of `plan` (`emulate_report.plan_emulation`)
    the calibration, then every (schedule, m, costs) run once and replayed (`replay_row`); JSON to --json."""
    import os
    import time

    import torch

    from megatron_pp.benchmarks.emulate import cost_model, family_schedule, worker_emulate
    from megatron_pp.benchmarks.emulate_calibrate import CALIBRATION_STEPS, calibrate
    from megatron_pp.benchmarks.emulate_report import report_header, report_load
    from megatron_pp.cli import write_json
    from megatron_pp.core.local_world import WorkerPool

    unit, load_start, started, rows, calibration = args.unit_ms / 1e3, os.getloadavg(), time.time(), [], {}
    for pp, counts in plan.grid:
        pool = WorkerPool(pp)
        try:
            block = calibration[str(pp)] = calibrate(pool, pp, unit, CALIBRATION_STEPS)
            for m in counts:
                for name in plan.names:
                    schedule = family_schedule(name, pp, m)
                    models = [cost_model(kind, unit / schedule.num_chunks) for kind in plan.costs]
                    runs = pool.run(worker_emulate, schedule, models, args.steps + 1, timeout=900)
                    for c, (kind, model) in enumerate(zip(plan.costs, models)):
                        steps = [[runs[r][c][k] for r in range(pp)] for k in range(1, args.steps + 1)]
                        row = {"costs": kind, **replay_row(schedule, model, steps, block),
                               "load_average": os.getloadavg()[0]}
                        rows.append(row)
                        print(f"{name:>17} p={pp:<2} m={m:<3} {kind}: measured {row['measured_step_s']:.3f} s, "
                              f"median latency {row['median_latency_step_s']:.3f} "
                              f"({100 * row['median_latency_error']:+.1f}%), replayed {row['replayed_step_s']:.3f} "
                              f"({100 * row['replayed_error']:+.1f}%)", flush=True)
        finally:
            pool.close()
    if args.json:
        write_json(args.json, {
            **report_header(args, argv, torch.__version__),
            "calibration": calibration,
            "definitions": "per row, medians over the measured steps of one run: measured_step_s (as the grids), "
                           "median_latency_step_s (simulated with the calibration's host costs and its median "
                           "latency for every message), drawn_latency_step_s (the same with latencies drawn from "
                           "the calibration's percentiles, the mean of emulate_calibrate.LATENCY_DRAWS), "
                           "replayed_step_s (the same with each message's latency as measured in that step), "
                           "replayed_with_overruns_step_s (and each compute action's measured overrun); *_error: "
                           "measured / simulated - 1",
            **report_load(load_start, started), "rows": rows})
    return 0
