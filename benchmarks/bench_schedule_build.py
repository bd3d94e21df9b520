"""Time building, validating and simulating one registered schedule at growing m (JSON out).

    python benchmarks/bench_schedule_build.py --schedule interleaved-1f1b --pp 32 --chunks 4 \
        --microbatches 256 512 1024 --json docs/results/schedule_build.json

Each size is timed in three phases on the same lists: `build` (generator, communication insertion and the
validation `build_schedule` runs), `validate` (a second, standalone `validate`, to show the validator's
share of `build`) and `simulate` (default cost model); `total` is build + simulate, wall-clock and CPU
seconds of this process (the CPU figure is steadier on a shared machine). `--profile N` prints the N most expensive functions of the last size (cProfile, cumulative).
The ratio of each size's total CPU seconds to the previous one's, divided by the ratio of their action
counts, is 1.0 for linear work; it is reported as `growth_vs_linear`.
"""
import argparse
import cProfile
import os
import platform
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_pp.cli import write_json  # noqa: E402
from megatron_pp.schedules.registry import build_schedule  # noqa: E402
from megatron_pp.schedules.simulate import simulate  # noqa: E402
from megatron_pp.schedules.validate import validate  # noqa: E402


def measure(name: str, pp: int, m: int, chunks: int) -> dict:
    clocks = [(time.perf_counter(), time.process_time())]
    schedule = build_schedule(name, pp, m, chunks)
    clocks.append((time.perf_counter(), time.process_time()))
    validate(schedule)
    clocks.append((time.perf_counter(), time.process_time()))
    result = simulate(schedule)
    clocks.append((time.perf_counter(), time.process_time()))
    wall = [b[0] - a[0] for a, b in zip(clocks, clocks[1:])]
    cpu = [b[1] - a[1] for a, b in zip(clocks, clocks[1:])]
    # build_schedule already validates; the standalone validate is timed only to show its share.
    return {"microbatches": m, "actions": sum(len(acts) for acts in schedule.actions),
            "build_s": wall[0], "validate_s": wall[1], "simulate_s": wall[2], "total_s": wall[0] + wall[2],
            "build_cpu_s": cpu[0], "validate_cpu_s": cpu[1], "simulate_cpu_s": cpu[2],
            "total_cpu_s": cpu[0] + cpu[2], "bubble_fraction": result.bubble_fraction}


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
    rows, load_start = [], os.getloadavg()[0]
    for m in args.microbatches:
        if args.profile and m == args.microbatches[-1]:
            profiler = cProfile.Profile()
            row = profiler.runcall(measure, args.schedule, args.pp, m, args.chunks)
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.profile)
        else:
            row = measure(args.schedule, args.pp, m, args.chunks)
        if rows:
            prev = rows[-1]
            row["growth_vs_linear"] = (row["total_cpu_s"] / prev["total_cpu_s"]) / (row["actions"] / prev["actions"])
        rows.append(row)
        print(f"m={m:<6} actions={row['actions']:<8} build {row['build_s']:.2f} s  validate {row['validate_s']:.2f} s"
              f"  simulate {row['simulate_s']:.2f} s  total {row['total_s']:.2f} s (cpu {row['total_cpu_s']:.2f} s)"
              + (f"  growth/linear {row['growth_vs_linear']:.2f}" if "growth_vs_linear" in row else ""), flush=True)
    report = {"schedule": args.schedule, "pp": args.pp, "chunks": args.chunks, "rows": rows,
              "python": platform.python_version(), "machine": platform.machine(),
              "cpus": os.cpu_count(), "load_average_start": load_start, "load_average_end": os.getloadavg()[0],
              "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
              "command": "python benchmarks/bench_schedule_build.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
