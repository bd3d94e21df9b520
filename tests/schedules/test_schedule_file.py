"""Schedules from files: torch.distributed.pipelining's own schedules, written with torch's CSV writer, run
here from the file and give the single-process losses; bad files give one line and exit 2."""
from __future__ import annotations

import json
import os
import sys

import pytest

from megatron_pp.schedules.registry import build_schedule
from megatron_pp.schedules.schedule_file import (ScheduleFileError, build_schedule_from_file, read_torch_csv,
                                                 schedule_to_json)
from tests.dist import run_distributed

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))
from torch_schedule_csv import write_torch_csv  # noqa: E402

TORCH_SCHEDULES = ["ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble",
                   "ScheduleZBVZeroBubble", "ScheduleDualPipeV"]
V_SHAPED = {"ScheduleZBVZeroBubble", "ScheduleDualPipeV"}


def torch_csv(path, class_name: str, p: int, m: int) -> str:
    """torch's compute-only CSV of one of its schedule classes, written by the project's tool."""
    return write_torch_csv(str(path), class_name, p, m)


@pytest.mark.parametrize("class_name", TORCH_SCHEDULES)
def test_torch_orders_read_with_their_placement(tmp_path, class_name):
    schedule = build_schedule_from_file(torch_csv(tmp_path / "s.csv", class_name, 4, 8))
    assert (schedule.num_ranks, schedule.num_microbatches, schedule.num_chunks) == (4, 8, 2)
    if class_name in V_SHAPED:  # rank r holds stages r and 7 - r
        assert schedule.placement == [(0, 0), (1, 0), (2, 0), (3, 0), (3, 1), (2, 1), (1, 1), (0, 1)]
    else:
        assert schedule.placement == [(r % 4, r // 4) for r in range(8)]
    computes = [a for acts in schedule.actions for a in acts if a.is_compute]
    assert sum(a.op.value == "F" for a in computes) == 8 * 8


def _losses(ctx, argv):
    from megatron_pp.training.arguments import parse_args
    from megatron_pp.training.train import pretrain

    args = parse_args(argv)
    rows = pretrain(args, state=ctx.parallel_state(1, args.pipeline_model_parallel_size))
    return [r["loss"] for r in rows] if rows else None


COMMON = ["--model-preset", "llama-tiny", "--num-layers", "8", "--mock-data", "--micro-batch-size", "1",
          "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3", "--seed", "3"]


@pytest.fixture(scope="module")
def reference():
    from megatron_pp.training.arguments import parse_args
    from megatron_pp.training.train import pretrain

    return [r["loss"] for r in pretrain(parse_args(COMMON))]


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("class_name", TORCH_SCHEDULES)
def test_torch_schedule_from_its_csv_trains_exactly(tmp_path, reference, class_name, p):
    path = torch_csv(tmp_path / "s.csv", class_name, p, 8)
    losses = run_distributed(p, _losses, COMMON + ["--pipeline-model-parallel-size", str(p),
                                                   "--pipeline-schedule-file", path])[0]
    assert len(losses) == 2
    for a, b in zip(losses, reference):
        assert abs(a - b) <= 1e-5 * abs(b), (class_name, p, losses, reference)


def test_exported_json_round_trips_and_takes_the_offload_pass(tmp_path):
    built = build_schedule("gis", 2, 4, 2)
    path = tmp_path / "gis.json"
    path.write_text(json.dumps(schedule_to_json(built)))
    again = build_schedule_from_file(str(path))
    assert again.actions == built.actions and again.placement == built.placement
    offloaded = build_schedule_from_file(str(path), offload_chunks=1)
    assert any(a.op.value == "OFFLOAD" for acts in offloaded.actions for a in acts)


@pytest.mark.parametrize("rows,needle", [
    (["0F0,0B0", "1F0"], "rank 1 never produces that message"),  # stage 1 has no backward: no gradient for rank 0
    (["0F0,1F0,1B0,0B0", "1F0,1B0"], "stage 1 is computed on rank 0 and on rank 1"),
    (["0F0,0X0,0B0", "1F0,1B0"], "row 1, column 2: cannot read cell '0X0'"),
])
def test_bad_files_are_one_line_naming_the_place(tmp_path, rows, needle):
    path = tmp_path / "bad.csv"
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(ScheduleFileError) as info:
        build_schedule_from_file(str(path))
    assert "\n" not in str(info.value) and needle in str(info.value), str(info.value)


def test_bad_file_through_the_training_script_exits_2(tmp_path, capsys):
    from megatron_pp.training.arguments import parse_args

    path = tmp_path / "bad.csv"
    path.write_text("0F0,0X0\n1F0,1B0\n")
    with pytest.raises(SystemExit) as info:
        parse_args(["--model-preset", "gpt-tiny", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "1",
                    "--train-iters", "1", "--pipeline-schedule-file", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and "cannot read cell" in err[0], err


def test_flags_that_disagree_with_the_file_name_both_values(tmp_path):
    path = torch_csv(tmp_path / "s.csv", "ScheduleInterleaved1F1B", 2, 8)
    with pytest.raises(ScheduleFileError, match="has 2 for --pipeline-model-parallel-size, the job has 4"):
        build_schedule_from_file(path, num_ranks=4)
    with pytest.raises(ScheduleFileError, match="has 8 for microbatches per step .*the job has 4"):
        build_schedule_from_file(path, num_microbatches=4)


def test_csv_skips_communication_cells_and_idle_slots():
    text = "0F0,,0SEND_F0,0UNSHARD,,0B0\n1RECV_F0,1F0,1B0\n"
    schedule = read_torch_csv("inline.csv", text)
    assert [str(a) for a in schedule.actions[0]] == ["F0.0", "B0.0"]
    assert [str(a) for a in schedule.actions[1]] == ["F0.0", "B0.0"]


def _file_job(tmp_path, name: str, p: int, m: int, v: int, *flags: str):
    """The schedule `pretrain` would run for a file holding registered schedule `name` at (p, m, v) with the
    schedule `flags`: parsed and built by the same functions the training scripts call."""
    from megatron_pp.training.arguments import build_job_schedule
    from megatron_pp.training.flags import build_parser

    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(schedule_to_json(build_schedule(name, p, m, v))))
    args = build_parser().parse_args(["--model-preset", "gpt-tiny", "--num-layers", str(p * v), "--mock-data",
                                      "--micro-batch-size", "1", "--global-batch-size", str(m),
                                      "--pipeline-model-parallel-size", str(p), "--pipeline-schedule-file", str(path),
                                      *flags])
    return build_job_schedule(args, 1, None)


def _moved(schedule, op: str) -> set[tuple[int, int, int]]:
    """(rank, microbatch, chunk) of every `op` action (OFFLOAD, EVICT, ...)."""
    return {(r, a.microbatch, a.chunk) for r, acts in enumerate(schedule.actions) for a in acts if a.op.value == op}


@pytest.mark.parametrize("flags,chunks", [
    (["--offload-chunks", "1"], 1),
    (["--offload-fraction", "0.5"], 1),  # ceil(0.5 x 2 chunks) = 1: the first chunk
    (["--offload-fraction", "1.0"], 2),
    (["--offload-chunks", "2", "--offload-time", "0.25"], 2),
])
def test_each_offload_flag_offloads_a_file_job(tmp_path, flags, chunks):
    """The flag's chunks go to host memory and come back on every rank (`--offload-fraction` alone once ran
    the file with no offload at all): with one chunk, every microbatch's stash of chunk 0; a fraction gives
    the very lists of the chunk count it rounds to."""
    schedule = _file_job(tmp_path, "gis", 2, 4, 2, *flags)
    offloaded = _moved(schedule, "OFFLOAD")
    assert offloaded == _moved(schedule, "RELOAD") and {c for _, _, c in offloaded} == set(range(chunks)), flags
    assert {r for r, _, _ in offloaded} == {0, 1}
    if chunks == 1:
        assert offloaded == {(r, mb, 0) for r in range(2) for mb in range(4)}
    assert schedule.options["offload_chunks"] == chunks
    if "--offload-fraction" in flags:
        assert schedule.actions == _file_job(tmp_path, "gis", 2, 4, 2, "--offload-chunks", str(chunks)).actions
    if "--offload-time" in flags:
        assert schedule.options["offload_time"] == 0.25


def test_bpipe_max_resident_parks_stashes_of_a_file_job(tmp_path):
    """1F1B at p = 4, m = 8 from a file with --bpipe-max-resident 2: rank 0 (4 stashes at its peak) parks
    its stashes above 2 on rank 3, which accepts and returns each; the bound is recorded."""
    schedule = _file_job(tmp_path, "1f1b", 4, 8, 1, "--bpipe-max-resident", "2")
    evicted = _moved(schedule, "EVICT")
    assert evicted and {r for r, _, _ in evicted} <= {0, 1} and 0 in {r for r, _, _ in evicted}
    assert evicted == _moved(schedule, "LOAD")
    accepted = {(mb, c) for r, mb, c in _moved(schedule, "ACCEPT") if r == 3}
    assert {(mb, c) for r, mb, c in evicted if r == 0} == accepted
    assert schedule.options["bpipe_max_resident"] == 2
    plain = _file_job(tmp_path, "1f1b", 4, 8, 1)
    assert not _moved(plain, "EVICT") and not _moved(plain, "OFFLOAD")


def _losses_and_peaks(ctx, argv):
    from megatron_pp.training.arguments import parse_args
    from megatron_pp.training.train import pretrain

    args = parse_args(argv)
    rows = pretrain(args, state=ctx.parallel_state(1, args.pipeline_model_parallel_size))
    return [(r["loss"], r["peak_stash_bytes"]) for r in rows] if rows else None


def test_a_file_job_with_bpipe_parks_stashes_at_run_time_and_trains_exactly(tmp_path, reference):
    """The lists above are also what runs: 1F1B at p = 4, m = 8 from a JSON file with --bpipe-max-resident 2 gives
    the single-process losses, rank 0's stash peak falls below the same file's without the flag (4 stashes; with
    the flag at most K + 1 = 3) and rank 3, its partner, holds more than its own: the runtime parked the stashes
    instead of ignoring the flag. (At p = 2 no K lowers rank 0's peak: K + 1 = 2 = p.)"""
    path = tmp_path / "1f1b.json"
    path.write_text(json.dumps(schedule_to_json(build_schedule("1f1b", 4, 8))))
    argv = COMMON + ["--pipeline-model-parallel-size", "4", "--pipeline-schedule-file", str(path)]
    plain = run_distributed(4, _losses_and_peaks, argv)[0]
    parked = run_distributed(4, _losses_and_peaks, argv + ["--bpipe-max-resident", "2"])[0]
    for rows in (plain, parked):
        assert len(rows) == 2
        for (loss, _), ref in zip(rows, reference):
            assert abs(loss - ref) <= 1e-5 * abs(ref), (rows, reference)
    peaks, plain_peaks = parked[-1][1], plain[-1][1]
    assert peaks[0] < plain_peaks[0] and peaks[3] > plain_peaks[3], (peaks, plain_peaks)
