"""`--manual-gc`: Python's garbage collector switched off for the training loop and run by hand at points
every rank reaches at the same iteration (Megatron-LM's flags and defaults).

Why a pipeline needs it: the automatic collector starts a full collection when its allocation counters
cross a threshold, which happens at a different moment on every rank; a collection of a large trainer's
objects takes tens of milliseconds, and when it lands inside a step on one rank every rank that waits for
that rank's activations or gradients waits with it (the emulated timelines of docs/schedules.md showed such
stalls before their steps ran with the collector off). With the flag the loop collects once before the first
iteration, after every `--manual-gc-interval`-th iteration (0, the default: never between iterations, as in
Megatron-LM) and, unless `--no-manual-gc-eval`, before and after each evaluation. Values do not change;
reference cycles that the loop creates wait for the next collection instead of the next threshold.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator


class ManualGC:
    """Collections at iteration boundaries; the collector's own state is restored when the loop ends (so that
    a caller of `pretrain` in the same process gets its collector back)."""

    def __init__(self, enabled: bool, interval: int = 0, around_evaluation: bool = True) -> None:
        self.enabled = enabled
        self.interval = interval
        self.around_evaluation = around_evaluation
        self.collections = 0
        self._was_enabled = True

    def __enter__(self) -> "ManualGC":
        if self.enabled:
            self._was_enabled = gc.isenabled()
            gc.disable()
            self._collect()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled and self._was_enabled:
            gc.enable()

    def _collect(self) -> None:
        gc.collect()
        self.collections += 1

    def after_iteration(self, iteration: int) -> None:
        if self.enabled and self.interval and iteration % self.interval == 0:
            self._collect()

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        collect = self.enabled and self.around_evaluation
        if collect:
            self._collect()
        yield
        if collect:
            self._collect()
