"""The renderers of dev/render_docs.py: one function per figure (parsed JSON in, markdown out) and RENDERERS,
the registry that names each one's JSON under docs/results/.

Adding a table: one function here, one line in RENDERERS, the two markers in the page, then
`python dev/render_docs.py --write` (its docstring has the marker syntax). Renderers only format: a
number a page shows is a number its JSON holds (rounded), never one computed here from several.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from doc_format import mib, num, pct, table, yes_no  # noqa: E402,F401  (the helpers every renderer shares)



# ---- the renderers ---------------------------------------------------------------------------------------

def split_backward_table(data: dict) -> str:
    """benchmarks/bench_split_backward.py: (BI + BW) / B and BI / B, median and range over rounds, with the
    targets the JSON records (1.044 over 9 rounds for (BI + BW) / B by wall time in the committed run)."""
    ranges, targets, met = data["round_range"], data["targets"], data["targets_met"]
    rounds = len(data["rounds"])

    def row(label, key, target):
        low, high = ranges[key]
        return [label, num(data[key], 3), f"{num(low, 3)} – {num(high, 3)}", target]
    return table(["ratio", "median", f"range over {rounds} rounds", "target"], [
        row("(BI + BW) / B, wall", "split_over_whole",
            f"≤ {targets['split_over_whole_max']:.2f}: " + ("met" if met["split_over_whole"] else "missed")),
        row("(BI + BW) / B, CPU seconds", "split_over_whole_cpu", ""),
        row("BI / B, wall", "input_over_whole",
            f"≤ {targets['input_over_whole_max']:.2f}: " + ("met" if met["input_over_whole"] else "missed"))])


def split_backward_sentence(data: dict) -> str:
    """The pair docs/schedules.md and docs/benchmarks.md quote in prose: '(BI + BW) / B = 1.044 and BI / B =
    0.568 over 9 paired rounds'."""
    return (f"(BI + BW) / B = {num(data['split_over_whole'], 3)} and BI / B = {num(data['input_over_whole'], 3)} "
            f"over {len(data['rounds'])} paired rounds")


VS_TORCH_ORDER = ("1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v")


def vs_torch_table(data: dict) -> str:
    """benchmarks/bench_vs_torch.py: per pair, ours / torch step time (median, min–max over rounds), CPU
    ratio, CPU seconds and peak activation MiB per rank, and whether each target was met."""
    rows = []
    for name in VS_TORCH_ORDER:
        pair = data["pairs"][name]
        ratio, ours, theirs = pair["ratio_ours_over_torch"], pair["ours"], pair["torch"]
        per_rank = lambda side, key, fmt: ", ".join(fmt(v) for v in side[key])  # noqa: E731
        rows.append([f"`{name}`", pair["torch_schedule"],
                     f"{num(ratio['median'], 3)} ({num(ratio['min'])}–{num(ratio['max'])})",
                     num(pair["cpu_ratio_ours_over_torch"]["median"], 3),
                     f"{per_rank(ours, 'cpu_s_per_rank_median', num)} / "
                     f"{per_rank(theirs, 'cpu_s_per_rank_median', num)}",
                     f"{per_rank(ours, 'peak_activation_bytes_per_rank', mib)} / "
                     f"{per_rank(theirs, 'peak_activation_bytes_per_rank', mib)}",
                     yes_no(pair["targets"]["time_met"]), yes_no(pair["targets"]["memory_met"])])
    return table(["ours", "torch", "step time ratio", "CPU ratio", "CPU s per rank, ours / torch",
                  "peak activation MiB, ours / torch", f"time ≤ {data['time_target']:.2f}", "memory ≤ torch"], rows)


def vs_torch_zb_h1_sentence(data: dict) -> str:
    """'0.942 (0.81–1.06); target ≤ 0.95: met' for `zb-h1` against our `1f1b`, back to back."""
    r = data["zb_h1_over_our_1f1b"]
    return (f"{num(r['median'], 3)} ({num(r['min'])}–{num(r['max'])}); target ≤ {data['time_target']:.2f}: "
            + ("met" if r["met"] else "missed"))


def vs_torch_gradients_sentence(data: dict) -> str:
    """The largest relative gradient difference of the untimed check step over all pairs: '9.5e-08'."""
    worst = max(pair["check"]["grad_rel_diff_max"] for pair in data["pairs"].values())
    return f"{worst:.1e}"


def bench_layer_table(data: dict) -> str:
    """tools/bench_layer.py: per (backend, micro-batch) forward, backward and attention-core ms, achieved
    GFLOP/s and the stash measured against the formula (MB = 10^6 bytes: 25198592 -> '25.20')."""
    names = {"sdpa": "sdpa (CPU flash kernel)", "reference": "reference (unfused)"}
    rows, seen = [], set()
    for r in data["results"]:
        label = r["backend"] if r["backend"] in seen else names.get(r["backend"], r["backend"])
        seen.add(r["backend"])
        rows.append([label, str(r["micro_batch_size"]), num(r["forward_ms"], 1), num(r["backward_ms"], 1),
                     num(r["core_forward_ms"], 1), num(r["achieved_tflops"] * 1000, 0),
                     num(r["stash_bytes"] / 1e6), num(r["stash_bytes_predicted"] / 1e6)])
    return table(["backend", "b", "forward ms", "backward ms", "attention core fwd ms", "achieved GFLOP/s",
                  "stash MB measured", "stash MB predicted"], rows)



def schedule_build_table(data: dict) -> str:
    """benchmarks/bench_schedule_build.py: per m, actions, total CPU s (build / validate share / simulate)
    and wall s; at m = 1024 of interleaved p = 32, v = 4: '7.63 (5.39 / 2.90 / 2.24)'."""
    rows = [[str(r["microbatches"]), num(r["actions"], 0),
             f"{num(r['total_cpu_s'])} ({num(r['build_cpu_s'])} / {num(r['validate_cpu_s'])} / "
             f"{num(r['simulate_cpu_s'])})", num(r["total_s"])] for r in data["rows"]]
    return table(["m", "actions", "total CPU s (build / validate share / simulate)", "total wall s"], rows)


def bpipe_build_table(data: dict) -> str:
    """benchmarks/bench_schedule_build.py --schedule bpipe at p = 48: build CPU seconds of the runs of the
    current tree (the JSON's runs whose tree is 'this change'), per m."""
    runs = [run for run in data["runs"] if run["tree"] == "this change"]
    rows = [[str(row["microbatches"]), num(row["actions"], 0),
             ", ".join(num(run["rows"][i]["build_cpu_s"]) for run in runs)]
            for i, row in enumerate(runs[0]["rows"])]
    return table(["m", "actions", f"build CPU s ({len(runs)} runs)"], rows)


def plot_schedule_table(data: dict) -> str:
    """dev/bench_plot_schedule.py: median CPU seconds per part and each round's, e.g. draw 3.35."""
    parts = [("draw", "draw (`plot_schedule.draw`, PNG written)"), ("simulate", "simulate"),
             ("build", "build (generator, communication, validation)")]
    rows = [[label, num(data["median_cpu_s"][key]), ", ".join(num(r[key]["cpu_s"]) for r in data["rounds"])]
            for key, label in parts]
    rows.append(["whole tool minus interpreter start", num(data["median_cpu_s"]["total_cpu_s"]),
                 ", ".join(num(r["total_cpu_s"]) for r in data["rounds"])])
    return table(["Part", "CPU s (median)", "rounds"], rows)


