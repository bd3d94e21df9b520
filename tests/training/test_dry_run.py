"""The dry run against the same code on real tensors, its bad input, the device check and rank agreement."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_pp.core import parallel_state
from megatron_pp.core.comm_check import CommDeviceError, CommEvent
from megatron_pp.core.host_read import reads
from megatron_pp.core.parallel_state import ParallelState
from megatron_pp.training import dry_run
from megatron_pp.training.arguments import parse_args
from megatron_pp.training.dry_run_agree import disagreements

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model-preset", "gpt-tiny", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", "2"]


def test_dry_run_equals_the_real_run_to_the_byte():
    """One rank, the same code: on real tensors (no process group) and on fake ones (world of 1)."""
    args = parse_args(TINY + ["--dry-run", "1"])
    fake = dry_run.run_rank(args, 0, torch.device("cpu"))
    tracker = dry_run.MemoryTracker()
    reads.clear()
    with tracker:
        real = dry_run._run(args, ParallelState.build(1, 1, device=torch.device("cpu")), None, tracker, steps=2)
    assert reads == {"found-inf": 2, "loss": 2}  # the step reads the device twice: overflow, and the logged loss
    for key in ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "stash_peak_bytes"):
        assert getattr(fake, key) == getattr(real, key), key
    # The total peak also holds kernel temporaries, whose sizes a CPU kernel and its fake (meta) rule may
    # size differently (3 KiB of 5 MiB here): close, not equal.
    assert abs(fake.peak_bytes - real.peak_bytes) <= 0.001 * real.peak_bytes
    assert fake.stash_peak_bytes > 0 and fake.optimizer_bytes == 2 * fake.parameter_bytes  # Adam's two moments
    assert fake.peak_at == real.peak_at
    # Both built the AdamW kernel a GPU job runs (--dry-run-optimizer's default), torch's fused one on the CPU.
    assert fake.optimizer_implementation == real.optimizer_implementation == "torch.optim.AdamW (fused)"


def test_pipeline_ranks_agree_and_last_rank_peaks_lower_under_1f1b():
    args = parse_args(TINY + ["--pipeline-model-parallel-size", "2", "--dry-run", "2", "--dry-run-ranks", "all",
                              "--dry-run-jobs", "1"])
    reports, problems = dry_run.dry_run(args)
    assert problems == []
    assert [r.pipeline_rank for r in reports] == [0, 1]
    assert reports[0].stash_peak_bytes > reports[1].stash_peak_bytes  # 2 stashes in flight against 1
    assert sum(e.op == "send" for e in reports[0].comm) == sum(e.op == "recv_" for e in reports[1].comm) > 0


def test_worker_processes_give_what_one_process_gives():
    """--dry-run-jobs 2: each rank in a spawned worker; the figures and the recorded calls are those of the
    same ranks run one after another here, and the parent still matches every rank's calls."""
    argv = TINY + ["--pipeline-model-parallel-size", "2", "--dry-run", "4", "--dry-run-ranks", "all"]
    alone, problems_alone = dry_run.dry_run(parse_args(argv + ["--dry-run-jobs", "1"]))
    workers, problems = dry_run.dry_run(parse_args(argv + ["--dry-run-jobs", "2"]))
    drop = lambda row: {k: v for k, v in row.items() if k not in ("seconds", "step_seconds")}  # noqa: E731
    assert [drop(r.row()) for r in workers] == [drop(r.row()) for r in alone]
    assert [r.comm for r in workers] == [r.comm for r in alone]
    assert problems == problems_alone == []
    assert sorted({r.data_rank for r in workers}) == [0, 1]  # dp 2: the data-parallel all-reduce was matched too


def test_a_cpu_tensor_in_a_collective_of_a_meta_job_is_named(monkeypatch):
    planted = lambda group, device: dist.all_reduce(torch.zeros(1), group=group)  # noqa: E731
    monkeypatch.setattr(parallel_state, "warm_up", planted)
    args = parse_args(TINY + ["--pipeline-model-parallel-size", "2", "--dry-run", "2"])
    with pytest.raises(CommDeviceError, match=r"allreduce_: tensor of shape \(1,\) float32 is on cpu, the job's device is meta"):
        dry_run.run_rank(args, 0, torch.device("meta"))


