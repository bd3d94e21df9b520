"""The pretraining loop: arguments → parallel state → data → schedule → model chunks → steps → metrics.

`pretrain(args)` reads top to bottom: seed, build the data and the model config, the schedule and this
rank's model chunks, the optimizer; resume from `--load` if there is a checkpoint; then iterate. One
iteration: the rank's microbatches of the global batch go through the pipeline executor (which runs the
validated action list of the chosen schedule), gradients are finalised (sequence-parallel, tied
embedding and data-parallel reductions), the global gradient norm is computed and clipped, the
optimizer steps with the iteration's learning rate, and the logging rank writes a metrics row.
After an iteration come, when due, a validation pass (`--eval-interval`), a checkpoint
(`--save-interval`) and the early-exit check (signals, `--exit-interval`, `--exit-duration-in-mins`),
which saves before stopping. The run also saves when training completes.

Data positions are *sample indices*: the global batch of an iteration covers samples
[consumed, consumed + B), and microbatch j of data-parallel replica d holds consumed + j·b·dp + d·b +
[0, b) (Megatron's layout). A checkpoint stores `consumed`, so a resumed run reads exactly the samples
the uninterrupted run would have read.

`--pipeline-schedule 2bw` trains with `training.twobw.TwoBWTrainer` instead, whose executor calls span
optimizer steps (one batch per call, no flush between them, the update deferred into the action lists).

Validation runs the schedule's own forward actions only (F, SEND_F, RECV_F, in the list's order) through
the same executor (`PipelineExecutor.run(..., forward_only=True)`) under `torch.no_grad()`, with dropout
off and the random generators put back afterwards, so every schedule and placement evaluates the way it
trains and evaluating never changes the training trajectory.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import sys
import time
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

import numpy as np
import torch
from torch import nn

from megatron_pp.core import comm
from megatron_pp.core.grads import finalize_gradients, unique_parameters
from megatron_pp.core.p2p import PipelineComm
from megatron_pp.core.parallel_state import ParallelState, init_distributed
from megatron_pp.core.tensor_parallel import model_parallel_seed
from megatron_pp.data.mock import mock_sample
from megatron_pp.models.config import TransformerConfig
from megatron_pp.models.layout import StageSpec, split_layers
from megatron_pp.models.transformer import RecomputeConfig
from megatron_pp.schedules.execute import PipelineExecutor, StepResult
from megatron_pp.schedules.ir import Schedule
from megatron_pp.schedules.peer_store import peer_store_for
from megatron_pp.training.arguments import (build_job_schedule, model_config_from_args, num_chunks, parse_args,
                                            schedule_takes_offload_time, uses_file_data, virtual_stages_given)
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
from megatron_pp.training.flops import IterationFlops, iteration_flops, peak_tflops
from megatron_pp.training.layered import all_weights, connect_optimizer, schedule_recompute
from megatron_pp.training.metrics import MetricsLogger, take_peak_memory
from megatron_pp.training.model import build_model_chunks
from megatron_pp.training.offload_probe import OffloadProbe, measure_offload_time
from megatron_pp.training.optimizer import LRSchedule, OptimizerConfig, TrainingOptimizer, build_optimizer
from megatron_pp.training.signals import ExitConditions
from megatron_pp.training.watchdog import Watchdog
from megatron_pp.training.weight_versions import DelayedUpdateOptimizer, WeightVersions, uses_weight_versions

# Mock validation samples start here: a range no training run reaches (10^12 samples).
MOCK_VALID_FIRST_SAMPLE = 1 << 40


# The pipeline -----------------------------------------------------------------------------------------


@dataclass
class Pipeline:
    """Everything one rank needs to run steps."""

    state: ParallelState
    config: TransformerConfig
    schedule: Schedule
    layout: list[StageSpec]
    chunks: list[nn.Module]
    executor: PipelineExecutor
    versions: Optional[WeightVersions] = None
    """2BW: the two weight versions the executor switches between (None for single-version schedules)."""

    @property
    def stage_ids(self) -> list[int]:
        """Global stage of each of this rank's chunks."""
        return [self.schedule.stage_of(self.state.pp_rank, c) for c in range(self.schedule.num_chunks)]


