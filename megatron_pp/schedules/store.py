"""Activation store: where the tensors saved for backward of each (microbatch, chunk) live.

Every chunk-forward runs inside `store.stash(key)`, which installs
`torch.autograd.graph.saved_tensors_hooks`. Each tensor autograd saves passes through `pack`, which
attributes its storage to the stash (deduplicated by storage, so views and a tensor saved by several
ops count once; parameters and buffers never count, they are not per-microbatch memory). In this base
class tensors stay where they are: the store only measures, which is how real activation memory is
measured on CPU. Subclasses change where the tensors go (host memory for PipeOffload, see
`offload_store.OffloadStore`; a peer rank for BPipe) by overriding `pack`/`unpack` and counting only the
stashes still in device memory (`resident_count`), without touching the executor.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Iterator, Optional

import torch

from megatron_pp.core.storage import storage_key


@dataclass
class Stash:
    """The storages one (microbatch, chunk) keeps for its backward, each counted from when autograd saves it
    (or the executor holds it for a deferred BW) until it dies or the stash is released.

    A storage can die while its stash is live: a split backward's BI frees every saved tensor its BW does
    not read (attention and MLP internals, norm statistics, ...), keeping only the linear layers' inputs,
    and the output gradients it adds for BW die one by one as BW's GEMMs run. Each counted storage has a
    weak reference whose callback stops counting it when it dies (PyTorch keeps one Python object per live
    storage, so the callback runs exactly when the storage is freed, before its key can be reused), and
    tells `on_free`, the store's running total."""

    key: Hashable
    storages: dict[int, int] = field(default_factory=dict)  # storage_key -> nbytes, of live storages only
    on_free: Optional[Callable[[int], None]] = field(default=None, repr=False)
    _alive: dict[int, weakref.ref] = field(default_factory=dict, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())

    def add(self, t: torch.Tensor) -> int:
        """Count `t`'s storage in this stash unless it already is; the bytes newly counted. A key present is
        its live storage: a counted storage that died was removed by its callback before the key was free."""
        storage = t.untyped_storage()
        if storage_key(storage) in self.storages:
            return 0
        self.put(storage)
        return storage.nbytes()

    def put(self, storage: torch.UntypedStorage) -> None:
        """Count `storage` at its key (a subclass bringing a moved storage back uses this too)."""
        key = storage_key(storage)
        self.storages[key] = storage.nbytes()
        self._alive[key] = weakref.ref(storage, lambda ref, key=key: self._freed(key, ref))

    def drop(self, storage: torch.UntypedStorage) -> None:
        """Stop counting `storage` (a subclass moved it off the device; its own count follows)."""
        self.storages.pop(storage_key(storage), None)
        self._alive.pop(storage_key(storage), None)

    def close(self) -> None:
        """Stop watching the storages (the stash is released): no callback runs for this stash any more."""
        self.on_free = None
        self._alive.clear()

    def _freed(self, key: int, ref: weakref.ref) -> None:
        if self._alive.get(key) is ref:  # not dropped, and not a later storage at the same key
            del self._alive[key]
            nbytes = self.storages.pop(key)
            if self.on_free is not None:
                self.on_free(nbytes)


class ActivationStore:
    """Measure (and, in subclasses, move) the activations saved by each chunk-forward."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded: set[int] = set()
        self.exclude(exclude)
        self.live: dict[Hashable, Stash] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_count = 0

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never count these (parameters, buffers): they are not per-microbatch memory."""
        for t in tensors:
            self._excluded.add(storage_key(t))

    def include(self, tensors: Iterable[torch.Tensor]) -> None:
        """Undo `exclude` for these tensors' current storage, which is about to be freed (sharded weights
        free a chunk's gathered parameters after it runs): the key may come back as an activation's."""
        for t in tensors:
            self._excluded.discard(storage_key(t))

    @contextmanager
    def stash(self, key: Hashable) -> Iterator[Stash]:
        """Attribute everything autograd saves inside this block to stash `key`."""
        if key in self.live:
            raise RuntimeError(f"stash {key} is already live: a forward ran twice without its backward")
        stash = Stash(key, on_free=self._freed)
        self.live[key] = stash
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self.pack(t, stash), self.unpack):
            yield stash
        self._note_peak()

    def hold(self, key: Hashable, tensors: Iterable[torch.Tensor]) -> None:
        """Count `tensors` (made after the forward, e.g. the output gradients a split backward keeps for
        its BW) as part of live stash `key` until it is released."""
        stash = self.live[key]
        for t in tensors:
            self.live_bytes += stash.add(t)
        self._note_peak()

    def release(self, key: Hashable) -> None:
        """The backward of `key` has run: what its stash still counts is no longer its (storages still alive
        now, such as the microbatch's batch tensors, are someone else's)."""
        stash = self.live.pop(key)
        self.live_bytes -= stash.nbytes
        stash.close()

    def _freed(self, nbytes: int) -> None:
        """A storage counted by a live stash died (see `Stash`); peaks are noted where stashes grow."""
        self.live_bytes -= nbytes

    def begin_step(self) -> None:
        """The executor starts running a step's list (a store that serves a peer starts serving here)."""

    def end_step(self) -> None:
        """The executor has run the whole list (a store that serves a peer finishes serving here)."""

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes
        self.peak_count = self.resident_count

    @property
    def live_count(self) -> int:
        return len(self.live)

    @property
    def resident_count(self) -> int:
        """Stashes whose tensors occupy device memory (all live ones here; subclasses park some elsewhere)."""
        return len(self.live)

    def _note_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.peak_count = max(self.peak_count, self.resident_count)

    # Hooks: called by autograd ---------------------------------------------------------------------------
    def pack(self, t: torch.Tensor, stash: Stash):
        """Attribute `t` (saved by autograd inside `stash(key)`) to that stash; the peak is noted when the
        block ends, since nothing is released while a forward runs."""
        if storage_key(t) not in self._excluded:
            self.live_bytes += stash.add(t)
        return t

    def is_excluded(self, t: torch.Tensor) -> bool:
        """Whether `t`'s storage belongs to a parameter or buffer (never per-microbatch memory)."""
        return storage_key(t) in self._excluded

    def unpack(self, packed):
        return packed
