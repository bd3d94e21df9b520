"""Renderers of the planner-against-emulation figures of docs/schedules.md (registered in tools/doc_renderers.py):
`tools/trace_vs_sim.py --emulate --plan ...` JSON (megatron_pp/benchmarks/emulate_plan.py)."""
from __future__ import annotations

from doc_format import num, pct, table

GIB = 2**30


def _plan_label(r: dict) -> str:
    options = ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in r["options"].items())
    v = f" v={r['v']}" if r["v"] > 1 else ""
    return (f"{r['schedule']}{v}{' ' + options if options else ''}, tp {r['tp']} × pp {r['pp']} × dp {r['dp']}, "
            f"b {r['micro_batch_size']}, m {r['microbatches']}, recompute {r['recompute']}")


def _span(values: list[float]) -> str:
    if not values:
        return "–"
    low, high = num(min(values), 1), num(max(values), 1)
    return low if low == high else f"{low} to {high}"


def emulate_plans_table(report: dict) -> str:
    """Per plan: the planner's predicted step and pipeline time (real seconds), the exact simulation of the same
    lists at the plan's m (the planner extrapolates above 3p + r), the emulated pipeline and step read back at
    real scale with their error against the prediction, e.g. '6.98 (+4.2%)', the emulated step beyond the
    costs and latencies on its critical path (ms of emulated time: overrun · gap · hop · wait · lead), the
    scale, the planner's p2p latency and host-copy time, the load average."""
    rows = []
    for r in report["rows"]:
        path = r["critical_path_ms"]
        copies = list(r["copy_ms"].values())
        rows.append([_plan_label(r), num(r["predicted_step_s"], 3), num(r["predicted_pipeline_s"], 3),
                     f"{num(r['simulated_pipeline_s'], 3)} ({pct(r['extrapolation_error'], 1, sign=True)})",
                     f"{num(r['emulated_pipeline_s'], 3)} ({pct(r['pipeline_error'], 1, sign=True)})",
                     f"{num(r['emulated_step_s'], 3)} ({pct(r['step_error'], 1, sign=True)})",
                     " · ".join(f"{path[k]:.0f}" for k in ("overrun", "gap", "hop", "wait", "lead")),
                     num(r["scale"], 3), num(r["p2p_latency_ms"], 3),
                     _span(copies),
                     f"{r['load_average'][0]:.0f}–{r['load_average'][1]:.0f}"])
    return table(["plan (best row of tools/plan.py)", "predicted step s", "predicted pipeline s",
                  "pipeline simulated exactly at m, s (prediction's difference)", "emulated pipeline s (against predicted)",
                  "emulated step s (against predicted)", "emulated ms beyond costs and latencies on the critical path, "
                  "overrun · gap · hop · wait · lead", "scale", "planner's p2p latency, real ms", "planner's host copy, real ms", "load average"], rows)


def emulate_plans_early_receives(report: dict) -> str:
    """The gloo executor's early receive buffers of each plan's lists (K per incoming link × one message): the
    largest over ranks in MiB and the largest share of a rank's predicted peak, per plan:
    '12 MiB (0.03%) for 1f1b, K = 1; ...'."""
    return "; ".join(f"{num(max(r['early_receive_bytes']) / 2**20, 0)} MiB ({pct(r['early_receive_share_of_peak'], 2)})"
                     f" for {r['schedule']}, K = {r['receives_ahead_max']}" for r in report["rows"])


def _rows_by_p(reports: tuple) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for report in reports:
        for row in report["rows"]:
            out.setdefault(row["pp"], []).append(row)
    return dict(sorted(out.items()))


def emulate_load_per_p(*reports: dict) -> str:
    """The load averages each grid's rows ran at, per p: 'p = 4: 4–7; p = 8: 1–3; ...'."""
    return "; ".join(f"p = {pp}: {min(x for r in rows for x in r['load_average']):.0f}–"
                     f"{max(x for r in rows for x in r['load_average']):.0f}" for pp, rows in _rows_by_p(reports).items())


def emulate_bubble_only_misses(*reports: dict) -> str:
    """Per p, the rows whose step is within 5% of the simulated one but whose bubble is not within 15%, and the
    range of their simulated bubbles: 'p = 4: 17 (simulated bubbles 0.06–0.16); ...'."""
    parts = []
    for pp, rows in _rows_by_p(reports).items():
        misses = [r for r in rows if abs(r["step_error"]) <= 0.05 and not r["within_target"]]
        bubbles = [r["simulated_bubble"] for r in misses]
        parts.append(f"p = {pp}: {len(misses)}" + (f" (simulated bubbles {num(min(bubbles))}–{num(max(bubbles))})"
                                                     if bubbles else ""))
    return "; ".join(parts)


def emulate_claims_shown(*reports: dict) -> str:
    """Per (p, m), in how many of the claims' pairs (both cost sets) the measured ratio is below 1 as the
    simulated one is, and the largest |measured / simulated − 1|: 'p = 8, m = 16: 8 of 8 (within 5.4%); ...'."""
    groups: dict = {}
    for report in reports:
        for r in report["ratios"]:
            if r["pp"] >= 8:
                groups.setdefault((r["pp"], r["microbatches"]), []).append(r)
    return "; ".join(
        f"p = {pp}, m = {m}: {sum((r['measured'] < 1) == (r['simulated'] < 1) for r in rs)} of {len(rs)} "
        f"(within {pct(max(abs(r['measured'] / r['simulated'] - 1) for r in rs), 1)})"
        for (pp, m), rs in sorted(groups.items()))
