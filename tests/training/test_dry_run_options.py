"""The dry run with the options users combine with a schedule: a schedule file, a plugin, uneven first and last
stages, bf16, fp16 with loss scaling, grouped-query attention, tensor parallelism with sequence parallelism.
Every rank of a tiny job, dry-run on fake tensors and the fake backend, against the same job code on real
tensors on gloo (`dry_run._run` with no fake mode, as tests/training/test_dry_run.py runs it): the state, the
stash and the host buffers to the byte, the total peak never above the real one by more than 0.1% (kernel
temporaries a CPU kernel and its fake rule may size differently), the ranks' calls agreeing with each other."""
from __future__ import annotations

import os
import sys

import pytest

from megatron_pp.training import dry_run
from megatron_pp.training.arguments import parse_args
from tests.dist import run_distributed
from tests.schedules import test_plugins

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from torch_schedule_csv import write_torch_csv  # noqa: E402

BASE = ["--mock-data", "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "2",
        "--lr", "1e-3", "--seed", "7"]
# tests/schedules/test_plugins.py's plugin under names of its own: both files' tests may load it in one process.
PLUGIN = (test_plugins.PLUGIN.replace("test-offloaded-interleaved", "dry-offloaded-interleaved")
          .replace("plugin_offloaded_chunks", "dry_plugin_offloaded_chunks")
          .replace("--plugin-offloaded-chunks", "--dry-plugin-offloaded-chunks"))
BYTES = ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "stash_peak_bytes", "host_peak_bytes")


@pytest.fixture(autouse=True)
def _plugin_schedule_leaves_this_process():
    """The plugin case loads its schedule into this process (parse_args); no later test here should find it
    registered (tools/plan.py ranks every registered schedule, and pool workers of other tests lack it): the
    registry is restored after each test, as tests/conftest.py does after each module."""
    from tests.registry_state import schedule_registry_restored

    with schedule_registry_restored():
        yield


def _case(name: str, tmp_path) -> tuple[list[str], int, int]:
    """(argv without --dry-run, tp, pp) of each case."""
    gpt, llama = ["--model-preset", "gpt-tiny"], ["--model-preset", "llama-tiny"]
    if name == "schedule-file":
        csv = write_torch_csv(str(tmp_path / "zbv.csv"), "ScheduleZBVZeroBubble", 2, 4)
        return [*llama, "--pipeline-schedule-file", csv], 1, 2
    if name == "plugin":
        plugin = tmp_path / "dry_schedules.py"
        plugin.write_text(PLUGIN)
        return [*gpt, "--schedule-plugin", str(plugin), "--pipeline-schedule", "dry-offloaded-interleaved",
                "--dry-plugin-offloaded-chunks", "1", "--num-layers-per-virtual-pipeline-stage", "1"], 1, 2
    if name == "uneven":
        return [*gpt, "--num-layers", "5", "--decoder-first-pipeline-num-layers", "1",
                "--decoder-last-pipeline-num-layers", "1"], 1, 3
    if name == "bf16":
        return [*gpt, "--bf16"], 1, 2
    if name == "fp16":
        return [*gpt, "--fp16", "--initial-loss-scale", "1024"], 1, 2
    if name == "gqa":
        return [*llama, "--pipeline-schedule", "zb-h1"], 1, 2  # llama-tiny: 8 heads in 4 query groups
    if name == "tp-sp":
        return [*llama, "--tensor-model-parallel-size", "2", "--sequence-parallel"], 2, 2
    raise AssertionError(name)


def _argv(name: str, tmp_path) -> tuple[list[str], int, int]:
    argv, tp, pp = _case(name, tmp_path)
    return [*argv, *BASE, "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--dry-run", str(tp * pp)], tp, pp


def _real_rank(ctx, argv: list[str], tp: int, pp: int) -> dict:
    args = parse_args(argv)
    tracker = dry_run.MemoryTracker()
    with tracker:
        report = dry_run._run(args, ctx.parallel_state(tp, pp), None, tracker, steps=2)
    return report.row()


@pytest.mark.parametrize("name", ["schedule-file", "plugin", "uneven", "bf16", "fp16", "gqa", "tp-sp"])
def test_every_rank_equals_the_real_gloo_run(name, tmp_path):
    argv, tp, pp = _argv(name, tmp_path)
    # The plugin's case in worker processes (the default for more than one rank: each must load the plugin
    # itself; they once did not, and the job's own schedule was unknown there); the others in this process.
    jobs = "2" if name == "plugin" else "1"
    reports, problems = dry_run.dry_run(parse_args(argv + ["--dry-run-ranks", "all", "--dry-run-jobs", jobs]))
    assert problems == []
    real = run_distributed(tp * pp, _real_rank, argv, tp, pp)
    assert [r.rank for r in reports] == list(range(tp * pp))
    for fake, actual in zip((r.row() for r in reports), real):
        assert fake["stash_peak_bytes"] > 0, (name, fake)
        for key in BYTES:
            assert fake[key] == actual[key], (name, fake["rank"], key, fake[key], actual[key])
        # The total peak: the dry run invents nothing (at most kernel temporaries above the real run). It is not
        # held from below here: on gloo a send completes only when waited for, at the step's end, so the real
        # run's peak also holds outputs it has sent, and what their autograd graphs keep, after their backward
        # ran (docs/dry_run.md); NCCL, like the fake backend, completes them. Both hold their state and stash.
        assert fake["peak_bytes"] <= actual["peak_bytes"] * 1.001, (name, fake, actual)
        for report in (fake, actual):
            state = report["parameter_bytes"] + report["gradient_bytes"] + report["optimizer_bytes"]
            assert state + report["stash_peak_bytes"] <= report["peak_bytes"], (name, report)
    if name == "plugin":  # its list offloads: the host holds stashes on every rank
        assert all(r.host_peak_bytes > 0 for r in reports)
    if name == "uneven":  # one layer on the first and the last stage, three in the middle
        params = [r.parameter_bytes for r in reports]
        assert params[1] > params[0] and params[1] > params[2]
