"""A rank waiting for the job's verdict (`Watchdog.wait_for_verdict`, megatron_pp/training/watchdog.py) when the
store's host dies meanwhile: it names the host gone at its first failed read, as the watch thread does
(tests/reliability/test_watchdog.py), instead of waiting out its whole wait and leaving with no verdict (issue
37's seed-44 mutation survivor dropped that report; the process-level tests never stop the store during this
wait)."""
import pytest

from megatron_pp.training import watchdog as wd


class _GoneStore:
    """A TCPStore whose host has died: every call fails (and is counted)."""

    def __init__(self):
        self.calls = 0

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            self.calls += 1
            raise RuntimeError("Connection reset by peer")
        return fail


class _Verdict(Exception):
    pass


def test_a_store_that_dies_during_the_wait_is_named_at_once(monkeypatch):
    store = _GoneStore()
    dog = wd.Watchdog(store, rank=1, world_size=2, timeout_s=8.0,
                      store_address="the rendezvous store at h:1", store_host=("127.0.0.1", 1))
    monkeypatch.setattr(dog, "_store_refuses", lambda: True)  # nothing listens on its port any more

    def report(cause):
        raise _Verdict(cause)

    monkeypatch.setattr(dog, "_report", report)
    with pytest.raises(_Verdict, match=r"^rank 0 is gone: the rendezvous store at h:1, which it hosted, refuses "
                                       r"connections$"):
        dog.wait_for_verdict(timeout_s=3.0)
    assert store.calls == 1  # at the first failed read, not at the end of the wait
