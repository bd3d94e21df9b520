"""One clock for the trace of a multi-rank job: each rank's offset to rank 0's clock, with its error bound.

Every rank times its actions with its own `time.perf_counter()`, whose zero is arbitrary (boot time on
Linux) and differs from host to host, so raw timestamps of two ranks cannot be compared. Here rank 0
measures every other rank's offset the way NTP does, with point-to-point messages: rank 0 stamps `a`
and sends, the peer stamps `t` on arrival and answers, rank 0 stamps `b` on the reply. The peer read
its clock somewhere inside [a, b] of rank 0's clock, so `offset = t - (a + b) / 2` is off by at most
`(b - a) / 2`, half the round trip, whatever the network's asymmetry. Of several rounds the one with the
shortest round trip is kept (the others waited in a queue or for the scheduler). On a gloo world on one
host the bound is tens of microseconds; across hosts, half a TCP round trip.

Clocks also drift apart (quartz: up to tens of ppm, so a millisecond in a minute on bad hardware), so
the trace measures twice, when tracing starts and when it is written, and maps each timestamp by
linear interpolation between the two offsets; the bound of a mapped time is the larger of the two
measured bounds (plus whatever drift is not linear, negligible over a run's minutes). The offsets and
bounds go into the trace file (`otherData`) so a reader knows how far to trust a cross-rank gap.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_pp.core import comm

ROUNDS = 8


@dataclass(frozen=True)
class ClockSync:
    """This rank's clock against rank 0's at local time `local`: rank 0's time is `local - offset`,
    within `error` seconds."""

    local: float
    offset: float
    error: float


def _cpu_group() -> Optional["dist.ProcessGroup"]:
    """A group that sends CPU tensors: the default one where its backend takes CPU tensors (gloo), else a gloo
    group over the world."""
    return None if comm.backend_needs().device_type == "cpu" else dist.new_group(backend="gloo")


def measure(clock: Optional[Callable[[], float]] = None, rounds: int = ROUNDS,
            group: Optional["dist.ProcessGroup"] = None) -> ClockSync:
    """Measure every rank's offset to rank 0 (collective over the world; rank 0 talks to one peer at a time).
    `clock` defaults to `time.perf_counter`, looked up at the call (the one the executor stamps with)."""
    clock = time.perf_counter if clock is None else clock
    world = comm.world_size()
    if world == 1:
        return ClockSync(clock(), 0.0, 0.0)
    group = _cpu_group() if group is None else group
    rank = dist.get_rank()
    result = torch.zeros(world, 2, dtype=torch.float64)  # (offset, error) by rank
    stamp = torch.zeros(1, dtype=torch.float64)
    if rank == 0:
        for peer in range(1, world):
            best = (float("inf"), 0.0)
            for _ in range(rounds):
                sent = clock()
                dist.send(stamp, peer, group=group)
                dist.recv(stamp, peer, group=group)
                back = clock()
                half = (back - sent) / 2
                if half < best[0]:
                    best = (half, float(stamp.item()) - (sent + back) / 2)
            result[peer, 0], result[peer, 1] = best[1], best[0]
    else:
        for _ in range(rounds):
            dist.recv(stamp, 0, group=group)
            stamp.fill_(clock())
            dist.send(stamp, 0, group=group)
    dist.broadcast(result, 0, group=group)
    return ClockSync(clock(), float(result[rank, 0]), float(result[rank, 1]))


@dataclass(frozen=True)
class JobClock:
    """Maps this rank's clock to rank 0's between two syncs (linear in between and beyond)."""

    start: ClockSync
    end: ClockSync

    def to_job(self, local: float) -> float:
        span = self.end.local - self.start.local
        share = (local - self.start.local) / span if span > 0 else 0.0
        return local - (self.start.offset + share * (self.end.offset - self.start.offset))

    @property
    def error(self) -> float:
        return max(self.start.error, self.end.error)
