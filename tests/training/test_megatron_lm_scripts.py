"""Megatron-LM's own launch scripts, with only the entry point changed: every flag of its llama3 8B (bf16,
mock data) and GPT-3 175B examples parses, the run starts and trains with the model shrunk by flags
appended after them, and what cannot run here is refused in one line (fp8, context parallelism, and the
GPT-3 script's batch-size ramp-up with --train-iters, which Megatron-LM refuses too)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_pp.data.indexed import IndexedDatasetWriter, best_dtype
from megatron_pp.data.tokenizers import build_tokenizer, train_bpe
from megatron_pp.training.arguments import build_parser, validate_args
from megatron_pp.training.megatron_compat import NO_EFFECT, accepted_without_effect
from tests.data import sample_texts
from tests.training.megatron_lm_flag_sets import FP8_BLOCK, GPT3_175B, LLAMA3_8B_BF16

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Appended after a script's flags (the last value of a flag wins): a model a CPU trains in seconds.
SHRINK_LLAMA = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
                "--num-query-groups", "2", "--kv-channels", "16", "--seq-length", "32",
                "--max-position-embeddings", "32", "--vocab-size", "256", "--global-batch-size", "4",
                "--train-samples", "12", "--lr-decay-samples", "12", "--lr-warmup-samples", "4",
                "--eval-iters", "1", "--eval-interval", "2", "--save-interval", "2"]
SHRINK_GPT3 = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
               "--max-position-embeddings", "16", "--global-batch-size", "4", "--train-iters", "3",
               "--lr-decay-iters", "3", "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
               "--eval-iters", "1", "--eval-interval", "2", "--save-interval", "2", "--log-interval", "1"]


def _placed(flags, paths):
    return [paths.get(a, a) for a in flags]


def test_every_flag_of_both_scripts_is_declared():
    parser = build_parser()
    for flags in (LLAMA3_8B_BF16, LLAMA3_8B_BF16 + FP8_BLOCK, GPT3_175B):
        assert parser.parse_known_args(flags)[1] == []


def test_llama_script_is_valid_at_its_own_size_and_fp8_is_refused_in_one_line(tmp_path):
    parser = build_parser()
    flags = _placed(LLAMA3_8B_BF16, {"CKPT": str(tmp_path / "ck"), "TB": str(tmp_path), "CACHE": str(tmp_path)})
    assert validate_args(parser.parse_args(flags), world_size=8, this_machine=False) == []
    errors = validate_args(parser.parse_args(flags + FP8_BLOCK), world_size=8, this_machine=False)
    assert len(errors) == 1 and errors[0].startswith("--fp8-format: fp8 training needs TransformerEngine")


def _counted_in_samples(flags):
    """The GPT-3 script with its run and decay lengths in samples (x its global batch of 1536): Megatron-LM's
    validate_args refuses --rampup-batch-size with --train-iters ('expected no batch-size rampup for
    iteration-based training'), so the script runs there only so changed."""
    flags = list(flags)
    for iters, samples in (("--train-iters", "--train-samples"), ("--lr-decay-iters", "--lr-decay-samples")):
        at = flags.index(iters)
        flags[at:at + 2] = [samples, str(int(flags[at + 1]) * 1536)]
    return flags


def test_gpt3_script_is_refused_only_for_its_ramp_up_with_train_iters_as_megatron_lm_refuses_it(tmp_path):
    files = _bpe_corpus(tmp_path)
    args = build_parser().parse_args(_placed(GPT3_175B, files) + ["--tokenizer-type", "GPT2BPETokenizer"])
    errors = validate_args(args, world_size=128, this_machine=False)
    assert errors == ["--rampup-batch-size 16 16 5859375 needs --train-samples (a sample-counted run, as "
                      "Megatron-LM requires: it refuses a ramp-up with --train-iters)"]
    # Counted in samples, the script is valid at its own size, the ramp's 96 microbatch counts included.
    args = build_parser().parse_args(_counted_in_samples(_placed(GPT3_175B, files))
                                     + ["--tokenizer-type", "GPT2BPETokenizer"])
    assert validate_args(args, world_size=128, this_machine=False) == []


def test_start_up_line_names_each_flag_without_effect_that_was_given():
    args = build_parser().parse_args(LLAMA3_8B_BF16)
    line = accepted_without_effect(args)
    for name in ("--use-mcore-models", "--cross-entropy-loss-fusion", "--empty-unused-memory-level 1",
                 "--tiktoken-pattern v2", "--no-create-attention-mask-in-dataloader",
                 "--no-mmap-bin-files", "--num-workers 1", "--profile", "--profile-step-start 4",
                 "--profile-step-end 6", "--calculate-per-token-loss", "--context-parallel-size 1",
                 "--ckpt-format torch_dist (--save writes this project's checkpoints; tools/convert_checkpoint.py "
                 "--target-format torch_dist writes Megatron-LM's)"):
        assert name in line, name
    assert "--overlap-param-gather" not in line  # implemented with --use-distributed-optimizer, as the script gives
    assert "--manual-gc" not in line and args.manual_gc  # implemented: training/manual_gc.py
    assert "\n" not in line and accepted_without_effect(build_parser().parse_args([])) is None
    assert set(NO_EFFECT) >= {"--use-mcore-models", "--num-workers", "--profile"}


def _run(argv, nproc, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    proc = subprocess.run([*launcher, os.path.join(ROOT, "pretrain_gpt.py"), *argv], capture_output=True, text=True,
                          timeout=600, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_llama_script_trains_shrunk_through_pretrain_gpt(tmp_path):
    paths = {"CKPT": str(tmp_path / "ck"), "TB": str(tmp_path / "tb"), "CACHE": str(tmp_path / "cache")}
    metrics = tmp_path / "m.jsonl"
    out = _run(_placed(LLAMA3_8B_BF16, paths) + SHRINK_LLAMA + ["--metrics-file", str(metrics)], 1, tmp_path)
    assert "Megatron-LM flags accepted with no effect here: --use-mcore-models" in out
    assert "--sequence-parallel (off at tensor-parallel size 1, as in Megatron-LM)" in out
    rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if "lr" in r]  # not the validation rows
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    # --lr-warmup-samples 4 of a cosine decay to --min-lr over 12 samples, each step at the rate before it (as
    # Megatron-LM's scheduler is read): 0, the warm-up's end at --lr, then half-way down the cosine.
    assert [r["lr"] for r in rows] == pytest.approx([0.0, 1.5e-4, 1e-5 + 0.5 * (1.5e-4 - 1e-5)])
    assert all(0 < r["loss"] < 20 for r in rows)
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


def _bpe_corpus(tmp_path):
    bpe = train_bpe(sample_texts(), 300, str(tmp_path / "bpe"))
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=bpe["vocab.json"], merge_file=bpe["merges.txt"])
    prefix = str(tmp_path / "corpus_text_document")
    with IndexedDatasetWriter(prefix, best_dtype(tokenizer.vocab_size)) as writer:
        for text in sample_texts(80, seed=3):
            writer.add_document(tokenizer.tokenize(text) + [tokenizer.eod])
    return {"DATA": prefix, "VOCAB": bpe["vocab.json"], "MERGE": bpe["merges.txt"],
            "CKPT": str(tmp_path / "ck"), "TB": str(tmp_path / "tb")}


def test_gpt3_script_trains_shrunk_with_its_ramp_up_on_two_pipeline_ranks(tmp_path):
    files = _bpe_corpus(tmp_path)
    flags = _counted_in_samples(_placed(GPT3_175B, files))  # the script's ramp-up, shrunk below
    shrink = [a for a in SHRINK_GPT3 if a not in ("--train-iters", "--lr-decay-iters", "3")]
    # Global batch 2, 2, then 4 (a 1F1B list of 2 microbatches, then the main one of 4), 14 samples: 4 steps.
    shrink += ["--rampup-batch-size", "2", "2", "4", "--train-samples", "14", "--lr-decay-samples", "14"]
    metrics = tmp_path / "m.jsonl"
    # Megatron-LM's script names no --tokenizer-type; its vocab and merge files are GPT-2 BPE's.
    out = _run(flags + shrink + ["--tokenizer-type", "GPT2BPETokenizer", "--metrics-file", str(metrics)], 2, tmp_path)
    assert "batch-size ramp-up (--rampup-batch-size 2 2 4): global batch 2 -> 4 over 3 iterations" in out
    rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if "lr" in r]  # not the validation rows
    assert [(r["iteration"], r["global_batch_size"], r["consumed_samples"]) for r in rows] == [
        (1, 2, 2), (2, 2, 4), (3, 4, 8), (4, 4, 12)]
    # --lr-warmup-fraction .001 of 14 samples: step 1 runs at the warm-up's start, 0, as in Megatron-LM.
    assert rows[0]["lr"] == 0.0 and 6.0e-6 < rows[-1]["lr"] < 6.0e-5
    assert all(0 < r["loss"] < 20 for r in rows)


