"""PipeDream-2BW end to end: `pretrain --pipeline-schedule 2bw` against a single-process reference of
W(t+1) = W(t) − lr·u(g(W(t−1))), both weight versions in the checkpoint, at most two versions in memory,
the combinations of the compatibility matrix, mixed precision and loss scaling, and an executed trace that
overlaps steps. Checkpoints and early exits: test_2bw_resume.py.

The reference runs in this process: the whole model, every microbatch of batch t evaluated on the older
weights W(t−1) (W(−1) = W(0)), the summed gradient clipped by its global norm and applied by one torch
optimizer to the newest weights W(t). The pipelined runs save a checkpoint at the end, whose model files
(newest version) and rank files (older version) are compared tensor by tensor.
"""
from __future__ import annotations

import json
import math
from unittest import mock

import pytest
import torch

from megatron_pp.models.layout import split_layers
from megatron_pp.models.transformer import StageModel, build_model
from megatron_pp.training.arguments import build_parser, derive_args, model_config_from_args, parse_args
from megatron_pp.training.checkpointing import iteration_dir, model_file, rank_file
from megatron_pp.training.train import MockSplit, pretrain
from megatron_pp.training.weight_versions import WeightVersions
from tests.dist import run_distributed

MICRO_BATCH = 2
STEPS = 4
CLIP = 1.0
# Tolerances of the pipeline against the single-process reference (fp32, different summation orders).
LOSS_RTOL = 1e-5
MODEL_RTOL = 1e-5
"""Relative distance of the whole model's weights (all tensors as one vector)."""
TENSOR_RTOL = 2e-4
"""Per tensor. Loose for one reason: the gradient of the attention's key bias is zero in exact arithmetic
(softmax ignores a shift shared by all keys), so both runs hold rounding noise there, which Adam turns
into updates of full size; every other tensor agrees to about 1e-7."""


def _argv(preset: str, pp: int, m: int, optimizer: str, extra: tuple[str, ...] = (), dp: int = 1) -> list[str]:
    return ["--model-preset", preset, "--mock-data", "--micro-batch-size", str(MICRO_BATCH),
            "--global-batch-size", str(MICRO_BATCH * m * dp), "--seed", "11",
            "--lr", "2e-3" if optimizer == "adam" else "0.2",
            "--optimizer", optimizer, "--weight-decay", "0.01", "--clip-grad", str(CLIP),
            "--train-iters", str(STEPS), "--pipeline-model-parallel-size", str(pp),
            "--pipeline-schedule", "2bw", *extra]


def _train(ctx, argv: list[str], pp: int) -> dict:
    """Worker: train, and report this rank's weight versions (peak in use, versions held at the end)."""
    made: list[WeightVersions] = []
    original = WeightVersions.__init__

    def recording(self, chunks):
        original(self, chunks)
        made.append(self)

    with mock.patch.object(WeightVersions, "__init__", recording):
        rows = pretrain(parse_args(argv), state=ctx.parallel_state(1, pp))
    return {"rows": rows, "peak_versions": made[0].peak_versions_in_use, "held": sorted(made[0].held)}


def _single_process_args(argv: list[str]):
    """The run's arguments on one process: no parallelism (the last occurrence of a flag wins)."""
    single = [a for a in argv if a != "--sequence-parallel"]
    return parse_args(single + ["--pipeline-model-parallel-size", "1", "--tensor-model-parallel-size", "1"])


