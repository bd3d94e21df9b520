"""The renderers of docs/bpipe.md's estimator tables and of the BPipe figures in docs/reproduction.md
(dev/doc_renderers.py registers them; dev/doc_format.py formats).

Each estimator JSON is what `tools/estimate_bpipe.py ... --json` wrote: a list of one report per layout
(`job`, `best_plain`, `best_bpipe`, `speedup`, `candidates` as rows of `candidate_fields`). The tool picks the
best 1F1B and the best BPipe configuration of each layout; across layouts the renderers take the fastest of
those recorded bests, as the tool's own `--all-layouts` summary does, and S is the ratio of the two recorded
steps. Nothing else is computed here.
"""
from __future__ import annotations

import re

from doc_format import num, pct, table


def layout(report: dict) -> str:
    """'(4,12,1)': the report's (tp, pp, dp)."""
    job = report["job"]
    return f"({job['tp']},{job['pp']},{job['dp']})"


def config(best: dict, bound: bool = False) -> str:
    """'b=1 none K=8' (K only for a BPipe configuration, when `bound`)."""
    text = f"b={best['micro_batch_size']} {best['recompute']}"
    return text + (f" K={best['resident_bound']}" if bound else "")


def peak_gib(candidate: dict) -> str:
    """The largest stage peak in GiB, one decimal: '69.9'."""
    return num(max(candidate["stage_peak_bytes"]) / 2**30, 1)


def fastest(reports: list, side: str):
    """The report and configuration with the shortest recorded step among the layouts' `side` bests
    ('best_plain' or 'best_bpipe'); (None, None) where nothing fits."""
    found = [(r, r[side]) for r in reports if r[side]]
    return min(found, key=lambda pair: pair[1]["step_s"]) if found else (None, None)


def candidate(report: dict, micro_batch_size: int, recompute: str, bpipe: bool) -> dict | None:
    """One recorded candidate of a report, as a dict of its fields."""
    for row in report["candidates"]:
        c = dict(zip(report["candidate_fields"], row))
        if (c["micro_batch_size"], c["recompute"], c["bpipe"]) == (micro_batch_size, recompute, bpipe):
            return c
    return None


def retuned(reports: list) -> tuple[str, str, str]:
    """Best 1F1B, best BPipe and S over all layouts of one `--all-layouts` run, as table cells."""
    (rp, plain), (rb, bpipe) = fastest(reports, "best_plain"), fastest(reports, "best_bpipe")
    plain_cell = f"{layout(rp)}: {config(plain)}, {num(plain['step_s'])} s" if plain else "nothing fits"
    if bpipe is None:
        return plain_cell, "nothing fits", "—"
    same = plain is not None and rp is rb and config(plain) == config(bpipe)
    if same:
        bpipe_cell = f"same, K={bpipe['resident_bound']}" + (
            "" if bpipe["step_s"] == plain["step_s"] else f", {num(bpipe['step_s'])} s")
    else:
        bpipe_cell = f"{layout(rb)}: {config(bpipe, True)}, {num(bpipe['step_s'])} s"
    if bpipe["transfer_overhead_s"] > 0:
        bpipe_cell += f" ({num(bpipe['transfer_overhead_s'])} s waiting for transfers)"
    return plain_cell, bpipe_cell, (num(plain["step_s"] / bpipe["step_s"]) if plain else "only BPipe fits")


def best_one_layout(reports: list) -> str:
    """The largest recorded per-layout S and what BPipe changes there: '1.33 at (4,12,1): b=1 none K=8
    against b=1 full'; just the S where no layout gains."""
    scored = [r for r in reports if isinstance(r["speedup"], (int, float))]
    if not scored:
        return "—"
    best = max(scored, key=lambda r: r["speedup"])
    if round(best["speedup"], 2) <= 1.0:
        return num(best["speedup"]) + ("" if len(reports) > 1 else f" (one layout: {layout(best)})")
    return (f"{num(best['speedup'])} at {layout(best)}: {config(best['best_bpipe'], True)} against "
            f"{config(best['best_plain'])}")


PAPERS_48 = {"gpt3_96b": ("GPT-3 96B", "BPipe: 1.25–2.17×"), "gpt3_134b": ("GPT-3 134B", "BPipe: 1.25–2.17×"),
             "gpt3_96b_flash": ("GPT-3 96B", "re-eval: negligible"), "llama_65b": ("LLaMA-65B", "re-eval: none")}
