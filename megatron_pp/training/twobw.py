"""How PipeDream-2BW runs iterations: one executor call per batch and no flush between calls.

`DeferredUpdateSteps` is the `Trainer`'s step driver when the schedule's lists carry weight versions; the
loop, evaluation, checkpoints and logging stay the `Trainer`'s. What changes (docs/2bw.md):

- **Calls that span steps.** Call t runs this rank's segment of the step-spanning list
  (`schedules.twobw.StepPlan`): batch t's remaining forwards and all its backwards, the first p−s−1
  forwards of batch t+1, and the deferred update of batch t−1 (STEP). Microbatches in flight between
  calls stay in the executor; the data of batch t+1 is loaded by call t, which starts it.
- **Flushes only where needed, planned.** The loop knows ahead which iterations end training, evaluate,
  save or exit (`--exit-interval`): the call of such an iteration is a cool-down (no forwards of the next
  batch, both pending updates applied) and the next call a warm-up. Everywhere else nothing waits for
  another rank between calls: no barrier, no blocking collective.
- **Metrics one call late.** Batch t's loss is on the last stage and its update runs in call t+1, so each
  rank starts one world all-reduce of the batch's metrics after its call (loss, the early-exit flags,
  peak memory per stage) and every rank reads it after the next call, when it has long completed; the
  row of iteration t+1 is then logged (at a flush, at once).
- **Early exits without a barrier.** `ExitConditions.check` all-reduces every step; here the signal and
  time flags ride on the metrics all-reduce instead. The ranks learn the agreed stop one call later, and
  the call after that flushes and saves: a signal stops training two iterations after it arrived.
- **Checkpoints** hold the newest weights as the model files, as for any schedule, and the older version
  plus the next batches' loss scales as the schedule state; a resumed run continues exactly as the
  uninterrupted one (a flush changes no number: the same actions run in the same order per rank).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_pp.core import comm
from megatron_pp.core.tensor_parallel.utils import PendingCollective
from megatron_pp.schedules.execute import StepResult
from megatron_pp.schedules.twobw import CallKind, build_plan
from megatron_pp.training.checkpointing import CheckpointError
from megatron_pp.training.metrics import take_peak_memory
from megatron_pp.training.signals import ExitConditions
from megatron_pp.core.host_read import read_values
from megatron_pp.training.step import global_token_count
from megatron_pp.training.trainer import Trainer, local_events
from megatron_pp.training.weight_versions import DelayedUpdateOptimizer, WeightVersions


@dataclass
class _Call:
    """What one call measured, kept until its batch's row can be logged."""

    tokens: float
    time_s: float
    comm_wait_s: float
    metrics: PendingCollective
    """World sum of [loss sum, signal flag, time-up flag, peak stash bytes per stage, peak memory per stage]."""


