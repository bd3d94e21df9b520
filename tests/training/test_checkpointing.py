"""Checkpoints: exact resume across tp/pp/dp layouts, atomic saves that survive a kill, Megatron's
--load semantics, refusal of incompatible checkpoints, and the early exits (signal, duration) that save."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_pp.training import checkpointing
from megatron_pp.training.arguments import parse_args
from megatron_pp.training.checkpointing import TRACKER_FILE, CheckpointError, read_tracker
from megatron_pp.training.train import pretrain
from tests.dist import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--model-preset", "gpt-tiny", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--lr", "1e-3", "--seed", "5"]
# Dropout makes every step draw random numbers (attention dropout from the tensor-parallel tracker), so
# a resume that restored the wrong RNG state would show in the losses.
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


def _pretrain(ctx, argv, tp, pp):
    """Rank 0's rows, or the agreed CheckpointError's message (raised identically on every rank)."""
    try:
        return pretrain(parse_args(argv), state=ctx.parallel_state(tp, pp))
    except CheckpointError as exc:
        return f"CheckpointError: {exc}"


def _run4(argv, tp, pp):
    return run_distributed(4, _pretrain, argv, tp, pp)[0]


def _train_rows(rows):
    return [r for r in rows if "loss" in r]


LAYOUTS = {
    "1f1b-tp2-pp2": (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                      "--pipeline-schedule", "1f1b"], 2, 2),
    "interleaved-pp2-dp2": (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                             "--pipeline-schedule", "interleaved-1f1b"], 1, 2),
    # V placement: rank 0 saves and loads the first and the last stage, whose tied embedding is one parameter.
    "zb-v-pp2-dp2": (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-v"], 1, 2),
    # ZeRO-1: each data-parallel rank saves and loads its own shard of the optimizer state.
    "distributed-optimizer-pp2-dp2": (["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"], 1, 2),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_resume_is_bitwise_exact(tmp_path, name):
    layout, tp, pp = LAYOUTS[name]
    argv = TINY + DROPOUT + layout + ["--train-iters", "4"]
    # The uninterrupted run saves after every step: saving must not perturb training either.
    reference = _run4(argv + ["--save", str(tmp_path / "ref"), "--save-interval", "1"], tp, pp)
    assert [r["iteration"] for r in reference] == [1, 2, 3, 4]
    assert read_tracker(str(tmp_path / "ref")) == 4

    stopped = _run4(argv + ["--save", str(tmp_path / "ck"), "--exit-interval", "2"], tp, pp)
    assert [r["loss"] for r in stopped] == [r["loss"] for r in reference[:2]]
    assert read_tracker(str(tmp_path / "ck")) == 2

    without_rng = _run4(argv + ["--load", str(tmp_path / "ck"), "--no-load-rng"], tp, pp)
    resumed = _run4(argv + ["--load", str(tmp_path / "ck"), "--save", str(tmp_path / "ck")], tp, pp)
    assert [r["iteration"] for r in resumed] == [3, 4]
    for got, want in zip(resumed, reference[2:]):
        for key in ("loss", "grad_norm", "consumed_samples", "lr"):
            assert got[key] == want[key], (key, resumed, reference)
    # Control: the same resume with fresh random streams draws other dropout masks.
    assert without_rng[0]["loss"] != reference[2]["loss"]
    assert read_tracker(str(tmp_path / "ck")) == 4
    metadata = json.loads((tmp_path / "ck" / "iter_0000004" / "metadata.json").read_text())
    assert metadata["consumed_samples"] == 32 and metadata["layout"]["tp"] == tp and metadata["layout"]["pp"] == pp


def test_weights_load_into_another_placement_of_the_same_stages(tmp_path):
    """pp=2 with 2 chunks per rank and pp=4 with one hold the same 4 stages: the weights load directly;
    rank-bound state (optimizer, RNG) must be declined explicitly."""
    interleaved, _, _ = LAYOUTS["interleaved-pp2-dp2"]
    reference = _run4(TINY + interleaved + ["--train-iters", "3"], 1, 2)
    _run4(TINY + interleaved + ["--train-iters", "3", "--save", str(tmp_path / "ck"), "--exit-interval", "2"], 1, 2)
    pp4 = TINY + ["--pipeline-model-parallel-size", "4", "--train-iters", "3", "--load", str(tmp_path / "ck")]
    refused = _run4(pp4, 1, 4)
    assert isinstance(refused, str) and "add --no-load-optim --no-load-rng" in refused, refused
    loaded = _run4(pp4 + ["--no-load-optim", "--no-load-rng"], 1, 4)
    # Iteration 3's loss is a forward with the loaded weights: equal up to the layouts' summation order.
    assert loaded[0]["iteration"] == 3
    assert abs(loaded[0]["loss"] - reference[2]["loss"]) <= 1e-5 * reference[2]["loss"]
    other_tp = _run4(TINY + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                             "--train-iters", "3", "--load", str(tmp_path / "ck")], 2, 2)
    assert "saved with --tensor-model-parallel-size 1 and layers per stage [0-1, 1-2, 2-3, 3-4]; this run has 2 and " \
           "[0-2, 2-4]" in other_tp and "conversion tool" in other_tp, other_tp


def test_distributed_optimizer_state_loads_only_at_its_own_data_parallel_size(tmp_path):
    """Each dp rank holds one shard of the optimizer state: another dp size, or the replicated optimizer,
    cannot use the shards as they are; the refusal names the way out, which then works."""
    ck = str(tmp_path / "ck")
    argv = TINY + ["--use-distributed-optimizer", "--train-iters", "1", "--save", ck]
    saved = run_distributed(2, _pretrain, argv, 1, 1)[0]
    assert [r["iteration"] for r in saved] == [1]
    resume = TINY + ["--train-iters", "2", "--load", ck]
    replicated = run_distributed(2, _pretrain, resume, 1, 1)[0]
    one_rank = run_distributed(1, _pretrain, resume + ["--use-distributed-optimizer"], 1, 1)[0]
    for refused in (replicated, one_rank):
        assert refused == (f"CheckpointError: {ck}/iter_0000001 holds optimizer state for data-parallel size 2 "
                           "(distributed optimizer); this run cannot load it directly: add --no-load-optim"), refused
    rows = run_distributed(1, _pretrain, resume + ["--use-distributed-optimizer", "--no-load-optim"], 1, 1)[0]
    assert [r["iteration"] for r in rows] == [2]
    # And the other way: replicated state (dp rank 0's copy) is not split into shards on load.
    plain = str(tmp_path / "plain")
    run_distributed(1, _pretrain, TINY + ["--train-iters", "1", "--save", plain], 1, 1)
    sharded = run_distributed(2, _pretrain, TINY + ["--use-distributed-optimizer", "--train-iters", "2", "--load",
                                                    plain], 1, 1)[0]
    assert sharded == (f"CheckpointError: {plain}/iter_0000001 holds optimizer state for data-parallel size 1 "
                       "(replicated optimizer); this run cannot load it directly: add --no-load-optim"), sharded


# Single process ---------------------------------------------------------------------------------------

SINGLE = ["--model-preset", "gpt-tiny", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4",
          "--seed", "3"]


def _single(argv):
    return pretrain(parse_args(SINGLE + argv))


KILL_DURING_SAVE = """
import os, signal, sys, torch
calls = 0
real_save = torch.save
def save(obj, f, *args, **kwargs):
    global calls
    calls += 1
    if calls == 5:  # iteration 2's second file (each save writes model, optimizer and rank files)
        f.write(b"half a tensor")
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return real_save(obj, f, *args, **kwargs)
torch.save = save
from megatron_pp.training.train import main
main(sys.argv[1:])
"""


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    proc = subprocess.run([sys.executable, "-c", KILL_DURING_SAVE, *SINGLE, "--train-iters", "3", "--save", str(ck),
                           "--save-interval", "1"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert (ck / TRACKER_FILE).read_text() == "1\n"
    assert (ck / "iter_0000001" / "metadata.json").is_file()
    assert (ck / "iter_0000002.tmp").is_dir() and not (ck / "iter_0000002.tmp" / "metadata.json").exists()
    assert not (ck / "iter_0000002").exists()
    rows = _single(["--train-iters", "2", "--load", str(ck)])
    assert [r["iteration"] for r in rows] == [2]


def test_a_failed_publish_keeps_latest_and_the_iteration_can_be_saved_again(tmp_path, monkeypatch):
    ck = str(tmp_path / "ck")
    real_write = checkpointing.write_text_atomic

    def disk_full_at_2(path, text):
        if text.strip() == "2":
            raise OSError(28, "No space left on device")
        real_write(path, text)

    monkeypatch.setattr(checkpointing, "write_text_atomic", disk_full_at_2)
    with pytest.raises(CheckpointError, match="publishing checkpoint .*iter_0000002: OSError: .*No space left"):
        _single(["--train-iters", "2", "--save", ck, "--save-interval", "1"])
    assert read_tracker(ck) == 1 and os.path.isdir(os.path.join(ck, "iter_0000002"))  # renamed, never pointed to
    monkeypatch.setattr(checkpointing, "write_text_atomic", real_write)
    rows = _single(["--train-iters", "2", "--load", ck, "--save", ck])
    assert [r["iteration"] for r in rows] == [2] and read_tracker(ck) == 2
    assert sorted(os.listdir(ck)) == ["iter_0000001", "iter_0000002", TRACKER_FILE]


def test_load_semantics(tmp_path):
    missing = str(tmp_path / "none")
    assert [r["iteration"] for r in _single(["--train-iters", "1", "--load", missing])] == [1]  # from scratch
    for flag in ("--exit-on-missing-checkpoint", "--finetune"):
        with pytest.raises(CheckpointError, match=f"no checkpoint found .* and {flag} was given"):
            _single(["--train-iters", "1", "--load", missing, flag])
    ck = str(tmp_path / "ck")
    first = _single(["--train-iters", "2", "--save", ck, "--no-save-optim"])
    assert read_tracker(ck) == 2  # saved at the end of training without --save-interval
    with pytest.raises(CheckpointError, match="no optimizer state .*add --no-load-optim or --finetune"):
        _single(["--train-iters", "3", "--load", ck])
    assert [r["iteration"] for r in _single(["--train-iters", "3", "--load", ck, "--no-load-optim"])] == [3]
    # --finetune: the weights only, from iteration 0 and sample 0 again.
    finetuned = _single(["--train-iters", "1", "--load", ck, "--finetune"])
    assert finetuned[0]["iteration"] == 1 and finetuned[0]["consumed_samples"] == 4
    assert finetuned[0]["loss"] != first[0]["loss"]  # trained weights on the first batch again
    assert _single(["--train-iters", "2", "--load", ck, "--no-load-optim"]) == []  # nothing left to train


def test_incompatible_checkpoints_are_refused_in_one_line(tmp_path):
    ck = str(tmp_path / "ck")
    _single(["--train-iters", "1", "--save", ck])
    with pytest.raises(CheckpointError) as info:
        _single(["--train-iters", "2", "--load", ck, "--hidden-size", "128"])
    message = str(info.value)
    assert message.startswith(f"{ck}/iter_0000001 holds a different model: ffn_size 256 (checkpoint) vs 512")
    assert "hidden_size 64 (checkpoint) vs 128 (this run)" in message
    with pytest.raises(CheckpointError) as info:
        _single(["--train-iters", "2", "--load", ck, "--pipeline-schedule", "interleaved-1f1b",
                 "--num-virtual-stages-per-pipeline-rank", "2"])
    message = str(info.value)
    assert "layers per stage [0-4]; this run has 1 and [0-2, 2-4]" in message and "conversion tool" in message
    assert "\n" not in message
    (tmp_path / "ck" / TRACKER_FILE).write_text("garbage")
    with pytest.raises(CheckpointError, match="expected an iteration number"):
        _single(["--train-iters", "2", "--load", ck])


def test_exit_duration_saves_and_stops(tmp_path):
    ck = str(tmp_path / "ck")
    rows = _single(["--train-iters", "50", "--save", ck, "--exit-duration-in-mins", "1e-9"])
    assert [r["iteration"] for r in rows] == [1] and read_tracker(ck) == 1


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def _rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    except OSError:
        return None
    return int(env[b"RANK"]) if b"RANK" in env else None


def test_sigusr1_to_one_rank_saves_on_all_ranks_and_exits_0(tmp_path):
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "pretrain_gpt.py"), *SINGLE, "--pipeline-model-parallel-size", "2",
           "--train-iters", "100000", "--save", str(ck), "--exit-signal-handler", "--metrics-file", str(metrics),
           "--log-interval", "1000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        rank1 = [pid for pid in _children(proc.pid) if _rank_of(pid) == 1]
        assert len(rank1) == 1
        os.kill(rank1[0], signal.SIGUSR1)  # only rank 1 hears it, as when SLURM's signal reaches ranks apart
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    steps = len(metrics.read_text().splitlines())
    assert 2 <= steps < 100000 and read_tracker(str(ck)) == steps
    files = sorted(os.listdir(ck / f"iter_{steps:07d}"))
    assert {"rank_pp000_tp00_dp000.pt", "rank_pp001_tp00_dp000.pt"} <= set(files)
    # Rank 0 never received the signal: it stopped at the same iteration through the all-reduce.
    assert f"exiting after iteration {steps}: received a signal on another rank" in out


def test_schedule_state_and_rng_round_trip_through_the_api(tmp_path):
    """The pieces a schedule with state across steps (2BW) relies on: its dict comes back as saved, and
    every generator continues where it was."""
    import random

    import numpy as np
    import torch

    from megatron_pp.core.parallel_state import ParallelState
    from megatron_pp.core.tensor_parallel import get_rng_tracker, model_parallel_seed
    from megatron_pp.models.layout import split_layers
    from megatron_pp.models.presets import get_preset
    from megatron_pp.models.transformer import StageModel

    config = get_preset("gpt-tiny")
    stages = split_layers(config.num_layers, 1, 1)
    state = ParallelState.build()
    model_parallel_seed(9, 0, 0)

    def training_state(seed):
        return checkpointing.TrainingState(chunks=[StageModel(config, stages[0], seed=seed)], stage_ids=[0],
                                           stages=stages, placement=[(0, 0)], state=state, config=config,
                                           schedule_name="1f1b")

    saved_state = training_state(1)
    old_weights = torch.randn(3, 4)
    checkpointing.save_checkpoint(str(tmp_path), 7, saved_state, consumed_samples=70,
                                  schedule_state={"weights_v0": old_weights, "version": 1})

    def draws():
        with get_rng_tracker().fork():
            tracked = torch.rand(2)
        return random.random(), float(np.random.rand()), torch.rand(2), tracked

    expected = draws()
    loaded_state = training_state(2)
    resume = checkpointing.load_checkpoint(str(tmp_path), loaded_state)
    assert (resume.iteration, resume.consumed_samples) == (7, 70)
    assert torch.equal(resume.schedule_state["weights_v0"], old_weights) and resume.schedule_state["version"] == 1
    for a, b in zip(saved_state.chunks[0].state_dict().values(), loaded_state.chunks[0].state_dict().values()):
        assert torch.equal(a, b)
    again = draws()
    assert again[:2] == expected[:2] and torch.equal(again[2], expected[2]) and torch.equal(again[3], expected[3])


def test_a_checkpoint_with_another_position_table_is_refused_in_one_line(tmp_path):
    """Learned positions: the table's length is part of the model's shape (else a size-mismatch traceback)."""
    ck = str(tmp_path / "ck")
    _single(["--train-iters", "1", "--save", ck])
    with pytest.raises(CheckpointError, match=r"num_positions 32 \(checkpoint\) vs 64 \(this run\)"):
        _single(["--train-iters", "2", "--load", ck, "--max-position-embeddings", "64"])


def test_rank_bound_state_needs_the_same_placement_not_only_the_same_pp():
    """Same pipeline size, same stages, another placement (interleaved vs a V): each rank holds other
    stages, so the optimizer and RNG files of a rank are another rank's; only equal placements share them."""
    from types import SimpleNamespace

    saved = {"layout": {"pp": 2, "placement": [[0, 0], [1, 0], [0, 1], [1, 1]]}}

    def run(pp, placement):
        return SimpleNamespace(state=SimpleNamespace(pp_size=pp), placement=placement)

    assert checkpointing._same_ranks(saved, run(2, [(0, 0), (1, 0), (0, 1), (1, 1)]))
    assert not checkpointing._same_ranks(saved, run(2, [(0, 0), (1, 0), (1, 1), (0, 1)]))
    assert not checkpointing._same_ranks(saved, run(4, [(0, 0), (1, 0), (2, 0), (3, 0)]))


def test_every_byte_reaches_the_os_before_the_fsync(tmp_path, monkeypatch):
    """A shard is flushed from Python's buffer before its fsync, or a crash right after the "durable"
    write could leave a short file that the tracker then points at."""
    sizes = []
    real_fsync = checkpointing.os.fsync

    def fsync(fd):
        sizes.append(os.fstat(fd).st_size)
        real_fsync(fd)

    monkeypatch.setattr(checkpointing.os, "fsync", fsync)
    path = str(tmp_path / "shard.pt")
    checkpointing._save_file({"weights": list(range(5000))}, path)
    assert sizes == [os.path.getsize(path)]
