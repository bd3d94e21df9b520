"""The batch-size ramp-up at run time: a checkpoint wherever the ramp changes the microbatch count (as Megatron-LM's
training loop saves one) that a run resumes from identically; the ramp's per-count executors under host offload
(PO-H, and ZB-V with --offload-chunks) giving the single process's losses; lists with weight versions refused
with a ramp, whatever their name."""
from __future__ import annotations

import os
import shutil

import pytest

from megatron_pp.schedules.ir import Op
from megatron_pp.schedules.registry import register_schedule, unregister_schedule
from megatron_pp.schedules.twobw import two_bw
from megatron_pp.training.arguments import build_job_schedule, build_parser, parse_args, validate_args
from megatron_pp.training.checkpointing import TRACKER_FILE
from megatron_pp.training.train import pretrain
from tests.dist import run_distributed
from tests.training.test_batch_ramp import TINY

KEYS = ("iteration", "consumed_samples", "global_batch_size", "loss", "grad_norm", "lr")


def test_a_checkpoint_is_saved_where_the_ramp_changes_the_microbatch_count_and_resumes_exactly(tmp_path, capsys):
    """Batches 2, 2, 4, 6, 6, 6: the count changes after iterations 2 and 3, so --save without an interval
    writes iterations 2, 3 and the last; with --save-interval 3 iteration 3 is saved once."""
    ck = tmp_path / "ck"
    whole = pretrain(parse_args(TINY + ["--save", str(ck)]))
    assert [r["global_batch_size"] for r in whole] == [2, 2, 4, 6, 6, 6]
    assert sorted(d for d in os.listdir(ck) if d.startswith("iter_")) == ["iter_0000002", "iter_0000003",
                                                                           "iter_0000006"]
    out = capsys.readouterr().out
    assert out.count("as Megatron-LM saves at each change") == 2 and out.count("saved checkpoint") == 3
    with_interval = tmp_path / "interval"
    pretrain(parse_args(TINY + ["--save", str(with_interval), "--save-interval", "3"]))
    assert sorted(d for d in os.listdir(with_interval) if d.startswith("iter_")) == [
        "iter_0000002", "iter_0000003", "iter_0000006"]
    assert capsys.readouterr().out.count("saved checkpoint") == 3
    for iteration in (2, 3):  # a job restarted from the ramp's checkpoint, as a requeue after it would be
        restart = tmp_path / f"restart{iteration}"
        shutil.copytree(ck / f"iter_{iteration:07d}", restart / f"iter_{iteration:07d}")
        (restart / TRACKER_FILE).write_text(f"{iteration}\n")
        rest = pretrain(parse_args(TINY + ["--load", str(restart)]))
        assert f"loaded checkpoint {restart}" in capsys.readouterr().out
        assert [[r[k] for k in KEYS] for r in rest] == [[r[k] for k in KEYS] for r in whole[iteration:]]


def test_no_ramp_checkpoint_without_save_or_ramp(tmp_path):
    at = TINY.index("--rampup-batch-size")
    plain = TINY[:at] + TINY[at + 4:]  # the same run at the full batch throughout
    ck = tmp_path / "ck"
    rows = pretrain(parse_args(plain + ["--save", str(ck)]))
    assert [r["global_batch_size"] for r in rows] == [6] * 4
    assert sorted(d for d in os.listdir(ck) if d.startswith("iter_")) == ["iter_0000004"]


def _ramp_losses(ctx, argv, pp):
    args = parse_args(argv)
    rows = pretrain(args, state=ctx.parallel_state(1, pp))
    return [(r["global_batch_size"], r["loss"]) for r in rows]


OFFLOAD = {
    "po-h": ["--pipeline-schedule", "po-h", "--num-layers-per-virtual-pipeline-stage", "1"],
    "zb-v-offload-chunks": ["--pipeline-schedule", "zb-v", "--offload-chunks", "1"],
}


@pytest.mark.parametrize("name", sorted(OFFLOAD))
def test_ramp_under_host_offload_gives_one_process_losses(name):
    """pp 2, 4 layers: every count of the ramp (2, 4 and 6 microbatches) runs its own list, each offloading
    stashes on both ranks, through its own executor (an OffloadStore each) over the same chunks."""
    argv = TINY + ["--num-layers", "4", "--train-samples", "20"]
    layout = ["--pipeline-model-parallel-size", "2", *OFFLOAD[name]]
    sized = build_parser().parse_args(argv + layout)
    for m in (2, 4, 6):
        schedule = build_job_schedule(sized, 1, 2, num_microbatches=m)
        assert all(any(a.op is Op.OFFLOAD for a in actions) for actions in schedule.actions), (name, m)
    reference = pretrain(parse_args(argv))
    ranked = run_distributed(2, _ramp_losses, argv + layout, 2)[0]
    assert [b for b, _ in ranked] == [r["global_batch_size"] for r in reference] == [2, 2, 4, 6, 6]
    assert [loss for _, loss in ranked] == pytest.approx([r["loss"] for r in reference], rel=1e-5)


def test_a_list_with_weight_versions_is_refused_with_a_ramp_whatever_its_name():
    """2BW under another name (a plugin would register it so): its steps overlap without a flush, one count."""
    register_schedule("ramp-test-2bw", two_bw, supports_virtual=False, description="2BW under another name")
    try:
        errors = validate_args(build_parser().parse_args(TINY + ["--pipeline-schedule", "ramp-test-2bw"]), world_size=1)
    finally:
        unregister_schedule("ramp-test-2bw")
    assert any(e.startswith("--rampup-batch-size: the ramp's global batch 2 (2 microbatches per step): "
                            "--pipeline-schedule ramp-test-2bw runs on two weight versions") for e in errors), errors
    assert all("\n" not in e for e in errors)
