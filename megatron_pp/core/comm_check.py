"""Watching every collective and point-to-point call a rank makes: device check and record.

Every `torch.distributed` call reaches the dispatcher as a `c10d` operator (`c10d.allreduce_`,
`c10d.send`, `c10d.recv_`, `c10d._reduce_scatter_base_`, ...), whichever module made it, so one
`TorchDispatchMode` sees them all: those of `core.comm`, `core.p2p`, the tensor-parallel layers, the
gradient reducer and anything a plugin adds. `CommWatch` does two things there, both off in production
(nothing is installed unless a caller enters it; the dry run and the tests do):

- **device check**: every tensor handed to a collective must be on the job's device. A CPU tensor given
  to an NCCL collective crashes the job at its first step, yet on a CPU test world it passes unnoticed;
  on a `meta`-device dry run the watch names it (`CommDeviceError`) with the operator and its shape.
- **record**: one `CommEvent` per call (operator, the group's global ranks, the peer's global rank for
  point-to-point, shapes and dtype), which `training.dry_run_agree` matches across simulated ranks.

Worked example: on a job whose device is `meta`, `dist.all_reduce(torch.zeros(1))` inside `CommWatch(
device=torch.device("meta"))` raises `CommDeviceError("c10d.allreduce_: tensor of shape (1,) float32 is
on cpu, the job's device is meta")`.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# Calls that carry no payload of the job (a barrier's tensor is torch's own scratch).
_NO_PAYLOAD = {"barrier", "monitored_barrier_"}
_SEND, _RECV = {"send"}, {"recv_", "recv_any_source_"}


class CommDeviceError(RuntimeError):
    """A tensor handed to a collective is not on the job's device."""


@dataclass(frozen=True)
class CommEvent:
    op: str                       # c10d operator name: "allreduce_", "send", "recv_", ...
    group: tuple[int, ...]        # global ranks of the group, in group order
    peer: Optional[int]           # global rank of the other end (point-to-point), else None
    shapes: tuple[tuple[int, ...], ...]
    dtype: str

    @property
    def is_p2p(self) -> bool:
        return self.op in _SEND or self.op in _RECV

    def text(self) -> str:
        where = f"peer {self.peer}" if self.peer is not None else f"group {list(self.group)}"
        return f"{self.op} {where} {'x'.join(str(list(s)) for s in self.shapes)} {self.dtype}"


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _group_ranks(args: tuple) -> tuple[int, ...]:
    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            try:
                group = dist.ProcessGroup.unbox(arg)
            except (RuntimeError, TypeError):
                continue
            return tuple(dist.get_process_group_ranks(group))
    return ()


class CommWatch(TorchDispatchMode):
    """Check (when `device` is given) and record (when `record`) every c10d call made inside the block."""

    def __init__(self, device: Optional[torch.device] = None, record: bool = True) -> None:
        super().__init__()
        self.device = device
        self.record = record
        self.events: list[CommEvent] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.observe(func, args)
        return func(*args, **(kwargs or {}))

    def observe(self, func, args: tuple) -> None:
        """Check and record `func` if it is a c10d call (another dispatch mode may call this for every
        operator it sees, saving a Python dispatch layer per operator: the dry run's memory tracker does)."""
        if func.namespace == "c10d":
            self._observe(func.__name__.split(".")[0], args)

    def _observe(self, op: str, args: tuple) -> None:
        if op in _NO_PAYLOAD:
            return
        payload = _tensors(args[0]) + (_tensors(args[1]) if op.startswith(("allgather", "_allgather",
                                                                           "_reduce_scatter", "reduce_scatter",
                                                                           "alltoall")) else [])
        if self.device is not None:
            for t in payload:
                if t.device != self.device:
                    raise CommDeviceError(f"c10d.{op}: tensor of shape {tuple(t.shape)} "
                                          f"{str(t.dtype).replace('torch.', '')} is on {t.device}, "
                                          f"the job's device is {self.device}")
        if not self.record:
            return
        group = _group_ranks(args)
        peer = None
        if op in _SEND or op in _RECV:
            local = args[2]
            peer = group[local] if group and 0 <= local < len(group) else local
        first = _tensors(args[0])
        self.events.append(CommEvent(op, group, peer, tuple(tuple(t.shape) for t in first),
                                     str(first[0].dtype).replace("torch.", "") if first else ""))


@contextmanager
def fake_world(rank: int, world_size: int, device_type: str = "cpu") -> Iterator[None]:
    """This process as rank `rank` of a world of `world_size` on torch's `fake` backend (every collective
    returns at once, nothing moves), torn down on exit so the next simulated rank gets a fresh world."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # On the meta device the backend is named per device type: batch_isend_irecv looks a backend up by the
    # tensors' device type, and a plain "fake" serves cpu only. On the CPU plain "fake": under the per-device
    # name the distributed optimizer's step measured one more copy of the parameters (cause not traced;
    # tests/planning/test_optimizer_step.py holds the CPU figure).
    backend = "fake" if device_type == "cpu" else f"cpu:fake,{device_type}:fake"
    dist.init_process_group(backend, store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