def bench_mfu_output(data: dict) -> str:
    """benchmarks/bench_mfu.py's own summary of its JSON (`format_table`), in a code block."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from bench_mfu import format_table
    return "```\n" + format_table(data) + "\n```"

def peaks(values: list, scale: int = 1) -> str:
    """Per-rank peaks: '4 on every rank' when equal, else the list: `peaks([4, 3, 2, 1])` -> '4 3 2 1'."""
    values = [v * scale for v in values]
    return f"{values[0]} on every rank" if len(set(values)) == 1 else " ".join(str(v) for v in values)


def _by_schedule(reports: list) -> dict:
    return {r["schedule"]: r for r in reports}


def zero_bubble_table(small: list, large: list) -> str:
    """tools/plot_schedule.py --compare 1f1b,zb-h1,zb-h2 at p = 4, m = 8 and p = 8, m = 32 (F = BI = BW = 1):
    makespan, bubble and per-rank peak stashes; 1F1B at p = 8, m = 32: 117 and 17.9%."""
    a, b = _by_schedule(small), _by_schedule(large)
    rows = [[f"`{name}`", num(a[name]["makespan"], 0), pct(a[name]["bubble_fraction"]), peaks(a[name]["peak_stash"]),
             num(b[name]["makespan"], 0), pct(b[name]["bubble_fraction"]), peaks(b[name]["peak_stash"])]
            for name in ("1f1b", "zb-h1", "zb-h2")]
    return table(["", "p = 4, m = 8: makespan", "bubble", "peak stashes per rank", "p = 8, m = 32: makespan",
                  "bubble", "peak stashes per rank"], rows)


def vshape_table(v_small: list, v_large: list, f1b_small: dict, f1b_large: dict) -> str:
    """tools/plot_schedule.py --compare zb-v,v-half,interleaved-1f1b (v = 2) and 1F1B with stages of two
    chunks (--stage-weights 2,...) at p = 4, m = 8 and p = 8, m = 32. Peaks in chunk stashes: 1F1B's
    stage stash holds both chunks, so its count is doubled (8 7 … 1 stages -> 16 14 … 2 chunks)."""
    rows = []
    for setting, compared, one_f1b in (("4, 8", v_small, f1b_small), ("8, 32", v_large, f1b_large)):
        named = _by_schedule(compared)
        for name, label in (("zb-v", "`zb-v`"), ("v-half", "`v-half`"),
                            ("interleaved-1f1b", "`interleaved-1f1b` (v = 2)")):
            r = named[name]
            rows.append([setting, label, num(r["makespan"], 0), pct(r["bubble_fraction"]), peaks(r["peak_stash"])])
        rows.append([setting, "`1f1b`", num(one_f1b["makespan"], 0), pct(one_f1b["bubble_fraction"]),
                     peaks(one_f1b["peak_stash"], scale=2)])
    return table(["p, m", "schedule", "makespan", "bubble", "peak chunk stashes per rank"], rows)

def _trace_cells(run: dict, target: float) -> list[str]:
    """Trace bubble 'median (min – max)', simulated bubble and relative error of one tools/trace_vs_sim.py run;
    the error gets a decimal where whole percent would hide which side of the target it is on (15.1%)."""
    steps = run["trace_bubble_per_step"]
    error = run["relative_error"]
    places = 1 if round(error * 100) == round(target * 100) else 0
    return [f"{num(run['trace_bubble'], 3)} ({num(min(steps), 3)} – {num(max(steps), 3)})", num(run["sim_bubble"], 3),
            f"{error * 100:.{places}f}%"]


def _trace_label(run: dict) -> list[str]:
    name = run["schedule"] + (f" (v = {run['chunks']})" if run["schedule"] == "interleaved-1f1b" else "")
    return [name, str(run["pp"])]


def trace_vs_sim_table(data: dict) -> str:
    """tools/trace_vs_sim.py: per (schedule, p) the trace's bubble (median and range over the measured steps),
    the simulated one, their relative error and the executor's share of busy time (min–max over ranks)."""
    rows = []
    for run in data["runs"]:
        share = [round(x * 100) for x in run["executor_share_of_busy"]]
        share_text = f"{min(share)}%" if min(share) == max(share) else f"{min(share)}–{max(share)}%"
        rows.append(_trace_label(run) + _trace_cells(run, data["target_relative_error"]) + [share_text])
    steps = data["runs"][0]["steps_measured"]
    return table(["schedule", "p", f"trace bubble (median; range over {steps} steps)", "simulated", "relative error",
                  "executor work, share of busy"], rows)


def trace_vs_sim_pair_table(short: dict, long: dict) -> str:
    """Two tools/trace_vs_sim.py runs side by side (5 and 10 measured steps), same rows."""
    rows = [_trace_label(a) + _trace_cells(a, short["target_relative_error"])
            + _trace_cells(b, long["target_relative_error"]) for a, b in zip(short["runs"], long["runs"])]
    return table(["schedule", "p", f"trace bubble, {short['runs'][0]['steps_measured']} steps (median; range)",
                  "simulated", "error", f"trace bubble, {long['runs'][0]['steps_measured']} steps (median; range)",
                  "simulated", "error"], rows)


def trace_clock_bound(*reports: dict) -> str:
    """The clock offsets' error bound (half the shortest synchronisation round trip, which trace_vs_sim.py
    records as `p2p_latency_ms`) over every committed trace: '0.10–3.85 ms'."""
    bounds = [run["p2p_latency_ms"] for report in reports for run in report["runs"]]
    return f"{num(min(bounds))}–{num(max(bounds))} ms"


TRACES = ("docs/results/trace_vs_sim_cpu.json", "docs/results/trace_vs_sim_cpu_iters11.json",
          "docs/results/trace_vs_sim_cpu_quiet.json", "docs/results/trace_vs_sim_cpu_quiet_iters11.json")

def trends_of(paper: str, keep=lambda trend: True):
    """A renderer for one paper's small-scale trend table of `tools/reproduce.py all --quick` (measured on
    CPU by the executor, predicted by the simulator), formatted as `PaperReport.format` prints it; `keep`
    picks rows (the layered paper's trends were measured in the breadth-first report)."""
    def render(data: dict) -> str:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from megatron_pp.planning.papers.common import error_text
        (report,) = [r for r in data["reports"] if r["paper"] == paper]
        return table(["Small-scale trend", "Setting", "Measured (executor, CPU)", "Predicted (simulator)", "Error"],
                     [[t["trend"], t["setting"], t["measured"], t["predicted"], error_text(t["error"])]
                      for t in report["trends"] if keep(t["trend"])])
    render.__doc__ = f"The small-scale trend rows of {paper} in the `tools/reproduce.py` JSON it is registered with."
    return render

