"""ExitConditions and the SLURM batch script's PID files: a rank advertises its PID only once its USR1
handler is in place (an earlier USR1 would kill it instead of stopping it), and withdraws it at the end."""
import os
import signal
import socket

from megatron_pp.training.signals import ExitConditions


def test_pid_file_appears_after_the_handler_and_goes_at_the_end(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_PP_PID_DIR", str(tmp_path / "pids"))
    pid_file = tmp_path / "pids" / f"{socket.gethostname()}.0.pid"
    with ExitConditions(handle_signals=False):
        assert not pid_file.exists()  # nothing would handle the signal: nothing to advertise
    before = signal.getsignal(signal.SIGUSR1)
    with ExitConditions(handle_signals=True) as conditions:
        assert int(pid_file.read_text()) == os.getpid()
        os.kill(int(pid_file.read_text()), signal.SIGUSR1)  # what the batch script's signal step does
        assert conditions.local_flags() == (True, False)
        assert conditions.reason(True, False, 3) == "received SIGUSR1 (--exit-signal-handler)"
    assert not pid_file.exists()
    assert signal.getsignal(signal.SIGUSR1) is before
