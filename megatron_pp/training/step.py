"""One iteration's forward and backward over the pipeline, and the numbers every rank agrees on after it."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megatron_pp.core import comm
from megatron_pp.core.host_read import read_values
from megatron_pp.core.grads import finalize_gradients, unique_parameters
from megatron_pp.core.parallel_state import ParallelState
from megatron_pp.schedules.execute import StepResult
from megatron_pp.training.metrics import take_peak_memory
from megatron_pp.training.optimizer import TrainingOptimizer
from megatron_pp.training.pipeline import Pipeline


def global_token_count(microbatches: Sequence[dict], state: ParallelState) -> torch.Tensor:
    """Loss-bearing tokens of the whole global batch (all microbatches, all dp replicas), as an fp64 scalar
    tensor on the data's device: it scales the loss on the device and is read on the host only with the
    step's logged loss (`step_metrics`), so counting it costs no synchronisation of its own."""
    count = torch.stack([mb["loss_mask"].sum() for mb in microbatches]).sum().double()
    if state.dp_group is not None and state.dp_size > 1:
        comm.all_reduce(count, group=state.dp_group)
    return count


def train_step(
    pipe: Pipeline, microbatches: Sequence[dict], optimizer: Optional[TrainingOptimizer] = None
) -> tuple[StepResult, torch.Tensor]:
    """Forward and backward of one global batch; gradients are final (reduced) on return.

    With an optimizer, its `GradientReducer` owns the gradients (bucketed, overlapping the backward
    when --overlap-grad-reduce, reduce-scattered under the distributed optimizer) and the loss is
    multiplied by its loss scale (fp16). Without one, `.grad` is reduced synchronously by
    `finalize_gradients` (the plain path that benchmarks and exactness tests use).
    Returns the executor's result and the global token count used to normalise the loss (a tensor).
    """
    tokens = global_token_count(microbatches, pipe.state)
    executor = pipe.executor_for(len(microbatches))  # another count than the schedule's: the batch-size ramp-up
    if optimizer is None:
        for p in unique_parameters(pipe.chunks):
            p.grad = None
        result = executor.run(microbatches, loss_scale=1.0 / tokens)
        finalize_gradients(pipe.chunks, pipe.state)
        return result, tokens
    optimizer.reducer.start_step(len(microbatches))
    result = executor.run(microbatches, loss_scale=optimizer.loss_multiplier / tokens)
    optimizer.reducer.finish()
    return result, tokens


@dataclass
class StepMetrics:
    """Per-iteration numbers that every rank agrees on (gathered to all ranks)."""

    loss: float
    peak_stash_bytes: list[int]
    peak_memory_bytes: Optional[list[int]]
    tokens: float = 0.0
    """Loss-bearing tokens of the global batch (read with the loss, in the same synchronisation)."""


def step_metrics(pipe: Pipeline, result: StepResult, tokens: torch.Tensor | float) -> StepMetrics:
    """Global-batch mean loss, the token count, and peak stash (and CUDA) bytes per pipeline rank.

    The loss lives on the last pipeline stage; peaks are maxed over each pipeline rank's tp and dp
    replicas. Two small collectives: a dp sum of the loss, then a world max that carries everything to
    every rank; reading the max's result is the step's one read of the loss (`host_read`).
    """
    state = pipe.state
    pp = state.pp_size
    tokens = torch.as_tensor(tokens, dtype=torch.float64)
    # Every rank joins the dp sum; ranks without the last stage add a zero (made on the loss's device
    # where there is one, and moved by comm to the device the backend needs either way).
    loss = result.loss_sum.double() if result.loss_sum is not None else torch.zeros((), dtype=torch.float64)
    if state.dp_group is not None and state.dp_size > 1:
        loss = comm.all_reduce(loss, group=state.dp_group)
    vec = torch.full((2 + 2 * pp,), -math.inf, dtype=torch.float64, device=tokens.device)
    if result.loss_sum is not None:
        # A NaN would not survive the max all-reduce reliably; +inf does, so every rank sees it.
        loss = loss.to(tokens.device)
        vec[0] = torch.where(torch.isfinite(loss), loss / tokens, math.inf)
    vec[1 + state.pp_rank] = float(result.peak_stash_bytes)
    on_cuda = state.device.type == "cuda"
    if on_cuda:
        vec[1 + pp + state.pp_rank] = float(take_peak_memory(state.device))
    vec[-1] = tokens  # every rank has the same count: the max carries it unchanged
    values = read_values(comm.all_reduce(vec, op="max"), "loss")
    return StepMetrics(
        loss=values[0],
        peak_stash_bytes=[int(v) for v in values[1:1 + pp]],
        peak_memory_bytes=[int(v) for v in values[1 + pp:1 + 2 * pp]] if on_cuda else None,
        tokens=values[-1],
    )
