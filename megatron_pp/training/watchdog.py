"""A heartbeat watchdog: when a rank dies or freezes, every other rank stops within a bounded time and
says which rank it was.

Without it, the ranks of a job whose peer was killed (OOM killer, a node lost, a segfault in a kernel)
wait in their next collective until the process-group timeout (`--distributed-timeout-minutes`, ten
minutes by default), and then report a gloo/NCCL error that names a socket, not a rank. Under srun
without `--kill-on-bad-exit` they may wait that long on every step of a requeue loop.

How it works, through the rendezvous TCPStore every launcher already runs (rank 0 hosts it for a plain
launch, the torchrun agent under torchrun):

- Each rank runs one daemon thread that every `interval` seconds increments its own counter
  `megatron_pp/<attempt>/heartbeat/<rank>`. The thread beats while the main thread computes, saves or
  blocks in a collective, so only a dead or wholly frozen process stops beating.
- Each rank watches one peer, the next rank on a ring (rank r watches r + 1 mod world), so the store
  sees four small requests per rank per interval whatever the world size. A counter that has not moved for
  `timeout` seconds (measured on the watcher's own clock; clocks of different hosts are never compared)
  and through as many of the watcher's own checks as that timeout holds intervals marks its rank dead (a
  stall of the whole host, a paused VM or a swap storm, stops the watcher too: its clock jumps but it has
  checked only once, so it waits for the peer's next beat instead of taking the stall for a death): the watcher records `failed = "<rank>"` with a compare-and-set (the
  first verdict wins) and exits.
- Every watchdog also reads the `failed` key each interval; when it is set, it prints one line
  naming that rank and ends its process with status 1 (`os._exit`: the main thread may be blocked
  inside a collective that will never return). A store that stops answering means its host is gone:
  rank 0 of a plain launch (srun, a script), the torchrun agent otherwise. A refused connection says so at
  once (nothing listens on the store's port any more: its process has ended), so the survivors name rank 0
  within an interval, not after a raw store error; a store that merely stops answering (its whole node
  lost, no refusal comes) is reported after `timeout` seconds. Either way the line names the host's role.
- A rank that finishes normally marks `done/<rank>` before it stops beating, so its watcher
  does not mistake the end of the job for a death.

Worked example, world 4, rank 2 SIGKILLed at t=0, `--heartbeat-timeout-seconds 10` (interval 2.5 s):
rank 1 (the watcher of 2) sees counter 2 frozen and by t≈10-12.5 s sets failed=2 and exits; ranks 0 and
3 read failed=2 within one interval and exit. All three print
`error: rank 2 failed or stopped responding (no heartbeat within 10 s); stopping rank N`. Ranks
blocked on a peer that already failed with a gloo error wait for the same verdict (`wait_for_verdict`)
so that they too name the rank that died, not the socket that closed. A rank that fails with its own
error (a bad input file) prints it and records itself as failed (`report_failure`), so the others
stop at once, without a line of their own: the job says what went wrong once.
"""
from __future__ import annotations

import math
import os
import socket
import sys
import threading
import time
from typing import Optional

from megatron_pp.core import comm


def key_prefix(environ: Optional[dict] = None) -> str:
    """Keys of this attempt of the job. Under torchrun the agent's store outlives a restart of the
    workers (`--max-restarts`), so the run id and restart count keep one attempt's verdict from ending
    the next attempt."""
    env = os.environ if environ is None else environ
    return f"megatron_pp/{env.get('TORCHELASTIC_RUN_ID', 'run')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


