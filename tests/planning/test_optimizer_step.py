"""The optimizer step's transient (`memory.optimizer_step_transient_bytes`) against what the step allocates.

Measured with the dry run's `MemoryTracker` around `TrainingOptimizer.step` of the second step (Adam's
moments exist), on real tensors where the world is one process and on the fake backend (NCCL's code path)
for the distributed optimizer at dp > 1; and the planner's per-rank peak, max(backward, optimizer step),
against the committed LLaMA-3-70B dry run.
"""
import json
from pathlib import Path

import pytest
import torch

from megatron_pp.core.comm_check import fake_world
from megatron_pp.core.parallel_state import ParallelState
from megatron_pp.models.layout import split_layers
from megatron_pp.planning.cost import Evaluator
from megatron_pp.planning.efficiency import HARDWARE_PROFILES, HardwareProfile
from megatron_pp.planning.job import Cluster, Configuration, Job
from megatron_pp.planning.memory import (optimizer_step_transient_bytes, stage_parameters_per_gpu,
                                         stage_vector_parameters_per_gpu, state_bytes_per_parameter)
from megatron_pp.training import dry_run
from megatron_pp.training.arguments import model_config_from_args, parse_args

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model-preset", "gpt-tiny", "--mock-data", "--micro-batch-size", "1", "--train-iters", "2",
        "--seq-length", "16", "--max-position-embeddings", "16"]


class _WindowTracker(dry_run.MemoryTracker):
    """The dry run's tracker, also keeping the peak inside a window the test opens."""

    window = None

    def _note(self, t):
        super()._note(t)
        if self.window is not None:
            self.window = max(self.window, self.live_bytes)


def _step_transients(monkeypatch, argv: list[str], world: int, **fields) -> tuple[list[int], dry_run.RankReport]:
    """Run the job's code (`dry_run._run`: model, optimizer, two steps) and return, per optimizer step, its
    peak above what was live when it began. world 1: real tensors; world > 1: fake tensors, fake backend.
    `fields` set arguments no flag exposes (`bucket_bytes`)."""
    args = parse_args(argv + ["--dry-run", str(world)])
    for name, value in fields.items():
        setattr(args, name, value)
    tracker, above = _WindowTracker(), []
    build = dry_run.build_optimizer

    def measured_build(*a, **k):
        opt = build(*a, **k)
        step = opt.step

        def measured_step(*x, **y):
            tracker.window = start = tracker.live_bytes
            out = step(*x, **y)
            above.append(tracker.window - start)
            tracker.window = None
            return out
        opt.step = measured_step
        return opt

    monkeypatch.setattr(dry_run, "build_optimizer", measured_build)
    if world == 1:
        with tracker:
            report = dry_run._run(args, ParallelState.build(1, 1, device=torch.device("cpu")), None, tracker, 2)
    else:
        from torch._subclasses.fake_tensor import FakeTensorMode
        with fake_world(0, world):
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            with mode, tracker:
                state = ParallelState.build(1, 1, device=torch.device("cpu"))
                report = dry_run._run(args, state, mode, tracker, 2)
    return above, report


def _counts(argv: list[str]) -> tuple[int, int]:
    config = model_config_from_args(parse_args(argv + ["--dry-run", "1"]))
    (spec,) = split_layers(config.num_layers, 1, 1)
    return stage_parameters_per_gpu(config, spec), stage_vector_parameters_per_gpu(config, spec)


@pytest.mark.parametrize("precision", [[], ["--bf16"]])
def test_foreach_adamw_holds_sqrt_v_of_the_larger_group_to_the_byte(monkeypatch, precision):
    argv = TINY + ["--global-batch-size", "2", "--dry-run-optimizer", "foreach"] + precision
    above, report = _step_transients(monkeypatch, argv, 1)
    assert report.optimizer_implementation == "torch.optim.AdamW (foreach)"  # --dry-run-optimizer foreach
    params, vectors = _counts(argv)
    assert report.parameter_bytes == params * (2 if precision else 4)  # the planner's count is the model's
    predicted = optimizer_step_transient_bytes(params, vectors, param_bytes=2 if precision else 4,
                                               implementation="foreach")
    assert above[1] == predicted == 4 * (params - vectors)


