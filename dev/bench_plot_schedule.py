"""Time tools/plot_schedule.py at cluster scale: build, simulate and draw one schedule, several rounds (JSON out).

    python dev/bench_plot_schedule.py --schedule interleaved-1f1b --pp 32 --chunks 4 --microbatches 256 \\
        --rounds 3 --json docs/results/plot_schedule_scale.json

Each round builds the schedule (generator, communication, validation), simulates it and draws the PNG
in this process, timing each part by wall clock and by this process's CPU time (the CPU time is what a
busy shared machine does not inflate). The tool's own start (imports of torch and matplotlib) is
reported once. The median of the rounds is the figure in docs/benchmarks.md.
"""
from __future__ import annotations

import os
import platform
import statistics
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, "tools"))

_T0 = time.perf_counter(), time.process_time()
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot  # noqa: E402,F401

import plot_schedule  # noqa: E402
from megatron_pp.cli import ExitingArgumentParser, write_json  # noqa: E402
from megatron_pp.schedules.registry import build_schedule  # noqa: E402
from megatron_pp.schedules.simulate import simulate  # noqa: E402

_IMPORT = time.perf_counter() - _T0[0], time.process_time() - _T0[1]


def _timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    value = fn()
    return value, {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}


def main(argv=None) -> int:
    parser = ExitingArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="interleaved-1f1b")
    parser.add_argument("--pp", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        png = os.path.join(tmp, "schedule.png")
        for _ in range(args.rounds):
            schedule, build = _timed(lambda: build_schedule(args.schedule, args.pp, args.microbatches, args.chunks))
            result, sim = _timed(lambda: simulate(schedule))
            _, draw = _timed(lambda: plot_schedule.draw(schedule, result, png))
            rounds.append({"build": build, "simulate": sim, "draw": draw,
                           "total_cpu_s": build["cpu_s"] + sim["cpu_s"] + draw["cpu_s"],
                           "total_wall_s": build["wall_s"] + sim["wall_s"] + draw["wall_s"]})
        png_bytes = os.path.getsize(png)
    median = {key: statistics.median(r[key] if key.startswith("total") else r[key]["cpu_s"] for r in rounds)
              for key in ("build", "simulate", "draw", "total_cpu_s", "total_wall_s")}
    report = {
        "command": "python dev/bench_plot_schedule.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "schedule": args.schedule, "pp": args.pp, "chunks": args.chunks, "microbatches": args.microbatches,
        "actions": sum(len(a) for a in schedule.actions), "png_bytes": png_bytes,
        "import_s": {"wall_s": _IMPORT[0], "cpu_s": _IMPORT[1]},
        "median_cpu_s": median, "rounds": rounds,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "matplotlib": matplotlib.__version__},
    }
    print(f"{args.schedule} p={args.pp} v={args.chunks} m={args.microbatches}: median CPU s build "
          f"{median['build']:.2f}, simulate {median['simulate']:.2f}, draw {median['draw']:.2f}, total "
          f"{median['total_cpu_s']:.2f} (wall {median['total_wall_s']:.2f}); imports {_IMPORT[1]:.2f}")
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
