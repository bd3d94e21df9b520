"""The schedule plugin of the interaction matrix (megatron_pp/testing/interaction.py): loaded by
`--schedule-plugin` with this file's path, like a user's own file, it registers `matrix-plugin`: 1F1B at one
chunk per rank, interleaved 1F1B at more, with the offload pass on every rank under the registered
`--offload-chunks` / `--offload-fraction`.

Written the way users write plugins today (postponed annotations, a dataclass for the choice), so that a plugin
loader that cannot import such a file fails the matrix, not a user.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_pp.schedules.generators import interleaved_1f1b, one_f_one_b
from megatron_pp.schedules.ir import Schedule
from megatron_pp.schedules.offload import add_offload
from megatron_pp.schedules.registry import list_schedules, register_schedule

NAME = "matrix-plugin"


@dataclass(frozen=True)
class Order:
    """What the plugin runs: (ranks, microbatches, chunks) -> the compute-only order before the offload pass."""

    num_ranks: int
    num_microbatches: int
    num_chunks: int

    def build(self) -> Schedule:
        if self.num_chunks == 1:
            return one_f_one_b(self.num_ranks, self.num_microbatches)
        return interleaved_1f1b(self.num_ranks, self.num_microbatches, self.num_chunks)


def matrix_plugin(num_ranks: int, num_microbatches: int, num_chunks: int, offload_chunks: Optional[int] = None,
                  offload_fraction: Optional[float] = None, offload_time: Optional[float] = None) -> Schedule:
    order = Order(num_ranks, num_microbatches, num_chunks).build()
    return add_offload(order, offload_chunks, offload_fraction=offload_fraction, offload_time=offload_time)


if NAME not in list_schedules():
    register_schedule(NAME, matrix_plugin, supports_virtual=True,
                      description="interaction-matrix plugin: 1F1B / interleaved 1F1B with the offload pass")