def farthest_stash_trend(data: dict) -> str:
    """The stash-peak trend row of `reproduce.py all --quick` farthest from its measurement, as
    '2.46% (PipeOffload: peak stash per rank, po-f, −2.46%)': the bound a page may claim for all of them."""
    rows = [t for report in data["reports"] for t in report["trends"]
            if "stash" in t["trend"] and t["error"] is not None]
    worst = max(rows, key=lambda t: abs(t["error"]))
    return f"{pct(abs(worst['error']), 2)} ({worst['trend']}, {pct(worst['error'], 2, sign=True)})"

def mutation_table(data: dict) -> str:
    """dev/mutation_check.py's headline sample: mutants, killed when it ran (time-outs among them),
    equivalent survivors, the score killed / non-equivalent, and what became of the survivors since."""
    survivors = data["survivors"]
    later = sum(1 for s in survivors if "killed_by" in s and "equivalent" not in s)
    open_ = len(survivors) - later - data["equivalent"]
    fate = f"{later} killed by a test written since" + (f", {open_} open" if open_ else "")
    return table(["sample", "mutants", "killed when it ran (by time-out)", "equivalent",
                  "score (killed / non-equivalent)", "non-equivalent survivors"],
                 [[data["command"].split("--seed ")[1].split()[0].join(["seed ", ""]), str(data["total"]),
                   f"{data['killed']} ({data['timeouts']})", str(data["equivalent"]),
                   f"**{data['killed']} / {data['non_equivalent']} = {pct(data['killed'] / data['non_equivalent'])}**",
                   fate]])

def soak_table(data: dict) -> str:
    """benchmarks/soak.py: per schedule, each rank's RSS at the first step, after warm-up and at the last
    step, the steepest slope within a segment and the growth per resume, ranks side by side ('0 / 1')."""
    rows = []
    for name, run in data["schedules"].items():
        ranks = run["ranks"]
        both = lambda key, places: " / ".join(num(r[key], places) for r in ranks)  # noqa: E731
        rows.append([name, " / ".join(str(i) for i in range(len(ranks))), both("rss_first_mb", 1),
                     both("rss_after_warmup_mb", 1), both("rss_last_mb", 1), both("slope_kb_per_step", 1),
                     both("growth_per_resume_kb", 0)])
    return table(["Schedule", "Rank", "RSS first step (MB)", "after warm-up (MB)", "last step (MB)",
                  "slope within segments (KB/step)", "growth per resume (KB)"], rows)

def planner_validation_table(data: dict) -> str:
    """tools/validate_planner.py: predicted against measured step (median, min–max over iterations) with the
    error predicted / measured − 1 ('+210.9%'), and the stash error per pipeline rank ('+0.00% +0.00%')."""
    rows = []
    for row in data["rows"]:
        stash = " ".join(f"{p / m - 1:+.2%}" for p, m in zip(row["predicted_stash_bytes"], row["measured_stash_bytes"]))
        if row["measured_step_s"] is None:
            measured, error = f"memory only ({len(row['measured_stash_bytes'])} processes on 2 cores)", "—"
        else:
            low, high = row["measured_step_s_range"]
            measured = f"{num(row['measured_step_s'], 3)} ({num(low)}–{num(high)})"
            error = f"{row['predicted_step_s'] / row['measured_step_s'] - 1:+.1%}"
        rows.append([row["configuration"], num(row["predicted_step_s"], 3), measured, error, stash])
    return table(["configuration", "predicted step s", "measured step s (min–max)", "error",
                  "stash error per pipeline rank"], rows)

def offload_table(reports: list) -> str:
    """tools/plot_schedule.py --compare interleaved-1f1b,gis,gis-h,po-h,po-f (p = 4, m = 8, v = 4): rank 0's
    simulated peak of device-resident stashes, as a share of interleaved 1F1B's (16 / 19 -> '84%'), its
    peak in host memory and the makespan."""
    base = reports[0]["peak_stash"][0]
    rows = [[f"`{r['schedule']}`", str(r["peak_stash"][0]), pct(r["peak_stash"][0] / base, 0),
             str(r["peak_parked"][0]), num(r["makespan"], 0)] for r in reports]
    return table(["Schedule", "rank-0 peak, simulated", f"of {reports[0]['schedule']}",
                  "in host memory (simulated peak)", "makespan (F = BI = BW = 1)"], rows)

def layered_traffic_table(data: dict) -> str:
    """benchmarks/bench_layered.py traffic: rank 0's data-parallel collectives over one step per (setup, m),
    as the tool prints them (reduce-scatter counted with the reductions; MiB = 2^20 bytes)."""
    rows = []
    for setup, by_m in data["rows"].items():
        for m, r in by_m.items():
            totals = r["totals"]
            gather = totals.get("all_gather", (0, 0))
            reduce = [a + b for a, b in zip(totals.get("all_reduce", (0, 0)), totals.get("reduce_scatter", (0, 0)))]
            peak = ("—" if r["peak_weight_bytes"] is None
                    else f"{mib(r['peak_weight_bytes'])} ({mib(r['model_bytes'])})")
            rows.append([setup, m, str(gather[0]), mib(gather[1]), str(reduce[0]), mib(reduce[1]),
                         mib(gather[1] + reduce[1]), peak])
    return table(["setup", "m", "all-gather calls", "all-gather MiB", "reduction calls", "reduction MiB", "total MiB",
                  "peak gathered weights MiB (of the rank's model)"], rows)


def plan_output(data: dict) -> str:
    """What `tools/plan.py` printed for the run whose JSON this is (its `printed` lines), in a code block."""
    return "```\n" + "\n".join(data["printed"]) + "\n```"

def demo_validation_sentence(rows: list) -> str:
    """launch/demo.sh's metrics: the first and last validation loss, 'from 6.70 after 30 iterations to 6.10
    after 120'."""
    evals = [r for r in rows if "eval_loss" in r]
    first, last = evals[0], evals[-1]
    return (f"from {num(first['eval_loss'])} after {first['iteration']} iterations to {num(last['eval_loss'])} "
            f"after {last['iteration']}")

def bench_layer_reading(data: dict) -> str:
    """The sentence under the bench_layer table: the unfused path's extra stash bytes at b = 1 (38.02 / 25.20
    MB -> '51% more'), the range of its attention core's time over SDPA's per b, and the achieved GFLOP/s range."""
    by = {(r["backend"], r["micro_batch_size"]): r for r in data["results"]}
    sizes = sorted({b for _, b in by})
    extra = by[("reference", sizes[0])]["stash_bytes"] / by[("sdpa", sizes[0])]["stash_bytes"] - 1
    slower = [by[("reference", b)]["core_forward_ms"] / by[("sdpa", b)]["core_forward_ms"] for b in sizes]
    rates = [r["achieved_tflops"] * 1000 for r in data["results"]]
    return (f"the unfused path keeps {pct(extra, 0)} more bytes per layer than the flash path, and its attention "
            f"core is {num(min(slower), 1)}–{num(max(slower), 1)}× slower than SDPA's on this CPU; achieved "
            f"throughput {num(min(rates), 0)}–{num(max(rates), 0)} GFLOP/s")

