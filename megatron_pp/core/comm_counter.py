"""Count the collectives issued on one process group: operation, calls and payload bytes.

Used to measure data-parallel traffic per step (docs/layered.md) and to test that layered gradient
accumulation reduces each chunk exactly once per breadth-first group. Inside `with CommCounter(group)`
the collective functions of `torch.distributed` (and the two aliases `core.tensor_parallel.utils` binds
at import for NCCL's single-tensor kernels) are wrapped; calls on `group` are recorded, then run as
usual. Calls on other groups pass through unrecorded.

Payload is the size of the whole buffer the collective reduces or assembles, whatever the algorithm:
all-reduce and broadcast of an n-byte tensor, an all-gather producing n bytes and a reduce-scatter
consuming n bytes all count n (a ring moves about n·(dp−1)/dp per rank for the last two and twice that
for an all-reduce). On gloo the distributed optimizer's reduce-scatter runs as an all-reduce and is
recorded as one.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_pp.core.tensor_parallel import utils as tp_utils


@dataclass(frozen=True)
class CollectiveCall:
    op: str
    nbytes: int


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# torch.distributed function -> (op recorded, payload of a call from its bound arguments). Newer torch
# names the single-tensor kernels *_single; both spellings are wrapped where they exist.
_PAYLOAD: dict[str, tuple[str, Callable[[dict], int]]] = {
    "all_reduce": ("all_reduce", lambda a: _nbytes(a["tensor"])),
    "broadcast": ("broadcast", lambda a: _nbytes(a["tensor"])),
    "all_gather": ("all_gather", lambda a: sum(_nbytes(t) for t in a["tensor_list"])),
    "all_gather_into_tensor": ("all_gather", lambda a: _nbytes(a["output_tensor"])),
    "all_gather_single": ("all_gather", lambda a: _nbytes(a["output_tensor"])),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a: _nbytes(a["input"])),
    "reduce_scatter_single": ("reduce_scatter", lambda a: _nbytes(a["input"])),
}
# Aliases of the single-tensor kernels that tensor_parallel.utils resolved at import.
_ALIASES = {"_all_gather_single": "all_gather_into_tensor", "_reduce_scatter_single": "reduce_scatter_tensor"}


class CommCounter:
    """Record the collectives on `group` issued inside the `with` block, in order (`calls`).

    `log`, when given, receives every recorded call too, so a test can interleave them with other events.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], log: Optional[list] = None) -> None:
        self.group = group
        self.calls: list[CollectiveCall] = []
        self.log = log
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> "CommCounter":
        for name in _PAYLOAD:
            if hasattr(dist, name):
                self._patch(dist, name, name)
        for alias, name in _ALIASES.items():
            if hasattr(tp_utils, alias):
                self._patch(tp_utils, alias, name)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, attr, original in reversed(self._saved):
            setattr(owner, attr, original)
        self._saved.clear()

    def _patch(self, owner: Any, attr: str, name: str) -> None:
        original = getattr(owner, attr)
        signature = inspect.signature(original)
        op, payload = _PAYLOAD[name]

        def counted(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            if self.group is not None and bound.arguments.get("group") is self.group:
                call = CollectiveCall(op, payload(bound.arguments))
                self.calls.append(call)
                if self.log is not None:
                    self.log.append(call)
            return original(*args, **kwargs)

        self._saved.append((owner, attr, original))
        setattr(owner, attr, counted)

    def totals(self) -> dict[str, tuple[int, int]]:
        """op -> (calls, payload bytes) over everything recorded."""
        out: dict[str, tuple[int, int]] = {}
        for call in self.calls:
            calls, nbytes = out.get(call.op, (0, 0))
            out[call.op] = (calls + 1, nbytes + call.nbytes)
        return out

    @property
    def nbytes(self) -> int:
        return sum(call.nbytes for call in self.calls)
