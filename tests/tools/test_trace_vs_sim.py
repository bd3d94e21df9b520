"""tools/trace_vs_sim.py at its smallest: a real 2-rank zb-h1 run's trace is measured, and the simulated
bubble in its JSON is the simulator's under exactly the costs measured from that trace."""
import json
import os
import statistics
import sys
from collections import defaultdict

import pytest

from megatron_pp.schedules.ir import Action
from megatron_pp.schedules.simulate import CostModel, simulate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import trace_vs_sim  # noqa: E402

SMALL = ["--pp", "2", "--schedules", "zb-h1", "--microbatches", "4", "--iters", "2", "--num-layers", "2",
         "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16", "--vocab-size", "128"]


def _costs_from_trace(path, schedule):
    """Per (op, stage) the median cost of the second step, read from the raw slices: from an action's start
    to the next compute action's (or the rank's last slice's end), less the waits nested in it."""
    events = [e for e in json.load(open(path))["traceEvents"] if e["ph"] == "X"]
    samples = defaultdict(list)
    for rank in range(schedule.num_ranks):
        mine = sorted((e for e in events if e["pid"] == rank), key=lambda e: e["ts"])
        waits = [e for e in mine if e["name"].startswith("wait ")]
        slices = [e for e in mine if not e["name"].startswith("wait ")]
        second = slices[len(slices) // 2:]  # two steps, the same slices each
        compute = [e for e in second if " " not in e["name"] and Action.parse(e["name"]).is_compute]
        for i, e in enumerate(compute):
            until = compute[i + 1]["ts"] if i + 1 < len(compute) else second[-1]["ts"] + second[-1]["dur"]
            blocked = sum(w["dur"] for w in waits if e["ts"] <= w["ts"] < e["ts"] + e["dur"])
            action = Action.parse(e["name"])
            samples[action.op, schedule.stage_of(rank, action.chunk)].append((until - e["ts"] - blocked) / 1e6)
    return {key: statistics.median(v) for key, v in samples.items()}


def test_smallest_run_simulates_with_the_traces_costs(tmp_path, capsys):
    out, traces = tmp_path / "r.json", tmp_path / "traces"
    assert trace_vs_sim.main([*SMALL, "--json", str(out), "--keep-traces", str(traces)]) == 0
    report = json.loads(out.read_text())
    assert report["target_relative_error"] == 0.15 and "median" in report["cost_model"]
    (run,) = report["runs"]
    assert (run["schedule"], run["pp"], run["microbatches"], run["steps_measured"]) == ("zb-h1", 2, 4, 1)
    assert set(report["within_target"]) == {"zb-h1 p=2"}
    # zb-h1 splits the backward: F, BI and BW each measured on both stages, one sample per microbatch.
    assert set(run["costs_ms"]) == {f"{op}.{s}" for op in ("F", "BI", "BW") for s in (0, 1)}
    assert all(n == 4 for n in run["cost_samples"].values())
    schedule = trace_vs_sim.job_schedule(trace_vs_sim.training_argv(
        trace_vs_sim.build_parser().parse_args(SMALL), "zb-h1", 2, "t.json"), 2)
    measured = _costs_from_trace(traces / "trace_zb-h1_pp2.json", schedule)
    assert {f"{op.value}.{s}": 1e3 * t for (op, s), t in measured.items()} == pytest.approx(run["costs_ms"])
    sim = simulate(schedule, CostModel(measured=measured, p2p_latency=run["p2p_latency_ms"] / 1e3))
    assert run["sim_bubble"] == pytest.approx(sim.bubble_fraction)
    assert run["sim_makespan_ms"] == pytest.approx(1e3 * sim.makespan)
    assert 0 < run["trace_bubble"] < 1 and run["trace_bubble"] == run["trace_bubble_per_step"][0]
    assert run["relative_error"] == pytest.approx(abs(run["trace_bubble"] - run["sim_bubble"]) / run["sim_bubble"])
    assert all(0 <= s < 1 for s in run["executor_share_of_busy"])
    assert "zb-h1 p=2: bubble trace" in capsys.readouterr().out


def test_bad_input_is_one_line_before_any_run(capsys):
    assert trace_vs_sim.main(["--schedules", "1f1b,nope"]) == 2
    assert trace_vs_sim.main(["--iters", "1"]) == 2
    assert trace_vs_sim.main(["--pp", "4", "--num-layers", "2"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("trace_vs_sim.py: error: ") for line in lines)
    assert "'nope'" in lines[0] and "--iters" in lines[1] and "p=4" in lines[2] and "--num-layers 2" in lines[2]


def test_a_trace_of_another_layout_is_refused(tmp_path):
    schedule = trace_vs_sim.job_schedule(trace_vs_sim.training_argv(
        trace_vs_sim.build_parser().parse_args(SMALL), "1f1b", 2, "t.json"), 2)
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "pid": 0, "name": "F0.0", "ts": 0, "dur": 1}]}))
    with pytest.raises(trace_vs_sim.UsageError, match="ranks"):
        trace_vs_sim.read_steps(str(path), schedule)