def vs_torch_memory_sentence(data: dict) -> str:
    """How much less peak activation memory ours holds than torch's: zb-v per rank and zb-h1's last rank,
    '15% less on rank 0 and 7% less on rank 1, and `zb-h1`'s last rank 8% less'."""
    def less(pair, rank):
        side = data["pairs"][pair]
        return pct(1 - side["ours"]["peak_activation_bytes_per_rank"][rank]
                   / side["torch"]["peak_activation_bytes_per_rank"][rank], 0)
    return (f"{less('zb-v', 0)} less on rank 0 and {less('zb-v', 1)} less on rank 1, and `zb-h1`'s last rank "
            f"{less('zb-h1', -1)} less")


def _emulate_rows(reports: tuple) -> list[dict]:
    return [row for report in reports for row in report["rows"]]


def _count_per_p(reports: tuple, holds, suffix: str = "") -> str:
    """Per p, how many rows `holds` for: 'p = 4: 10 of 48<suffix>; p = 8: ...'."""
    rows = _emulate_rows(reports)
    return "; ".join(f"p = {pp}: {sum(bool(holds(r)) for r in rows if r['pp'] == pp)} of "
                     f"{sum(r['pp'] == pp for r in rows)}{suffix}" for pp in sorted({r["pp"] for r in rows}))


def emulate_targets(*reports: dict) -> str:
    """How many rows meet both targets, per p: 'p = 4: 10 of 48; p = 8: ...'."""
    return _count_per_p(reports, lambda r: r["within_target"])


def _span(values, fmt) -> str:
    lo, hi = min(values), max(values)
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)} to {fmt(hi)}"


def emulate_load(*reports: dict) -> str:
    """The load averages the emulated grids ran at (every row's, and each file's start and end): 'a to b'."""
    loads = [x for report in reports for x in (report["load_average_start"][0], report["load_average_end"][0])]
    loads += [x for row in _emulate_rows(reports) for x in row["load_average"]]
    return _span(loads, lambda x: f"{x:.0f}")


def emulate_path_cost(*reports: dict) -> str:
    """How close the costs on each measured critical path come to the ideal simulated makespan (no host costs):
    the largest |path cost - ideal step| / ideal step over the rows, e.g. '6.2%'."""
    rows = [r for r in _emulate_rows(reports) if r.get("critical_path_ms")]
    worst = max(abs(r["critical_path_ms"]["cost"] / 1000 - r["ideal_step_s"]) / r["ideal_step_s"] for r in rows)
    return pct(worst, 1)


def emulate_gap(*reports: dict) -> str:
    """The range of the rows' median executor gap between two compute actions of a rank, ms."""
    return _span([r["executor_gap_ms"] for r in _emulate_rows(reports)], lambda x: f"{x:.2f}") + " ms"


def emulate_over_cost(*reports: dict) -> str:
    """In how many rows, per p, at least one compute action's own work exceeded its cost."""
    return _count_per_p(reports, lambda r: sum(r.get("actions_over_cost", [])) > 0, " rows")


def emulate_share(*reports: dict) -> str:
    """The model's largest share of busy time in rows with no action over its cost, and over all rows."""
    rows = _emulate_rows(reports)
    clean = [r["model_share"] for r in rows if sum(r.get("actions_over_cost", [])) == 0]
    return (f"at most {pct(max(clean), 0)} in the rows with no action over its cost" if clean else
            "every row has an action over its cost") + f", up to {pct(max(r['model_share'] for r in rows), 0)} overall"


def emulate_step_within(*reports: dict) -> str:
    """Per p, the rows whose step alone is within 5% of the simulated makespan: 'p = 4: 44 of 52; ...'."""
    return _count_per_p(reports, lambda r: abs(r["step_error"]) <= 0.05)


def _ratios_p8_up(reports) -> list[dict]:
    return [r for report in reports for r in report["ratios"] if r["pp"] >= 8]


def emulate_ratio_spread(*reports: dict) -> str:
    """measured / simulated - 1 over the speed-claim ratios at p >= 8: 'from a to b'."""
    errors = [r["measured"] / r["simulated"] - 1 for r in _ratios_p8_up(reports)]
    return f"from {pct(min(errors), 0, sign=True)} to {pct(max(errors), 0, sign=True)}"


def emulate_zb_h1_wins(*reports: dict) -> str:
    """In how many measured (p >= 8, m, costs) pairs zb-h1's step was below 1f1b's: 'k of n'."""
    pairs = [r for r in _ratios_p8_up(reports) if r["ratio"] == "zb-h1 / 1f1b"]
    return f"{sum(r['measured'] < 1 for r in pairs)} of the {len(pairs)}"


EMULATED = ("docs/results/emulate_p4.json", "docs/results/emulate_p8.json", "docs/results/emulate_p16.json")

# docs/bpipe.md's estimator tables and the BPipe figures of docs/reproduction.md (they use the helpers above).
import doc_renderers_bpipe as bp  # noqa: E402
import doc_renderers_glance as glance  # noqa: E402
import doc_renderers_bench as bench  # noqa: E402
import doc_renderers_traces as traces  # noqa: E402
import doc_renderers_sim as sim  # noqa: E402
import doc_renderers_validation as validation  # noqa: E402
import doc_renderers_dry_run_prose as dry_prose  # noqa: E402

ESTIMATE = "docs/results/estimate_bpipe_48gpu_gpt3_{}.json".format
FULL = "docs/results/reproduce_full.json"