def test_a_meta_job_runs_every_pipeline_rank_and_agrees():
    """--dry-run-device meta at pp 2: point-to-point goes through batch_isend_irecv, which looks a backend up by
    the tensors' device type, so the fake world serves meta as well as cpu (it once stopped at 'No backend type
    associated with device type meta'); state bytes are the CPU run's, the calls match across ranks."""
    argv = TINY + ["--pipeline-model-parallel-size", "2", "--dry-run", "2", "--dry-run-ranks", "all",
                   "--dry-run-jobs", "1"]
    meta, problems = dry_run.dry_run(parse_args(argv + ["--dry-run-device", "meta"]))
    cpu, _ = dry_run.dry_run(parse_args(argv))
    assert problems == [] and [r.pipeline_rank for r in meta] == [0, 1]
    state = ("parameter_bytes", "gradient_bytes", "optimizer_bytes")
    assert [[r.row()[k] for k in state] for r in meta] == [[r.row()[k] for k in state] for r in cpu]
    assert all(r.row()["stash_peak_bytes"] > 0 for r in meta)


def test_a_planted_mismatch_is_reported():
    send = CommEvent("send", (0, 1), 1, ((4, 2, 8),), "float32")
    recv = CommEvent("recv_", (0, 1), 0, ((4, 2, 16),), "float32")
    reduce0 = CommEvent("allreduce_", (0, 1), None, ((10,),), "float32")
    reduce1 = CommEvent("allreduce_", (0, 1), None, ((12,),), "float32")
    assert disagreements({0: [send, reduce0], 1: [recv, reduce0]}) == [
        "send 0 -> 1 #0: rank 0 sends [4, 2, 8] float32, rank 1 receives [4, 2, 16] float32"]
    assert disagreements({0: [reduce0], 1: [reduce1]}) == [
        "group [0, 1] call #0: rank 0 calls allreduce_ [10] float32, rank 1 calls allreduce_ [12] float32"]
    assert disagreements({0: [send], 1: []}) == ["send 0 -> 1 #0: rank 0 sends 1 messages, rank 1 receives 0"]


def test_default_ranks_are_one_per_pipeline_rank():
    ranks = dry_run.default_ranks(64, 8, 8)
    layout = parallel_state.RankLayout(64, 8, 8)
    assert sorted(layout.coords(r).pp for r in ranks) == list(range(8))
    assert all(layout.coords(r).tp == 0 and layout.coords(r).dp == 0 for r in ranks)


@pytest.mark.parametrize("extra, expected", [
    (["--pipeline-model-parallel-size", "2", "--dry-run", "3"], "world size 3 is not divisible"),
    (["--dry-run", "2", "--dry-run-ranks", "5"], "--dry-run-ranks: rank 5 is not in a world of 2"),
    (["--dry-run-ranks", "0"], "--dry-run-ranks needs --dry-run N"),
    (["--dry-run", "2", "--dry-run-jobs", "0"], "--dry-run-jobs 0: needs at least one worker"),
])
def test_bad_input_is_one_line_and_exit_2(extra, expected, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(TINY + extra)
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    lines = [ln for ln in (captured.out + captured.err).splitlines() if ln.strip()]
    assert len(lines) == 1 and expected in lines[0], lines


def test_the_entry_point_takes_the_dry_run(tmp_path):
    out = tmp_path / "dry.json"
    proc = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *TINY, "--dry-run", "1",
                           "--dry-run-json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json
    rows = json.loads(out.read_text())["ranks"]
    assert [r["rank"] for r in rows] == [0] and rows[0]["peak_bytes"] >= rows[0]["stash_peak_bytes"] > 0


def _stash_peaks(schedule: str, *extra: str) -> list[int]:
    args = parse_args(TINY + ["--micro-batch-size", "1", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
                              "--pipeline-schedule", schedule, *extra, "--dry-run", "2", "--dry-run-ranks", "all",
                              "--dry-run-jobs", "1"])
    reports, problems = dry_run.dry_run(args)
    assert problems == []
    return [r.stash_peak_bytes for r in reports]


@pytest.mark.parametrize("schedule, extra", [
    ("zb-h1", []),
    ("interleaved-1f1b", ["--num-layers-per-virtual-pipeline-stage", "1"]),
    ("po-h", ["--num-layers-per-virtual-pipeline-stage", "1"]),
    ("bpipe", []),  # pp 2: BPipe's lists have no evictions there (pp 4 with evictions: the test below)
])
def test_schedule_families_run_every_rank_and_agree(schedule, extra):
    """Every rank of a tiny pp 2 job, m 8, through the dry run: the ranks' sends match their receives and
    each rank saved something; an offload schedule moves stashes to host memory (counted apart)."""
    args = parse_args(TINY + ["--micro-batch-size", "1", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
                              "--pipeline-schedule", schedule, *extra, "--dry-run", "2", "--dry-run-ranks", "all",
                              "--dry-run-jobs", "1"])
    reports, problems = dry_run.dry_run(args)
    assert problems == []
    assert [r.pipeline_rank for r in reports] == [0, 1] and all(r.stash_peak_bytes > 0 for r in reports)
    assert sum(e.op == "send" for e in reports[0].comm) == sum(e.op == "recv_" for e in reports[1].comm) > 0
    assert all((r.host_peak_bytes > 0) == (schedule == "po-h") for r in reports)


def test_gpipe_holds_four_times_the_stashes_of_1f1b_on_rank_0_at_m_8():
    """m = 8, p = 2: GPipe keeps all 8 forwards' stashes on rank 0, 1F1B keeps p = 2 (same stage, same bytes)."""
    gpipe, one_f_one_b = _stash_peaks("gpipe"), _stash_peaks("1f1b")
    assert gpipe[0] == 4 * one_f_one_b[0]


def test_the_command_drives_2bw_on_every_pipeline_rank(capsys):
    """2BW updates weights inside its action lists, over calls that span steps; the dry run once refused it
    (exit 2). Now the command runs it through the job's step driver (tests/training/test_dry_run_twobw.py holds
    the figures to real runs): exit 0, both pipeline ranks in the table, their calls matched."""
    args = parse_args(TINY + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw", "--dry-run", "2",
                              "--dry-run-jobs", "1"])
    assert dry_run.main(args) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    assert "schedule 2bw, 2 ranks simulated" in lines[0], lines
    assert [ln.split()[0] for ln in lines[2:]] == ["0", "1"] and not any("disagreement" in ln for ln in lines), lines