def test_docs_name_every_flag_of_both_scripts():
    with open(os.path.join(ROOT, "docs", "training.md")) as f:
        section = f.read().split("## Megatron-LM launch scripts", 1)[1].split("\n## ", 1)[0]
    flags = {a for a in LLAMA3_8B_BF16 + FP8_BLOCK + GPT3_175B if a.startswith("--")}
    assert sorted(f for f in flags if f"`{f}" not in section) == []


def _llama_rows(ctx, argv):
    from megatron_pp.training.arguments import parse_args
    from megatron_pp.training.train import pretrain

    args = parse_args(argv)
    state = ctx.parallel_state(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    return pretrain(args, state=state)


def test_llama_script_at_data_parallel_two_steps_as_at_one(tmp_path):
    """dp 2 runs the script's distributed optimizer, bf16 gradient reduction and decoupled LR across two
    ranks: the same global batches as one rank, so the same losses to bf16's precision."""
    from tests.dist import run_distributed

    runs = {}
    for world in (1, 2):
        paths = {"CKPT": str(tmp_path / f"ck{world}"), "TB": str(tmp_path / f"tb{world}"), "CACHE": str(tmp_path)}
        argv = _placed(LLAMA3_8B_BF16, paths) + SHRINK_LLAMA + ["--eval-interval", "100", "--save-interval", "100"]
        runs[world] = run_distributed(world, _llama_rows, argv)[0]
    one, two = ([r["loss"] for r in runs[w] if "lr" in r] for w in (1, 2))
    assert len(one) == len(two) == 3
    assert two == pytest.approx(one, rel=2e-2) and one[0] == pytest.approx(two[0], rel=1e-2)