RENDERERS: dict = {
    # name: (its JSON, the function that renders it)
    "split-backward": ("docs/results/split_backward_cpu.json", split_backward_table),
    "split-backward-pair": ("docs/results/split_backward_cpu.json", split_backward_sentence),
    "vs-torch": ("docs/results/vs_torch_cpu.json", vs_torch_table),
    "vs-torch-zb-h1": ("docs/results/vs_torch_cpu.json", vs_torch_zb_h1_sentence),
    "vs-torch-gradients": ("docs/results/vs_torch_cpu.json", vs_torch_gradients_sentence),
    "bench-layer": ("docs/results/bench_layer_cpu_gpt3-125m_s512.json", bench_layer_table),
    "zero-bubble-sim": (("docs/results/zero_bubble_sim_p4_m8.json", "docs/results/zero_bubble_sim_p8_m32.json"),
                        zero_bubble_table),
    "vshape-sim": (("docs/results/vshape_p4_m8.json", "docs/results/vshape_p8_m32.json",
                    "docs/results/vshape_1f1b_p4_m8.json", "docs/results/vshape_1f1b_p8_m32.json"), vshape_table),
    "trace-vs-sim-loaded": (TRACES[0], trace_vs_sim_table),
    "trace-vs-sim-loaded-iters11": (TRACES[1], trace_vs_sim_table),
    "trace-vs-sim-quiet": (TRACES[2:], trace_vs_sim_pair_table),
    "trace-clock-bound": (TRACES, trace_clock_bound),
    "trace-loaded-within": (TRACES[0], traces.within_target),
    "trace-loaded-iters11-within": (TRACES[1], traces.within_target),
    "trace-loaded-spread": (TRACES[:2], traces.bubble_spread),
    "trace-loaded-above": (TRACES[:2], traces.trace_above),
    "trace-loaded-blocked": (TRACES[:2], traces.blocked_delay),
    "trace-loaded-round-trip": (TRACES[:2], traces.link_round_trip),
    "trace-loaded-executor-share": (TRACES[:2], traces.executor_share),
    "trace-quiet-p2-errors": (TRACES[3], traces.errors_at(2)),
    "trace-quiet-p2-within": (TRACES[2], traces.outside_target_at(2)),
    "trace-quiet-blocked": (TRACES[2:], traces.blocked_delay),
    "trace-quiet-p4-within": (TRACES[2], traces.within_at(4)),
    "trace-quiet-p4-above": (TRACES[2:], traces.above_outside_first(4)),
    "sim-1f1b-bubble-p4-m8": ("docs/results/zero_bubble_sim_p4_m8.json", sim.bubble_of("1f1b")),
    "sim-interleaved-bubble-p4-m8": ("docs/results/vshape_p4_m8.json", sim.bubble_of("interleaved-1f1b")),
    "sim-interleaved-peak-p4-m8": ("docs/results/vshape_p4_m8.json", sim.rank0_peak_of("interleaved-1f1b")),
    "sim-gis-h-peak-p4-m8-v4": ("docs/results/pipeoffload_sim_p4_m8.json",
                                sim.peaks_against("gis-h", "interleaved-1f1b")),
    "sim-gis-makespan-p4-m8-v4": ("docs/results/pipeoffload_sim_p4_m8.json",
                                  sim.makespans_against("gis", "interleaved-1f1b")),
    "sim-v-half-idle": (("docs/results/vshape_p4_m8.json", "docs/results/vshape_p8_m32.json",
                         "docs/results/vshape_1f1b_p4_m8.json", "docs/results/vshape_1f1b_p8_m32.json"), sim.v_half_idle),
    "planner-validation-step-errors": ("docs/results/planner_validation.json", validation.step_error_range),
    "planner-validation-step-worst": ("docs/results/planner_validation.json", validation.step_error_worst),
    "planner-validation-spread": ("docs/results/planner_validation.json", validation.iteration_spread),
    "planner-validation-stash": ("docs/results/planner_validation.json", validation.stash_error_largest),
    "planner-validation-hosted": ("docs/results/planner_validation.json", validation.hosted_rank_margin),
    "planner-validation-drift": ("docs/results/planner_validation.json", validation.input_drift),
    "dry-run-1f1b-backward-low": ("docs/results/dry_run_bench_llama3_70b_1f1b.json", dry_prose.backward_low),
    "dry-run-1f1b-backward-transient": ("docs/results/dry_run_bench_llama3_70b_1f1b.json", dry_prose.backward_transient),
    "dry-run-1f1b-optimizer-ranks": ("docs/results/dry_run_bench_llama3_70b_1f1b.json", dry_prose.optimizer_ranks),
    "dry-run-1f1b-optimizer-transient": ("docs/results/dry_run_bench_llama3_70b_1f1b.json", dry_prose.optimizer_transient),
    "dry-run-1f1b-optimizer-low": ("docs/results/dry_run_bench_llama3_70b_1f1b.json", dry_prose.optimizer_low),
    "dry-run-1f1b-fused-vs-foreach": (("docs/results/dry_run_llama3_70b_1f1b_fused.json", "docs/results/dry_run_bench_llama3_70b_1f1b.json"),
                                      dry_prose.fused_against_foreach),
    "dry-run-fused-against-target": ("docs/results/dry_run_bench_llama3_70b_1f1b_fused.json", dry_prose.against_target),
    "dry-run-fused-two-cores": ("docs/results/dry_run_bench_llama3_70b_1f1b_fused.json", dry_prose.two_idle_cores),
    "dry-run-profile-shares": ("docs/results/dry_run_profile_llama3_70b_m8_one_mode.json", dry_prose.profile_shares),
    "dry-run-profile-parts": ("docs/results/dry_run_profile_llama3_70b_m8_fast_dispatch.json", dry_prose.profile_parts),
    "dry-run-speed-pairs": ("docs/results/dry_run_speed_ab_llama3_70b_m8.json", dry_prose.speed_pairs),
    "dry-run-fast-two-cores": ("docs/results/dry_run_bench_llama3_70b_1f1b_fast_dispatch.json", dry_prose.two_idle_cores),
    "dry-run-fast-against-target": ("docs/results/dry_run_bench_llama3_70b_1f1b_fast_dispatch.json", dry_prose.against_target),
    "dry-run-fast-cores-used": ("docs/results/dry_run_bench_llama3_70b_1f1b_fast_dispatch.json", dry_prose.cores_used),
    "dry-run-fast-per-rank": ("docs/results/dry_run_bench_llama3_70b_1f1b_fast_dispatch.json", dry_prose.per_rank_seconds),
    "dry-run-meta-stash-ratio": ("docs/results/dry_run_device_llama3_70b_m8.json", dry_prose.meta_stash_ratio),
    "2bw-sim": (tuple(f"docs/results/2bw_sim_p{p}_m{m}.json" for p, m in ((2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16))),
                sim.two_bw_table),
    "trends-bpipe": ("docs/results/reproduce_bpipe.json", trends_of("bpipe")),
    "trends-bpipe-reeval": ("docs/results/reproduce_quick.json", trends_of("bpipe-reeval")),
    "trends-pipeoffload": ("docs/results/reproduce_quick.json", trends_of("pipeoffload")),
    "trends-2bw": ("docs/results/reproduce_quick.json", trends_of("2bw")),
    "trends-breadth-first": ("docs/results/reproduce_quick.json",
                             trends_of("breadth-first", lambda trend: trend.startswith("breadth-first"))),
    "trends-layered": ("docs/results/reproduce_quick.json",
                       trends_of("breadth-first", lambda trend: not trend.startswith("breadth-first"))),
    "stash-trends-farthest": ("docs/results/reproduce_quick.json", farthest_stash_trend),
    "mutation-headline": ("docs/results/mutation.json", mutation_table),
    "soak": ("docs/results/soak_short_cpu.json", soak_table),
    "planner-validation": ("docs/results/planner_validation.json", planner_validation_table),
    "pipeoffload-sim": ("docs/results/pipeoffload_sim_p4_m8.json", offload_table),
    "layered-traffic": ("docs/results/layered_traffic_cpu.json", layered_traffic_table),
    "plan-output": ("docs/results/plan_gpt3_13b_32xa100.json", plan_output),
    "demo-validation": ("docs/results/demo_metrics.jsonl", demo_validation_sentence),
    "bench-layer-reading": ("docs/results/bench_layer_cpu_gpt3-125m_s512.json", bench_layer_reading),
    "vs-torch-memory": ("docs/results/vs_torch_cpu.json", vs_torch_memory_sentence),
    "schedule-build": ("docs/results/schedule_build_constant_factors.json", schedule_build_table),
    "bpipe-build-p48": ("docs/results/bpipe_build_p48.json", bpipe_build_table),
    "plot-schedule-scale": ("docs/results/plot_schedule_scale_linear_comm.json", plot_schedule_table),
    "bench-mfu-tiny": ("docs/results/bench_mfu_tiny_cpu.json", bench_mfu_output),
    "emulate-targets": (EMULATED, emulate_targets),
    "emulate-load": (EMULATED, emulate_load),
    "emulate-path-cost": (EMULATED, emulate_path_cost),
    "emulate-gap": (EMULATED, emulate_gap),
    "emulate-over-cost": (EMULATED, emulate_over_cost),
    "emulate-share": (EMULATED, emulate_share),
    "emulate-ratio-spread": (EMULATED, emulate_ratio_spread),
    "emulate-zb-h1-wins": (EMULATED, emulate_zb_h1_wins),
    "emulate-step-within": (EMULATED, emulate_step_within),
    "schedule-build-growth": ("docs/results/schedule_build_constant_factors.json", bench.build_growth_sentence),
    "schedule-build-actions": ("docs/results/schedule_build_constant_factors.json", bench.build_actions),
    "plot-schedule-size": ("docs/results/plot_schedule_scale_linear_comm.json", bench.plot_size_sentence),
    "plot-schedule-wall": ("docs/results/plot_schedule_scale_linear_comm.json", bench.plot_wall_sentence),
    "bench-mfu-spread": ("docs/results/bench_mfu_tiny_cpu.json", bench.mfu_spread),
    "vs-torch-cpu-same": ("docs/results/vs_torch_cpu.json", bench.vs_torch_cpu_sentence("1f1b", "interleaved-1f1b")),
    "vs-torch-cpu-zb": ("docs/results/vs_torch_cpu.json", bench.vs_torch_cpu_sentence("zb-h1", "zb-v")),
    "vs-torch-identical": ("docs/results/vs_torch_cpu.json", bench.vs_torch_identical),
    "vs-torch-profile": ("docs/results/vs_torch_cpu.json", bench.vs_torch_profile_sentence),
    "layered-traffic-sentence": ("docs/results/layered_traffic_cpu.json", bench.layered_traffic_sentence),
    "layered-weights-sentence": ("docs/results/layered_traffic_cpu.json", bench.layered_weights_sentence),
    "bpipe-acceptor-pairs": ("docs/results/bpipe_acceptor_cpu.json", bench.acceptor_pairs_sentence),
    "reproduction-glance": ("docs/results/reproduce_full.json", glance.glance_table),
    "pipeoffload-bytes-error": ("docs/results/reproduce_full.json",
                                glance.glance_figure("pipeoffload", "absolute activation bytes (1F1B-I, GIS, GIS-H, 1F1B):")),
    "pipeoffload-mfu-error": ("docs/results/reproduce_full.json", glance.glance_figure("pipeoffload", "MFU (uncalibrated):")),
    "pipeoffload-pp-over-tp8": ("docs/results/reproduce_full.json", glance.glance_figure("pipeoffload", "PP over TP8:")),
    # docs/reproduction.md, "Where the model is wrong, and why": the rows each paragraph discusses.
    "repro-po-bytes-per-h": (FULL, glance.rows_text("pipeoffload", r"^10\.5B seq 4k 1f1b-i: saved bytes",
                                                    "{published}; ours {predicted}")),
    "repro-po-parameters": (FULL, glance.rows_text("pipeoffload", r"B parameters \(Table 2",
                                                   "{published}: {predicted}", "; ")),
    "repro-po-llama-error": (FULL, glance.rows_text("pipeoffload", r"^10\.5B seq 4k 1f1b-i activation if", "{error}")),
    "repro-po-1f1bi-error": (FULL, glance.rows_text("pipeoffload", r"^10\.5B seq 4k 1f1b-i activation$", "{error}")),
    "repro-po-ratios": (FULL, glance.rows_text("pipeoffload", r"^10\.5B seq 4k (?P<tag>gis|gis-h|1f1b) activation / 1F1B-I$",
                                               "{tag} {predicted} vs {published}")),
    "repro-po-poh-ratio": (FULL, glance.rows_text("pipeoffload", r"^10\.5B seq 4k po-h activation / 1F1B-I$",
                                                  "{predicted} vs {published}")),
    "pipeoffload-k-error": (FULL, glance.glance_figure("pipeoffload", "k:")),
    "repro-po-k-10b": (FULL, glance.rows_text("pipeoffload", r"^10\.5B seq 4k: k,", "{predicted} against {published}")),
    "repro-po-k-43b": (FULL, glance.rows_text("pipeoffload", r"^42\.9B seq 4k: k,", "{predicted}")),
    "repro-po-43b-ratios": (FULL, glance.rows_text("pipeoffload", r"^42\.9B seq 4k (?P<tag>po-h|po-f) activation / 1F1B-I$",
                                                   "{tag} {predicted} vs {published}")),
    "repro-po-fig10": (FULL, glance.rows_text("pipeoffload", r"^5\.8B seq 8k", "{predicted} (the paper: {published})")),
    "repro-po-mfu-short": (FULL, glance.rows_errors("pipeoffload", r"seq (4|8)k .*MFU$")),
    "repro-po-mfu-long": (FULL, glance.rows_errors("pipeoffload", r"seq (16|32)k .*MFU$")),
    "repro-po-gis-mfu": (FULL, glance.rows_errors("pipeoffload", r" (gis|1f1b-i) MFU$")),
    "repro-reeval-mfu": (FULL, glance.rows_text("bpipe-reeval", r"^GPT-3 96B, unfused attention: single-layer MFU")),
    "repro-reeval-configured": (FULL, glance.glance_figure("bpipe-reeval", "as configured:")),
    "repro-bpipe-configured": (FULL, glance.glance_figure("bpipe", "`bpipe` as configured:")),
    "repro-bpipe-best": (FULL, glance.glance_figure("bpipe", "best against best (b ≤ 4, any recompute):")),
    "repro-bpipe-node": (FULL, glance.glance_figure("bpipe", "without selective recompute and with pairs on one node:")),
    "repro-2bw-flush": (FULL, glance.glance_figure("2bw", "over Flush:")),
    "repro-2bw-gpipe": (FULL, glance.glance_figure("2bw", "over GPipe:")),
    "repro-2bw-memory": (FULL, glance.rows_text("2bw", r"worst-worker memory, (?P<tag>pipedream-flush|2bw)",
                                                "{error} for {tag}", " and ")),
    "repro-bf-gains": (FULL, glance.rows_text("breadth-first", r"gain over our (?P<tag>\S+) at the same layout",
                                              "{predicted} over our {tag}", "; ")),
    "repro-layered-time": (FULL, glance.rows_text("layered", r"^Shortest training time", "{predicted}, {error}")),
    "repro-layered-depth-first": (FULL, glance.rows_text("layered", r"^Same, against the looping placement")),
    "repro-layered-larger": (FULL, glance.rows_text("layered", r"^Gain over 1F1B at larger batches")),
    "repro-layered-bytes": (FULL, glance.rows_text("layered", r"^Data movement")),
    "repro-layered-link": (FULL, glance.rows_text("layered", r"^Network: slowest")),
    "repro-layered-slow": (FULL, glance.rows_text("layered", r"^Network: step time")),
    "repro-layered-memory": (FULL, glance.rows_text("layered", r"^Memory with ZeRO")),
    "bpipe-estimate-48gpu": (bp.VARIANTS_48, bp.estimate_48gpu_table),
    "bpipe-estimate-usage": ("docs/results/estimate_bpipe_gpt3_13b.json", bp.estimate_printout),
    "bpipe-estimate-one-node": (tuple(bp.ONE_NODE), bp.estimate_one_node_table),
    "bpipe-estimate-reserve": (bp.RESERVE, bp.reserve_table),
    "bpipe-recompute-cost": ((ESTIMATE("96b_modern_pairs_node"), ESTIMATE("96b_flash_modern_pairs_node")),
                             bp.recompute_cost_sentence),
    "bpipe-transfer-wait": (ESTIMATE("96b_classic_pairs_ib"), bp.transfer_wait_sentence),
    "bpipe-134b-no-fit": (ESTIMATE("134b_classic_pairs_ib"), bp.no_fit_sentence),
    "bpipe-96b-modern-4-12-1": (ESTIMATE("96b_modern_pairs_node"), bp.layout_speedup),
    "bpipe-worst-rank": ("docs/results/reproduce_bpipe.json", bp.worst_rank_sentence),
    "bpipe-variant-steps": ("docs/results/reproduce_bpipe.json", bp.variant_step_sentence),
    "bpipe-k2-before": ("docs/results/reproduce_quick.json",
                        bp.trend_row_sentence("BPipe: peak stash per rank, bpipe K=2")),
    "bpipe-k2-worst-before": ("docs/results/reproduce_quick.json",
                              bp.trend_row_sentence("BPipe: worst-rank stash, BPipe (K=2) / 1F1B")),
}