"""Per MODEL of the file names: the model's name and the published claim it is judged against (docs/bpipe.md)."""

VARIANTS_48 = tuple(f"docs/results/estimate_bpipe_48gpu_{model}_{megatron}_pairs_{pairs}.json"
                    for model in PAPERS_48 for megatron in ("classic", "modern") for pairs in ("ib", "node"))


def _merge(rows: list[list[str]], column: int, word: str) -> list[list[str]]:
    """Adjacent rows equal but for `column` become one, that cell reading `word` ('either')."""
    out: list[list[str]] = []
    for row in rows:
        prev = out[-1] if out else None
        if prev and all(a == b for i, (a, b) in enumerate(zip(prev, row)) if i != column):
            prev[column] = word
        else:
            out.append(list(row))
    return out


def estimate_48gpu_table(*runs: list) -> str:
    """The 16 `--all-layouts 48` runs of docs/bpipe.md (VARIANTS_48, in order): per model, Megatron flavour
    and pair placement, the re-tuned best of each side, S, and the best single layout; rows that agree but
    for the pairs (then the flavour) are merged."""
    rows = []
    for path, reports in zip(VARIANTS_48, runs):
        model, megatron, pairs = re.fullmatch(r".*_48gpu_(.+)_(classic|modern)_pairs_(ib|node)\.json", path).groups()
        name, papers = PAPERS_48[model]
        rows.append([name, reports[0]["job"]["attention"], megatron,
                     "across nodes" if pairs == "ib" else "on a node", *retuned(reports),
                     best_one_layout(reports), papers])
    rows = _merge(_merge(rows, 3, "either"), 2, "classic or modern")
    return table(["model", "attention", "Megatron", "pairs", "best 1F1B (tp,pp,dp): config, step", "best BPipe",
                  "S re-tuned", "best one layout", "papers"], rows)


ONE_NODE = {"docs/results/estimate_bpipe_gpt3_13b.json": "GPT-3 13B",
            "docs/results/estimate_bpipe_gpt3_13b_selective.json": "GPT-3 13B",
            "docs/results/estimate_bpipe_gpt3_13b_flash.json": "GPT-3 13B",
            "docs/results/estimate_bpipe_llama2_13b_flash.json": "LLaMA-2 13B"}
"""The single-node runs of docs/bpipe.md and the published model each one's shape is."""


def _model_name(name: str, report: dict) -> str:
    """'GPT-3 13B (40 × 5120, 40 heads, s 2048)': the name and the shape the run used."""
    c = report["job"]["config"]
    return f"{name} ({c['num_layers']} × {c['hidden_size']}, {c['num_attention_heads']} heads, s {c['seq_length']})"


def estimate_one_node_table(*runs: list) -> str:
    """The single-node runs (ONE_NODE): per model and recompute options, the best of each side (with its
    largest stage peak), S, and what 1F1B needs at b = 1 without recomputation."""
    rows = []
    for (path, name), (report,) in zip(ONE_NODE.items(), runs):
        plain, bpipe = report["best_plain"], report["best_bpipe"]
        options = sorted({c[report["candidate_fields"].index("recompute")] for c in report["candidates"]},
                         key=("none", "selective", "full").index)
        bare = candidate(report, 1, "none", False)
        rows.append([_model_name(name, report), report["job"]["attention"], ", ".join(options),
                     f"{config(plain)}: {peak_gib(plain)} GiB, {num(plain['step_s'])} s",
                     f"{config(bpipe, True)}: {peak_gib(bpipe)} GiB, {num(bpipe['step_s'])} s",
                     num(report["speedup"]),
                     f"{peak_gib(bare)} GiB ({'fits' if bare['fits'] else 'does not fit'})",
                     f"`{path.split('/')[-1]}`"])
    return table(["model", "attention", "recompute options", "best 1F1B: peak, step", "best BPipe: peak, step",
                  "S", "1F1B at b=1 without recompute: peak", "JSON"], rows)


RESERVE = tuple(f"docs/results/estimate_bpipe_{case}{suffix}.json"
                for case in ("gpt3_13b", "48gpu_gpt3_96b_classic_pairs_node")
                for suffix in ("_reserve_0.05", "", "_reserve_0.15"))


