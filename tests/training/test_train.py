"""The job wiring of `training.train`: seeding and what `main` leaves behind (the training itself is in
test_pretrain.py and the exactness tests)."""
from __future__ import annotations

import random
import types

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_pp.core.tensor_parallel.random import get_rng_tracker
from megatron_pp.training import train
from megatron_pp.training.checkpointing import CheckpointError
from megatron_pp.training.trainer import TrainingStopped
from megatron_pp.training.train import seed_everything
from tests.reliability.ranks import free_port


def _draws() -> tuple[float, float, float, float]:
    with get_rng_tracker().fork():
        tracked = torch.rand(1).item()
    return random.random(), float(np.random.rand()), torch.rand(1).item(), tracked


def test_seed_everything_seeds_every_generator_a_user_or_plugin_may_draw_from():
    # Restored afterwards: the generators are process-wide and other tests share this process.
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state(), get_rng_tracker().get_states()
    try:
        first = types.SimpleNamespace(tp_rank=0, pp_rank=0)
        seed_everything(7, first)
        a = _draws()
        random.random(), np.random.rand(), torch.rand(1)  # move every stream on; reseeding must rewind it
        seed_everything(7, first)
        assert _draws() == a
        assert a[0] == random.Random(7).random()
        assert a[1] == float(np.random.RandomState(7).rand())
        assert a[2] == torch.rand(1, generator=torch.Generator().manual_seed(7)).item()
        # Another stage: Python and NumPy get the seed itself on every rank; torch and the tensor-parallel
        # stream are offset per stage, so stages do not repeat each other's dropout masks.
        seed_everything(7, types.SimpleNamespace(tp_rank=0, pp_rank=1))
        b = _draws()
        assert b[:2] == a[:2] and b[2] != a[2] and b[3] != a[3]
        seed_everything(8, first)
        assert all(x != y for x, y in zip(_draws(), a))
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])
        get_rng_tracker().set_states(saved[3])


def test_main_runs_the_job_in_the_process_group_it_made_and_releases_it(tmp_path, monkeypatch):
    # A launched world of one (torchrun's variables): main builds the gloo group on the store it met the
    # other ranks on (pretrain must find it made, not make its own), runs the job, and leaves no group
    # behind (a second job in the same process, or a harness, starts clean).
    monkeypatch.chdir(tmp_path)
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(free_port()))):
        monkeypatch.setenv(name, value)
    made = []
    monkeypatch.setattr(train, "pretrain", lambda args: made.append(dist.is_initialized()) or [])
    try:
        train.main(["--model-preset", "gpt-tiny", "--mock-data", "--micro-batch-size", "2", "--train-iters", "1",
                    "--distributed-backend", "gloo", "--heartbeat-timeout-seconds", "0"])
        assert made == [True]  # the job ran inside the group ...
        assert not dist.is_initialized()  # ... and main destroyed it
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# main's error policy, with the process group, the watchdog and the job stood in for -------------------------


class _Watchdog:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name):
        if name in ("quiet", "stop", "report_failure", "wait_for_verdict"):
            return lambda: self.calls.append(name)
        raise AttributeError(name)


def _main_with(monkeypatch, job, watchdog=None, traceback=False):
    """Run `train.main` on a single process whose job is `job(args)`; returns (watchdog calls, reported lines,
    shutdowns, the exit status or None)."""
    watchdog, reported, shutdowns = watchdog or _Watchdog(), [], []
    monkeypatch.setattr(train, "read_launch_env", lambda: types.SimpleNamespace(world_size=1, rank=0))
    monkeypatch.setattr(train, "rendezvous_store", lambda launch: None)
    monkeypatch.setattr(train, "init_distributed", lambda *a, **k: None)
    monkeypatch.setattr(train, "start_watchdog", lambda args, launch: watchdog)
    monkeypatch.setattr(train, "pretrain", job)
    monkeypatch.setattr(train, "report_runtime_error",
                        lambda line, store, rank, world, echo=False: reported.append((line, echo)))
    monkeypatch.setattr(train.comm, "shutdown", lambda: shutdowns.append(True))
    if traceback:
        monkeypatch.setenv("MEGATRON_PP_TRACEBACK", "1")
    else:
        monkeypatch.delenv("MEGATRON_PP_TRACEBACK", raising=False)
    status = None
    try:
        train.main(["--model-preset", "gpt-tiny", "--mock-data", "--micro-batch-size", "2", "--train-iters", "1"])
    except SystemExit as exc:
        status = exc.code
    return watchdog.calls, reported, shutdowns, status


