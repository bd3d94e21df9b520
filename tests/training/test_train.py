"""The job wiring of `training.train`: seeding and what `main` leaves behind (the training itself is in
test_pretrain.py and the exactness tests)."""
from __future__ import annotations

import random
import types

import numpy as np
import torch
import torch.distributed as dist

from megatron_pp.core.tensor_parallel.random import get_rng_tracker
from megatron_pp.training import train
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
