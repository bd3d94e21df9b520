"""One clock for the trace (megatron_pp/core/clock.py): a rank whose clock is 1234.5 s ahead of rank 0's
is measured to within the bound the measurement states, drift between two syncs is interpolated away
(planted offsets of seconds, far beyond any bound a loaded machine gives, and a synthetic clock),
and in a real 2-rank trace whose rank 1 runs on a shifted clock the pipeline's causality holds on the
trace's one clock (rank 1 starts microbatch 0 only after rank 0 finished it)."""
from __future__ import annotations

import json
import time

from megatron_pp.core import clock as clock_module
from megatron_pp.core.clock import ClockSync, JobClock, measure
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
    # The bound is half the best of 8 round trips: milliseconds, more on a loaded machine; any load keeps it far
    # below the planted 1234.5 s, so the offset check holds on any load (no bound tied to a quiet machine).
    assert 0 < error1 < 1.0 and abs(offset1 - SHIFT) <= error1, (offset1 - SHIFT, error1)


def _drifting(ctx):
    """Rank 1's clock is 50 s ahead at the first sync and 60 s ahead at the second: a drift of 10 s between
    them, planted so large that no measurement error (half a round trip, milliseconds on a loaded machine)
    comes near it. The job clock maps the local time a quarter of the way between the syncs back with the
    offset a quarter of the way from 50 to 60; a correction of the wrong sign or direction misses by seconds."""
    shift = {"now": 50.0}
    clock = (lambda: time.perf_counter() + shift["now"]) if ctx.rank == 1 else time.perf_counter
    start = measure(clock)
    if ctx.rank == 1:
        shift["now"] = 60.0  # between the two collective syncs: each sync sees one constant offset
    end = measure(clock)
    job = JobClock(start, end)
    quarter = start.local + 0.25 * (end.local - start.local)
    beyond = end.local + (end.local - start.local)  # linear beyond the second sync too
    return start.offset, end.offset, job.to_job(quarter) - quarter, job.to_job(beyond) - beyond, job.error


def test_drift_between_two_syncs_is_interpolated():
    (_, _, at_quarter0, _, error0), (start, end, at_quarter, at_beyond, bound) = run_distributed(2, _drifting)
    assert at_quarter0 == 0.0 and error0 == 0.0  # rank 0 is the job's clock
    assert 0 < bound < 1.0, bound  # far below the planted 10 s on any load
    assert abs(start - 50.0) <= bound and abs(end - 60.0) <= bound, (start, end, bound)
    # job time = local - offset, the offset interpolated: 52.5 s at a quarter, 70 s one span beyond the end.
    assert abs(at_quarter + 52.5) <= bound, (at_quarter, bound)
    assert abs(at_beyond + 70.0) <= bound, (at_beyond, bound)


def test_job_clock_on_a_synthetic_clock():
    """Planted syncs, no processes: the arithmetic alone, exact. Rank 0's time is local - offset."""
    job = JobClock(ClockSync(local=100.0, offset=50.0, error=1e-3), ClockSync(local=200.0, offset=60.0, error=2e-3))
    assert job.to_job(100.0) == 50.0 and job.to_job(200.0) == 140.0
    assert job.to_job(125.0) == 125.0 - 52.5 and job.to_job(300.0) == 300.0 - 70.0
    assert job.to_job(50.0) == 50.0 - 45.0  # before the first sync: the line extended back
    assert job.error == 2e-3
    same = JobClock(ClockSync(5.0, 1.5, 0.0), ClockSync(5.0, 1.5, 0.0))  # one sync: a constant offset
    assert same.to_job(7.0) == 5.5


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
    # the best barrier round trip: milliseconds, more on a loaded machine, and far below SHIFT on any load).
    assert 0 <= max(notes["error_bound_s"]) < 1.0, notes
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
