"""Emulated compute, the parent's side: a step's time and bubble read from the ranks' records of
`megatron_pp/benchmarks/emulate.py` (`measure`), the measured step taken apart along its critical path
(`critical_path`), and the grid of rows against the simulator (`run_grid`, `compare`) that
`tools/trace_vs_sim.py --emulate` writes. Records and times are `emulate.py`'s (the host's monotonic clock)."""
from __future__ import annotations

import statistics

from megatron_pp.benchmarks.emulate import cost_model, family_schedule, worker_emulate
from megatron_pp.schedules.ir import Op, Schedule
from megatron_pp.schedules.simulate import CostModel, simulate


def step_window(per_rank: list[dict]) -> tuple[float, float]:
    """(start, end) of one step on the shared clock: from the first compute action's start (the simulator's
    time 0; ranks leave the barrier before it some milliseconds apart) to the last action's end."""
    start = min(r["compute"][0][1] for r in per_rank)
    end = max([r["started"] + e for r in per_rank for _, _, e in r["events"]]
              + [c[2] for r in per_rank for c in r["copies"]])
    return start, end


def measure(per_rank: list[dict]) -> dict:
    """Step time, bubble (mean over ranks of (window - busy) / window, busy = the rank's compute net of its
    waits, as `simulate` defines it), the tiny model's share of busy time, and where a measured step can
    exceed the simulated one: actions outlasting their cost (`overrun_s`, a late wake-up or own work beyond
    the cost), the executor's work between compute actions (`gap_s`: posting, the loop), medians in seconds;
    each action's slack (its cost less its own work: median and least) and the actions whose own work
    exceeded their cost (`overran`, with up to five labels)."""
    start, end = step_window(per_rank)
    window = end - start
    busy = [sum(c[2] - c[1] - c[3] for c in r["compute"]) for r in per_rank]
    own = sum(c[4] for r in per_rank for c in r["compute"])
    overrun = [c[2] - c[1] - c[3] - c[5] for r in per_rank for c in r["compute"]]
    gaps = [b[1] - a[2] for r in per_rank for a, b in zip(r["compute"], r["compute"][1:])]
    slack = [(c[6], f"rank {rank} {c[0]}") for rank, r in enumerate(per_rank) for c in r["compute"] if len(c) > 6]
    late = sorted(x for x in slack if x[0] < 0)
    return {"step_s": window, "bubble": sum((window - b) / window for b in busy) / len(busy),
            "model_share": own / sum(busy), "busy_s": busy, "overrun_s": statistics.median(overrun),
            "gap_s": statistics.median(gaps) if gaps else 0.0,
            "slack_s": statistics.median(x for x, _ in slack) if slack else None,
            "least_slack_s": min(x for x, _ in slack) if slack else None,
            "actions": len(overrun), "overran": len(late), "overran_actions": [label for _, label in late[:5]]}


def _producers(schedule: Schedule) -> dict:
    """(rank, consumer label) -> (peer, producer label) for every received input: the k-th receive of a link
    is the k-th send on it; a send's producer is the last compute action before it of its (microbatch,
    chunk) and kind (F for SEND_F, B or BI for SEND_B), a receive's consumer the next one after it."""
    forward, backward = {Op.F}, {Op.B, Op.BI}

    def near(actions, index, step, kinds, a):
        while not (actions[index].op in kinds and (actions[index].microbatch, actions[index].chunk)
                   == (a.microbatch, a.chunk)):
            index += step
        return str(actions[index])

    sent: dict = {}
    for rank, actions in enumerate(schedule.actions):
        for i, a in enumerate(actions):
            if a.op in (Op.SEND_F, Op.SEND_B):
                kinds = forward if a.op is Op.SEND_F else backward
                sent.setdefault((rank, a.peer), []).append(near(actions, i, -1, kinds, a))
    out, k = {}, {}
    for rank, actions in enumerate(schedule.actions):
        for i, a in enumerate(actions):
            if a.op in (Op.RECV_F, Op.RECV_B):
                n = k[a.peer, rank] = k.get((a.peer, rank), -1) + 1
                kinds = forward if a.op is Op.RECV_F else backward
                out[rank, near(actions, i, 1, kinds, a)] = (a.peer, sent[a.peer, rank][n])
    return out


