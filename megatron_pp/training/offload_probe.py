"""Measure `--offload-time` on the machine that trains instead of assuming it.

The offload pass places each OFFLOAD/RELOAD so that the copy hides behind compute; it needs the one-way
copy time of a chunk's stash in units of that chunk's forward time (T). Both grow with the number of
layers in a chunk, so one transformer layer of the job's shape gives the ratio: run its forward on one
microbatch while counting the storages autograd saves (the stash), time that forward, and time a copy of
that many bytes from the device into pinned host memory on a side stream (the path `OffloadStore` takes).
On CPU the "copy to host" is a host-to-host copy, so the figure there only exercises the code.

Every rank measures and the largest T wins (an all-reduce): the schedule must be the same on every rank,
and the slowest link is the one a copy must hide behind. The embedding and the head are left out: they
add forward time to the first and last chunks, which only makes their copies easier to hide.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from megatron_pp.core import comm
from megatron_pp.core.storage import storage_key
from megatron_pp.core.tensor_parallel import RNGTracker
from megatron_pp.models.config import TransformerConfig
from megatron_pp.models.layers import TransformerLayer
from megatron_pp.models.ops import rotary_cos_sin


@dataclass(frozen=True)
class OffloadProbe:
    stash_bytes: int
    """Bytes one layer saves for backward for one microbatch (unique storages, parameters excluded)."""
    forward_s: float
    copy_s: float
    """Seconds to copy `stash_bytes` to (pinned, on CUDA) host memory; median of the repeats."""
    offload_time: float
    """copy_s / forward_s, the largest over ranks: what `--offload-time` means."""

    @property
    def copy_gbps(self) -> float:
        return self.stash_bytes / self.copy_s / 1e9 if self.copy_s > 0 else float("inf")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, device: torch.device, repeats: int, warmup: int = 1) -> float:
    """Median wall time of `fn()` over `repeats` calls after `warmup` untimed ones (kernels chosen, allocator
    primed), the device synchronised around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_offload_time(config: TransformerConfig, micro_batch_size: int, device: torch.device,
                         repeats: int = 3) -> OffloadProbe:
    """Measure T for one layer of `config` at `micro_batch_size` on `device` (collective over the world)."""
    layer = TransformerLayer(config, None, False, RNGTracker(), device).to(device=device, dtype=config.params_dtype)
    layer.eval()  # no dropout (its RNG streams belong to the real model); saved tensors are the same
    params = {storage_key(p) for p in layer.parameters()}
    s, b, h = config.seq_length, micro_batch_size, config.hidden_size
    x = torch.randn(s, b, h, device=device, dtype=config.params_dtype, requires_grad=True)
    rotary = None
    if config.position_embedding_type == "rope":
        positions = torch.arange(s, device=device).expand(b, s)
        rotary = rotary_cos_sin(positions, config.head_dim, config.rotary_base)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if storage_key(t) not in params:
            saved[storage_key(t)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, rotary, None, None)
    stash_bytes = max(sum(saved.values()), 1)
    forward_s = median_seconds(lambda: layer(x, rotary, None, None), device, repeats)

    source = torch.empty(stash_bytes, dtype=torch.uint8, device=device)
    host = torch.empty(stash_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    if device.type == "cuda":
        stream = torch.cuda.Stream(device)

        def copy() -> None:
            with torch.cuda.stream(stream):
                host.copy_(source, non_blocking=True)
            stream.synchronize()
    else:
        def copy() -> None:
            host.copy_(source)
    copy_s = median_seconds(copy, device, repeats)
    ratio = comm.all_reduce(torch.tensor([copy_s / max(forward_s, 1e-9)], dtype=torch.float64), op="max")
    return OffloadProbe(stash_bytes, forward_s, copy_s, float(ratio))
