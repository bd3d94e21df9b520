"""The emulator's timer slack (megatron_pp/benchmarks/emulate.py, `tighten_timer_slack`): after it, the calling
thread's sleeps may end at most 1 ns late by the kernel's choice, which the emulated grids' timing rests on
(docs/benchmarks.md). Read back with PR_GET_TIMERSLACK in the same thread: a wrong prctl option (issue 37's
seed-45 mutation survivor asked for option 28, PR_SET_SECUREBITS) still returned success and left the slack at
its default. Linux only, as the emulator's thread measurements are."""
import ctypes
import threading

from megatron_pp.benchmarks.emulate import tighten_timer_slack

PR_SET_TIMERSLACK, PR_GET_TIMERSLACK = 29, 30


def test_tightening_sets_this_threads_slack_to_one_nanosecond():
    seen = {}

    def in_a_thread():  # the slack is per thread: this one ends with the test, pytest's own stays as it was
        ctypes.CDLL(None).prctl(PR_SET_TIMERSLACK, 50_000, 0, 0, 0)  # the usual default, whatever was inherited
        seen["before"] = ctypes.CDLL(None).prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0)
        seen["tightened"] = tighten_timer_slack()
        seen["after"] = ctypes.CDLL(None).prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0)

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert seen["before"] == 50_000 and seen["tightened"] is True and seen["after"] == 1