def critical_path(schedule: Schedule, per_rank: list[dict], latency: float = 0.0) -> dict:
    """The measured step taken apart along its critical path, in seconds: from the compute action that ends
    last, back through whatever each action started after (its received input, if its producer ended after
    it was called, else the previous compute action of its rank) to the step's start. The parts add up to
    the step (up to a copy ending last): `cost` (the cost model's, what the simulator has), `overrun`
    (actions outlasting their cost), `gap` (the executor's work between two compute actions of a rank),
    `hop` (a producer's end to its consumer's input being in: posting the send, gloo, the receiver's
    wake-up, beyond the cost model's `latency`, which is `latency` on the path: the simulator's), `wait` (a
    consumer waiting for a stash copy), `lead` (the path's first action starting after the step's)."""
    records = [r["compute"] for r in per_rank]
    index = [{c[0]: i for i, c in enumerate(rec)} for rec in records]
    producers = _producers(schedule)
    start, _ = step_window(per_rank)
    rank = max(range(len(records)), key=lambda r: records[r][-1][2])
    i = len(records[rank]) - 1
    parts = dict.fromkeys(("cost", "latency", "overrun", "gap", "hop", "wait", "lead"), 0.0)
    while True:
        label, begin, end, waited, _, cost, *_ = records[rank][i]
        parts["cost"] += cost
        parts["overrun"] += end - begin - waited - cost
        source = producers.get((rank, label))
        if source is not None and records[source[0]][index[source[0]][source[1]]][2] > begin:
            peer, produced = source
            parts["latency"] += latency
            parts["hop"] += begin + waited - records[peer][index[peer][produced]][2] - latency
            rank, i = peer, index[peer][produced]
        elif i > 0:
            parts["wait"] += waited
            parts["gap"] += begin - records[rank][i - 1][2]
            i -= 1
        else:
            parts["wait"] += waited
            parts["lead"] += begin - start
            return parts


def run_grid(pool, pp: int, names: list[str], microbatches: list[int], kinds: list[str], unit_s: float, steps: int,
             log=print, calibration: dict | None = None, list_calibration=None) -> list[dict]:
    """Every (schedule, m) of the grid on one pool of `pp` workers, each built once and run under every cost
    set of `kinds`: one warm-up step, then `steps` measured; rows with the median measured step and bubble
    beside the simulated ones. A forward of a rank's whole share of the layers takes `unit_s`: with v chunks
    per rank, one chunk's forward takes unit_s / v (the same model, cut finer), so step times of schedules
    with different v compare as the same job's. With a `calibration` (`emulate_calibrate`), the simulated
    step is timed with its host costs and latency, the ideal one without; with `list_calibration` (a callable
    (family, schedule, cost set) -> its list's calibration block, run on the pool when first asked for), the
    simulated step is timed with the row's own list's block and the common one's stays beside it."""
    rows = []
    for m in microbatches:
        for name in names:
            schedule = family_schedule(name, pp, m)
            costs = {kind: cost_model(kind, unit_s / schedule.num_chunks) for kind in kinds}
            runs = pool.run(worker_emulate, schedule, list(costs.values()), steps + 1, timeout=900)
            for c, (kind, model) in enumerate(costs.items()):
                own = list_calibration(name, schedule, kind) if list_calibration is not None else None
                row = compare(schedule, model, [[runs[r][c][k] for r in range(pp)] for k in range(steps + 1)],
                              calibration, own)
                rows.append({"costs": kind, **row})
                log(f"{name:>17} p={pp:<2} m={m:<3} {kind}: step {row['measured_step_s']:.3f} s (sim "
                    f"{row['simulated_step_s']:.3f}, {100 * row['step_error']:+.1f}%; ideal {row['ideal_step_s']:.3f})  "
                    f"bubble {row['measured_bubble']:.3f} (sim {row['simulated_bubble']:.3f}; ideal "
                    f"{row['ideal_bubble']:.3f})  model "
                    f"{100 * row['model_share']:.1f}%  load {row['load_average'][1]:.1f}")
    return rows