def reference(argv: list[str], delayed: bool = True) -> tuple[list[float], list[float], dict, dict]:
    """(losses, grad norms, newest weights, older weights) of a single process applying 2BW's update
    (`delayed`) or the plain one (what 1F1B computes)."""
    args = _single_process_args(argv)
    config = model_config_from_args(args)
    model = build_model(config, seed=args.seed)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    groups = [{"params": [p for p in params if p.dim() > 1]},
              {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}]
    if args.optimizer == "sgd":
        opt = torch.optim.SGD(groups, lr=args.lr, momentum=args.sgd_momentum, weight_decay=args.weight_decay,
                              foreach=True)
    else:
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
                                weight_decay=args.weight_decay, foreach=True)
    split = MockSplit(args.seed, config.seq_length, config.vocab_size)
    b, batch_size = args.micro_batch_size, args.global_batch_size
    older = [p.detach().clone() for p in params]
    losses, norms = [], []
    for t in range(args.train_iters):
        newest = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, w in zip(params, older if delayed else newest):
                p.copy_(w)
        batches = [split.get_batch(range(t * batch_size + j, t * batch_size + j + b))
                   for j in range(0, batch_size, b)]
        tokens = sum(float(mb["loss_mask"].sum()) for mb in batches)
        for p in params:
            p.grad = None
        loss = 0.0
        for mb in batches:
            part = (model(None, mb).float() * mb["loss_mask"]).sum() / tokens
            part.backward()
            loss += float(part.detach())
        losses.append(loss)
        grads = [p.grad.detach().clone() for p in params]
        norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
        norms.append(norm)
        if args.clip_grad > 0 and norm > args.clip_grad:
            for g in grads:
                g.mul_(args.clip_grad / (norm + 1e-6))
        with torch.no_grad():
            for p, w, g in zip(params, newest, grads):
                p.copy_(w)
                p.grad = g
        opt.step()
        older = newest
    return (losses, norms, {n: p.detach().clone() for n, p in named},
            {n: w for (n, _), w in zip(named, older)})


def checkpoint_weights(root, argv: list[str], pp: int, iteration: int) -> tuple[dict, dict]:
    """(newest, older) weights of the whole model from a 2BW checkpoint, by parameter name."""
    args = _single_process_args(argv)
    config = model_config_from_args(args)
    directory = iteration_dir(str(root), iteration)
    newest, older = {}, {}
    for stage, spec in enumerate(split_layers(config.num_layers, pp)):
        saved = torch.load(f"{directory}/{model_file(stage, 0)}", weights_only=True)["model"]
        names = [n for n, p in StageModel(config, spec, seed=args.seed).named_parameters() if p.requires_grad]
        newest.update({n: saved[n] for n in names})
        state = torch.load(f"{directory}/{rank_file(stage, 0, 0)}", weights_only=True)["schedule_state"]
        assert state["two_bw"]["next_batch"] == iteration
        older.update(zip(names, state["two_bw"]["older_weights"]))
    return newest, older


def relative_errors(got: dict, want: dict) -> dict:
    assert set(got) == set(want)
    return {n: float((got[n] - want[n]).norm() / want[n].norm()) for n in want}


def model_error(got: dict, want: dict) -> float:
    diff = sum(float((got[n] - want[n]).double().square().sum()) for n in want)
    return math.sqrt(diff / sum(float(w.double().square().sum()) for w in want.values()))


def assert_close(got: dict, want: dict) -> None:
    errors = relative_errors(got, want)
    assert max(errors.values()) <= TENSOR_RTOL, sorted(errors.items(), key=lambda e: -e[1])[:3]
    assert model_error(got, want) <= MODEL_RTOL


SEMANTICS = [  # (preset, pp, m, optimizer): pp 2 and 4, m = p and 2p, SGD and AdamW at each pp
    ("gpt-tiny", 2, 2, "sgd"),
    ("gpt-tiny", 2, 4, "adam"),
    ("llama-tiny", 4, 4, "adam"),
    ("gpt-tiny", 4, 8, "sgd"),
]


