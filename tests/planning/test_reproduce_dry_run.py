"""The dry-run figure beside the paper reproductions' memory cells (issue 33 item 6): a made-up
repro_dry_run JSON in, the cell's text out; a JSON the page does not show makes `--check` fail; a JSON of
another job reads as stale; the cell's job is the launch config's variant."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megatron_pp.core.tensor_parallel.random import RNGTracker
from megatron_pp.planning.papers import dry_run_cells
from megatron_pp.planning.papers.common import GIB, ROOT
from megatron_pp.planning.papers.dry_run_cells import CELLS, CellJob, DryRunCell, dry_run_text, job_flags
from megatron_pp.planning.reproduce import check_document

CELL = DryRunCell("made_up", "bpipe_gpt3_96b", "1f1b", "peak_bytes", "GiB")


def _job(planner_rank: int = 1) -> CellJob:
    return CellJob(CELL, ["--a", "1"], 8, tp=2, dp=1, planner_rank=planner_rank,
                   planner_bytes=[30 * GIB, 42 * GIB, 35 * GIB, 20 * GIB])


def _row(pipeline_rank: int, peak: float, tensor_rank: int = 0) -> dict:
    return {"rank": 2 * pipeline_rank + tensor_rank, "pipeline_rank": pipeline_rank, "tensor_rank": tensor_rank,
            "data_rank": 0, "peak_bytes": peak, "stash_peak_bytes": peak / 2}


def _record(*rows: dict, flags=("--a", "1"), world: int = 8) -> dict:
    return {"flags": list(flags), "world": world, "ranks": list(rows)}


def test_cell_text_reads_the_planners_worst_rank():
    text = dry_run_text(_record(_row(1, 40 * GIB), _row(0, 10 * GIB), _row(1, 99 * GIB, tensor_rank=1)), _job())
    assert text == "dry run 40.0 GiB (planner/dry run 1.050)"


def test_a_worse_rank_in_the_dry_run_is_named():
    text = dry_run_text(_record(_row(1, 40 * GIB), _row(2, 41.5 * GIB)), _job())
    assert text == ("dry run 40.0 GiB (planner/dry run 1.050); the dry run's worst of the ranks it ran is "
                    "pipeline rank 2, 41.5 GiB")


def test_stale_missing_and_absent_records_give_no_figure():
    assert "stale" in dry_run_text(_record(_row(1, GIB), flags=("--a", "2")), _job())
    assert "stale" in dry_run_text(_record(_row(1, GIB), world=16), _job())
    assert dry_run_text(_record(_row(0, GIB)), _job()) == \
        "dry run: pipeline rank 1 (the planner's worst) not in its JSON"
    assert dry_run_text(None, _job()).startswith("dry run: none recorded")


def test_stash_figure_in_gb():
    cell = DryRunCell("x", "pipeoffload_10.5b", "1f1b-i", "stash_peak_bytes", "GB", (("seq-length", 4096),))
    job = CellJob(cell, ["--a", "1"], 8, tp=1, dp=1, planner_rank=0, planner_bytes=[3e9])
    assert dry_run_text(_record(_row(0, 5e9)), job) == "dry run 2.5 GB (planner/dry run 1.200)"


def test_cell_job_is_the_launch_configs_variant():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from launch_config import load_config, variant_flags

    for cell in CELLS["bpipe"]:
        flags, world = job_flags(cell)
        config = load_config(os.path.join(ROOT, "launch", "configs", cell.config + ".yaml"))
        assert flags == variant_flags(config, cell.variant, "full", {"train-iters": 2})
        assert world == config.world_size


def test_check_fails_when_a_json_and_the_page_disagree(tmp_path, monkeypatch):
    """End to end through the BPipe predictor: a made-up JSON of the 96B 1f1b cell's own job is read into the
    cell; the page holding that text passes the check, and after the JSON changes the check names the cell."""
    from megatron_pp.planning.papers.bpipe import predict_bpipe

    monkeypatch.setattr(dry_run_cells, "RESULTS", str(tmp_path))
    cell = CELLS["bpipe"][0]
    flags, world = job_flags(cell)

    def write(peak: float) -> None:
        with open(tmp_path / f"repro_dry_run_{cell.key}.json", "w") as f:
            json.dump(_record(_row(0, peak), flags=flags, world=world), f)

    write(36 * GIB)
    report = predict_bpipe(models=("96b",))
    claim = "GPT-3 96B, variant `1f1b` of bpipe_gpt3_96b.yaml"
    predicted = dict((c[0], c[2]) for c in report.row_cells())[claim]
    job = next(j for j in report.dry_runs if j.cell == cell)
    assert predicted.endswith(f"; dry run 36.0 GiB (planner/dry run {job.planner_bytes[0] / (36 * GIB):.3f})")
    page = {"bpipe": {"calibration": report.calibration, "rows": {c[0]: tuple(c[1:]) for c in report.row_cells()}}}
    assert check_document(report, page) == []
    write(35 * GIB)
    problems = check_document(predict_bpipe(models=("96b",)), page)
    assert len(problems) == 1 and claim in problems[0] and "column Predicted" in problems[0]


def test_rng_states_are_real_under_fake_tensors():
    """Full recompute with dropout in the dry run: the tracker's states are snapshot and restored inside
    FakeTensorMode; a fake copy could not be loaded into the generator."""
    tracker = RNGTracker()
    tracker.add("x", 5)
    with FakeTensorMode():
        states = tracker.get_states()
        tracker.set_states(states)
        with tracker.fork("x"):
            pass
    assert type(states["x"]["cpu"]) is torch.Tensor


@pytest.mark.parametrize("paper", sorted(CELLS))
def test_committed_records_are_the_cells_jobs(paper):
    """Each committed repro_dry_run JSON ran its cell's flags (the page would otherwise say 'stale')."""
    from megatron_pp.planning.reproduce import reproduce

    report = reproduce(paper, quick=True, measure=False)
    assert {j.cell.key for j in report.dry_runs} == {c.key for c in CELLS[paper]}
    for job in report.dry_runs:
        text = dry_run_text(dry_run_cells.load_record(job.cell), job)
        assert text.startswith("dry run ") and not text.startswith("dry run:"), (job.cell.key, text)


def test_reference_attention_keeps_fp32_probabilities():
    """Why the BPipe cells without recompute are below 1 (docs/reproduction.md): the `reference` backend keeps
    the s x s softmax output and, with dropout, its output and (on the CPU) the scaled noise, all in fp32,
    where the planner counts Megatron's bf16 softmax and dropout outputs and a one-byte mask."""
    from megatron_pp.models.attention import _reference

    b, s, n, d = 1, 16, 2, 8
    q, k, v = (torch.randn(b, s, n, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    for p, count in ((0.0, 1), (0.1, 3)):
        saved: dict = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved[t.untyped_storage().data_ptr()] = t
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _reference(q, k, v, True, p, None, None)
        square = [t for t in saved.values() if t.shape[-2:] == (s, s) and t.numel() == b * n * s * s]
        assert len(square) == count and all(t.dtype == torch.float32 for t in square), p


def test_dry_run_cells_bad_input_is_one_line_exit_2(capsys):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import reproduce as tool

    assert tool.main(["bpipe", "--dry-run-cells", "no_such_cell"]) == 2
    assert tool.main(["bpipe", "--dry-run-cells", "--dry-run-extra-ranks", "last"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "no_such_cell" in err[0] and "--dry-run-extra-ranks" in err[1]