def reserve_table(*runs: list) -> str:
    """S re-tuned at reserves of 5%, 10% (the tables above) and 15% for the two cases of RESERVE, with the
    best 1F1B configuration each S is measured against."""
    cases = ("GPT-3 13B, 8 GPUs, unfused, none/full",
             "GPT-3 96B, 48 GPUs, unfused, classic, pairs on a node, re-tuned")
    rows = []
    for i, case in enumerate(cases):
        cells = []
        for reports in runs[3 * i: 3 * i + 3]:
            plain, _, speedup = retuned(reports)
            cells.append(f"{speedup} (1F1B {plain.split(', ')[0]})")
        rows.append([case, *cells])
    return table(["case", "reserve 5%", "10%", "15%"], rows)


def at_layout(reports: list, where: str) -> dict:
    """The report of one layout, '(4,12,1)'."""
    (report,) = [r for r in reports if layout(r) == where]
    return report


def recompute_cost_sentence(unfused: list, flash: list) -> str:
    """What recomputation costs the 96B step at b = 1 and (4,12,1), from the modern runs (which try all
    three): '24.91 s against 18.77 s without (1.33×); selective 19.29 s (1.03×; with flash 1.005×)'."""
    steps = {}
    for name, reports in (("unfused", unfused), ("flash", flash)):
        report = at_layout(reports, "(4,12,1)")
        steps[name] = {r: candidate(report, 1, r, False)["step_s"] for r in ("none", "selective", "full")}
    u, f = steps["unfused"], steps["flash"]
    return (f"full {num(u['full'])} s against {num(u['none'])} s without ({num(u['full'] / u['none'])}×); "
            f"selective {num(u['selective'])} s ({num(u['selective'] / u['none'])}×; with flash "
            f"{num(f['selective'] / f['none'], 3)}×)")


def transfer_wait_sentence(reports: list) -> str:
    """The 96B run with pairs across InfiniBand at (4,12,1): BPipe without recomputation fits but waits;
    '40.45 s, of which 21.69 s waits for transfers (b=1 none K=8), against 24.91 s for 1F1B (b=1 full)'."""
    report = at_layout(reports, "(4,12,1)")
    bpipe, plain = candidate(report, 1, "none", True), report["best_plain"]
    return (f"{num(bpipe['step_s'])} s, of which {num(bpipe['transfer_overhead_s'])} s waits for transfers "
            f"({config(bpipe, True)}), against {num(plain['step_s'])} s for 1F1B ({config(plain)})")


def no_fit_sentence(reports: list) -> str:
    """The 134B run at (4,12,1) without recomputation, with BPipe: 'stage 0 at 86.6 GiB of 72.0 usable
    (b=1 none K=7)'."""
    report = at_layout(reports, "(4,12,1)")
    bpipe = candidate(report, 1, "none", True)
    peaks = bpipe["stage_peak_bytes"]
    return (f"stage {peaks.index(max(peaks))} at {peak_gib(bpipe)} GiB of {num(report['capacity_bytes'] / 2**30, 1)} "
            f"usable ({config(bpipe, True)})")


def layout_speedup(reports: list) -> str:
    """The recorded S of the (4,12,1) layout alone: '1.03'."""
    return num(at_layout(reports, "(4,12,1)")["speedup"])


def worst_rank_sentence(data: dict) -> str:
    """`reproduce.py bpipe`'s measured worst rank against 1F1B's rank 0, per K and p: '0.79 (K=2) and 1.00
    (K=3) at p = 4, 0.75 (K=5) at p = 8'."""
    (report,) = [r for r in data["reports"] if r["paper"] == "bpipe"]
    by_p: dict = {}
    for t in report["trends"]:
        if t["trend"].startswith("BPipe: worst-rank stash"):
            k = re.search(r"K=(\d+)", t["trend"])[1]
            p = re.match(r"pp (\d+)", t["setting"])[1]
            by_p.setdefault(p, []).append(f"{t['measured']} (K={k})")
    return ", ".join(f"{' and '.join(items)} at p = {p}" for p, items in by_p.items())


def trend_row_sentence(label: str):
    """A renderer of one BPipe trend row of `reproduce.py` ('measured, predicted by the simulator')."""
    def render(data: dict) -> str:
        (report,) = [r for r in data["reports"] if r["paper"] == "bpipe"]
        (row,) = [t for t in report["trends"] if t["trend"] == label]
        return f"{row['measured']} measured, {row['predicted']} simulated ({row['setting']})"
    render.__doc__ = f"The trend row '{label}' of the bpipe report: measured and simulated."
    return render