@pytest.mark.parametrize("case", SEMANTICS, ids=lambda c: f"{c[0]}-pp{c[1]}-m{c[2]}-{c[3]}")
def test_weights_follow_the_delayed_update(case, tmp_path):
    preset, pp, m, optimizer = case
    argv = _argv(preset, pp, m, optimizer, ("--save", str(tmp_path)))
    results = run_distributed(pp, _train, argv, pp)
    rows = results[0]["rows"]
    ref_losses, ref_norms, ref_newest, ref_older = reference(argv)
    assert [r["iteration"] for r in rows] == list(range(1, STEPS + 1))
    for row, loss, norm in zip(rows, ref_losses, ref_norms):
        assert abs(row["loss"] - loss) <= LOSS_RTOL * loss, (row, loss)
        assert abs(row["grad_norm"] - norm) <= LOSS_RTOL * norm, (row, norm)
        assert not row["skipped"]
    assert max(ref_norms) > CLIP  # clipping by the global norm (every stage's share) took part
    newest, older = checkpoint_weights(tmp_path, argv, pp, STEPS)
    assert_close(newest, ref_newest)
    assert_close(older, ref_older)
    # The plain update (1F1B's semantics, exact in tests/schedules/test_exactness.py) lands elsewhere.
    _, _, plain, _ = reference(argv, delayed=False)
    assert model_error(newest, plain) > 100 * MODEL_RTOL
    # Two versions in use at once on every rank that runs forwards of the next batch before its last
    # backward of the current one (all but the last); two buffers holding the last two versions.
    assert [r["peak_versions"] for r in results] == [2] * (pp - 1) + [1]
    assert all(r["held"] == [STEPS, STEPS + 1] for r in results)


def test_one_stage_applies_the_same_delayed_update(tmp_path):
    """pp=1 is legal and runs the same update, so 2BW at any depth equals 2BW on one stage."""
    argv = _argv("gpt-tiny", 1, 2, "adam", ("--save", str(tmp_path)))
    results = run_distributed(1, _train, argv, 1)
    ref_losses, _, ref_newest, _ = reference(argv)
    assert [r["loss"] for r in results[0]["rows"]] == pytest.approx(ref_losses, rel=LOSS_RTOL)
    newest, _ = checkpoint_weights(tmp_path, argv, 1, STEPS)
    assert_close(newest, ref_newest)


def _rows(ctx, argv: list[str], pp: int, tp: int = 1) -> list[dict]:
    return pretrain(parse_args(argv), state=ctx.parallel_state(tp, pp))


def _assert_rows_follow_reference(rows: list[dict], argv: list[str]) -> None:
    ref_losses, ref_norms, _, _ = reference(argv)
    assert [r["iteration"] for r in rows] == list(range(1, len(ref_losses) + 1))
    for row, loss, norm in zip(rows, ref_losses, ref_norms):
        assert abs(row["loss"] - loss) <= LOSS_RTOL * loss, (row, loss)
        assert abs(row["grad_norm"] - norm) <= LOSS_RTOL * norm, (row, norm)


# (id, tp, pp, dp, m, optimizer, flags): the compatibility matrix's cells in docs/schedules.md.
COMBINATIONS = [
    ("tp2", 2, 2, 1, 4, "adam", ("--tensor-model-parallel-size", "2")),
    ("tp2-sequence-parallel", 2, 2, 1, 2, "sgd", ("--tensor-model-parallel-size", "2", "--sequence-parallel")),
    ("dp2-overlap", 1, 2, 2, 2, "adam", ("--overlap-grad-reduce",)),
    ("recompute", 1, 2, 1, 2, "adam", ("--recompute-granularity", "full", "--recompute-method", "uniform",
                                        "--recompute-num-layers", "1")),
    ("odd-m", 1, 2, 1, 3, "sgd", ()),
]


@pytest.mark.parametrize("case", COMBINATIONS, ids=lambda c: c[0])
def test_combinations_follow_the_reference(case):
    """Losses and global gradient norms of every step equal the single-process 2BW reference (recompute
    reruns the forward in the backward: it must find the forward's weight version too)."""
    _, tp, pp, dp, m, optimizer, flags = case
    argv = _argv("gpt-tiny", pp, m, optimizer, flags, dp=dp)
    rows = run_distributed(tp * pp * dp, _rows, argv, pp, tp)[0]
    _assert_rows_follow_reference(rows, argv)


