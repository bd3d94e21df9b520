"""Storage identity for real, fake and meta tensors, and the activation store counting fake tensors."""
import gc

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megatron_pp.core.host_read import read_values, reads
from megatron_pp.core.storage import StorageRef, same_memory, storage_key
from megatron_pp.schedules.store import ActivationStore, Stash


def test_keys_tell_fake_and_meta_storages_apart_where_data_ptr_cannot():
    with FakeTensorMode():
        a, c = torch.empty(1000), torch.empty(1000)
        assert a.untyped_storage().data_ptr() == c.untyped_storage().data_ptr() == 0
        assert storage_key(a) == storage_key(a[2:5]) != storage_key(c)
        assert same_memory(a, a.view(10, 100).view(1000)) and not same_memory(a, a[1:])
    m1, m2 = torch.empty(8, device="meta"), torch.empty(8, device="meta")
    assert storage_key(m1) != storage_key(m2)


def test_store_counts_fake_saved_tensors_by_their_bytes():
    with FakeTensorMode():
        w = torch.empty(64, 64, requires_grad=True)
        store = ActivationStore(exclude=[w])
        x = torch.empty(8, 64, requires_grad=True)
        with store.stash((0, 0)):
            y = (x @ w).relu()  # saves x (w is excluded) and relu's output
        assert store.live_bytes == 8 * 64 * 4 * 2
        del y


def test_a_freed_storage_is_not_taken_for_a_new_one_with_the_same_key():
    t = torch.empty(256)
    ref, key = StorageRef(t), storage_key(t)
    assert ref.alive_as(t)
    del t
    gc.collect()
    assert not ref.alive()
    for _ in range(50):  # the allocator may hand the same StorageImpl address to a new storage
        u = torch.empty(256)
        if storage_key(u) == key:
            assert not ref.alive_as(u)
            break


def test_stash_stops_counting_a_storage_when_it_dies():
    freed = []
    stash = Stash((0, 0), on_free=freed.append)
    t = torch.empty(100)
    assert stash.add(t) == 400 and stash.add(t[1:]) == 0
    del t
    gc.collect()
    assert stash.nbytes == 0 and freed == [400]
    u = torch.empty(100)  # whatever key it gets, it is new memory
    assert stash.add(u) == 400 and stash.nbytes == 400


def test_reads_are_counted_and_fake_reads_return_zeros():
    reads.clear()
    assert read_values(torch.tensor([1.0, 4.0]), "loss") == [1.0, 4.0]
    with FakeTensorMode():
        assert read_values(torch.empty(3), "found-inf") == [0.0, 0.0, 0.0]
    assert reads == {"loss": 1, "found-inf": 1}
