"""PipeDream-2BW in the dry run: the job's own step driver, `DeferredUpdateSteps`, on fake tensors.

A 2BW job does not run flushed steps: one executor call per batch, calls that span batches (each ends with the
next batch's first forwards in flight), and the update of batch t inside batch t+1's action list (STEP@(t+2)),
on two weight versions and one optimizer state (docs/2bw.md). `dry_run._run` hands such a pipeline (built with
its `WeightVersions`) to `TwoBWCalls`, which holds what `pretrain` builds for it, the `DelayedUpdateOptimizer`
(with the AdamW kernel of `--dry-run-optimizer`, as the flushed dry run builds it), and runs the calls of
`DeferredUpdateSteps.advance` itself, through a small stand-in for the `Trainer` fields it reads, in place of
the flushed dry run's two steps. The dry run's instrumentation (the memory tracker, the action labels) and
its report stay `dry_run._run`'s; this module adds the state a flushed job does not hold (`extra_state`).

Which calls, and why (`calls`):

1. **warm-up** (batch 0, after the start): all of batch 0 and the first p−s−1 forwards of batch 1; no update
   yet. Both weight buffers exist from the build (buffer 1 is a copy of the weights).
2. **steady** (batch 1): STEP@2, the first update (batch 0's gradient), runs inside this call, where the
   rank's first forward of batch 2 needs it (late in the call on the first ranks); Adam's moments are made
   by that step, so this call's earlier actions run without them.
3. **steady** (batch 2): the whole call runs with Adam's moments, both weight versions (batch 2's stashes on
   one, batch 3's first forwards on the other) and the two fp32 gradient buffers (the reducer's, where the
   batch accumulates, and the pending copy awaiting STEP@3) alive: the steady state a long run repeats.
4. **cool-down** (batch 3, a flush): no next-batch forwards, both pending updates at the end, as before a
   checkpoint; the run ends with nothing in flight.

`steps` (the flushed dry run's two steps) is the number of steady calls; the default 2 gives the four above.
Each call is labelled `step k (kind)` in `peak_at`.

Data: the first global batch is made for real (by `dry_run._run`) and faked, and every batch is that one, as in
the flushed dry run. The token count is read through `core.host_read` as the job reads it; on fake tensors it
reads 0, so the driver takes the count of the real first batch instead (times the data-parallel replicas, whose
batches have the same shape): it only scales the loss, so no byte depends on it. Every other read of the
calls (found-inf and the gradient norm at each STEP, the gathered metrics of each row) goes through
`core.host_read` and reads zeros on fake tensors: no overflow, a zero norm, so no clipping.

What is counted beyond the flushed schedules: `parameter_bytes` holds both weight versions (buffer 1, the
older or newer version, is a full copy of the stage's trainable weights in their dtype); `gradient_bytes` the
reducer's fp32 buckets and the pending fp32 copy of the deferred update; `optimizer_bytes` Adam's moments and,
for bf16/fp16 models, the fp32 main weights (an fp32 model's main weights are the newest weight buffer itself,
counted once, as a parameter).
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from megatron_pp.core.host_read import has_data
from megatron_pp.schedules.twobw import CallKind
from megatron_pp.training.flops import IterationFlops
from megatron_pp.training.optimizer import LRSchedule, OptimizerConfig
from megatron_pp.training.pipeline import Pipeline
from megatron_pp.training.signals import ExitConditions
from megatron_pp.training.step_data import TrainingData
from megatron_pp.training.trainer import Progress
from megatron_pp.training.twobw import DeferredUpdateSteps
from megatron_pp.training.weight_versions import DelayedUpdateOptimizer


def calls(steady: int) -> list[CallKind]:
    """The calls the dry run makes (module docstring): a warm-up, `steady` steady calls, a cool-down."""
    return [CallKind.WARMUP] + [CallKind.STEADY] * steady + [CallKind.COOLDOWN]


@dataclass
class _SameBatch:
    """The `TrainingData` fields `DeferredUpdateSteps` reads; every batch is the (faked) first one."""

    batches: list[dict]
    num_microbatches: int
    train: Any = None

    def microbatches(self, split: Any, first_sample: int, dp_rank: int, device: torch.device) -> list[dict]:
        return list(self.batches)


@dataclass
class _Trainer:
    """The `Trainer` fields `DeferredUpdateSteps` reads (no logger, no checkpoints, no evaluation)."""

    args: argparse.Namespace
    pipe: Pipeline
    data: _SameBatch
    optimizer: DelayedUpdateOptimizer
    lr_schedule: LRSchedule
    progress: Progress = field(default_factory=Progress)
    flops: IterationFlops = field(default_factory=lambda: IterationFlops(model=0, hardware=0))
    peak_tflops: Optional[float] = None
    traces: list = field(default_factory=list)

    @property
    def state(self):
        return self.pipe.state


class _Steps(DeferredUpdateSteps):
    """The job's step driver; only the token count of a fake batch (which reads 0) is answered from the real
    first batch."""

    def __init__(self, trainer: _Trainer, tokens: float) -> None:
        super().__init__(trainer)
        self.tokens = tokens

    def read_token_count(self, count: torch.Tensor) -> float:
        read = super().read_token_count(count)  # the job's read (counted; zeros on a fake tensor)
        return read if has_data(count) else self.tokens


class TwoBWCalls:
    """A 2BW rank's optimizer and calls in the dry run (module docstring); `dry_run._run` builds it for a pipeline
    with weight versions, connects and instruments it as any, and calls `run` instead of its flushed steps."""

    def __init__(self, args: argparse.Namespace, pipe: Pipeline, config: OptimizerConfig, data: TrainingData,
                 batches_real: list[dict]) -> None:
        self.args, self.pipe, self.data = args, pipe, data
        self.optimizer = DelayedUpdateOptimizer(pipe.chunks, pipe.state, config, pipe.versions)
        with torch._subclasses.fake_tensor.unset_fake_temporarily():  # the real first batch: host work, for real
            self.tokens = float(sum(float(mb["loss_mask"].sum()) for mb in batches_real)) * pipe.state.dp_size

    def run(self, batches: list[dict], step: list, steady: int = 2) -> list[float]:
        """The calls, each labelled `step k (kind)` through `step[0]` (`dry_run._label_actions`); CPU seconds of
        each. Checks that they ended flushed, every update applied."""
        trainer = _Trainer(self.args, self.pipe, _SameBatch(batches, self.data.num_microbatches), self.optimizer,
                           LRSchedule.from_args(self.args))
        driver = _Steps(trainer, self.tokens)
        exits = ExitConditions(device=self.pipe.state.device)  # no signals, no time limit: no early stop
        kinds, seconds = calls(steady), []
        for index, kind in enumerate(kinds, start=1):
            step[0] = f"{index} ({kind.value})"
            began = time.process_time()
            driver.advance(flush=index == len(kinds), exit_conditions=exits)
            seconds.append(time.process_time() - began)
        versions = self.pipe.versions
        if not self.optimizer.flushed or self.optimizer.outcomes or versions.newest != len(kinds) + 1:
            raise RuntimeError(f"2BW dry run: {len(kinds)} calls should end flushed at weight version "
                               f"{len(kinds) + 1}, got version {versions.newest}")
        return seconds

    def extra_state(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """What a 2BW rank holds beyond a flushed one's parameters, reducer buckets and optimizer state: both
        weight buffers (one is the parameters' own storage), the pending fp32 gradient copy, and the fp32 main
        weights (an fp32 model's are a weight buffer, which the caller's count leaves out of the optimizer's)."""
        weights = [t for buffer in self.pipe.versions.buffers for t in buffer]
        return weights, list(self.optimizer._pending), list(self.optimizer.main)
