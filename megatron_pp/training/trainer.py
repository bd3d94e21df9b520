"""The training loop of one rank: iterations, evaluation, checkpoints, numerics checks, metrics rows, trace.

`Trainer.run` iterates to `--train-iters` or an early exit. After an iteration come, when due, a validation
pass (`--eval-interval`), a checkpoint (`--save-interval`) and the early-exit check (signals,
`--exit-interval`, `--exit-duration-in-mins`), which saves before stopping. The run also saves when
training completes. How iterations run is the step driver's: `FlushedSteps` here, and for schedules whose
lists carry weight versions (PipeDream-2BW) `training.twobw.DeferredUpdateSteps`, which overlaps steps.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import torch

from megatron_pp.core import comm
from megatron_pp.core.parallel_state import ParallelState
from megatron_pp.schedules.execute import StepResult
from megatron_pp.core import clock
from megatron_pp.core.clock import ClockSync, JobClock
from megatron_pp.training.batch_ramp import BatchSizes
from megatron_pp.training.checkpointing import (
    CheckpointError,
    TrainingState,
    capture_rng_state,
    load_checkpoint,
    read_tracker,
    restore_rng_state,
    save_checkpoint,
)
from megatron_pp.training.faults import FaultPlan, poison_first_gradient
from megatron_pp.training.flops import IterationFlops
from megatron_pp.training.layered import all_weights
from megatron_pp.training.manual_gc import ManualGC
from megatron_pp.training.metrics import MetricsLogger
from megatron_pp.training.optimizer import LRSchedule, TrainingOptimizer
from megatron_pp.training.pipeline import Pipeline, finish_param_gather
from megatron_pp.training.signals import ExitConditions
from megatron_pp.training.step import step_metrics, train_step
from megatron_pp.training.step_data import TrainingData, evaluation_enabled


@dataclass
class Progress:
    """Where training stands: completed iterations and the samples they consumed."""

    iteration: int = 0
    consumed_samples: int = 0


class TrainingStopped(RuntimeError):
    """Training cannot go on (e.g. --max-consecutive-nonfinite reached); raised on every rank in the same
    iteration, with a one-line message."""


@dataclass
class Trainer:
    """One rank's training job, assembled by `pretrain`."""

    args: argparse.Namespace
    pipe: Pipeline
    data: TrainingData
    optimizer: TrainingOptimizer
    lr_schedule: LRSchedule
    checkpoint: TrainingState
    flops: IterationFlops
    peak_tflops: Optional[float]
    logger: Optional[MetricsLogger]
    progress: Progress = field(default_factory=Progress)
    last_saved: Optional[int] = None
    traces: list[list[tuple[str, float, float]]] = field(default_factory=list)
    """Per step, the executed actions as (label, start, end) on this rank's `time.perf_counter()`."""
    clock_start: Optional[ClockSync] = None  # the trace's first clock sync (see core/clock.py)
    faults: FaultPlan = field(default_factory=lambda: FaultPlan([], 0, 1))
    on_iteration: Optional[Callable[[dict], None]] = None
    """Called on every rank with each training row (benchmarks/soak.py samples memory through it)."""
    nonfinite_streak: int = 0
    recent_losses: list[float] = field(default_factory=list)
    pending_messages: list[str] = field(default_factory=list)
    """Messages logged before the logger exists (it is opened only once the setup has succeeded)."""
    steps: Optional["StepDriver"] = None
    """How iterations are run: `FlushedSteps` (default) or, for lists that carry weight versions,
    `training.twobw.DeferredUpdateSteps` (`pretrain` picks it)."""
    batch_sizes: Optional[BatchSizes] = None
    """Each iteration's global batch (default from the flags: constant, or --rampup-batch-size's ramp-up)."""

    def __post_init__(self) -> None:
        if self.steps is None:
            self.steps = FlushedSteps(self)
        if self.batch_sizes is None:
            self.batch_sizes = BatchSizes.from_args(self.args)

    @property
    def state(self) -> ParallelState:
        return self.pipe.state

    def log(self, text: str) -> None:
        if self.logger is not None:
            self.logger.message(text)
        elif self.state.rank == 0:
            self.pending_messages.append(text)

    def attach_logger(self, logger: Optional[MetricsLogger]) -> None:
        self.logger = logger
        if logger is not None:
            for text in self.pending_messages:
                logger.message(text)
        self.pending_messages.clear()

    def train_iteration(self) -> dict:
        """One optimizer step on the next global batch; returns its metrics row (on every rank).

        The global batch is `batch_sizes.at(consumed samples)` (constant, or the batch-size ramp-up's), and
        the learning rate is the schedule's at the position before the step, as Megatron-LM's scheduler
        reads it (stepped after each update: its first step runs at the warm-up's starting rate)."""
        args, pipe, state = self.args, self.pipe, self.state
        start = time.perf_counter()
        consumed = self.progress.consumed_samples
        batch = self.batch_sizes.at(consumed)
        microbatches = self.data.microbatches(self.data.train, consumed, state.dp_rank, state.device, batch)
        iteration = self.progress.iteration + 1
        lr = self.lr_schedule.learning_rate(iteration - 1, consumed)
        result, tokens = train_step(pipe, microbatches, self.optimizer)
        self.faults.after_backward(iteration, lambda: poison_first_gradient(self.optimizer.reducer.held_pieces()))
        outcome = self.optimizer.step(lr, self.lr_schedule.decoupled_rate(iteration - 1, consumed))
        metrics = step_metrics(pipe, result, tokens)
        step_time = time.perf_counter() - start
        self.progress.iteration += 1
        self.progress.consumed_samples += batch
        if args.trace_file:
            self.traces.append(local_events(result))
        share = batch / args.global_batch_size  # FLOPs are linear in the batch (a ramp-up step is smaller)
        tflops = share * self.flops.model / step_time / state.world_size / 1e12
        hardware_tflops = share * self.flops.hardware / step_time / state.world_size / 1e12
        return {
            "iteration": self.progress.iteration,
            "consumed_samples": self.progress.consumed_samples,
            "loss": metrics.loss,
            "grad_norm": outcome.grad_norm,
            "lr": lr,
            "global_batch_size": batch,
            "loss_scale": 1.0 if outcome.loss_scale is None else outcome.loss_scale,  # 1.0: no loss scaling
            "skipped": outcome.skipped,
            "step_time_s": step_time,
            "tokens_per_s": metrics.tokens / step_time,
            "tflops_per_gpu": tflops,
            "mfu": tflops / self.peak_tflops if self.peak_tflops else None,
            "hfu": hardware_tflops / self.peak_tflops if self.peak_tflops else None,
            "peak_stash_bytes": metrics.peak_stash_bytes,
            "peak_memory_bytes": metrics.peak_memory_bytes,
            "comm_wait_s": result.comm_wait_s,
        }

    def ramp_changes_after(self, iteration: int) -> bool:
        """Whether the batch-size ramp-up gives the iteration after `iteration` (about to run, with the consumed
        samples of `progress`) another global batch, and so another microbatch count, with --save: Megatron-LM
        saves a checkpoint there (its training loop, when `update_num_microbatches` changes the count), and so
        do we, unless the run ends at `iteration` (it saves then anyway)."""
        if not (self.args.save and self.batch_sizes.ramps) or iteration >= self.args.train_iters:
            return False
        batch = self.batch_sizes.at(self.progress.consumed_samples)
        return self.batch_sizes.at(self.progress.consumed_samples + batch) != batch

    def evaluate(self, block: int = 0) -> dict:
        """Validation loss over `--eval-iters` global batches: block `block` of them, as Megatron-LM reads
        one block after another (evaluation k at iteration k·eval_interval reads block k − 1, the
        closing one block train_iters // eval_interval). Collective."""
        self.steps.prepare_weights()
        args, state = self.args, self.state
        start = time.perf_counter()
        rng = capture_rng_state()
        for chunk in self.pipe.chunks:
            chunk.eval()
        try:
            loss_sum = torch.zeros((), dtype=torch.float64)
            tokens = torch.zeros((), dtype=torch.float64)
            with torch.no_grad(), all_weights(self.optimizer):
                for e in range(args.eval_iters):
                    first = (block * args.eval_iters + e) * args.global_batch_size
                    batches = self.data.microbatches(self.data.valid, first, state.dp_rank, state.device)
                    result = self.pipe.executor.run(batches, loss_scale=1.0, forward_only=True)
                    if result.loss_sum is not None:
                        loss_sum += result.loss_sum.double().cpu()
                        tokens += result.token_count.double().cpu()
        finally:
            for chunk in self.pipe.chunks:
                chunk.train()
            restore_rng_state(rng)
        totals = torch.stack([loss_sum, tokens])
        if state.dp_group is not None and state.dp_size > 1:
            totals = comm.all_reduce(totals, group=state.dp_group)
        # Only the ranks holding the last stage have the sums: a world max carries them to everyone.
        carried = totals if self._holds_last_stage() else torch.full((2,), -math.inf, dtype=torch.float64)
        carried = comm.all_reduce(carried, op="max")
        loss = float(carried[0] / carried[1])
        return {
            "iteration": self.progress.iteration,
            "consumed_samples": self.progress.consumed_samples,
            "eval_loss": loss,
            "eval_ppl": math.exp(loss) if loss < 700 else math.inf,
            "eval_tokens": int(carried[1]),
            "eval_time_s": time.perf_counter() - start,
        }

    def _holds_last_stage(self) -> bool:
        return self.pipe.schedule.num_stages - 1 in self.pipe.stage_ids

    def save(self) -> None:
        self.steps.prepare_weights()
        args, iteration = self.args, self.progress.iteration
        try:
            with all_weights(self.optimizer), self.faults.during_save(iteration):
                path = save_checkpoint(
                    args.save, iteration, self.checkpoint,
                    consumed_samples=self.progress.consumed_samples, save_optimizer=not args.no_save_optim,
                    extra_metadata={"args": loggable_settings(vars(args))}, schedule_state=self.schedule_state(),
                )
        except CheckpointError as exc:  # agreed: every rank is here
            if not getattr(args, "continue_on_save_failure", False):
                raise
            self.log(f"warning: checkpoint of iteration {iteration} not written ({exc}); training goes on "
                     f"(--continue-on-save-failure); newest checkpoint: {_newest_checkpoint(args.save)}")
            return
        self.last_saved = iteration
        self.log(f"saved checkpoint {path}")

    def check_numerics(self, row: dict) -> Optional[str]:
        """Non-finite steps and loss spikes of a training row (the same verdict on every rank: the loss
        and the skip decision are agreed). Returns why training must stop, or None; marks spikes in
        the row (`loss_spike`) and logs them."""
        args, iteration, loss = self.args, row["iteration"], row["loss"]
        # fp16 overflows are expected while the loss scale settles: the scaler skips and backs off.
        if not math.isfinite(loss) or (row["skipped"] and not args.fp16):
            self.nonfinite_streak += 1
            limit = getattr(args, "max_consecutive_nonfinite", 1)
            self.log(f"warning: iteration {iteration}: non-finite loss or gradient (loss {loss}), step skipped "
                     f"({self.nonfinite_streak} consecutive, limit {limit})")
            if self.nonfinite_streak >= limit:
                return (f"iteration {iteration}: loss or gradients not finite for {self.nonfinite_streak} consecutive "
                        f"step(s) (--max-consecutive-nonfinite {limit}); stopped without saving; newest checkpoint: "
                        f"{_newest_checkpoint(args.save)}")
            return None
        self.nonfinite_streak = 0
        factor = getattr(args, "loss_spike_factor", None)
        if factor:
            window = args.loss_spike_window
            history = self.recent_losses
            if len(history) >= max(2, window // 2):
                median = statistics.median(history)
                row["loss_spike"] = loss > factor * median
                if row["loss_spike"]:
                    self.log(f"warning: loss spike at iteration {iteration}: {loss:.4f} is {loss / median:.1f}x the "
                             f"median {median:.4f} of the last {len(history)} losses (--loss-spike-factor {factor:g})")
            else:
                row["loss_spike"] = False
            history.append(loss)
            del history[:-window]
        return None

    def resume(self) -> None:
        args = self.args
        if args.load is None:
            return
        with all_weights(self.optimizer, write_back=True):
            resumed = load_checkpoint(
                args.load, self.checkpoint, load_optimizer=not args.no_load_optim, load_rng=not args.no_load_rng,
                finetune=args.finetune, exit_on_missing=args.exit_on_missing_checkpoint,
            )
        if resumed is None:
            self.log(f"no checkpoint in --load {args.load}: starting from scratch")
            return
        self.progress = Progress(resumed.iteration, resumed.consumed_samples)
        self.last_saved = resumed.iteration if not args.finetune else None
        self.load_schedule_state(resumed.schedule_state)
        self.log(f"loaded checkpoint {resumed.path}: iteration {resumed.iteration}, "
                 f"consumed samples {resumed.consumed_samples}")

    def schedule_state(self) -> dict:
        """What the schedule carries from one step to the next, saved in every rank's checkpoint file
        (2BW: the older weight version, see `training.twobw`); nothing for flushed schedules."""
        return self.steps.schedule_state()

    def load_schedule_state(self, state: dict) -> None:
        """Take back what `schedule_state` saved, once the checkpoint's weights and optimizer are loaded."""
        self.steps.load_schedule_state(state)

    def _recorder(self, rows: list[dict]) -> Callable[..., None]:
        """`record(row, evaluation=False)`: log a training or evaluation row and keep it in `rows` (on the
        logging rank only)."""

        def record(row: dict, evaluation: bool = False) -> None:
            if self.logger is not None:
                rows.append(row)
                (self.logger.evaluation if evaluation else self.logger.train)(row)

        return record

    def run(self, exit_conditions: ExitConditions) -> list[dict]:
        """Iterate to `--train-iters` or an early exit; returns the logging rank's rows.

        The step driver runs the iterations. The loop tells it ahead which iterations end training,
        evaluate or save (`flush`: a driver whose steps overlap, like 2BW's, ends such a call with nothing
        in flight); a stop is agreed either before an iteration (a driver that learns it from earlier
        metrics) or after it (`ExitConditions.check`, a collective). With `--manual-gc` the garbage
        collector runs only at the iteration boundaries `ManualGC` names."""
        args = self.args
        manual_gc = ManualGC(getattr(args, "manual_gc", False), getattr(args, "manual_gc_interval", 0),
                             not getattr(args, "no_manual_gc_eval", False))
        with manual_gc:
            return self._iterate(exit_conditions, manual_gc)

    def _iterate(self, exit_conditions: ExitConditions, manual_gc: ManualGC) -> list[dict]:
        args = self.args
        rows: list[dict] = []
        record = self._recorder(rows)

        last_eval: Optional[int] = None
        stop: Optional[str] = None
        if args.trace_file:
            self.clock_start = clock.measure()
        while self.progress.iteration < args.train_iters:
            iteration = self.progress.iteration + 1
            evaluate = evaluation_enabled(args) and iteration % args.eval_interval == 0
            save = bool(args.save and args.save_interval and iteration % args.save_interval == 0)
            ramp_save = self.ramp_changes_after(iteration)
            stop = self.steps.stop_before(iteration, exit_conditions)
            flush = stop is not None or evaluate or save or ramp_save or iteration == args.train_iters
            numerics: Optional[str] = None
            for row in self.steps.advance(flush, exit_conditions):
                # Every rank builds the same rows (agreed loss and skip decision), so every rank stops at
                # the same row.
                numerics = numerics or self.check_numerics(row)
                record(row)
                if self.on_iteration is not None:
                    self.on_iteration(row)
            if numerics is not None:
                raise TrainingStopped(numerics)
            manual_gc.after_iteration(iteration)
            if evaluate:
                with manual_gc.evaluation():
                    record(self.evaluate(iteration // args.eval_interval - 1), evaluation=True)
                last_eval = iteration
            if save:
                self.save()
            if stop is None:
                stop = self.steps.stop_after(iteration, exit_conditions)
            if stop is not None:
                if args.save and self.last_saved != iteration:
                    self.save()
                self.log(f"exiting after iteration {iteration}: {stop}")
                break
            if ramp_save and self.last_saved != iteration:
                self.log(f"batch-size ramp-up: the next iteration runs another microbatch count; checkpoint of "
                         f"iteration {iteration}, as Megatron-LM saves at each change")
                self.save()
        finish_param_gather(self.optimizer)  # nothing left in flight when training ends
        if stop is None:
            if evaluation_enabled(args) and last_eval != self.progress.iteration:
                with manual_gc.evaluation():
                    record(self.evaluate(args.train_iters // args.eval_interval), evaluation=True)
            if args.save and self.progress.iteration > 0 and self.last_saved != self.progress.iteration:
                self.save()
        if args.trace_file:
            self.write_trace(args.trace_file)
        return rows

    def write_trace(self, path: str) -> None:
        """Gather every rank's actions on rank 0's clock and write them (collective)."""
        assert self.clock_start is not None
        job_clock = JobClock(self.clock_start, clock.measure())
        events = [(label, job_clock.to_job(s), job_clock.to_job(e)) for step in self.traces for label, s, e in step]
        gathered = comm.all_gather_object((events, job_clock.start.offset, job_clock.end.offset, job_clock.error))
        if self.state.rank == 0:
            write_trace(path, [g[0] for g in gathered], clock_notes={
                "clock": "rank 0's time.perf_counter(); other ranks mapped by offsets measured at a barrier "
                         "(min round trip of 8) when tracing started and ended, linear in between",
                "offset_start_s": [g[1] for g in gathered], "offset_end_s": [g[2] for g in gathered],
                "error_bound_s": [g[3] for g in gathered]})


class StepDriver(Protocol):
    """How a `Trainer` runs iterations (see `Trainer.run`)."""

    def advance(self, flush: bool, exit_conditions: ExitConditions) -> list[dict]:
        """Run the next iteration; return the metrics rows it completed (every rank builds the same)."""

    def stop_before(self, iteration: int, exit_conditions: ExitConditions) -> Optional[str]:
        """An agreed reason to make `iteration` the last one, known before it runs."""

    def stop_after(self, iteration: int, exit_conditions: ExitConditions) -> Optional[str]:
        """An agreed reason to stop after `iteration` (may be collective)."""

    def prepare_weights(self) -> None:
        """Put the weights that evaluation and checkpoints see in place."""

    def schedule_state(self) -> dict: ...

    def load_schedule_state(self, state: dict) -> None: ...


class FlushedSteps:
    """One flushed step per iteration (every schedule but those with weight versions)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def advance(self, flush: bool, exit_conditions: ExitConditions) -> list[dict]:
        return [self.trainer.train_iteration()]

    def stop_before(self, iteration: int, exit_conditions: ExitConditions) -> Optional[str]:
        return None

    def stop_after(self, iteration: int, exit_conditions: ExitConditions) -> Optional[str]:
        return exit_conditions.check(iteration)

    def prepare_weights(self) -> None:
        finish_param_gather(self.trainer.optimizer)  # --overlap-param-gather: the last update's, if left

    def schedule_state(self) -> dict:
        return {}

    def load_schedule_state(self, state: dict) -> None:
        pass


def _newest_checkpoint(save: Optional[str]) -> str:
    if not save:
        return "none (no --save)"
    try:
        iteration = read_tracker(save)
    except CheckpointError:
        iteration = None
    return f"iteration {iteration} in {save}" if iteration is not None else f"none in {save}"


# Names of settings and environment variables that hold credentials (WANDB_API_KEY, HF tokens' *_SECRET...).
_SECRET_NAME = re.compile(r"api[_-]?key|secret|password|passwd|credential|auth[_-]?token", re.IGNORECASE)
REDACTED = "<redacted>"


def loggable_settings(values: dict) -> dict:
    """The plain values of `values` for metadata and logging sinks, with credentials redacted: a setting
    whose name looks like one, or any string that contains the value of such an environment variable."""
    secrets = [v for k, v in os.environ.items() if _SECRET_NAME.search(k) and len(v) >= 8]

    def clean(key: str, value: Any) -> Any:
        if _SECRET_NAME.search(key):
            return REDACTED
        if isinstance(value, str) and any(secret in value for secret in secrets):
            return REDACTED
        if isinstance(value, list):
            return [REDACTED if isinstance(v, str) and any(s in v for s in secrets) else v for v in value]
        return value

    return {k: clean(k, v) for k, v in values.items() if isinstance(v, (int, float, str, bool, list, type(None)))}


# Trace ------------------------------------------------------------------------------------------------


def local_events(result: StepResult) -> list[tuple[str, float, float]]:
    """A step's executed actions on this rank's `time.perf_counter()` (the executor's are step-relative)."""
    return [(label, result.started + s, result.started + e) for label, s, e in result.events]


def write_trace(path: str, events_by_rank: list[list[tuple[str, float, float]]],
                clock_notes: Optional[dict] = None) -> None:
    """Chrome-trace / Perfetto JSON: one process row per global rank ("rank N"), one slice per action;
    times in seconds on one clock, written from the earliest event on."""
    origin = min((start for events in events_by_rank for _, start, _ in events), default=0.0)
    trace: list[dict] = []
    for rank, events in enumerate(events_by_rank):
        trace.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        trace.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})
        for label, start, end in events:
            trace.append({"name": label, "ph": "X", "pid": rank, "tid": 0, "ts": (start - origin) * 1e6,
                          "dur": (end - start) * 1e6, "cat": label.split()[0].rstrip("0123456789.@<>")})
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms", "otherData": clock_notes or {}}, f)
    os.replace(tmp, path)
