"""The planner held to a dry run after the fact (`planning.verify.compare_dry_run`, `tools/validate_planner.py
--dry-run-json`): the AdamW kernel each row names decides the planner's optimizer-step term."""
import json
import os
import sys

import pytest
import torch

from megatron_pp.planning.verify import compare_dry_run, optimizer_of
from megatron_pp.training import dry_run
from megatron_pp.training.arguments import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import validate_planner  # noqa: E402

FLAGS = ["--model-preset", "gpt-tiny", "--mock-data", "--bf16", "--micro-batch-size", "1", "--global-batch-size", "4",
         "--seq-length", "16", "--max-position-embeddings", "16", "--pipeline-model-parallel-size", "2",
         "--attention-dropout", "0", "--hidden-dropout", "0", "--train-iters", "2", "--dry-run", "2"]


def _rows(kernel: str) -> list[dict]:
    args = parse_args(FLAGS + ["--dry-run-optimizer", kernel])
    return [dry_run.run_rank(args, rank, torch.device("cpu")).row() for rank in (0, 1)]


def test_rows_name_their_kernel_and_old_rows_ran_foreach():
    assert optimizer_of([{"optimizer_implementation": "torch.optim.AdamW (fused)"}]) == "fused"
    assert optimizer_of([{"optimizer_implementation": "apex.optimizers.FusedAdam"}]) == "fused"
    assert optimizer_of([{"peak_bytes": 1}]) == "foreach"  # before --dry-run-optimizer: the CPU's choice
    with pytest.raises(ValueError, match="different optimizers"):
        optimizer_of([{"optimizer_implementation": "torch.optim.AdamW (fused)"}, {}])


@pytest.mark.parametrize("kernel", ["fused", "foreach"])
def test_the_planner_is_compared_with_the_kernel_the_dry_run_built(kernel):
    """State to the byte on both pipeline ranks either way; the planner's optimizer-step term is foreach's
    sqrt(v) (4 bytes a matrix parameter) only where the dry run ran foreach."""
    rows = _rows(kernel)
    result = compare_dry_run("python pretrain_gpt.py " + " ".join(FLAGS + ["--dry-run-optimizer", kernel]), 2, rows)
    assert result["optimizer"] == kernel
    for r in result["ranks"]:
        assert r["measured_state_bytes"] == r["predicted_state_bytes"]
        assert (r["predicted_optimizer_step_bytes"] > 0) == (kernel == "foreach")


def test_validate_planner_keeps_runs_of_one_command_apart_by_kernel(tmp_path, capsys):
    command = "python pretrain_gpt.py " + " ".join(FLAGS)
    paths = []
    for kernel in ("fused", "foreach"):
        path = tmp_path / f"{kernel}.json"
        path.write_text(json.dumps({"results": [{"command": command, "ranks": _rows(kernel)}]}))
        paths.append(str(path))
    out = tmp_path / "compared.json"
    assert validate_planner.main(["--dry-run-json", *paths, "--json", str(out)]) == 0
    compared = json.loads(out.read_text())["results"]
    assert [c["optimizer"] for c in compared] == ["fused", "foreach"]
    assert all(len(c["ranks"]) == 2 for c in compared)


def test_layered_reduction_across_groups_carries_each_chunks_copy_as_the_planner_says():
    """looped-bfs at pp 2 x dp 2 (bf16, two chunks a rank, breadth-first groups of 2 of the 4 microbatches,
    layered reduction, distributed optimizer): each chunk's intermediate reduction holds a copy of its fp32
    buckets and the 1/dp reduce-scatter output into the next group. The planner's per-rank figure carries
    4 x 1.5 bytes a parameter for it and lands within 3% of the dry run's peak on both pipeline ranks; without
    the term it is well below."""
    flags = ["--model-preset", "gpt-tiny", "--mock-data", "--bf16", "--micro-batch-size", "1",
             "--global-batch-size", "8", "--seq-length", "16", "--max-position-embeddings", "16",
             "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "looped-bfs",
             "--num-layers-per-virtual-pipeline-stage", "1", "--num-layers", "4", "--breadth-first-microbatches", "2",
             "--layered-grad-accumulation", "--use-distributed-optimizer", "--attention-dropout", "0",
             "--hidden-dropout", "0", "--train-iters", "2", "--dry-run", "4"]
    args = parse_args(flags)
    rows = [dry_run.run_rank(args, rank, torch.device("cpu")).row() for rank in (0, 2)]
    result = compare_dry_run("python pretrain_gpt.py " + " ".join(flags), 4, rows)
    for r, row in zip(result["ranks"], rows):
        carried = 4 * 1.5 * row["parameter_bytes"] / 2  # bf16 parameters: 2 bytes each
        assert r["predicted_backward_bytes"] >= carried
        assert abs(r["predicted_over_measured"] - 1) <= 0.03, r
        assert (r["predicted_peak_bytes"] - carried) / r["measured_peak_bytes"] < 0.97


FULL_SIZE = ("llama3_70b_1f1b_fused", "gpt3_175b_1f1b", "llama3_70b_interleaved", "llama3_70b_gpipe", "llama3_70b_po_h",
             "llama3_70b_recompute_full", "llama3_70b_recompute_selective", "llama3_70b_dp2_zero1",
             "llama3_70b_dp2_zero1_overlap", "llama3_70b_interleaved_dp2", "llama3_70b_interleaved_dp2_overlap",
             "llama3_70b_looped_bfs_layered", "gpt3_175b_1f1b_middle",
             "llama3_70b_interleaved_middle", "llama3_70b_gpipe_middle", "llama3_70b_recompute_full_middle",
             "llama3_70b_recompute_selective_middle", "llama3_70b_dp2_zero1_middle",
             "llama3_70b_looped_bfs_layered_middle")
# Not held: llama3_70b_po_h_middle (pipeline rank 4), where the planner is 3.8% high (docs/planner.md, "Where the
# planner is still off"): its stash term counts one chunk's stash more than the dry run holds.


@pytest.mark.parametrize("name", FULL_SIZE)
def test_the_planner_within_3_percent_of_every_committed_full_size_dry_run(name):
    """docs/dry_run.md's full-size rows (LLaMA-3-70B and GPT-3 175B, every schedule family), each rank the
    dry run measured: the planner as it stands now within 1% of the peak (the target is 3%; 1% is what it
    reaches with the backward's working set, which it missed by 0.7% to 1.8%, and the layered carries, by up to 28%),
    in the phase it fell in, with the state to the byte."""
    with open(os.path.join(ROOT, "docs", "results", f"dry_run_{name}.json")) as f:
        (result,) = json.load(f)["results"]
    compared = compare_dry_run(result["command"], int(result["command"].split("--dry-run ")[1].split()[0]),
                               result["ranks"])
    for r in compared["ranks"]:
        assert abs(r["predicted_over_measured"] - 1) <= 0.01, (name, r["pipeline_rank"], r["predicted_over_measured"])
        assert r["predicted_phase"] == r["measured_phase"], (name, r["pipeline_rank"])
        assert r["predicted_state_bytes"] == r["measured_state_bytes"], (name, r["pipeline_rank"])
