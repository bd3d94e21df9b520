"""Activation recomputation (Megatron's `--recompute-*` flags): which spans of layers are checkpointed, and
a non-reentrant checkpoint that replays dropout masks exactly (both the default generator and the
tensor-parallel RNG tracker's streams are restored for the rerun). Its inputs are saved through the ordinary
saved-tensor hooks, so the pipeline's activation store sees (and can offload) exactly what is kept."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.checkpoint import checkpoint

from megatron_pp.core.tensor_parallel import RNGTracker


RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")


@dataclass(frozen=True)
class RecomputeConfig:
    """Which activations the backward recomputes instead of keeping (default: none).

    `full` checkpoints whole transformer layers of each model chunk. `method="uniform"` cuts the chunk's
    layers into spans of `num_layers` (the last may be shorter) and keeps only each span's input;
    `method="block"` checkpoints each of the chunk's first `num_layers` layers on its own and runs the
    rest normally, a way to spend memory left over. Example, a chunk of 4 layers: uniform 2 keeps the
    inputs of layers 0 and 2; block 1 keeps the input of layer 0 and everything layers 1-3 save.
    `selective` checkpoints only the attention core (scores, softmax, dropout, weighted sum), whose
    saved tensors grow with the square of the sequence length while its FLOPs are a small share.
    """

    granularity: Optional[str] = None
    """None, "full" or "selective" (--recompute-granularity)."""
    method: Optional[str] = None
    """"uniform" or "block", full granularity only (--recompute-method)."""
    num_layers: Optional[int] = None
    """Span length (uniform) or number of checkpointed layers (block) (--recompute-num-layers)."""

    def __post_init__(self) -> None:
        if self.granularity is not None and self.granularity not in RECOMPUTE_GRANULARITIES:
            raise ValueError(
                f"--recompute-granularity {self.granularity!r} is not one of {', '.join(RECOMPUTE_GRANULARITIES)}"
            )
        if self.granularity == "full":
            if self.method not in RECOMPUTE_METHODS:
                raise ValueError(
                    f"--recompute-granularity full needs --recompute-method {' or '.join(RECOMPUTE_METHODS)}, "
                    f"got {self.method!r}"
                )
            if self.num_layers is None or self.num_layers < 1:
                raise ValueError(
                    f"--recompute-granularity full needs --recompute-num-layers >= 1, got {self.num_layers}"
                )
        elif self.method is not None or self.num_layers is not None:
            raise ValueError("--recompute-method and --recompute-num-layers apply only to --recompute-granularity full")

    def checkpointed_spans(self, num_layers: int) -> list[tuple[int, int, bool]]:
        """`(start, end, checkpointed)` spans covering a chunk's `num_layers` layers, in order."""
        if self.granularity != "full" or num_layers == 0:
            return [(0, num_layers, False)]
        n = self.num_layers
        if self.method == "uniform":
            return [(i, min(i + n, num_layers), True) for i in range(0, num_layers, n)]
        spans = [(i, i + 1, True) for i in range(min(n, num_layers))]
        return spans + ([(n, num_layers, False)] if n < num_layers else [])


def checkpoint_with_rng(fn: Callable[..., torch.Tensor], rng_tracker: RNGTracker, *args: Any) -> torch.Tensor:
    """`fn(*args)`, keeping only `args` for the backward, which reruns `fn` to rebuild what it saved.

    The rerun must draw the same dropout masks. `torch.utils.checkpoint` restores the default generators
    (`preserve_rng_state`); the tracker's named streams (TP-split dropout) have moved on by the time the
    backward runs, so they are snapshot when the forward starts, swapped in for the rerun, and the
    streams' current states put back after it.
    """
    snapshot: dict = {}

    @contextlib.contextmanager
    def forward_context() -> Iterator[None]:
        snapshot.update(rng_tracker.get_states())
        yield

    @contextlib.contextmanager
    def recompute_context() -> Iterator[None]:
        current = rng_tracker.get_states()
        rng_tracker.set_states(snapshot)
        try:
            yield
        finally:
            rng_tracker.set_states(current)

    return checkpoint(fn, *args, use_reentrant=False, context_fn=lambda: (forward_context(), recompute_context()))
