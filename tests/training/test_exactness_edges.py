"""Exactness at odd sizes and across steps: every optimizer x every gradient-reduction mode at dp > 1.

The central test (tests/schedules/test_exactness.py) checks one step's gradients at friendly sizes
(dp 2, even splits). Bugs that only show at dp = 3, with shards that cut parameters and buckets
unevenly, with m not a multiple of p, with uneven layer splits, or on the second call of a training step
(state one step leaves behind) pass it unseen. Here the real training loop (`pretrain`, argument
parsing and validation included, on a gloo world of 6) trains three steps, and every step's loss and
gradient norm must equal those of a plain single-process loop written in this file: the whole model,
the global batch of samples [i·B, (i+1)·B), per-token mean loss, fp64 gradient norm, clipping and
torch's AdamW with weight decay on 2-D+ tensors only. Loss and norm within 1e-5 relative: the norm
is the gradient checked (a reduction bug changes it), the next step's loss checks the update.

Matrix (world 6, fp32, Adam, clip 1.0, 3 steps): optimizer {plain, --use-distributed-optimizer,
--data-parallel-sharding-strategy optim_grads_params} x reduction {per step, --overlap-grad-reduce,
--layered-grad-accumulation}, each on a layout from {tp1 pp2 dp3, tp2 pp1 dp3, tp1 pp3 dp2} with small
gradient buckets (several per chunk, most padded to a multiple of dp). Combinations the validator
refuses are checked for the refusal and the flags it names. One-step cases at the same sizes compare
every gradient tensor (the central test's `check`), for the executor's own reduction and for the
layered reducer in two breadth-first groups at dp 3 under each sharding strategy.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megatron_pp.models.presets import get_preset
from megatron_pp.models.transformer import build_model
from megatron_pp.training.arguments import build_parser, validate_args
from megatron_pp.training.step_data import MockSplit
from tests.dist import run_distributed

SEED = 11
ITERS = 3
LR, CLIP, WEIGHT_DECAY = 1e-3, 1.0, 0.01
TOL = 1e-5
WORLD = 6
# Buckets of about 3 KiB of fp32: several per chunk, and (with dp 2 or 3) most of them padded.
BUCKET_BYTES = 3000


def _argv(preset, layers, mbs, gbs, extra):
    return ["--model-preset", preset, "--num-layers", str(layers), "--mock-data", "--seed", str(SEED),
            "--micro-batch-size", str(mbs), "--global-batch-size", str(gbs), "--train-iters", str(ITERS),
            "--lr", str(LR), "--clip-grad", str(CLIP), "--weight-decay", str(WEIGHT_DECAY), "--log-interval", "100",
            *extra]


def reference(preset, layers, gbs):
    """(loss, grad norm) per step of a single process training the whole global batch at once."""
    config = dataclasses.replace(get_preset(preset), num_layers=layers)
    model = build_model(config, seed=SEED)
    split = MockSplit(SEED, config.seq_length, config.vocab_size)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() > 1]},
         {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}],
        lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WEIGHT_DECAY)
    out = []
    for step in range(ITERS):
        batch = split.get_batch(range(step * gbs, (step + 1) * gbs))
        optimizer.zero_grad(set_to_none=True)
        mask = batch["loss_mask"]
        loss = (model(None, batch).float() * mask).sum() / mask.sum()
        loss.backward()
        norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in params))
        if norm > CLIP:
            for p in params:
                p.grad.mul_(CLIP / (norm + 1e-6))
        optimizer.step()
        out.append((float(loss.detach()), norm))
    return out


def _train(ctx, argv, bucket_bytes):
    from megatron_pp.training.arguments import parse_args
    from megatron_pp.training.train import pretrain

    args = parse_args(argv)
    args.bucket_bytes = bucket_bytes  # OptimizerConfig.from_args reads every field the namespace has
    state = ctx.parallel_state(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    rows = pretrain(args, state=state)
    return [(r["iteration"], r["consumed_samples"], r["loss"], r["grad_norm"], r["lr"]) for r in rows]


_REFERENCES: dict = {}


def check_against_reference(preset, layers, mbs, gbs, extra, bucket_bytes=BUCKET_BYTES):
    rows = run_distributed(WORLD, _train, _argv(preset, layers, mbs, gbs, extra), bucket_bytes)[0]
    key = (preset, layers, gbs)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference(preset, layers, gbs)
    ref = _REFERENCES[key]
    assert [(r[0], r[1]) for r in rows] == [(i + 1, (i + 1) * gbs) for i in range(ITERS)], rows
    for (it, _, loss, norm, lr), (ref_loss, ref_norm) in zip(rows, ref):
        assert lr == LR
        assert abs(loss - ref_loss) <= TOL * ref_loss, f"step {it}: loss {loss} vs reference {ref_loss}"
        assert abs(norm - ref_norm) <= TOL * ref_norm, f"step {it}: grad norm {norm} vs reference {ref_norm}"


OPTIMIZERS = {
    "plain": [],
    "zero1": ["--use-distributed-optimizer"],
    "zero3": ["--data-parallel-sharding-strategy", "optim_grads_params"],
}

# (optimizer, reduction, preset, layers, mbs, layout flags and schedule). gbs = mbs x m x dp.
MATRIX = [
    # per step: the reduction after the last backward
    ("plain", "step", "gpt-tiny", 5, 1, 3, ["--pipeline-model-parallel-size", "2",
                                            "--decoder-first-pipeline-num-layers", "2"]),  # dp 3, layers 2 + 3
    ("zero1", "step", "llama-tiny", 4, 1, 5, ["--pipeline-model-parallel-size", "3",
                                              "--decoder-last-pipeline-num-layers", "2",
                                              "--pipeline-schedule", "gpipe"]),  # dp 2, layers 1 + 1 + 2, m 5
    ("zero3", "step", "gpt-tiny", 4, 2, 3, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),  # dp 3
    # overlapped: buckets reduced as their hooks complete
    ("plain", "overlap", "llama-tiny", 4, 1, 2, ["--tensor-model-parallel-size", "2"]),  # dp 3
    ("zero1", "overlap", "gpt-tiny", 4, 1, 3, ["--pipeline-model-parallel-size", "2",
                                               "--num-layers-per-virtual-pipeline-stage", "1",
                                               "--pipeline-schedule", "interleaved-1f1b"]),  # dp 3, v 2, m 3
    ("zero3", "overlap", "gpt-tiny", 5, 1, 4, ["--pipeline-model-parallel-size", "3",
                                               "--decoder-first-pipeline-num-layers", "1"]),  # dp 2, m 4
    # layered: REDUCE_GRAD per chunk per breadth-first group (looped-bfs), two groups where m allows
    ("plain", "layered", "gpt-tiny", 4, 1, 4, ["--pipeline-model-parallel-size", "2",
                                               "--num-layers-per-virtual-pipeline-stage", "1",
                                               "--breadth-first-microbatches", "2"]),  # dp 3, 2 groups
    ("zero1", "layered", "llama-tiny", 6, 1, 6, ["--pipeline-model-parallel-size", "3",
                                                 "--num-layers-per-virtual-pipeline-stage", "1",
                                                 "--breadth-first-microbatches", "3"]),  # dp 2, 2 groups
    ("zero3", "layered", "gpt-tiny", 4, 1, 3, ["--pipeline-model-parallel-size", "2",
                                               "--num-layers-per-virtual-pipeline-stage", "1"]),  # dp 3, m 3, v 2
]


def _layout_flags(reduction, extra):
    if reduction == "overlap":
        return extra + ["--overlap-grad-reduce"]
    if reduction == "layered":
        return extra + ["--pipeline-schedule", "looped-bfs", "--layered-grad-accumulation"]
    return extra


def _dp(extra):
    def size(flag):
        return int(extra[extra.index(flag) + 1]) if flag in extra else 1
    return WORLD // (size("--tensor-model-parallel-size") * size("--pipeline-model-parallel-size"))


@pytest.mark.parametrize("case", MATRIX, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}-L{c[3]}-m{c[5]}-dp{_dp(c[6])}")
def test_three_steps_match_single_process(case):
    optimizer, reduction, preset, layers, mbs, m, extra = case
    flags = OPTIMIZERS[optimizer] + _layout_flags(reduction, extra)
    check_against_reference(preset, layers, mbs, mbs * m * _dp(extra), flags)


# Combinations the validator refuses, at the same world size: the refusal names the flags that clash.
REFUSED = [
    (OPTIMIZERS["zero3"] + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "po-f",
                            "--num-layers-per-virtual-pipeline-stage", "1"],
     ["--data-parallel-sharding-strategy optim_grads_params", "--pipeline-schedule po-f"]),
    # At p = 2 BPipe's default bound parks nothing; with a bound of 1 rank 0 parks on rank 1.
    (OPTIMIZERS["zero3"] + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "bpipe",
                            "--bpipe-max-resident", "1"],
     ["--data-parallel-sharding-strategy optim_grads_params", "peer parking", "--pipeline-schedule bpipe"]),
    # 1f1b offloads on ranks 0..p-3 only, so at p = 2 --offload-chunks moves nothing; gis offloads everywhere.
    (OPTIMIZERS["zero3"] + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "gis",
                            "--num-layers-per-virtual-pipeline-stage", "1", "--offload-chunks", "1"],
     ["--data-parallel-sharding-strategy optim_grads_params", "host offload", "--offload-chunks 1"]),
    (OPTIMIZERS["zero1"] + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw"],
     ["--pipeline-schedule 2bw", "--use-distributed-optimizer"]),
    (OPTIMIZERS["zero3"] + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw"],
     ["--pipeline-schedule 2bw", "--data-parallel-sharding-strategy optim_grads_params"]),
    (["--pipeline-model-parallel-size", "2", "--layered-grad-accumulation"],  # layered needs looped-bfs
     ["--layered-grad-accumulation", "--pipeline-schedule 1f1b"]),
]


@pytest.mark.parametrize("flags,names", REFUSED, ids=["zero3-po-f", "zero3-bpipe", "zero3-offload", "zero1-2bw",
                                                     "zero3-2bw", "layered-1f1b"])
def test_refused_combinations_name_their_flags(monkeypatch, flags, names):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(WORLD))
    errors = validate_args(build_parser().parse_args(_argv("gpt-tiny", 4, 1, 3 * 2, flags)))
    assert len(errors) == 1 and all(name in errors[0] for name in names), errors


# One step, every gradient tensor (the central test's criterion) at the same odd sizes: the executor's
# own reduction at dp 3 and pp 3, and the optimizer's reducer with layered accumulation in two
# breadth-first groups at dp 3 for each sharding strategy.
ONE_STEP = [  # (preset, layers, tp, pp, schedule, m, v, sequence parallel, layout)
    ("gpt-tiny", 5, 1, 2, "1f1b", 3, 1, False, {"first_stage_layers": 2}),  # dp 3
    ("llama-tiny", 4, 2, 1, "1f1b", 2, 1, True, {}),  # tp 2 x dp 3
    ("gpt-tiny", 4, 1, 3, "gpipe", 4, 1, False, {"last_stage_layers": 2}),  # pp 3 x dp 2, m 4
    ("llama-tiny", 6, 1, 3, "interleaved-1f1b", 3, 2, False, {}),  # pp 3 x dp 2, v 2
]


@pytest.mark.parametrize("case", ONE_STEP, ids=lambda c: f"{c[0]}-L{c[1]}-tp{c[2]}-pp{c[3]}-{c[4]}-m{c[5]}-v{c[6]}")
def test_one_step_gradients_at_odd_sizes(case):
    from tests.schedules.test_exactness import MICRO_BATCH, _reference_cached, check, pipeline_run

    preset, layers, tp, pp, name, m, v, sp, layout = case
    results = run_distributed(WORLD, pipeline_run, preset, layers, tp, pp, name, m, v, sp, None, layout)
    ref_loss, ref_grads = _reference_cached(preset, layers, MICRO_BATCH * m * WORLD // (tp * pp))
    check(results, ref_loss, ref_grads, case)


@pytest.mark.parametrize("sharding", ["no_shard", "optim", "optim_grads_params"])
def test_one_step_layered_gradients_at_dp3(sharding):
    from tests.schedules.test_exactness import MICRO_BATCH, _reference_cached, check, looped_run

    pp, v, m, layers = 2, 2, 4, 4
    options = {"breadth_first_microbatches": 2, "layered_grad_accumulation": True}  # two groups
    results = run_distributed(WORLD, looped_run, "gpt-tiny", layers, pp, m, v, options, sharding)
    ref_loss, ref_grads = _reference_cached("gpt-tiny", layers, MICRO_BATCH * m * WORLD // pp)
    check(results, ref_loss, ref_grads, (sharding, "dp3"))


@pytest.mark.parametrize("optimizer", ["zero1", "zero3"])
def test_resume_at_dp3_continues_exactly(tmp_path, optimizer):
    """What a checkpoint carries across steps: 2 steps, save, exit, resume for the third equals 3 straight
    steps bit for bit, with the optimizer state in shards that cut parameters unevenly (dp 3)."""
    flags = OPTIMIZERS[optimizer] + ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers",
                                     "2", "--overlap-grad-reduce"]
    argv = _argv("gpt-tiny", 5, 1, 9, flags)
    straight = run_distributed(WORLD, _train, argv, BUCKET_BYTES)[0]
    ck = str(tmp_path / "ck")
    first = run_distributed(WORLD, _train, argv + ["--save", ck, "--exit-interval", "2"], BUCKET_BYTES)[0]
    resumed = run_distributed(WORLD, _train, argv + ["--load", ck], BUCKET_BYTES)[0]
    assert first + resumed == straight
