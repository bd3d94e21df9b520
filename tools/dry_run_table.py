"""Full-size configurations: the dry run's per-rank memory beside the planner's, as JSON and a Markdown table.

    python tools/dry_run_table.py --out docs/results/dry_run_table.json
    python tools/dry_run_table.py --configs llama3-70b-1f1b --ranks all --out docs/results/dry_run_bench.json

Each configuration is run through the training script's own `--dry-run` path (`training.dry_run.dry_run`:
argument validation, process groups on the fake backend, the model, the optimizer, two steps) for its
default ranks (one per pipeline rank) or `--ranks all`, and through the planner's `Evaluator` (bf16,
flash-style attention: what SDPA's fused kernel saves, which is what the dry run's CPU SDPA saves too).
Dropout is off in every row (SDPA's CPU kernel with attention dropout is the math fallback, whose saved
tensors the planner does not model). The JSON keeps every rank's bytes and CPU seconds; `docs/dry_run.md`
quotes it. CPU seconds are process time, so a loaded machine slows the wall clock, not them.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from megatron_pp.planning.cost import Evaluator  # noqa: E402
from megatron_pp.core.parallel_state import RankLayout  # noqa: E402
from megatron_pp.planning.verify import planned_from_flags  # noqa: E402
from megatron_pp.training import dry_run  # noqa: E402
from megatron_pp.training.arguments import parse_args  # noqa: E402

# name -> (preset, tp, pp, schedule, micro batch, global batch, seq, extra flags)
CONFIGS = {
    "llama3-70b-1f1b": ("llama3-70b", 8, 8, "1f1b", 1, 64, 4096, []),
    "llama3-70b-interleaved": ("llama3-70b", 8, 8, "interleaved-1f1b", 1, 64, 4096,
                               ["--num-layers-per-virtual-pipeline-stage", "5"]),
    "llama3-70b-zb-h1": ("llama3-70b", 8, 8, "zb-h1", 1, 64, 4096, []),
    # The V shapes: stages r and 15 - r on rank r, 80 / 16 = 5 layers each.
    "llama3-70b-zb-v": ("llama3-70b", 8, 8, "zb-v", 1, 64, 4096, ["--num-layers-per-virtual-pipeline-stage", "5"]),
    "llama3-70b-v-half": ("llama3-70b", 8, 8, "v-half", 1, 64, 4096, ["--num-layers-per-virtual-pipeline-stage", "5"]),
    "gpt3-175b-1f1b": ("gpt3-175b", 8, 16, "1f1b", 1, 64, 2048, []),
    # Other schedule families at full size: m 16 = 2p (a 1F1B rank's stash peak is the same for any m >= p).
    "llama3-70b-gpipe": ("llama3-70b", 8, 8, "gpipe", 1, 16, 4096, []),
    "llama3-70b-recompute-full": ("llama3-70b", 8, 8, "1f1b", 1, 16, 4096,
                                  ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                   "--recompute-num-layers", "1"]),
    "llama3-70b-recompute-selective": ("llama3-70b", 8, 8, "1f1b", 1, 16, 4096,
                                       ["--recompute-granularity", "selective"]),
    "llama3-70b-po-h": ("llama3-70b", 8, 8, "po-h", 1, 16, 4096,
                        ["--num-layers-per-virtual-pipeline-stage", "5", "--offload-time", "0.25"]),
    # PipeDream-2BW: four calls (warm-up, two steady, cool-down; training/dry_run_twobw.py), m 16 = 2p per call.
    "llama3-70b-2bw": ("llama3-70b", 8, 8, "2bw", 1, 16, 4096, []),
    "llama3-70b-dp2-zero1": ("llama3-70b", 8, 8, "1f1b", 1, 32, 4096, ["--use-distributed-optimizer"]),
    "llama3-70b-dp2-zero1-overlap": ("llama3-70b", 8, 8, "1f1b", 1, 32, 4096,
                                     ["--use-distributed-optimizer", "--overlap-param-gather"]),
    # The overlap on a rank of two chunks: chunk 1's gathers held through chunk 0's first forwards.
    "llama3-70b-interleaved-dp2": ("llama3-70b", 8, 8, "interleaved-1f1b", 1, 32, 4096,
                                   ["--num-layers-per-virtual-pipeline-stage", "5", "--use-distributed-optimizer"]),
    "llama3-70b-interleaved-dp2-overlap": ("llama3-70b", 8, 8, "interleaved-1f1b", 1, 32, 4096,
                                           ["--num-layers-per-virtual-pipeline-stage", "5",
                                            "--use-distributed-optimizer", "--overlap-param-gather"]),
    "llama3-70b-looped-bfs-layered": ("llama3-70b", 8, 8, "looped-bfs", 1, 32, 4096,
                                      ["--num-layers-per-virtual-pipeline-stage", "5",
                                       "--breadth-first-microbatches", "8", "--layered-grad-accumulation",
                                       "--use-distributed-optimizer"]),
}
DATA_PARALLEL = {"llama3-70b-dp2-zero1": 2, "llama3-70b-dp2-zero1-overlap": 2, "llama3-70b-interleaved-dp2": 2,
                 "llama3-70b-interleaved-dp2-overlap": 2, "llama3-70b-looped-bfs-layered": 2}
"""Configurations run at dp > 1 (the world is tp x pp x dp); the rest at dp 1."""


def argv_of(name: str) -> list[str]:
    preset, tp, pp, schedule, b, gbs, seq, extra = CONFIGS[name]
    world = tp * pp * DATA_PARALLEL.get(name, 1)
    return ["--model-preset", preset, "--mock-data", "--bf16", "--tensor-model-parallel-size", str(tp),
            "--pipeline-model-parallel-size", str(pp), "--pipeline-schedule", schedule,
            "--micro-batch-size", str(b), "--global-batch-size", str(gbs), "--seq-length", str(seq),
            "--max-position-embeddings", str(seq), "--attention-dropout", "0", "--hidden-dropout", "0",
            "--sequence-parallel", "--train-iters", "2", "--dry-run", str(world), *extra]


def planner_row(argv: list[str], world: int, optimizer: str) -> dict:
    """The planner's per-pipeline-rank bytes for the same command (`planning.verify.planned_from_flags`:
    H100 80 GB, flash-style attention, the command's recomputation, dp, distributed optimizer and schedule
    options, the AdamW kernel the dry run builds)."""
    job, cluster, c = planned_from_flags(argv, world, optimizer=optimizer)
    p = Evaluator(job, cluster).evaluate(c, exact=True)
    return {"configuration": c.label(), "optimizer": job.optimizer, "state_bytes": list(p.state_bytes),
            "stash_bytes": list(p.stash_bytes), "transient_bytes": p.transient_bytes,
            "optimizer_step_bytes": list(p.optimizer_step_bytes), "memory_bytes": list(p.memory_bytes),
            "peak_phase": [p.peak_phase(r) for r in range(c.pp)],
            "reserve_note": "memory_bytes excludes the planner's reserved fraction of the device"}


def script_of(name: str) -> str:
    return "pretrain_gpt.py" if CONFIGS[name][0].startswith("gpt") else "pretrain_llama.py"


def pipeline_ranks_to_global(name: str, pipeline_ranks: str) -> str:
    """--pipeline-ranks 0,7 -> the global ranks of tp 0, dp 0 of those pipeline ranks (as --dry-run-ranks)."""
    _, tp, pp, *_ = CONFIGS[name]
    world = tp * pp * DATA_PARALLEL.get(name, 1)
    layout = RankLayout(world, tp, pp)
    wanted = {int(r) for r in pipeline_ranks.split(",")}
    bad = sorted(r for r in wanted if not 0 <= r < pp)
    if bad:
        raise ValueError(f"--pipeline-ranks: {bad[0]} is not a pipeline rank of {name} (0..{pp - 1})")
    return ",".join(str(g) for g in range(world)
                    if (c := layout.coords(g)).pp in wanted and c.tp == 0 and c.dp == 0)


def run(name: str, ranks: str | None, on_rank=lambda partial: None, jobs: int | None = None) -> dict:
    """Dry-run `name`'s ranks in `jobs` worker processes (`dry_run.run_ranks`; `on_rank` sees the partial
    result after each rank, so a long run that is stopped keeps what it measured), then match their
    communication over all of them and ask the planner."""
    from megatron_pp.training.dry_run_agree import disagreements

    argv = argv_of(name) + (["--dry-run-ranks", ranks] if ranks else [])
    args = parse_args(argv)
    try:
        planner = planner_row(argv_of(name), args.dry_run, args.dry_run_optimizer)
    except Exception as err:  # noqa: BLE001 - a schedule the planner cannot model is reported, not fatal
        planner = {"error": f"{type(err).__name__}: {err}"}
    chosen = dry_run.chosen_ranks(args)
    jobs = dry_run.default_jobs(len(chosen)) if jobs is None else jobs
    result = {"name": name, "command": f"python {script_of(name)} " + " ".join(argv), "ranks": [],
              "disagreements": [], "planner": planner, "jobs": jobs, "cpu_seconds": 0.0, "wall_seconds": 0.0,
              "load_average_before": list(os.getloadavg())}
    began = time.perf_counter()

    def arrived(report) -> None:
        result["ranks"].append(report.row())
        result["ranks"].sort(key=lambda row: row["rank"])
        result["cpu_seconds"] += report.seconds  # the worker's process time for that rank
        result["wall_seconds"] = time.perf_counter() - began
        on_rank(result, report.rank)

    reports = dry_run.run_ranks(args, chosen, jobs, arrived)
    result["wall_seconds"] = time.perf_counter() - began
    result["load_average_after"] = list(os.getloadavg())
    result["disagreements"] = disagreements({r.rank: r.comm for r in reports})
    return result


def markdown(results: list[dict]) -> str:
    lines = ["| configuration | pp rank | dry run peak (GiB) | planner (GiB) | planner / dry run | stash dry run = planner |",
             "|---|---|---|---|---|---|"]
    for res in results:
        plan = res["planner"]
        for r in res["ranks"]:
            p = r["pipeline_rank"]
            mine = r["peak_bytes"] / 2**30
            if "memory_bytes" in plan:
                theirs = plan["memory_bytes"][p] / 2**30
                same = "yes" if int(plan["stash_bytes"][p]) == r["stash_peak_bytes"] else (
                    f"{r['stash_peak_bytes'] / 2**30:.2f} vs {plan['stash_bytes'][p] / 2**30:.2f}")
                lines.append(f"| {res['name']} | {p} | {mine:.2f} | {theirs:.2f} | {theirs / mine:.3f} | {same} |")
            else:
                lines.append(f"| {res['name']} | {p} | {mine:.2f} | {plan['error']} | | |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    parser.add_argument("--ranks", default=None, help="--dry-run-ranks for every configuration (default: one per pp rank)")
    parser.add_argument("--pipeline-ranks", default=None, metavar="R,R,...",
                        help="pipeline ranks to run (tp 0, dp 0 of each), instead of --ranks")
    parser.add_argument("--out", default=None, help="JSON file to write")
    parser.add_argument("--jobs", type=int, default=None,
                        help="worker processes per configuration (default: one per usable core, at most one per rank)")
    args = parser.parse_args(argv)
    names = args.configs.split(",")
    if args.jobs is not None and args.jobs < 1:
        print(f"error: --jobs {args.jobs}: needs at least one worker", file=sys.stderr)
        return 2
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        print(f"error: --configs: unknown configuration {unknown[0]!r} (known: {', '.join(CONFIGS)})", file=sys.stderr)
        return 2
    if args.ranks and args.pipeline_ranks:
        print("error: --ranks and --pipeline-ranks: give one", file=sys.stderr)
        return 2
    try:
        ranks = {n: pipeline_ranks_to_global(n, args.pipeline_ranks) if args.pipeline_ranks else args.ranks
                 for n in names}
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    results: list[dict] = []

    def write(partial: dict, rank: int | None = None) -> None:
        if rank is not None:
            print(f"{partial['name']}: rank {rank} done, {partial['cpu_seconds']:.1f} CPU s, "
                  f"{partial['wall_seconds']:.1f} s wall so far", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({
                "machine": platform.processor() or platform.machine(),
                "cores": len(os.sched_getaffinity(0)),
                "note": "cpu_seconds: the sum of each rank's process time in its worker; wall_seconds: the whole "
                        "configuration with `jobs` workers, on a machine shared with other work (load averages "
                        "recorded before and after)",
                "results": results + [partial]}, indent=1))

    for name in names:
        results.append(run(name, ranks[name], write, args.jobs))
    print(markdown(results))
    write(results.pop())
    return 0


if __name__ == "__main__":
    sys.exit(main())
