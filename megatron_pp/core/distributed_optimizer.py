"""The distributed optimizer's parameter side (ZeRO-1): fp32 main weights sharded over data parallelism.

Plain data parallelism keeps a full copy of the fp32 main weights and of the optimizer state (Adam's two
moments: 12 bytes per parameter with the main weights) on every replica. Here each data-parallel rank
keeps only its shard. The shard is defined by the gradient buffers of `GradientReducer`: every bucket
is a flat buffer padded to a multiple of dp, and rank r owns the contiguous slice
`[r * n / dp, (r + 1) * n / dp)` of each (Megatron's layout). A parameter may straddle two ranks' slices;
each rank then holds a *piece* of it. Worked example, dp = 2, one bucket with a 6-element weight `w` and
a 3-element bias `b`, padded to 10:

    bucket      w0 w1 w2 w3 w4 | w5 b0 b1 b2 pad
    rank 0      pieces  w[0:5]
    rank 1      pieces  w[5:6], b[0:3]

A step is then: the reducer reduce-scatters gradients so each rank receives the summed gradient of
exactly its slice; the optimizer updates the fp32 pieces (its state exists for those elements only);
`copy_to_model` writes the updated pieces, in the model's dtype, into the slice and all-gathers every
bucket's slices so all replicas hold the full updated model again. Element by element the arithmetic is
that of plain data parallelism, so the two agree to rounding (bitwise for dp = 2 in fp32).

Overlapped parameter gather (`overlap_param_gather`, Megatron-LM's --overlap-param-gather): `copy_to_model`
starts every bucket's all-gather and returns. A forward pre-hook on each model chunk finishes the gathers of
the buckets that hold that chunk's parameters (wait, then copy in place, so the parameters keep their
storage and the stash stores' exclusions stay right) when the chunk's forward is first called, wherever the
rank's action list puts it: the update's communication runs under the forwards of the chunks before it.
Whatever reads the weights outside a forward (checkpoints, the next update) calls `finish_param_gather()`
first. Gathers start first chunk first, the order in which every registered list runs its chunks' first
forwards. They run on a process group of their own over the same ranks (`param_gather_group`): on the
data-parallel group itself, the next step's first collective there (the global token count, issued before
the first forward) would queue behind them, on NCCL's one stream per communicator and on gloo's work queue.
Cost: each bucket's gathered buffer (the bucket's parameters in the model's dtype) lives from the update
until its chunk's first forward, instead of until the end of the update.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megatron_pp.core.grads import GradBucket, GradientReducer, GradPiece
from megatron_pp.core.parallel_state import ParallelState
from megatron_pp.core.tensor_parallel.utils import PendingCollective, start_all_gather

_GATHER_GROUPS: dict[tuple, Optional[dist.ProcessGroup]] = {}


def param_gather_group(state: ParallelState) -> Optional[dist.ProcessGroup]:
    """A second process group over this rank's data-parallel ranks, for the overlapped parameter gathers
    (None at data-parallel size 1). Collective: every rank creates the groups of every data-parallel
    replica in the same order (`new_group` involves the whole world) and keeps its own; built once per
    (world, layout) and cached, as `ParallelState.pair_groups` does."""
    if state.dp_size == 1 or not dist.is_initialized():
        return None
    key = (dist.group.WORLD, state.layout)
    if key not in _GATHER_GROUPS:
        mine = None
        for ranks in state.layout.dp_groups():
            group = dist.new_group(ranks)
            if state.rank in ranks:
                mine = group
        _GATHER_GROUPS[key] = mine
    return _GATHER_GROUPS[key]


class ShardedMainParams:
    """The fp32 main-weight pieces this data-parallel rank owns, tied to `reducer`'s gradient shards.

    `params` are what a torch optimizer steps (1-D fp32 parameters, one per piece); `decay[i]` says
    whether piece i belongs to a parameter that takes weight decay (not biases and norm weights).
    """

    shards_state_over_dp = True

    def __init__(self, reducer: GradientReducer) -> None:
        if not reducer.distributed_optimizer:
            raise ValueError("ShardedMainParams needs a GradientReducer built with distributed_optimizer=True")
        dtypes = {p.dtype for bucket in reducer.buckets for p in bucket.params}
        if len(dtypes) != 1:
            raise ValueError(
                f"the distributed optimizer needs one parameter dtype, the model has {sorted(map(str, dtypes))}"
            )
        self.reducer = reducer
        self.pieces: list[GradPiece] = reducer.held_pieces()
        with torch.no_grad():
            self.params = [
                nn.Parameter(piece.param.detach().reshape(-1)[piece.start : piece.end].to(torch.float32, copy=True))
                for piece in self.pieces
            ]
        self.decay = [piece.param.dim() > 1 for piece in self.pieces]
        self._in_flight: dict[int, tuple[GradBucket, PendingCollective]] = {}
        self._chunk_buckets: Optional[list[list[int]]] = None  # per chunk, its buckets (overlapped gathers only)
        self._gather_group: Optional[dist.ProcessGroup] = None
        self._hooks: list[Any] = []
        self.attach_grads()

    def attach_grads(self) -> None:
        """Point each piece's `.grad` at its reduced fp32 gradient (views into the reducer's buffers), or at
        an fp32 copy of it when the buffers are bf16 (--grad-reduce-in-bf16)."""
        for main, piece in zip(self.params, self.pieces):
            main.grad = piece.grad if piece.grad.dtype == main.dtype else piece.grad.float()

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Write the updated pieces into the model on every data-parallel replica (one all-gather per bucket).

        All buckets' all-gathers start before the first is waited on, so they overlap each other. With
        `overlap_param_gather` they are left in flight: each chunk's forward pre-hook finishes its own.
        """
        self.finish_param_gather()  # the previous update's, should a chunk have had no forward since
        mine: dict[int, list[tuple[nn.Parameter, GradPiece]]] = {}
        for main, piece in zip(self.params, self.pieces):
            mine.setdefault(piece.bucket.index, []).append((main, piece))
        overlapping = self._chunk_buckets is not None
        # Overlapped: first chunk first (the reverse of the gradients' completion order), the order in which
        # the lists run their chunks' first forwards.
        buckets = list(reversed(self.reducer.buckets)) if overlapping else self.reducer.buckets
        group = self._gather_group if overlapping else self.reducer.state.dp_group
        for bucket in buckets:
            shard = torch.zeros(
                bucket.shard_end - bucket.shard_start, dtype=bucket.params[0].dtype, device=bucket.grad.device
            )
            for main, piece in mine.get(bucket.index, []):
                start = piece.bucket_offset - bucket.shard_start
                shard[start : start + main.numel()].copy_(main)
            self._in_flight[bucket.index] = (bucket, start_all_gather(shard, 0, group))
        if not overlapping:
            self.finish_param_gather()

    @torch.no_grad()
    def _finish(self, indices: Sequence[int]) -> None:
        for index in indices:
            bucket, gather = self._in_flight.pop(index, (None, None))
            if gather is None:
                continue
            full = gather.wait()
            for p, offset in zip(bucket.params, bucket.offsets):
                p.detach().view(-1).copy_(full[offset : offset + p.numel()])

    def finish_param_gather(self) -> None:
        """Complete every parameter gather still in flight (anything that reads the weights outside a chunk's
        forward calls this first: checkpoints, the next update, the end of training)."""
        self._finish(list(self._in_flight))

    @property
    def gathers_in_flight(self) -> set[int]:
        """Indices of the buckets whose gathered parameters are not in the model yet."""
        return set(self._in_flight)

    def overlap_param_gather(self, chunks: Sequence[nn.Module], group: Optional[dist.ProcessGroup] = None) -> None:
        """Leave the gathers of each update in flight, each chunk's finished by a forward pre-hook on
        `chunks[c]` (the modules the reducer was built over). `group`: the gathers' process group (default
        `param_gather_group`; collective when it must be created)."""
        if self._chunk_buckets is not None:
            raise ValueError("overlap_param_gather was already set up for these parameters")
        self._gather_group = group if group is not None else param_gather_group(self.reducer.state)
        self._chunk_buckets = [
            [b.index for b in self.reducer.buckets if {id(p) for p in b.params} & {id(p) for p in chunk.parameters()}]
            for chunk in chunks
        ]
        for c, chunk in enumerate(chunks):
            self._hooks.append(chunk.register_forward_pre_hook(self._before_forward(c)))

    def _before_forward(self, chunk: int):
        def hook(module: nn.Module, args: Any) -> None:
            if self._in_flight:
                self._finish(self._chunk_buckets[chunk])
        return hook

    def close(self) -> None:
        """Finish what is in flight and remove the forward pre-hooks."""
        self.finish_param_gather()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _layout(self) -> list[list[int]]:
        return [[piece.bucket.index, piece.start, piece.end] for piece in self.pieces]

    def state_dict(self) -> dict[str, Any]:
        """This rank's pieces and the layout they were cut with (every rank saves its own)."""
        return {"dp_size": self.reducer.state.dp_size, "layout": self._layout(), "main": list(self.params)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.finish_param_gather()  # a gather landing later would overwrite the loaded weights
        dp_size, layout = self.reducer.state.dp_size, self._layout()
        if state["dp_size"] != dp_size or state["layout"] != layout:
            raise ValueError(
                f"distributed-optimizer shard does not fit this run: saved for data-parallel size {state['dp_size']} "
                f"as {len(state['layout'])} pieces, this rank has data-parallel size {dp_size} and "
                f"{len(layout)} pieces. "
                "Resume with the same parallel layout, model and gradient bucket size"
            )
        for main, saved in zip(self.params, state["main"]):
            main.copy_(saved)
