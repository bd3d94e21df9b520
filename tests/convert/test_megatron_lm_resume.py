"""Issue 34, item 3, loss for loss: a Megatron-Core `GPTModel` (local layer spec, tiny, fp32, CPU) saved as
Megatron-LM saves it after 7 iterations of a global batch of 4 (`args.consumed_train_samples` 28), in its
`torch` and `torch_dist` formats, is imported with the converter and resumed by `pretrain_gpt.py` with the
same data flags. Its first logged loss (iteration 8, the forward before the update) is megatron-core's
forward loss on the batch megatron-core's own `GPTDataset` gives at samples [28, 32) of the same file,
split, seed and sample count: the resumed run reads the batch Megatron-LM would have read next."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron_pp.convert import convert_checkpoint
from megatron_pp.convert.core import training_flags
from megatron_pp.core.local_world import WorkerPool
from megatron_pp.models.presets import get_preset
from megatron_pp.training.checkpointing import config_from_json, config_to_json, iteration_dir
from tests.convert.megatron_lm_args import args_for
from tests.convert.test_megatron_core import (
    _child_processes_allowed,
    _mcore_model,
    _megatron_core_on_cpu,
    _perturb_mcore,
)
from tests.data import write_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ, MICRO, GLOBAL, DONE, SEED = 16, 2, 4, 7, 1234
TRAIN_ITERS = DONE + 1
SPLIT = "90,10,0"
# 251 ids (NullTokenizer --vocab-size 250: Megatron's vocabulary is N + 1, EOD = N), padded to 256 rows: the
# five padding rows of Megatron-LM's embedding and output layer count in its softmax, so the import must keep
# them (it does at the same padded size).
VOCAB, EOD = 251, 250


def _config():
    return dataclasses.replace(get_preset("llama-tiny"), num_layers=2, vocab_size=VOCAB, seq_length=SEQ)


def _corpus(prefix: str) -> None:
    """120 documents of 3..40 random ids, each ending with EOD: ~2,500 tokens, so the 32 samples of
    the run (8 iterations x 4) cross no epoch and the resume point lies inside the first."""
    rng = np.random.default_rng(11)
    documents = [np.append(rng.integers(0, EOD, size=int(n)), EOD) for n in rng.integers(2, 40, size=120)]
    write_dataset(prefix, documents, np.uint8)


class _Tokenizer:
    """What megatron-core's GPTDatasetConfig reads of a tokenizer."""

    vocab_size = VOCAB
    eod = EOD
    pad = -1
    unique_identifiers = {"class": "NullTokenizer"}