def build_pipeline(
    config: TransformerConfig,
    state: ParallelState,
    schedule: Schedule,
    *,
    micro_batch_size: int,
    seed: int,
    sequence_parallel: bool = False,
    first_stage_layers: Optional[int] = None,
    last_stage_layers: Optional[int] = None,
    account_for_embedding: bool = False,
    account_for_loss: bool = False,
    recompute: Optional[RecomputeConfig] = None,
    trace: bool = False,
) -> Pipeline:
    layout = split_layers(
        config.num_layers, state.pp_size, schedule.num_chunks,
        first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers,
        account_for_embedding=account_for_embedding, account_for_loss=account_for_loss,
    )
    recompute = schedule_recompute(schedule, recompute)  # None: the schedule's own memory mode
    chunks = build_model_chunks(config, layout, schedule, state, seed=seed, sequence_parallel=sequence_parallel,
                                recompute=recompute)
    seq = config.seq_length // state.tp_size if sequence_parallel else config.seq_length
    pipeline_comm = PipelineComm(state.pp_group, state.pp_ranks) if state.pp_size > 1 else None
    versions = WeightVersions(chunks) if uses_weight_versions(schedule) else None
    executor = PipelineExecutor(
        schedule, state.pp_rank, chunks, comm=pipeline_comm,
        activation_shape=(seq, micro_batch_size, config.hidden_size),
        dtype=config.params_dtype, device=state.device, trace=trace,
        store=peer_store_for(schedule, state),  # BPipe: collective, creates the pairs' process groups
        hooks=versions,
    )
    if versions is not None:
        executor.store.exclude(versions.buffers[1])  # the second weight buffer is no activation either
    return Pipeline(state, config, schedule, layout, chunks, executor, versions)


# Data -------------------------------------------------------------------------------------------------


class Split(Protocol):
    """A dataset split: batches by global sample index (what `megatron_pp.data.builder` returns)."""

    def get_batch(self, sample_indices: Sequence[int], device: torch.device | str = "cpu") -> dict: ...


@dataclass(frozen=True)
class MockSplit:
    """`--mock-data` as a split: sample i is mock sample `first_sample + i` (see `data.mock`)."""

    seed: int
    seq_length: int
    vocab_size: int
    first_sample: int = 0

    def get_batch(self, sample_indices: Sequence[int], device: torch.device | str = "cpu") -> dict:
        samples = torch.stack([mock_sample(self.seed, self.first_sample + i, self.seq_length, self.vocab_size)
                               for i in sample_indices])
        b, s = samples.shape[0], self.seq_length
        return {
            "tokens": samples[:, :-1].contiguous().to(device),
            "labels": samples[:, 1:].contiguous().to(device),
            "loss_mask": torch.ones(b, s, dtype=torch.float32, device=device),
            "position_ids": torch.arange(s, device=device).unsqueeze(0).expand(b, s).contiguous(),
        }


@dataclass
class TrainingData:
    """The train and validation splits and the batch geometry that cuts them into microbatches."""

    train: Split
    valid: Optional[Split]
    micro_batch_size: int
    global_batch_size: int
    dp_size: int
    vocab_size: Optional[int] = None
    """With file datasets, the tokenizer's vocabulary: a batch holding a larger id is refused."""

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    def microbatches(self, split: Split, first_sample: int, dp_rank: int, device: torch.device) -> list[dict]:
        """This replica's microbatches of the global batch starting at sample `first_sample`."""
        b = self.micro_batch_size
        starts = [first_sample + j * b * self.dp_size + dp_rank * b for j in range(self.num_microbatches)]
        batches = [split.get_batch(range(start, start + b), device) for start in starts]
        if self.vocab_size is not None:
            for start, batch in zip(starts, batches):
                _check_token_ids(batch, self.vocab_size, start)
        return batches


def _check_token_ids(batch: dict, vocab_size: int, first_sample: int) -> None:
    """An id outside the vocabulary would index past the embedding (or, split over tensor-parallel ranks,
    be masked to a zero vector silently): the dataset was tokenized with another tokenizer."""
    high = int(torch.maximum(batch["tokens"].max(), batch["labels"].max()))
    low = int(torch.minimum(batch["tokens"].min(), batch["labels"].min()))
    if high >= vocab_size or low < 0:
        bad = high if high >= vocab_size else low
        raise ValueError(f"--data-path: samples {first_sample}.. hold token id {bad}, outside the tokenizer's "
                         f"vocabulary 0..{vocab_size - 1}: the dataset was tokenized with another tokenizer "
                         "(check --tokenizer-type / --vocab-size / --tokenizer-model)")


