"""`tools/trace_vs_sim.py --emulate`: the emulated-compute grid (megatron_pp/benchmarks/emulate.py) over pipeline
sizes, schedules, microbatch counts and cost sets, one worker pool per pipeline size reused for every run of
that size (spawning 16 processes and importing torch dominates otherwise), and its JSON.

The JSON's `rows` hold, per (pp, schedule, microbatches, costs), the median measured step and bubble over the
measured steps beside the simulated makespan and bubble of the same lists under the same costs, and whether
they are within the issue's targets (step within 5%, bubble within 15%, relative). `ratios` are the speed
claims measured from the same rows: step-time ratios such as zb-h1 / 1f1b at equal (pp, m, costs), beside
the simulator's. The load average is recorded at the start and end of the grid and per row, because the
emulation holds only while the ranks are not starved of CPU.

Worked example: `--pp 4 --microbatches 2p --schedules 1f1b --costs equal` runs one row, 1f1b at p = 4,
m = 8, whose simulated step is 33 units (660 ms at 20 ms a unit) and simulated bubble 9/33 = 0.273.
"""
from __future__ import annotations

import os
import platform
import shlex
import time
from dataclasses import dataclass

from megatron_pp.benchmarks.emulate import FAMILIES, family_schedule
from megatron_pp.benchmarks.emulate_calibrate import CALIBRATION_MICROBATCHES
from megatron_pp.benchmarks.emulate_measure import run_grid
from megatron_pp.cli import UsageError, write_json

CLAIMS = [("zb-h1", "1f1b"), ("zb-v", "interleaved-1f1b"), ("v-half", "1f1b"), ("gis", "interleaved-1f1b")]
"""(schedule, baseline) pairs whose step-time ratio the papers claim (docs/schedules.md)."""
COST_KINDS = ("equal", "split")


def report_header(args, argv: list[str], torch_version: str) -> dict:
    """The fields every `--emulate` JSON starts with: the command as typed, the host, torch, the unit and the
    measured steps."""
    return {"command": "python tools/trace_vs_sim.py " + " ".join(shlex.quote(a) for a in argv),
            "device": f"CPU ({platform.machine()}, {os.cpu_count()} cores), gloo, 1 thread per rank",
            "torch": torch_version, "unit_ms": args.unit_ms, "steps_measured": args.steps}


def report_load(load_start, started: float) -> dict:
    """The load averages at the start and now, and the wall time since `started` (every `--emulate` JSON)."""
    return {"load_average_start": list(load_start), "load_average_end": list(os.getloadavg()),
            "wall_s": time.time() - started}


@dataclass(frozen=True)
class EmulationPlan:
    grid: list[tuple[int, list[int]]]  # (pp, microbatch counts)
    names: list[str]
    costs: list[str]
    names_given: bool = True
    """--schedules was given (with --calibrate-only: calibrate those lists too)."""