def compare(schedule: Schedule, costs: CostModel, steps: list[list[dict]], calibration: dict | None = None,
            own: dict | None = None) -> dict:
    """One row: the measured steps after the first (warm-up) against `simulate(schedule, costs)` with a
    calibration's host costs and latencies drawn from its percentiles (`simulated_*`, what the targets compare:
    `emulate_calibrate.drawn_simulation`): the row's own list's calibration `own` where given, else the
    common `calibration`. Beside it: the common calibration's drawn simulation (`common_*`, with `own`), its
    median latency for every message (`median_latency_*`; also `simulated_*` for a calibration without
    percentiles), and the simulation without host costs (`ideal_*`, the schedule's own timeline: the same as
    `simulated_*` without a calibration)."""
    from megatron_pp.benchmarks.emulate_calibrate import drawn_simulation, with_host_costs

    ideal = simulate(schedule, costs)
    at_median = simulate(schedule, with_host_costs(costs, calibration)) if calibration is not None else ideal
    sim_step, sim_bubble = at_median.makespan, at_median.bubble_fraction
    if calibration is not None and calibration.get("latency_ms_percentiles"):
        sim_step, sim_bubble = drawn_simulation(schedule, costs, calibration)
    common = (sim_step, sim_bubble)
    if own is not None:
        sim_step, sim_bubble = drawn_simulation(schedule, costs, own)
    per_step = [{**measure(step), "path": critical_path(schedule, step)} for step in steps[1:]]
    step = statistics.median(x["step_s"] for x in per_step)
    bubble = statistics.median(x["bubble"] for x in per_step)
    loads = [rank["load"] for s in steps for rank in s[:1]]
    row = {"pp": schedule.num_ranks, "schedule": schedule.name, "chunks": schedule.num_chunks,
           "microbatches": schedule.num_microbatches, "measured_step_s": step, "simulated_step_s": sim_step,
           "measured_bubble": bubble, "simulated_bubble": sim_bubble, "step_error": step / sim_step - 1,
           "bubble_error": (bubble - sim_bubble) / sim_bubble if sim_bubble else None,
           "median_latency_step_s": at_median.makespan, "median_latency_bubble": at_median.bubble_fraction,
           "common_step_s": common[0], "common_bubble": common[1],
           "calibrated_on": own["key"] if own is not None else None,
           "ideal_step_s": ideal.makespan, "ideal_bubble": ideal.bubble_fraction,
           "ideal_step_error": step / ideal.makespan - 1,
           "steps_s": [x["step_s"] for x in per_step], "bubbles": [x["bubble"] for x in per_step],
           "model_share": statistics.median(x["model_share"] for x in per_step),
           "action_overrun_ms": 1e3 * statistics.median(x["overrun_s"] for x in per_step),
           "executor_gap_ms": 1e3 * statistics.median(x["gap_s"] for x in per_step),
           "action_slack_ms": 1e3 * statistics.median(x["slack_s"] for x in per_step),
           "least_action_slack_ms": 1e3 * min(x["least_slack_s"] for x in per_step),
           "actions_per_step": per_step[0]["actions"],
           "actions_over_cost": [x["overran"] for x in per_step],
           "actions_over_cost_examples": next((x["overran_actions"] for x in per_step if x["overran"]), []),
           "receives_ahead_max": max([k for rank in steps[0] for k in rank.get("receives_ahead", {}).values()],
                                     default=1),
           "critical_path_ms": {part: 1e3 * statistics.median(x["path"][part] for x in per_step)
                                for part in per_step[0]["path"]},
           "load_average": [min(loads), max(loads)],
           "raised_priority": all(rank.get("prioritised", False) for s in steps for rank in s),
           "autogroup_nice": sorted({rank.get("autogroup_nice") for s in steps for rank in s}, key=str),
           "realtime": all(rank.get("realtime", False) for s in steps for rank in s),
           "timer_slack_1ns": all(rank.get("timer_slack_1ns", False) for s in steps for rank in s)}
    row["within_target"] = abs(row["step_error"]) <= 0.05 and (
        row["bubble_error"] is None or abs(row["bubble_error"]) <= 0.15)
    return row
