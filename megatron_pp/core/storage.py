"""Storage identity: one name for "the memory a tensor lives in", for real, fake and meta tensors alike.

`data_ptr()` is not that name. On `FakeTensorMode` and `meta` tensors it is 0 for every storage, so a
store keyed by it counts every saved tensor as one storage of 0 useful bytes (silently); and on real
tensors an address is reused by the allocator as soon as the storage is freed. `storage_key` returns the
address of the storage's C++ `StorageImpl` instead: distinct for every live storage on every device,
fake and meta included. A key outlives its storage, though: the next `StorageImpl` may be allocated where
a freed one was. Whoever keeps keys across frees pairs each key with a weak reference (`StorageRef`, which
tells a live storage from a new one at the same key; the activation store and the dry run's tracker use
one with a callback, which forgets the key when its storage dies: PyTorch keeps one Python object per live
storage, so the weak reference dies exactly when the storage does).

Worked example: `a = torch.empty(1000)`, `b = a[2:5]` -> `storage_key(a) == storage_key(b)`; under
`FakeTensorMode`, `a.data_ptr() == b.data_ptr() == c.data_ptr() == 0` for any third tensor `c`, while
`storage_key(c) != storage_key(a)`.
"""
from __future__ import annotations

import weakref
from typing import Union

import torch

StorageLike = Union[torch.Tensor, torch.UntypedStorage]


def untyped(x: StorageLike) -> torch.UntypedStorage:
    """The untyped storage of a tensor (a storage is returned as it is)."""
    return x.untyped_storage() if isinstance(x, torch.Tensor) else x


def storage_key(x: StorageLike) -> int:
    """An integer naming the storage `x` lives in (a tensor or a storage), unique among live storages."""
    return untyped(x)._cdata


def same_storage(a: StorageLike, b: StorageLike) -> bool:
    """Whether `a` and `b` live in one storage (views of one base do; two fake tensors never unless so)."""
    return storage_key(a) == storage_key(b)


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` are the same elements of one storage (same storage, offset, shape and strides):
    the test `a.data_ptr() == b.data_ptr()` meant, valid on fake and meta tensors too."""
    return (same_storage(a, b) and a.storage_offset() == b.storage_offset() and a.shape == b.shape
            and a.stride() == b.stride() and a.dtype == b.dtype)


class StorageRef:
    """A weak reference to one storage: `alive_as(s)` tells whether `s` is still that storage (and not a
    new one that took its key after it was freed)."""

    __slots__ = ("key", "_ref")

    def __init__(self, x: StorageLike) -> None:
        storage = untyped(x)
        self.key = storage._cdata
        self._ref = weakref.ref(storage)

    def alive(self) -> bool:
        return self._ref() is not None

    def alive_as(self, x: StorageLike) -> bool:
        return self._ref() is untyped(x)
