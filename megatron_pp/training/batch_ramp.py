"""Megatron-LM's batch-size ramp-up, `--rampup-batch-size START INCREMENT SAMPLES`: the global batch of each
iteration as a function of the samples consumed before it.

The rule (ours, written from megatron-core 0.16.1's `RampupBatchsizeNumMicroBatchesCalculator` documentation
and behaviour; `tests/training/test_batch_ramp.py` checks it step by step against that class). With n =
(B − START) / INCREMENT increments over SAMPLES samples, each increment lasts SAMPLES / n samples (a float),
and an iteration that starts with c samples consumed runs a global batch of

    B                                        if c > SAMPLES
    START + int(c / (SAMPLES / n)) · INCREMENT  otherwise

in micro-batches of --micro-batch-size × dp, read sequentially from the sample order (the batch sampler is
the same; only the number of microbatches per step changes). The run's length in iterations is Megatron-LM's
too: the ramp's iterations (every one that starts with c ≤ SAMPLES) plus (--train-samples − the samples they
consumed) // B at the full batch. Megatron-LM allows the ramp only with --train-samples (sample-counted
training and LR schedule), and so do we.

Worked example: START 2, INCREMENT 2, SAMPLES 8, B 6: n = 2 increments of 4 samples; c = 0 → 2, c = 2 → 2,
c = 4 → 4, c = 8 → 6 (8 ≤ 8: int(8 / 4) = 2 increments), c = 14 > 8 → 6. The ramp is 4 iterations of
2, 2, 4, 6 samples (14 in all); --train-samples 26 adds (26 − 14) // 6 = 2 iterations: 6 in all.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class BatchSizes:
    """The global batch size of every iteration: constant, or Megatron-LM's ramp-up toward it."""

    global_batch_size: int
    start: Optional[int] = None
    """The ramp's first global batch (None: no ramp, every step runs `global_batch_size`)."""
    increment: int = 0
    ramp_samples: int = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "BatchSizes":
        ramp = getattr(args, "rampup_batch_size", None)
        if ramp is None:
            return cls(args.global_batch_size)
        start, increment, samples = (int(v) for v in ramp)
        return cls(args.global_batch_size, start, increment, samples)

    @property
    def ramps(self) -> bool:
        return self.start is not None

    def at(self, consumed_samples: int) -> int:
        """The global batch of the iteration that starts with `consumed_samples` consumed."""
        if self.start is None or consumed_samples > self.ramp_samples:
            return self.global_batch_size
        increments = (self.global_batch_size - self.start) // self.increment
        per_increment = self.ramp_samples / increments  # a float, as Megatron-LM divides
        return self.start + int(consumed_samples / per_increment) * self.increment

    def ramp_batches(self) -> list[int]:
        """The global batches of the ramp's iterations, in order (empty without a ramp)."""
        if self.start is None:
            return []
        batches, consumed = [], 0
        while consumed <= self.ramp_samples:
            batches.append(self.at(consumed))
            consumed += batches[-1]
        return batches

    def train_iters(self, train_samples: int) -> int:
        """Iterations of a run of `train_samples` samples (a partial last batch is dropped)."""
        ramp = self.ramp_batches()
        return len(ramp) + (train_samples - sum(ramp)) // self.global_batch_size

    def distinct_sizes(self) -> list[int]:
        """Every global batch a run uses, ascending (the full one included)."""
        return sorted(set(self.ramp_batches()) | {self.global_batch_size})


def check_rampup(args: argparse.Namespace, data_parallel_size: Optional[int]) -> list[str]:
    """One line per problem of --rampup-batch-size (empty without it). `data_parallel_size` None: unknown
    (the divisibility of each batch is then not checked)."""
    if getattr(args, "rampup_batch_size", None) is None:
        return []
    start, increment, samples = args.rampup_batch_size
    name = f"--rampup-batch-size {start} {increment} {samples}"
    if args.train_samples is None:
        return [f"{name} needs --train-samples (a sample-counted run, as Megatron-LM requires: it refuses a "
                "ramp-up with --train-iters)"]
    if min(start, increment, samples) < 1:
        return [f"{name}: START, INCREMENT and SAMPLES must be >= 1"]
    gbs = args.global_batch_size
    if gbs is None or gbs < 1:
        return []  # the missing or bad --global-batch-size has its own line
    if start >= gbs or (gbs - start) % increment:
        return [f"{name}: START must be below --global-batch-size {gbs} and differ from it by a multiple of "
                "INCREMENT"]
    errors = []
    if getattr(args, "pipeline_schedule", None) == "2bw":
        errors.append(f"{name} is not supported with --pipeline-schedule 2bw (its steps overlap without a "
                      "flush, one microbatch count throughout)")
    if getattr(args, "data_parallel_sharding_strategy", "no_shard") == "optim_grads_params":
        errors.append(f"{name} is not supported with --data-parallel-sharding-strategy optim_grads_params")
    sizes = BatchSizes.from_args(args)
    ramp = sizes.ramp_batches()
    if args.train_samples < sum(ramp):
        errors.append(f"{name}: --train-samples {args.train_samples} ends inside the ramp-up, which consumes "
                      f"{sum(ramp)} samples in {len(ramp)} iterations")
    mbs = args.micro_batch_size
    if data_parallel_size and mbs >= 1:
        bad = [b for b in sizes.distinct_sizes() if b % (mbs * data_parallel_size)]
        if bad:
            errors.append(f"{name}: its global batch {bad[0]} is not divisible by --micro-batch-size {mbs} x "
                          f"data-parallel size {data_parallel_size}")
    return errors