def evaluation_enabled(args: argparse.Namespace) -> bool:
    return args.eval_interval is not None and args.eval_iters > 0


def build_config_and_data(args: argparse.Namespace, state: ParallelState) -> tuple[TransformerConfig, TrainingData]:
    """The model config and the data. With file datasets the tokenizer decides the vocabulary."""
    geometry = dict(micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
                    dp_size=state.dp_size)
    if not uses_file_data(args):
        config = model_config_from_args(args)
        train = MockSplit(args.seed, config.seq_length, config.vocab_size)
        valid = MockSplit(args.seed, config.seq_length, config.vocab_size, MOCK_VALID_FIRST_SAMPLE)
        return config, TrainingData(train, valid if evaluation_enabled(args) else None, **geometry)

    from megatron_pp.data.builder import build_datasets, data_config_from_args
    from megatron_pp.data.tokenizers import build_tokenizer

    seq_length = model_config_from_args(args, vocab_size=1).seq_length
    data_config = data_config_from_args(args, seq_length=seq_length)
    tokenizer = build_tokenizer(**data_config.tokenizer_args())
    config = model_config_from_args(args, vocab_size=tokenizer.vocab_size)
    valid_samples = args.eval_iters * args.global_batch_size if evaluation_enabled(args) else 0
    train, valid, _ = build_datasets(
        data_config, (args.train_iters * args.global_batch_size, valid_samples, 0), tokenizer.eod,
        barrier=comm.barrier if comm.is_distributed() else None, is_builder=state.rank == 0,
    )
    if train is None:
        raise ValueError(f"--split {args.split} leaves no training data")
    if evaluation_enabled(args) and valid is None:
        raise ValueError(f"--eval-interval: --split {args.split} leaves no validation data")
    return config, TrainingData(train, valid, vocab_size=config.vocab_size, **geometry)


# One iteration ----------------------------------------------------------------------------------------


def global_token_count(microbatches: Sequence[dict], state: ParallelState) -> float:
    """Loss-bearing tokens of the whole global batch (all microbatches, all dp replicas)."""
    count = torch.stack([mb["loss_mask"].sum() for mb in microbatches]).sum().double()
    if state.dp_group is not None and state.dp_size > 1:
        comm.all_reduce(count, group=state.dp_group)
    return float(count)


def train_step(
    pipe: Pipeline, microbatches: Sequence[dict], optimizer: Optional[TrainingOptimizer] = None
) -> tuple[StepResult, float]:
    """Forward and backward of one global batch; gradients are final (reduced) on return.

    With an optimizer, its `GradientReducer` owns the gradients (bucketed, overlapping the backward
    when --overlap-grad-reduce, reduce-scattered under the distributed optimizer) and the loss is
    multiplied by its loss scale (fp16). Without one, `.grad` is reduced synchronously by
    `finalize_gradients` (the plain path that benchmarks and exactness tests use).
    Returns the executor's result and the global token count used to normalise the loss.
    """
    tokens = global_token_count(microbatches, pipe.state)
    if optimizer is None:
        for p in unique_parameters(pipe.chunks):
            p.grad = None
        result = pipe.executor.run(microbatches, loss_scale=1.0 / tokens)
        finalize_gradients(pipe.chunks, pipe.state)
        return result, tokens
    optimizer.reducer.start_step(len(microbatches))
    result = pipe.executor.run(microbatches, loss_scale=optimizer.loss_multiplier / tokens)
    optimizer.reducer.finish()
    return result, tokens


@dataclass
class StepMetrics:
    """Per-iteration numbers that every rank agrees on (gathered to all ranks)."""

    loss: float
    peak_stash_bytes: list[int]
    peak_memory_bytes: Optional[list[int]]