@pytest.mark.parametrize("precision", [[], ["--bf16"]])
@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("bucket_bytes", [None, 64 * 1024])
def test_distributed_optimizer_holds_every_gathered_bucket_at_once(monkeypatch, precision, dp, bucket_bytes):
    """One bucket, or several (64 KiB): every bucket's shard and its gathered copy are alive together, as
    NCCL's works keep their inputs until waited on. The fake backend's works keep nothing, so before the
    collective helpers held their inputs, several buckets measured only the last bucket's shard."""
    argv = TINY + ["--global-batch-size", str(2 * dp), "--use-distributed-optimizer", "--dry-run-optimizer",
                   "foreach"] + precision
    fields = {"bucket_bytes": bucket_bytes} if bucket_bytes else {}
    above, report = _step_transients(monkeypatch, argv, dp, **fields)
    params, vectors = _counts(argv)
    param_bytes = 2 if precision else 4
    # The state too: an fp32 model's shard is copied as well (8 + 12/dp bytes a parameter, not 8 + 8/dp).
    state = report.parameter_bytes + report.gradient_bytes + report.optimizer_bytes
    assert state == params * state_bytes_per_parameter(dp=dp, distributed_optimizer=True, bf16=bool(precision))
    predicted = optimizer_step_transient_bytes(params, vectors, dp=dp, distributed_optimizer=True,
                                               param_bytes=param_bytes, implementation="foreach")
    assert above[1] == predicted == param_bytes * params * (1 + 1 / dp)


@pytest.mark.parametrize("world", [1, 2])
def test_fused_adamw_allocates_nothing_on_real_and_on_fake_tensors(monkeypatch, world):
    """The kernel a CUDA job runs (torch's fused AdamW; apex's FusedAdam is in place too), which the dry run
    builds by default: on the CPU for real (world 1) and on fake tensors (world 2, dp 2, no distributed
    optimizer), the step holds nothing beside the state but the gradient norm's scalars and Adam's step
    counters, against 4 bytes a parameter for foreach."""
    argv = TINY + ["--global-batch-size", str(2 * world)]
    above, report = _step_transients(monkeypatch, argv, world)
    assert report.optimizer_implementation == "torch.optim.AdamW (fused)"
    params, vectors = _counts(argv)
    assert optimizer_step_transient_bytes(params, vectors, param_bytes=4, implementation="fused") == 0
    assert above[1] < 256, above  # 40 bytes here; foreach: 4 * (params - vectors), over 400 KiB
    assert 4 * (params - vectors) > 400 * 1024


def test_a_tiny_real_run_peaks_in_the_optimizer_step_where_the_planner_says(monkeypatch):
    """gpt-tiny, seq 16, one process, fp32 on CPU (foreach AdamW, as a CPU job builds it): activations are
    small, so the peak is state + sqrt(v)."""
    argv = TINY + ["--global-batch-size", "2", "--dry-run-optimizer", "foreach"]
    _, report = _step_transients(monkeypatch, argv, 1)
    args = parse_args(argv + ["--dry-run", "1"])
    job = Job("gpt-tiny", model_config_from_args(args), 2, attention_backend="sdpa", device_type="cpu")
    cpu = HardwareProfile("CPU", peak_tflops=1.0, memory_gib=1.0, hbm_gbps=10.0, tp_link_gbps=1.0,
                          pair_link_gbps=1.0, gpus_per_node=1)
    prediction = Evaluator(job, Cluster(1, cpu)).evaluate(
        Configuration(tp=1, pp=1, dp=1, micro_batch_size=1, recompute="none", schedule="1f1b"), exact=True)
    assert report.peak_at.endswith("optimizer") and prediction.peak_phase(0) == "optimizer"
    # The state is exact; what the planner leaves out is the step's few KiB (loss, norm scalars, counters).
    assert 0 <= report.peak_bytes - prediction.memory_bytes[0] <= 0.002 * report.peak_bytes


def _llama70b_dry_run() -> tuple[list[str], dict[int, dict]]:
    measured = {}
    for name in ("", "_ranks_24_32", "_ranks_40_48", "_ranks_56"):
        result = json.loads((ROOT / f"docs/results/dry_run_bench_llama3_70b{name}.json").read_text())["results"][0]
        measured.update({r["pipeline_rank"]: r for r in result["ranks"]})
    return result["command"].split()[2:], measured


def test_planner_within_3_percent_of_the_llama3_70b_dry_run_on_every_pipeline_rank():
    """The committed dry run (tp 8 x pp 8, 1F1B, m 64): ranks 0-5 peak in a backward, 6 and 7 in the
    optimizer step, whose foreach AdamW (what the dry run's CPU tensors run) the planner now counts."""
    argv, measured = _llama70b_dry_run()
    args = parse_args(argv)
    job = Job("llama3-70b", model_config_from_args(args), 64, attention_backend="flash",
              optimizer_implementation="foreach")
    prediction = Evaluator(job, Cluster(64, HARDWARE_PROFILES["h100-sxm"])).evaluate(
        Configuration(tp=8, pp=8, dp=1, micro_batch_size=1, recompute="none", schedule="1f1b"), exact=True)
    for rank in range(8):
        ratio = prediction.memory_bytes[rank] / measured[rank]["peak_bytes"]
        assert abs(ratio - 1) <= 0.03, (rank, ratio)
        phase = "optimizer" if measured[rank]["peak_at"].endswith("optimizer") else "pipeline"
        assert prediction.peak_phase(rank) == phase, rank
    assert [prediction.peak_phase(r) for r in range(8)] == ["pipeline"] * 6 + ["optimizer"] * 2