# docs/planner.md, docs/bpipe.md: the planner and BPipe held to the dry run ---------------------------------


def planner_vs_dry_run_table(data: dict) -> str:
    """tools/validate_planner.py --dry-run-json: per pipeline rank, the dry run's peak and where it fell
    beside the planner's peak and its phase, and their ratio."""
    rows = []
    for result in data["results"]:
        for r in result["ranks"]:
            rows.append([str(r["pipeline_rank"]), num(r["measured_peak_bytes"] / 2**30), r["measured_peak_at"],
                         num(r["predicted_peak_bytes"] / 2**30), r["predicted_phase"],
                         num(r["predicted_optimizer_step_bytes"] / 2**30),
                         num(r["predicted_over_measured"], 4)])
    return table(["pp rank", "dry run peak GiB", "dry run peak at", "planner GiB", "planner's peak in",
                  "planner's optimizer-step term GiB", "planner / dry run"], rows)


RENDERERS["planner-vs-dry-run"] = ("docs/results/planner_vs_dry_run_llama3_70b.json", planner_vs_dry_run_table)


def _planner_gap(data: dict, phase: str) -> list[tuple[float, int]]:
    """(1 - predicted / measured, measured - predicted bytes) of the ranks whose measured peak is in `phase`."""
    return [(1 - r["predicted_over_measured"], r["measured_peak_bytes"] - r["predicted_peak_bytes"])
            for result in data["results"] for r in result["ranks"] if r["measured_phase"] == phase]


