"""The optimizer step of training: mixed precision, loss scaling, clipping, AdamW/SGD, and the LR schedule.

`build_optimizer(chunks, state, OptimizerConfig)` returns a `TrainingOptimizer` that owns the rank's
`GradientReducer` (bucketed, optionally overlapped data-parallel reduction) and fp32 *main* weights:
the model's own parameters when they are fp32, fp32 copies when they are bf16/fp16 (bf16 has too few
mantissa bits to accumulate small updates), or, with the distributed optimizer, only this data-parallel
rank's shard of them (`core.distributed_optimizer`). Gradients always accumulate and reduce in fp32.
A step is: global inf/NaN check and gradient norm in one world all-reduce (so every rank takes the same
decision), skip on overflow (and, under fp16, back off the loss scale), else unscale and clip in one
multiply, update the main weights, copy them into the model. Weight decay is not applied to biases and
norm weights (1-D parameters), as in Megatron-LM.

`LRSchedule` is a pure function from the step's position (iterations, or consumed samples) to the LR:
linear warmup, then constant, linear, cosine or WSD (warmup-stable-decay) decay to `min_lr`.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from megatron_pp.core.distributed_optimizer import ShardedMainParams
from megatron_pp.core.grads import DEFAULT_BUCKET_BYTES, GradientReducer, unique_parameters
from megatron_pp.core.layered_grads import LayeredGradientReducer
from megatron_pp.core.sharded_weights import ShardedWeights, ShardedWeightsMainParams
from megatron_pp.core.parallel_state import ParallelState


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _given(args: argparse.Namespace, name: str) -> Any:
    """`args.name`, or None when the parser has no such flag (or it was left unset)."""
    return getattr(args, name, None)


# Learning-rate schedule -------------------------------------------------------------------------------------

DECAY_STYLES = ("constant", "linear", "cosine", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")

# Shape of WSD's final decay: the LR multiplier (1 -> 0) at fraction r of the decay (Megatron's names).
_WSD_SHAPES: dict[str, Callable[[float], float]] = {
    "linear": lambda r: 1.0 - r,
    "cosine": lambda r: 0.5 * (1.0 + math.cos(math.pi * r)),
    "exponential": lambda r: 2.0 * 0.5**r - 1.0,
    "minus_sqrt": lambda r: 1.0 - math.sqrt(r),
}


@dataclass(frozen=True)
class LRSchedule:
    """Learning rate as a function of the position of the step: warmup, then decay.

    Positions count *completed* units including the current step: iteration i (1-based) is at i, or,
    for a sample-based schedule, at the samples consumed up to and including it. With warmup W, decay
    end D (both in that unit) and position t:

        t <= W                    lr * t / W
        constant                  lr
        linear / cosine           min_lr + (lr - min_lr) * f((t - W) / (D - W)),  f = 1 - r or (1 + cos(pi r)) / 2
        WSD                       lr until D - wsd_decay_steps, then min_lr + (lr - min_lr) * shape(r) over
                                  the last wsd_decay_steps (shape: linear, cosine, exponential, minus_sqrt)
        t >= D (decaying styles)  min_lr

    Example: lr 1e-3, min_lr 1e-4, W 2, D 10, cosine: t = 1, 2, 6, 10 give 5e-4, 1e-3, 5.5e-4, 1e-4.
    Pure: no state to checkpoint beyond the iteration / consumed samples the loop already saves.
    """

    lr: float
    """Peak learning rate (--lr)."""
    min_lr: float = 0.0
    """Floor that decaying styles end at (--min-lr)."""
    decay_style: str = "constant"
    """constant | linear | cosine | WSD (--lr-decay-style)."""
    warmup_steps: int = 0
    """Length of the linear warmup from 0 (--lr-warmup-iters / --lr-warmup-samples)."""
    decay_steps: Optional[int] = None
    """Where decay ends, counted from the start (--lr-decay-iters / --lr-decay-samples; default: the run's length)."""
    wsd_decay_steps: int = 0
    """Length of WSD's final decay (--lr-wsd-decay-iters / --lr-wsd-decay-samples)."""
    wsd_decay_style: str = "exponential"
    """Shape of WSD's final decay (--lr-wsd-decay-style)."""
    by_samples: bool = False
    """Positions count consumed samples instead of iterations."""
    decoupled: Optional["LRSchedule"] = None
    """The word embedding's and output layer's schedule under --decoupled-lr: this one with its peak and
    floor replaced (--decoupled-lr, --decoupled-min-lr or --min-lr), as Megatron-LM's parameter groups."""

    def __post_init__(self) -> None:
        unit = "samples" if self.by_samples else "iters"
        if self.lr < 0:
            raise ValueError(f"--lr must be >= 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"--min-lr {self.min_lr} must be in [0, --lr {self.lr}]")
        if self.decay_style not in DECAY_STYLES:
            raise ValueError(f"--lr-decay-style {self.decay_style!r} is not one of {', '.join(DECAY_STYLES)}")
        if self.warmup_steps < 0:
            raise ValueError(f"--lr-warmup-{unit} must be >= 0, got {self.warmup_steps}")
        # Megatron's rule for every style, constant included: the warm-up ends before the decay length (the
        # run's length by default, as from_args fills it in); validate_args refuses the same flags up front.
        if self.warmup_steps and self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            raise ValueError(
                f"--lr-warmup-{unit} {self.warmup_steps} must be less than --lr-decay-{unit} (default: the run's "
                f"length), got {self.decay_steps}"
            )
        if self.decay_style == "constant":
            return
        if self.decay_steps is None or self.decay_steps <= self.warmup_steps:
            raise ValueError(
                f"--lr-decay-style {self.decay_style} needs --lr-decay-{unit} (default: the run's length) greater than "
                f"--lr-warmup-{unit} {self.warmup_steps}, got {self.decay_steps}"
            )
        if self.decay_style == "WSD":
            if self.wsd_decay_style not in WSD_DECAY_STYLES:
                raise ValueError(
                    f"--lr-wsd-decay-style {self.wsd_decay_style!r} is not one of {', '.join(WSD_DECAY_STYLES)}"
                )
            if not 0 < self.wsd_decay_steps <= self.decay_steps - self.warmup_steps:
                raise ValueError(
                    f"--lr-decay-style WSD needs --lr-wsd-decay-{unit} in [1, {self.decay_steps - self.warmup_steps}] "
                    f"(decay end minus warmup), got {self.wsd_decay_steps}"
                )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "LRSchedule":
        """From Megatron's flags. Iteration-based unless the sample flags are used (Megatron forbids mixing)."""
        iter_flags = [n for n in ("lr_warmup_iters", "lr_decay_iters", "lr_wsd_decay_iters") if _given(args, n)]
        sample_flags = [n for n in ("lr_warmup_samples", "lr_decay_samples", "lr_wsd_decay_samples") if _given(args, n)]
        if iter_flags and sample_flags:
            raise ValueError(
                f"{_flag(iter_flags[0])} and {_flag(sample_flags[0])} cannot be combined: an LR schedule counts "
                "either iterations or samples"
            )
        by_samples = bool(sample_flags) or bool(_given(args, "train_samples") and not _given(args, "train_iters"))
        unit = "samples" if by_samples else "iters"
        length = _given(args, "train_samples" if by_samples else "train_iters")
        decay_steps = _given(args, f"lr_decay_{unit}") or length
        warmup_steps = _given(args, f"lr_warmup_{unit}") or 0
        if _given(args, "lr_warmup_fraction") is not None and decay_steps is not None:
            # Megatron-LM: warm-up = fraction x decay length, in the schedule's unit and not rounded
            # (.001 of 430000 iterations: 430.0; of 1000 samples: 1.0).
            warmup_steps = args.lr_warmup_fraction * decay_steps
        main = cls(
            lr=args.lr,
            min_lr=_given(args, "min_lr") or 0.0,
            decay_style=_given(args, "lr_decay_style") or "constant",
            warmup_steps=warmup_steps,
            decay_steps=decay_steps,
            wsd_decay_steps=_given(args, f"lr_wsd_decay_{unit}") or 0,
            wsd_decay_style=_given(args, "lr_wsd_decay_style") or "exponential",
            by_samples=by_samples,
        )
        if _given(args, "decoupled_lr") is None:
            return main
        floor = _given(args, "decoupled_min_lr")
        decoupled = dataclasses.replace(main, lr=args.decoupled_lr, min_lr=main.min_lr if floor is None else floor)
        return dataclasses.replace(main, decoupled=decoupled)

    def decoupled_rate(self, iteration: int, consumed_samples: Optional[int] = None) -> Optional[float]:
        """The embedding and output layer's LR at this step under --decoupled-lr, else None."""
        return None if self.decoupled is None else self.decoupled.learning_rate(iteration, consumed_samples)

    def learning_rate(self, iteration: int, consumed_samples: Optional[int] = None) -> float:
        """LR of optimizer step `iteration` (1-based); sample-based schedules read `consumed_samples`
        (samples consumed up to and including this step) instead."""
        if self.by_samples:
            if consumed_samples is None:
                raise ValueError("a sample-based LR schedule needs consumed_samples")
            t = consumed_samples
        else:
            t = iteration
        if t < 0:
            raise ValueError(f"LR schedule position must be >= 0, got {t}")
        if self.warmup_steps > 0 and t <= self.warmup_steps:
            return self.lr * t / self.warmup_steps
        if self.decay_style == "constant":
            return self.lr
        if t >= self.decay_steps:
            return self.min_lr
        if self.decay_style == "WSD":
            anneal_start = self.decay_steps - self.wsd_decay_steps
            if t <= anneal_start:
                return self.lr
            coeff = _WSD_SHAPES[self.wsd_decay_style]((t - anneal_start) / self.wsd_decay_steps)
        else:
            ratio = (t - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
            coeff = 1.0 - ratio if self.decay_style == "linear" else 0.5 * (1.0 + math.cos(math.pi * ratio))
        return self.min_lr + (self.lr - self.min_lr) * coeff


# Configuration -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OptimizerConfig:
    """Everything the optimizer step needs; field names are Megatron's flags with `_` for `-`."""

    optimizer: str = "adam"
    """adam (AdamW: decoupled weight decay) or sgd."""
    lr: float = 1e-3
    """LR the optimizer is built with; each step's LR comes from `LRSchedule` through `step(lr)`."""
    weight_decay: float = 0.01
    """Decoupled (AdamW) or L2 (SGD) weight decay on parameters with 2+ dims."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""
    bf16: bool = False
    """The model's parameters are bf16 (fp32 main weights are kept)."""
    fp16: bool = False
    """The model's parameters are fp16 (fp32 main weights and loss scaling)."""
    loss_scale: Optional[float] = None
    """Static fp16 loss scale; None means dynamic scaling."""
    initial_loss_scale: float = 2.0**32
    """Dynamic scaling's starting scale."""
    min_loss_scale: float = 1.0
    """Dynamic scaling never backs off below this."""
    loss_scale_window: int = 1000
    """Double the dynamic scale after this many steps without overflow."""
    hysteresis: int = 2
    """Overflowing steps tolerated before the dynamic scale is halved (reset when it grows)."""
    use_distributed_optimizer: bool = False
    """Shard main weights and optimizer state over data parallelism (ZeRO-1)."""
    overlap_grad_reduce: bool = False
    """Start each gradient bucket's data-parallel reduction during the backward, as soon as it is complete."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Size of a gradient bucket (fp32 bytes): a few large collectives instead of one per tensor."""
    layered_grad_accumulation: bool = False
    """Reduce each model chunk's buckets when the schedule's REDUCE_GRAD says (`LayeredGradientReducer`),
    once per breadth-first group, instead of when the hooks see them complete (supersedes overlap)."""
    data_parallel_sharding_strategy: str = "no_shard"
    """no_shard, optim (the distributed optimizer) or optim_grads_params (also the weights: ZeRO-3)."""
    grad_reduce_in_bf16: bool = False
    """Gradient buffers in bf16 (with --bf16): accumulation and the data-parallel reduction in bf16, the
    optimizer's main gradients fp32 copies of them (Megatron-LM's --grad-reduce-in-bf16)."""
    decoupled_lr: Optional[float] = None
    """--decoupled-lr: the word embedding and output layer step in groups of their own, whose LR
    `step(lr, decoupled_lr)` sets apart (the parameters tagged `is_embedding_or_output_parameter`)."""
    adam_implementation: Optional[str] = None
    """AdamW's kernel: None = what the device runs (fused on CUDA, foreach elsewhere); `fused` or `foreach`
    forces one (torch has both on the CPU). The dry run sets it to what the job's GPU would build."""

    def __post_init__(self) -> None:
        problems = []
        if self.optimizer not in ("adam", "sgd"):
            problems.append(f"--optimizer {self.optimizer!r} is not one of adam, sgd")
        for name in ("lr", "weight_decay", "clip_grad", "sgd_momentum"):
            if getattr(self, name) < 0:
                problems.append(f"{_flag(name)} must be >= 0, got {getattr(self, name)}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                problems.append(f"{_flag(name)} must be in [0, 1), got {getattr(self, name)}")
        if self.adam_eps <= 0:
            problems.append(f"--adam-eps must be > 0, got {self.adam_eps}")
        if self.bf16 and self.fp16:
            problems.append("--bf16 and --fp16 are mutually exclusive")
        if self.grad_reduce_in_bf16 and not self.bf16:
            problems.append("--grad-reduce-in-bf16 applies only to --bf16")
        if self.loss_scale is not None and self.loss_scale <= 0:
            problems.append(f"--loss-scale must be > 0, got {self.loss_scale}")
        if not 0 < self.min_loss_scale <= self.initial_loss_scale:
            problems.append(
                f"--min-loss-scale {self.min_loss_scale} must be in (0, --initial-loss-scale {self.initial_loss_scale}]"
            )
        for name in ("loss_scale_window", "hysteresis", "bucket_bytes"):
            if getattr(self, name) < 1:
                problems.append(f"{_flag(name)} must be >= 1, got {getattr(self, name)}")
        strategy = self.data_parallel_sharding_strategy
        if strategy not in ("no_shard", "optim", "optim_grads_params"):
            problems.append(f"--data-parallel-sharding-strategy {strategy!r} is not one of no_shard, optim, "
                            "optim_grads_params")
        elif strategy != "no_shard" and not self.use_distributed_optimizer:
            problems.append(f"--data-parallel-sharding-strategy {strategy} shards the optimizer: it needs "
                            "--use-distributed-optimizer")
        if self.adam_implementation not in (None, "fused", "foreach"):
            problems.append(f"AdamW implementation {self.adam_implementation!r} is not one of fused, foreach")
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "OptimizerConfig":
        """Read every field from the parsed arguments that has it (flags a parser lacks keep the defaults)."""
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if _given(args, f.name) is not None}
        return cls(**values)


# fp16 loss scaling -----------------------------------------------------------------------------------------------


class LossScaler:
    """The fp16 loss scale: the loss is multiplied by it so small gradients survive fp16, and the
    gradients divided by it before the update.

    Static (`dynamic=False`): the scale never changes; an overflowing step is still skipped. Dynamic, with
    Megatron-LM's semantics: an overflowing step is skipped and uses up one unit of hysteresis; once the
    hysteresis is spent, each overflow halves the scale (not below `min_scale`). `window` consecutive
    clean steps double the scale and restore the full hysteresis. Example, hysteresis 2, window 3,
    scale 8: overflow -> 8 (hysteresis left 1), overflow -> 4, overflow -> 2, 3 clean steps -> 4.
    """

    def __init__(
        self,
        initial_scale: float,
        *,
        dynamic: bool = True,
        min_scale: float = 1.0,
        window: int = 1000,
        hysteresis: int = 2,
    ) -> None:
        self.scale = float(initial_scale)
        self.dynamic = dynamic
        self.min_scale = min_scale
        self.window = window
        self.hysteresis = hysteresis
        self._clean_steps = 0
        self._hysteresis_left = hysteresis

    def update(self, found_inf: bool) -> None:
        """Account for one step's outcome (call on every rank with the same, globally agreed flag)."""
        if not self.dynamic:
            return
        if found_inf:
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * 0.5, self.min_scale)
            return
        self._clean_steps += 1
        if self._clean_steps == self.window:
            self._clean_steps = 0
            self._hysteresis_left = self.hysteresis
            self.scale *= 2.0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean_steps": self._clean_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])


# Main weights without the distributed optimizer ------------------------------------------------------------------


class ReplicatedMainParams:
    """fp32 main weights on every data-parallel replica: the model's parameters themselves when they are
    fp32, else fp32 copies. Their `.grad` are the reducer's fp32 gradient slots (no copy)."""

    shards_state_over_dp = False

    def __init__(self, reducer: GradientReducer, model_params: Sequence[nn.Parameter]) -> None:
        self.reducer = reducer
        self.model_params = list(model_params)
        self.copies = any(p.dtype != torch.float32 for p in self.model_params)
        if self.copies:
            self.params = [nn.Parameter(p.detach().float().clone()) for p in self.model_params]
        else:
            self.params = self.model_params
        self.decay = [p.dim() > 1 for p in self.model_params]
        self.attach_grads()

    def attach_grads(self) -> None:
        for main, model in zip(self.params, self.model_params):
            view = self.reducer.grad_view(model)
            main.grad = view if view.dtype == main.dtype else view.float()  # bf16 buffers: an fp32 copy

    @torch.no_grad()
    def copy_to_model(self) -> None:
        if self.copies:
            for main, model in zip(self.params, self.model_params):
                model.copy_(main)

    def state_dict(self) -> dict[str, Any]:
        """The fp32 copies (empty for an fp32 model: its own checkpoint holds the exact weights)."""
        return {"main": list(self.params) if self.copies else []}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["main"]
        needed = len(self.params) if self.copies else 0
        if len(saved) != needed:
            raise ValueError(
                f"checkpoint holds {len(saved)} fp32 main weights, this model needs {needed}: "
                "was it saved with another precision (--bf16/--fp16) or model?"
            )
        for main, value in zip(self.params if self.copies else [], saved):
            main.copy_(value)


# The optimizer -------------------------------------------------------------------------------------------------


@dataclass
class StepOutcome:
    skipped: bool
    """The update was not applied: a gradient was inf or NaN on some rank (every rank agrees)."""
    grad_norm: float
    """Global L2 norm of the unscaled gradient before clipping (inf when skipped)."""
    loss_scale: Optional[float]
    """fp16 only: the loss scale after this step's update, i.e. what the next step uses."""


def _apex_fused_adam() -> Optional[type]:
    try:
        from apex.optimizers import FusedAdam
    except ImportError:
        return None
    return FusedAdam


class TrainingOptimizer:
    """A rank's gradient reduction, main weights, loss scaler and inner optimizer. Per step:

        optimizer.reducer.start_step(num_microbatches)
        executor.run(microbatches, loss_scale=optimizer.loss_multiplier / global_tokens)
        optimizer.reducer.finish()
        outcome = optimizer.step(lr)
    """

    def __init__(self, chunks: Sequence[nn.Module], state: ParallelState, config: OptimizerConfig) -> None:
        params = [p for p in unique_parameters(chunks) if p.requires_grad]
        _check_precision(params, config)
        self.config = config
        self.state = state
        if config.layered_grad_accumulation:
            self.reducer: GradientReducer = LayeredGradientReducer(
                chunks, state, bucket_bytes=config.bucket_bytes, distributed_optimizer=config.use_distributed_optimizer)
        else:
            self.reducer = GradientReducer(
                chunks, state, overlap=config.overlap_grad_reduce, bucket_bytes=config.bucket_bytes,
                distributed_optimizer=config.use_distributed_optimizer,
                grad_dtype=torch.bfloat16 if config.grad_reduce_in_bf16 else torch.float32,
            )
        self.sharded_weights: Optional[ShardedWeights] = None
        """The weight shards under --data-parallel-sharding-strategy optim_grads_params (ZeRO-3), else None."""
        if config.data_parallel_sharding_strategy == "optim_grads_params":
            sharded = ShardedWeightsMainParams(self.reducer, chunks)
            self.main: ShardedMainParams | ReplicatedMainParams = sharded
            self.sharded_weights = sharded.weights
        else:
            self.main = (
                ShardedMainParams(self.reducer) if config.use_distributed_optimizer
                else ReplicatedMainParams(self.reducer, params)
            )
        # Every group always exists (possibly empty on a shard), so state dicts line up across ranks.
        owners = [piece.param for piece in self.main.pieces] if hasattr(self.main, "pieces") else params
        apart = [config.decoupled_lr is not None and getattr(p, "is_embedding_or_output_parameter", False)
                 for p in owners]
        groups = [
            {"params": [m for m, d, a in zip(self.main.params, self.main.decay, apart) if d == decay and a == dec],
             "decoupled": dec, **({} if decay else {"weight_decay": 0.0})}
            for dec in ((False, True) if config.decoupled_lr is not None else (False,)) for decay in (True, False)
        ]
        self.optimizer, self.implementation = _make_inner_optimizer(groups, config, params[0].device)
        self.scaler: Optional[LossScaler] = None
        if config.fp16:
            dynamic = config.loss_scale is None
            self.scaler = LossScaler(
                config.initial_loss_scale if dynamic else config.loss_scale, dynamic=dynamic,
                min_scale=config.min_loss_scale, window=config.loss_scale_window, hysteresis=config.hysteresis,
            )

    @property
    def loss_multiplier(self) -> float:
        """What the executor multiplies each loss by on top of 1 / tokens: the fp16 loss scale, else 1."""
        return self.scaler.scale if self.scaler is not None else 1.0

    @torch.no_grad()
    def step(self, lr: float, decoupled_lr: Optional[float] = None) -> StepOutcome:
        """Check, clip and apply the reduced gradients with learning rate `lr` (after `reducer.finish()`);
        the embedding and output layer take `decoupled_lr` when the optimizer was built with --decoupled-lr."""
        if (decoupled_lr is None) != (self.config.decoupled_lr is None):
            raise ValueError("step(decoupled_lr=...) is given exactly when the optimizer has --decoupled-lr groups")
        if not self.reducer.grads_reduced:
            raise RuntimeError("TrainingOptimizer.step() before reducer.finish(): the gradients are not reduced")
        scaled_norm, found_inf = self.reducer.norm_and_found_inf()
        scale = self.loss_multiplier
        if self.scaler is not None:
            self.scaler.update(found_inf)
        reported_scale = self.scaler.scale if self.scaler is not None else None
        if found_inf:
            return StepOutcome(skipped=True, grad_norm=math.inf, loss_scale=reported_scale)
        grad_norm = scaled_norm / scale
        factor = 1.0 / scale
        if self.config.clip_grad > 0 and grad_norm > self.config.clip_grad:
            factor *= self.config.clip_grad / (grad_norm + 1e-6)
        self.main.attach_grads()
        if factor != 1.0:  # on the fp32 gradients the optimizer reads (copies of bf16 buffers), as Megatron-LM
            if self.reducer.grad_dtype == torch.float32:
                self.reducer.scale_(factor)
            else:
                torch._foreach_mul_([m.grad for m in self.main.params], factor)
        for group in self.optimizer.param_groups:
            group["lr"] = decoupled_lr if group.get("decoupled") else lr
        self.optimizer.step()
        self.main.copy_to_model()
        return StepOutcome(skipped=False, grad_norm=grad_norm, loss_scale=reported_scale)

    def state_dict(self) -> dict[str, Any]:
        """Optimizer state, fp32 main weights and loss scaler: tensors and plain values only, so
        `torch.load(weights_only=True)` reads it back.

        With the distributed optimizer every rank's dict holds only its own shard, so every rank must
        save and load its own (and resume with the same tp, pp and dp sizes). Otherwise the dicts of
        data-parallel replicas are identical and dp rank 0's is enough. Model weights are not included:
        save them with the model (for bf16/fp16 models they equal the main weights cast down).
        """
        return {
            "optimizer": self.optimizer.state_dict(),
            "main_params": self.main.state_dict(),
            "loss_scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.main.load_state_dict(state["main_params"])
        self.optimizer.load_state_dict(state["optimizer"])
        if (state["loss_scaler"] is None) != (self.scaler is None):
            raise ValueError("checkpoint and run disagree on --fp16 (loss scaler state present in only one)")
        if self.scaler is not None:
            self.scaler.load_state_dict(state["loss_scaler"])


def build_optimizer(chunks: Sequence[nn.Module], state: ParallelState, config: OptimizerConfig) -> TrainingOptimizer:
    """The optimizer for this rank's model chunks (registers the gradient hooks: build it once)."""
    return TrainingOptimizer(chunks, state, config)


def _check_precision(params: Sequence[nn.Parameter], config: OptimizerConfig) -> None:
    dtypes = {p.dtype for p in params}
    wanted = torch.float16 if config.fp16 else torch.bfloat16 if config.bf16 else torch.float32
    if dtypes != {wanted}:
        flag = "--fp16" if config.fp16 else "--bf16" if config.bf16 else "neither --bf16 nor --fp16"
        raise ValueError(
            f"model parameters are {sorted(map(str, dtypes))} but the optimizer was configured with {flag} "
            f"(expects {wanted}); build the model with the matching params_dtype"
        )


def _make_inner_optimizer(
    groups: list[dict], config: OptimizerConfig, device: torch.device
) -> tuple[torch.optim.Optimizer, str]:
    """(optimizer over the fp32 main weights, a name for logs): apex FusedAdam on CUDA when apex is
    installed, else torch's AdamW (fused kernel on CUDA, multi-tensor foreach elsewhere), or SGD.
    `config.adam_implementation` forces torch's fused or foreach kernel on any device (the dry run's fake
    CPU tensors run the fused kernel a GPU job runs)."""
    if config.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.sgd_momentum,
                               weight_decay=config.weight_decay, foreach=True), "torch.optim.SGD"
    adam = dict(lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                weight_decay=config.weight_decay)
    if config.adam_implementation == "foreach" or (config.adam_implementation is None and device.type != "cuda"):
        return torch.optim.AdamW(groups, foreach=True, **adam), "torch.optim.AdamW (foreach)"
    if config.adam_implementation == "fused" and device.type != "cuda":
        return torch.optim.AdamW(groups, fused=True, **adam), "torch.optim.AdamW (fused)"
    fused_adam = _apex_fused_adam()
    if fused_adam is not None:
        return fused_adam(groups, adam_w_mode=True, **adam), "apex.optimizers.FusedAdam"
    return torch.optim.AdamW(groups, fused=True, **adam), "torch.optim.AdamW (fused)"