class DeferredUpdateSteps:
    """The step driver of schedules with weight versions (module docstring)."""

    def __init__(self, trainer: Trainer) -> None:
        if trainer.pipe.versions is None or not isinstance(trainer.optimizer, DelayedUpdateOptimizer):
            raise ValueError("DeferredUpdateSteps needs a pipeline built with weight versions and a "
                             "DelayedUpdateOptimizer (a schedule whose lists carry weight versions, e.g. 2bw)")
        self.trainer = trainer
        self.versions: WeightVersions = trainer.pipe.versions
        self.optimizer: DelayedUpdateOptimizer = trainer.optimizer
        self.plan = build_plan(trainer.state.pp_size, trainer.data.num_microbatches)
        batch_size = trainer.args.global_batch_size
        self.optimizer.lr_of_batch = lambda t: trainer.lr_schedule.learning_rate(t, t * batch_size)
        self._fresh = True  # the next call starts after a flush (or the start)
        self._loaded: dict[int, list[dict]] = {}  # batch -> this replica's microbatches
        self._calls: dict[int, _Call] = {}
        self._stop_flags = (False, False)  # agreed (signal, time up), from the metrics of finished batches

    @property
    def state(self):
        return self.trainer.state

    # One call ---------------------------------------------------------------------------------------------
    def advance(self, flush: bool, exit_conditions: ExitConditions) -> list[dict]:
        """Run the call of the next batch (ending in a flush if `flush`); returns the rows it completed."""
        trainer = self.trainer
        args, state, data = trainer.args, self.state, trainer.data
        batch = trainer.progress.iteration
        m = data.num_microbatches
        for b in (batch,) if flush else (batch, batch + 1):
            if b not in self._loaded:
                first = trainer.progress.consumed_samples + (b - batch) * args.global_batch_size
                self._loaded[b] = data.microbatches(data.train, first, state.dp_rank, state.device)
        microbatches = {b * m + i: mb for b, mbs in self._loaded.items() for i, mb in enumerate(mbs)}
        tokens = self.read_token_count(global_token_count(self._loaded[batch], state))
        multiplier = self.optimizer.begin_batch(batch)
        self.optimizer.reducer.start_step(m)
        segment = self.plan.segment(CallKind.of(self._fresh, flush), state.pp_rank, batch)
        start = time.perf_counter()
        result = trainer.pipe.executor.run(microbatches, loss_scale=multiplier / tokens, segment=segment)
        self.optimizer.finish_batch(batch)
        elapsed = time.perf_counter() - start
        del self._loaded[batch]
        self._fresh = flush
        self._calls[batch] = _Call(tokens, elapsed, result.comm_wait_s, self._start_metrics(result, exit_conditions))
        if args.trace_file:  # calls overlap across ranks: the trace puts every rank on one clock
            trainer.traces.append(local_events(result))
        trainer.progress.iteration += 1
        trainer.progress.consumed_samples += args.global_batch_size
        return [self._row(b) for b in sorted(self.optimizer.outcomes)]

    def read_token_count(self, count: torch.Tensor) -> float:
        """The global batch's loss-bearing tokens, read on the host: the call's loss scale and its row divide
        by it. 2BW's rows are written a batch later, from their own gathered metrics, so the count is read
        here (its own synchronisation; the flushing schedules read it with the loss, `step_metrics`). The dry
        run's driver (`training.dry_run_twobw`) overrides it, since a fake count reads as 0."""
        return read_values(count, "tokens")[0]

    def _start_metrics(self, result: StepResult, exit_conditions: ExitConditions) -> PendingCollective:
        state = self.state
        pp = state.pp_size
        # On the job's device, where the world all-reduce runs it (NCCL in place, no copy from the host per call;
        # the dry run's `--dry-run-device meta` check holds every collective's tensor there); without a process
        # group nothing reduces it, and it stays on the host.
        device = state.device if comm.is_distributed() else torch.device("cpu")
        values = torch.zeros(3 + 2 * pp, dtype=torch.float64, device=device)
        if result.loss_sum is not None and state.tp_rank == 0:
            # Tensor-parallel ranks hold the same loss; dp ranks add up. Copied, not read: it is read with the
            # gathered metrics (`_row`).
            values[0] = result.loss_sum.detach()
        values[1:3] = torch.tensor(exit_conditions.local_flags(), dtype=torch.float64)
        if state.tp_rank == 0 and state.dp_rank == 0:
            values[3 + state.pp_rank] = float(result.peak_stash_bytes)
            if state.device.type == "cuda":
                values[3 + pp + state.pp_rank] = float(take_peak_memory(state.device))
        pending = comm.all_reduce_async(values)
        return PendingCollective(None, pending.result)

    def _row(self, batch: int) -> dict:
        """The metrics row of `batch` (iteration batch+1), once its update ran (every rank builds it)."""
        trainer = self.trainer
        args, state = trainer.args, self.state
        outcome, lr = self.optimizer.outcomes.pop(batch)
        call = self._calls.pop(batch)
        values = read_values(call.metrics.wait(), "loss")
        pp = state.pp_size
        self._stop_flags = (self._stop_flags[0] or values[1] > 0, self._stop_flags[1] or values[2] > 0)
        tflops = trainer.flops.model / call.time_s / state.world_size / 1e12
        hardware_tflops = trainer.flops.hardware / call.time_s / state.world_size / 1e12
        return {
            "iteration": batch + 1,
            "consumed_samples": (batch + 1) * args.global_batch_size,
            "loss": values[0] / call.tokens,
            "grad_norm": outcome.grad_norm,
            "lr": lr,
            "global_batch_size": args.global_batch_size,
            "loss_scale": 1.0 if outcome.loss_scale is None else outcome.loss_scale,
            "skipped": outcome.skipped,
            "step_time_s": call.time_s,
            "tokens_per_s": call.tokens / call.time_s,
            "tflops_per_gpu": tflops,
            "mfu": tflops / trainer.peak_tflops if trainer.peak_tflops else None,
            "hfu": hardware_tflops / trainer.peak_tflops if trainer.peak_tflops else None,
            "peak_stash_bytes": [int(v) for v in values[3:3 + pp]],
            "peak_memory_bytes": [int(v) for v in values[3 + pp:]] if state.device.type == "cuda" else None,
            "comm_wait_s": call.comm_wait_s,
        }

    # Between calls -------------------------------------------------------------------------------------
    def stop_before(self, iteration: int, exit_conditions: ExitConditions) -> Optional[str]:
        # The signal and time flags ride on the metrics all-reduce: agreed one call late, no barrier.
        return exit_conditions.reason(*self._stop_flags, iteration)

    def stop_after(self, iteration: int, exit_conditions: ExitConditions) -> Optional[str]:
        return None

    def prepare_weights(self) -> None:
        self.versions.use(self.versions.newest)  # evaluation and the model files see the newest weights

    def schedule_state(self) -> dict:
        if not self.optimizer.flushed or not self._fresh:
            raise RuntimeError("2BW checkpoint requested between unflushed steps")
        next_batch = self.trainer.progress.iteration
        return {"two_bw": {"next_batch": next_batch, "older_weights": self.versions.older(),
                           **self.optimizer.position_state(next_batch)}}

    def load_schedule_state(self, state: dict) -> None:
        next_batch = self.trainer.progress.iteration
        saved = state.get("two_bw")
        if saved is not None and saved["next_batch"] != next_batch:
            raise CheckpointError(f"2BW schedule state is for batch {saved['next_batch']}, the checkpoint for "
                                  f"iteration {next_batch}")
        # Without it (weights from another schedule or a conversion) both versions start equal, as at step 0.
        self.versions.restore(next_batch + 1, saved["older_weights"] if saved is not None else None)
        self.optimizer.restore_position(next_batch, saved,
                                        main_loaded=not (self.trainer.args.no_load_optim or self.trainer.args.finetune))
        self._fresh = True