def planner_low_in_backward(data: dict) -> str:
    """How low the planner is on the ranks that peak in the pipeline (backward): 'a% to b%'."""
    gaps = sorted(g for g, _ in _planner_gap(data, "pipeline"))
    lo, hi = pct(gaps[0], 1), pct(gaps[-1], 1)
    return lo if lo == hi else f"{lo} to {hi}"


def planner_low_in_optimizer(data: dict) -> str:
    """How low the planner is on the ranks that peak in the optimizer step: 'x MiB (y%)', the larger of them."""
    gap, low = max(_planner_gap(data, "optimizer"))
    return f"{mib(low, 1)} MiB ({pct(gap, 2)})"


RENDERERS["planner-low-in-backward"] = ("docs/results/planner_vs_dry_run_llama3_70b.json", planner_low_in_backward)
RENDERERS["planner-low-in-optimizer"] = ("docs/results/planner_vs_dry_run_llama3_70b.json", planner_low_in_optimizer)


BPIPE_DRY_RUNS = ("docs/results/bpipe_dry_run_96b_p4.json", "docs/results/bpipe_dry_run_96b_p8_80layers.json",
                  "docs/results/bpipe_dry_run_96b_p8.json")
RENDERERS["bpipe-dry-run"] = (BPIPE_DRY_RUNS, bp.dry_run_bound_table)
RENDERERS["bpipe-dry-run-worst"] = (BPIPE_DRY_RUNS, bp.dry_run_worst_sentence)
RENDERERS["bpipe-dry-run-gap"] = (BPIPE_DRY_RUNS, bp.dry_run_gap_sentence)
RENDERERS["bpipe-dry-run-cpu"] = (BPIPE_DRY_RUNS, bp.dry_run_cpu_sentence)
RENDERERS["bpipe-dry-run-batch"] = (BPIPE_DRY_RUNS, bp.dry_run_batch_sentence)
RENDERERS["bpipe-dry-run-totals"] = (BPIPE_DRY_RUNS, bp.dry_run_total_sentence)


# docs/dry_run.md: full-size configurations through the dry run (tools/dry_run_table.py) ---------------------
from doc_renderers_dry_run import dry_run_ranks_table, dry_run_time_sentence  # noqa: E402

RENDERERS["dry-run-llama3-70b-1f1b"] = ("docs/results/dry_run_bench_llama3_70b_1f1b.json", dry_run_ranks_table)
from doc_renderers_zb import zero_bubble_ranks_table  # noqa: E402
RENDERERS["dry-run-llama3-70b-zero-bubble"] = (("docs/results/dry_run_llama3_70b_zb_h1.json", "docs/results/dry_run_llama3_70b_zb_h1_middle.json", "docs/results/dry_run_llama3_70b_zb_v.json", "docs/results/dry_run_llama3_70b_v_half.json"), zero_bubble_ranks_table)
import doc_renderers_dry_run as dry_run_docs  # noqa: E402

_FULL_SIZE = tuple(f"docs/results/dry_run_{name}.json" for name in (
    "llama3_70b_1f1b_fused", "gpt3_175b_1f1b", "gpt3_175b_1f1b_middle", "llama3_70b_interleaved",
    "llama3_70b_interleaved_middle", "llama3_70b_gpipe", "llama3_70b_gpipe_middle", "llama3_70b_po_h",
    "llama3_70b_po_h_middle", "llama3_70b_recompute_full", "llama3_70b_recompute_full_middle",
    "llama3_70b_recompute_selective", "llama3_70b_recompute_selective_middle", "llama3_70b_dp2_zero1",
    "llama3_70b_dp2_zero1_middle", "llama3_70b_looped_bfs_layered", "llama3_70b_looped_bfs_layered_middle"))
