"""One clock for the trace (megatron_pp/core/clock.py): a rank whose clock is 1234.5 s ahead of rank 0's
is measured to within the bound the measurement states, drift between two syncs is interpolated away,
and in a real 2-rank trace whose rank 1 runs on a shifted clock the pipeline's causality holds on the
trace's one clock (rank 1 starts microbatch 0 only after rank 0 finished it)."""
from __future__ import annotations

import json
import time

from megatron_pp.core import clock as clock_module
from megatron_pp.core.clock import JobClock, measure
from tests.dist import run_distributed

SHIFT = 1234.5


def _shifted_offsets(ctx):
    # Both workers run on this host: perf_counter is one system-wide clock, so the true offset is SHIFT.
    clock = (lambda: time.perf_counter() + SHIFT) if ctx.rank == 1 else time.perf_counter
    sync = measure(clock)
    return sync.offset, sync.error


def test_a_shifted_clock_is_measured_within_the_stated_bound():
    (offset0, error0), (offset1, error1) = run_distributed(2, _shifted_offsets)
    assert offset0 == 0.0 and error0 == 0.0
    assert 0 < error1 < 0.05 and abs(offset1 - SHIFT) <= error1, (offset1 - SHIFT, error1)


def _drifting(ctx):
    base = time.perf_counter()
    rate = 1 + 1e-3  # a clock running 1000 ppm fast, far worse than quartz: interpolation must absorb it
    clock = (lambda: (time.perf_counter() - base) * rate + 50.0) if ctx.rank == 1 else time.perf_counter
    start = measure(clock)
    time.sleep(0.3)
    middle_true = time.perf_counter()
    middle_local = clock()
    time.sleep(0.3)
    job = JobClock(start, measure(clock))
    return job.to_job(middle_local) - middle_true, job.error


def test_linear_drift_between_two_syncs_is_interpolated():
    _, (miss, bound) = run_distributed(2, _drifting)
    # Without interpolation the start offset alone would be 0.3 ms off at the middle: more than the bound here.
    assert abs(miss) <= bound + 1e-5, (miss, bound)


def _traced_run(ctx, argv):
    from megatron_pp.training.arguments import parse_args
    from megatron_pp.training.train import pretrain

    real = time.perf_counter
    if ctx.rank == 1:  # everything on rank 1 that stamps times (executor, clock sync) runs SHIFT ahead
        time.perf_counter = lambda: real() + SHIFT
    try:
        args = parse_args(argv)
        pretrain(args, state=ctx.parallel_state(1, 2))
    finally:
        time.perf_counter = real
    return clock_module.ROUNDS


def test_ranks_line_up_in_the_trace_despite_a_shifted_clock(tmp_path):
    trace = tmp_path / "trace.json"
    argv = ["--model-preset", "gpt-tiny", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "4",
            "--train-iters", "2", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b",
            "--log-interval", "1000", "--trace-file", str(trace)]
    run_distributed(2, _traced_run, argv)
    data = json.loads(trace.read_text())
    notes = data["otherData"]
    bound = max(notes["error_bound_s"]) * 1e6
    # Rank 1's clock runs SHIFT ahead: both measurements find that offset, each within its error bound (half
    # the best barrier round trip, well under 50 ms on one machine).
    assert 0 <= max(notes["error_bound_s"]) < 0.05, notes
    for key in ("offset_start_s", "offset_end_s"):
        assert abs(notes[key][1] - SHIFT) <= notes["error_bound_s"][1] + 1e-6, notes
    slices = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == {0, 1} and min(e["ts"] for e in slices) == 0.0

    def compute(rank, label, step):  # microbatches are numbered within a step
        return sorted((e for e in slices if e["pid"] == rank and e["name"] == label), key=lambda e: e["ts"])[step]

    for step in range(2):
        for mb in range(4):
            # Rank 1's forward cannot end before rank 0's output exists, nor rank 0's backward before rank
            # 1's input gradient does (a compute slice includes waiting for its input).
            f0, f1 = compute(0, f"F{mb}.0", step), compute(1, f"F{mb}.0", step)
            b0, b1 = compute(0, f"B{mb}.0", step), compute(1, f"B{mb}.0", step)
            assert f1["ts"] + f1["dur"] >= f0["ts"] + f0["dur"] - bound, (mb, f0, f1)
            assert b0["ts"] + b0["dur"] >= b1["ts"] + b1["dur"] - bound, (mb, b0, b1)
    names = {e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1"}
