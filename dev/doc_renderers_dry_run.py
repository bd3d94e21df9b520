"""Renderers of docs/dry_run.md and docs/planner.md (registered in dev/doc_renderers.py): the per-rank table
and the timing sentence of a `tools/dry_run_table.py` JSON, and the planner beside the dry runs of several
configurations (`tools/validate_planner.py --dry-run-json`)."""
from __future__ import annotations

from doc_format import num, table

GIB = 2**30


def ranks_of(*runs: dict):
    """Every simulated rank of `tools/dry_run_table.py` JSON files, in order: (configuration result, rank row,
    the rank's state bytes: parameters + gradients + optimizer). The tables of docs/dry_run.md and the
    figures its prose quotes all read rows through this."""
    for data in runs:
        for res in data["results"]:
            for r in res["ranks"]:
                yield res, r, r["parameter_bytes"] + r["gradient_bytes"] + r["optimizer_bytes"]


def dry_run_ranks_table(*runs: dict) -> str:
    """Per configuration and simulated rank: state (parameters + gradients + optimizer), stash peak, transient,
    total peak and host peak from the dry run (GiB), the planner's peak and the ratio of the two, where the
    peak fell, and the rank's CPU seconds."""
    rows = []
    for res, r, state in ranks_of(*runs):
        plan, p = res["planner"], r["pipeline_rank"]
        theirs = plan["memory_bytes"][p] if "memory_bytes" in plan else None
        rows.append([res["name"], str(r["rank"]), str(p), num(state / GIB), num(r["stash_peak_bytes"] / GIB),
                     num(r["transient_peak_bytes"] / GIB), num(r["peak_bytes"] / GIB),
                     num(r.get("host_peak_bytes", 0) / GIB),
                     num(theirs / GIB) if theirs is not None else plan.get("error", "n/a"),
                     num(theirs / r["peak_bytes"], 3) if theirs is not None else "",
                     r["peak_at"], num(r["seconds"], 1)])
    return table(["configuration", "rank", "pp rank", "state GiB", "stash peak GiB", "transient GiB",
                  "dry run peak GiB", "host peak GiB", "planner GiB", "planner / dry run", "peak at", "CPU s"], rows)


def dry_run_time_sentence(data: dict) -> str:
    """'8 ranks, 829.7 CPU s in all (82.9 to 120.1 per rank), 2156.6 s wall with 2 workers, load average
    18.9 before and 9.7 after' for the first configuration of the JSON."""
    res = data["results"][0]
    per_rank = [r["seconds"] for r in res["ranks"]]
    return (f"{len(per_rank)} ranks, {num(res['cpu_seconds'], 1)} CPU s in all ({num(min(per_rank), 1)} to "
            f"{num(max(per_rank), 1)} per rank), {num(res['wall_seconds'], 1)} s wall with {res['jobs']} workers, "
            f"load average {num(res['load_average_before'][0], 1)} before and "
            f"{num(res['load_average_after'][0], 1)} after")


def planner_vs_dry_runs_table(data: dict) -> str:
    """Per configuration and pipeline rank: the dry run's peak, its transient (what is neither state nor
    stash at the peak) and where it fell, beside the planner's peak, the phase it names and their ratio."""
    rows = []
    for res in data["results"]:
        for r in res["ranks"]:
            rows.append([f"{res['preset']} {res['configuration']}", res["optimizer"], str(r["pipeline_rank"]),
                         num(r["measured_peak_bytes"] / GIB), num(r["measured_transient_bytes"] / GIB),
                         r["measured_peak_at"], num(r["predicted_peak_bytes"] / GIB), r["predicted_phase"],
                         num(r["predicted_over_measured"], 4)])
    return table(["configuration", "AdamW", "pp rank", "dry run peak GiB", "dry run transient GiB",
                  "dry run peak at", "planner GiB", "planner's peak in", "planner / dry run"], rows)


