"""The memory soak behind benchmarks/soak.py: train for many steps in resumed segments and sample every
rank's resident memory (RSS) after every step, to show that nothing grows per step.

A leak that matters in a weeks-long run is small per step: an activation store that keeps one stash
too many, a host buffer allocated per offload instead of reused, process groups created on every
resume, metrics rows kept forever. Each shows as a steady upward RSS trend. The soak runs each schedule
as `segments` calls of `pretrain` in the *same* worker processes, each resuming from the previous
segment's checkpoint (so resume paths are exercised too). It fits a least-squares line to RSS over the
second half of each segment after the first (the first segment and the first half of each segment pay
one-time costs: allocator arenas, caches, a new optimizer state) and reports the mean slope in bytes
per step, the number to watch. What a resume
costs in the same process (a new model, optimizer and reducer while the old ones are freed, or not)
is reported apart, as the jump between segments; a production resume is a new process.

Worked numbers: RSS samples [100, 101, 100, 102, 101] MB after warm-up fit a slope of +0.2 MB/step;
the same noise around a flat line over 200 steps gives a slope near 0 ± a few KB/step, while a leak of
one 64 KB buffer per step gives +64 KB/step whatever the noise.
"""
from __future__ import annotations

import os
import shutil
from typing import Any, Sequence

# The soaked runs: gpt-tiny on two pipeline ranks (m = 4), one entry per schedule family. po-h parks
# stashes in host memory (the offload store), bpipe on the peer rank.
BASE = ["--model-preset", "gpt-tiny", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--pipeline-model-parallel-size", "2", "--seed", "1", "--lr", "1e-4", "--log-interval", "1000000"]
SCHEDULES = {
    "1f1b": ["--pipeline-schedule", "1f1b"],
    "gpipe": ["--pipeline-schedule", "gpipe"],
    "interleaved-1f1b": ["--pipeline-schedule", "interleaved-1f1b", "--num-virtual-stages-per-pipeline-rank", "2"],
    "po-h": ["--pipeline-schedule", "po-h", "--num-virtual-stages-per-pipeline-rank", "2"],  # host offload store
    "bpipe": ["--pipeline-schedule", "bpipe"],  # activations parked on the peer rank
}

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """This process's resident set size now (Linux /proc; 0 where it is not available)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def slope_per_step(samples: Sequence[float]) -> float:
    """Least-squares slope of `samples` against their index (0 for fewer than two samples)."""
    n = len(samples)
    if n < 2:
        return 0.0
    mean_x = (n - 1) / 2.0
    mean_y = sum(samples) / n
    cov = sum((i - mean_x) * (y - mean_y) for i, y in enumerate(samples))
    var = sum((i - mean_x) ** 2 for i in range(n))
    return cov / var


def soak_segments(ctx: Any, argv: Sequence[str], steps: int, segment_steps: int, checkpoint_dir: str) -> list[int]:
    """Run on every rank of a local world (`WorkerPool.run`): train `steps` iterations of `argv` in
    segments of `segment_steps`, each resuming from `checkpoint_dir`; returns RSS after every step."""
    from megatron_pp.training.arguments import parse_args
    from megatron_pp.training.train import pretrain

    samples: list[int] = []
    done = 0
    while done < steps:
        done = min(done + segment_steps, steps)
        args = parse_args([*argv, "--train-iters", str(done), "--save", checkpoint_dir, "--load", checkpoint_dir])
        state = ctx.parallel_state(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
        pretrain(args, state=state, on_iteration=lambda row: samples.append(rss_bytes()))
    return samples


def summarize(samples_by_rank: Sequence[Sequence[int]], segment_steps: int) -> dict:
    """Per rank: RSS at the first step, after warm-up and at the last step; the slope per step *within*
    segments after the first (the mean of each segment's least-squares slope over its second half),
    the slope over all steps after warm-up, and the mean jump from the end of one segment to
    the first step of the next (what one resume in the same process costs)."""
    ranks = []
    for samples in samples_by_rank:
        segments = [list(samples[i:i + segment_steps]) for i in range(0, len(samples), segment_steps)]
        later = segments[1:]
        # A segment's first half pays for its resume and warms up (Adam's state is created at the first
        # step, allocator arenas and caches fill); measured, RSS is flat from about step 50 of a segment.
        settle = segment_steps // 2
        slopes = [slope_per_step(seg[settle:]) for seg in later if len(seg) - settle >= 2]
        jumps = [b[0] - a[-1] for a, b in zip(segments, segments[1:])]
        ranks.append({
            "rss_first_mb": round(samples[0] / 2**20, 2),
            "rss_after_warmup_mb": round(later[0][0] / 2**20, 2) if later else None,
            "rss_last_mb": round(samples[-1] / 2**20, 2),
            "slope_kb_per_step": round(sum(slopes) / len(slopes) / 1024, 3) if slopes else 0.0,
            "overall_slope_kb_per_step": round(slope_per_step(samples[segment_steps:]) / 1024, 3),
            "growth_per_resume_kb": round(sum(jumps) / len(jumps) / 1024, 1) if jumps else 0.0,
        })
    return {"steps": len(samples_by_rank[0]), "ranks": ranks,
            "max_slope_kb_per_step": max(r["slope_kb_per_step"] for r in ranks)}


def run_schedule(run: Any, name: str, argv: Sequence[str], steps: int, segment_steps: int, workdir: str) -> dict:
    """Soak one schedule through `run(fn, *args)` (a pool's run); the checkpoint directory is removed
    afterwards."""
    checkpoint_dir = os.path.join(workdir, f"soak-{name}")
    shutil.rmtree(checkpoint_dir, ignore_errors=True)
    try:
        samples = run(soak_segments, list(argv), steps, segment_steps, checkpoint_dir)
    finally:
        shutil.rmtree(checkpoint_dir, ignore_errors=True)
    return summarize(samples, segment_steps)
