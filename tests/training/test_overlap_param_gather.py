"""--overlap-param-gather with the distributed optimizer (`ShardedMainParams.overlap_param_gather`): the update's
all-gathers are left in flight, each chunk's finished by its first forward of the next step, and everything
else that reads the weights waits for all of them.

At pp 2 x dp 2 (fp32, Adam, clipping, small gradient buckets: several per chunk) under 1F1B, interleaved 1F1B, PO-H
(host offload of each rank's first chunk), ZB-V (split backward; rank 0's two chunks share the tied embedding) and
looped BFS with layered gradient accumulation, and at tp 2 x dp 2 with --overlap-grad-reduce, a run with the flag
gives the losses, gradient norms, validation losses and checkpointed weights of the same run without it, bit for
bit, and the single process's losses and norms (1e-5). Recorders on every rank see the gathers in flight when each
step after the first begins, each chunk's buckets in place before that chunk's first forward (and, with two chunks
per rank, the second chunk's still in flight at the first chunk's first forward), none in flight at a checkpoint,
at the first forward of an evaluation, or when training ends.
"""
from __future__ import annotations

import os

import pytest
import torch

from megatron_pp.training.arguments import build_parser, validate_args
from tests.dist import run_distributed
from tests.training.test_exactness_edges import BUCKET_BYTES, ITERS, TOL, _argv, reference

