"""Paired step-time benchmark of pipeline schedules against a single-process baseline.

Machines here are shared and noisy (the same CPU step can vary 2x from minute to minute), so a lone
time means nothing. This module alternates, round by round, one baseline step (the whole model, one
process, one thread, plain forward/backward over the same microbatches) and one step of each schedule
(pp processes on a local gloo world, one thread each), and reports each schedule's time as a ratio to
the *same round's* ideal:

    ideal = baseline / p x (1 + bubble),  bubble = (p-1)/m for 1F1B and GPipe, (p-1)/(v m) interleaved

i.e. perfect p-way splitting of the baseline's compute plus the schedule's own fill/drain bubble with
F:B = 1:2. A ratio of 1.00 means the executor, communication and stage imbalance cost nothing.

Each round also runs a *contention control*: every worker runs the whole baseline step at the same
time. On a small VM two busy processes slow each other (shared caches, memory bandwidth, host
scheduling), so `baseline / p` is not reachable even with zero overhead; `control / p x (1 + bubble)`
is the ideal under the same contention, and the ratio to it isolates what the pipeline machinery and
the stage split cost. CPU-seconds per rank and the seconds each rank spent blocked in receives are
reported beside it, together with tokens/s, TFLOP/s per device and MFU (MFU only against a known device
peak, never on CPU), the simulated bubble of the same action lists next to the measured one (1 − the
rank's compute time / step time, compute excluding time blocked in receives), and peak activation
memory per pipeline rank (saved-for-backward bytes; on CUDA also the allocator's peak).
The worker-side functions live here (not in tools/) so spawned workers can import them.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Optional, Sequence

import torch

from megatron_pp.core.local_world import WorkerPool
from megatron_pp.core.parallel_state import default_device
from megatron_pp.data.mock import MockData
from megatron_pp.models.config import TransformerConfig
from megatron_pp.models.transformer import build_model
from megatron_pp.schedules.registry import build_schedule

_PIPELINES: dict = {}


def bench_config(layers: int, hidden: int, heads: int, seq: int, vocab: int, preset: str) -> TransformerConfig:
    from megatron_pp.models.presets import get_preset

    return dataclasses.replace(
        get_preset(preset), num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        num_query_groups=None, ffn_hidden_size=4 * hidden, seq_length=seq, max_position_embeddings=seq,
        vocab_size=vocab,
    )


def ideal_bubble(name: str, p: int, m: int, v: int) -> float:
    return (p - 1) / (m * v) if name.startswith("interleaved") else (p - 1) / m


COMPUTE_PREFIXES = ("F", "B")  # F, B, BI, BW: action labels of compute (communication starts SEND_/RECV_)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _worker_step(ctx, config, name, pp, m, v, micro_batch, seed):
    """One timed training step (forward, backward, gradient finalisation) of schedule `name`."""
    from megatron_pp.training.train import build_pipeline, train_step

    key = (name, pp, m, v)
    if key not in _PIPELINES:
        state = ctx.parallel_state(1, pp)
        schedule = build_schedule(name, pp, m, v)
        # Tracing costs two clock reads per action on CPU; on CUDA it synchronises after every action,
        # which is why CUDA timings come from an untraced step.
        pipe = build_pipeline(config, state, schedule, micro_batch_size=micro_batch, seed=seed,
                              trace=state.device.type != "cuda")
        data = MockData(seed, config.seq_length, config.vocab_size, micro_batch, micro_batch * m * state.dp_size, state.dp_size)
        _PIPELINES[key] = (pipe, data.step_microbatches(0, state.dp_rank, state.device))
    pipe, microbatches = _PIPELINES[key]
    device = pipe.state.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    torch.distributed.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    result, _ = train_step(pipe, microbatches)
    _sync(device)
    wall = time.perf_counter() - wall
    compute = sum(end - start for label, start, end in result.events if label.startswith(COMPUTE_PREFIXES))
    return {
        "wall_s": wall, "cpu_s": time.process_time() - cpu, "wait_s": result.comm_wait_s,
        # Receives are waited for inside the compute action that consumes them: take that wait out.
        "busy_s": max(compute - result.comm_wait_s, 0.0) if result.events else None,
        "peak_stash_bytes": result.peak_stash_bytes,
        "peak_cuda_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }


_CONTROL: dict = {}


def _worker_control(ctx, config, micro_batch, m, seed):
    """Contention control: every worker runs the whole single-process baseline step at once."""
    if "model" not in _CONTROL:
        device = default_device()
        data = MockData(seed, config.seq_length, config.vocab_size, micro_batch, micro_batch * m)
        batches = data.step_microbatches(0, 0, device)
        _CONTROL["model"] = (build_model(config, seed=seed, device=device), batches,
                             float(sum(b["loss_mask"].sum() for b in batches)))
    model, batches, tokens = _CONTROL["model"]
    torch.distributed.barrier()
    return _baseline_step(model, batches, tokens)


def _baseline_step(model, microbatches, tokens: float) -> float:
    for p in model.parameters():
        p.grad = None
    device = next(model.parameters()).device
    _sync(device)
    start = time.perf_counter()
    for batch in microbatches:
        loss = (model(None, batch).float() * batch["loss_mask"]).sum() / tokens
        loss.backward()
    _sync(device)
    return time.perf_counter() - start


def run_benchmark(
    schedules: Sequence[str],
    *,
    pp: int,
    microbatches: int,
    chunks: int,
    rounds: int,
    micro_batch: int,
    config: TransformerConfig,
    seed: int = 1234,
    pool: Optional[WorkerPool] = None,
) -> dict:
    from megatron_pp.schedules.simulate import simulate
    from megatron_pp.training.flops import iteration_flops, peak_tflops

    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    model = build_model(config, seed=seed, device=device)
    data = MockData(seed, config.seq_length, config.vocab_size, micro_batch, micro_batch * microbatches)
    batches = data.step_microbatches(0, 0, device)
    tokens = float(sum(b["loss_mask"].sum() for b in batches))
    own_pool = pool is None
    pool = pool or WorkerPool(pp, backend="nccl" if cuda else "gloo")
    v_of = {name: (chunks if name.startswith("interleaved") else 1) for name in schedules}
    samples: dict[str, list[dict]] = {name: [] for name in schedules}
    baselines: list[float] = []
    controls: list[float] = []
    try:
        # Warm-up: build every pipeline and touch every code path once, untimed.
        _baseline_step(model, batches, tokens)
        pool.run(_worker_control, config, micro_batch, microbatches, seed)
        for name in schedules:
            pool.run(_worker_step, config, name, pp, microbatches, v_of[name], micro_batch, seed)
        for _ in range(rounds):
            base = _baseline_step(model, batches, tokens)
            control = max(pool.run(_worker_control, config, micro_batch, microbatches, seed))
            baselines.append(base)
            controls.append(control)
            for name in schedules:
                per_rank = pool.run(_worker_step, config, name, pp, microbatches, v_of[name], micro_batch, seed)
                wall = max(r["wall_s"] for r in per_rank)
                bubble = 1 + ideal_bubble(name, pp, microbatches, v_of[name])
                samples[name].append({"wall_s": wall, "ratio_to_ideal": wall / (base / pp * bubble),
                                      "ratio_to_contended_ideal": wall / (control / pp * bubble),
                                      "cpu_s": [r["cpu_s"] for r in per_rank], "wait_s": [r["wait_s"] for r in per_rank],
                                      "busy_s": [r["busy_s"] for r in per_rank],
                                      "peak_stash_bytes": [r["peak_stash_bytes"] for r in per_rank],
                                      "peak_cuda_bytes": [r["peak_cuda_bytes"] for r in per_rank],
                                      "device": per_rank[0]["device"]})
    finally:
        if own_pool:
            pool.close()
    report = {
        "device": samples[schedules[0]][0]["device"] if schedules else "cpu",
        "pp": pp, "microbatches": microbatches, "chunks": chunks, "rounds": rounds, "micro_batch_size": micro_batch,
        "model": {"num_layers": config.num_layers, "hidden_size": config.hidden_size, "seq_length": config.seq_length,
                  "vocab_size": config.vocab_size, "num_attention_heads": config.num_attention_heads},
        "baseline_step_s_median": statistics.median(baselines),
        "contention_slowdown_median": statistics.median(c / b for c, b in zip(controls, baselines)),
        "schedules": {},
    }
    flops = iteration_flops(config, micro_batch * microbatches).model
    device_name = samples[schedules[0]][0]["device"] if schedules else "cpu"
    peak = peak_tflops(torch.device("cuda")) if device_name != "cpu" else None
    tokens = micro_batch * microbatches * config.seq_length
    for name, rows in samples.items():
        step = statistics.median(r["wall_s"] for r in rows)
        busy = [statistics.median(r["busy_s"][k] for r in rows) if rows[0]["busy_s"][k] is not None else None
                for k in range(pp)]
        tflops = flops / step / pp / 1e12
        report["schedules"][name] = {
            "step_time_s_median": step,
            "step_time_s_spread": [min(r["wall_s"] for r in rows), max(r["wall_s"] for r in rows)],
            "tokens_per_s": tokens / step,
            "tflops_per_device": tflops,
            "mfu": tflops / peak if peak else None,
            "bubble_simulated": simulate(build_schedule(name, pp, microbatches, v_of[name])).bubble_fraction,
            "bubble_measured": (statistics.mean(1 - b / step for b in busy) if None not in busy else None),
            "peak_stash_bytes_per_rank": [max(r["peak_stash_bytes"][k] for r in rows) for k in range(pp)],
            "peak_cuda_bytes_per_rank": ([max(r["peak_cuda_bytes"][k] for r in rows) for k in range(pp)]
                                         if rows[0]["peak_cuda_bytes"][0] is not None else None),
            "v": v_of[name],
            "ratio_to_ideal_median": statistics.median(r["ratio_to_ideal"] for r in rows),
            "ratio_to_ideal_min": min(r["ratio_to_ideal"] for r in rows),
            "ratio_to_ideal_max": max(r["ratio_to_ideal"] for r in rows),
            "ratio_to_contended_ideal_median": statistics.median(r["ratio_to_contended_ideal"] for r in rows),
            "speedup_vs_baseline_median": statistics.median(b / r["wall_s"] for b, r in zip(baselines, rows)),
            "cpu_s_per_rank_median": [statistics.median(r["cpu_s"][k] for r in rows) for k in range(pp)],
            "comm_wait_s_per_rank_median": [statistics.median(r["wait_s"][k] for r in rows) for k in range(pp)],
        }
    return report
