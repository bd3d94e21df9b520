"""tools/plot_schedule.py: PNG and JSON for every registered schedule, one-line errors with exit status 2."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_pp.schedules.registry import build_schedule, registered_schedules
from megatron_pp.schedules.simulate import simulate

TOOL = Path(__file__).resolve().parents[2] / "tools" / "plot_schedule.py"
_spec = importlib.util.spec_from_file_location("plot_schedule", TOOL)
plot_schedule = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot_schedule)


@pytest.mark.parametrize("entry", registered_schedules(), ids=lambda e: e.name)
def test_writes_png_and_json_for_every_registered_schedule(entry, tmp_path):
    name = entry.name
    chunks = 2 if entry.supports_virtual else 1
    png, js = tmp_path / "s.png", tmp_path / "s.json"
    argv = ["--schedule", name, "--pp", "3", "--microbatches", "3", "--chunks", str(chunks),
            "--out", str(png), "--json", str(js)]
    assert plot_schedule.main(argv) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads(js.read_text())
    schedule = build_schedule(name, 3, 3, chunks)
    result = simulate(schedule)
    assert record["actions"] == [[str(a) for a in acts] for acts in schedule.actions]
    assert record["makespan"] == result.makespan
    assert record["bubble_fraction"] == result.bubble_fraction
    assert record["peak_stash"] == result.peak_stash
    assert record["options"] == schedule.options
    assert (record["schedule"], record["num_ranks"], record["num_microbatches"], record["num_chunks"]) == (
        name, 3, 3, chunks)


def test_options_and_costs_reach_the_schedule(tmp_path):
    js = tmp_path / "s.json"
    argv = ["--pipeline-schedule", "interleaved-1f1b", "--pp", "2", "--microbatches", "6", "--chunks", "2",
            "--option", "microbatch_group_size=3", "--p2p-latency", "0.25", "--stage-weights", "1,2,3,4",
            "--out", str(tmp_path / "s.png"), "--json", str(js)]
    assert plot_schedule.main(argv) == 0
    record = json.loads(js.read_text())
    assert record["options"] == {"microbatch_group_size": 3}
    assert record["costs"]["stage_weights"] == [1.0, 2.0, 3.0, 4.0] and record["costs"]["p2p_latency"] == 0.25
    # Rank 0 holds stages 0 and 2, rank 1 stages 1 and 3: m * (sum of its weights) * (F + B).
    assert record["busy"] == [6 * (1 + 3) * 3.0, 6 * (2 + 4) * 3.0]


@pytest.mark.parametrize("argv, message", [
    (["--schedule", "nope", "--pp", "2", "--microbatches", "2"], "unknown --pipeline-schedule 'nope'"),
    (["--schedule", "1f1b", "--pp", "0", "--microbatches", "2"], "num_ranks must be a positive int, got 0"),
    (["--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--chunks", "2"], "virtual-pipeline-stage"),
    (["--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--option", "x"], "expects NAME=VALUE"),
    (["--schedule", "1f1b", "--pp", "two", "--microbatches", "2"], "invalid int value: 'two'"),
    (["--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--stage-weights", "1,a"], "comma-separated"),
])
def test_bad_input_is_one_line_and_status_2(argv, message, tmp_path, capsys):
    assert plot_schedule.main(argv + ["--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("plot_schedule.py: error: ") and message in err
    assert not (tmp_path / "x.png").exists()


def test_command_line_exit_status_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, str(TOOL), "--schedule", "1f1b", "--pp", "-1", "--microbatches", "4",
                           "--out", str(tmp_path / "x.png")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == "plot_schedule.py: error: num_ranks must be a positive int, got -1\n"
    assert proc.stdout == ""


def test_the_training_flags_of_a_run_can_be_pasted(tmp_path):
    """The flags a user trains with draw their run: --pipeline-model-parallel-size,
    --num-virtual-stages-per-pipeline-rank and each schedule option's own flag."""
    js = tmp_path / "s.json"
    argv = ["--schedule", "gis", "--pipeline-model-parallel-size", "4", "--microbatches", "8",
            "--num-virtual-stages-per-pipeline-rank", "2", "--interleave-group-size", "2", "--offload-chunks", "1",
            "--json", str(js)]
    assert plot_schedule.main(argv) == 0
    record = json.loads(js.read_text())
    expected = build_schedule("gis", 4, 8, 2, interleave_group_size=2, offload_chunks=1)
    assert record["actions"] == [[str(a) for a in acts] for acts in expected.actions]
    clash = ["--schedule", "gis", "--pp", "4", "--microbatches", "8", "--chunks", "2", "--interleave-group-size", "2",
             "--option", "interleave_group_size=3", "--json", str(js)]
    assert plot_schedule.main(clash) == 2


