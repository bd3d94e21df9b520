"""2BW checkpoints and early exits: a flush changes no number, resume is bitwise exact, and a stop request
reaches every rank without a barrier (its flags ride on the metrics all-reduce)."""
from __future__ import annotations

import os
import shutil

import torch

from megatron_pp.training.arguments import parse_args
from megatron_pp.training.checkpointing import iteration_dir, model_file, rank_file, read_tracker
from megatron_pp.training.train import pretrain
from tests.dist import run_distributed

# Dropout draws random numbers in every forward: restoring the wrong RNG state, or running the forwards of
# a batch in another order around a flush, would show in the losses.
ARGV = ["--model-preset", "gpt-tiny", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--lr", "1e-3", "--seed", "5", "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
        "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw", "--train-iters", "5"]
KEYS = ("loss", "grad_norm", "lr", "consumed_samples", "skipped")


def _pretrain(ctx, argv):
    return pretrain(parse_args(argv), state=ctx.parallel_state(1, 2))


def _run(argv):
    return run_distributed(2, _pretrain, argv)[0]


def _same(rows, reference):
    assert [r["iteration"] for r in rows] == [r["iteration"] for r in reference]
    for got, want in zip(rows, reference):
        assert {k: got[k] for k in KEYS} == {k: want[k] for k in KEYS}, (got, want)


def test_flushes_and_resume_are_bitwise_exact(tmp_path):
    straight = _run(ARGV)  # warm-up, three steady calls, cool-down: no flush in between
    assert [r["iteration"] for r in straight] == [1, 2, 3, 4, 5]
    # A flush (and a checkpoint) after every step: the same numbers.
    _same(_run(ARGV + ["--save", str(tmp_path / "every"), "--save-interval", "1"]), straight)

    stopped = _run(ARGV + ["--save", str(tmp_path / "ck"), "--exit-interval", "2"])
    _same(stopped, straight[:2])
    assert read_tracker(str(tmp_path / "ck")) == 2
    state = torch.load(os.path.join(iteration_dir(str(tmp_path / "ck"), 2), rank_file(1, 0, 0)), weights_only=True)
    two_bw = state["schedule_state"]["two_bw"]
    assert two_bw["next_batch"] == 2 and two_bw["loss_scales"] == [1.0, 1.0] and len(two_bw["older_weights"]) > 0
    # The model file holds the newest version and the schedule state the older one. Files with the older
    # weights would resume one update behind wherever the optimizer's copy is not loaded (--no-load-optim,
    # --finetune, a conversion), which the bitwise resume above does not see.
    model = torch.load(os.path.join(iteration_dir(str(tmp_path / "ck"), 2), model_file(1, 0)), weights_only=True)
    newest = list(model["model"].values())
    assert [t.shape for t in newest] == [t.shape for t in two_bw["older_weights"]]
    assert all(not torch.equal(n, o) for n, o in zip(newest, two_bw["older_weights"]) if n.dim() == 2)

    resumed = _run(ARGV + ["--load", str(tmp_path / "ck")])
    _same(resumed, straight[2:])

    # Control: the same checkpoint without the 2BW state (as one written by another schedule) starts both
    # versions equal, so batch 2 runs on W(2) instead of W(1): another loss, although the RNG is restored.
    other = tmp_path / "other"
    shutil.copytree(tmp_path / "ck", other)
    for pp_rank in range(2):
        path = os.path.join(iteration_dir(str(other), 2), rank_file(pp_rank, 0, 0))
        saved = torch.load(path, weights_only=True)
        del saved["schedule_state"]["two_bw"]
        torch.save(saved, path)
    without_older = _run(ARGV + ["--load", str(other)])
    assert without_older[0]["loss"] != straight[2]["loss"]


def test_a_stop_request_flushes_and_saves_without_a_barrier(tmp_path):
    """--exit-duration-in-mins 1e-9: every rank's clock says stop from the first call on. The flag travels on
    batch 0's metrics, which the ranks read after call 1; call 2 then flushes, saves and stops."""
    rows = _run(ARGV + ["--exit-duration-in-mins", "1e-9", "--save", str(tmp_path)])
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert read_tracker(str(tmp_path)) == 3
