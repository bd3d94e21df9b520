"""The pretraining job: arguments → parallel state → schedule → data → model chunks → trainer.

`pretrain(args)` reads top to bottom: seed, build the schedule (registered, from a plugin, or from
`--pipeline-schedule-file`; the same `arguments.build_job_schedule` the argument checks ran), the data and
the model config, this rank's pipeline and the optimizer; resume from `--load` if there is a checkpoint;
then hand over to the trainer. `main` wraps it in the error policy of docs/reliability.md.

The jobs live in their own modules: `pipeline` (chunks and executor of one rank), `step_data` (what each
step reads), `step` (one iteration's forward and backward, and the agreed metrics), `trainer` (the loop:
evaluation, checkpoints, logging, trace) and `twobw` (PipeDream-2BW's loop without flushes, chosen when the
schedule's lists carry weight versions).

One iteration: the rank's microbatches of the global batch go through the pipeline executor (which runs the
validated action list), gradients are finalised (sequence-parallel, tied embedding and data-parallel
reductions), the global gradient norm is computed and clipped, the optimizer steps with the iteration's
learning rate, and the logging rank writes a metrics row. Validation runs the schedule's own forward actions
only through the same executor (`PipelineExecutor.run(..., forward_only=True)`) under `torch.no_grad()`, with
dropout off and the random generators put back afterwards, so every schedule and placement evaluates the way
it trains and evaluating never changes the training trajectory.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
import typing
from typing import Any, Callable, Optional, Sequence

import numpy as np

from megatron_pp.core import comm
from megatron_pp.core.parallel_state import ParallelState, init_distributed, read_launch_env, rendezvous_store
from megatron_pp.core.tensor_parallel import model_parallel_seed
from megatron_pp.models.config import TransformerConfig
from megatron_pp.models.ops import use_fused_rotary
from megatron_pp.models.recompute import RecomputeConfig
from megatron_pp.training.arguments import (build_job_schedule, model_config_from_args, num_chunks, parse_args,
                                            schedule_takes_offload_time, uses_file_data, virtual_stages_given)
from megatron_pp.training.batch_ramp import BatchSizes
from megatron_pp.training.checkpointing import (
    CheckpointError,
    TrainingState,
)
from megatron_pp.training.errors import EXIT_FAILURE, agree_on_usage_errors, report_runtime_error
from megatron_pp.training.faults import FaultPlan
from megatron_pp.training.flops import iteration_flops, peak_tflops
from megatron_pp.training.layered import connect_optimizer
from megatron_pp.training.megatron_compat import accepted_without_effect
from megatron_pp.training.metrics import MetricsLogger
from megatron_pp.training.offload_probe import OffloadProbe, measure_offload_time
from megatron_pp.training.optimizer import LRSchedule, OptimizerConfig, build_optimizer
from megatron_pp.training.signals import ExitConditions
from megatron_pp.training.watchdog import Watchdog
from megatron_pp.training.pipeline import Pipeline, build_job_pipeline, build_pipeline, connect_param_gather
from megatron_pp.training.step import global_token_count, step_metrics, train_step
from megatron_pp.training.step_data import MockSplit, build_config_and_data
from megatron_pp.training.trainer import REDACTED, Trainer, TrainingStopped, loggable_settings
from megatron_pp.training.twobw import DeferredUpdateSteps
from megatron_pp.training.weight_versions import DelayedUpdateOptimizer

# The names programs and tests use from here; each lives in the module that does the job.
__all__ = ["pretrain", "main", "build_pipeline", "Pipeline", "train_step", "step_metrics", "global_token_count",
           "MockSplit", "Trainer", "TrainingStopped", "loggable_settings", "REDACTED", "probe_offload_time"]


# The job ----------------------------------------------------------------------------------------------


def seed_everything(seed: int, state: ParallelState) -> None:
    """Python, NumPy, torch and the tensor-parallel RNG tracker (streams differ by pipeline stage and,
    for the tracker, by tensor-parallel rank; see `core.tensor_parallel.random`)."""
    random.seed(seed)
    np.random.seed(seed)
    model_parallel_seed(seed, state.tp_rank, state.pp_rank)


def _recomputed_layers(recompute: RecomputeConfig, pipe: Pipeline) -> Optional[int]:
    """Layers of the whole model re-run in the backward under full recompute (None: all of them).

    Block recompute checkpoints the first N layers of every stage, so fewer than all layers re-run.
    """
    if recompute.granularity != "full" or recompute.method != "block":
        return None
    return sum(min(recompute.num_layers, spec.num_layers) for spec in pipe.layout)


def probe_offload_time(args: argparse.Namespace, shape: TransformerConfig, state: ParallelState) -> Optional[OffloadProbe]:
    """Measure `--offload-time` when the schedule places host copies, the user did not give it, and
    `--measure-offload-time` is on (default: on CUDA). Collective; None when nothing is measured."""
    if not schedule_takes_offload_time(args) or args.offload_time is not None:
        return None
    measure = args.measure_offload_time
    if not (state.device.type == "cuda" if measure is None else measure):
        return None
    probe = measure_offload_time(shape, args.micro_batch_size, state.device)
    if state.rank == 0:
        print(f"megatron_pp: measured --offload-time {probe.offload_time:.3f} (one layer: stash "
              f"{probe.stash_bytes / 2**20:.1f} MiB, forward {probe.forward_s * 1e3:.2f} ms, copy to host "
              f"{probe.copy_s * 1e3:.2f} ms = {probe.copy_gbps:.1f} GB/s)", flush=True)
    return probe


def connect_batch_ramp(args: argparse.Namespace, pipe: Pipeline, optimizer: Any, chunks: Optional[int],
                       offload_time: Optional[float]) -> Optional[str]:
    """With --rampup-batch-size: give the pipeline the job's schedule at any microbatch count (each validated,
    built on first use, its executor connected to the optimizer) and return the start-up line; else None."""
    if args.rampup_batch_size is None:
        return None
    state = pipe.state
    pipe.schedule_for = lambda m: build_job_schedule(args, state.dp_size, chunks, offload_time=offload_time,
                                                     num_microbatches=m)
    pipe.on_new_executor = lambda executor: connect_optimizer(executor, optimizer)
    ramp = BatchSizes.from_args(args).ramp_batches()
    return (f"megatron_pp: batch-size ramp-up (--rampup-batch-size {' '.join(map(str, args.rampup_batch_size))}): "
            f"global batch {ramp[0]} -> {args.global_batch_size} over {len(ramp)} iterations ({sum(ramp)} samples), "
            f"{args.train_iters} iterations in all")


def pretrain(args: argparse.Namespace, state: Optional[ParallelState] = None,
             on_iteration: Optional[Callable[[dict], None]] = None) -> list[dict]:
    """Run the configured training job; returns rank 0's metric rows (training and evaluation; empty
    on other ranks). `args` come from `parse_args`; `state` is built here unless given (by an embedding
    program that already has the process groups); `on_iteration(row)` is called on every rank after
    every training step.

    Cheap checks come first, so bad input fails before expensive work and before any output exists:
    the schedule is built before the datasets (whose index caches can take minutes), and the metrics,
    TensorBoard and wandb outputs are opened only once the checkpoint of `--load` has loaded."""
    started = time.monotonic()
    if state is None:
        init_distributed(args.distributed_backend, timeout_s=60.0 * getattr(args, "distributed_timeout_minutes", 10.0))
        state = ParallelState.build(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    seed_everything(args.seed, state)
    if args.apply_rope_fusion:
        use_fused_rotary(True)
    # The layer count decides the chunks; the vocabulary (the tokenizer's, with file data) does not matter yet.
    shape = model_config_from_args(args, vocab_size=1 if uses_file_data(args) else None)
    chunks = num_chunks(args, shape) if virtual_stages_given(args) or not args.pipeline_schedule_file else None
    probe = probe_offload_time(args, shape, state)
    schedule = build_job_schedule(args, state.dp_size, chunks, offload_time=probe.offload_time if probe else None)
    config, data = build_config_and_data(args, state)
    pipe = build_job_pipeline(args, config, state, schedule, trace=bool(args.trace_file))
    if pipe.versions is not None:  # 2BW: one optimizer state, updates deferred into the action lists
        optimizer = DelayedUpdateOptimizer(pipe.chunks, state, OptimizerConfig.from_args(args), pipe.versions)
    else:
        optimizer = build_optimizer(pipe.chunks, state, OptimizerConfig.from_args(args))
    connect_optimizer(pipe.executor, optimizer)  # REDUCE_GRAD -> its reducer; sharded weights' gathers
    connect_param_gather(args, pipe, optimizer)  # --overlap-param-gather: each chunk's forward finishes its own
    ramp_line = connect_batch_ramp(args, pipe, optimizer, chunks, probe.offload_time if probe else None)
    checkpoint = TrainingState(
        chunks=pipe.chunks, stage_ids=pipe.stage_ids, stages=pipe.layout, placement=schedule.placement,
        state=state, config=config, schedule_name=schedule.name, optimizer=optimizer,
        optimizer_sharded_by_dp=args.use_distributed_optimizer,
    )
    logger: Optional[MetricsLogger] = None
    trainer = Trainer(args, pipe, data, optimizer, LRSchedule.from_args(args), checkpoint,
                      flops=iteration_flops(config, args.global_batch_size, tp=state.tp_size,
                                            recompute_granularity=pipe.recompute.granularity,
                                            recomputed_layers=_recomputed_layers(pipe.recompute, pipe)),
                      peak_tflops=peak_tflops(state.device, args.peak_tflops), logger=None,
                      faults=FaultPlan.from_env(state.rank, state.world_size), on_iteration=on_iteration)
    if pipe.versions is not None:  # lists with weight versions: steps overlap, the update is deferred
        trainer.steps = DeferredUpdateSteps(trainer)
    try:
        trainer.log(
            f"megatron_pp: world {state.world_size} = tp {state.tp_size} x pp {state.pp_size} x dp {state.dp_size}, "
            f"schedule {schedule.name} (m={schedule.num_microbatches}, v={schedule.num_chunks}), "
            f"{config.num_parameters(state.tp_size) / 1e6:.2f}M parameters"
        )
        if ramp_line is not None:
            trainer.log(ramp_line)
        compat_line = accepted_without_effect(args)  # Megatron-LM flags that tune only its own machinery
        if compat_line is not None:
            trainer.log(compat_line)
        trainer.resume()
        if data.vocab_size is not None and trainer.progress.iteration < args.train_iters:
            # A dataset from another tokenizer is refused here, before any output file exists.
            data.microbatches(data.train, trainer.progress.consumed_samples, state.dp_rank, state.device)
        if state.rank == 0:
            logger = MetricsLogger(
                train_iters=args.train_iters, log_interval=args.log_interval, log_throughput=args.log_throughput,
                metrics_file=args.metrics_file, tensorboard_dir=args.tensorboard_dir,
                wandb_project=args.wandb_project, wandb_exp_name=args.wandb_exp_name,
                wandb_save_dir=args.wandb_save_dir, run_config=loggable_settings(vars(args)),
                resumed_at=trainer.progress.iteration if trainer.progress.iteration > 0 else None,
            )
            trainer.attach_logger(logger)
            logger.start(trainer.progress.iteration)
        with ExitConditions(handle_signals=args.exit_signal_handler, exit_interval=args.exit_interval,
                            exit_duration_mins=args.exit_duration_in_mins, started=started,
                            device=state.device) as exit_conditions:
            return trainer.run(exit_conditions)
    finally:
        if logger is not None:
            logger.close()
        optimizer.reducer.close()


# Errors that mean "the input is wrong" (a file, a checkpoint, a schedule that cannot run), found once
# the job runs: one line and exit 1. Every other exception is a bug and keeps its traceback.
# MEGATRON_PP_TRACEBACK=1 shows the traceback of the input errors too.
INPUT_ERRORS = (ValueError, OSError)


def start_watchdog(args: argparse.Namespace, launch: Any) -> Optional[Watchdog]:
    """The heartbeat watchdog of a multi-process run (None for one process or --heartbeat-timeout-seconds 0)."""
    if not comm.is_distributed() or launch.world_size < 2 or not args.heartbeat_timeout_seconds:
        return None
    return Watchdog.connect(launch.master_addr, launch.master_port, launch.rank, launch.world_size,
                            args.heartbeat_timeout_seconds).start()


def main(argv: Optional[Sequence[str]] = None, description: str = "megatron_pp pretraining",
         default_preset: Optional[str] = None) -> None:
    """The entry point of pretrain_*.py: arguments, process group and watchdog, training, and the
    error policy of docs/reliability.md (each error line once for the whole job, exit 2 for usage
    errors and 1 for failures, never a hang)."""
    launch = read_launch_env()
    # The ranks meet on the rendezvous store before checking their arguments, so that a usage error is
    # printed once for the job (`errors.agree_on_usage_errors`); the process group is built on it after.
    store = rendezvous_store(launch)
    args = parse_args(argv, description, default_preset,
                      agree=lambda lines: agree_on_usage_errors(lines, store, launch.rank, launch.world_size))
    if getattr(args, "dry_run", None):  # the job's code on fake tensors, one process (docs/dry_run.md)
        from megatron_pp.training import dry_run

        sys.exit(dry_run.main(args))
    show_traceback = os.environ.get("MEGATRON_PP_TRACEBACK") == "1"
    watchdog: Optional[Watchdog] = None

    def fail(exc: BaseException, agreed: bool) -> "typing.NoReturn":
        if watchdog is not None:
            watchdog.quiet()  # this rank's own error is the message, not the watchdog's
        if show_traceback:
            raise exc
        # A rank whose agreed error only says "another rank failed" leaves the telling to that rank.
        report_runtime_error(str(exc), store, launch.rank, launch.world_size, echo=getattr(exc, "echo", False))
        if watchdog is not None:
            if agreed:
                watchdog.stop()  # every rank stops here by itself: nobody is to blame
            else:
                watchdog.report_failure()  # the others stop now, silently, instead of at a heartbeat timeout
        # Data flags that cannot build the splits (DataFlagError, CacheMismatch) are usage errors: exit 2.
        sys.exit(getattr(exc, "exit_status", EXIT_FAILURE))

    try:
        init_distributed(args.distributed_backend, timeout_s=60.0 * args.distributed_timeout_minutes, store=store)
        watchdog = start_watchdog(args, launch)
        pretrain(args)
    except (CheckpointError, TrainingStopped) as exc:
        fail(exc, agreed=True)  # every rank raises the same agreed error in the same place
    except INPUT_ERRORS as exc:
        fail(exc, agreed=False)
    except RuntimeError:
        # A collective failed: usually a peer died (gloo: "connection closed by peer"). Let the watchdog
        # name it; it ends this process. Without a verdict, it is a bug: keep the traceback.
        if watchdog is not None:
            watchdog.wait_for_verdict()
        raise
    if watchdog is not None:
        watchdog.stop()
    comm.shutdown()
