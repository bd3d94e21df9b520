"""The memory soak, short: 60 steps of the host-offload schedule (po-h) on two ranks, resumed from a
checkpoint every 20 steps; RSS after warm-up must not trend upward. The long run (benchmarks/soak.py,
hundreds of steps, five schedules) and its numbers are in docs/reliability.md."""
from __future__ import annotations

import pytest

from megatron_pp.benchmarks.soak import BASE, SCHEDULES, rss_bytes, run_schedule, slope_per_step, summarize
from tests.dist import run_distributed

# Loose enough for allocator noise over 10-sample windows on a shared 2-vCPU machine, tight enough to
# catch one activation stash kept per step (gpt-tiny on 2 ranks: about 0.29 MB per microbatch and rank).
MAX_SLOPE_KB = 256.0


def test_slope_and_summary():
    assert slope_per_step([5, 5, 5, 5]) == 0.0
    assert slope_per_step([0, 2, 4, 6]) == pytest.approx(2.0)
    assert slope_per_step([1]) == 0.0
    mb = 2**20
    flat = [100 * mb + (i % 3) * 4096 for i in range(40)]
    leaking = [100 * mb + i * 64 * 1024 for i in range(40)]
    # Flat within segments, +1 MB at every resume (a segment is 10 steps).
    stepped = [100 * mb + (i // 10) * mb for i in range(40)]
    summary = summarize([flat, leaking, stepped], segment_steps=10)
    flat_rank, leaking_rank, stepped_rank = summary["ranks"]
    assert abs(flat_rank["slope_kb_per_step"]) < 1.0 and abs(flat_rank["growth_per_resume_kb"]) < 10
    assert leaking_rank["slope_kb_per_step"] == pytest.approx(64.0)
    assert stepped_rank["slope_kb_per_step"] == 0.0 and stepped_rank["growth_per_resume_kb"] == 1024.0
    assert summary["max_slope_kb_per_step"] == pytest.approx(64.0) and rss_bytes() > 0


def test_short_soak_shows_no_memory_growth(tmp_path):
    result = run_schedule(lambda fn, *args: run_distributed(2, fn, *args), "po-h", BASE + SCHEDULES["po-h"],
                          steps=60, segment_steps=20, workdir=str(tmp_path))
    assert result["steps"] == 60
    assert result["max_slope_kb_per_step"] < MAX_SLOPE_KB, result
