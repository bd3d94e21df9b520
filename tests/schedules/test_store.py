"""The base activation store's measurement: what `peak_bytes` and `peak_count` report (the figures the
metrics rows, the planner's check and the memory tests read)."""
from __future__ import annotations

import torch

from megatron_pp.schedules.store import ActivationStore


def test_peaks_count_saved_storages_and_held_tensors_once():
    store = ActivationStore()
    assert (store.peak_bytes, store.peak_count, store.live_bytes) == (0, 0, 0)  # a rank that stores nothing
    weight = torch.randn(4, 4, requires_grad=True)
    store.exclude([weight])
    x = torch.randn(3, 4)
    with store.stash("a"):
        y = (x @ weight).relu()  # saves x (the weight is excluded) and relu's output
    saved = x.untyped_storage().nbytes() + y.untyped_storage().nbytes()
    assert store.live["a"].nbytes == saved
    assert (store.peak_bytes, store.peak_count) == (saved, 1)
    grad_out = torch.ones(3, 4)
    store.hold("a", [grad_out, grad_out[:1], x])  # a view and an already counted storage add nothing
    held = saved + grad_out.untyped_storage().nbytes()
    assert store.live_bytes == store.peak_bytes == held
    store.release("a")
    assert (store.live_bytes, store.peak_bytes, store.peak_count) == (0, held, 1)
