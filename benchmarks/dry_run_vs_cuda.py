"""The dry run held to a real allocator: one full-width stage trained on one GPU against its dry run.

    python benchmarks/dry_run_vs_cuda.py --json docs/results/gpu/dry_run_vs_cuda.json [-- extra pretrain flags]

Run by `tools/gpu_check.py` on a machine with CUDA. Two subprocesses with the same flags: the job itself
(`pretrain_llama.py` under `torchrun`, one GPU, NCCL, bf16, two iterations, `--log-interval 1`), whose metrics
rows carry `torch.cuda.max_memory_allocated` of each iteration (`training.metrics.take_peak_memory`: reset after
every reading, so iteration 2's figure is that step's own peak, Adam's state included), and its dry run
(`--dry-run 1`: the same job on fake CPU tensors, one process, no GPU), whose total peak is counted from live
storages and falls in step 2. The stage is LLaMA-3-8B's width (hidden 4096, FFN 14336, 32 heads, 8 KV groups,
128256-token vocabulary) cut to 4 layers so that it fits one 80 GB GPU with its embedding, head and optimizer.

What the allocator holds and the dry run cannot count (docs/dry_run.md, "What it cannot count"): the caching
allocator's rounding of each block, cuBLAS and attention workspaces, anything a kernel allocates for itself. So
the dry run may fall short of the real peak, and must not exceed it: a figure above the real one is a tensor
the dry run invents. The bounds below are ours, chosen before any GPU run: the dry run within
[`LOW`, `HIGH`] of `max_memory_allocated`.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FLAGS = ["--model-preset", "llama3-8b", "--num-layers", "4", "--seq-length", "4096",
         "--max-position-embeddings", "4096", "--micro-batch-size", "1", "--global-batch-size", "4",
         "--train-iters", "2", "--lr", "1e-4", "--min-lr", "1e-5", "--bf16", "--mock-data", "--log-interval", "1"]
LOW, HIGH = 0.90, 1.005
"""Dry run over real: at most 10% short (allocator rounding, workspaces), at most 0.5% over."""


def real_argv(python: str, flags: list[str], metrics: str) -> list[str]:
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
            str(ROOT / "pretrain_llama.py"), *flags, "--distributed-backend", "nccl", "--metrics-file", metrics]


def dry_argv(python: str, flags: list[str], out: str) -> list[str]:
    return [python, str(ROOT / "pretrain_llama.py"), *flags, "--dry-run", "1", "--dry-run-json", out]


def compare(rows: list[dict], dry: dict) -> dict:
    """The real job's per-iteration CUDA peaks (metrics rows) against the dry run's rank 0 (its JSON)."""
    steps = [r for r in rows if "loss" in r and r.get("peak_memory_bytes")]
    if len(steps) < 2:
        raise ValueError(f"the real run logged {len(steps)} iteration(s) with a CUDA peak; 2 are needed")
    (rank,) = [r for r in dry["ranks"] if r["rank"] == 0]
    real = int(steps[1]["peak_memory_bytes"][0])
    ratio = rank["peak_bytes"] / real
    return {
        "real_peak_bytes_per_iteration": [int(r["peak_memory_bytes"][0]) for r in steps],
        "real_peak_bytes": real,
        "dry_run": {k: rank[k] for k in ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "stash_peak_bytes",
                                         "transient_peak_bytes", "peak_bytes", "peak_at")},
        "dry_over_real": ratio,
        "real_minus_dry_bytes": real - rank["peak_bytes"],
        "bounds": [LOW, HIGH],
        "within_bounds": LOW <= ratio <= HIGH,
    }


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    given = list(argv)
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="where the comparison goes")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per subprocess")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("dry_run_vs_cuda: no CUDA device here (torch.cuda.is_available() is False): nothing to compare")
        return 0
    flags = [*FLAGS, *extra]
    work = tempfile.mkdtemp(prefix="dry_run_vs_cuda-")
    metrics, dry_json = os.path.join(work, "metrics.jsonl"), os.path.join(work, "dry_run.json")
    commands = {"real": real_argv(sys.executable, flags, metrics), "dry_run": dry_argv(sys.executable, flags, dry_json)}
    for name, command in commands.items():
        proc = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout_s, cwd=ROOT)
        if proc.returncode != 0:
            print(f"dry_run_vs_cuda: the {name} run failed (exit {proc.returncode}): "
                  f"{(proc.stdout + proc.stderr)[-2000:]}", file=sys.stderr)
            return 1
    rows = [json.loads(line) for line in Path(metrics).read_text().splitlines() if line.strip()]
    result = compare(rows, json.loads(Path(dry_json).read_text()))
    result.update({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                   "commands": {k: shlex.join(v) for k, v in commands.items()},
                   "command": "python benchmarks/dry_run_vs_cuda.py " + shlex.join(given)})
    from megatron_pp.cli import write_json

    write_json(args.json, result)
    print(f"dry run {result['dry_run']['peak_bytes'] / 2**30:.2f} GiB against max_memory_allocated "
          f"{result['real_peak_bytes'] / 2**30:.2f} GiB: {result['dry_over_real']:.4f} "
          f"({'within' if result['within_bounds'] else 'outside'} [{LOW}, {HIGH}])")
    return 0 if result["within_bounds"] else 1


if __name__ == "__main__":
    sys.exit(main())
