"""When to stop training early: a preemption signal, a wall-clock budget or an iteration count.

SLURM warns a job before preempting or timing it out by sending SIGTERM or, with `--signal=USR1@90`,
SIGUSR1 to every task. With `--exit-signal-handler` the handler here only records the signal; the
training loop finishes the step it is in, saves a checkpoint and exits 0, so the requeued job resumes
where this one stopped. `--exit-duration-in-mins` and `--exit-interval` stop the same way.

Every rank must stop after the *same* iteration, or the ones that go on wait forever in the next
step's collectives. A signal may reach one rank only, or ranks a step apart, and clocks drift, so the
decision is an all-reduce (max) of each rank's flags after every step: one tiny collective, issued only
when a signal handler or a time limit is in use. `--exit-interval` needs none, being the same
arithmetic on every rank.
"""
from __future__ import annotations

import os
import signal
import time
from types import FrameType
from typing import Callable, Optional, Union

import torch

from megatron_pp.core import comm

from megatron_pp.core.parallel_state import read_launch_env, write_pid_file

EXIT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_Handler = Union[Callable[[int, Optional[FrameType]], object], int, None]


class ExitConditions:
    """Decides, identically on every rank, whether to stop after the current iteration.

    Use as a context manager: the signal handlers are installed on entry (main thread only, as Python
    requires) and the previous handlers are put back on exit, so an embedding program or a test worker
    keeps its own.
    """

    def __init__(
        self,
        *,
        handle_signals: bool = False,
        exit_interval: Optional[int] = None,
        exit_duration_mins: Optional[float] = None,
        started: Optional[float] = None,
        device: torch.device = torch.device("cpu"),
    ) -> None:
        self.handle_signals = handle_signals
        self.exit_interval = exit_interval
        self.exit_duration_mins = exit_duration_mins
        self.started = time.monotonic() if started is None else started
        self.device = device
        self.received: Optional[int] = None  # the signal number, once one has arrived
        self._previous: dict[int, _Handler] = {}
        self._pid_file: Optional[str] = None

    def __enter__(self) -> "ExitConditions":
        if self.handle_signals:
            for sig in EXIT_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            # The SLURM batch script sends USR1 to the PIDs it finds in these files; advertised any
            # earlier, a USR1 would meet the default action and kill the rank instead of stopping it.
            self._pid_file = write_pid_file(read_launch_env())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pid_file is not None:
            try:
                os.remove(self._pid_file)
            except OSError:
                pass
            self._pid_file = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        # Only record: the step in flight finishes, and the loop saves at a consistent point.
        self.received = signum

    def check(self, iteration: int) -> Optional[str]:
        """The reason to stop after `iteration` (the same on every rank), or None to go on.

        Collective when signals or a duration are watched: every rank must call it after every step.
        """
        local = torch.zeros(2, dtype=torch.float32, device=self.device)
        if self.handle_signals or self.exit_duration_mins is not None:
            local = torch.tensor(self.local_flags(), dtype=torch.float32, device=self.device)
            local = comm.all_reduce(local, op="max")
        return self.reason(bool(local[0] > 0), bool(local[1] > 0), iteration)

    def local_flags(self) -> tuple[bool, bool]:
        """(a signal arrived on this rank, this rank's clock says the time is up): what `check` agrees on.
        A caller that agrees on them another way (2BW carries them on its metrics all-reduce, so that no
        step waits for the slowest rank) passes the agreed flags to `reason`."""
        time_up = (self.exit_duration_mins is not None
                   and (time.monotonic() - self.started) / 60.0 > self.exit_duration_mins)
        return self.received is not None, time_up

    def reason(self, signal_seen: bool, time_up: bool, iteration: int) -> Optional[str]:
        """The reason to stop after `iteration` given flags every rank agrees on, or None to go on."""
        if signal_seen:
            name = signal.Signals(self.received).name if self.received is not None else "a signal on another rank"
            return f"received {name} (--exit-signal-handler)"
        if time_up:
            return f"--exit-duration-in-mins {self.exit_duration_mins} reached"
        if self.exit_interval is not None and iteration % self.exit_interval == 0:
            return f"--exit-interval {self.exit_interval} reached"
        return None
