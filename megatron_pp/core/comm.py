"""The collectives that training, schedules and planning need, with each tensor on the device its backend takes.

Layers above `core` never call `torch.distributed` themselves: they hand a tensor wherever it lives and
get the result back on that same device. NCCL reduces only CUDA tensors and gloo is only sure of CPU
ones, so a caller that computed a loss on the CPU of a rank without the last pipeline stage (or summed
evaluation totals on the host) would crash an NCCL job at its first step; here the tensor is moved to the
group's device for the call and the result copied back, so the same call is right on both backends.

Every function is a no-op (returning its input) when no process group is running or the group has a single
member, so single-process runs and tools pay nothing and need no guard of their own.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup
Work = dist.Work
Store = dist.Store
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def is_distributed() -> bool:
    """True when a default process group with more than one rank is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size(group: Optional[ProcessGroup] = None) -> int:
    """Ranks in `group` (the world by default); 1 without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def backend_name(group: Optional[ProcessGroup] = None) -> str:
    """'nccl', 'gloo', ... of `group`, or 'none' without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return "none"
    return str(dist.get_backend(group))


@dataclass(frozen=True)
class BackendNeeds:
    """What a backend needs from the code that calls it; every choice of a code path reads these, never the
    backend's name, so a backend not listed gets the path that works everywhere, not gloo's by default."""

    device_type: Optional[str]
    """Tensors must be on this device type ("cuda", "cpu"); None: any device (the tensor stays where it is)."""
    batched_p2p: bool
    """Point-to-point must be posted in groups (`batch_isend_irecv`) to be deadlock-free (NCCL); posting in
    groups is right on every backend, posting one by one (and receives ahead) only where this is False."""
    single_tensor_collectives: bool
    """Has all-gather / reduce-scatter into one tensor worth using (else the list forms every backend has)."""
    completes_at_once: bool = False
    """Operations are done when posted and their works never report completion (torch's `fake` backend)."""


# gloo: CPU tensors, each operation its own asynchronous work. fake (the dry run): no data moves, any device;
# it takes NCCL's path (batches, single-tensor kernels), the one the GPU job it stands for takes.
BACKEND_NEEDS = {
    "nccl": BackendNeeds("cuda", batched_p2p=True, single_tensor_collectives=True),
    "gloo": BackendNeeds("cpu", batched_p2p=False, single_tensor_collectives=False),
    "fake": BackendNeeds(None, batched_p2p=True, single_tensor_collectives=True, completes_at_once=True),
}
_ANY_BACKEND = BackendNeeds(None, batched_p2p=True, single_tensor_collectives=False)


def backend_needs(group: Optional[ProcessGroup] = None) -> BackendNeeds:
    """`BACKEND_NEEDS` of `group`'s backend. A mixed backend ("cpu:gloo,cuda:nccl") routes CUDA tensors to
    NCCL and CPU ones to gloo: batches (NCCL needs them), tensors on either device."""
    name = backend_name(group).lower()
    if name in BACKEND_NEEDS:
        return BACKEND_NEEDS[name]
    backends = {part.split(":")[-1] for part in name.split(",")}
    if len(backends) == 1 and (only := backends.pop()) in BACKEND_NEEDS and BACKEND_NEEDS[only].device_type is None:
        return BACKEND_NEEDS[only]  # one device-agnostic backend for every device type ("cpu:fake,meta:fake")
    if "nccl" in name:
        return BackendNeeds(None, batched_p2p=True, single_tensor_collectives=False)
    return _ANY_BACKEND


def backend_device(group: Optional[ProcessGroup] = None, tensor: Optional[torch.Tensor] = None) -> torch.device:
    """The device a tensor must be on for a collective over `group`: the current CUDA device for NCCL, the
    CPU for gloo (and without a process group); for a backend that takes any device, `tensor`'s own (the
    CPU when no tensor is given)."""
    kind = backend_needs(group).device_type if backend_name(group) != "none" else "cpu"
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    if kind is None and tensor is not None:
        return tensor.device
    return torch.device("cpu")


def _op(op: str) -> dist.ReduceOp:
    try:
        return _OPS[op]
    except KeyError:
        raise ValueError(f"reduce op must be one of {sorted(_OPS)}, got {op!r}") from None


def all_reduce(tensor: torch.Tensor, op: str = "sum", group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """Reduce `tensor` over `group` (world by default) and return the result on `tensor`'s device.

    In place when `tensor` is already where the backend needs it; otherwise a copy travels and the result
    is copied back into `tensor` too, so callers may rely on either the return value or in-place update.
    """
    if world_size(group) == 1:
        return tensor
    device = backend_device(group, tensor)
    if tensor.device == device:
        dist.all_reduce(tensor, op=_op(op), group=group)
        return tensor
    moved = tensor.to(device)
    dist.all_reduce(moved, op=_op(op), group=group)
    tensor.copy_(moved)
    return tensor


class PendingReduce:
    """An all-reduce in flight; `result()` waits and returns the reduced tensor on the caller's device."""

    def __init__(self, work: Optional[Work], moved: torch.Tensor, original: torch.Tensor) -> None:
        self._work, self._moved, self._original = work, moved, original

    def result(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
            if self._moved is not self._original:
                self._original.copy_(self._moved)
        return self._original


def all_reduce_async(tensor: torch.Tensor, op: str = "sum", group: Optional[ProcessGroup] = None) -> PendingReduce:
    """Start an all-reduce of `tensor`; the result lands in `tensor` (and is returned) by `.result()`."""
    if world_size(group) == 1:
        return PendingReduce(None, tensor, tensor)
    device = backend_device(group, tensor)
    moved = tensor if tensor.device == device else tensor.to(device)
    return PendingReduce(dist.all_reduce(moved, op=_op(op), group=group, async_op=True), moved, tensor)


def all_gather_object(obj: Any, group: Optional[ProcessGroup] = None) -> list:
    """Every rank's `obj` (picklable), by rank of `group`; `[obj]` without a process group."""
    n = world_size(group)
    if n == 1:
        return [obj]
    gathered: list = [None] * n
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def barrier(group: Optional[ProcessGroup] = None) -> None:
    """Wait for every rank of `group`; nothing without a process group. On NCCL the barrier runs on the
    rank's own device (torch would otherwise guess one from the rank number)."""
    if world_size(group) == 1:
        return
    if backend_needs(group).device_type == "cuda":
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier(group=group)


def shutdown() -> None:
    """Synchronise all ranks and destroy the default group (end of a run)."""
    if dist.is_available() and dist.is_initialized():
        barrier()
        dist.destroy_process_group()


def connect_store(host: str, port: int, timeout_s: float) -> Store:
    """A client of the rendezvous TCP store that the default group was created with (side channel for
    heartbeats, which must keep working while a collective hangs)."""
    return dist.TCPStore(host, port, world_size=None, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))