def variant_step_sentence(data: dict) -> str:
    """The configured `bpipe` variants' simulated steps and the 96B speedup from `reproduce.py bpipe`'s rows:
    '40.45 s (96B) and 51.59 s (134B); 0.62× for 96B as configured'."""
    (report,) = [r for r in data["reports"] if r["paper"] == "bpipe"]
    steps = []
    for model in ("96B", "134B"):
        (row,) = [r for r in report["rows"] if r["claim"].startswith(f"GPT-3 {model}, variant `bpipe` ")]
        steps.append(f"{re.search(r'step ([0-9.]+ s)', row['predicted'])[1]} ({model})")
    (speedup,) = [r for r in report["rows"] if r["claim"].startswith("GPT-3 96B: speedup of `bpipe` ")]
    return f"{' and '.join(steps)}; {speedup['predicted']} for 96B as configured"


def estimate_printout(data: list) -> str:
    """What `tools/estimate_bpipe.py` printed for a one-layout run, re-printed by the tool's own `explain`
    from the run's JSON (the estimate rebuilt from its recorded fields, nothing recomputed), in a code
    block. The tool's "layer MFU(b)" line is a roofline evaluation the JSON does not record, so it is
    not part of the block."""
    import dataclasses
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    sys.path.insert(0, os.path.join(root, "tools"))  # the user tool whose printout this is
    import estimate_bpipe as tool
    from megatron_pp.models.config import TransformerConfig
    from megatron_pp.planning.bpipe_estimator import Candidate, Estimate, Job
    from megatron_pp.planning.efficiency import HardwareProfile

    def candidate(fields: dict | None):
        return fields and Candidate(**{**fields, "stage_peak_bytes": tuple(fields["stage_peak_bytes"])})

    (run,) = data
    job = run["job"]
    config = TransformerConfig(**job["config"])
    estimate = Estimate(
        Job(config, job["tp"], job["pp"], job["dp"], job["global_batch_size"], job["attention"],
            sequence_parallel=job["sequence_parallel"], distributed_optimizer=job["distributed_optimizer"]),
        HardwareProfile(**{f.name: run["hardware"][f.name] for f in dataclasses.fields(HardwareProfile)}),
        run["efficiency"], run["capacity_bytes"],
        [candidate(dict(zip(run["candidate_fields"], row))) for row in run["candidates"]],
        candidate(run["best_plain"]), candidate(run["best_bpipe"]), list(run["warnings"]))
    return "```\n" + "\n".join(tool.explain(estimate)) + "\n```"


# docs/bpipe.md, "At full size": tools/bpipe_dry_run.py's JSON per p ---------------------------------------------
def _gib(n_bytes: float) -> str:
    return num(n_bytes / 2**30)


def _setting(run: dict) -> str:
    return f"{run['pp']} ({run['num_layers']} layers, m {run['microbatches']}, K {run['K']})"


def _size(run: dict) -> str:
    """'p = 8 (80 layers)'."""
    return f"p = {run['pp']} ({run['num_layers']} layers)"


def _over_bound(run: dict, stash_bytes: float) -> float:
    """Bytes of `stash_bytes` above the bound, (K + 1)/p of 1F1B's rank-0 stash peak (<= 0: within it)."""
    return stash_bytes - run["bound"] * run["runs"]["1f1b"]["ranks"][0]["stash_peak_bytes"]


def _kib(n_bytes: float) -> str:
    return num(n_bytes / 1024, 0).replace("-", "−")


def dry_run_bound_table(*runs: dict) -> str:
    """Per p and pipeline rank: the stash peaks of 1F1B's and BPipe's dry runs (GiB, the step's batch tensors
    counted apart), of BPipe's the part hosted for the partner, BPipe simulated with 1F1B's per-stage bytes and the
    dry run's difference from it (KiB), the dry run's BPipe peak over 1F1B's rank 0 with its excess over the bound
    (K + 1)/p (KiB), and both schedules' total peaks (every live storage, GiB)."""
    rows = []
    for run in runs:
        one, bp = run["runs"]["1f1b"], run["runs"]["bpipe"]
        rank0 = one["ranks"][0]["stash_peak_bytes"]
        for r, row in enumerate(bp["ranks"]):
            measured, simulated = row["stash_peak_bytes"], bp["simulated_stash_peak_bytes"][r]
            over = _over_bound(run, measured)
            rows.append([_setting(run), str(r), _gib(one["ranks"][r]["stash_peak_bytes"]), _gib(measured),
                         _gib(row["guest_peak_bytes"]), _gib(simulated), _kib(measured - simulated),
                         num(measured / rank0, 3), f"{_kib(over)} KiB over" if over > 0 else "within",
                         _gib(one["ranks"][r]["peak_bytes"]), _gib(row["peak_bytes"])])
    return table(["p", "rank", "1F1B stash peak, dry run GiB", "BPipe stash peak, dry run GiB",
                  "of it hosted for the partner GiB", "BPipe, simulated GiB", "dry run − simulated KiB",
                  "BPipe (dry run) / 1F1B rank 0", "bound (K + 1)/p", "1F1B total peak GiB", "BPipe total peak GiB"],
                 rows)


