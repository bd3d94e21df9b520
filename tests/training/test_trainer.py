"""The training loop's bookkeeping (`training.trainer`): which iterations save and evaluate, what a resume
continues from, the numbers of a metrics row, and the trace file. One process, gpt-tiny, mock data."""
from __future__ import annotations

import json
import os
import types

import pytest

from megatron_pp.training import trainer as trainer_module
from megatron_pp.training.arguments import parse_args
from megatron_pp.training.checkpointing import TRACKER_FILE, read_tracker
from megatron_pp.training.optimizer import LRSchedule
from megatron_pp.training.train import pretrain

SINGLE = ["--model-preset", "gpt-tiny", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4",
          "--seed", "5", "--lr", "1e-3"]
LR = ["--min-lr", "1e-4", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine"]


def _run(argv, capsys):
    args = parse_args(SINGLE + argv)
    rows = pretrain(args)
    out = capsys.readouterr().out
    return args, rows, out.splitlines()


def _saved(ck) -> list[str]:
    return sorted(name for name in os.listdir(ck) if name != TRACKER_FILE)


def _said(lines, prefix) -> list[str]:
    return [line for line in lines if line.startswith(prefix)]


def test_saves_evaluations_and_resumes_happen_at_their_iterations_once(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    common = ["--save", ck, "--save-interval", "2", "--eval-interval", "2", "--eval-iters", "1", *LR]
    args, rows, lines = _run(["--train-iters", "5", *common], capsys)
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    # Every interval, and at the end of training, each exactly once.
    assert _saved(ck) == ["iter_0000002", "iter_0000004", "iter_0000005"] and read_tracker(ck) == 5
    assert _said(lines, "saved checkpoint") == [f"saved checkpoint {ck}/iter_{i:07d}" for i in (2, 4, 5)]
    assert [r["iteration"] for r in evals] == [2, 4, 5]
    assert [(r["iteration"], r["consumed_samples"]) for r in train] == [(i, 4 * i) for i in range(1, 6)]
    assert [(r["iteration"], r["consumed_samples"]) for r in evals] == [(i, 4 * i) for i in (2, 4, 5)]
    # The row's figures: the schedule's learning rate at the position before the step (Megatron-LM's: its
    # first warm-up step runs at 0), the batch's tokens over the step time.
    schedule = LRSchedule.from_args(args)
    assert [r["lr"] for r in train] == [schedule.learning_rate(i - 1, 4 * (i - 1)) for i in range(1, 6)]
    assert train[0]["lr"] == 0.0 and train[1]["lr"] == pytest.approx(5e-4) and train[2]["lr"] == pytest.approx(1e-3)
    for r in train:
        assert r["global_batch_size"] == 4 and r["loss_scale"] == 1.0 and r["skipped"] is False
        assert r["tokens_per_s"] * r["step_time_s"] == pytest.approx(4 * 32)  # global batch x sequence length
        assert r["mfu"] is None and r["hfu"] is None

    # Resumed where it ended: nothing left to train and nothing saved again; the loaded model's validation
    # loss is reported (what an evaluation-only job asks for), the same figure the run ended with.
    before = {name: os.stat(os.path.join(ck, name)).st_mtime_ns for name in os.listdir(ck)}
    _, again, lines = _run(["--train-iters", "5", "--load", ck, *common], capsys)
    assert [(r["iteration"], r["eval_loss"]) for r in again] == [(5, evals[-1]["eval_loss"])]
    assert _said(lines, "saved checkpoint") == []
    assert _said(lines, "loaded checkpoint") == [f"loaded checkpoint {ck}/iter_0000005: iteration 5, "
                                                 "consumed samples 20"]
    assert {name: os.stat(os.path.join(ck, name)).st_mtime_ns for name in os.listdir(ck)} == before

    # Resumed and stopped by --exit-interval on a save iteration: one save, then the stop.
    longer, more, lines = _run(["--train-iters", "9", "--load", ck, "--exit-interval", "6", *common], capsys)
    assert [(r["iteration"], "loss" in r) for r in more] == [(6, True), (6, False)]
    # The decay length follows --train-iters (9 now): iteration 6 runs at the new schedule's rate after 5.
    assert more[0]["consumed_samples"] == 24 and more[0]["lr"] == LRSchedule.from_args(longer).learning_rate(5, 20)
    assert _said(lines, "saved checkpoint") == [f"saved checkpoint {ck}/iter_0000006"] and read_tracker(ck) == 6
    assert _said(lines, "exiting after iteration 6")

    # Stopped off the save interval: saved once at the stop, no evaluation owed at the end.
    _, last, lines = _run(["--train-iters", "9", "--load", ck, "--exit-interval", "7", *common], capsys)
    assert [(r["iteration"], "loss" in r) for r in last] == [(7, True)]
    assert _said(lines, "saved checkpoint") == [f"saved checkpoint {ck}/iter_0000007"] and read_tracker(ck) == 7


def test_a_finetune_saves_its_first_checkpoint_even_at_the_loaded_iteration(tmp_path, capsys):
    # --finetune starts from iteration 0 again: the loaded checkpoint's iteration is not "already saved".
    ck, tuned = str(tmp_path / "ck"), str(tmp_path / "tuned")
    _run(["--train-iters", "2", "--save", ck], capsys)
    _, rows, lines = _run(["--train-iters", "2", "--load", ck, "--finetune", "--save", tuned], capsys)
    assert [r["iteration"] for r in rows] == [1, 2]
    assert _saved(tuned) == ["iter_0000002"] and len(_said(lines, "saved checkpoint")) == 1


def test_hardware_flops_count_recomputed_forwards(capsys):
    _, plain, _ = _run(["--train-iters", "1", "--peak-tflops", "1e-3"], capsys)
    assert plain[0]["hfu"] == pytest.approx(plain[0]["mfu"])
    assert plain[0]["mfu"] == pytest.approx(plain[0]["tflops_per_gpu"] / 1e-3)
    _, full, _ = _run(["--train-iters", "1", "--peak-tflops", "1e-3", "--recompute-granularity", "full",
                       "--recompute-method", "uniform"], capsys)
    # Full recompute re-runs each layer's forward: 4 passes where the model counts 3 (plus the head).
    assert 1.2 < full[0]["hfu"] / full[0]["mfu"] < 4 / 3 + 1e-9


def test_newest_checkpoint_names_what_a_restart_would_load(tmp_path):
    newest = trainer_module._newest_checkpoint
    assert newest(None) == "none (no --save)" and newest("") == "none (no --save)"
    assert newest(str(tmp_path)) == f"none in {tmp_path}"
    (tmp_path / TRACKER_FILE).write_text("3")
    assert newest(str(tmp_path)) == f"iteration 3 in {tmp_path}"
    (tmp_path / TRACKER_FILE).write_text("garbage")  # unreadable tracker: nothing a restart could load
    assert newest(str(tmp_path)) == f"none in {tmp_path}"


def test_trace_file_holds_every_rank_on_one_time_origin(tmp_path):
    path = tmp_path / "trace.json"
    # The executor's labels: an action, a batch of communication actions, a wait nested in a compute.
    events = [[("F0", 10.0, 10.5), ("B0.1", 10.5, 11.5)],
              [("RECV_F0<0 SEND_B1<0", 10.25, 10.75), ("wait F1@1", 11.0, 11.25)]]
    trainer_module.write_trace(str(path), events, clock_notes={"clock": "test"})
    assert os.listdir(tmp_path) == ["trace.json"]  # written through a temporary file, renamed
    written = json.loads(path.read_text())
    assert written["displayTimeUnit"] == "ms" and written["otherData"] == {"clock": "test"}
    meta = [e for e in written["traceEvents"] if e["ph"] == "M"]
    assert meta == [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "rank 0"}},
        {"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}},
        {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "rank 1"}},
        {"name": "process_sort_index", "ph": "M", "pid": 1, "args": {"sort_index": 1}},
    ]
    slices = [(e["pid"], e["name"], e["cat"], e["ts"], e["dur"]) for e in written["traceEvents"] if e["ph"] == "X"]
    assert slices == [(0, "F0", "F", 0.0, 0.5e6), (0, "B0.1", "B", 0.5e6, 1e6),
                      (1, "RECV_F0<0 SEND_B1<0", "RECV_F", 0.25e6, 0.5e6), (1, "wait F1@1", "wait", 1e6, 0.25e6)]
    trainer_module.write_trace(str(path), [[], []])  # a rank without events: rows, and no error
    assert [e["ph"] for e in json.loads(path.read_text())["traceEvents"]] == ["M"] * 4