def _trace_of(schedule, path, scale=1e-3, shift=0):
    """A trace as `--trace-file` writes it, of `schedule`'s simulated timeline (cost units as ms)."""
    from megatron_pp.training.trainer import write_trace

    timeline = simulate(schedule).timeline
    events = [[(str(a), s * scale, e * scale) for a, s, e in entries if a.is_compute] for entries in timeline]
    if shift:
        events[0] = [(f"F{99}.0", 0.0, 0.001)] + events[0]
    write_trace(str(path), events)


def test_a_run_trace_is_drawn_under_the_simulated_timeline(tmp_path):
    schedule = build_schedule("interleaved-1f1b", 2, 4, 2)
    trace, png = tmp_path / "t.json", tmp_path / "s.png"
    _trace_of(schedule, trace)
    executed = plot_schedule.read_trace(str(trace), schedule)
    assert [len(ranks) for ranks in executed] == [sum(a.is_compute for a in acts) for acts in schedule.actions]
    argv = ["--pipeline-schedule", "interleaved-1f1b", "--pipeline-model-parallel-size", "2", "--microbatches", "4",
            "--num-virtual-stages-per-pipeline-rank", "2", "--trace-file", str(trace), "--out", str(png)]
    assert plot_schedule.main(argv) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_trace_of_another_run_is_refused_in_one_line(tmp_path, capsys):
    trace = tmp_path / "t.json"
    _trace_of(build_schedule("1f1b", 2, 4, 1), trace, shift=True)  # rank 0 ran F99: not in 1f1b's list
    base = ["--pipeline-schedule", "1f1b", "--microbatches", "4", "--trace-file", str(trace),
            "--out", str(tmp_path / "s.png")]
    assert plot_schedule.main(base + ["--pp", "2"]) == 2
    assert "rank 0 ran F99.0, which is not in its list" in capsys.readouterr().err
    assert plot_schedule.main(base + ["--pp", "4"]) == 2
    assert "has 2 ranks, the schedule 4" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{")
    assert plot_schedule.main(base[:-4] + ["--pp", "2", "--trace-file", str(tmp_path / "bad.json"),
                              "--out", str(tmp_path / "s.png")]) == 2
    assert "not a trace written by --trace-file" in capsys.readouterr().err


def test_layers_per_virtual_stage_and_batch_sizes_give_v_and_m_as_training_does(tmp_path, capsys):
    js = tmp_path / "s.json"
    argv = ["--pipeline-schedule", "interleaved-1f1b", "--pipeline-model-parallel-size", "2", "--num-layers", "8",
            "--num-layers-per-virtual-pipeline-stage", "2", "--global-batch-size", "16", "--micro-batch-size", "2",
            "--data-parallel-size", "2", "--json", str(js)]
    assert plot_schedule.main(argv) == 0
    record = json.loads(js.read_text())
    assert (record["num_chunks"], record["num_microbatches"]) == (2, 4)
    assert plot_schedule.main(argv[:-2] + ["--microbatches", "5", "--json", str(js)]) == 2
    assert "--microbatches 5 disagrees" in capsys.readouterr().err
    assert plot_schedule.main([a if a != "8" else "6" for a in argv]) == 2
    assert "--num-layers-per-virtual-pipeline-stage 2 does not divide 6 layer slots" in capsys.readouterr().err
