"""Two weight versions per stage and one optimizer state: the runtime of PipeDream-2BW
(arXiv 2006.09503).

`WeightVersions` keeps two buffers per trainable parameter; version v (the weights batch v runs on,
W(v−1), see `schedules.twobw`) lives in buffer v mod 2. Before every F and B the executor asks it (as
the executor's hooks) to point the parameters at the action's version by swapping `param.data`, one
pointer per parameter and nothing copied. Why that is enough: autograd saves a parameter a forward used
as the parameter object itself (a leaf), so the backward reads whatever `param.data` is when it runs;
pointing it at the forward's version right before the backward (which recomputation also relies on)
gives every backward its forward's weights, while tensors autograd derived from the weights (views,
casts) keep the buffer they were made from. A buffer is overwritten only by the update that creates the
version two after its tenant, once no stash of that tenant is in flight (`claim` refuses otherwise), so
no saved tensor ever changes under a pending backward.

`DelayedUpdateOptimizer` is the update: one optimizer state (momentum, Adam moments) updated in place,
W(t+1) = W(t) − lr·u(g(W(t−1))). The fp32 main weights are the newest version itself for an fp32 model
(the optimizer's parameters alias its buffer: `claim` copies W(t) into the free buffer, the optimizer
steps it to W(t+1) there) and fp32 copies for bf16/fp16 models (stepped, then cast into the free buffer).

The update of batch t runs where the schedule puts STEP@(t+2), one batch later than where batch t ends,
so its global operations run in the background (the module docstring of `schedules.twobw` shows that
every rank has finished batch t by then):

1. when a rank has run its last backward of batch t (`finish_batch`), the data-parallel and
   sequence-parallel sums run (the rank's data-parallel replicas are in lockstep with it); the reduced
   gradient is copied to the *pending* buffer, because batch t+1 starts accumulating at once;
2. the tied embedding (first and last stage): the last stage finishes batch t before stage 0 (the
   backward reaches stage 0 last), so it starts the embedding-group sum on its pending copy and goes on;
   stage 0 then joins it and finds it already posted, so its wait is the sum itself;
3. each rank starts one world all-reduce of [inf/NaN flag, sum of squares of the gradient it counts]
   (stage 0 counts the summed embedding, the last stage's copy is only checked for inf);
4. at STEP@(t+2) the rank waits for both (already complete in the steady state), updates the fp16 loss
   scaler, skips the update on inf/NaN (the new version is then a copy of the newest), else unscales and
   clips by the global norm and steps.

Only the fp16 loss scale shifts: batch t's loss is scaled by the scale the scaler had after batch t−2's
update (the last stage computes batch t's loss before batch t−1's update has run), the gradient is
unscaled by that same value, and an overflow at batch t lowers the scale from batch t+2 on.

Memory per stage: two weight buffers in the model's dtype, fp32 main weights (free for an fp32 model),
one optimizer state, and two fp32 gradient buffers (the reducer's, where batch t+1 accumulates, and the
pending copy of batch t); the distributed optimizer and sharded weights are not supported with 2BW.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from megatron_pp.core.grads import GradientReducer, counts_once_in_model, squared_norms_fp64, unique_parameters
from megatron_pp.core.parallel_state import ParallelState
from megatron_pp.core.storage import same_memory
from megatron_pp.core import comm
from megatron_pp.core.host_read import read_values
from megatron_pp.core.tensor_parallel.utils import PendingCollective, start_all_reduce_
from megatron_pp.schedules.execute import ExecutorHooks
from megatron_pp.schedules.ir import Action, Op, Schedule
from megatron_pp.schedules.runtime import runtime_needs
from megatron_pp.training.optimizer import (LossScaler, OptimizerConfig, StepOutcome, _check_precision,
                                            _make_inner_optimizer)


def uses_weight_versions(schedule: Schedule) -> bool:
    """Whether `schedule` runs on two weight versions (2BW) and so needs `WeightVersions`: its actions carry
    weight versions or an in-list optimizer STEP (a fact of the lists, so plugins and files get it too)."""
    return runtime_needs(schedule).weight_versions


class WeightVersions(ExecutorHooks):
    """Two buffers per trainable parameter of a rank's chunks; the executor's hooks for 2BW.

    Buffer 0 is the parameters' own storage and buffer 1 a copy, so versions 0 and 1 both start as the
    initial weights. `held[b]` is the version in buffer b; `peak_versions_in_use` is the most versions
    that were needed at once (in flight or being computed on), never more than 2.
    """

    def __init__(self, chunks: Sequence[nn.Module]) -> None:
        self.params = [p for p in unique_parameters(chunks) if p.requires_grad]
        self.buffers = ([p.data for p in self.params], [p.detach().clone() for p in self.params])
        self.held = [0, 1]
        self._active = 0
        self._in_flight: Counter[int] = Counter()  # stashes (F run, B not yet) per version
        self.peak_versions_in_use = 0
        self.on_step: Optional[Callable[[int], None]] = None
        """The update run by STEP@v, given v; attached by `DelayedUpdateOptimizer`."""
        self.handlers = {Op.STEP: self._step}

    @property
    def newest(self) -> int:
        return max(self.held)

    def use(self, version: int) -> None:
        """Point every parameter at `version`'s buffer; it must hold that version."""
        buffer = version % 2
        if self.held[buffer] != version:
            raise RuntimeError(f"weight version {version} is not in memory: buffer {buffer} holds version "
                               f"{self.held[buffer]}")
        if buffer != self._active:
            for p, t in zip(self.params, self.buffers[buffer]):
                p.data = t
            self._active = buffer

    def before_compute(self, action: Action) -> None:
        self.use(action.version)
        if action.op is Op.F:
            self._in_flight[action.version] += 1
        in_use = {v for v, n in self._in_flight.items() if n > 0} | {action.version}
        self.peak_versions_in_use = max(self.peak_versions_in_use, len(in_use))
        if action.op in (Op.B, Op.BW):
            self._in_flight[action.version] -= 1

    def _step(self, action: Action) -> None:
        if self.on_step is None:
            raise RuntimeError("a 2BW STEP ran without its optimizer: build a DelayedUpdateOptimizer on these "
                               "WeightVersions")
        self.on_step(action.version)

    @torch.no_grad()
    def claim(self, version: int) -> list[torch.Tensor]:
        """The buffer of the new `version` (= newest + 1), filled with the newest weights, for the update
        that creates it. Its tenant, version − 2, must have nothing in flight."""
        buffer = version % 2
        tenant = self.held[buffer]
        if version != self.newest + 1:
            raise RuntimeError(f"version {version} cannot follow version {self.newest}")
        if self._in_flight[tenant]:
            raise RuntimeError(f"version {version} needs buffer {buffer}, but {self._in_flight[tenant]} stashes of "
                               f"version {tenant} are still in flight (a third weight version)")
        for dst, src in zip(self.buffers[buffer], self.buffers[1 - buffer]):
            dst.copy_(src)
        del self._in_flight[tenant]
        self.held[buffer] = version
        return self.buffers[buffer]

    def older(self) -> list[torch.Tensor]:
        """The weights of the older version in memory."""
        return self.buffers[(self.newest - 1) % 2]

    @torch.no_grad()
    def restore(self, newest_version: int, older: Optional[Sequence[torch.Tensor]]) -> None:
        """After the parameters were loaded with the newest weights (a checkpoint): make them version
        `newest_version` and `older` (None: the same weights, as at a start) version `newest_version` − 1."""
        if older is not None:
            shapes = [tuple(t.shape) for t in older]
            if shapes != [tuple(p.shape) for p in self.params]:
                raise ValueError(f"the checkpoint's older weight version has {len(shapes)} tensors that do not "
                                 f"match this rank's {len(self.params)} trainable parameters")
        if any(self._in_flight.values()):
            raise RuntimeError("restoring weight versions while microbatches are in flight")
        newest = newest_version % 2
        for dst, p in zip(self.buffers[newest], self.params):
            if not same_memory(dst, p.data):
                dst.copy_(p.data)
        for dst, src in zip(self.buffers[1 - newest], older if older is not None else self.buffers[newest]):
            dst.copy_(src)
        self.held[newest], self.held[1 - newest] = newest_version, newest_version - 1
        self._in_flight.clear()
        self._active = 1 - newest
        self.use(newest_version)