def test_local_events_move_step_relative_times_onto_the_rank_clock():
    result = types.SimpleNamespace(started=100.0, events=[("F0", 0.0, 0.5), ("B0", 0.5, 2.0)])
    assert trainer_module.local_events(result) == [("F0", 100.0, 100.5), ("B0", 100.5, 102.0)]


def _gc_events(monkeypatch):
    """Every garbage collection and every logged row, in order, with whether the collector was on."""
    import gc

    from megatron_pp.training.metrics import MetricsLogger

    events, collect = [], gc.collect
    train, evaluation = MetricsLogger.train, MetricsLogger.evaluation

    def counted(*a, **k):
        events.append("collect")
        return collect(*a, **k)

    monkeypatch.setattr(gc, "collect", counted)
    monkeypatch.setattr(MetricsLogger, "train",
                        lambda self, row: (events.append((row["iteration"], gc.isenabled())), train(self, row))[1])
    monkeypatch.setattr(MetricsLogger, "evaluation",
                        lambda self, row: (events.append(("eval", gc.isenabled())), evaluation(self, row))[1])
    return events


@pytest.mark.parametrize("flags,expected", [
    (["--manual-gc", "--manual-gc-interval", "2"],
     ["collect", (1, False), (2, False), "collect", "collect", ("eval", False), "collect", (3, False), (4, False),
      "collect", "collect", ("eval", False), "collect"]),
    (["--manual-gc", "--no-manual-gc-eval"],
     ["collect", (1, False), (2, False), ("eval", False), (3, False), (4, False), ("eval", False)]),
    ([], [(1, True), (2, True), ("eval", True), (3, True), (4, True), ("eval", True)]),
], ids=["interval-2", "no-eval", "off"])
def test_manual_gc_collects_at_iteration_boundaries_only(flags, expected, capsys, monkeypatch):
    """Megatron-LM's --manual-gc: the collector is off for the loop (no threshold collection can land inside a
    step on one rank) and collects before the first iteration, after every N-th and around each evaluation;
    the process gets its collector back when training ends."""
    import gc

    events = _gc_events(monkeypatch)
    assert gc.isenabled()
    _run(["--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1", *flags], capsys)
    assert events == expected
    assert gc.isenabled()


def test_a_negative_manual_gc_interval_is_one_line():
    from megatron_pp.training.arguments import build_parser, validate_args

    args = build_parser().parse_args(SINGLE + ["--train-iters", "1", "--manual-gc", "--manual-gc-interval", "-1"])
    assert validate_args(args, world_size=1) == [
        "--manual-gc-interval must be >= 0 (0: no collection between iterations), got -1"]
