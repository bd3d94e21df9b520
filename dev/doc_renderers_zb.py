"""Renderers of the zero-bubble rows of docs/dry_run.md (registered in dev/doc_renderers.py): the dry run of
the split-backward families (zb-h1, zb-v, v-half) at full size beside the planner, from `tools/dry_run_table.py`
JSON files."""
from __future__ import annotations

from doc_format import num, table
from doc_renderers_dry_run import GIB, ranks_of


def zero_bubble_ranks_table(*runs: dict) -> str:
    """Per configuration and simulated rank: state, the executor's stash peak and the planner's, transient,
    the dry run's total peak and the planner's, their ratio, where the dry run peaked and the AdamW kernel
    it built (the planner was asked for the same one)."""
    rows = []
    for res, r, state in ranks_of(*runs):
        plan, p = res["planner"], r["pipeline_rank"]
        rows.append([res["name"], str(r["rank"]), str(p), num(state / GIB),
                     num(r["stash_peak_bytes"] / GIB), num(plan["stash_bytes"][p] / GIB),
                     num(r["transient_peak_bytes"] / GIB), num(r["peak_bytes"] / GIB),
                     num(plan["memory_bytes"][p] / GIB), num(plan["memory_bytes"][p] / r["peak_bytes"], 3),
                     r["peak_at"], r.get("optimizer_implementation") or "foreach (job's CPU choice)",
                     num(r["seconds"], 1)])
    return table(["configuration", "rank", "pp rank", "state GiB", "stash peak GiB", "planner stash GiB",
                  "transient GiB", "dry run peak GiB", "planner GiB", "planner / dry run", "peak at", "AdamW",
                  "CPU s"], rows)