def _raise(exc):
    def job(args):
        raise exc

    return job


def test_main_stops_the_watchdog_and_releases_the_group_after_a_job(monkeypatch):
    assert _main_with(monkeypatch, lambda args: []) == (["stop"], [], [True], None)


def test_main_reports_an_input_error_once_and_tells_the_other_ranks(monkeypatch):
    calls, reported, shutdowns, status = _main_with(monkeypatch, _raise(ValueError("data.idx: bad magic")))
    # Quiet first (this rank's line is the message, not the watchdog's), then the others stop at once.
    assert calls == ["quiet", "report_failure"] and reported == [("data.idx: bad magic", False)]
    assert status == 1 and shutdowns == []


def test_main_ends_an_agreed_error_without_blaming_a_rank(monkeypatch):
    echo = CheckpointError("saving checkpoint 3 failed on another rank (see its error)")
    echo.echo = True
    calls, reported, _, status = _main_with(monkeypatch, _raise(echo))
    assert calls == ["quiet", "stop"] and status == 1
    assert reported == [("saving checkpoint 3 failed on another rank (see its error)", True)]
    calls, reported, _, status = _main_with(monkeypatch, _raise(TrainingStopped("iteration 4: not finite")))
    assert calls == ["quiet", "stop"] and reported == [("iteration 4: not finite", False)] and status == 1


def test_main_lets_the_watchdog_name_a_dead_peer_before_a_collective_error_goes_on(monkeypatch):
    # Without a verdict the error is a bug and keeps its traceback.
    watchdog = _Watchdog()
    with pytest.raises(RuntimeError, match="closed by peer"):
        _main_with(monkeypatch, _raise(RuntimeError("Connection closed by peer")), watchdog)
    assert watchdog.calls == ["wait_for_verdict"]


def test_main_keeps_the_traceback_of_an_input_error_when_asked(monkeypatch):
    watchdog = _Watchdog()
    with pytest.raises(ValueError, match="bad magic"):
        _main_with(monkeypatch, _raise(ValueError("bad magic")), watchdog, traceback=True)
    assert watchdog.calls == ["quiet"]
@pytest.mark.parametrize("distributed,world,heartbeat,started", [
    (True, 2, 30.0, True), (True, 3, 7.0, True), (True, 1, 30.0, False), (False, 2, 30.0, False),
    (True, 2, 0.0, False)])
def test_the_watchdog_runs_only_in_a_multi_process_job_with_a_heartbeat(monkeypatch, distributed, world, heartbeat,
                                                                        started):
    connected = []

    class Started:
        def start(self):
            return self

    def connect(addr, port, rank, world_size, timeout):
        connected.append((addr, port, rank, world_size, timeout))
        return Started()

    monkeypatch.setattr(train.comm, "is_distributed", lambda: distributed)
    monkeypatch.setattr(train.Watchdog, "connect", staticmethod(connect))
    launch = types.SimpleNamespace(master_addr="node0", master_port=1234, rank=1, world_size=world)
    got = train.start_watchdog(types.SimpleNamespace(heartbeat_timeout_seconds=heartbeat), launch)
    assert (got is not None) == started
    assert connected == ([("node0", 1234, 1, world, heartbeat)] if started else [])