def dry_run_batch_sentence(*runs: dict) -> str:
    """'rank 0 16 KiB, rank 3 8 KiB (p = 4); ...': per p, the batch bytes one microbatch's stash saves on each rank
    whose stashes save any (the 1F1B dry run's `batch_saved_bytes` over m), counted apart from the stashes."""
    parts = []
    for run in runs:
        ranks = run["runs"]["1f1b"]["ranks"]
        saved = [f"rank {r['pipeline_rank']} {_kib(r['batch_saved_bytes'] / run['microbatches'])} KiB"
                 for r in ranks if r["batch_saved_bytes"]]
        parts.append(f"{', '.join(saved)} ({_size(run)})")
    return "; ".join(parts)


def dry_run_total_sentence(*runs: dict) -> str:
    """'p = 4 (84 layers): rank 0 A GiB under 1F1B, B under BPipe; ...': each p's evicting ranks (those whose
    partner hosts stashes) and their total peaks (every live storage) under both schedules."""
    parts = []
    for run in runs:
        one, bp = run["runs"]["1f1b"]["ranks"], run["runs"]["bpipe"]["ranks"]
        evicting = [r for r in range(len(bp)) if bp[len(bp) - 1 - r]["guest_peak_bytes"] > 0]  # its partner hosts
        cells = [f"rank {r} {_gib(one[r]['peak_bytes'])} GiB under 1F1B, {_gib(bp[r]['peak_bytes'])} under BPipe"
                 for r in evicting]
        parts.append(f"{_size(run)}: " + ", ".join(cells))
    return "; ".join(parts)


def dry_run_worst_sentence(*runs: dict) -> str:
    """'p = 4 (84 layers): rank 0 at 1.000 of 1F1B's rank 0, within the bound 1.000 (simulated 1.000, within it); ...':
    each p's worst BPipe rank in the dry run, against the bound, and the simulation's worst."""
    def verdict(over: float) -> str:
        return f"{_kib(over)} KiB over" if over > 0 else "within"
    parts = []
    for run in runs:
        ranks = run["runs"]["bpipe"]["ranks"]
        worst = max(range(len(ranks)), key=lambda r: ranks[r]["stash_peak_bytes"])
        simulated = max(run["runs"]["bpipe"]["simulated_stash_peak_bytes"])
        parts.append(f"{_size(run)}: rank {worst} at {num(run['worst_over_1f1b_rank0'], 3)} of 1F1B's rank 0, "
                     f"{verdict(_over_bound(run, ranks[worst]['stash_peak_bytes']))} the bound {num(run['bound'], 3)} "
                     f"(simulated {num(run['simulated_worst_over_1f1b_rank0'], 3)}, "
                     f"{verdict(_over_bound(run, simulated))} it)")
    return "; ".join(parts)


def dry_run_gap_sentence(*runs: dict) -> str:
    """The largest |dry run − simulated| over every rank and p, in KiB and as a share of that rank's peak."""
    gaps = [(abs(row["stash_peak_bytes"] - sim), row["stash_peak_bytes"]) for run in runs
            for row, sim in zip(run["runs"]["bpipe"]["ranks"], run["runs"]["bpipe"]["simulated_stash_peak_bytes"])]
    gap, peak = max(gaps)
    return f"{_kib(gap)} KiB ({pct(gap / peak, 4)} of that rank's peak)"


def dry_run_cpu_sentence(*runs: dict) -> str:
    """'p = 4 (84 layers): 1F1B 70 CPU s, BPipe 84 CPU s; ...': what each size's dry runs of every pipeline
    rank cost."""
    return "; ".join(f"{_size(run)}: 1F1B {num(run['runs']['1f1b']['cpu_seconds'], 0)} CPU s, BPipe "
                     f"{num(run['runs']['bpipe']['cpu_seconds'], 0)} CPU s" for run in runs)