@dataclass
class _PendingBatch:
    """One batch's gradient on its way from the rank's last backward of it to its update."""

    index: int
    loss_scale: float
    """The multiplier its losses were scaled by (fp16), to divide its gradient by."""
    finished: bool = False
    stats: Optional[PendingCollective] = None
    """World sum of [inf/NaN flag, sum of squares of the counted gradient]."""
    embedding: list[PendingCollective] = field(default_factory=list)


class DelayedUpdateOptimizer:
    """2BW's optimizer: one optimizer state, the update of batch t deferred to STEP@(t+2) (module docstring).

    Per call of the executor (`training.twobw.DeferredUpdateSteps`): `begin_batch(t)` gives the loss multiplier,
    `reducer.start_step(m)`, the executor runs (its STEPs call the update), then `finish_batch(t)`.
    `outcomes[t]` is the result of batch t's update once it ran. `state_dict` (only between flushed
    steps) has the same layout as `TrainingOptimizer`'s, so checkpoints move between 2BW and other
    schedules.
    """

    sharded_weights = None
    """2BW keeps whole weights (read by `training.layered`)."""

    def __init__(self, chunks: Sequence[nn.Module], state: ParallelState, config: OptimizerConfig,
                 versions: WeightVersions) -> None:
        unsupported = [flag for flag, on in (
            ("--use-distributed-optimizer", config.use_distributed_optimizer),
            ("--layered-grad-accumulation", getattr(config, "layered_grad_accumulation", False)),
        ) if on]
        if unsupported:
            raise ValueError(f"--pipeline-schedule 2bw keeps whole fp32 main weights and gradients per stage: "
                             f"{', '.join(unsupported)} is not supported with it")
        params = versions.params
        _check_precision(params, config)
        self.config = config
        self.state = state
        self.versions = versions
        self.reducer = GradientReducer(chunks, state, overlap=config.overlap_grad_reduce,
                                       bucket_bytes=config.bucket_bytes)
        self.copies = any(p.dtype != torch.float32 for p in params)
        newest = versions.buffers[versions.newest % 2]
        self.main = [nn.Parameter(t.detach().float().clone() if self.copies else t) for t in newest]
        decay = [p.dim() > 1 for p in params]
        groups = [{"params": [m for m, d in zip(self.main, decay) if d]},
                  {"params": [m for m, d in zip(self.main, decay) if not d], "weight_decay": 0.0}]
        self.optimizer, self.implementation = _make_inner_optimizer(groups, config, params[0].device)
        self.scaler: Optional[LossScaler] = None
        if config.fp16:
            dynamic = config.loss_scale is None
            self.scaler = LossScaler(
                config.initial_loss_scale if dynamic else config.loss_scale, dynamic=dynamic,
                min_scale=config.min_loss_scale, window=config.loss_scale_window, hysteresis=config.hysteresis)
        # The pending copy of each reducer bucket, and each parameter's gradient view into it.
        self._pending = [torch.empty_like(bucket.grad) for bucket in self.reducer.buckets]
        self._pending_grad: dict[int, torch.Tensor] = {}
        for bucket, pending in zip(self.reducer.buckets, self._pending):
            for p, offset in zip(bucket.params, bucket.offsets):
                self._pending_grad[id(p)] = pending[offset:offset + p.numel()].view_as(p)
        self._pending_batch: Optional[int] = None
        self._batches: dict[int, _PendingBatch] = {}
        scale = self.scaler.scale if self.scaler is not None else 1.0
        self.loss_scales: dict[int, float] = {0: scale, 1: scale}
        """Loss multiplier of each batch that may still start: the scale after batch t−2's update."""
        self.outcomes: dict[int, tuple[StepOutcome, float]] = {}
        """Batch -> (its update's outcome, the learning rate it used), until the trainer takes them."""
        self.lr_of_batch: Callable[[int], float] = lambda batch: config.lr
        """Learning rate of batch t's update; the trainer sets it from its LR schedule."""
        versions.on_step = self.update

    @property
    def flushed(self) -> bool:
        """No batch is between its first backward and its update."""
        return not self._batches

    def begin_batch(self, batch: int) -> float:
        """Register `batch`, whose call is about to run; returns the multiplier its losses take."""
        scale = self.loss_scales[batch]
        self._batches[batch] = _PendingBatch(batch, scale)
        return scale

    @torch.no_grad()
    def finish_batch(self, batch: int) -> None:
        """Reduce `batch`'s gradient and start its global operations (after this rank's last backward of
        it); a no-op if its update (a flush) already did."""
        if batch in self.outcomes:
            return
        record = self._batches[batch]
        if record.finished:
            return
        if self._pending_batch is not None:
            raise RuntimeError(f"batch {batch}'s gradient is complete before batch {self._pending_batch}'s update "
                               "ran: its STEP must come first (schedules.twobw)")
        self.reducer.finish(reduce_embedding=False)
        for pending, bucket in zip(self._pending, self.reducer.buckets):
            pending.copy_(bucket.grad)
        self._pending_batch = batch
        state = self.state
        embedding = [self._pending_grad[id(p)] for p in self.reducer.embedding_params]
        if embedding and state.is_first_pp_rank:
            # The last stage joined this sum when it finished the batch, before the backward reached here.
            for grad in embedding:
                start_all_reduce_(grad, state.embedding_group).wait()
            embedding = []
        stats = self._local_stats()  # before the last stage's embedding sum starts writing its copy
        record.embedding = [start_all_reduce_(grad, state.embedding_group) for grad in embedding]
        record.stats = PendingCollective(None, comm.all_reduce_async(stats).result)
        record.finished = True

    def _local_stats(self) -> torch.Tensor:
        """[inf/NaN flag, sum of squares of the gradient this rank counts] (as `GradientReducer`)."""
        state = self.state
        device = self._pending[0].device
        counted_grads, rest_grads = [], []
        for p in self.versions.params:
            grad = self._pending_grad[id(p)]
            (counted_grads if counts_once_in_model(p, state) and state.dp_rank == 0 else rest_grads).append(grad)
        if not counted_grads and not rest_grads:
            counted = rest = torch.zeros((), dtype=torch.float64, device=device)
        else:
            counted, rest = squared_norms_fp64([counted_grads, rest_grads])  # one multi-tensor kernel
        return torch.stack([(~torch.isfinite(counted + rest)).double(), counted])

    @torch.no_grad()
    def update(self, version: int) -> None:
        """STEP@`version`: apply batch version−2's gradient to the newest weights, creating `version`."""
        batch = version - 2
        if batch not in self._batches:
            raise RuntimeError(f"STEP@{version} for batch {batch}, which never ran on this rank")
        self.finish_batch(batch)  # at a flush the STEP comes right after the batch's last backward
        record = self._batches.pop(batch)
        found, sumsq = read_values(record.stats.wait(), "found-inf")
        for pending in record.embedding:
            pending.wait()
        found_inf = found > 0
        if self.scaler is not None:
            self.scaler.update(found_inf)
        target = self.versions.claim(version)  # the newest weights, in the free buffer
        lr = self.lr_of_batch(batch)
        if found_inf:
            grad_norm = math.inf
        else:
            grad_norm = math.sqrt(sumsq) / record.loss_scale
            factor = 1.0 / record.loss_scale
            if self.config.clip_grad > 0 and grad_norm > self.config.clip_grad:
                factor *= self.config.clip_grad / (grad_norm + 1e-6)
            if factor != 1.0:
                for pending in self._pending:
                    pending.mul_(factor)
        if not self.copies:
            for main, t in zip(self.main, target):
                main.data = t  # W(t) was copied in by `claim`; the optimizer steps it to W(t+1) there
        if not found_inf:
            for main, p in zip(self.main, self.versions.params):
                main.grad = self._pending_grad[id(p)]
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            if self.copies:
                for t, main in zip(target, self.main):
                    t.copy_(main)
        self._pending_batch = None
        scale = self.scaler.scale if self.scaler is not None else None
        self.loss_scales.pop(batch, None)
        self.loss_scales[batch + 2] = scale if scale is not None else 1.0
        self.outcomes[batch] = (StepOutcome(skipped=found_inf, grad_norm=grad_norm, loss_scale=scale), lr)

    # Checkpoints -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """As `TrainingOptimizer.state_dict`; only between flushed steps."""
        if not self.flushed:
            raise RuntimeError("2BW optimizer state saved with updates pending: flush first")
        return {
            "optimizer": self.optimizer.state_dict(),
            "main_params": {"main": list(self.main) if self.copies else []},
            "loss_scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["main_params"]["main"]
        needed = len(self.main) if self.copies else 0
        if len(saved) != needed:
            raise ValueError(f"checkpoint holds {len(saved)} fp32 main weights, this model needs {needed}: was it "
                             "saved with another precision (--bf16/--fp16) or model?")
        for main, value in zip(self.main if self.copies else [], saved):
            main.copy_(value)
        self.optimizer.load_state_dict(state["optimizer"])
        if (state["loss_scaler"] is None) != (self.scaler is None):
            raise ValueError("checkpoint and run disagree on --fp16 (loss scaler state present in only one)")
        if self.scaler is not None:
            self.scaler.load_state_dict(state["loss_scaler"])

    def position_state(self, next_batch: int) -> dict[str, Any]:
        """Where the update stands between flushed steps (for the schedule state of a checkpoint)."""
        return {"loss_scales": [self.loss_scales[next_batch], self.loss_scales[next_batch + 1]]}

    @torch.no_grad()
    def restore_position(self, next_batch: int, position: Optional[dict[str, Any]], main_loaded: bool) -> None:
        """After loading a checkpoint at `next_batch`: the main weights follow the newest version (fp32 copies
        are taken from it unless the checkpoint's were loaded, `main_loaded`), and the next two batches take
        the saved loss scales (the scaler's current one without them)."""
        newest = self.versions.buffers[self.versions.newest % 2]
        for main, t in zip(self.main, newest):
            if not self.copies:
                main.data = t
            elif not main_loaded:
                main.copy_(t)
        current = self.scaler.scale if self.scaler is not None else 1.0
        scales = position["loss_scales"] if position else [current, current]
        self.loss_scales = {next_batch: float(scales[0]), next_batch + 1: float(scales[1])}
