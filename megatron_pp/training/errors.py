"""Errors of a multi-process job reported like one program: each distinct line once, one exit status.

Every rank of a launched job checks its own arguments and reads its own files, so a bad flag is found
by all of them and a node-local file may be bad on one. Printed by every rank, one mistake becomes
hundreds of identical lines; printed by rank 0 only, a problem that only rank 37 saw is lost. Here the
ranks agree through the job's rendezvous TCPStore (the one `init_distributed` builds the process group
on, so no second server) and every distinct line is printed once: by global rank 0 when every rank
found it, else by the first rank that found it, prefixed with its rank and how many others did.

Exit statuses (the table is in docs/reliability.md): `EXIT_USAGE` (2) for a usage error — a flag, a
config file, a file named on the command line that is missing, a flag combination that cannot run on
the launched world — found before any process group exists; every rank exits 2 (also when the torchrun
agent, seeing the first one exit, sends the rest SIGTERM). `EXIT_FAILURE` (1) for a runtime failure:
an input file found wrong once the job is running, a checkpoint that cannot load or save, a stop for
non-finite steps, a rank that died. The ranks that did not fail are stopped by the heartbeat watchdog,
which stays silent when the failed rank printed its own error.

Store traffic is a few counters per rank and per distinct line, whatever the world size: no rank reads
another rank's keys, so the agreement costs the same at 8 ranks and at 8,000.
"""
from __future__ import annotations

import hashlib
import os
import signal
import sys
import time
from typing import Optional, Sequence

from megatron_pp.training.watchdog import key_prefix

EXIT_FAILURE = 1
EXIT_USAGE = 2


def one_line(text: object) -> str:
    """`text` as one printable line: whitespace runs collapse, control characters are escaped (a value
    typed or read from a file must not break the line)."""
    text = " ".join(str(text).split())
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def print_error(line: str) -> None:
    print(f"error: {one_line(line)}", file=sys.stderr, flush=True)


def _digest(line: str) -> str:
    return hashlib.sha1(line.encode()).hexdigest()[:16]


def _attributed(line: str, rank: int, count: int) -> str:
    if count <= 1:
        return f"rank {rank}: {line}"
    return f"rank {rank} and {count - 1} other rank{'s' if count > 2 else ''}: {line}"


def _exit_on_sigterm(status: int) -> None:
    """Under torchrun the agent SIGTERMs the other workers as soon as the first exits: they are leaving
    with `status` anyway, so the agent's summary should show it, not -15."""
    def leave(signum: int, frame: object) -> None:
        sys.stderr.flush()
        os._exit(status)
    try:
        signal.signal(signal.SIGTERM, leave)
    except ValueError:  # not the main thread (an embedding program): keep its handler
        pass


def agree_on_usage_errors(lines: Sequence[str], store: Optional[object], rank: int, world_size: int) -> None:
    """Return when no rank found a usage error; else print each distinct line once and exit 2 on every rank.

    Every rank of the job must call this once, with its own (possibly empty) lines: it is the first
    meeting of the ranks. `store` is None for a single process."""
    lines = list(dict.fromkeys(one_line(line) for line in lines))
    if store is None or world_size == 1:
        if lines:
            for line in lines:
                print_error(line)
            sys.exit(EXIT_USAGE)
        return
    prefix = key_prefix() + "usage/"
    first = {line: store.add(f"{prefix}line/{_digest(line)}", 1) == 1 for line in lines}
    if lines:
        store.add(f"{prefix}failed_ranks", 1)
    if store.add(f"{prefix}arrived", 1) == world_size:
        store.set(f"{prefix}all_arrived", "1")
    store.wait([f"{prefix}all_arrived"])
    if store.add(f"{prefix}failed_ranks", 0) == 0:
        return
    _exit_on_sigterm(EXIT_USAGE)
    for line in lines:
        count = store.add(f"{prefix}line/{_digest(line)}", 0)
        if count == world_size:
            if rank == 0:
                print_error(line)
        elif first[line]:
            print_error(_attributed(line, rank, count))
    _leave_together(store, prefix, world_size, rank)
    # Not sys.exit: tearing down an interpreter with torch loaded takes a while, and Python restores the
    # default SIGTERM action for it, so the agent's SIGTERM would turn this rank's status into -15.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_USAGE)


def _leave_together(store: object, prefix: str, expected: int, rank: int, timeout_s: float = 10.0) -> None:
    """Wait (bounded) until the `expected` ranks that print or stay silent here are all done. A rank that
    left early would hand its launcher a reason to stop the others (srun --kill-on-bad-exit, the torchrun
    agent) before one of them printed the line. Rank 0 of a plain launch hosts the store itself, so it
    leaves last, after every other rank's final call: a rank still talking to a store whose host is gone
    gets torch's broken-connection warnings on its stderr, beside the one line it was meant to show."""
    deadline = time.monotonic() + timeout_s
    try:
        store.add(f"{prefix}done", 1)
        while store.add(f"{prefix}done", 0) < expected and time.monotonic() < deadline:
            time.sleep(0.02)
        left = store.add(f"{prefix}left", 1)
        if rank == 0:
            while left < expected and time.monotonic() < deadline:
                time.sleep(0.02)
                left = store.add(f"{prefix}left", 0)
    except Exception:  # the store's host left first: everything that needed it has been said
        return


def report_runtime_error(line: str, store: Optional[object], rank: int, world_size: int,
                         grace_s: float = 2.0, echo: bool = False) -> None:
    """Print `line` once for the ranks that fail with it (within `grace_s` of the first), and return.

    The first rank to fail with a line waits up to `grace_s` for the others to fail with it too; when
    all of them do, rank 0 prints it, else the first one does, naming itself. `echo`: the line only
    says that another rank failed (an agreed checkpoint error); that rank prints the cause, so in a
    multi-process job an echo is not printed. The caller then tells the watchdog and exits 1."""
    line = one_line(line)
    if store is None or world_size == 1:
        print_error(line)
        return
    printed = f"{key_prefix()}error/printed"
    if echo:
        # The rank that met the cause prints it. Stay until it has: under torchrun the agent stops the other
        # workers as soon as one exits, which would stop that rank before its line; and a plain launch's
        # store lives in rank 0, which that rank still talks to until it has said so.
        deadline = time.monotonic() + grace_s + 30.0
        try:
            while not store.check([printed]) and time.monotonic() < deadline:
                time.sleep(0.02)
        except Exception:  # the store's host is gone: nothing left to wait for
            pass
        return
    key = f"{key_prefix()}error/{_digest(line)}/"
    try:
        if store.add(key + "count", 1) == 1:
            deadline = time.monotonic() + grace_s
            while store.add(key + "count", 0) < world_size and time.monotonic() < deadline:
                time.sleep(0.02)
            count = store.add(key + "count", 0)
            store.set(key + "printer", f"{0 if count == world_size else rank} {count}")
        store.wait([key + "printer"])
        printer, count = (int(x) for x in store.get(key + "printer").decode().split())
    except Exception:  # the store is gone (its host died): this rank's own line is still worth printing
        print_error(f"rank {rank}: {line}")
        return
    if printer == rank:
        print_error(line if count == world_size else _attributed(line, rank, count))
    _leave_together(store, key, count, rank)
    try:
        store.set(printed, "1")  # the ranks that only echo a failure elsewhere may leave now
    except Exception:
        pass

