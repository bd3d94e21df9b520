"""The way back to Megatron-LM keeps the data position (issue 34, item 3): a checkpoint our training wrote
after 3 iterations of 4 samples, exported as Megatron-LM's `torch` and Megatron-Core's `torch_dist`,
carries what Megatron-LM's load_checkpoint reads to continue: the tracker's iteration, the state dict's
`iteration`, and `args.consumed_train_samples` (its batch sampler starts there), with
`skipped_train_samples` and `consumed_valid_samples` at 0. The torch_dist side is read with
megatron-core's own `dist_checkpointing.load_common_state_dict`, in a worker of this module."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megatron_pp.convert import convert_checkpoint
from megatron_pp.convert.megatron_lm import rank_directory
from megatron_pp.core.local_world import WorkerPool
from megatron_pp.training.checkpointing import iteration_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _mcore_common(ctx, directory: str) -> tuple[int, int, int, int]:
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(directory)
    args = common["args"]
    return common["iteration"], args.consumed_train_samples, args.skipped_train_samples, args.consumed_valid_samples


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Our checkpoint after 3 iterations of a global batch of 4 (12 samples consumed)."""
    root = str(tmp_path_factory.mktemp("ours") / "ckpt")
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--model-preset", "gpt-tiny", "--mock-data",
           "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--save", root]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


@pytest.mark.parametrize("fmt", ["megatron_lm", "torch_dist"])
def test_megatron_lm_export_carries_iteration_and_consumed_samples(trained, tmp_path, fmt):
    save = str(tmp_path / fmt)
    convert_checkpoint("megatron_pp", fmt, trained, save, transformer_impl="local", progress=False)
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "3"
    directory = iteration_dir(save, 3)
    if fmt == "megatron_lm":
        state = torch.load(os.path.join(directory, rank_directory(0, 0, 1), "model_optim_rng.pt"), weights_only=False)
        args = state["args"]
        read = (state["iteration"], args.consumed_train_samples, args.skipped_train_samples,
                args.consumed_valid_samples)
    else:
        pool = WorkerPool(1)
        try:
            read = pool.run(_mcore_common, directory, timeout=600)[0]  # megatron-core's import is slow when busy
        finally:
            pool.close()
    assert read == (3, 12, 0, 0)