class Watchdog:
    """Heartbeat and peer watch of one rank (see the module docstring). Start with `start()`; call
    `stop()` once the rank is done, before the final barrier."""

    def __init__(self, store: "comm.Store", rank: int, world_size: int, timeout_s: float,
                 store_address: str = "the rendezvous store", store_host: Optional[tuple[str, int]] = None,
                 agent_store: Optional[bool] = None) -> None:
        if world_size < 2:
            raise ValueError("a watchdog needs at least two ranks")
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.interval_s = min(max(timeout_s / 4.0, 0.1), 5.0)
        self.peer = (rank + 1) % world_size
        self.store_address = store_address
        self.store_host = store_host  # (host, port) to probe when the store fails; None: never probe
        # Who hosts the store: the torchrun agent (its workers use the agent's store) or rank 0.
        self.agent_store = (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" if agent_store is None
                            else agent_store)
        self.prefix = key_prefix()
        self._stop = threading.Event()
        self._reporting = threading.Lock()  # one line per process, whichever thread sees the failure first
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def connect(cls, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> "Watchdog":
        """A watchdog talking to the rendezvous TCPStore at host:port as one more client."""
        store = comm.connect_store(host, port, max(timeout_s, 1.0))
        return cls(store, rank, world_size, timeout_s, store_address=f"the rendezvous store at {host}:{port}",
                   store_host=(host, port))

    def _key(self, name: str, rank: Optional[int] = None) -> str:
        return f"{self.prefix}{name}" if rank is None else f"{self.prefix}{name}/{rank}"

    # Lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> "Watchdog":
        self.store.add(self._key("heartbeat", self.rank), 1)
        self._thread = threading.Thread(target=self._loop, name="megatron_pp-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """This rank is finishing normally: tell its watcher, then stop beating and watching."""
        try:
            self.store.set(self._key("done", self.rank), "1")
        except Exception:  # the store may already be gone at the very end of a job; nothing to guard then
            pass
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s + 1.0)

    def quiet(self) -> None:
        """This rank is reporting its own error: from here on that is the message, not the watchdog's."""
        self._stop.set()

    def report_failure(self) -> None:
        """This rank is exiting with its own error, already printed: the others stop at once (within one
        interval instead of a heartbeat timeout) and without a line of their own."""
        self.quiet()
        try:
            self.store.set(self._key("reported", self.rank), "1")
            self.store.compare_set(self._key("failed"), "", str(self.rank))
        except Exception:
            pass

    def wait_for_verdict(self, timeout_s: Optional[float] = None) -> Optional[int]:
        """Block until a dead rank is named (the watch thread then ends the process) or `timeout_s`
        passes (default: the heartbeat timeout plus two intervals). Returns the rank if one is already
        recorded, else None after the wait."""
        deadline = time.monotonic() + (self.timeout_s + 2 * self.interval_s if timeout_s is None else timeout_s)
        store_ok = time.monotonic()
        while time.monotonic() < deadline:
            try:
                failed = self._read_failed()
                store_ok = time.monotonic()
            except Exception:
                failed = None
                self._store_failed(time.monotonic() - store_ok)
            if failed is not None:
                self._die(failed)
            time.sleep(self.interval_s / 2)
        return None

    # The watch thread -----------------------------------------------------------------------------------
    def _loop(self) -> None:
        last_value, last_change = -1, time.monotonic()
        store_ok = time.monotonic()
        unchanged, needed = 0, max(1, math.ceil(self.timeout_s / self.interval_s - 1e-9))
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            try:
                self.store.add(self._key("heartbeat", self.rank), 1)
                failed = self._read_failed()
                if failed is not None:
                    self._die(failed)
                if self.store.check([self._key("done", self.peer)]):
                    last_change, unchanged = now, 0  # the peer finished: nothing to watch
                    continue
                value = self.store.add(self._key("heartbeat", self.peer), 0)
                store_ok = now
            except Exception:
                if self._stop.is_set():
                    return
                self._store_failed(now - store_ok)
                continue
            if value != last_value:
                last_value, last_change, unchanged = value, now, 0
                continue
            unchanged += 1  # the peer had the time of one more of this watcher's intervals to beat, and did not
            if now - last_change > self.timeout_s and unchanged >= needed:
                self._blame(self.peer)

    def _store_failed(self, silent_s: float) -> None:
        """A store call failed, `silent_s` after the last one that worked: report its host gone when nothing
        listens on its port any more (the connection is refused), or when it has not answered for `timeout`."""
        refused = self._store_refuses()
        if not refused and silent_s <= self.timeout_s:
            return
        host = "the torchrun agent" if self.agent_store else "rank 0"
        how = "refuses connections" if refused else f"stopped answering for {self.timeout_s:g} s"
        self._report(f"{host} is gone: {self.store_address}, which it hosted, {how}")

    def _store_refuses(self) -> bool:
        """True when a fresh connection to the store's port is refused: no process listens there now."""
        if self.store_host is None:
            return False
        try:
            with socket.create_connection(self.store_host, timeout=min(self.interval_s, 1.0)):
                return False
        except ConnectionRefusedError:
            return True
        except OSError:  # a time-out or an unreachable host: no answer either way, wait for the timeout
            return False

    def _read_failed(self) -> Optional[int]:
        if not self.store.check([self._key("failed")]):
            return None
        return int(self.store.get(self._key("failed")).decode())

    def _blame(self, rank: int) -> None:
        try:
            # compare_set with expected "" creates the key only if it is missing: the first verdict wins.
            recorded = self.store.compare_set(self._key("failed"), "", str(rank)).decode()
            rank = int(recorded) if recorded.isdigit() else rank
        except Exception:
            pass
        self._die(rank)

    def _die(self, rank: int) -> None:
        try:
            reported = self.store.check([self._key("reported", rank)])
        except Exception:
            reported = False
        if reported:  # that rank printed its error: the job has said what went wrong, once
            self._report(None)
        self._report(f"rank {rank} failed or stopped responding (no heartbeat within {self.timeout_s:g} s)")

    def _report(self, cause: Optional[str]) -> None:
        """Print `cause` (None: nothing) and end this process with status 1."""
        if self._stop.is_set():
            return
        if not self._reporting.acquire(blocking=False):
            while True:  # the other thread (watch or main) is already reporting and ends the process
                time.sleep(1.0)
        sys.stdout.flush()
        if cause is not None:
            print(f"error: {cause}; stopping rank {self.rank}", file=sys.stderr, flush=True)
        if self.rank == 0:
            # A plain launch's store lives in rank 0: stay up long enough for every rank to read the verdict.
            time.sleep(2 * self.interval_s + 0.5)
        os._exit(1)
