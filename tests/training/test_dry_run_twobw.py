"""PipeDream-2BW in the dry run (training/dry_run_twobw.py): the job's own step driver on fake tensors against
the same code on real tensors in a gloo world, the ranks' agreement, and the second weight version counted."""
from __future__ import annotations

import pytest
import torch

from megatron_pp.core.host_read import reads
from megatron_pp.core.parallel_state import ParallelState
from megatron_pp.training import dry_run
from megatron_pp.training.arguments import parse_args
from tests.dist import run_distributed

TINY = ["--model-preset", "gpt-tiny", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", "2"]


def _args(schedule: str, pp: int, *extra: str):
    return parse_args(TINY + ["--pipeline-model-parallel-size", str(pp), "--pipeline-schedule", schedule,
                              "--dry-run", str(pp), "--dry-run-jobs", "1", *extra])


def _real_rank(ctx, schedule: str, pp: int) -> dict:
    args = _args(schedule, pp)
    tracker = dry_run.MemoryTracker()
    with tracker:
        report = dry_run._run(args, ctx.parallel_state(1, pp), None, tracker, steps=2)
    return report.row()


def test_dry_run_of_2bw_equals_the_real_gloo_run_on_every_rank():
    """pp 2, m 4: the same calls (warm-up, two steady, cool-down) on real tensors in a gloo world and on fake
    ones: parameters (both weight versions), gradients (with the pending copy), optimizer state and the stash
    peak to the byte on every rank. The total peak is held below, at pp 1: on gloo it is above the fake run's
    (by 1.6% on rank 0 here, and by 2.6% for 1F1B of the same job), since gloo takes its own point-to-point
    path (`core.comm.BACKEND_NEEDS`) and the fake backend NCCL's."""
    real = run_distributed(2, _real_rank, "2bw", 2)
    args = _args("2bw", 2)
    for rank in range(2):
        fake = dry_run.run_rank(args, rank, torch.device("cpu")).row()
        for key in ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "stash_peak_bytes"):
            assert fake[key] == real[rank][key], (rank, key)
        for report in (fake, real[rank]):
            state = report["parameter_bytes"] + report["gradient_bytes"] + report["optimizer_bytes"]
            assert state + report["stash_peak_bytes"] <= report["peak_bytes"], (rank, report)


def test_dry_run_of_2bw_equals_the_real_run_on_one_rank():
    """pp 1 (2BW still runs batch t on W(t-1) while it updates W(t)): real tensors without a process group and
    fake ones. Every figure to the byte but the total peak, which holds kernel temporaries a CPU kernel and its
    fake rule size differently (as for the flushed schedules): within 0.1%, in the same action. Each of the
    four calls reads the device three times, through `core.host_read`."""
    args = _args("2bw", 1)
    reads.clear()
    fake = dry_run.run_rank(args, 0, torch.device("cpu")).row()
    # Each call reads its token count, its row's gathered metrics and, at its STEP, found-inf and the norm.
    assert reads == {"tokens": 4, "loss": 4, "found-inf": 4}, reads
    tracker = dry_run.MemoryTracker()
    with tracker:
        real = dry_run._run(args, ParallelState.build(1, 1, device=torch.device("cpu")), None, tracker, steps=2).row()
    for key in ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "stash_peak_bytes"):
        assert fake[key] == real[key], key
    assert abs(fake["peak_bytes"] - real["peak_bytes"]) <= 0.001 * real["peak_bytes"], (fake, real)
    assert fake["peak_at"] == real["peak_at"]
    # The peak falls in the second steady call, the first to run whole with Adam's moments alive.
    assert fake["peak_at"].startswith("step 3 (steady), "), fake["peak_at"]
    assert fake["optimizer_implementation"] == real["optimizer_implementation"] == "torch.optim.AdamW (fused)"


def test_every_rank_of_2bw_at_pp_4_agrees():
    """pp 4, m 4: middle ranks receive and send in both directions across calls that span batches; every send
    matches its receive and the world's collectives (metrics, found-inf/norm, the tied embedding's sum) agree."""
    args = parse_args(TINY + ["--micro-batch-size", "1", "--global-batch-size", "4", "--num-layers", "4",
                              "--pipeline-model-parallel-size", "4", "--pipeline-schedule", "2bw", "--dry-run", "4",
                              "--dry-run-ranks", "all", "--dry-run-jobs", "1"])
    reports, problems = dry_run.dry_run(args)
    assert problems == []
    assert [r.pipeline_rank for r in reports] == [0, 1, 2, 3]
    for sender, receiver in ((0, 1), (1, 2), (2, 3)):
        sends = sum(e.op == "send" and e.peer == receiver for e in reports[sender].comm)
        assert sends == sum(e.op == "recv_" and e.peer == sender for e in reports[receiver].comm) > 0
    assert all(r.stash_peak_bytes > 0 for r in reports)


def test_a_meta_dry_run_of_2bw_hands_every_collective_a_tensor_on_the_job_device():
    """--dry-run-device meta checks the device of every tensor a collective is handed: 2BW's per-call metrics
    vector, once built on the host, was named there (a CPU tensor in an all-reduce of a meta job). The state is
    the CPU device's run's; the calls match across ranks."""
    meta, problems = dry_run.dry_run(_args("2bw", 2, "--dry-run-ranks", "all", "--dry-run-device", "meta"))
    cpu, _ = dry_run.dry_run(_args("2bw", 2, "--dry-run-ranks", "all"))
    assert problems == [] and [r.pipeline_rank for r in meta] == [0, 1]
    state = ("parameter_bytes", "gradient_bytes", "optimizer_bytes")
    assert [[getattr(r, k) for k in state] for r in meta] == [[getattr(r, k) for k in state] for r in cpu]


@pytest.mark.parametrize("precision, weight_bytes", [([], 4), (["--bf16"], 2)])
def test_the_second_weight_version_and_the_pending_gradient_are_counted(precision, weight_bytes):
    """Against 1F1B of the same job, per rank: 2BW holds one more copy of the stage's weights in the model's
    dtype (4 bytes a parameter in fp32, 2 in bf16) and one more fp32 gradient (the deferred update's pending
    copy); Adam's moments and the fp32 main weights are held once (an fp32 model's main weights are the newest
    weight buffer itself)."""
    two_bw, _ = dry_run.dry_run(_args("2bw", 2, "--dry-run-ranks", "all", *precision))
    flushed, _ = dry_run.dry_run(_args("1f1b", 2, "--dry-run-ranks", "all", *precision))
    for a, b in zip(two_bw, flushed):
        parameters = b.gradient_bytes // 4  # the reducer's fp32 gradient: 4 bytes a trainable parameter
        assert b.parameter_bytes == weight_bytes * parameters
        assert a.parameter_bytes - b.parameter_bytes == weight_bytes * parameters
        assert a.gradient_bytes - b.gradient_bytes == 4 * parameters
        assert a.optimizer_bytes == b.optimizer_bytes == (8 if weight_bytes == 4 else 12) * parameters
        assert a.stash_peak_bytes == b.stash_peak_bytes  # 2BW's stash peak is 1F1B's (docs/2bw.md)
