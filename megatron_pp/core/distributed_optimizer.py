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
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron_pp.core.grads import GradientReducer, GradPiece
from megatron_pp.core.tensor_parallel.utils import start_all_gather


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
        self.attach_grads()

    def attach_grads(self) -> None:
        """Point each piece's `.grad` at its reduced fp32 gradient (views into the reducer's buffers), or at
        an fp32 copy of it when the buffers are bf16 (--grad-reduce-in-bf16)."""
        for main, piece in zip(self.params, self.pieces):
            main.grad = piece.grad if piece.grad.dtype == main.dtype else piece.grad.float()

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Write the updated pieces into the model on every data-parallel replica (one all-gather per bucket).

        All buckets' all-gathers start before the first is waited on, so they overlap each other.
        """
        mine: dict[int, list[tuple[nn.Parameter, GradPiece]]] = {}
        for main, piece in zip(self.params, self.pieces):
            mine.setdefault(piece.bucket.index, []).append((main, piece))
        gathers = []
        for bucket in self.reducer.buckets:
            shard = torch.zeros(
                bucket.shard_end - bucket.shard_start, dtype=bucket.params[0].dtype, device=bucket.grad.device
            )
            for main, piece in mine.get(bucket.index, []):
                start = piece.bucket_offset - bucket.shard_start
                shard[start : start + main.numel()].copy_(main)
            gathers.append(start_all_gather(shard, 0, self.reducer.state.dp_group))
        for bucket, gather in zip(self.reducer.buckets, gathers):
            full = gather.wait()
            for p, offset in zip(bucket.params, bucket.offsets):
                p.detach().view(-1).copy_(full[offset : offset + p.numel()])

    def _layout(self) -> list[list[int]]:
        return [[piece.bucket.index, piece.start, piece.end] for piece in self.pieces]

    def state_dict(self) -> dict[str, Any]:
        """This rank's pieces and the layout they were cut with (every rank saves its own)."""
        return {"dp_size": self.reducer.state.dp_size, "layout": self._layout(), "main": list(self.params)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
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
