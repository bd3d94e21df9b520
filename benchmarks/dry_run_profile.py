"""Where a dry run's time goes: cProfile of one `--dry-run` command, split into import, FakeTensorMode's
dispatch, the dry run's own memory tracker and communication watch (one dispatch mode since the fake mode
itself tracks and watches: `training.dry_run.TrackingFakeMode`), and the rest of the step.

    python benchmarks/dry_run_profile.py --out docs/results/dry_run_profile.json -- \
        --model-preset llama3-70b --mock-data --bf16 ... --dry-run 64 --dry-run-ranks 0
    python benchmarks/dry_run_profile.py --from-profile prof.out --argv "..." --out ...   (an existing profile)

Shares are of cProfile's clock (wall time with the profiler's own overhead): on a loaded machine compare
the shares, not the seconds.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
from pathlib import Path

PARTS = {
    "import": ("train.py", 1, "<module>"),
    "executor (both steps)": ("execute.py", None, "run"),
    "fake tensor dispatch": ("fake_tensor.py", None, "dispatch"),
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
    fake = parts["fake tensor dispatch"]
    watch = parts["communication watch"]  # called by the tracker for every operator, inside its time
    tracker = parts["memory tracker (with what it wraps)"] - fake - watch
    return {"command": f"python pretrain_llama.py {argv}", "profile_total_s": stats.total_tt, "parts_s": parts,
            "executor_shares": {"fake tensor dispatch": fake / run, "memory tracker itself": tracker / run,
                                "communication watch itself": watch / run,
                                "model code and autograd engine": (run - fake - tracker - watch) / run},
            "note": "cProfile clock on a shared, loaded 2-core machine: shares, not seconds"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--from-profile", default=None)
    parser.add_argument("--argv", default=None, help="the dry run's flags (with --from-profile)")
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args()
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
