"""Time building, validating and simulating one registered schedule at growing m (JSON out).

    python tools/bench_schedule_build.py --schedule interleaved-1f1b --pp 32 --chunks 4 \
        --microbatches 256 512 1024 --json docs/results/schedule_build.json

Each size is timed in three phases on the same lists: `build` (generator, communication insertion and the
validation `build_schedule` runs), `validate` (a second, standalone `validate`) and `simulate` (default
cost model). `--profile N` prints the N most expensive functions of the last size (cProfile, cumulative).
The ratio of each size's total to the previous one's, divided by the ratio of their action counts, is 1.0
for linear work; it is reported as `growth_vs_linear`.
"""
import argparse
import cProfile
import json
import os
import platform
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_pp.schedules.registry import build_schedule  # noqa: E402
from megatron_pp.schedules.simulate import simulate  # noqa: E402
from megatron_pp.schedules.validate import validate  # noqa: E402


def measure(name: str, pp: int, m: int, chunks: int) -> dict:
    t0 = time.perf_counter()
    schedule = build_schedule(name, pp, m, chunks)
    t1 = time.perf_counter()
    validate(schedule)
    t2 = time.perf_counter()
    result = simulate(schedule)
    t3 = time.perf_counter()
    return {"microbatches": m, "actions": sum(len(acts) for acts in schedule.actions),
            "build_s": t1 - t0, "validate_s": t2 - t1, "simulate_s": t3 - t2, "total_s": t3 - t0,
            "bubble_fraction": result.bubble_fraction}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="interleaved-1f1b")
    parser.add_argument("--pp", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile the last size and print its N most expensive functions")
    parser.add_argument("--json", default=None, help="write the report here (default: stdout only)")
    args = parser.parse_args(argv)
    if args.pp < 1 or args.chunks < 1 or min(args.microbatches) < 1:
        parser.error("--pp, --chunks and every --microbatches value must be positive")
    rows = []
    for m in args.microbatches:
        if args.profile and m == args.microbatches[-1]:
            profiler = cProfile.Profile()
            row = profiler.runcall(measure, args.schedule, args.pp, m, args.chunks)
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.profile)
        else:
            row = measure(args.schedule, args.pp, m, args.chunks)
        if rows:
            prev = rows[-1]
            row["growth_vs_linear"] = (row["total_s"] / prev["total_s"]) / (row["actions"] / prev["actions"])
        rows.append(row)
        print(f"m={m:<6} actions={row['actions']:<8} build {row['build_s']:.2f} s  validate {row['validate_s']:.2f} s"
              f"  simulate {row['simulate_s']:.2f} s  total {row['total_s']:.2f} s"
              + (f"  growth/linear {row['growth_vs_linear']:.2f}" if "growth_vs_linear" in row else ""), flush=True)
    report = {"schedule": args.schedule, "pp": args.pp, "chunks": args.chunks, "rows": rows,
              "python": platform.python_version(), "machine": platform.machine(),
              "cpus": os.cpu_count(), "load_average_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
              "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
              "command": "python tools/bench_schedule_build.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    if args.json:
        with open(args.json + ".tmp", "w") as f:
            f.write(json.dumps(report, indent=2) + "\n")
        os.replace(args.json + ".tmp", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
