"""Memory soak: hundreds of CPU training steps per schedule, resumed from a checkpoint every segment,
with every rank's resident memory sampled after every step; fails if RSS trends upward.

    python benchmarks/soak.py                                    # 5 schedules x 500 steps, 2 ranks, JSON to stdout
    python benchmarks/soak.py --steps 60 --segment-steps 20 --schedules 1f1b po-h --output soak.json

Each schedule runs as `--steps / --segment-steps` calls of pretrain in the same two worker processes
(gloo), each call resuming from the previous one's checkpoint. The JSON gives, per schedule and rank,
RSS at the first step, after the first segment (warm-up) and at the last step, the least-squares slope
of RSS over the second half of every later segment in KB per step, and the RSS jump per resume (see
megatron_pp/benchmarks/soak.py). The exit status is 1 when any slope exceeds --max-slope-kb. Results
on the reference machine are in docs/reliability.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_pp.core.local_world import WorkerPool  # noqa: E402
from megatron_pp.benchmarks.soak import BASE, SCHEDULES, run_schedule  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500, help="Training steps per schedule.")
    parser.add_argument("--segment-steps", type=int, default=100, help="Steps between checkpoint and resume.")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    parser.add_argument("--max-slope-kb", type=float, default=64.0,
                        help="Fail when RSS grows faster than this many KB per step on any rank.")
    parser.add_argument("--output", default=None, help="Write the JSON here as well as to stdout.")
    args = parser.parse_args(argv)
    if args.steps <= args.segment_steps or args.segment_steps < 1:
        parser.error("--steps must exceed --segment-steps (the first segment is warm-up), which must be >= 1")
    pool = WorkerPool(2)
    results = {}
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="soak-") as workdir:
            for name in args.schedules:
                t = time.monotonic()
                results[name] = run_schedule(pool.run, name, BASE + SCHEDULES[name], args.steps, args.segment_steps,
                                             workdir)
                results[name]["seconds"] = round(time.monotonic() - t, 1)
    finally:
        pool.close()
    report = {
        "command": "python benchmarks/soak.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}",
        "world_size": 2, "steps_per_schedule": args.steps, "segment_steps": args.segment_steps,
        "max_slope_kb_per_step": args.max_slope_kb, "seconds": round(time.monotonic() - started, 1),
        "schedules": results,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    worst = max(r["max_slope_kb_per_step"] for r in results.values())
    if worst > args.max_slope_kb:
        print(f"error: RSS grows {worst} KB per step (> --max-slope-kb {args.max_slope_kb})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
