"""The heartbeat watchdog's verdicts on a synthetic clock, so that no bound depends on the machine's load:
a peer that stops beating is named once the timeout has passed through the watcher's own checks, and a
stall of the whole host (every process frozen while the clock runs on: a paused VM, a swap storm) is not
taken for a death, however long it lasts. The real processes: test_failing_rank.py and test_faults.py."""
from __future__ import annotations

import pytest

from megatron_pp.training import watchdog as wd


class FakeStore:
    """The few TCPStore calls the watchdog makes, on a dict."""

    def __init__(self):
        self.values: dict[str, object] = {}

    def add(self, key, amount):
        self.values[key] = int(self.values.get(key, 0)) + amount
        return self.values[key]

    def check(self, keys):
        return all(k in self.values for k in keys)

    def get(self, key):
        return str(self.values[key]).encode()

    def set(self, key, value):
        self.values[key] = value

    def compare_set(self, key, expected, desired):
        if key not in self.values and expected == "":
            self.values[key] = desired
        return str(self.values[key]).encode()


class Verdict(Exception):
    pass


class Clock:
    """The watcher's clock and its interval wait: each wait moves the clock by the interval plus whatever
    stall is planted at that step, then lets the peer beat (or not)."""

    def __init__(self, steps, peer_beats, stalls=None):
        self.now, self.step, self.steps = 1000.0, 0, steps
        self.peer_beats, self.stalls = peer_beats, stalls or {}

    def monotonic(self):
        return self.now

    def wait(self, interval):
        self.step += 1
        self.now += interval + self.stalls.get(self.step, 0.0)
        return self.step > self.steps  # True: stop the loop

    def sleep(self, seconds):
        self.now += seconds


def _watch(monkeypatch, clock, timeout_s=8.0):
    """Run rank 0's watch loop (its peer is rank 1) on `clock`; the rank it blames, or None."""
    store = FakeStore()
    dog = wd.Watchdog(store, rank=0, world_size=2, timeout_s=timeout_s)
    monkeypatch.setattr(wd.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(dog._stop, "wait", lambda interval: (clock.wait(interval),
                                                             clock.peer_beats(clock.step) and
                                                             store.add(dog._key("heartbeat", 1), 1))[0])

    def report(cause):
        raise Verdict(cause)

    monkeypatch.setattr(dog, "_report", report)
    try:
        dog._loop()
    except Verdict as verdict:
        return str(verdict), clock.step
    return None, clock.step


def test_a_peer_that_stops_beating_is_named_after_the_timeout(monkeypatch):
    # Interval 2 s (timeout 8 s / 4): the peer beats through step 5, then never again.
    cause, step = _watch(monkeypatch, Clock(100, lambda step: step <= 5))
    assert cause == "rank 1 failed or stopped responding (no heartbeat within 8 s)"
    # Last change seen at step 5 (t = 10 s); more than 8 s and 4 unchanged checks later: step 10.
    assert step == 10


@pytest.mark.parametrize("stall_s", [9.0, 60.0, 3600.0])
def test_a_stall_of_the_whole_host_is_not_a_death(monkeypatch, stall_s):
    """The host stalls for longer than the timeout at step 6: the watcher's clock jumps, but the peer was
    frozen too and beats again at its next interval. Before the watcher counted its own checks, the jump
    alone named the peer dead (what a loaded 2-core host did to a 60 s heartbeat)."""
    cause, step = _watch(monkeypatch, Clock(40, lambda step: step != 6, stalls={6: stall_s}))
    assert cause is None and step == 41


def test_a_peer_dead_across_a_stall_is_still_named(monkeypatch):
    """The peer dies in the stall: once the watcher has checked through the timeout again, it names it."""
    cause, step = _watch(monkeypatch, Clock(100, lambda step: step < 6, stalls={6: 600.0}))
    assert cause.startswith("rank 1 failed or stopped responding") and step == 9  # 4 unchanged checks: 6..9


def _reporting_dog(monkeypatch, refused: bool, agent_store: bool = False):
    dog = wd.Watchdog(FakeStore(), rank=1, world_size=2, timeout_s=8.0, store_address="the rendezvous store at h:1",
                      store_host=("127.0.0.1", 1), agent_store=agent_store)
    monkeypatch.setattr(dog, "_store_refuses", lambda: refused)

    def report(cause):
        raise Verdict(cause)

    monkeypatch.setattr(dog, "_report", report)
    return dog


def test_a_store_whose_port_refuses_means_its_host_is_gone_at_once(monkeypatch):
    """The first failed store call with the port refusing: no waiting out the timeout (a plain launch's rank 0
    hosts the store; under torchrun, the agent)."""
    with pytest.raises(Verdict, match=r"^rank 0 is gone: the rendezvous store at h:1, which it hosted, refuses "
                                      r"connections$"):
        _reporting_dog(monkeypatch, refused=True)._store_failed(0.0)
    with pytest.raises(Verdict, match=r"^the torchrun agent is gone: "):
        _reporting_dog(monkeypatch, refused=True, agent_store=True)._store_failed(0.0)


def test_a_store_that_does_not_answer_is_given_the_timeout(monkeypatch):
    """No refusal (a host lost with its node, or a slow store): only after the timeout without an answer."""
    dog = _reporting_dog(monkeypatch, refused=False)
    dog._store_failed(7.9)  # within the timeout: nothing yet
    with pytest.raises(Verdict, match=r"^rank 0 is gone: .* stopped answering for 8 s$"):
        dog._store_failed(8.1)


def test_the_probe_tells_a_closed_port_from_a_listening_one():
    import socket

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(1)
        port = listening.getsockname()[1]
        dog = wd.Watchdog(FakeStore(), rank=1, world_size=2, timeout_s=8.0, store_host=("127.0.0.1", port))
        assert dog._store_refuses() is False
    assert dog._store_refuses() is True  # closed now: nothing listens there
    assert wd.Watchdog(FakeStore(), rank=1, world_size=2, timeout_s=8.0)._store_refuses() is False  # no address
