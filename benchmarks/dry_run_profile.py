"""Where a dry run's time goes: cProfile of one `--dry-run` command, split into import, FakeTensorMode's
dispatch, the dry run's own memory tracker and communication watch (one dispatch mode since the fake mode
itself tracks and watches: `training.dry_run.TrackingFakeMode`), and the rest of the step.

    python benchmarks/dry_run_profile.py --out docs/results/dry_run_profile.json -- \
        --model-preset llama3-70b --mock-data --bf16 ... --dry-run 64 --dry-run-ranks 0
    python benchmarks/dry_run_profile.py --from-profile prof.out --argv "..." --out ...   (an existing profile)
    python benchmarks/dry_run_profile.py --against REV --current REV2 --pairs 3 --ranks 0,56 --out ... -- <flags>

`--against REV`: paired A/B of the dry run's speed, the code of git revision REV (exported with `git archive`
into a temporary folder) against REV2's (`--current`; default the working tree), alternating (REV, tree, REV, tree, ...) so drift in the
host's load falls on both, each run a fresh process (FakeTensorMode's dispatch cache is process-wide). Timed:
each rank's CPU seconds (`RankReport.seconds`: fake world, model, optimizer, both steps) and its steps'. Every
byte field of the rank's row and every recorded call must be equal between the two; the JSON says so per rank.

Shares are of cProfile's clock (wall time with the profiler's own overhead): on a loaded machine compare
the shares, not the seconds.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import dataclasses, json, sys, torch
from megatron_pp.training import dry_run
from megatron_pp.training.arguments import parse_args
args = parse_args(json.loads(sys.argv[1]))
report = dry_run.run_rank(args, int(sys.argv[2]), torch.device(args.dry_run_device))
print(json.dumps({"row": report.row(), "comm": [dataclasses.asdict(e) for e in report.comm]}))
"""
TIMES = ("seconds", "step_seconds")

PARTS = {
    "import": ("train.py", 1, "<module>"),
    "executor (both steps)": ("execute.py", None, "run"),
    "fake tensor dispatch": ("fake_tensor.py", None, "dispatch"),
    # Since the fast fake dispatch (training/dry_run_fast.py) the tracker enters the fake mode here, which
    # calls torch's `dispatch`, or its fake kernels directly for operators torch never caches.
    "fake tensor dispatch (fast)": ("dry_run_fast.py", None, "fake_dispatch"),
    "cache key": ("fake_tensor.py", None, "_cache_key"),
    "cache hit output": ("fake_tensor.py", None, "_output_from_cache_entry"),
    "fake kernels (misses, uncached operators)": ("fake_tensor.py", None, "_dispatch_impl"),
    "memory tracker (with what it wraps)": ("dry_run.py", None, "__torch_dispatch__"),
    "communication watch": ("comm_check.py", None, "observe"),
    "backward (autograd engine)": ("execute.py", None, "_backward_pass"),
}


def cumulative(stats: pstats.Stats, file_end: str, line, name: str) -> float:
    return max((v[3] for (f, ln, fn), v in stats.stats.items()
                if f.endswith(file_end) and fn == name and (line is None or ln == line)), default=0.0)


def summary(profile: str, argv: str) -> dict:
    stats = pstats.Stats(profile)
    parts = {k: cumulative(stats, *v) for k, v in PARTS.items()}
    run = parts["executor (both steps)"]
    fake = max(parts["fake tensor dispatch"], parts["fake tensor dispatch (fast)"])
    inside = ("cache key", "cache hit output", "fake kernels (misses, uncached operators)")
    watch = parts["communication watch"]  # called by the tracker for every operator, inside its time
    tracker = parts["memory tracker (with what it wraps)"] - fake - watch
    return {"command": f"python pretrain_llama.py {argv}", "profile_total_s": stats.total_tt, "parts_s": parts,
            "executor_shares": {"fake tensor dispatch": fake / run, "memory tracker itself": tracker / run,
                                "communication watch itself": watch / run,
                                "model code and autograd engine": (run - fake - tracker - watch) / run},
            "fake_dispatch_shares": {**{k: parts[k] / run for k in inside},
                                     "cache lookup and the rest": (fake - sum(parts[k] for k in inside)) / run},
            "note": "cProfile clock on a shared, loaded 2-core machine: shares, not seconds"}