LAYERS, GBS = 4, 8  # dp 2, micro-batch 1: 4 microbatches per replica
COMMON = ["--use-distributed-optimizer", "--eval-interval", "2", "--eval-iters", "1", "--save-interval", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
CASES = {  # name: (flags, chunks per rank)
    "1f1b": (PP2 + ["--pipeline-schedule", "1f1b"], 1),
    "interleaved-1f1b": (PP2 + ["--pipeline-schedule", "interleaved-1f1b",
                                "--num-layers-per-virtual-pipeline-stage", "1"], 2),
    "po-h": (PP2 + ["--pipeline-schedule", "po-h", "--num-layers-per-virtual-pipeline-stage", "1"], 2),
    "zb-v": (PP2 + ["--pipeline-schedule", "zb-v"], 2),  # rank 0 holds both ends: the tied embedding in both chunks
    "looped-bfs-layered": (PP2 + ["--pipeline-schedule", "looped-bfs", "--num-layers-per-virtual-pipeline-stage", "1",
                                  "--layered-grad-accumulation"], 2),
    # tp 2 (two data-parallel groups, so two gather groups) with the overlapped reduction Megatron-LM requires
    "tp2-overlap-grad-reduce": (["--tensor-model-parallel-size", "2", "--overlap-grad-reduce"], 1),
}


def _run(ctx, argv, bucket_bytes):
    """pretrain with recorders: a marker when each training step begins and when an evaluation begins, one
    event per chunk forward and per checkpoint save, each with the buckets whose gathers are in flight."""
    import megatron_pp.training.train as train_module
    import megatron_pp.training.trainer as trainer_module
    from megatron_pp.training.arguments import parse_args

    events: list = []
    found: dict = {}
    originals = (train_module.connect_param_gather, trainer_module.train_step, trainer_module.save_checkpoint,
                 trainer_module.Trainer.evaluate)

    def in_flight():
        return sorted(found["main"].gathers_in_flight) if "main" in found else []

    def connect(args, pipe, optimizer):
        connected = originals[0](args, pipe, optimizer)
        found["main"], found["connected"] = optimizer.main, connected
        for c, chunk in enumerate(pipe.chunks):  # after the overlap's own pre-hook, so it sees what that left
            chunk.register_forward_pre_hook(lambda module, inputs, c=c: events.append(("F", c, in_flight())))
        return connected

    def step(pipe, microbatches, optimizer=None):
        events.append(("step", None, in_flight()))
        return originals[1](pipe, microbatches, optimizer)

    def save(*a, **k):
        events.append(("save", None, in_flight()))
        return originals[2](*a, **k)

    def evaluate(self, *a, **k):
        events.append(("eval", None, in_flight()))
        return originals[3](self, *a, **k)

    train_module.connect_param_gather, trainer_module.train_step = connect, step
    trainer_module.save_checkpoint, trainer_module.Trainer.evaluate = save, evaluate
    try:
        args = parse_args(argv)
        args.bucket_bytes = bucket_bytes
        state = ctx.parallel_state(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
        rows = train_module.pretrain(args, state=state)
    finally:
        (train_module.connect_param_gather, trainer_module.train_step, trainer_module.save_checkpoint,
         trainer_module.Trainer.evaluate) = originals
    main = found["main"]
    chunk_buckets = main._chunk_buckets if found["connected"] else None
    return {"rows": rows, "events": events, "chunk_buckets": chunk_buckets, "connected": found["connected"],
            "buckets": len(main.reducer.buckets), "left": sorted(main.gathers_in_flight)}


def _tensors(value, name=""):
    if isinstance(value, torch.Tensor):
        return {name: value}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    return {k: t for key, v in items for k, t in _tensors(v, f"{name}/{key}").items()}


def _weights(directory):
    """Every tensor of the checkpoint's model files, by file and key."""
    files = sorted(f for f in os.listdir(directory) if f.startswith("model_"))
    assert files
    return {f"{f}{k}": t for f in files for k, t in _tensors(torch.load(os.path.join(directory, f),
                                                                          weights_only=True)).items()}


def _check_recorded(result, chunks):
    """The order of waits on one rank (see the module docstring)."""
    events, chunk_buckets, every = result["events"], result["chunk_buckets"], list(range(result["buckets"]))
    assert result["connected"] and len(chunk_buckets) == chunks and result["left"] == []
    steps = [i for i, e in enumerate(events) if e[0] == "step"]
    assert len(steps) == ITERS and events[steps[0]][2] == []  # nothing to gather before the first update
    overlapped = 0
    for before, i in zip(steps, steps[1:]):
        if any(e[0] in ("eval", "save") for e in events[before:i]):  # they waited for everything
            assert events[i][2] == []
            continue
        overlapped += 1
        assert events[i][2] == every, "the update's gathers are in flight when the next step begins"
        first_forward = {}
        for kind, c, pending in events[i + 1:]:
            if kind != "F":
                break
            first_forward.setdefault(c, pending)
        assert sorted(first_forward) == list(range(chunks))
        for c, pending in first_forward.items():
            assert not set(pending) & set(chunk_buckets[c]), f"chunk {c}'s first forward ran on stale weights"
        if chunks > 1:
            later = set(chunk_buckets[1]) - set(chunk_buckets[0])
            assert later and later <= set(first_forward[0]), "the second chunk's gathers overlap the first's forwards"
    assert overlapped
    saves = [e for e in events if e[0] == "save"]
    assert saves and all(pending == [] for _, _, pending in saves)
    for i, event in enumerate(events):
        if event[0] == "eval":
            assert events[i + 1][0] == "F" and events[i + 1][2] == [], "an evaluation reads gathered weights"


@pytest.mark.parametrize("name", sorted(CASES))
def test_overlapped_gather_trains_as_without_it_and_waits_where_it_must(tmp_path, name):
    flags, chunks = CASES[name]
    argv = _argv("gpt-tiny", LAYERS, 1, GBS, COMMON + flags)
    plain = run_distributed(4, _run, argv + ["--save", str(tmp_path / "plain")], BUCKET_BYTES)
    overlapped = run_distributed(4, _run, argv + ["--save", str(tmp_path / "overlap"), "--overlap-param-gather"],
                                 BUCKET_BYTES)
    assert not any(r["connected"] for r in plain)
    for result in overlapped:
        _check_recorded(result, chunks)
    rows = overlapped[0]["rows"]
    keys = ("iteration", "consumed_samples", "loss", "grad_norm", "lr", "eval_loss", "eval_tokens")
    assert [[r.get(k) for k in keys] for r in rows] == [[r.get(k) for k in keys] for r in plain[0]["rows"]]
    train = [r for r in rows if "grad_norm" in r]
    assert len(train) == ITERS and len(rows) > ITERS  # and the evaluations
    for row, (ref_loss, ref_norm) in zip(train, reference("gpt-tiny", LAYERS, GBS)):
        assert row["loss"] == pytest.approx(ref_loss, rel=TOL) and row["grad_norm"] == pytest.approx(ref_norm, rel=TOL)
    for iteration in ("iter_0000002", "iter_0000003"):
        mine, theirs = (_weights(str(tmp_path / run / iteration)) for run in ("overlap", "plain"))
        assert mine.keys() == theirs.keys() and len(mine) > 4
        for key in mine:
            assert torch.equal(mine[key], theirs[key]), (iteration, key)


def test_overlap_param_gather_needs_the_distributed_optimizer():
    argv = ["--model-preset", "gpt-tiny", "--mock-data", "--global-batch-size", "4", "--train-iters", "2",
            "--overlap-param-gather"]
    errors = validate_args(build_parser().parse_args(argv), world_size=2)
    assert errors == ["--overlap-param-gather needs --use-distributed-optimizer (as in Megatron-LM): only its "
                      "parameter all-gather can be overlapped"]
    assert validate_args(build_parser().parse_args(argv + ["--use-distributed-optimizer"]), world_size=2) == []


def test_a_run_without_checkpoints_or_evaluation_ends_with_nothing_in_flight():
    """The last update's gathers are finished when training ends even where no final checkpoint or evaluation
    waits for them (no --save, no evaluation): the model holds the updated weights and no collective is left
    pending at teardown. The cases above always end with a save and an evaluation, which wait anyway."""
    argv = _argv("gpt-tiny", LAYERS, 1, GBS, ["--use-distributed-optimizer", "--eval-iters", "0", "--overlap-param-gather"]
                 + CASES["1f1b"][0])
    for result in run_distributed(4, _run, argv, BUCKET_BYTES):
        assert result["connected"] and not any(kind in ("eval", "save") for kind, _, _ in result["events"])
        assert sum(kind == "step" for kind, _, _ in result["events"]) == ITERS
        assert result["left"] == [], "the last update's gathers are still in flight after training"
