"""Optimizer with fp32 main weights, and the learning-rate schedule.

With bf16 model weights the update is applied to an fp32 copy (the "main" parameters), which the bf16
weights are then refreshed from: bf16 has too few mantissa bits to accumulate small updates. With fp32
models the optimizer steps the model parameters directly, no copy. Weight decay is not applied to
biases and norm weights (1-D parameters), as in Megatron-LM.
"""
from __future__ import annotations

import argparse
import math
from typing import Sequence

import torch
from torch import nn


def learning_rate(args: argparse.Namespace, step: int) -> float:
    """LR at optimizer step `step` (0-based): linear warmup, then constant / linear / cosine decay to min-lr."""
    if args.lr_warmup_iters > 0 and step < args.lr_warmup_iters:
        return args.lr * (step + 1) / args.lr_warmup_iters
    if args.lr_decay_style == "constant":
        return args.lr
    span = max(args.train_iters - args.lr_warmup_iters, 1)
    progress = min(max(step - args.lr_warmup_iters, 0) / span, 1.0)
    if args.lr_decay_style == "linear":
        factor = 1.0 - progress
    else:
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return args.min_lr + (args.lr - args.min_lr) * factor


class MixedPrecisionOptimizer:
    """Steps `params` (model weights of any dtype) through fp32 main copies when needed."""

    def __init__(self, params: Sequence[nn.Parameter], make_optimizer) -> None:
        self.model_params = list(params)
        self.needs_main = any(p.dtype != torch.float32 for p in self.model_params)
        if self.needs_main:
            self.main_params = [nn.Parameter(p.detach().float().clone()) for p in self.model_params]
        else:
            self.main_params = self.model_params
        decay = [p for p in self.main_params if p.dim() > 1]
        no_decay = [p for p in self.main_params if p.dim() <= 1]
        self.optimizer = make_optimizer([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}])

    @classmethod
    def from_args(cls, params: Sequence[nn.Parameter], args: argparse.Namespace) -> "MixedPrecisionOptimizer":
        if args.optimizer == "adam":
            def make(groups):
                return torch.optim.AdamW(groups, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
                                         eps=args.adam_eps, weight_decay=args.weight_decay, foreach=True)
        else:
            def make(groups):
                return torch.optim.SGD(groups, lr=args.lr, momentum=args.sgd_momentum, weight_decay=args.weight_decay)
        return cls(params, make)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.needs_main:
            for model, main in zip(self.model_params, self.main_params):
                main.grad = None if model.grad is None else model.grad.float()
        self.optimizer.step()
        if self.needs_main:
            for model, main in zip(self.model_params, self.main_params):
                model.copy_(main)