def dry_run_measured_table(*runs: dict) -> str:
    """Per configuration and simulated rank, what the dry run measured (GiB): state, stash peak, transient,
    total peak, host peak, where the peak fell, the AdamW kernel it built, microbatches and CPU seconds. The
    planner beside these is docs/planner.md's table (the planner as it stands, not as it stood)."""
    rows = []
    for data in runs:
        for res in data["results"]:
            words = res["command"].split()
            gbs, world = int(words[words.index("--global-batch-size") + 1]), int(words[words.index("--dry-run") + 1])
            tp = int(words[words.index("--tensor-model-parallel-size") + 1])
            pp = int(words[words.index("--pipeline-model-parallel-size") + 1])
            m = gbs // (world // (tp * pp)) // int(words[words.index("--micro-batch-size") + 1])
            for r in res["ranks"]:
                state = r["parameter_bytes"] + r["gradient_bytes"] + r["optimizer_bytes"]
                kernel = "foreach" if "foreach" in r.get("optimizer_implementation", "foreach") else "fused"
                rows.append([res["name"], str(m), str(r["rank"]), str(r["pipeline_rank"]), kernel, num(state / GIB),
                             num(r["stash_peak_bytes"] / GIB), num(r["transient_peak_bytes"] / GIB),
                             num(r["peak_bytes"] / GIB), num(r.get("host_peak_bytes", 0) / GIB), r["peak_at"],
                             num(r["seconds"], 1)])
    return table(["configuration", "m", "rank", "pp rank", "AdamW", "state GiB", "stash peak GiB", "transient GiB",
                  "dry run peak GiB", "host peak GiB", "peak at", "CPU s"], rows)


def planner_vs_dry_runs_range(data: dict) -> str:
    """'0.9989 to 1.0083' (planner / dry run over every rank of every configuration), and how many ranks."""
    ratios = [r["predicted_over_measured"] for res in data["results"] for r in res["ranks"]]
    return f"{num(min(ratios), 4)} to {num(max(ratios), 4)} over {len(ratios)} ranks"


def dry_run_device_sentence(data: dict) -> str:
    """benchmarks/dry_run_device.py: meta over the CPU device per pair, the medians, which byte figures agree
    (and, where the run has it, whether meta with the CPU job's weight-gradient fold and batch agrees in all),
    and RoPE's share of the operators."""
    ratios = ", ".join(num(r, 2) for r in data["meta_over_cpu_per_pair"])
    med = data["median_cpu_seconds"]
    cpu, meta = data["bytes"]["cpu"], data["bytes"]["meta"]
    same = [k for k in cpu if cpu[k] == meta[k] and k.endswith("_bytes")]
    counts = data["operator_counts"]
    names = ", ".join(k.replace("_bytes", "") for k in same)
    if data["same_bytes"]:
        bytes_part = "every byte figure equal"
    elif "stash_peak_bytes" in same:
        bytes_part = (f"equal for {names} (stash peak {num(cpu['stash_peak_bytes'] / GIB)} GiB on both devices); "
                      f"transient {num(cpu['transient_peak_bytes'] / 2**20, 1)} MiB on the CPU device, "
                      f"{num(meta['transient_peak_bytes'] / 2**20, 1)} on meta (total peak "
                      f"{num(cpu['peak_bytes'] / GIB)} GiB against {num(meta['peak_bytes'] / GIB)})")
    else:
        bytes_part = (f"equal only for {names} (stash peak {num(cpu['stash_peak_bytes'] / GIB)} GiB on the CPU "
                      f"device, {num(meta['stash_peak_bytes'] / GIB)} on meta; total peak "
                      f"{num(cpu['peak_bytes'] / GIB)} against {num(meta['peak_bytes'] / GIB)})")
    if "meta_with_cpu_fold_and_batch_same_bytes" in data:
        aligned = data["bytes"]["meta_with_cpu_fold_and_batch"]
        apart = [f"{k.replace('_bytes', '')} {aligned[k] - cpu[k]:+d} B" for k in cpu
                 if k.endswith("_bytes") and aligned[k] != cpu[k]]
        bytes_part += ("; meta with the CPU job's fold and batch: " +
                       ("every byte figure equal to the CPU device's" if not apart else
                        f"equal to the CPU device's but for {', '.join(apart)}"))
    return (f"meta over CPU per pair {ratios} (median {num(med['cpu'], 1)} CPU s on the CPU device, "
            f"{num(med['meta'], 1)} on meta); {bytes_part}; RoPE's rotation is {counts['rotary']} of the "
            f"{counts['operators']} operators the rank dispatches ({num(100 * counts['rotary'] / counts['operators'], 1)}%)")
