"""tools/plan.py end to end: the launch commands it prints for its three best plans of three tiny problems
start and train (gloo, two iterations), and the peak stash each pipeline rank measures is within 5% of the
plan's figure. The problems are picked so that their top rows differ in layout and schedule (data
parallelism, 2BW, GIS, offload with recomputation, and split-backward schedules whose BW runs apart from
its BI); a one-GPU-per-node profile keeps tensor parallelism out, whose step time is unvalidated."""
import json
import os
import shlex
import sys

import pytest

from megatron_pp.planning.job import GIB
from tests.dist import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import plan as plan_tool  # noqa: E402

MEMORY_TOLERANCE = 0.05
ITERATIONS = 2
# Speeds are placeholders: the ranking only has to be deterministic; memory is what the runs check.
CPU = {"name": "cpu (test)", "peak_tflops": 0.05, "memory_gib": 64, "hbm_gbps": 10, "tp_link_gbps": 5,
       "pair_link_gbps": 5, "gpus_per_node": 1}
PROBLEMS = {
    "gpt-2gpus": ["--model-preset", "gpt-tiny", "--global-batch-size", "8", "--num-gpus", "2",
                  "--attention-backend", "reference"],
    "llama-4gpus": ["--model-preset", "llama-tiny", "--global-batch-size", "8", "--num-gpus", "4"],
    "gpt-4gpus-tight": ["--model-preset", "gpt-tiny", "--global-batch-size", "8", "--num-gpus", "4",
                        "--attention-backend", "reference", "--gpu-memory-gb", "0.0025"],
}


def _train(ctx, flags, tp, pp):
    """Worker: the command's training flags (plus mock data and a length) through the training entry's own
    argument parsing and loop; the peak stash bytes per pipeline rank over the iterations."""
    from megatron_pp.training.arguments import parse_args
    from megatron_pp.training.train import pretrain

    args = parse_args(flags + ["--mock-data", "--train-iters", str(ITERATIONS), "--log-interval", "1000"])
    rows = pretrain(args, ctx.parallel_state(tp, pp))
    return [max(r["peak_stash_bytes"][k] for r in rows) for k in range(pp)] if rows else None


def _launch(command):
    """(world size, script, training flags) of a printed line: launch/local.sh on one node, the Slurm
    batch script beyond (here a node holds one GPU, so every multi-GPU plan is a Slurm line)."""
    words = shlex.split(command)
    if words[1:3] == ["bash", "launch/local.sh"]:
        assert words[0].startswith("NPROC="), command
        return int(words[0].split("=")[1]), words[3], words[4:]
    assert words[0].startswith("GPUS_PER_NODE=") and words[1:4] == ["sbatch", "--nodes", words[3]], command
    assert words[4] == "launch/slurm/pretrain.sbatch", command
    return int(words[0].split("=")[1]) * int(words[3]), words[5], words[6:]


def _value(flags, name):
    return int(flags[flags.index(name) + 1])


@pytest.mark.parametrize("problem", list(PROBLEMS))
def test_printed_commands_run_and_match_the_planned_stash(problem, tmp_path, capsys):
    hardware = tmp_path / "cpu.json"
    hardware.write_text(json.dumps(CPU))
    out = tmp_path / "plan.json"
    argv = PROBLEMS[problem] + ["--device", "cpu", "--hardware", str(hardware), "--max-micro-batch-size", "1",
                                "--reserved-memory-fraction", "0", "--top", "3", "--commands", "3", "--json", str(out)]
    assert plan_tool.main(argv) == 0
    commands = [line.split(" ", 1)[1] for line in capsys.readouterr().out.splitlines() if line.startswith("#")]
    assert len(commands) == 3, commands
    planned = {row["command"]: row for row in json.loads(out.read_text())["ranked"]}
    for command in commands:
        world, script, flags = _launch(command)
        assert script in ("pretrain_gpt.py", "pretrain_llama.py") and "--bf16" not in flags
        tp, pp = _value(flags, "--tensor-model-parallel-size"), _value(flags, "--pipeline-model-parallel-size")
        measured = run_distributed(world, _train, flags, tp, pp)[0]
        predicted = [gib * GIB for gib in planned[command]["stash_gib"]]
        assert measured is not None and len(measured) == len(predicted) == pp
        # Schedules that defer BW (zb-v, ...) included: the plan counts what a deferred BW holds.
        for rank, (want, got) in enumerate(zip(predicted, measured)):
            assert abs(want - got) <= MEMORY_TOLERANCE * got, (command, rank, want, got)