def _one(tree: Path, flags: list[str], rank: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(flags), str(rank)], cwd=tree, env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _export(rev: str, folder: str) -> str:
    """The code of git revision `rev` under `folder` (git archive); its full hash."""
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    return subprocess.run(["git", "rev-parse", rev], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def paired(rev: str, current: str | None, flags: list[str], ranks: list[int], pairs: int) -> dict:
    """REV against `current` (a revision, or the working tree when None), alternating; per rank the CPU
    seconds of each run and whether every byte field and recorded call is equal."""
    load_before = list(os.getloadavg())
    with tempfile.TemporaryDirectory() as base, tempfile.TemporaryDirectory() as cur:
        out = {"baseline_rev": _export(rev, base),
               "current_rev": _export(current, cur) if current else "working tree",
               "command": "python pretrain_llama.py " + " ".join(flags), "pairs": pairs, "ranks": {}}
        trees = {"baseline": Path(base), "current": Path(cur) if current else ROOT}
        for rank in ranks:
            runs = {"baseline": [], "current": []}
            for _ in range(pairs):
                for side in ("baseline", "current"):
                    runs[side].append(_one(trees[side], flags, rank))
            out["ranks"][str(rank)] = _compare(runs)
    out["load_average_before"], out["load_average_after"] = load_before, list(os.getloadavg())
    out["note"] = "CPU seconds are process time on a shared 2-core host: compare within a pair"
    return out


def _compare(runs: dict) -> dict:
    drop = lambda row: {k: v for k, v in row.items() if k not in TIMES}  # noqa: E731
    first = runs["baseline"][0]
    secs = {k: [r["row"]["seconds"] for r in v] for k, v in runs.items()}
    ratios = [c / b for b, c in zip(secs["baseline"], secs["current"])]
    return {"baseline_seconds": secs["baseline"], "current_seconds": secs["current"],
            "baseline_step_seconds": [r["row"]["step_seconds"] for r in runs["baseline"]],
            "current_step_seconds": [r["row"]["step_seconds"] for r in runs["current"]],
            "current_over_baseline": ratios, "median_current_over_baseline": statistics.median(ratios),
            "bytes_equal": all(drop(r["row"]) == drop(first["row"]) for v in runs.values() for r in v),
            "calls_equal": all(r["comm"] == first["comm"] for v in runs.values() for r in v),
            "calls": len(first["comm"]), "row": drop(first["row"])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--from-profile", default=None)
    parser.add_argument("--argv", default=None, help="the dry run's flags (with --from-profile)")
    parser.add_argument("--against", default=None, help="git revision to time against --current")
    parser.add_argument("--current", default=None, help="git revision timed against --against (default: the working tree)")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--ranks", default="0", help="global ranks to time (with --against)")
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.against:
        flags = [a for a in args.rest if a != "--"]
        result = paired(args.against, args.current, flags, [int(r) for r in args.ranks.split(",")], args.pairs)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(json.dumps({r: {k: v[k] for k in ("median_current_over_baseline", "bytes_equal", "calls_equal")}
                          for r, v in result["ranks"].items()}, indent=1))
        return 0
    if args.from_profile:
        result = summary(args.from_profile, args.argv or "")
    else:
        flags = [a for a in args.rest if a != "--"]
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        profile = args.out + ".prof"
        code = "from megatron_pp.training.train import main; main(FLAGS + ['--dry-run-jobs', '1'], default_preset='llama-tiny')"
        try:
            cProfile.run(code.replace("FLAGS", repr(flags)), profile)
        except SystemExit:
            pass
        result = summary(profile, " ".join(flags))
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["executor_shares"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