def _rows_unvalidated(ctx, argv: list[str], pp: int) -> list[dict]:
    return pretrain(derive_args(build_parser().parse_args(argv)), state=ctx.parallel_state(1, pp))


def test_distributed_optimizer_is_refused(capsys):
    argv = _argv("gpt-tiny", 2, 2, "adam", ("--use-distributed-optimizer",), dp=2)
    with pytest.raises(SystemExit):  # at start-up, by the argument check
        parse_args(argv)
    assert "--use-distributed-optimizer is not supported with it" in capsys.readouterr().err
    # And by the optimizer itself, for a program that builds the job without the argument check.
    with pytest.raises(AssertionError, match="--use-distributed-optimizer is not supported with it"):
        run_distributed(4, _rows_unvalidated, argv, 2)


def test_sample_based_lr_schedule_gives_each_update_the_plain_schedules_lr():
    """With --train-samples the LR is a function of the samples consumed once the batch is in: 2BW, whose
    update of batch t runs after batch t+1 has started, must still use batch t's position."""
    samples = ["--train-samples", "24", "--lr-warmup-samples", "8", "--lr-decay-samples", "24",
               "--lr-decay-style", "linear", "--min-lr", "0"]
    argv = _argv("gpt-tiny", 1, 2, "sgd")
    at = argv.index("--train-iters")
    argv = argv[:at] + argv[at + 2:] + samples
    two_bw = run_distributed(1, _rows, argv, 1)[0]
    plain = run_distributed(1, _rows, argv + ["--pipeline-schedule", "1f1b"], 1)[0]
    lrs = [r["lr"] for r in two_bw]
    assert len(lrs) == 6 and all(a != b for a, b in zip(lrs, lrs[1:]))  # warm-up then decay: no LR repeats
    assert lrs == [r["lr"] for r in plain]


# Mixed precision and loss scaling ----------------------------------------------------------------------------


