"""Sharded weights (ZeRO-3): each data-parallel rank keeps 1/dp of the model's weights between uses.

The shards are the distributed optimizer's (`core.distributed_optimizer`): every gradient bucket of the
`GradientReducer` is a flat buffer padded to a multiple of dp, and rank r owns the contiguous slice
`[shard_start, shard_end)` of each. `ShardedWeights` gives every bucket a flat weight buffer with the same
layout, in the model's dtype, and makes the bucket's parameters views into it. Between uses the buffer's
storage is freed (resized to 0 bytes; the parameters keep their shapes) and only the rank's shard,
a separate small tensor, stays. Worked example, dp = 2, a chunk whose one bucket holds a 6-element
weight w and a 3-element bias b, padded to 10:

    flat weight buffer   w0 w1 w2 w3 w4 | w5 b0 b1 b2 pad     (exists only while the chunk is acquired)
    shard on rank 0      w0 w1 w2 w3 w4                       (always)
    shard on rank 1      w5 b0 b1 b2 pad                      (always)

`acquire(c)` re-allocates chunk c's buffers and starts their all-gathers (asynchronous: a caller
prefetches the next chunk while the current one computes), `wait(c)` completes them, `release(c)` frees
the buffers once nothing holds them (a bucket shared by two chunks is reference-counted). Autograd's
saved references to a parameter stay valid across a free and a later gather: they point at the same
storage object, which the gather refills with the same values, so a chunk may be freed after its
forwards and gathered again for its backwards. The optimizer step writes the updated fp32 pieces into
the shards only (`ShardedWeightsMainParams.copy_to_model`); there is no all-gather at the step, the next
forward's gathers carry the update. Gradients are reduce-scattered into the same shards by the
reducer, once per chunk per breadth-first group with layered accumulation.

Traffic per step, per rank, for a chunk of n weight elements: one all-gather of n per acquisition.
Layered (breadth-first) order acquires each chunk twice per group (forward pass, backward pass; the
last chunk once, its forwards run straight into its backwards), so 2·v − 1 gathers of a chunk's size
per group, independent of the microbatches in it. A depth-first order switches chunks after nearly
every microbatch and gathers ∝ m (the baseline of docs/layered.md).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megatron_pp.core import comm
from megatron_pp.core.distributed_optimizer import ShardedMainParams
from megatron_pp.core.grads import GradBucket, GradientReducer

ParamsCallback = Callable[[Sequence[nn.Parameter]], None]


def _free(flat: torch.Tensor) -> None:
    flat.untyped_storage().resize_(0)


def _allocate(flat: torch.Tensor) -> None:
    flat.untyped_storage().resize_(flat.numel() * flat.element_size())


class ShardedWeights:
    """The weight shards of one rank's model chunks over its data-parallel group (see the module docstring).

    Built from a reducer with the distributed optimizer, after the optimizer has read the full initial
    weights; from then on the chunks' parameters hold data only while acquired. `on_gathered(params)` is
    called when a bucket's parameters hold data again and `on_freeing(params)` right before they are freed
    (the executor's activation store re-registers their addresses there).
    """

    def __init__(self, reducer: GradientReducer, chunks: Sequence[nn.Module]) -> None:
        if not reducer.distributed_optimizer:
            raise ValueError("sharded weights use the distributed optimizer's shards: build the GradientReducer "
                             "with distributed_optimizer=True (--use-distributed-optimizer)")
        self.group = reducer.state.dp_group
        self.dp_size = reducer.state.dp_size
        self.buckets: list[GradBucket] = list(reducer.buckets)
        self.on_gathered: Optional[ParamsCallback] = None
        self.on_freeing: Optional[ParamsCallback] = None
        self.gather_wait_s = 0.0
        """Host seconds spent in `wait` on gathers (the exposed all-gather time on CPU/gloo; NCCL's wait only
        orders streams, so on GPUs take it from a profile)."""
        self._flats: list[torch.Tensor] = []
        self.shards: list[torch.Tensor] = []
        with torch.no_grad():
            for bucket in self.buckets:
                first = bucket.params[0]
                flat = torch.zeros(bucket.grad.numel(), dtype=first.dtype, device=first.device)
                for p, offset in zip(bucket.params, bucket.offsets):
                    flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
                    p.data = flat[offset:offset + p.numel()].view_as(p)
                self.shards.append(flat[bucket.shard_start:bucket.shard_end].clone())
                _free(flat)
                self._flats.append(flat)
        in_chunk = [{id(p) for p in chunk.parameters()} for chunk in chunks]
        self.chunk_buckets: list[list[int]] = [
            [b.index for b in self.buckets if any(id(p) in ids for p in b.params)] for ids in in_chunk]
        self._holders = [0] * len(self.buckets)  # acquisitions holding each bucket's buffer
        self._pending: dict[int, dist.Work] = {}  # bucket index -> its all-gather in flight
        self.gathers = 0
        """All-gathers started since construction (one per bucket per acquisition from zero)."""
        self.peak_resident_bytes = 0
        """Most bytes of gathered weight buffers allocated at once since construction."""

    # Residency ------------------------------------------------------------------------------------------
    def acquire(self, chunk: int) -> None:
        """Make chunk `chunk`'s weights resident: start the all-gathers of its buckets not resident yet."""
        for b in self.chunk_buckets[chunk]:
            self._holders[b] += 1
            if self._holders[b] == 1:
                self._start_gather(b)

    def wait(self, chunk: int) -> None:
        """Block until chunk `chunk`'s (acquired) weights hold their values."""
        for b in self.chunk_buckets[chunk]:
            if self._holders[b] == 0:
                raise RuntimeError(f"wait() on chunk {chunk} before acquire(): its weights are not being gathered")
            work = self._pending.pop(b, None)
            if work is not None:
                start = time.perf_counter()
                work.wait()
                self.gather_wait_s += time.perf_counter() - start
                if self.on_gathered is not None:
                    self.on_gathered(self.buckets[b].params)

    def release(self, chunk: int) -> None:
        """Drop this use of chunk `chunk`'s weights; buffers nothing else holds are freed."""
        for b in self.chunk_buckets[chunk]:
            if self._holders[b] == 0:
                raise RuntimeError(f"release() of chunk {chunk} without a matching acquire()")
            self._holders[b] -= 1
            if self._holders[b] == 0:
                self._free_bucket(b)

    @contextmanager
    def gathered(self, write_back: bool = False) -> Iterator[None]:
        """All chunks' weights resident inside the block (evaluation, saving a checkpoint). With
        `write_back`, whatever the block wrote into the parameters (loading a checkpoint) becomes the shards."""
        chunks = range(len(self.chunk_buckets))
        for c in chunks:
            self.acquire(c)
        try:
            for c in chunks:
                self.wait(c)
            yield
            if write_back:
                with torch.no_grad():
                    for bucket, flat, shard in zip(self.buckets, self._flats, self.shards):
                        shard.copy_(flat[bucket.shard_start:bucket.shard_end])
        finally:
            for c in chunks:
                self.release(c)

    # Collectives ----------------------------------------------------------------------------------------
    def _start_gather(self, b: int) -> None:
        flat, shard = self._flats[b], self.shards[b]
        _allocate(flat)
        self.gathers += 1
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes())
        if self.group is None or self.dp_size == 1:
            with torch.no_grad():
                flat.copy_(shard)
            if self.on_gathered is not None:
                self.on_gathered(self.buckets[b].params)
            return
        if comm.backend_needs(self.group).single_tensor_collectives:
            gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            work = gather_into(flat, shard, group=self.group, async_op=True)
        else:  # gloo and unknown backends: the list form, writing straight into the buffer's slices
            work = dist.all_gather(list(flat.chunk(self.dp_size)), shard, group=self.group, async_op=True)
        self._pending[b] = work

    def _free_bucket(self, b: int) -> None:
        work = self._pending.pop(b, None)
        if work is not None:  # acquired and released without a wait: the gather must land before the free
            work.wait()
        if self.on_freeing is not None:
            self.on_freeing(self.buckets[b].params)
        _free(self._flats[b])

    # The optimizer's side -------------------------------------------------------------------------------
    @torch.no_grad()
    def write_pieces(self, mains: Sequence[torch.Tensor], pieces: Sequence) -> None:
        """Write updated fp32 main pieces (`GradPiece` layout) into the shards, in the model's dtype."""
        for main, piece in zip(mains, pieces):
            start = piece.bucket_offset - piece.bucket.shard_start
            self.shards[piece.bucket.index][start:start + main.numel()].copy_(main)

    def resident_bytes(self) -> int:
        """Bytes of gathered (full) weight buffers allocated right now."""
        return sum(flat.untyped_storage().nbytes() for flat in self._flats)

    def shard_bytes(self) -> int:
        return sum(shard.numel() * shard.element_size() for shard in self.shards)


class ShardedWeightsMainParams(ShardedMainParams):
    """The distributed optimizer's fp32 main pieces, with the model's weights sharded too: the step
    writes this rank's pieces into its weight shards and gathers nothing (the next forward does)."""

    def __init__(self, reducer: GradientReducer, chunks: Sequence[nn.Module]) -> None:
        super().__init__(reducer)  # reads the full initial weights, so it comes before the sharding
        self.weights = ShardedWeights(reducer, chunks)

    def copy_to_model(self) -> None:
        self.weights.write_pieces(self.params, self.pieces)
