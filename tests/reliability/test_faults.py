"""Faults: a rank killed mid-step or mid-save stops every other rank within a bounded time, with a line
naming the dead rank; the checkpoint being written when a rank died is never published; a full disk
during a save is reported in one line and stops the run, or is survived with --continue-on-save-failure;
SIGTERM saves and exits 0 for a requeue. Ranks are separate `pretrain_gpt.py` processes (no torchrun
agent to kill the survivors for them); faults come from MEGATRON_PP_INJECT_FAULTS."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_pp.training.arguments import parse_args
from megatron_pp.training.checkpointing import TRACKER_FILE, CheckpointError, read_tracker
from megatron_pp.training.faults import ENV_VAR, parse_faults
from megatron_pp.training.train import main, pretrain
from tests.dist import run_distributed
from tests.reliability.ranks import ROOT, launch_ranks, stderr_of, wait_all

TINY = ["--model-preset", "gpt-tiny", "--mock-data", "--micro-batch-size", "1", "--seed", "5", "--lr", "1e-3"]
HEARTBEAT_S = 6.0
# No wall-clock bound (it would depend on the machine's load): the process-group timeout is set far beyond
# the test's patience, so a survivor that exits at all was stopped by its watchdog, which its line says.
NO_PG_TIMEOUT = ["--distributed-timeout-minutes", "60"]
PATIENCE_S = 600.0


def _wait_for_death(procs, rank, timeout=120.0):
    deadline = time.monotonic() + timeout
    while procs[rank].poll() is None:
        assert time.monotonic() < deadline, "the injected kill never happened"
        time.sleep(0.05)
    return time.monotonic()


def test_a_rank_killed_mid_step_stops_every_other_rank_naming_it(tmp_path):
    argv = TINY + ["--num-layers", "3", "--pipeline-model-parallel-size", "3", "--global-batch-size", "3",
                   "--train-iters", "1000", "--heartbeat-timeout-seconds", str(HEARTBEAT_S), "--log-interval", "1000",
                   *NO_PG_TIMEOUT]
    procs = launch_ranks(3, argv, str(tmp_path), env={ENV_VAR: "kill_in_step@3:1"})
    _wait_for_death(procs, 1)
    codes = wait_all(procs, timeout=PATIENCE_S)
    assert codes[1] == -signal.SIGKILL
    assert codes[0] == 1 and codes[2] == 1, codes
    for rank in (0, 2):
        err = stderr_of(str(tmp_path), rank)
        assert err.startswith("error: rank 1 failed or stopped responding") and err.count("\n") == 1, err


def test_a_rank_killed_while_saving_leaves_the_previous_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    argv = TINY + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "2", "--train-iters", "4",
                   "--save", str(ck), "--save-interval", "1", "--heartbeat-timeout-seconds", str(HEARTBEAT_S),
                   *NO_PG_TIMEOUT]
    procs = launch_ranks(2, argv, str(tmp_path), env={ENV_VAR: "kill_in_save@2:1"})
    _wait_for_death(procs, 1)
    codes = wait_all(procs, timeout=PATIENCE_S)
    assert codes == [1, -signal.SIGKILL], codes
    assert stderr_of(str(tmp_path), 0).startswith("error: rank 1 failed or stopped responding")
    assert read_tracker(str(ck)) == 1 and not (ck / "iter_0000002").exists()
    assert (ck / "iter_0000002.tmp").is_dir()  # half-written, never published, never loaded
    # The requeued job resumes from iteration 1 and finishes.
    procs = launch_ranks(2, argv + ["--load", str(ck)], str(tmp_path))
    assert wait_all(procs, timeout=120) == [0, 0], stderr_of(str(tmp_path), 0)
    assert read_tracker(str(ck)) == 4 and not (ck / "iter_0000002.tmp").exists()


SINGLE = TINY + ["--global-batch-size", "2", "--train-iters", "4"]


def test_disk_full_during_save_is_one_line_and_stops(tmp_path, capsys, monkeypatch):
    ck = tmp_path / "ck"
    monkeypatch.setenv(ENV_VAR, "enospc_save@2:0")
    with pytest.raises(SystemExit) as info:
        main(SINGLE + ["--save", str(ck), "--save-interval", "1"])
    err = capsys.readouterr().err
    assert info.value.code == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"error: saving checkpoint {ck}/iter_0000002: OSError: [Errno 28] No space left on device")
    assert read_tracker(str(ck)) == 1 and sorted(os.listdir(ck)) == ["iter_0000001", TRACKER_FILE]  # no .tmp left


def test_disk_full_during_save_can_be_survived(tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    monkeypatch.setenv(ENV_VAR, "enospc_save@2:0")
    messages = []
    from megatron_pp.training import metrics

    real = metrics.MetricsLogger.message
    monkeypatch.setattr(metrics.MetricsLogger, "message", lambda self, text: (messages.append(text), real(self, text)))
    rows = pretrain(parse_args(SINGLE + ["--save", str(ck), "--save-interval", "1", "--continue-on-save-failure"]))
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4] and read_tracker(str(ck)) == 4
    assert sorted(os.listdir(ck)) == ["iter_0000001", "iter_0000003", "iter_0000004", TRACKER_FILE]
    warning = [m for m in messages if m.startswith("warning: checkpoint of iteration 2 not written")]
    assert len(warning) == 1 and "No space left on device" in warning[0]
    assert "newest checkpoint: iteration 1" in warning[0]


def _save_with_full_disk_on_rank1(ctx, argv):
    os.environ[ENV_VAR] = "enospc_save@1:1"
    try:
        args = parse_args(argv)
        pretrain(args, state=ctx.parallel_state(1, 2))
        return None
    except CheckpointError as exc:
        return str(exc)
    finally:
        del os.environ[ENV_VAR]


def test_disk_full_on_one_rank_stops_every_rank_alike(tmp_path):
    argv = TINY + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "2", "--train-iters", "2",
                   "--save", str(tmp_path / "ck"), "--save-interval", "1"]
    errors = run_distributed(2, _save_with_full_disk_on_rank1, argv)
    assert errors[1].startswith("saving checkpoint") and "No space left on device" in errors[1]
    assert errors[0].endswith("failed on another rank (see its error)")
    assert not (tmp_path / "ck").exists() or os.listdir(tmp_path / "ck") == []


def test_sigterm_saves_and_exits_0_for_a_requeue(tmp_path):
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *TINY, "--global-batch-size",
                             "2", "--train-iters", "100000", "--save", str(ck), "--exit-signal-handler",
                             "--metrics-file", str(metrics), "--log-interval", "1000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    steps = metrics.read_text().count("\n")
    assert read_tracker(str(ck)) == steps and "received SIGTERM (--exit-signal-handler)" in out


def test_fault_spec_is_checked():
    assert [(f.kind, f.iteration, f.rank) for f in parse_faults("nan_grad@3, kill_in_save@2:1")] == [
        ("nan_grad", 3, None), ("kill_in_save", 2, 1)]
    with pytest.raises(ValueError, match=ENV_VAR):
        parse_faults("explode@3")