def step_metrics(pipe: Pipeline, result: StepResult, tokens: float) -> StepMetrics:
    """Global-batch mean loss, and peak stash (and CUDA) bytes per pipeline rank.

    The loss lives on the last pipeline stage; peaks are maxed over each pipeline rank's tp and dp
    replicas. Two small collectives: a dp sum of the loss, then a world max that carries everything to
    every rank.
    """
    state = pipe.state
    pp = state.pp_size
    # Every rank joins the dp sum; ranks without the last stage add a zero (made on the loss's device
    # where there is one, and moved by comm to the device the backend needs either way).
    loss = result.loss_sum.double() if result.loss_sum is not None else torch.zeros((), dtype=torch.float64)
    if state.dp_group is not None and state.dp_size > 1:
        loss = comm.all_reduce(loss, group=state.dp_group)
    vec = torch.full((1 + 2 * pp,), -math.inf, dtype=torch.float64)
    if result.loss_sum is not None:
        # A NaN would not survive the max all-reduce reliably; +inf does, so every rank sees it.
        vec[0] = float(loss) / tokens if math.isfinite(float(loss)) else math.inf
    vec[1 + state.pp_rank] = float(result.peak_stash_bytes)
    on_cuda = state.device.type == "cuda"
    if on_cuda:
        vec[1 + pp + state.pp_rank] = float(take_peak_memory(state.device))
    values = comm.all_reduce(vec, op="max").tolist()
    return StepMetrics(
        loss=values[0],
        peak_stash_bytes=[int(v) for v in values[1:1 + pp]],
        peak_memory_bytes=[int(v) for v in values[1 + pp:]] if on_cuda else None,
    )


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
    faults: FaultPlan = field(default_factory=lambda: FaultPlan([], 0, 1))
    on_iteration: Optional[Callable[[dict], None]] = None
    """Called on every rank with each training row (tools/soak.py samples memory through it)."""
    nonfinite_streak: int = 0
    recent_losses: list[float] = field(default_factory=list)
    pending_messages: list[str] = field(default_factory=list)
    """Messages logged before the logger exists (it is opened only once the setup has succeeded)."""

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
        """One optimizer step on the next global batch; returns its metrics row (on every rank)."""
        args, pipe, state = self.args, self.pipe, self.state
        start = time.perf_counter()
        microbatches = self.data.microbatches(self.data.train, self.progress.consumed_samples, state.dp_rank,
                                              state.device)
        iteration = self.progress.iteration + 1
        lr = self.lr_schedule.learning_rate(iteration, self.progress.consumed_samples + args.global_batch_size)
        result, tokens = train_step(pipe, microbatches, self.optimizer)
        self.faults.after_backward(iteration, lambda: poison_first_gradient(self.optimizer.reducer.held_pieces()))
        outcome = self.optimizer.step(lr)
        metrics = step_metrics(pipe, result, tokens)
        step_time = time.perf_counter() - start
        self.progress.iteration += 1
        self.progress.consumed_samples += args.global_batch_size
        if args.trace_file:
            self.traces.append(result.events)
        tflops = self.flops.model / step_time / state.world_size / 1e12
        hardware_tflops = self.flops.hardware / step_time / state.world_size / 1e12
        return {
            "iteration": self.progress.iteration,
            "consumed_samples": self.progress.consumed_samples,
            "loss": metrics.loss,
            "grad_norm": outcome.grad_norm,
            "lr": lr,
            "global_batch_size": args.global_batch_size,
            "loss_scale": 1.0 if outcome.loss_scale is None else outcome.loss_scale,  # 1.0: no loss scaling
            "skipped": outcome.skipped,
            "step_time_s": step_time,
            "tokens_per_s": tokens / step_time,
            "tflops_per_gpu": tflops,
            "mfu": tflops / self.peak_tflops if self.peak_tflops else None,
            "hfu": hardware_tflops / self.peak_tflops if self.peak_tflops else None,
            "peak_stash_bytes": metrics.peak_stash_bytes,
            "peak_memory_bytes": metrics.peak_memory_bytes,
            "comm_wait_s": result.comm_wait_s,
        }

    def evaluate(self) -> dict:
        """Validation loss over `--eval-iters` global batches (the same ones every time). Collective."""
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
                    batches = self.data.microbatches(self.data.valid, e * args.global_batch_size, state.dp_rank,
                                                     state.device)
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
        return {}

    def load_schedule_state(self, state: dict) -> None:
        """Take back what `schedule_state` saved, once the checkpoint's weights and optimizer are loaded."""

    def _recorder(self, rows: list[dict]) -> Callable[..., None]:
        """`record(row, evaluation=False)`: log a training or evaluation row and keep it in `rows` (on the
        logging rank only)."""

        def record(row: dict, evaluation: bool = False) -> None:
            if self.logger is not None:
                rows.append(row)
                (self.logger.evaluation if evaluation else self.logger.train)(row)

        return record

    def run(self, exit_conditions: ExitConditions) -> list[dict]:
        """Iterate to `--train-iters` or an early exit; returns the logging rank's rows."""
        args = self.args
        rows: list[dict] = []
        record = self._recorder(rows)

        last_eval: Optional[int] = None
        stopped = False
        while self.progress.iteration < args.train_iters:
            row = self.train_iteration()
            stop = self.check_numerics(row)
            record(row)
            if self.on_iteration is not None:
                self.on_iteration(row)
            if stop is not None:
                raise TrainingStopped(stop)
            iteration = self.progress.iteration
            if evaluation_enabled(args) and iteration % args.eval_interval == 0:
                record(self.evaluate(), evaluation=True)
                last_eval = iteration
            if args.save and args.save_interval and iteration % args.save_interval == 0:
                self.save()
            reason = exit_conditions.check(iteration)
            if reason is not None:
                if args.save and self.last_saved != iteration:
                    self.save()
                self.log(f"exiting after iteration {iteration}: {reason}")
                stopped = True
                break
        if not stopped:
            if evaluation_enabled(args) and last_eval != self.progress.iteration:
                record(self.evaluate(), evaluation=True)
            if args.save and self.progress.iteration > 0 and self.last_saved != self.progress.iteration:
                self.save()
        if args.trace_file:
            _gather_and_write_trace(args.trace_file, self.traces, self.state)
        return rows


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
    # The layer count decides the chunks; the vocabulary (the tokenizer's, with file data) does not matter yet.
    shape = model_config_from_args(args, vocab_size=1 if uses_file_data(args) else None)
    chunks = num_chunks(args, shape) if virtual_stages_given(args) or not args.pipeline_schedule_file else None
    probe = probe_offload_time(args, shape, state)
    schedule = build_job_schedule(args, state.dp_size, chunks, offload_time=probe.offload_time if probe else None)
    config, data = build_config_and_data(args, state)
    recompute = schedule_recompute(schedule, RecomputeConfig(
        args.recompute_granularity, args.recompute_method,
        (args.recompute_num_layers or 1) if args.recompute_granularity == "full" else None,
    ) if args.recompute_granularity else None)
    pipe = build_pipeline(
        config, state, schedule, micro_batch_size=args.micro_batch_size, seed=args.seed,
        sequence_parallel=args.sequence_parallel, recompute=recompute,
        first_stage_layers=args.decoder_first_pipeline_num_layers,
        last_stage_layers=args.decoder_last_pipeline_num_layers,
        account_for_embedding=args.account_for_embedding_in_pipeline_split,
        account_for_loss=args.account_for_loss_in_pipeline_split,
        trace=bool(args.trace_file),
    )
    if pipe.versions is not None:  # 2BW: one optimizer state, updates deferred into the action lists
        optimizer = DelayedUpdateOptimizer(pipe.chunks, state, OptimizerConfig.from_args(args), pipe.versions)
    else:
        optimizer = build_optimizer(pipe.chunks, state, OptimizerConfig.from_args(args))
    connect_optimizer(pipe.executor, optimizer)  # REDUCE_GRAD -> its reducer; sharded weights' gathers
    checkpoint = TrainingState(
        chunks=pipe.chunks, stage_ids=pipe.stage_ids, stages=pipe.layout, placement=schedule.placement,
        state=state, config=config, schedule_name=schedule.name, optimizer=optimizer,
        optimizer_sharded_by_dp=args.use_distributed_optimizer,
    )
    logger: Optional[MetricsLogger] = None
    from megatron_pp.training.twobw import TwoBWTrainer  # it builds on Trainer

    trainer_class = TwoBWTrainer if pipe.versions is not None else Trainer
    trainer = trainer_class(args, pipe, data, optimizer, LRSchedule.from_args(args), checkpoint,
                            flops=iteration_flops(config, args.global_batch_size, tp=state.tp_size,
                                                  recompute_granularity=recompute.granularity,
                                                  recomputed_layers=_recomputed_layers(recompute, pipe)),
                            peak_tflops=peak_tflops(state.device, args.peak_tflops), logger=None,
                            faults=FaultPlan.from_env(state.rank, state.world_size), on_iteration=on_iteration)
    try:
        trainer.log(
            f"megatron_pp: world {state.world_size} = tp {state.tp_size} x pp {state.pp_size} x dp {state.dp_size}, "
            f"schedule {schedule.name} (m={schedule.num_microbatches}, v={schedule.num_chunks}), "
            f"{config.num_parameters(state.tp_size) / 1e6:.2f}M parameters"
        )
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


