"""One launcher for every multi-process test: a pool of persistent gloo workers per world size.

Spawning processes and importing torch dominate the cost of small distributed tests, so each world size
gets one pool for the whole pytest session. A test sends a module-level function (importable by name)
and its arguments to every worker; each worker calls `fn(ctx, *args)` and the per-rank return values
come back as a list ordered by rank. An exception on any rank fails the test with that rank's traceback.
If a call times out (a hang), the pool is killed and rebuilt so later tests still run.

Functions must not leave process groups behind: create them through `ctx.parallel_state(tp, pp)`, which
caches one `ParallelState` per layout for the life of the worker (new_group is collective and slow).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

DEFAULT_TIMEOUT_S = 240.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class WorkerContext:
    rank: int
    world_size: int
    _states: dict = field(default_factory=dict)

    def parallel_state(self, tp: int = 1, pp: int = 1):
        from megatron_pp.core.parallel_state import ParallelState

        key = (tp, pp)
        if key not in self._states:
            self._states[key] = ParallelState.build(tp=tp, pp=pp)
        return self._states[key]


def _worker(rank: int, world_size: int, port: int, inbox, outbox) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    ctx = WorkerContext(rank, world_size)
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args, kwargs = job
        try:
            outbox.put((rank, True, fn(ctx, *args, **kwargs)))
        except BaseException:  # report everything, the parent decides
            outbox.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class WorkerPool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(self.world_size)]
        self.procs = [
            ctx.Process(target=_worker, args=(r, self.world_size, port, self.inboxes[r], self.outbox), daemon=True)
            for r in range(self.world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable, *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list:
        for q in self.inboxes:
            q.put((fn, args, kwargs))
        results: dict[int, Any] = {}
        failures: list[str] = []
        import queue

        try:
            for _ in range(self.world_size):
                rank, ok, value = self.outbox.get(timeout=timeout)
                if ok:
                    results[rank] = value
                else:
                    failures.append(f"--- rank {rank} ---\n{value}")
                    # A failed rank may leave its peers blocked in a collective: stop waiting for them.
                    break
        except queue.Empty:
            self.restart()
            raise TimeoutError(f"{fn.__name__} did not finish on all {self.world_size} ranks in {timeout}s")
        if failures:
            self.restart()
            raise AssertionError(f"{fn.__name__} failed:\n" + "\n".join(failures))
        return [results[r] for r in range(self.world_size)]

    def restart(self) -> None:
        self.close(force=True)
        self._start()

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self.inboxes:
                q.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()


_POOLS: dict[int, WorkerPool] = {}


def pool(world_size: int) -> WorkerPool:
    if world_size not in _POOLS:
        _POOLS[world_size] = WorkerPool(world_size)
    return _POOLS[world_size]


def run_distributed(world_size: int, fn: Callable, *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list:
    """Run `fn(ctx, *args, **kwargs)` on every rank of a `world_size` gloo world; return results by rank."""
    return pool(world_size).run(fn, *args, timeout=timeout, **kwargs)


def shutdown_pools() -> None:
    for p in _POOLS.values():
        p.close()
    _POOLS.clear()