RENDERERS["dry-run-full-size"] = (_FULL_SIZE, dry_run_docs.dry_run_measured_table)
RENDERERS["dry-run-full-size-2bw"] = ("docs/results/dry_run_llama3_70b_2bw.json", dry_run_docs.dry_run_measured_table)
RENDERERS["planner-vs-dry-runs"] = ("docs/results/planner_vs_dry_run_full_size.json",
                                    dry_run_docs.planner_vs_dry_runs_table)
RENDERERS["planner-vs-dry-runs-range"] = ("docs/results/planner_vs_dry_run_full_size.json",
                                          dry_run_docs.planner_vs_dry_runs_range)
RENDERERS["dry-run-device"] = ("docs/results/dry_run_device_llama3_70b_m8.json", dry_run_docs.dry_run_device_sentence)
RENDERERS["dry-run-time-fused"] = ("docs/results/dry_run_bench_llama3_70b_1f1b_fused.json", dry_run_time_sentence)
RENDERERS["dry-run-time-fast"] = ("docs/results/dry_run_bench_llama3_70b_1f1b_fast_dispatch.json", dry_run_time_sentence)


# docs/schedules.md, emulated compute: per-p figures of the grids and the planner's full-size plans ----------
import doc_renderers_emulate as emulate  # noqa: E402

RENDERERS["emulate-load-per-p"] = (EMULATED, emulate.emulate_load_per_p)
RENDERERS["emulate-bubble-only"] = (EMULATED, emulate.emulate_bubble_only_misses)
RENDERERS["emulate-claims-shown"] = (EMULATED, emulate.emulate_claims_shown)
RENDERERS["emulate-grid"] = (EMULATED, emulate.emulate_grid_table)
RENDERERS["emulate-ratios"] = (EMULATED, emulate.emulate_ratios_table)
RENDERERS["emulate-calibration"] = (EMULATED, emulate.emulate_calibration_table)
RENDERERS["emulate-ideal-targets"] = (EMULATED, emulate.emulate_ideal_targets)
RENDERERS["emulate-misses"] = (EMULATED, emulate.emulate_misses)
RENDERERS["emulate-list-calibration"] = (EMULATED, emulate.emulate_list_calibration_table)
RENDERERS["emulate-crowding"] = (EMULATED, emulate.emulate_crowding_table)
RENDERERS["emulate-common-targets"] = (EMULATED, emulate.emulate_common_targets)
RENDERERS["emulate-plans"] = ("docs/results/emulate_plans.json", emulate.emulate_plans_table)
RENDERERS["emulate-plans-early"] = ("docs/results/emulate_plans.json", emulate.emulate_plans_early_receives)
RENDERERS["emulate-replay"] = (("docs/results/emulate_replay_p8.json", "docs/results/emulate_replay_p16.json",
                                "docs/results/emulate_replay_p8_zb_v.json"),
                               emulate.emulate_replay_table)
RENDERERS["emulate-median-targets"] = (EMULATED, emulate.emulate_median_targets)


# docs/data.md, README.md: the demo corpus's counts (python -m megatron_pp.data.demo_corpus ... --stats-json) ----
import doc_renderers_data as data_docs  # noqa: E402

RENDERERS["demo-corpus-mb"] = ("docs/results/demo_corpus.json", data_docs.demo_corpus_megabytes)
RENDERERS["demo-corpus-size"] = ("docs/results/demo_corpus.json", data_docs.demo_corpus_size)
RENDERERS["demo-corpus-tokens"] = ("docs/results/demo_corpus.json", data_docs.demo_corpus_tokens)
RENDERERS["split-backward-load"] = ("docs/results/split_backward_cpu.json", data_docs.load_at_start)
RENDERERS["schedule-build-load"] = ("docs/results/schedule_build_constant_factors.json", data_docs.load_start_to_end)
RENDERERS["planner-backward-working-set"] = ("docs/results/planner_vs_dry_run_full_size.json",
                                             data_docs.planner_backward_working_set)
RENDERERS["planner-high-on-last-rank"] = ("docs/results/planner_vs_dry_run_full_size.json", data_docs.planner_high_on_last_rank)
RENDERERS["planner-po-h-last-rank"] = ("docs/results/planner_vs_dry_run_full_size.json", data_docs.planner_po_h_last_rank)
RENDERERS["plan-best-mfu"] = ("docs/results/plan_gpt3_13b_32xa100.json", data_docs.plan_best_mfu)
_MATRIX, _PROBE = "docs/results/interaction_matrix.json", "docs/results/interaction_step1_update.json"
RENDERERS["matrix-outcomes"] = (_MATRIX, data_docs.matrix_outcomes)
RENDERERS["matrix-default-run"] = (_MATRIX, data_docs.matrix_default_run)
RENDERERS["matrix-low-precision-margin"] = (_MATRIX, data_docs.matrix_low_precision_margin)
RENDERERS["matrix-fp32-norm"] = (_MATRIX, data_docs.matrix_fp32_norm)
RENDERERS["matrix-larger-draw"] = ("docs/results/interaction_matrix_seed11x2.json", data_docs.matrix_larger_draw)
RENDERERS["probe-norm-miss"] = (_PROBE, data_docs.probe_norm_miss)
RENDERERS["probe-elements"] = (_PROBE, data_docs.probe_elements)
RENDERERS["probe-gradient-range"] = (_PROBE, data_docs.probe_gradient_range)
RENDERERS["probe-gradient-difference"] = (_PROBE, data_docs.probe_gradient_difference)
RENDERERS["probe-model-error"] = (_PROBE, data_docs.probe_model_error)
RENDERERS["probe-same-without"] = (_PROBE, data_docs.probe_same_without)
RENDERERS["probe-own-weights"] = (_PROBE, data_docs.probe_own_weights)
RENDERERS["bpipe-exec-p8-m8"] = ("docs/results/bpipe_sim_p8_m8.json", data_docs.bpipe_exec_table)


# docs/reliability.md, each round's changes: the current --since mutation sample beside the previous one -------
import doc_renderers_mutation as mutation  # noqa: E402

RENDERERS["mutation-since"] = (("docs/results/mutation_since_9821f81_seed46.json",
                                "docs/results/mutation_since_9821f81_seed45.json"), mutation.since_table)


# docs/dry_run.md, --overlap-param-gather at full size: with it against without it, and the planner ----------
import doc_renderers_param_gather as param_gather  # noqa: E402

RENDERERS["dry-run-overlap-param-gather"] = (("docs/results/dry_run_llama3_70b_dp2_zero1.json",
                                              "docs/results/dry_run_llama3_70b_dp2_zero1_overlap.json"),
                                             param_gather.overlap_peak_change)
RENDERERS["dry-run-overlap-interleaved"] = (("docs/results/dry_run_llama3_70b_interleaved_dp2.json",
                                             "docs/results/dry_run_llama3_70b_interleaved_dp2_overlap.json"),
                                            param_gather.overlap_peak_change)
RENDERERS["dry-run-overlap-interleaved-planner"] = ("docs/results/dry_run_llama3_70b_interleaved_dp2_overlap.json",
                                                    param_gather.planner_against_overlap)