# Trace ------------------------------------------------------------------------------------------------


def write_trace(path: str, events_by_rank: list[list[tuple[str, float, float]]]) -> None:
    """Chrome-trace / Perfetto JSON: one process row per global rank, one slice per action."""
    trace = []
    for rank, events in enumerate(events_by_rank):
        for label, start, end in events:
            trace.append({"name": label, "ph": "X", "pid": rank, "tid": 0, "ts": start * 1e6, "dur": (end - start) * 1e6,
                          "cat": label.split()[0].rstrip("0123456789.@<>")})
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)
    os.replace(tmp, path)


def _gather_and_write_trace(path: str, traces: list, state: ParallelState) -> None:
    # Steps follow each other on the time axis: offset every step by the previous steps' durations.
    events: list[tuple[str, float, float]] = []
    offset = 0.0
    for step_events in traces:
        events += [(lbl, s + offset, e + offset) for lbl, s, e in step_events]
        offset = events[-1][2] if events else offset
    gathered = comm.all_gather_object(events)
    if state.rank == 0:
        write_trace(path, gathered)


# Errors that mean "the input is wrong" (a flag, a file, a checkpoint, a schedule that cannot run): one
# line and exit 1. Every other exception is a bug and keeps its traceback. MEGATRON_PP_TRACEBACK=1 shows
# the traceback of the input errors too.
INPUT_ERRORS = (ValueError, OSError)


