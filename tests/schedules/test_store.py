"""The base activation store's measurement: what `peak_bytes` and `peak_count` report (the figures the
metrics rows, the planner's check and the memory tests read)."""
from __future__ import annotations

import pytest
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


def test_the_second_step_peaks_from_what_is_still_live_and_freed_weights_count_again():
    store = ActivationStore()
    weight = torch.randn(4, 4, requires_grad=True)
    store.exclude([weight])
    x1, x2 = torch.randn(2, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
    with store.stash("a"):
        (x1 @ weight).sum()  # saves x1 and the weight, which is excluded
    with store.stash("b"):
        (x2 @ weight).sum()
    one, two = x1.untyped_storage().nbytes(), x2.untyped_storage().nbytes()
    assert (store.live_bytes, store.peak_bytes, store.peak_count) == (one + two, one + two, 2)
    with pytest.raises(RuntimeError, match="stash a is already live"):  # a forward twice without its backward
        with store.stash("a"):
            pass
    store.release("a")
    # Next step: its peak starts from what is still live ("b"), not from the last step's two stashes.
    store.reset_peak()
    assert (store.peak_bytes, store.peak_count, store.live_count) == (two, 1, 1)
    # A gathered weight freed after its chunk ran: its storage may come back as an activation's and must count.
    store.include([weight])
    x3 = torch.randn(2, 4, requires_grad=True)
    with store.stash("c"):
        (x3 @ weight).sum()  # saves x3 and the weight (x3's gradient needs it), which now counts
    assert store.live["c"].nbytes == x3.untyped_storage().nbytes() + weight.untyped_storage().nbytes()
    assert (store.peak_bytes, store.peak_count) == (two + store.live["c"].nbytes, 2)


def test_a_storage_freed_while_its_stash_is_live_stops_counting_and_a_new_one_at_its_address_counts():
    """A split backward's BI frees what its BW does not need while the stash lives: those bytes are no longer
    held, so the stash stops counting them (counting them until BW put zb-h1's last LLaMA-3-70B rank 11 GiB
    over what its live storages ever reached). The allocator may give the address to the output gradient BW
    holds: new memory, counted (a store that knew storages by address alone skipped it)."""
    buffer = bytearray(256)  # two storages over one buffer: the same address, forced, not left to malloc
    store = ActivationStore()
    first = torch.frombuffer(buffer, dtype=torch.float32).requires_grad_()
    with store.stash("a"):
        (first * 2.0).sum()  # saves nothing: mul by a Python scalar
        out = first.exp()  # exp saves its output, a fresh storage
    saved = out.untyped_storage().nbytes()
    assert store.live_bytes == store.peak_bytes == saved
    out.backward(torch.ones_like(out))  # frees the graph, and exp's output with it once we drop ours
    del out
    assert store.live_bytes == 0 and store.live["a"].nbytes == 0
    held = torch.frombuffer(buffer, dtype=torch.float32)
    store.hold("a", [held])
    assert store.live_bytes == 256 and store.peak_bytes == saved
    address = held.untyped_storage().data_ptr()
    del held  # the held storage dies while the stash is live
    assert store.live_bytes == 0
    again = torch.frombuffer(buffer, dtype=torch.float32)
    assert again.untyped_storage().data_ptr() == address
    store.hold("a", [again, again[1:]])  # a different storage at the same address: counted; its view is not
    assert store.live_bytes == 256 and store.peak_bytes == saved
    store.release("a")
    assert store.live_bytes == 0
    del again  # released: its stash no longer watches it
    assert store.live_bytes == 0


def test_what_a_released_stash_counted_is_not_subtracted_again_when_it_dies():
    """Storages alive at release (the microbatch's batch tensors, which the executor keeps to the step's
    end) leave the count at release; their later death must not lower it again."""
    store = ActivationStore()
    weight = torch.randn(4, 4, requires_grad=True)
    store.exclude([weight])
    x = torch.randn(3, 4)
    with store.stash("a"):
        y = x @ weight  # saves x
    with store.stash("b"):
        z = (x + 1.0) @ weight  # saves x + 1
    store.release("a")
    assert store.live_bytes == store.live["b"].nbytes == 48
    del x, y
    assert store.live_bytes == 48
    del z  # b's saved tensor dies with its graph: b counts nothing any more
    assert store.live_bytes == store.live["b"].nbytes == 0
