"""Measure what decides whether PipeOffload is free: copy bandwidth, layer time, the ratio k, and the cost
of full offload on one device.

    python benchmarks/bench_offload.py --json runs/bench_offload.json            # a GPU: defaults sized for it
    python benchmarks/bench_offload.py --hidden 256 512 --seq 128 256 --stack-hidden 256 --stack-seq 128 \\
        --layers 4 --copy-mb 64 --json runs/bench_offload_cpu.json          # CPU: only a smoke test

1. Bandwidth: one-way device-to-host and host-to-device copy rate into pinned host memory (the PCIe
   number Eq. 1 of PipeOffload, arXiv 2503.01328, calls B_o; never the duplex sum), median over `--repeats`
   copies. On a CPU-only machine this is a host-to-host copy, reported as such: it says nothing about PCIe.
2. k for every (hidden, seq): one LLaMA-shaped layer (RMSNorm, SwiGLU, RoPE, grouped-query attention),
   micro-batch 1, bf16 on GPU and fp32 on CPU. Measured F+B time t and saved bytes S (the activation
   store's count) give k = 2·S / B_D2H / t; the same layer's achieved FLOP/s B_c = 12·s·h·(6h + s) / t
   gives Eq. 1, k = 10 / (3·(6h + s)) · B_c / B_D2H (which assumes 20·s·h saved bytes, i.e. norms and
   activations recomputed; this layer saves more, so the measured k is the larger). Full offload is free
   when k ≤ 1.
3. Full offload on one device: a stack of `--layers` such layers, one per chunk (p = 1), m microbatches,
   run as `po-f` (every stash offloaded, copies placed with `--offload-time` = offload_time_from_k of the
   stack's measured k) and as the same order without offload (`gis`, group size 1). Rounds alternate the
   two and the slowdown is the median of the per-round ratios. On a CPU copies are synchronous, so the
   cost there is the copying itself, not a failure to overlap.
4. PO-H and GIS-H against interleaved 1F1B on the same stack and device: resident stash peak (and, on
   CUDA, the step's peak allocated memory) and the paired step-time ratio, each relative to interleaved
   1F1B (the issue's GPU target: PO-H stash ≤ 0.25× at ≤ 1.05× the step time). One device means p = 1,
   where every schedule keeps one microbatch's chunks in flight at a time; the multi-rank memory ratios
   come from the simulator (`tools/plot_schedule.py`) and the exactness tests.

Results go to stdout and `--json`; docs/benchmarks.md records them with the device name.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

os.environ.setdefault("OMP_NUM_THREADS", "1")
_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from megatron_pp.data.mock import MockData  # noqa: E402
from megatron_pp.models.layout import StageSpec, split_layers  # noqa: E402
from megatron_pp.models.presets import get_preset, llama_ffn_hidden_size  # noqa: E402
from megatron_pp.models.transformer import StageModel  # noqa: E402
from megatron_pp.schedules.execute import PipelineExecutor  # noqa: E402
from megatron_pp.schedules.offload import (full_offload_is_free, k_from_formula, k_from_measurement,  # noqa: E402
                                           offload_time_from_k)
from megatron_pp.schedules.registry import build_schedule  # noqa: E402
from megatron_pp.schedules.store import ActivationStore  # noqa: E402
from megatron_pp.training.offload_probe import median_seconds, sync  # noqa: E402


def copy_bandwidth(device: torch.device, megabytes: int, repeats: int) -> dict:
    """One-way copy rates in bytes/s (pinned host memory on CUDA)."""
    n = megabytes * 2**20
    on_cuda = device.type == "cuda"
    host = torch.empty(n, dtype=torch.uint8, pin_memory=on_cuda)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    d2h = median_seconds(lambda: host.copy_(dev, non_blocking=on_cuda), device, repeats, warmup=2)
    h2d = median_seconds(lambda: dev.copy_(host, non_blocking=on_cuda), device, repeats, warmup=2)
    return {"bytes": n, "d2h_bytes_per_s": n / d2h, "h2d_bytes_per_s": n / h2d,
            "kind": "pinned PCIe copy" if on_cuda else "host-to-host memcpy (CPU only, not PCIe)"}


def layer_config(hidden: int, seq: int, num_layers: int, dtype: torch.dtype):
    """A LLaMA-shaped config: heads of 128 (64 below hidden 1024), 8 query groups when heads allow."""
    head_dim = 128 if hidden >= 1024 else 64
    heads = hidden // head_dim
    groups = 8 if heads % 8 == 0 else heads
    return dataclasses.replace(
        get_preset("llama-tiny"), num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads,
        num_query_groups=groups, ffn_hidden_size=llama_ffn_hidden_size(hidden, 256), seq_length=seq,
        max_position_embeddings=seq, vocab_size=8192, params_dtype=dtype)


def measure_layer(hidden: int, seq: int, device: torch.device, dtype: torch.dtype, repeats: int,
                  bandwidth: float) -> dict:
    config = layer_config(hidden, seq, 3, dtype)
    layer = StageModel(config, StageSpec(1, 1, 2, has_embedding=False, has_head=False), device=device, seed=1)
    batch = {"tokens": torch.zeros(1, seq, dtype=torch.long, device=device)}
    x = torch.randn(seq, 1, hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(seq, 1, hidden, device=device, dtype=dtype)

    def step() -> None:
        layer(x, batch).backward(grad)

    t = median_seconds(step, device, repeats, warmup=2)
    store = ActivationStore(list(layer.parameters()) + list(layer.buffers()))
    with store.stash(0):
        y = layer(x, batch)
    saved = store.live_bytes
    del y
    flops = 12.0 * seq * hidden * (6 * hidden + seq)
    k = k_from_measurement(saved, bandwidth, t)
    return {"hidden": hidden, "seq": seq, "fb_time_s": t, "saved_bytes": saved, "achieved_flops": flops / t,
            "k_measured": k, "k_eq1": k_from_formula(hidden, seq, flops / t, bandwidth),
            "full_offload_free": full_offload_is_free(k)}


def paired_steps(entries: Sequence[tuple[str, str, dict]], hidden: int, seq: int, layers: int, microbatches: int,
                 rounds: int, device: torch.device, dtype: torch.dtype) -> dict:
    """Run each (label, schedule, options) on one device (p = 1, a layer per chunk), rounds alternating their
    order; per label the step times, the executor's peak resident stash bytes and, on CUDA, the step's peak
    allocated device memory (reset before every step). The first round warms up (host buffer pool too)."""
    config = layer_config(hidden, seq, layers, dtype)
    layout = split_layers(layers, 1, layers)
    data = MockData(1, seq, config.vocab_size, 1, microbatches)
    batches = data.step_microbatches(0, 0, device)
    scale = 1.0 / sum(float(b["loss_mask"].sum()) for b in batches)
    executors = {}
    for label, name, options in entries:
        schedule = build_schedule(name, 1, microbatches, layers, **options)
        chunks = [StageModel(config, layout[schedule.stage_of(0, c)], device=device, seed=1) for c in range(layers)]
        executors[label] = (PipelineExecutor(schedule, 0, chunks, comm=None, activation_shape=(seq, 1, hidden),
                                             dtype=dtype, device=device), chunks, schedule)
    times: dict[str, list[float]] = {label: [] for label in executors}
    peaks: dict[str, int] = {}
    device_peaks: dict[str, int] = {}
    for round_ in range(rounds + 1):
        for label in (list(executors) if round_ % 2 == 0 else list(reversed(executors))):
            executor, chunks, _ = executors[label]
            for chunk in chunks:
                chunk.zero_grad(set_to_none=True)
            sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            result = executor.run(batches, scale)
            sync(device)
            if round_:
                times[label].append(time.perf_counter() - start)
            peaks[label] = result.peak_stash_bytes
            if device.type == "cuda":
                device_peaks[label] = torch.cuda.max_memory_allocated(device)
    return {"times": times, "peak_resident_bytes": peaks, "peak_device_bytes": device_peaks or None,
            "schedules": {label: schedule for label, (_, _, schedule) in executors.items()}}


def offload_cost(hidden: int, seq: int, layers: int, microbatches: int, rounds: int, device: torch.device,
                 dtype: torch.dtype, offload_time: float) -> dict:
    """Step time of po-f against the same order without offload on one device (p = 1, a layer per chunk)."""
    run = paired_steps([("no offload", "gis", {"interleave_group_size": 1}),
                        ("po-f", "po-f", {"offload_time": offload_time})],
                       hidden, seq, layers, microbatches, rounds, device, dtype)
    times = run["times"]
    ratios = [b / a for a, b in zip(times["no offload"], times["po-f"])]
    offloaded = sum(1 for a in run["schedules"]["po-f"].actions[0] if a.op.value == "OFFLOAD")
    return {"hidden": hidden, "seq": seq, "layers": layers, "microbatches": microbatches, "rounds": rounds,
            "offload_time": offload_time, "offloaded_stashes": offloaded,
            "step_s": {label: statistics.median(t) for label, t in times.items()},
            "slowdown": statistics.median(ratios) - 1.0,
            "peak_resident_bytes": run["peak_resident_bytes"]}


def against_interleaved(hidden: int, seq: int, layers: int, microbatches: int, rounds: int, device: torch.device,
                        dtype: torch.dtype, offload_time: float) -> dict:
    """PO-H and GIS-H against interleaved 1F1B on one device: stash and device memory ratios, and the paired
    step-time ratio (median of per-round ratios), each relative to interleaved 1F1B."""
    entries = [("interleaved-1f1b", "interleaved-1f1b", {}), ("gis-h", "gis-h", {}),
               ("po-h", "po-h", {"offload_time": offload_time})]
    run = paired_steps(entries, hidden, seq, layers, microbatches, rounds, device, dtype)
    base = "interleaved-1f1b"
    times, peaks, device_peaks = run["times"], run["peak_resident_bytes"], run["peak_device_bytes"]
    rows = {}
    for label, _, _ in entries:
        rows[label] = {
            "step_s": statistics.median(times[label]),
            "step_ratio": statistics.median(t / b for t, b in zip(times[label], times[base])),
            "peak_resident_bytes": peaks[label],
            "stash_ratio": peaks[label] / peaks[base] if peaks[base] else None,
            "peak_device_bytes": device_peaks[label] if device_peaks else None,
        }
    return {"hidden": hidden, "seq": seq, "layers": layers, "microbatches": microbatches, "rounds": rounds,
            "offload_time": offload_time, "baseline": base, "schedules": rows,
            "targets": {"po_h_stash_ratio_max": 0.25, "po_h_step_ratio_max": 1.05}}


def main(argv: Sequence[str] | None = None) -> int:
    on_gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[2048, 4096, 8192] if on_gpu else [256, 512])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192] if on_gpu else [128, 256])
    parser.add_argument("--stack-hidden", type=int, default=4096 if on_gpu else 256)
    parser.add_argument("--stack-seq", type=int, default=4096 if on_gpu else 128)
    parser.add_argument("--layers", type=int, default=8 if on_gpu else 4, help="layers (= chunks) of the stack")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10 if on_gpu else 5)
    parser.add_argument("--copy-mb", type=int, default=512 if on_gpu else 64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    torch.manual_seed(0)

    device_name = (torch.cuda.get_device_name(device) if on_gpu
                   else f"CPU only ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
    bandwidth = copy_bandwidth(device, args.copy_mb, args.repeats)
    d2h = bandwidth["d2h_bytes_per_s"]
    print(f"device: {device_name}; {bandwidth['kind']}: D2H {d2h / 1e9:.1f} GB/s, "
          f"H2D {bandwidth['h2d_bytes_per_s'] / 1e9:.1f} GB/s")
    rows = []
    for hidden in args.hidden:
        for seq in args.seq:
            row = measure_layer(hidden, seq, device, dtype, args.repeats, d2h)
            rows.append(row)
            print(f"h={hidden:6d} s={seq:6d}: F+B {row['fb_time_s'] * 1e3:8.2f} ms, saved "
                  f"{row['saved_bytes'] / 2**20:8.1f} MiB, {row['achieved_flops'] / 1e12:6.2f} TFLOP/s, k measured "
                  f"{row['k_measured']:.2f}, Eq. 1 {row['k_eq1']:.2f}, "
                  f"full offload {'free' if row['full_offload_free'] else 'NOT free'}")
    stack_k = measure_layer(args.stack_hidden, args.stack_seq, device, dtype, args.repeats, d2h)["k_measured"]
    cost = offload_cost(args.stack_hidden, args.stack_seq, args.layers, args.microbatches, args.rounds, device, dtype,
                        offload_time_from_k(stack_k))
    step, peak = cost["step_s"], cost["peak_resident_bytes"]
    print(f"full offload, {args.layers} layers h={args.stack_hidden} s={args.stack_seq} (k={stack_k:.2f}, offload "
          f"time {cost['offload_time']:.2f}): step {step['no offload'] * 1e3:.1f} ms -> {step['po-f'] * 1e3:.1f} ms "
          f"({cost['slowdown']:+.1%}), resident stash peak {peak['no offload'] / 2**20:.1f} -> "
          f"{peak['po-f'] / 2**20:.1f} MiB")
    compare = against_interleaved(args.stack_hidden, args.stack_seq, args.layers, args.microbatches, args.rounds,
                                  device, dtype, offload_time_from_k(stack_k))
    for label, row in compare["schedules"].items():
        memory = f", device peak {row['peak_device_bytes'] / 2**30:.2f} GiB" if row["peak_device_bytes"] else ""
        print(f"{label:<17} step x{row['step_ratio']:.3f} of interleaved 1F1B, resident stash peak "
              f"{row['peak_resident_bytes'] / 2**20:.1f} MiB (x{row['stash_ratio']:.2f}){memory}")
    report = {
        "device": device_name,
        "torch": torch.__version__, "dtype": str(dtype), "bandwidth": bandwidth, "layers": rows,
        "full_offload": {**cost, "k": stack_k},
        "against_interleaved": compare,
        "command": "python benchmarks/bench_offload.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json + ".tmp").write_text(json.dumps(report, indent=2) + "\n")
        os.replace(args.json + ".tmp", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