def _microbatches(text: str, pp: int) -> list[int]:
    """'2p,4p' at pp = 8 -> [16, 32]; plain integers stay."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        try:
            out.append(int(item[:-1]) * pp if item.endswith("p") else int(item))
        except ValueError:
            raise UsageError(f"--microbatches {text!r}: items are integers or Np (N times --pp)") from None
    if not out or min(out) < 1:
        raise UsageError(f"--microbatches {text!r}: give at least one positive count")
    return out


def plan_emulation(args, pps: list[int], names: list[str]) -> EmulationPlan:
    """Check every flag and build every list of the grid (ValueError/UsageError on bad input)."""
    if names == ["all"]:
        names = list(FAMILIES)
    missing = [n for n in names if n not in FAMILIES]
    if missing:
        raise UsageError(f"--schedules: {missing[0]!r} has no emulated variant; known: {', '.join(FAMILIES)}")
    costs = [c.strip() for c in args.costs.split(",") if c.strip()]
    if not costs or any(c not in COST_KINDS for c in costs):
        raise UsageError(f"--costs {args.costs!r}: comma-separated from {', '.join(COST_KINDS)}")
    if not args.unit_ms > 0:
        raise UsageError(f"--unit-ms must be > 0, got {args.unit_ms}")
    if args.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {args.steps}")
    if min(pps) < 2:
        raise UsageError(f"--pp: pipeline sizes must be >= 2, got {min(pps)}")
    text = "2p,4p" if args.microbatches == "8" else args.microbatches  # the default of the trace mode
    grid = [(pp, _microbatches(text, pp)) for pp in pps]
    for pp, counts in grid:
        for m in counts + [CALIBRATION_MICROBATCHES * pp]:  # each list's own calibration runs at m = 3p
            for name in names:
                family_schedule(name, pp, m)  # raises ValueError naming the schedule's rule
    return EmulationPlan(grid, names, costs, getattr(args, "schedules", None) is not None)


def paper_ratio(schedule: str, p: int, m: int) -> float:
    """Step-time ratio of a claim's pair at F = B/2 = BI = BW from the papers' bubble formulas (docs/schedules.md,
    "Formulas and their sources"), in units of a rank's whole-share forward, v = 2 where chunked; the step as
    m·(F+BI+BW) + bubble is ours. 1F1B's bubble (p−1)·3, interleaved's (p−1)·3/2; ZB-H1 (p−1)(T_F+T_B−T_W) =
    p−1 (2401.10241 §2.1); ZB-V about 0 (2401.10241 §6); V-Half ≈ p/(2m) of the step against 1F1B's ≈ p/m
    (2405.15362); GIS (p−1)(T_F+T_B) = p−1 with chunk times 1/2 (2503.01328 §3).
    Worked: zb-h1 / 1f1b at p = 8, m = 16 = (48 + 7) / (48 + 21) = 0.797."""
    base, inter = 3 * m + 3 * (p - 1), 3 * m + 1.5 * (p - 1)
    return {"zb-h1": (3 * m + p - 1) / base, "zb-v": 3 * m / inter, "v-half": (1 + p / (2 * m)) / (1 + p / m),
            "gis": (3 * m + p - 1) / inter}[schedule]


def speed_ratios(rows: list[dict]) -> list[dict]:
    """Measured and simulated step-time ratios of each claim's pair at equal (pp, m, costs): simulated with the
    calibrated host costs (`simulated`) and without (`ideal`, the schedules' own)."""
    index = {(r["pp"], r["microbatches"], r["costs"], r["schedule"]): r for r in rows}
    out = []
    for (pp, m, kind, name), row in sorted(index.items()):
        for schedule, baseline in CLAIMS:
            base = index.get((pp, m, kind, baseline))
            if name == schedule and base is not None:
                out.append({"pp": pp, "microbatches": m, "costs": kind, "ratio": f"{schedule} / {baseline}",
                            "measured": row["measured_step_s"] / base["measured_step_s"],
                            "simulated": row["simulated_step_s"] / base["simulated_step_s"],
                            "ideal": row["ideal_step_s"] / base["ideal_step_s"],
                            "papers_formula": paper_ratio(schedule, pp, m) if kind == "equal" else None})
    return out


def run_emulation(args, plan: EmulationPlan, argv: list[str]) -> int:
    import torch

    from megatron_pp.core.local_world import WorkerPool

    from megatron_pp.benchmarks.emulate_calibrate import (CALIBRATION_SCHEDULE, CALIBRATION_STEPS, calibrate,
                                                          list_calibration_key)

    unit = args.unit_ms / 1e3
    load_start, started = os.getloadavg(), time.time()
    rows: list[dict] = []
    calibration: dict[str, dict] = {}
    lists: dict[str, dict[str, dict]] = {}
    for pp, counts in plan.grid:
        pool = WorkerPool(pp)
        try:
            block = calibration[str(pp)] = {
                "command": f"python tools/trace_vs_sim.py --emulate --calibrate-only --pp {pp} --unit-ms {args.unit_ms:g}",
                "key": f"{CALIBRATION_SCHEDULE}/equal", **calibrate(pool, pp, unit, CALIBRATION_STEPS)}
            print(f"calibration p={pp}: host {block['host_compute_ms']:.3f} ms a compute action + "
                  f"{block['host_post_ms']:.3f} ms a post, latency {block['p2p_latency_ms']:.3f} ms "
                  f"({block['gaps']} gaps, {block['latency_samples']} waited inputs)", flush=True)
            own = lists[str(pp)] = {block["key"]: block}  # the common run is 1f1b's own under equal costs

            def list_calibration(name, schedule, kind, pp=pp, pool=pool, own=own):
                key = list_calibration_key(name, schedule, kind)
                if key not in own:
                    name, kind = key.split("/")
                    own[key] = {"command": f"python tools/trace_vs_sim.py --emulate --calibrate-only --pp {pp} "
                                           f"--unit-ms {args.unit_ms:g} --schedules {name} --costs {kind}",
                                "key": key, **calibrate(pool, pp, unit, CALIBRATION_STEPS, name, kind)}
                    print(f"calibration p={pp} {key}: host {own[key]['host_compute_ms']:.3f} + "
                          f"{own[key]['host_post_ms']:.3f} ms a post, latency {own[key]['p2p_latency_ms']:.3f} ms",
                          flush=True)
                return own[key]

            if args.calibrate_only:
                for name in plan.names if plan.names_given else []:
                    schedule = family_schedule(name, pp, CALIBRATION_MICROBATCHES * pp)
                    for kind in plan.costs:
                        list_calibration(name, schedule, kind)
            else:
                rows += run_grid(pool, pp, plan.names, counts, plan.costs, unit, args.steps,
                                 log=lambda line: print(line, flush=True), calibration=block,
                                 list_calibration=list_calibration)
            if args.json:  # partial results survive an interrupted grid
                write_json(args.json, _report(args, argv, rows, load_start, started, torch.__version__, calibration,
                                              lists))
        finally:
            pool.close()
    report = _report(args, argv, rows, load_start, started, torch.__version__, calibration, lists)
    for r in report["ratios"]:
        print(f"{r['ratio']:>27} p={r['pp']:<2} m={r['microbatches']:<3} {r['costs']}: measured "
              f"{r['measured']:.3f}  simulated {r['simulated']:.3f}  ideal {r['ideal']:.3f}")
    if args.json:
        write_json(args.json, report)
    return 0


def run_plan_emulation(args, cases: list, argv: list[str]) -> int:
    """`--emulate --plan ...`: each plan emulated on a pool of its pipeline size; JSON rows of `emulate_plan`."""
    import torch

    from megatron_pp.benchmarks.emulate_plan import run_plans
    from megatron_pp.core.local_world import WorkerPool

    load_start, started, pools = os.getloadavg(), time.time(), {}

    def pool_for(pp: int):
        for size in [s for s in pools if s != pp]:
            pools.pop(size).close()  # one pool at a time on a small host
        if pp not in pools:
            pools[pp] = WorkerPool(pp)
        return pools[pp]

    try:
        rows = run_plans(pool_for, cases, args.steps, log=lambda line: print(line, flush=True))
    finally:
        for pool in pools.values():
            pool.close()
    if args.json:
        write_json(args.json, {
            **report_header(args, argv, torch.__version__),
            "scaling": "every planner time (F, B, BI, BW per stage, host and peer copies, p2p latency) times one "
                       "factor per plan (`scale`), so that the mean rank's forward share takes unit_ms; emulated "
                       "times are divided by it again (real seconds) in *_s fields, critical_path_ms is emulated",
            "definitions": "emulated_pipeline_s: first compute action's start to the last action's end; "
                           "emulated_step_s: to the latest rank's end plus its after-pipeline time (the planner's "
                           "reduction and optimizer step, a closed form); simulated_pipeline_s: the lists at the "
                           "plan's m simulated exactly (the planner extrapolates above 3p + r); medians over the "
                           "measured steps",
            **report_load(load_start, started), "rows": rows})
    return 0


def _report(args, argv, rows, load_start, started, torch_version, calibration, lists=None) -> dict:
    within = [r for r in rows if r["within_target"]]
    return {
        **report_header(args, argv, torch_version),
        "model": "emulate.emulated_chunk: per chunk one column-parallel linear layer 8 x 8 (an embedding of 16 x 8 "
                 "before it on the first stage, a per-token loss after it on the last), 4 tokens, micro-batch 1",
        "receives_ahead": "per incoming link, receives kept posted ahead by the executor (simulate.receives_ahead); "
                          "rows: receives_ahead_max over the schedule's links",
        "calibration": calibration,
        "list_calibrations": lists or {},
        "simulated": "rows: simulated_step_s and simulated_bubble simulate the lists with the host costs "
                     "(CostModel.host_compute per compute action, host_post per posted send or receive) and "
                     "latencies drawn per message of the row's own list calibration (list_calibrations[pp][calibrated_on]: "
                     "the family at m = 3p under the row's costs), what the targets compare; common_step_s and "
                     "common_bubble the same with the pp's common 1f1b calibration; median_latency_* the common one's "
                     "median latency for every message; ideal_step_s and ideal_bubble without host costs "
                     "(host and latency 0: the schedule's own timeline)",
        "critical_path": "rows: critical_path_ms, the measured step taken apart along its critical path "
                         "(emulate_measure.critical_path; medians over the measured steps): cost + overrun + gap + hop + "
                         "wait + lead = step",
        "cost_sets": {"equal": "F = 1, B = 2, BI = BW = 1 unit per rank's share of the layers (1/v unit per chunk)",
                      "split": "F = 1, B = 2, BI and BW from docs/results/split_backward_cpu.json (F = B/2 ours)"},
        "transfers": "OFFLOAD/RELOAD/EVICT/LOAD: CostModel.transfer_time (the schedule's offload_time, default "
                     "0.25 of the chunk's forward) on the simulator's lanes; p2p: gloo's own, simulator latency the "
                     "calibration's (0 in ideal_*)",
        "definitions": "measured step: first compute action's start to the last action's end, over all ranks, on "
                       "the host's monotonic clock; bubble: mean over ranks of (step - busy) / step, busy = compute "
                       "time net of waits; medians over the measured steps; targets |step error| <= 5%, "
                       "|bubble error| <= 15% (relative)",
        **report_load(load_start, started),
        "rows": rows,
        "within_target": f"{len(within)} of {len(rows)}",
        "ratios": speed_ratios(rows),
    }
