"""A larger draw of the interaction matrix: the same cases and checks as tests/training/test_interaction_matrix.py,
from other seeds and several arrays at once, with a JSON report.

Each array covers every feasible pair of levels once (megatron_pp/testing/interaction.py); `--arrays K` joins K
arrays drawn from seeds SEED, SEED+1, ..., so each pair meets K (mostly different) contexts. Cases that appear
twice run once. A development aid run from a checkout: it uses the tests' runner (tests/interaction.py) and
worker pool (tests/dist.py), so the repository root goes on sys.path.

    python dev/interaction_matrix.py --list                       # the default array, one case a line
    python dev/interaction_matrix.py --seed 11 --arrays 3 --json runs/interaction.json
    python dev/interaction_matrix.py --only bf16-zb               # the cases whose name contains a string

Exit status: 0 when every case ran or was refused as it should be, 1 when one failed (its line says why).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from typing import Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def draw(seed: int, arrays: int, candidates: int, workdir: str) -> list[dict]:
    """The union of `arrays` arrays from seeds seed, seed+1, ..., first appearance order, no case twice."""
    from megatron_pp.testing import interaction

    cases, seen = [], set()
    for k in range(arrays):
        for case in interaction.covering_array(seed + k, candidates, accepts=interaction.accepted(workdir)):
            key = tuple(sorted(case.items()))
            if key not in seen:
                seen.add(key)
                cases.append(case)
    return cases


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=None, help="first array's seed (default: the test's)")
    parser.add_argument("--arrays", type=int, default=1, help="arrays drawn from consecutive seeds, joined")
    parser.add_argument("--candidates", type=int, default=4, help="greedy rows tried per added row")
    parser.add_argument("--only", default=None, help="run only cases whose name contains this string")
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)
    if args.arrays < 1 or args.candidates < 1:
        parser.error("--arrays and --candidates must be at least 1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, ROOT)
    import torch

    from megatron_pp.testing import interaction
    from tests.dist import run_distributed, shutdown_pools
    from tests.interaction import Runner

    torch.set_num_threads(1)
    seed = interaction.SEED if args.seed is None else args.seed
    workdir = tempfile.mkdtemp(prefix="interaction-")
    cases = draw(seed, args.arrays, args.candidates, workdir)
    jobs = [(case, interaction.make_job(case, workdir)) for case in cases]
    if args.only:
        jobs = [(c, j) for c, j in jobs if args.only in j.name]
    if args.list:
        for _, job in jobs:
            print(job.name)
        print(f"{len(jobs)} cases; {interaction.skipped_pairs()} pairs of levels skipped by construction")
        return 0
    runner, report = Runner(run_distributed, workdir), []
    try:
        for case, job in jobs:
            start = time.perf_counter()
            try:
                outcome, detail = runner.outcome(case), None
            except AssertionError as exc:
                outcome, detail = "failed", str(exc).strip().splitlines()[-1][:500]
            except Exception as exc:  # noqa: BLE001 - a bug in the run is a failed case, with its traceback
                outcome, detail = "failed", "".join(traceback.format_exception_only(exc)).strip()[:500]
            report.append({"case": job.name, "world": job.world, "outcome": outcome, "detail": detail,
                           "deviation": runner.deviations.get(job.name),
                           "wall_s": round(time.perf_counter() - start, 2)})
            print(f"{outcome:8s} {job.name}" + (f": {detail}" if detail else ""), flush=True)
    finally:
        shutdown_pools()
    counts = {k: sum(r["outcome"] == k for r in report) for k in ("ran", "refused", "failed")}
    # Also the largest relative error of an update element (every precision) and, in fp32, of a gradient tensor
    # (tests/interaction.py)
    largest = {p: {k: max((r["deviation"][k] for r in report if r["deviation"] and k in r["deviation"]
                           and r["case"].startswith(p)), default=None)
                   for k in ("loss", "grad_norm") + (("gradient", "update") if p == "fp32" else ("update",))}
               for p in ("fp32", "bf16", "fp16")}
    summary = {"seed": seed, "arrays": args.arrays, "candidates": args.candidates, "cases": len(report),
               "skipped_pairs": interaction.skipped_pairs(), **counts,
               "largest_relative_deviation_from_reference": largest, "results": report}
    print(f"{len(report)} cases: {counts['ran']} ran, {counts['refused']} refused, {counts['failed']} failed; "
          f"largest relative deviation from the reference (loss, grad norm): {largest}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