def test_bf16_tracks_fp32():
    fp32 = _argv("gpt-tiny", 2, 4, "adam")
    rows32 = run_distributed(2, _rows, fp32, 2)[0]
    rows16 = run_distributed(2, _rows, fp32 + ["--bf16"], 2)[0]
    for a, b in zip(rows32, rows16):
        assert abs(a["loss"] - b["loss"]) <= 1e-2 * a["loss"], (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 0.05 * a["grad_norm"], (a, b)


def test_fp16_overflow_skips_the_update_on_every_stage(tmp_path):
    """A loss scale too large for fp16 overflows the gradients: the inf check of the deferred update sees it
    on every stage, the step is skipped (the new version is a copy of the newest), the scale is halved
    (hysteresis 1) and training goes on with finite weights. The scale an overflow sets reaches the batch
    after next (batch t's loss is scaled before batch t−1's update has run), so 2BW overflows once more
    than 1F1B: batch t runs at 2^20 / 2^(t−1) where 1F1B's runs at 2^20 / 2^t."""
    flags = ("--fp16", "--initial-loss-scale", str(2.0**20), "--hysteresis", "1", "--train-iters", "6")
    argv = _argv("gpt-tiny", 2, 2, "adam", (*flags, "--save", str(tmp_path)))
    rows = run_distributed(2, _rows, argv, 2)[0]
    flush_argv = _argv("gpt-tiny", 2, 2, "adam", flags) + ["--pipeline-schedule", "1f1b"]
    flush_rows = run_distributed(2, _rows, flush_argv, 2)[0]
    flush_skips = [r["skipped"] for r in flush_rows].index(False)
    assert flush_skips >= 1
    skipped = [r["skipped"] for r in rows]
    assert skipped == [True] * (flush_skips + 1) + [False] * (6 - flush_skips - 1)
    # The scale after each update: halved per overflow, then kept.
    assert [r["loss_scale"] for r in rows] == [2.0**(19 - min(t, flush_skips)) for t in range(6)]
    assert all(math.isinf(r["grad_norm"]) for r in rows if r["skipped"])
    assert all(math.isfinite(r["grad_norm"]) for r in rows if not r["skipped"])
    assert all(math.isfinite(r["loss"]) for r in rows)
    newest, older = checkpoint_weights(tmp_path, argv, 2, 6)
    assert all(torch.isfinite(w).all() for w in [*newest.values(), *older.values()])


# What runs: steps overlap --------------------------------------------------------------------------------------


def test_executed_trace_overlaps_consecutive_steps(tmp_path):
    """In the executed trace every rank runs the first p−s−1 forwards of batch t+1 before its own last
    backward of batch t: no rank drains between steps. Only same-rank times are compared: each rank's
    trace clock starts at its own step start, so timestamps of different ranks are not comparable."""
    pp, m, steps = 4, 4, 4
    trace = tmp_path / "trace.json"
    argv = _argv("gpt-tiny", pp, m, "sgd", ("--train-iters", str(steps), "--trace-file", str(trace)))
    run_distributed(pp, _rows, argv, pp)
    events = json.loads(trace.read_text())["traceEvents"]
    by_name = {(e["pid"], e["name"]): e for e in events}
    for t in range(steps - 1):
        for rank in range(pp):
            last_backward = by_name[(rank, f"B{t * m + m - 1}.0@{t}")]
            early = [by_name[(rank, f"F{(t + 1) * m + i}.0@{t + 1}")] for i in range(pp - 1 - rank)]
            assert all(e["ts"] + e["dur"] <= last_backward["ts"] for e in early), (t, rank)
    # And the deferred update of batch t ran on stage 0 between them (STEP@(t+2)), after batch t+1 began.
    for t in range(steps - 2):
        step = by_name[(0, f"STEP@{t + 2}")]
        assert by_name[(0, f"F{(t + 1) * m}.0@{t + 1}")]["ts"] < step["ts"]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_each_figure_of_the_metrics_sum_is_contributed_once(monkeypatch, device):
    """2BW sums one vector over the world: the loss once per data-parallel replica (tensor-parallel rank 0
    of the last stage), each stage's peaks once (tensor- and data-parallel rank 0's), the exit flags from
    every rank. Checked for every rank of tp 3 x dp 3 x pp 2 with the collective stood in for; each rank
    reports its own peaks, so the sum shows whose arrived."""
    from types import SimpleNamespace

    from megatron_pp.training import twobw

    sent = []
    monkeypatch.setattr(twobw.comm, "all_reduce_async",
                        lambda values: sent.append(values) or SimpleNamespace(result=lambda: values))
    steps = twobw.DeferredUpdateSteps.__new__(twobw.DeferredUpdateSteps)
    total = torch.zeros(3 + 2 * 2, dtype=torch.float64)
    for tp_rank in range(3):
        for dp_rank in range(3):
            for pp_rank in range(2):
                rank_figure = 100 + pp_rank + 10 * tp_rank + 1000 * dp_rank
                monkeypatch.setattr(twobw, "take_peak_memory", lambda dev, figure=rank_figure: 4 * figure)
                state = SimpleNamespace(pp_size=2, pp_rank=pp_rank, tp_rank=tp_rank, dp_rank=dp_rank,
                                        device=torch.device(device))
                steps.trainer = SimpleNamespace(state=state)
                # Tensor-parallel ranks hold the same loss; replicas differ.
                result = SimpleNamespace(loss_sum=torch.tensor(6.0 * (dp_rank + 1)) if pp_rank == 1 else None,
                                         peak_stash_bytes=rank_figure)
                flags = SimpleNamespace(local_flags=lambda: (tp_rank == 1 and dp_rank == 2, False))
                steps._start_metrics(result, flags)
                total += sent[-1]
    memory = [400.0, 404.0] if device == "cuda" else [0.0, 0.0]
    assert total.tolist() == [6.0 + 12.0 + 18.0, 2.0, 0.0, 100.0, 101.0, *memory]
