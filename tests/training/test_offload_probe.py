"""The start-up measurement of --offload-time: what it counts, and that training uses what it measured."""
from __future__ import annotations

import torch

from megatron_pp.models.presets import get_preset
from megatron_pp.training.offload_probe import measure_offload_time
from tests.dist import run_distributed


def test_probe_counts_one_layers_stash_and_times_its_copy():
    config = get_preset("llama-tiny")
    probe = measure_offload_time(config, micro_batch_size=2, device=torch.device("cpu"), repeats=2)
    s, b, h = config.seq_length, 2, config.hidden_size
    # At least the layer's input and the two norms' outputs (s*b*h each) are saved; far less than 100 of them.
    assert 3 * s * b * h * 4 <= probe.stash_bytes <= 100 * s * b * h * 4
    assert probe.forward_s > 0 and probe.copy_s > 0
    assert probe.offload_time == probe.copy_s / probe.forward_s and probe.copy_gbps > 0


def _pretrain_offload(ctx, argv):
    from megatron_pp.training import train
    from megatron_pp.training.arguments import parse_args

    seen = {}
    original = train.build_job_schedule

    def recording(*args, **kwargs):
        seen["offload_time"] = kwargs.get("offload_time")
        return original(*args, **kwargs)

    train.build_job_schedule = recording
    try:
        args = parse_args(argv)
        rows = train.pretrain(args, state=ctx.parallel_state(1, args.pipeline_model_parallel_size))
    finally:
        train.build_job_schedule = original
    return seen.get("offload_time"), [r["loss"] for r in rows if "loss" in r]


def test_measured_offload_time_is_agreed_and_used():
    argv = ["--model-preset", "gpt-tiny", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "4",
            "--train-iters", "1", "--lr", "1e-3", "--pipeline-model-parallel-size", "2",
            "--num-layers-per-virtual-pipeline-stage", "1", "--pipeline-schedule", "po-h"]
    measured = run_distributed(2, _pretrain_offload, argv + ["--measure-offload-time"])
    (t0, losses), (t1, _) = measured
    assert t0 is not None and t0 == t1 and t0 > 0  # every rank builds the schedule with the same figure
    default = run_distributed(2, _pretrain_offload, argv)
    assert default[0][0] is None  # on CPU the documented constant stays unless asked
    assert losses == default[0][1]  # where the copies go never changes the numbers
