"""Which transformer layers each pipeline stage holds.

`split_layers` cuts `num_layers` into `pp * vp` global stages, in global stage order: stage 0 holds the
embedding, the last stage the final norm, output layer and loss, and a microbatch's forward visits the
stages in order. Which rank runs which global stage is the schedule's business; only the
`--decoder-first/last-pipeline-num-layers` flags need the placement: they count the layers of the rank
that holds the first (last) stage, by default the interleaved placement, where pipeline rank r runs global
stages r, r + pp, r + 2*pp, ... (its chunks 0, 1, 2, ...). Under the V placement (schedules/vshape.py)
rank 0 holds both ends, so only one of the two flags can be given.

Worked example: 10 layers, pp=2, vp=2, `last_stage_layers=2` (the last rank also computes the loss).
The last rank (1) owns global stages 1 and 3 and gets 2 layers, one per chunk; the 8 remaining layers
split evenly over rank 0's stages 0 and 2:

    global stage   rank.chunk   layers        extras
    0              0.0          [0, 4)        embedding
    1              1.0          [4, 5)
    2              0.1          [5, 9)
    3              1.1          [9, 10)       final norm, output layer, loss

With `account_for_embedding` / `account_for_loss` the embedding and the head each take one layer slot of
an even split instead: 3*p - 2 layers on p ranks with vp=3 gives every global stage one slot, so stage 0
holds only the embedding and stage 3p-1 only the head.

Every error is a `LayoutError` (a ValueError) with one line naming the flags to change; no layer is ever
silently dropped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from megatron_pp.core.parallel_state import LayoutError

FIRST_FLAG = "--decoder-first-pipeline-num-layers"
LAST_FLAG = "--decoder-last-pipeline-num-layers"
EMBEDDING_FLAG = "--account-for-embedding-in-pipeline-split"
LOSS_FLAG = "--account-for-loss-in-pipeline-split"


@dataclass(frozen=True)
class StageSpec:
    """One global pipeline stage: layers [layer_start, layer_end) plus the embedding and/or the head."""

    stage: int
    layer_start: int
    layer_end: int
    has_embedding: bool
    has_head: bool

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_end)


def split_layers(
    num_layers: int,
    pp: int,
    vp: int = 1,
    *,
    first_stage_layers: Optional[int] = None,
    last_stage_layers: Optional[int] = None,
    account_for_embedding: bool = False,
    account_for_loss: bool = False,
    placement: Optional[Sequence[tuple[int, int]]] = None,
) -> list[StageSpec]:
    """Split `num_layers` over `pp` ranks x `vp` chunks; returns the `pp * vp` stages in global order.

    `placement[g]` is the (rank, chunk) of global stage g (default: the interleaved placement, g on rank
    g % pp). It matters only for the uneven flags, which count the layers of the rank holding the first
    stage and of the rank holding the last one, spread evenly over that rank's chunks."""
    if pp < 1 or vp < 1:
        raise LayoutError(
            f"--pipeline-model-parallel-size {pp} and --num-virtual-stages-per-pipeline-rank {vp} must be >= 1"
        )
    if num_layers < 0:
        raise LayoutError(f"--num-layers {num_layers} must be >= 0")
    uneven = first_stage_layers is not None or last_stage_layers is not None
    if uneven and (account_for_embedding or account_for_loss):
        raise LayoutError(
            f"{FIRST_FLAG} / {LAST_FLAG} cannot be combined with {EMBEDDING_FLAG} / {LOSS_FLAG}; use one or the other"
        )
    stages = pp * vp
    if uneven:
        ranks = [g % pp for g in range(stages)] if placement is None else [rank for rank, _ in placement]
        counts = _uneven_counts(num_layers, pp, vp, first_stage_layers, last_stage_layers, ranks)
    else:
        counts = _even_counts(num_layers, stages, account_for_embedding, account_for_loss)

    specs, start = [], 0
    for stage, count in enumerate(counts):
        spec = StageSpec(stage, start, start + count, has_embedding=stage == 0, has_head=stage == stages - 1)
        if count == 0 and not (spec.has_embedding or spec.has_head):
            raise LayoutError(
                f"global pipeline stage {stage} would hold no layer and neither the embedding nor the head; "
                f"change {FIRST_FLAG} / {LAST_FLAG} or --num-layers {num_layers}"
            )
        specs.append(spec)
        start += count
    assert start == num_layers, (counts, num_layers)
    return specs


def _even_counts(num_layers: int, stages: int, with_embedding: bool, with_loss: bool) -> list[int]:
    slots = num_layers + int(with_embedding) + int(with_loss)
    if slots % stages != 0:
        accounted = "".join(
            f" + 1 ({f})" for f, on in ((EMBEDDING_FLAG, with_embedding), (LOSS_FLAG, with_loss)) if on
        )
        raise LayoutError(
            f"--num-layers {num_layers}{accounted} is not divisible by {stages} pipeline stages "
            f"(--pipeline-model-parallel-size x --num-virtual-stages-per-pipeline-rank); "
            f"set {FIRST_FLAG} / {LAST_FLAG} for an uneven split"
        )
    per_stage = slots // stages
    counts = [per_stage] * stages
    counts[0] -= int(with_embedding)
    counts[-1] -= int(with_loss)
    if min(counts) < 0:
        raise LayoutError(
            f"--num-layers {num_layers} leaves no layer slot for {EMBEDDING_FLAG} and {LOSS_FLAG} on one stage"
        )
    return counts


def _uneven_counts(
    num_layers: int, pp: int, vp: int, first_layers: Optional[int], last_layers: Optional[int], ranks: list[int]
) -> list[int]:
    if ranks[0] == ranks[-1] and first_layers is not None and last_layers is not None:
        where = ("--pipeline-model-parallel-size is 1" if pp == 1 else
                 f"the schedule places the first and the last stage on rank {ranks[0]} (V placement)")
        raise LayoutError(f"{FIRST_FLAG} and {LAST_FLAG} name the same rank when {where}; give one of them")
    fixed: dict[int, int] = {}  # pipeline rank -> its layers over all its chunks
    for rank, value, name in ((ranks[0], first_layers, FIRST_FLAG), (ranks[-1], last_layers, LAST_FLAG)):
        if value is None:
            continue
        if value < 0 or value % vp != 0:
            raise LayoutError(
                f"{name} {value} must be >= 0 and divisible by --num-virtual-stages-per-pipeline-rank {vp}"
            )
        fixed[rank] = value
    remaining = num_layers - sum(fixed.values())
    other_stages = (pp - len(fixed)) * vp
    if remaining < 0 or (other_stages == 0 and remaining != 0) or (other_stages and remaining % other_stages):
        raise LayoutError(
            f"--num-layers {num_layers} minus {FIRST_FLAG} {first_layers} and {LAST_FLAG} {last_layers} leaves "
            f"{remaining} layers, which do not split evenly over the other {other_stages} pipeline stages"
        )
    per_other = remaining // other_stages if other_stages else 0
    return [fixed[ranks[g]] // vp if ranks[g] in fixed else per_other for g in range(pp * vp)]