def _mcore_batch(prefix: str, cache: str, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron-core's training samples [first, first + B) for Megatron-LM's sizes of this run."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(random_seed=SEED, sequence_length=SEQ, tokenizer=_Tokenizer(), blend=([prefix], None),
                              split=SPLIT, reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False, path_to_cache=cache)
    # Megatron-LM's sizes: train_iters·B, (train_iters // eval_interval + 1)·eval_iters·B, eval_iters·B.
    sizes = [TRAIN_ITERS * GLOBAL, (TRAIN_ITERS // 1000 + 1) * GLOBAL, GLOBAL]
    train = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()[0]
    items = [train[i] for i in range(first, first + GLOBAL)]
    return torch.stack([it["tokens"] for it in items]).long(), torch.stack([it["labels"] for it in items]).long()


def _mcore_saves_mid_run(ctx, fmt: str, root: str, config_json: dict, prefix: str, cache: str) -> dict:
    """GPTModel saved as Megatron-LM's checkpoint at iteration DONE (DONE·B samples consumed); its forward
    loss (Megatron-LM's: the masked token mean of each microbatch, averaged) on the global batch starting at
    each sample count: the next one (DONE·B), and two a wrong resume would read (0 and (DONE − 1)·B)."""
    import torch.distributed as dist

    config = config_from_json(config_json)
    with _megatron_core_on_cpu(1):
        torch.manual_seed(SEED)
        model = _mcore_model(config, 1)
        _perturb_mcore(model, SEED, ctx.rank)
        args = args_for(config, ckpt_format=fmt, transformer_impl="local", consumed_train_samples=DONE * GLOBAL)
        directory = iteration_dir(root, DONE)
        common = {"args": args, "checkpoint_version": 3.0, "iteration": DONE}
        os.makedirs(directory, exist_ok=True)
        if fmt == "torch":
            os.makedirs(os.path.join(directory, "mp_rank_00"))
            torch.save({**common, "model": model.state_dict()}, os.path.join(directory, "mp_rank_00",
                                                                            "model_optim_rng.pt"))
        else:
            from megatron.core import dist_checkpointing

            with _child_processes_allowed():
                dist_checkpointing.save({**common, "model": model.sharded_state_dict()}, directory)
        dist.barrier()
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(DONE))
        positions = torch.arange(SEQ).expand(MICRO, SEQ)
        causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
        found = {}
        for first in (0, (DONE - 1) * GLOBAL, DONE * GLOBAL):
            tokens, labels = _mcore_batch(prefix, cache, first)
            losses = []
            with torch.no_grad():
                for start in range(0, GLOBAL, MICRO):
                    per_token = model.eval()(tokens[start:start + MICRO], positions, attention_mask=causal,
                                             labels=labels[start:start + MICRO])
                    losses.append(per_token.float().mean().item())
            found[first] = sum(losses) / len(losses)
        return found


@pytest.fixture(scope="module")
def pool():
    workers = WorkerPool(1)
    yield workers
    workers.close()


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_resumed_megatron_lm_checkpoint_trains_on_the_batch_megatron_lm_reads_next(pool, tmp_path, fmt):
    config = _config()
    prefix = str(tmp_path / "corpus_text_document")
    _corpus(prefix)
    mcore_dir, ours_dir = str(tmp_path / "mcore"), str(tmp_path / "ours")
    os.makedirs(mcore_dir)
    losses = pool.run(_mcore_saves_mid_run, fmt, mcore_dir, config_to_json(config), prefix,
                      str(tmp_path / "mcore-cache"))[0]
    expected = losses[DONE * GLOBAL]
    for wrong in (0, (DONE - 1) * GLOBAL):  # the comparison tells the batches apart
        assert abs(losses[wrong] - expected) > 10 * 1e-5 * expected, losses

    result = convert_checkpoint("megatron_lm" if fmt == "torch" else "torch_dist", "megatron_pp", mcore_dir,
                                ours_dir, true_vocab_size=VOCAB, progress=False)
    assert (result.iteration, result.consumed_samples) == (DONE, DONE * GLOBAL)
    with open(os.path.join(iteration_dir(ours_dir, DONE), "metadata.json")) as f:
        assert json.load(f)["consumed_samples"] == DONE * GLOBAL
    if fmt == "torch":  # resharding keeps the position, and the tool says how to continue from it
        resharded = subprocess.run(
            [sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"), "--source-format", "megatron_pp",
             "--target-format", "megatron_pp", "--load-dir", ours_dir, "--save-dir", str(tmp_path / "resharded"),
             "--no-progress"], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert resharded.returncode == 0, resharded.stderr[-2000:]
        assert (f"to continue this run at iteration {DONE}, {DONE * GLOBAL} samples consumed, pass --no-load-optim "
                "--no-load-rng instead") in resharded.stdout, resharded.stdout

    model_flags = training_flags(config)
    model_flags[model_flags.index("--vocab-size") + 1] = str(VOCAB - 1)  # NullTokenizer: N + 1 ids
    metrics = tmp_path / "metrics.jsonl"
    argv = model_flags + [
        "--tokenizer-type", "NullTokenizer", "--data-path", prefix, "--split", SPLIT, "--seed", str(SEED),
        "--micro-batch-size", str(MICRO), "--global-batch-size", str(GLOBAL), "--train-iters", str(TRAIN_ITERS),
        "--lr", "1e-4", "--lr-decay-style", "constant", "--eval-interval", "1000", "--eval-iters", "1",
        "--load", ours_dir, "--no-load-optim", "--no-load-rng", "--log-interval", "1",
        "--data-cache-path", str(tmp_path / "cache"), "--metrics-file", str(metrics)]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *argv], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if "lr" in r]
    assert [(r["iteration"], r["consumed_samples"]) for r in rows] == [(TRAIN_ITERS, TRAIN_ITERS * GLOBAL)]
    assert rows[0]["loss"] == pytest.approx(expected, rel=1e-5, abs=0)
