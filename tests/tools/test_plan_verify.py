"""`tools/plan.py --verify N`: the worst pipeline rank of each of the N best plans dry-run with the flags the plan
prints, measured beside predicted (tiny models on a CPU "cluster", a few seconds per dry run)."""
import json
import os
import shlex
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import plan as plan_tool  # noqa: E402

CPU = {"name": "cpu (test)", "peak_tflops": 0.05, "memory_gib": 64, "hbm_gbps": 10, "tp_link_gbps": 5,
       "pair_link_gbps": 5, "gpus_per_node": 1}


@pytest.mark.parametrize("problem", [
    ["--num-gpus", "2", "--top", "2", "--verify", "2"],  # data parallelism with the distributed optimizer
    ["--num-gpus", "4", "--gpu-memory-gb", "0.0025", "--top", "1", "--verify", "1"],  # pipelined to fit
])
def test_verify_dry_runs_the_printed_flags_and_agrees(tmp_path, capsys, problem):
    hardware = tmp_path / "cpu.json"
    hardware.write_text(json.dumps(CPU))
    out = tmp_path / "plan.json"
    argv = ["--model-preset", "gpt-tiny", "--global-batch-size", "8", "--attention-backend", "reference",
            "--device", "cpu", "--hardware", str(hardware), "--commands", "0", "--json", str(out)] + problem
    assert plan_tool.main(argv) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    n = int(problem[problem.index("--verify") + 1])
    assert len(data["verify"]) == n and "measured" in printed and "predicted" in printed
    commands = {row["configuration"]: shlex.split(row["command"]) for row in data["ranked"]}
    for row in data["verify"]:
        assert "refused" not in row, row
        # The dry run ran the flags the plan prints for that configuration, plus mock data and the dry run's.
        printed_flags = commands[row["configuration"]]
        start = printed_flags.index("--model-preset")
        assert row["flags"][:len(printed_flags) - start] == printed_flags[start:]
        assert row["measured_state_bytes"] == row["predicted_state_bytes"]
        assert abs(row["measured_stash_peak_bytes"] / row["predicted_stash_bytes"] - 1) <= 0.01
        # The peak: the planner leaves out the backward's kernel temporaries (the reference attention's s x s
        # gradients) and received activations, 5% of a tiny stage's peak (0.3 GiB, 1%, of a LLaMA-3-70B stage's).
        assert 0.90 <= row["predicted_over_measured"] <= 1.0 + 1e-3, row
        if row["measured_phase"] == "optimizer":
            assert row["predicted_phase"] == "optimizer"


def test_a_negative_verify_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        plan_tool.main(["--model-preset", "gpt-tiny", "--global-batch-size", "8", "--num-gpus", "2", "--verify", "-1"])
    assert exit_info.value.code == 2
    assert "--verify must be >= 0" in capsys.readouterr().err
