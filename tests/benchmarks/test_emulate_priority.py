"""The emulating ranks' scheduling (megatron_pp/benchmarks/emulate.py, `raise_priority`, `make_realtime`), checked in
a child process so that the test run itself keeps its own: with the rights to (root), every thread runs under
SCHED_FIFO, a thread started afterwards (as gloo's are) inherits it, and the process's autogroup gets the
rank's nice value; without them, both say False and change nothing. Linux only, as the emulator is."""
import os
import subprocess
import sys

import pytest

CHILD = """
import os, threading
from megatron_pp.benchmarks.emulate import PRIORITY, autogroup_nice, make_realtime, raise_priority
before = os.sched_getscheduler(0)
raised, realtime = raise_priority(), make_realtime()
seen = {}
thread = threading.Thread(target=lambda: seen.setdefault("policy", os.sched_getscheduler(0)))
thread.start(); thread.join()
print(before, raised, realtime, os.sched_getscheduler(0), seen["policy"], autogroup_nice(), PRIORITY)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux scheduling")
def test_ranks_run_real_time_and_their_autogroup_at_the_rank_priority():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=root, capture_output=True, text=True, check=True,
                         start_new_session=True)  # its own autogroup: the test run's stays as it was
    before, raised, realtime, after, in_thread, group_nice, priority = out.stdout.split()
    assert int(before) == os.SCHED_OTHER
    if os.geteuid() == 0:
        assert (raised, realtime) == ("True", "True")
        assert int(after) == int(in_thread) == os.SCHED_FIFO
        if os.path.exists("/proc/self/autogroup"):
            assert int(group_nice) == int(priority)
    else:
        assert realtime == "False" and int(after) == int(in_thread) == os.SCHED_OTHER


RESTORE = """
import os
from megatron_pp.benchmarks.emulate import (autogroup_nice, make_realtime, raise_priority, restore_scheduling,
                                            scheduling_state)
saved = scheduling_state()
raise_priority(); make_realtime()
restore_scheduling(saved)
print(saved == scheduling_state(), os.sched_getscheduler(0) == os.SCHED_OTHER)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux scheduling")
def test_restore_puts_policy_nice_and_autogroup_back():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", RESTORE], cwd=root, capture_output=True, text=True, check=True,
                         start_new_session=True)
    assert out.stdout.split() == ["True", "True"]
