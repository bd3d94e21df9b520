"""Renderers of the planner-against-emulation figures of docs/schedules.md (registered in dev/doc_renderers.py):
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


# The schedule grids (tools/trace_vs_sim.py --emulate --pp P ...): the executor against the simulator with the
# calibrated host costs (simulated_*) and without them (ideal_*) -----------------------------------------------


def _grid_rows(reports: tuple) -> list[dict]:
    return [row for report in reports for row in report["rows"]]


def _path_excess(row: dict) -> str:
    path = row["critical_path_ms"]
    return " · ".join(f"{path[k]:.0f}" for k in ("overrun", "gap", "hop", "wait", "lead"))


def emulate_grid_table(*reports: dict) -> str:
    """Per (schedule, p, m) and cost set: the measured step against the simulation with its list's calibrated
    host costs (its error, what the 5% target reads) and the ideal simulation, e.g. '0.674 / 0.668 (+0.9%) / 0.660';
    the measured bubble against the same two, '0.287 / 0.280 / 0.273'; with equal costs, the step beyond the
    costs on its measured critical path (ms: overrun · gap · hop · wait · lead); receives kept ahead (most), the
    actions whose own work exceeded their cost (all measured steps, both cost sets), the model's largest share
    of busy time, the load average over the rows."""
    rows: dict = {}
    for row in _grid_rows(reports):
        rows.setdefault((row["pp"], row["microbatches"], row["schedule"]), {})[row["costs"]] = row
    out = []
    for (pp, m, name), by_costs in rows.items():
        cells = [name, str(pp), str(m)]
        for kind in ("equal", "split"):
            r = by_costs.get(kind)
            cells += ["–", "–"] if r is None else [
                f"{num(r['measured_step_s'], 3)} / {num(r['simulated_step_s'], 3)} "
                f"({pct(r['step_error'], 1, sign=True)}) / {num(r['ideal_step_s'], 3)}",
                f"{num(r['measured_bubble'], 3)} / {num(r['simulated_bubble'], 3)} / {num(r['ideal_bubble'], 3)}"]
        load = [x for r in by_costs.values() for x in r["load_average"]]
        over = [n for r in by_costs.values() for n in r["actions_over_cost"]]
        cells += ["–" if "equal" not in by_costs else _path_excess(by_costs["equal"]),
                  str(max(r["receives_ahead_max"] for r in by_costs.values())), str(sum(over)),
                  pct(max(r["model_share"] for r in by_costs.values()), 0), f"{min(load):.0f}–{max(load):.0f}"]
        out.append(cells)
    return table(["schedule", "p", "m", "equal costs: step s, measured / simulated with its list's host costs (error) / ideal",
                  "bubble, measured / with host costs / ideal",
                  "split costs: step s, measured / simulated with its list's host costs (error) / ideal",
                  "bubble, measured / with host costs / ideal",
                  "equal costs: ms beyond the costs on the critical path, overrun · gap · hop · wait · lead",
                  "receives ahead", "actions over cost", "model share", "load average"], out)


def emulate_calibration_table(*reports: dict) -> str:
    """Per p, the common calibration run the grid made first (`calibration` in each JSON): its unit, the host time per
    compute action and per posted send or receive, the latency (median, with its quartiles), the samples, the
    median late wake-up (not charged) and the load average before and after it."""
    out = []
    for report in reports:
        for pp, c in sorted(report["calibration"].items(), key=lambda kv: int(kv[0])):
            quartiles = c["latency_ms_quartiles"]
            spread = f" ({num(quartiles[0], 3)}–{num(quartiles[2], 3)})" if quartiles else ""
            if "p2p_latency_mean_ms" in c:
                spread += f", mean {num(c['p2p_latency_mean_ms'], 3)}"
            out.append([pp, f"{c['schedule']}, m = {c['microbatches']}, equal", num(c["unit_ms"], 0),
                        num(c["host_compute_ms"], 3), num(c["host_post_ms"], 3),
                        num(c["p2p_latency_ms"], 3) + spread, f"{c['gaps']} · {c['latency_samples']}",
                        num(c["overrun_ms"], 3), f"{c['load_average'][0]:.0f}–{c['load_average'][1]:.0f}"])
    return table(["p", "calibration run", "unit ms", "host per compute action, ms", "host per posted send or "
                  "receive, ms", "latency, ms: median (quartiles), mean", "gaps · waited inputs", "late wake-up, ms (not charged)",
                  "load average"], out)


def emulate_ratios_table(*reports: dict) -> str:
    """The speed claims at p >= 8 from the grids: per (pair, p, m, costs) the measured step-time ratio, the
    simulated one with the calibrated host costs, the ideal simulated one and the papers' formulas' (equal
    costs only)."""
    out = []
    for report in reports:
        for r in report["ratios"]:
            if r["pp"] >= 8:
                paper = r["papers_formula"]
                out.append([r["ratio"], str(r["pp"]), str(r["microbatches"]), r["costs"], num(r["measured"], 3),
                            num(r["simulated"], 3), num(r["ideal"], 3), "–" if paper is None else num(paper, 3)])
    return table(["ratio", "p", "m", "costs", "measured (emulated)", "simulated with host costs", "ideal simulated",
                  "papers' bubble formulas (ours: step = m·(F+BI+BW) + bubble)"], out)


def _held_against(reports: tuple, simulation: str) -> str:
    """Per p, the rows within both targets (step 5%, bubble 15%, relative; a simulated bubble of 0 holds the
    bubble target) against the simulation whose fields are `<simulation>_step_s` and `<simulation>_bubble`:
    'p = 4: 52 of 52; ...'."""
    parts = []
    for pp, rows in _rows_by_p(reports).items():
        held = sum(abs(r["measured_step_s"] / r[f"{simulation}_step_s"] - 1) <= 0.05 and (
            r[f"{simulation}_bubble"] == 0 or abs(r["measured_bubble"] / r[f"{simulation}_bubble"] - 1) <= 0.15)
            for r in rows)
        parts.append(f"p = {pp}: {held} of {len(rows)}")
    return "; ".join(parts)


def emulate_ideal_targets(*reports: dict) -> str:
    """Per p, the rows within both targets against the ideal simulation instead (what the previous grids were
    held to): 'p = 4: 18 of 52; ...'."""
    return _held_against(reports, "ideal")


def emulate_misses(*reports: dict) -> str:
    """The rows outside either target, per p, with their step and bubble errors against the calibrated
    simulation: 'p = 8: v-half m = 32 equal (step +5.5%, bubble +27.8%); p = 16: ...'; 'none' when all hold."""
    parts = []
    for pp, rows in _rows_by_p(reports).items():
        misses = [f"{r['schedule']} m = {r['microbatches']} {r['costs']} (step {pct(r['step_error'], 1, sign=True)}, "
                  f"bubble {pct(r['bubble_error'], 1, sign=True)})" for r in rows if not r["within_target"]]
        if misses:
            parts.append(f"p = {pp}: " + ", ".join(misses))
    return "; ".join(parts) or "none"


# The replays (tools/trace_vs_sim.py --emulate --replay ...: megatron_pp/benchmarks/emulate_replay.py) ---------


def emulate_replay_table(*reports: dict) -> str:
    """Per replayed row (one run each): the measured step against the simulation with the calibration's median
    latency for every message, with latencies drawn from its percentiles, and the replays with each message's
    measured latency (and each action's measured overrun too), as 'simulated s (measured / simulated − 1)';
    the bubbles, measured / median latency / replayed / replayed with overruns; the latencies of the messages
    a consumer waited for (median and mean, ms) beside the calibration's median; per number of posts in a
    gap, the row's median gap against what the calibrated simulation charges (ms); the load average."""
    def cell(r: dict, key: str) -> str:
        return "–" if r.get(key + "_step_s") is None else (
            f"{num(r[key + '_step_s'], 3)} ({pct(r[key + '_error'], 1, sign=True)})")

    out = []
    for report in reports:
        for r in report["rows"]:
            gaps = "; ".join(f"{n}: {num(g[1], 2)} / {num(g[2], 2)}" for n, g in r["gap_ms_by_posts"].items())
            out.append([r["schedule"], str(r["pp"]), str(r["microbatches"]), num(r["measured_step_s"], 3),
                        cell(r, "median_latency"), cell(r, "drawn_latency"), cell(r, "replayed"),
                        cell(r, "replayed_with_overruns"),
                        " / ".join(num(r[k], 3) for k in ("measured_bubble", "median_latency_bubble",
                                                          "replayed_bubble", "replayed_with_overruns_bubble")),
                        f"{num(r['waited_latency_median_ms'], 2)} · {num(r['waited_latency_mean_ms'], 2)} "
                        f"({num(r['calibrated_latency_ms'], 2)})", gaps, f"{r['load_average']:.0f}"])
    return table(["schedule", "p", "m", "measured step s", "simulated, median latency (error)",
                  "simulated, drawn latencies (error)", "replayed, measured latencies (error)",
                  "replayed, and measured overruns (error)",
                  "bubble: measured / median latency / replayed / and overruns",
                  "waited latency ms, median · mean (calibration's median)",
                  "median gap ms per posts in it, measured / charged", "load average"], out)


def emulate_median_targets(*reports: dict) -> str:
    """Per p, the rows within both targets against the simulation with the calibration's median latency for
    every message (`median_latency_*`, the rule before the drawn latencies): 'p = 4: 52 of 52; ...'."""
    return _held_against(reports, "median_latency")


# Each list's own calibration (emulate_calibrate: the family at m = 3p under the row's costs) ----------------


def _list_blocks(reports: tuple) -> dict[str, dict[int, dict]]:
    """key ('family/costs') -> {p: block}, in the order of the grids' rows."""
    out: dict[str, dict[int, dict]] = {}
    for report in reports:
        for pp, blocks in report.get("list_calibrations", {}).items():
            for key, block in blocks.items():
                out.setdefault(key, {})[int(pp)] = block
    order = {row.get("calibrated_on"): i for i, row in enumerate(_grid_rows(reports))}
    return dict(sorted(out.items(), key=lambda kv: order.get(kv[0], len(order))))


def emulate_list_calibration_table(*reports: dict) -> str:
    """Per list calibration and p: the waited latency's median (below 0, timing noise: 0, as the simulation
    takes it) · mean (ms), the host time per compute action
    + per posted send or receive (ms), and the 90th percentile of the late wake-ups (ms, not charged), e.g.
    '0.95 · 1.00 (0.12 + 0.14; 0.69)'."""
    blocks = _list_blocks(reports)
    pps = sorted({pp for by_p in blocks.values() for pp in by_p})
    out = []
    for key, by_p in blocks.items():
        family, kind = key.split("/")
        cells = [family, kind]
        for pp in pps:
            c = by_p.get(pp)
            cells.append("–" if c is None else  # a median below 0 is timing noise, used as 0 (with_host_costs)
                         f"{num(max(c['p2p_latency_ms'], 0.0), 2)} · {num(c['p2p_latency_mean_ms'], 2)} "
                         f"({num(c['host_compute_ms'], 2)} + {num(c['host_post_ms'], 2)}; {num(c['overrun_ms_p90'], 2)})")
        out.append(cells)
    return table(["list (m = 3p)", "costs"] + [f"p = {pp}: latency ms median · mean (host per action + per post; "
                                              "late wake-up p90)" for pp in pps], out)


CROWDING_BINS = ((0, 2), (3, 4), (5, 6), (7, 8), (9, 10), (11, 12), (13, 99))


def emulate_crowding_table(*reports: dict, keys: tuple[str, ...] = ("1f1b/equal", "zb-v/equal", "v-half/equal")) -> str:
    """At the largest p of the reports, for the list calibrations `keys`: per bin of the number of compute actions
    (any rank) that ended in the 4 ms up to a send's post, the waited inputs and their latency as 'n · ms'; the
    blocks keep a median per count (`latency_ms_by_recent_ends`), so a bin's figure is the median of its
    counts' medians weighted by their inputs (ours)."""
    blocks = _list_blocks(reports)
    pp = max(pp for by_p in blocks.values() for pp in by_p)
    out = []
    for low, high in CROWDING_BINS:
        cells = [f"{low}–{high}" if high < 99 else f"{low} or more"]
        for key in keys:
            counts = blocks[key][pp]["latency_ms_by_recent_ends"]
            items = sorted((median, n) for c, (n, median) in counts.items() if low <= int(c) <= high)
            total = sum(n for _, n in items)
            if not total:
                cells.append("–")
                continue
            seen = 0
            for median, n in items:  # the weighted median of the per-count medians
                seen += n
                if 2 * seen >= total:
                    break
            cells.append(f"{total} · {num(median, 2)}")
        out.append(cells)
    return table([f"compute actions ended in the 4 ms before the send (p = {pp})"] +
                 [f"{k.replace('/', ', ')}: waited inputs · latency ms" for k in keys], out)


def emulate_common_targets(*reports: dict) -> str:
    """Per p, the rows within both targets against the simulation with the common 1f1b calibration's drawn
    latencies (`common_*`, the rule before each list had its own): 'p = 4: 52 of 52; ...'."""
    return _held_against(reports, "common")
