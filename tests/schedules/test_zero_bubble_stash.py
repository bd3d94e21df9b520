"""The stash a split backward really holds: the executor's store against the live storages of a real run,
and the dry run (fake tensors) against the real run (gloo), for the zero-bubble families.

BI frees every saved tensor its BW does not read; the store counts a storage until it dies, so its peak is
what the stashes hold. The real runs are the dry run's own job code on real tensors (`dry_run._run` with
no fake mode, as tests/training/test_dry_run.py runs it), inside a `MemoryTracker`, which knows from its
own weak references which storages are alive."""
from __future__ import annotations

import pytest
import torch

from megatron_pp.core.parallel_state import ParallelState
from megatron_pp.core.storage import storage_key
from megatron_pp.schedules.store import ActivationStore
from megatron_pp.training import dry_run
from megatron_pp.training.arguments import parse_args
from tests.dist import run_distributed


def _args(schedule: str, pp: int, *extra: str):
    return parse_args(["--model-preset", "gpt-tiny", "--mock-data", "--micro-batch-size", "1",
                       "--global-batch-size", "8", "--train-iters", "2", "--num-layers", "4",
                       "--pipeline-model-parallel-size", str(pp), "--pipeline-schedule", schedule,
                       "--dry-run", str(pp), *extra])


class _Ledger:
    """Which storages each stash saved or held (recorded as the store is handed them) and, at every point
    the store notes its peak, the bytes of those that the tracker still sees alive: the held stash bytes by
    a count that does not use the store's own bookkeeping."""

    def __init__(self, tracker: dry_run.MemoryTracker) -> None:
        self.tracker, self.saved, self.peak, self.freed_while_live = tracker, {}, 0, 0

    def record(self, store: ActivationStore, key, tensors) -> None:
        for t in tensors:
            k = storage_key(t)
            entry = self.tracker.live.get(k)
            if entry is not None and not store.is_excluded(t):
                self.saved.setdefault(key, {})[k] = entry[0]  # the tracker's weak reference to that storage

    def held(self, store: ActivationStore) -> int:
        total = 0
        for key in store.live:
            for k, ref in self.saved.get(key, {}).items():
                entry = self.tracker.live.get(k)
                if entry is not None and entry[0] is ref:
                    total += entry[1]
                else:
                    self.freed_while_live += 1
        return total


def _watch(monkeypatch, ledger: _Ledger) -> None:
    pack, hold, note = ActivationStore.pack, ActivationStore.hold, ActivationStore._note_peak

    def pack_recorded(self, t, stash):
        ledger.record(self, stash.key, [t])
        return pack(self, t, stash)

    def hold_recorded(self, key, tensors):
        tensors = list(tensors)
        ledger.record(self, key, tensors)
        hold(self, key, tensors)

    def note_checked(self):
        note(self)
        held = ledger.held(self)
        assert self.live_bytes == held, (self.live_bytes, held)
        ledger.peak = max(ledger.peak, held)

    monkeypatch.setattr(ActivationStore, "pack", pack_recorded)
    monkeypatch.setattr(ActivationStore, "hold", hold_recorded)
    monkeypatch.setattr(ActivationStore, "_note_peak", note_checked)


def test_v_half_on_one_rank_holds_what_the_store_counts_and_the_dry_run_agrees(monkeypatch):
    """v-half at pp 1 (both V chunks on one rank, m 8): 16 backwards split, BW apart from BI. At every point
    the store notes, its count is the bytes of the stashes' storages still alive, to the byte; the dry run's
    stash peak is the real run's."""
    args = _args("v-half", 1, "--num-layers-per-virtual-pipeline-stage", "2")
    fake = dry_run.run_rank(args, 0, torch.device("cpu"))
    tracker = dry_run.MemoryTracker()
    ledger = _Ledger(tracker)
    _watch(monkeypatch, ledger)
    with tracker:
        real = dry_run._run(args, ParallelState.build(1, 1, device=torch.device("cpu")), None, tracker, steps=2)
    assert ledger.freed_while_live > 0  # BI really freed saved storages of live stashes
    assert real.stash_peak_bytes == ledger.peak == fake.stash_peak_bytes
    persistent = real.parameter_bytes + real.gradient_bytes + real.optimizer_bytes
    assert persistent + real.stash_peak_bytes <= real.peak_bytes


def _real_rank(ctx, schedule: str, pp: int, extra: tuple[str, ...]) -> dict:
    args = _args(schedule, pp, *extra)
    tracker = dry_run.MemoryTracker()
    with tracker:
        report = dry_run._run(args, ctx.parallel_state(1, pp), None, tracker, steps=2)
    return report.row()


@pytest.mark.parametrize("schedule,pp,extra", [
    ("zb-h1", 2, ()), ("zb-h1", 4, ()),
    ("zb-h1", 4, ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")),
    ("zb-v", 2, ("--num-layers-per-virtual-pipeline-stage", "1"))])
def test_dry_run_stash_peak_is_the_real_runs_on_every_rank(schedule, pp, extra):
    """m 8 on gloo against the fake backend: every rank but zb-h1's first splits backwards. The same stash
    peak on every rank, to the byte, and the state plus that peak fits under each run's total peak (the store
    no longer counts what BI freed: before, zb-h1's last rank at pp 2 counted 988480 stash bytes, more than
    its total peak less its state left room for). At pp 4 the middle ranks also send their outputs, and a
    gloo send reports completion only when waited for, at the step's end: a pending send that held its
    output strongly kept the output's graph, and through it the chunk input BI had freed, alive until then
    (2 to 3 inputs over the fake run's peak)."""
    real = run_distributed(pp, _real_rank, schedule, pp, extra)
    args = _args(schedule, pp, *extra)
    for rank in range(pp):
        fake = dry_run.run_rank(args, rank, torch.device("cpu"))
        assert fake.stash_peak_bytes == real[rank]["stash_peak_bytes"], (schedule, rank)
        for report in (fake.row(), real[rank]):
            state = report["parameter_bytes"] + report["gradient_bytes"] + report["optimizer_bytes"]
            assert state + report["stash_peak_bytes"] <= report["peak_bytes"], (schedule, rank, report)
