"""Layered gradient accumulation: data-parallel reductions launched per model chunk when the schedule says.

`GradientReducer` starts a bucket's reduction when its hooks have counted every contribution of the
step. Under layered accumulation (arXiv 2106.02679) the schedule states the point instead: its
`REDUCE_GRAD.c` action comes right after chunk c's last backward of a breadth-first group, and the
executor calls `reduce_chunk(c)` there. That launches, asynchronously and in bucket order, every bucket
*owned* by chunk c, i.e. whose parameters are completed by chunk c's backward (a bucket never spans
two chunks; a parameter held by two local chunks, the tied embedding when both pipeline ends share a
rank, belongs to the lower chunk, whose backward runs last). Every data-parallel replica runs the same
list, so all of them issue the same collectives in the same order.

With depth-first groups (m/B groups of B microbatches) a chunk is reduced once per group. A reduction
that does not complete the step's gradient (the hooks have not counted all k·m contributions yet) is
*intermediate*: it reduces a copy of the bucket and zeroes the bucket, so the next group accumulates
while the collective is in flight. The next reduction of the same bucket first folds that result back
in: each rank adds the part it will hold after the last reduction (its shard under the distributed
optimizer, everything on data-parallel rank 0 otherwise) to its local buffer, so the last collective
carries the earlier groups' sum exactly once. Example, dp = 2, all-reduce, two groups with local sums
a0, a1 (rank 0) and b0, b1 (rank 1): group 0 reduces a0 + b0; rank 0 adds it to a1; the last all-reduce
gives (a1 + a0 + b0) + b1 on both ranks, the step's sum. Network traffic is one reduction per chunk per
group; memory, one copy of a bucket while its intermediate reduction runs.

The last reduction of a bucket runs in place, exactly like the base class's. A step whose list never
completes a chunk's reduction fails in `finish()` naming the chunk, and a gradient that arrives after
the last reduction trips the base class's contribution count.
"""
from __future__ import annotations

from typing import Optional, Sequence

from torch import nn

from megatron_pp.core.grads import DEFAULT_BUCKET_BYTES, GradBucket, GradientReducer
from megatron_pp.core.parallel_state import ParallelState
from megatron_pp.core.tensor_parallel.utils import PendingCollective, start_all_reduce_, start_reduce_scatter_dim0


class LayeredGradientReducer(GradientReducer):
    """A `GradientReducer` whose reductions start on `reduce_chunk(c)` (the executor's REDUCE_GRAD.c).

    Per step, as for the base class: `start_step(m)`, the executor's run (which calls `reduce_chunk`),
    `finish()`. `reductions` counts the collectives this reducer started in the current step, per chunk.
    """

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        state: ParallelState,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        distributed_optimizer: bool = False,
    ) -> None:
        super().__init__(chunks, state, overlap=False, bucket_bytes=bucket_bytes,
                         distributed_optimizer=distributed_optimizer)
        lowest: dict[int, int] = {}
        for c, chunk in enumerate(chunks):
            for p in chunk.parameters():
                lowest.setdefault(id(p), c)
        self.chunk_buckets: dict[int, list[GradBucket]] = {c: [] for c in range(len(chunks))}
        for bucket in self.buckets:  # in index order, so each chunk launches its buckets in index order
            self.chunk_buckets[min(lowest[id(p)] for p in bucket.params)].append(bucket)
        self._carried: dict[int, PendingCollective] = {}  # bucket index -> its intermediate reduction
        self._final: set[int] = set()  # buckets whose last reduction of the step has started
        self.reductions: dict[int, int] = {c: 0 for c in self.chunk_buckets}

    def start_step(self, num_microbatches: int) -> None:
        if self._carried:
            raise RuntimeError("start_step() while an intermediate reduction of the previous step is pending; "
                               "call finish() first")
        super().start_step(num_microbatches)
        self._final.clear()
        self.reductions = {c: 0 for c in self.chunk_buckets}

    def reduce_chunk(self, chunk: int) -> None:
        """Start the data-parallel reduction of the buckets chunk `chunk` completes (REDUCE_GRAD.chunk)."""
        if not self._step_open:
            raise RuntimeError("reduce_chunk() outside a step: call start_step() before running the schedule")
        if chunk not in self.chunk_buckets:
            raise ValueError(f"REDUCE_GRAD.{chunk}: this rank has chunks 0..{len(self.chunk_buckets) - 1}")
        for bucket in self.chunk_buckets[chunk]:
            if bucket.index in self._final:
                raise RuntimeError(f"REDUCE_GRAD.{chunk} after the step's gradients of chunk {chunk} were already "
                                   "complete and reduced: a second reduction of the same gradients")
            self._fold(bucket)
            if bucket.waiting == 0:  # every parameter has all its contributions: the step's last reduction
                self._final.add(bucket.index)
                bucket.pending = self._start(bucket.grad)
            else:
                snapshot = bucket.grad.clone()
                bucket.grad.zero_()
                self._carried[bucket.index] = self._start(snapshot)
            self.reductions[chunk] += 1

    def _start(self, flat) -> PendingCollective:
        # The reduced tensor is scratch (the bucket itself, or a copy of it), so the gloo fallback of the
        # reduce-scatter may reduce in place.
        if self.distributed_optimizer:
            return start_reduce_scatter_dim0(flat, self.state.dp_group, input_is_scratch=True)
        return start_all_reduce_(flat, self.state.dp_group)

    def _fold(self, bucket: GradBucket) -> None:
        """Add the finished intermediate reduction of `bucket` to the part of its buffer this rank will hold."""
        pending: Optional[PendingCollective] = self._carried.pop(bucket.index, None)
        if pending is None:
            return
        reduced = pending.wait()
        if self.distributed_optimizer:
            bucket.grad[bucket.shard_start:bucket.shard_end].add_(reduced)
        elif self.state.dp_rank == 0:
            bucket.grad.add_(reduced)

    def _launch_ready(self, force: bool = False) -> None:
        # Launches belong to the schedule; finish() calls this with force=True only to complete the step.
        missing = sorted({c for c, buckets in self.chunk_buckets.items() for b in buckets if b.pending is None})
        if force and missing:
            raise RuntimeError(
                f"the step ended before the last REDUCE_GRAD of chunk(s) {missing}: under layered gradient "
                "accumulation every chunk needs a REDUCE_GRAD after its last backward of the step, and the "
                "executor must call reduce_chunk for it (training.layered.connect_optimizer sets that up)")