def test_bpipe_with_evictions_runs_in_worker_processes_and_agrees():
    """At pp 4 BPipe evicts: rank 0 parks stashes on rank 3 (the dry run once spun there for ever, then refused
    it). In worker processes, rank 3 learns rank 0's stash layout by dry-running it up to its first eviction;
    every EVICT matches its ACCEPT (tests/schedules/test_bpipe_dry_run.py holds it to a real gloo run)."""
    args = parse_args(TINY + ["--pipeline-model-parallel-size", "4", "--num-layers", "4", "--pipeline-schedule",
                              "bpipe", "--dry-run", "4", "--dry-run-ranks", "0,3", "--dry-run-jobs", "2"])
    reports, problems = dry_run.dry_run(args)
    assert problems == []
    assert [r.guest_peak_bytes > 0 for r in reports] == [False, True]
    assert any(e.op == "send" and e.peer == 3 for e in reports[0].comm)


def test_offloaded_stashes_are_host_memory_to_the_byte_of_the_real_run():
    """PipeOffload (po-h, 4 chunks on one rank): the host buffers are counted apart from the device's peak, from
    live storages, equal to the byte on real and fake tensors; the fake run moves its stashes too (a fake
    tensor's storage is on `meta`, which the offload store once took for another device and moved nothing)."""
    args = parse_args(TINY + ["--micro-batch-size", "1", "--num-layers", "4", "--pipeline-schedule", "po-h",
                              "--num-layers-per-virtual-pipeline-stage", "1", "--dry-run", "1"])
    fake = dry_run.run_rank(args, 0, torch.device("cpu"))
    tracker = dry_run.MemoryTracker()
    with tracker:
        real = dry_run._run(args, ParallelState.build(1, 1, device=torch.device("cpu")), None, tracker, steps=2)
    assert fake.host_peak_bytes > 0 and fake.host_bytes > 0
    for key in ("host_bytes", "host_peak_bytes", "stash_peak_bytes", "parameter_bytes", "optimizer_bytes"):
        assert getattr(fake, key) == getattr(real, key), key
    # Stashes that stayed on the device (a fake dispatch cache holding `set_`'s storage kept 2.8x the peak).
    assert abs(fake.peak_bytes - real.peak_bytes) <= 0.001 * real.peak_bytes
    no_offload = dry_run.run_rank(parse_args(TINY + ["--micro-batch-size", "1", "--num-layers", "4",
                                                     "--pipeline-schedule", "interleaved-1f1b",
                                                     "--num-layers-per-virtual-pipeline-stage", "1",
                                                     "--dry-run", "1"]), 0, torch.device("cpu"))
    assert no_offload.host_peak_bytes == 0 and fake.stash_peak_bytes < no_offload.stash_peak_bytes