def _fail(message: str) -> "typing.NoReturn":
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    sys.exit(1)


def start_watchdog(args: argparse.Namespace, launch: Any) -> Optional[Watchdog]:
    """The heartbeat watchdog of a multi-process run (None for one process or --heartbeat-timeout-seconds 0)."""
    if not comm.is_distributed() or launch.world_size < 2 or not args.heartbeat_timeout_seconds:
        return None
    return Watchdog.connect(launch.master_addr, launch.master_port, launch.rank, launch.world_size,
                            args.heartbeat_timeout_seconds).start()


def main(argv: Optional[Sequence[str]] = None, description: str = "megatron_pp pretraining",
         default_preset: Optional[str] = None) -> None:
    """The entry point of pretrain_*.py: arguments, process group and watchdog, training, and the
    error policy of docs/reliability.md (one line on stderr and a non-zero exit, never a hang)."""
    args = parse_args(argv, description, default_preset)
    show_traceback = os.environ.get("MEGATRON_PP_TRACEBACK") == "1"
    watchdog: Optional[Watchdog] = None
    try:
        launch = init_distributed(args.distributed_backend, timeout_s=60.0 * args.distributed_timeout_minutes)
        watchdog = start_watchdog(args, launch)
        pretrain(args)
    except (CheckpointError, TrainingStopped) as exc:
        # Every rank raises the same agreed error in the same place: no rank is to blame.
        if watchdog is not None:
            watchdog.stop()
        if show_traceback:
            raise
        _fail(str(exc))
    except INPUT_ERRORS as exc:
        if watchdog is not None:
            watchdog.report_failure()  # the other ranks stop now instead of waiting for a heartbeat timeout
        if show_traceback:
            raise
        _fail(str(exc))
    except RuntimeError:
        # A collective failed: usually a peer died (gloo: "connection closed by peer"). Let the watchdog
        # name it; it ends this process. Without a verdict, it is a bug: keep the traceback.
        if watchdog is not None:
            watchdog.wait_for_verdict()
        raise
    if watchdog is not None:
        watchdog.stop()
    comm.shutdown()
