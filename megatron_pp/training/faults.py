"""Fault injection for the reliability tests: make one rank fail at a chosen iteration, on purpose.

Read once from the environment variable `MEGATRON_PP_INJECT_FAULTS`, a comma-separated list of
`KIND@ITERATION` or `KIND@ITERATION:RANK` (global rank; default: the last rank of the world):

    nan_grad      after the backward of that iteration, one gradient element becomes NaN on that rank
    kill_in_step  after the backward of that iteration, that rank SIGKILLs itself (the others are in
                  the optimizer's all-reduce, waiting for it)
    kill_in_save  while saving the checkpoint of that iteration, that rank SIGKILLs itself after its
                  first shard file is written (a half-written `iter_N.tmp/`)
    enospc_save   while saving the checkpoint of that iteration, that rank's first shard write raises
                  OSError(ENOSPC), as a full disk does

Example: `MEGATRON_PP_INJECT_FAULTS=nan_grad@3,nan_grad@4:0,kill_in_save@6:1`. Unset (the normal case),
every hook is a dictionary lookup that finds nothing. The variable is for tests and drills only; it is
named in docs/reliability.md next to the test that uses each kind.
"""
from __future__ import annotations

import errno
import math
import os
import signal
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

ENV_VAR = "MEGATRON_PP_INJECT_FAULTS"
KINDS = ("nan_grad", "kill_in_step", "kill_in_save", "enospc_save")


@dataclass(frozen=True)
class Fault:
    kind: str
    iteration: int
    rank: Optional[int]  # None: the last rank of the world


def parse_faults(text: str) -> list[Fault]:
    """`KIND@ITER[:RANK],...` -> faults. Raises ValueError naming the variable on a malformed entry."""
    faults = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        kind, _, where = entry.partition("@")
        iteration, _, rank = where.partition(":")
        if kind not in KINDS or not iteration.isdigit() or (rank and not rank.isdigit()):
            raise ValueError(f"{ENV_VAR}: cannot read {entry!r}; expected KIND@ITERATION[:RANK] with KIND one of "
                             f"{', '.join(KINDS)}")
        faults.append(Fault(kind, int(iteration), int(rank) if rank else None))
    return faults


class FaultPlan:
    """The faults this process was asked to inject (`from_env`), and the hooks the loop calls."""

    def __init__(self, faults: list[Fault], rank: int, world_size: int) -> None:
        self._due = {(f.kind, f.iteration) for f in faults if (world_size - 1 if f.rank is None else f.rank) == rank}

    @classmethod
    def from_env(cls, rank: int, world_size: int) -> "FaultPlan":
        return cls(parse_faults(os.environ.get(ENV_VAR, "")), rank, world_size)

    def due(self, kind: str, iteration: int) -> bool:
        return (kind, iteration) in self._due

    def after_backward(self, iteration: int, poison: Callable[[], None]) -> None:
        """Called between the backward and the optimizer step; `poison` makes one gradient NaN."""
        if self.due("nan_grad", iteration):
            poison()
        if self.due("kill_in_step", iteration):
            os.kill(os.getpid(), signal.SIGKILL)

    @contextmanager
    def during_save(self, iteration: int) -> Iterator[None]:
        """Install the checkpoint-write hook for the save of `iteration` (and remove it afterwards)."""
        from megatron_pp.training import checkpointing

        kill, full = self.due("kill_in_save", iteration), self.due("enospc_save", iteration)
        if not (kill or full):
            yield
            return
        writes = 0

        def hook(path: str) -> None:
            nonlocal writes
            writes += 1
            if full:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
            if kill and writes == 2:  # the first file is complete, the second never will be
                os.kill(os.getpid(), signal.SIGKILL)

        previous = checkpointing.set_write_hook(hook)
        try:
            yield
        finally:
            checkpointing.set_write_hook(previous)


def poison_first_gradient(pieces: list) -> None:
    """Set the first element of the first held gradient piece to NaN (see `GradientReducer.held_pieces`)."""
    for piece in pieces:
        if piece.grad is not None and piece.grad.numel():
            piece.grad.view(-1)[0] = math.nan
            return
