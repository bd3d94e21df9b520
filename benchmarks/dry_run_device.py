"""The dry run's device, paired: the same rank on fake CPU tensors and on the meta device, alternating.

    python benchmarks/dry_run_device.py --pairs 3 --out docs/results/dry_run_device_llama3_70b_m8.json -- \
        --model-preset llama3-70b --mock-data --bf16 ... --dry-run 64 --dry-run-ranks 0

Each run is a fresh process (FakeTensorMode's dispatch cache is process-wide, so a second run in one process
would start warm); the runs alternate cpu, meta, cpu, meta, ... so drift in the host's load falls on both.
The meta device counts what the CPU device counts but for two of the job's own device-dependent choices
(tests/training/test_dry_run_meta.py): the linear layers' weight-gradient fold (on meta as on a GPU with
fp32-output GEMMs, one fp32 product; on the CPU fp32 copies of both operands) and the batch, which the meta
job copies to its device and the CPU job already has there. Once, untimed, meta runs with both made the CPU's
(`bytes.meta_with_cpu_fold_and_batch`), and the JSON says whether that equals the CPU device to the byte.
Timed: the rank's CPU seconds (`RankReport.seconds`, process time from the fake world's start to the end of
the second step) and each step's. Both devices build foreach AdamW (`--dry-run-optimizer foreach`: torch's
fused AdamW refuses meta parameters), so their byte figures are comparable; the JSON says whether they are
equal. Also counted, once: the operators the job dispatches on the CPU device and how many are RoPE's
rotation. CPU seconds are process time: other work on the host slows them less than the wall clock, but it
does slow them (shared caches, frequency), so compare pairs, not runs from different hours.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BYTES = ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "stash_peak_bytes", "transient_peak_bytes",
         "peak_bytes", "peak_at", "host_peak_bytes")
CHILD = """
import json, sys, torch
from megatron_pp.training import dry_run
from megatron_pp.training.arguments import parse_args
args = parse_args(json.loads(sys.argv[1]))
(rank,) = dry_run.chosen_ranks(args)
print(json.dumps(dry_run.run_rank(args, rank, torch.device(args.dry_run_device)).row()))
"""
ALIGNED = """
import json, sys, torch
from megatron_pp.core.tensor_parallel import layers
from megatron_pp.training import dry_run
from megatron_pp.training.arguments import parse_args
def upcast_fold(weight, grad_out, x):  # add_to_main_grad's CPU branch, on any device
    g, i = grad_out.reshape(-1, grad_out.size(-1)), x.reshape(-1, x.size(-1))
    weight.main_grad.addmm_(g.t().float(), i.float())
    weight.main_grad_added()
class BatchAlreadyOnMeta(dry_run.TrackingFakeMode):  # the batch as fake meta tensors: .to(meta) copies nothing
    def from_tensor(self, t, *a, **k):
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            t = t.to("meta")
        return super().from_tensor(t, *a, **k)
layers.add_to_main_grad = upcast_fold
dry_run.TrackingFakeMode = BatchAlreadyOnMeta
args = parse_args(json.loads(sys.argv[1]))
(rank,) = dry_run.chosen_ranks(args)
print(json.dumps(dry_run.run_rank(args, rank, torch.device("meta")).row()))
"""
COUNT = """
import json, sys, torch
from megatron_pp.models import ops
from megatron_pp.training import dry_run
from megatron_pp.training.arguments import parse_args
counts = {"operators": 0, "rotary": 0}
inside = [False]
class Counting(dry_run.TrackingFakeMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._inside and func is not dry_run._DEVICE_OF:
            counts["operators"] += 1
            counts["rotary"] += inside[0]
        return super().__torch_dispatch__(func, types, args, kwargs)
rotate = ops._rotate_kernel
def counted(*a):
    inside[0] = True
    try:
        return rotate(*a)
    finally:
        inside[0] = False
ops._rotate_kernel = counted
dry_run.TrackingFakeMode = Counting
args = parse_args(json.loads(sys.argv[1]))
(rank,) = dry_run.chosen_ranks(args)
dry_run.run_rank(args, rank, torch.device("cpu"))
print(json.dumps(counts))
"""


def one_run(flags: list[str], device: str, child: str = CHILD) -> dict:
    """The rank's row from a fresh process on `device`."""
    argv = flags + ["--dry-run-device", device, "--dry-run-optimizer", "foreach", "--dry-run-jobs", "1"]
    done = subprocess.run([sys.executable, "-c", child, json.dumps(argv)], capture_output=True, text=True,
                          cwd=ROOT, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def operator_counts(flags: list[str]) -> dict:
    """Operators the job dispatches to the fake mode on the CPU device (its own, not those the fake mode runs
    inside itself; `tensor.device` queries left out) and how many of them are RoPE's rotation
    (`models.ops._rotate_kernel`, forward and backward)."""
    argv = flags + ["--dry-run-device", "cpu", "--dry-run-optimizer", "foreach", "--dry-run-jobs", "1"]
    done = subprocess.run([sys.executable, "-c", COUNT, json.dumps(argv)], capture_output=True, text=True,
                          cwd=ROOT, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="-- then the dry run's flags, one rank")
    args = parser.parse_args(argv)
    flags = [a for a in args.rest if a != "--"]
    if args.pairs < 1:
        print("error: --pairs must be >= 1", file=sys.stderr)
        return 2
    if "--dry-run-ranks" not in flags or "," in flags[flags.index("--dry-run-ranks") + 1]:
        print("error: give one rank with --dry-run-ranks R", file=sys.stderr)
        return 2
    load_before = list(os.getloadavg())
    runs = {"cpu": [], "meta": []}
    for i in range(args.pairs):
        for device in ("cpu", "meta"):
            runs[device].append(one_run(flags, device))
            print(f"pair {i + 1}: {device} {runs[device][-1]['seconds']:.1f} CPU s", flush=True)
    seconds = {d: [r["seconds"] for r in rows] for d, rows in runs.items()}
    same = all(runs["cpu"][0][k] == r[k] for rows in runs.values() for r in rows for k in BYTES)
    result = {
        "command": "python benchmarks/dry_run_device.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "cores": len(os.sched_getaffinity(0)), "load_average_before": load_before,
        "load_average_after": list(os.getloadavg()),
        "cpu_seconds": seconds, "median_cpu_seconds": {d: statistics.median(s) for d, s in seconds.items()},
        "meta_over_cpu_per_pair": [m / c for c, m in zip(seconds["cpu"], seconds["meta"])],
        "step_seconds": {d: [r["step_seconds"] for r in rows] for d, rows in runs.items()},
        "same_bytes": same, "bytes": {d: {k: rows[0][k] for k in BYTES} for d, rows in runs.items()},
        "operator_counts": operator_counts(flags),
    }
    # Untimed, once: meta with the CPU job's two device-dependent choices (weight-gradient fold, batch copy).
    aligned = one_run(flags, "meta", ALIGNED)
    result["bytes"]["meta_with_cpu_fold_and_batch"] = {k: aligned[k] for k in BYTES}
    result["meta_with_cpu_fold_and_batch_same_bytes"] = all(aligned[k] == runs["cpu"][0][k] for k in BYTES)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("median_cpu_seconds", "meta_over_cpu_per_pair", "same_bytes",
                                             "meta_with_cpu_fold_and_batch_same_bytes",
                                             "operator_counts")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
