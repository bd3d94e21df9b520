"""The one launcher for multi-process tests: one pool of gloo workers per world size, per session.

`run_distributed(world_size, fn, *args)` runs module-level `fn(ctx, *args)` on every rank and returns the
per-rank results; `ctx.parallel_state(tp, pp)` gives a cached ParallelState (new_group is collective and
slow, so layouts are built once per worker). Pools live for the pytest session (see conftest.py).
"""
from __future__ import annotations

from typing import Any, Callable

from megatron_pp.core.local_world import DEFAULT_TIMEOUT_S, WorkerPool

_POOLS: dict[int, WorkerPool] = {}


def pool(world_size: int) -> WorkerPool:
    if world_size not in _POOLS:
        _POOLS[world_size] = WorkerPool(world_size)
    return _POOLS[world_size]


def run_distributed(world_size: int, fn: Callable, *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list:
    """Run `fn(ctx, *args, **kwargs)` on every rank of a `world_size` gloo world; return results by rank."""
    return pool(world_size).run(fn, *args, timeout=timeout, **kwargs)


def shutdown_pools() -> None:
    """End of the session: kill the workers rather than let each leave its loop, destroy its group and exit in
    turn (tens of seconds of interpreter teardown on 2 cores for a few dozen workers). Nothing of a worker's
    outlives it that a graceful exit would have saved; `WorkerPool.close` without force is for the pools a
    test itself closes."""
    for p in _POOLS.values():
        p.close(force=True)
    _POOLS.clear()
