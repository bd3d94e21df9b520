"""Reading device data on the host: the one door through which a training step learns a number.

A step must read a little data (the loss it logs, whether a gradient overflowed); every such read is a
device-to-host synchronisation on a GPU, so the step's code goes through `read_values` and names what it
reads. `reads` counts them by name, which is how a test holds a step to its two reads (loss, found-inf),
each once per step. On fake and meta tensors (the dry run, `training.dry_run`) there is no data: the read
returns zeros of the tensor's size, as if no gradient overflowed and the loss were 0, so the job's code runs
on unchanged.

Worked example: `read_values(torch.tensor([0.0, 4.0]), "found-inf")` -> `[0.0, 4.0]`, and
`reads["found-inf"]` goes up by 1; on a `FakeTensorMode` tensor of 2 elements it returns `[0.0, 0.0]`.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch._subclasses.fake_tensor import FakeTensor

reads: Counter = Counter()
"""Reads so far, by name (tests reset it with `reads.clear()`)."""


def has_data(t: torch.Tensor) -> bool:
    """Whether `t` holds readable values (not a fake or meta tensor)."""
    return not isinstance(t, FakeTensor) and t.device.type != "meta"


def read_values(t: torch.Tensor, what: str) -> list[float]:
    """`t`'s values as a flat list of floats (one host synchronisation), counted under `what`."""
    reads[what] += 1
    if not has_data(t):
        return [0.0] * t.numel()
    return [float(v) for v in t.detach().reshape(-1).tolist()]
