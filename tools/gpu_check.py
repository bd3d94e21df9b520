"""One command that checks the GPU paths on a machine with CUDA, and records what it saw.

    python tools/gpu_check.py                  # on a GPU node: everything below, JSON under docs/results/gpu/
    python tools/gpu_check.py --plan           # print the commands it would run (any machine)

Steps, each a subprocess whose exit code, duration and last lines of output go into the report:
1. the CUDA-only tests (offload store on side streams and pinned buffers, flash-attention against the
   reference, the MFU benchmark's GPU shape, the compiled RoPE kernel, fp32-output GEMMs into the main
   gradient, the multi-tensor norm), with `pytest`;
2. `pretrain_gpt.py` under `torchrun` on one GPU with the NCCL backend, once per schedule family that
   runs on a single pipeline rank, with data parallelism of 1 and mock data (a family that cannot run at
   pp 1 is listed as refused with the validator's line, not silently skipped);
3. `benchmarks/bench_mfu.py` (LLaMA-3-8B-shaped stack cut to fit one GPU, Hugging Face baseline beside it);
4. `benchmarks/bench_offload.py` (copy bandwidth, the offload ratio k, full-offload cost, PO-H and GIS-H against
   interleaved 1F1B);
5. `benchmarks/bench_split_backward.py` (BI and BW against the whole backward, bf16);
6. `benchmarks/dry_run_vs_cuda.py` (a full-width LLaMA-3-8B stage of 4 layers: `torch.cuda.max_memory_allocated`
   of its second iteration against the dry run of the same flags).
The report (`docs/results/gpu/<device>-<date>.json`) holds every step, the benchmarks' own JSON and the
versions; a table goes to stdout. Without CUDA it prints one line saying so and exits 0, so the command
is safe to put in any job script. Exit code 1 if any step failed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CUDA_TESTS = ["tests/schedules/test_offload_store.py", "tests/models/test_attention.py", "tests/benchmarks/test_bench_mfu.py",
              "tests/models/test_fused_ops.py", "tests/core/test_main_grad.py", "tests/core/test_grad_norm.py"]
PRETRAIN = ["--model-preset", "gpt-tiny", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "16",
            "--train-iters", "4", "--lr", "1e-3", "--bf16", "--distributed-backend", "nccl", "--log-interval", "1"]
# Schedule families on one pipeline rank: (name, extra flags).
FAMILIES = [
    ("gpipe", []),
    ("1f1b", []),
    ("interleaved-1f1b", ["--num-virtual-stages-per-pipeline-rank", "2"]),
    ("gis-h", ["--num-virtual-stages-per-pipeline-rank", "2"]),
    ("po-h", ["--num-virtual-stages-per-pipeline-rank", "2"]),
    ("po-f", ["--num-virtual-stages-per-pipeline-rank", "2"]),
    ("looped-bfs", ["--num-virtual-stages-per-pipeline-rank", "2"]),
    ("bpipe", []),
    ("2bw", []),
]


def pretrain_argv(schedule: str, extra: list[str]) -> list[str]:
    return [*PRETRAIN, "--pipeline-schedule", schedule, *extra]


def steps(python: str, out_dir: str) -> list[dict]:
    """The commands of a check, in order: {"name", "argv", "json" (a file the step writes, or None)}."""
    plan = [{"name": "cuda tests", "argv": [python, "-m", "pytest", "-q", *CUDA_TESTS], "json": None}]
    for schedule, extra in FAMILIES:
        metrics = os.path.join(out_dir, f"pretrain-{schedule}.jsonl")
        plan.append({"name": f"pretrain {schedule} (nccl, 1 GPU)",
                     "argv": [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                              str(ROOT / "pretrain_gpt.py"), *pretrain_argv(schedule, extra), "--metrics-file", metrics],
                     "json": metrics, "schedule": schedule, "flags": pretrain_argv(schedule, extra)})
    plan.append({"name": "bench_mfu", "argv": [python, str(ROOT / "benchmarks" / "bench_mfu.py"), "--json",
                                               os.path.join(out_dir, "bench_mfu.json")],
                 "json": os.path.join(out_dir, "bench_mfu.json")})
    plan.append({"name": "bench_offload", "argv": [python, str(ROOT / "benchmarks" / "bench_offload.py"), "--json",
                                                   os.path.join(out_dir, "bench_offload.json")],
                 "json": os.path.join(out_dir, "bench_offload.json")})
    plan.append({"name": "bench_split_backward", "argv": [python, str(ROOT / "benchmarks" / "bench_split_backward.py"),
                                                          "--json", os.path.join(out_dir, "bench_split_backward.json")],
                 "json": os.path.join(out_dir, "bench_split_backward.json")})
    plan.append({"name": "dry run vs cuda", "argv": [python, str(ROOT / "benchmarks" / "dry_run_vs_cuda.py"), "--json",
                                                     os.path.join(out_dir, "dry_run_vs_cuda.json")],
                 "json": os.path.join(out_dir, "dry_run_vs_cuda.json")})
    return plan


def refusal(flags: list[str]) -> Optional[str]:
    """The validator's error for these pretrain flags on one GPU (world size 1), or None if they are accepted:
    the same function `pretrain_gpt.py` runs first, so a refused family costs no GPU time."""
    from megatron_pp.training.arguments import build_parser, validate_args

    args = build_parser().parse_args(flags)
    errors = validate_args(args)
    return "; ".join(errors) if errors else None


def _read(path: Optional[str]):
    if not path or not os.path.exists(path):
        return None
    text = Path(path).read_text()
    if path.endswith(".jsonl"):
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return json.loads(text)


def run_step(step: dict, timeout_s: float) -> dict:
    if step.get("flags") is not None:
        refused = refusal(step["flags"])
        if refused is not None:
            return {"name": step["name"], "status": "refused", "reason": refused}
    start = time.monotonic()
    try:
        proc = subprocess.run(step["argv"], capture_output=True, text=True, timeout=timeout_s, cwd=ROOT,
                              env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "8")})
        code, output = proc.returncode, (proc.stdout + proc.stderr)
    except subprocess.TimeoutExpired as exc:
        code, output = 124, f"timed out after {timeout_s:.0f} s: {exc}"
    result = {"name": step["name"], "status": "passed" if code == 0 else "failed", "exit_code": code,
              "seconds": round(time.monotonic() - start, 1), "command": shlex.join(step["argv"]),
              "output_tail": output[-3000:], "result": _read(step.get("json"))}
    return result


def summary_line(result: dict) -> str:
    status = result["status"]
    detail = result.get("reason", "")
    data = result.get("result")
    if result["name"].startswith("pretrain") and isinstance(data, list) and data:
        last = data[-1]
        detail = (f"loss {last.get('loss'):.3f}, peak memory {max(last.get('peak_memory_bytes') or [0]) / 2**30:.2f} GiB, "
                  f"{last.get('tokens_per_s', 0):.0f} tokens/s")
    elif result["name"] == "bench_mfu" and isinstance(data, dict):
        detail = (f"MFU {100 * (data['ours']['mfu'] or 0):.1f}%, ours/HF tokens/s {data['ratio_tokens_per_s']['median']:.2f}x, "
                  f"attention {data.get('attention_in_use')}")
    elif result["name"] == "dry run vs cuda" and isinstance(data, dict):
        detail = (f"dry run {data['dry_run']['peak_bytes'] / 2**30:.2f} GiB, max_memory_allocated "
                  f"{data['real_peak_bytes'] / 2**30:.2f} GiB, ratio {data['dry_over_real']:.4f}")
    elif result["name"] == "cuda tests":
        match = re.findall(r"\d+ (?:passed|failed|skipped)", result.get("output_tail", ""))
        detail = ", ".join(match)
    return f"{result['name']:<36} {status:<8} {detail}"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", action="store_true", help="print the commands and exit (needs no GPU)")
    parser.add_argument("--out-dir", default=str(ROOT / "docs" / "results" / "gpu"),
                        help="where the report goes (default docs/results/gpu)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per step")
    args = parser.parse_args(argv)
    work = tempfile.mkdtemp(prefix="gpu_check-")
    plan = steps(sys.executable, work)
    if args.plan:
        for step in plan:
            print(shlex.join(step["argv"]))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False): nothing to check")
        return 0
    device = torch.cuda.get_device_name(0)
    results = []
    for step in plan:
        result = run_step(step, args.timeout_s)
        results.append(result)
        print(summary_line(result), flush=True)
    stamp = datetime.datetime.now(datetime.timezone.utc)
    report = {"format": "megatron_pp.gpu_check/1", "device": device, "date": stamp.isoformat(timespec="seconds"),
              "versions": {"torch": torch.__version__, "cuda": torch.version.cuda,
                           "nccl": ".".join(map(str, torch.cuda.nccl.version()))},
              "command": "python tools/gpu_check.py" + (" " + shlex.join(argv) if argv else ""), "steps": results}
    os.makedirs(args.out_dir, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-").lower()
    path = os.path.join(args.out_dir, f"{slug}-{stamp:%Y%m%d}.json")
    from megatron_pp.cli import write_json

    write_json(path, report)
    print(f"report: {os.path.relpath(path, ROOT)}")
    return 0 if all(r["status"] != "failed" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
