"""A local multi-process world: a pool of persistent gloo workers on this machine.

Used by the test suite (through `tests/dist.py`) and by the benchmarks. Spawning processes and
importing torch dominate the cost of small distributed jobs, so a pool is started once and reused: the
caller sends a module-level function (importable by name) and its arguments to every worker; each
worker calls `fn(ctx, *args)` and the per-rank return values come back as a list ordered by rank. An
exception on any rank raises with that rank's traceback. If a call times out (a hang), the pool is
killed and rebuilt so later calls still run. Workers use one intra-op thread each.

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


def _worker(rank: int, world_size: int, port: int, inbox, outbox, backend: str = "gloo") -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":  # one GPU per worker, as torchrun --nproc-per-node would place them
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
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
    """`world_size` spawned processes joined in one world (gloo, or nccl with one GPU each), waiting
    for functions to run."""

    def __init__(self, world_size: int, backend: str = "gloo"):
        self.world_size = world_size
        self.backend = backend
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(self.world_size)]
        self.procs = [
            ctx.Process(target=_worker, args=(r, self.world_size, port, self.inboxes[r], self.outbox, self.backend),
                        daemon=True)
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


