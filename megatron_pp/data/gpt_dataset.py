"""GPT pretraining samples: fixed windows of `seq_length + 1` tokens over a shuffled document stream.

A split of an indexed dataset is a contiguous range of its sequences ("documents" here, as in
Megatron's GPT dataset). Three index arrays turn it into samples:

- document index: each epoch is a fresh permutation of the split's documents; epochs are concatenated
  until the stream holds enough tokens for the requested number of samples.
- sample index: sample i covers stream tokens [i·s, i·s + s] (s = seq_length; one token of overlap
  with the next sample, the label of its last input), stored as (document position, offset) of its
  first token. Worked example, s = 4, documents of 3, 5 and 2 tokens in stream order A B C:

      stream   A0 A1 A2 B0 B1 B2 B3 B4 C0 C1
      sample 0 A0 A1 A2 B0 B1         start (0, 0)
      sample 1             B1 B2 B3 B4 C0   start (1, 1)
      the 10-token stream gives 2 samples: a third would need token 12

- shuffle index: a permutation of the samples *within each epoch*, so all samples of epoch e come
  before those of epoch e + 1 and every token of the split is read once per epoch.

The arrays depend only on (split's sequence lengths, seq_length, seed, number of samples), are built
once by the builder rank and stored under a key hashed from exactly those inputs (`IndexCache`): a
second run, another rank or a changed dataset finds the right files or builds new ones, never stale.

`get_batch` returns Megatron's batch: tokens, labels, loss_mask (0 where the *input* token is EOD
with `--eod-mask-loss`), position_ids (restarting at 0 after each EOD with `--reset-position-ids`), and
with `--reset-attention-mask` the document boundaries as `cu_seqlens` over the flattened batch.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from megatron_pp.data import megatron_order
from megatron_pp.data.indexed import IndexedDataset, apply_umask
from megatron_pp.data.megatron_cache import CacheMismatch, gpt_matcher, use_megatron_cache

# Bump when the index construction changes: old caches are then ignored (their key differs).
INDEX_VERSION = 1
# `--data-order`: Megatron-LM's sample order (megatron_order.py), or every token once per epoch (below).
DATA_ORDERS = ("megatron", "epoch-exact")


class DataFlagError(ValueError):
    """Data flags that cannot build the run's splits (a --split leaving a needed split without tokens, too few
    samples for the run): a usage error, exit status 2, raised before any training."""

    exit_status = 2


@dataclass(frozen=True)
class BatchOptions:
    """How samples become a batch (Megatron's `--eod-mask-loss` and reset flags)."""

    eod: int
    """End-of-document token id."""
    eod_mask_loss: bool = False
    """No loss at positions whose input token is EOD (predicting across a document boundary)."""
    reset_position_ids: bool = False
    """Position ids restart at 0 at the token after each EOD."""
    reset_attention_mask: bool = False
    """Tokens attend only within their document: the batch carries `cu_seqlens` and `max_seqlen`."""


def make_batch(samples: np.ndarray, options: BatchOptions, device: torch.device | str = "cpu") -> dict:
    """The batch dict of `samples` ([b, s + 1] token ids); see the module doc for the fields.

    Example, s = 6, EOD = 0, sample [5 6 0 7 8 0 9]: tokens [5 6 0 7 8 0], labels [6 0 7 8 0 9],
    loss_mask with --eod-mask-loss [1 1 0 1 1 0], reset position_ids [0 1 2 0 1 2], cu_seqlens
    [0 3 6] (a boundary after each EOD and at every sample start).
    """
    samples = np.asarray(samples, dtype=np.int64)
    tokens = np.ascontiguousarray(samples[:, :-1])
    labels = np.ascontiguousarray(samples[:, 1:])
    b, s = tokens.shape
    loss_mask = np.ones((b, s), dtype=np.float32)
    if options.eod_mask_loss:
        loss_mask[tokens == options.eod] = 0.0
    positions = np.tile(np.arange(s, dtype=np.int64), (b, 1))  # writable: torch warns on read-only arrays
    after_eod = np.zeros((b, s), dtype=bool)
    after_eod[:, 1:] = tokens[:, :-1] == options.eod
    if options.reset_position_ids:
        # Each position minus the start of its document, the latest "just after an EOD" position.
        starts = np.where(after_eod, positions, 0)
        positions = positions - np.maximum.accumulate(starts, axis=1)
    batch = {
        "tokens": torch.from_numpy(tokens).to(device),
        "labels": torch.from_numpy(labels).to(device),
        "loss_mask": torch.from_numpy(loss_mask).to(device),
        "position_ids": torch.from_numpy(positions).to(device),
    }
    if options.reset_attention_mask:
        rows, cols = np.nonzero(after_eod)
        bounds = np.unique(np.concatenate([np.arange(b + 1, dtype=np.int64) * s, rows * s + cols]))
        batch["cu_seqlens"] = torch.from_numpy(bounds.astype(np.int32)).to(device)
        batch["max_seqlen"] = int(np.diff(bounds).max())
    return batch


class IndexCache:
    """Index arrays stored as `.npy` files in `directory`, named by a hash of what determines them.

    `load_or_build` is called by every rank in the same order: the builder rank writes missing arrays
    (each file atomically, the description file last as the "complete" mark), then all ranks meet at
    `barrier` and load the arrays memory-mapped.
    """

    def __init__(self, directory: str, is_builder: bool = True, barrier: Optional[Callable[[], None]] = None) -> None:
        self.directory = directory
        self.is_builder = is_builder
        self.barrier = barrier

    def _paths(self, name: str, key: str, arrays: Sequence[str]) -> tuple[str, dict[str, str]]:
        stem = os.path.join(self.directory, f"{name}-{key}")
        return stem + ".json", {a: f"{stem}-{a}.npy" for a in arrays}

    def load_or_build(self, name: str, description: dict, arrays: Sequence[str],
                      build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        key = hashlib.blake2b(json.dumps(description, sort_keys=True).encode(), digest_size=8).hexdigest()
        done_path, paths = self._paths(name, key, arrays)
        if self.is_builder and not os.path.exists(done_path):
            try:
                os.makedirs(self.directory, exist_ok=True)
                built = build()
                for array in arrays:
                    _atomic_write(paths[array], lambda f, a=built[array]: np.save(f, a))
                _atomic_write(done_path, lambda f: f.write(json.dumps(description, indent=1, sort_keys=True).encode()))
            except OSError as exc:
                raise OSError(f"cannot write the data index cache in {self.directory} ({exc.strerror}); "
                              f"choose a writable directory with --data-cache-path") from None
        if self.barrier is not None:
            self.barrier()
        if not os.path.exists(done_path):
            raise FileNotFoundError(
                f"data index cache {done_path} is missing after the builder rank's turn: --data-cache-path "
                f"must be a directory every rank sees (a shared filesystem)"
            )
        _check_description(done_path, description)
        return {array: np.load(paths[array], mmap_mode="r") for array in arrays}


def _check_description(path: str, description: dict) -> None:
    """The cached arrays under `path`'s key must be the ones made for `description`: a file copied in from
    another cache or edited by hand would otherwise feed other samples silently."""
    try:
        with open(path) as f:
            stored = json.load(f)
    except (OSError, ValueError) as exc:
        raise CacheMismatch(f"{path}: unreadable data index description ({exc}); remove it") from None
    if stored != json.loads(json.dumps(description)):
        raise CacheMismatch(f"{path}: this cached data index was made for other flags or data than its name says; "
                            f"remove it or give another --data-cache-path")


def _atomic_write(path: str, write: Callable) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        apply_umask(tmp)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _epoch_sample_starts(tokens_per_epoch: int, num_epochs: int, seq_length: int, num_samples: int) -> np.ndarray:
    """First sample of each epoch, plus the end: sample i lies in the epoch holding stream token i·s."""
    starts = -(-np.arange(num_epochs + 1, dtype=np.int64) * tokens_per_epoch // seq_length)
    return np.minimum(starts, num_samples)


def document_id_dtype(num_documents: int) -> type:
    """The narrowest of int32 and int64 that holds every document id, 0 .. num_documents - 1 (the
    document index has one entry per document per epoch, so its width is most of its size)."""
    return np.int32 if num_documents - 1 <= np.iinfo(np.int32).max else np.int64


def build_sample_index(lengths: np.ndarray, num_samples: int, seq_length: int, seed: int) -> dict[str, np.ndarray]:
    """Document, sample and shuffle indices (see the module doc) for documents of `lengths` tokens.

    `document_index` holds positions into `lengths`; `sample_index` has num_samples + 1 rows of
    (position in document_index, token offset): row i + 1 is where sample i's last token lies.
    """
    if num_samples < 1 or seq_length < 1:
        raise ValueError(f"need num_samples >= 1 and seq_length >= 1, got {num_samples} and {seq_length}")
    lengths = np.asarray(lengths, dtype=np.int64)
    tokens_per_epoch = int(lengths.sum())
    if tokens_per_epoch == 0:
        raise ValueError("the split has no tokens")
    needed = num_samples * seq_length + 1
    num_epochs = -(-needed // tokens_per_epoch)
    rng = np.random.default_rng(seed)
    id_dtype = document_id_dtype(len(lengths))
    document_index = np.concatenate(
        [rng.permutation(len(lengths)).astype(id_dtype) for _ in range(num_epochs)]
    )
    ends = np.cumsum(lengths[document_index])
    first_tokens = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # side="right" skips empty documents: the document holding token t is the first one ending after t.
    positions = np.searchsorted(ends, first_tokens, side="right")
    offsets = first_tokens - (ends[positions] - lengths[document_index[positions]])
    sample_index = np.stack([positions, offsets], axis=1)
    starts = _epoch_sample_starts(tokens_per_epoch, num_epochs, seq_length, num_samples)
    shuffle_index = np.concatenate(
        [lo + rng.permutation(hi - lo) for lo, hi in zip(starts[:-1].tolist(), starts[1:].tolist())]
    )
    return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}


def _lengths_digest(lengths: np.ndarray) -> str:
    """Hash of a length array: the part of a dataset's content the indices depend on."""
    return hashlib.blake2b(np.ascontiguousarray(lengths, dtype="<i4").tobytes(), digest_size=16).hexdigest()


class GPTDataset:
    """`num_samples` samples of `seq_length + 1` tokens from sequences [start, stop) of `indexed`."""

    ARRAYS = ("document_index", "sample_index", "shuffle_index")

    def __init__(self, indexed: IndexedDataset, document_range: tuple[int, int], num_samples: Optional[int], *,
                 seq_length: int, seed: int, options: BatchOptions, cache: IndexCache, split_name: str,
                 order: str = "epoch-exact") -> None:
        start, stop = document_range
        if not 0 <= start < stop <= len(indexed):
            raise ValueError(f"document range [{start}, {stop}) is empty or outside {indexed.prefix} "
                             f"({len(indexed)} sequences)")
        if order not in DATA_ORDERS:
            raise ValueError(f"--data-order {order!r}: choose one of {', '.join(DATA_ORDERS)}")
        self.indexed = indexed
        self.start, self.stop = start, stop
        self.seq_length = seq_length
        self.options = options
        self.order = order
        lengths = indexed.sequence_lengths[start:stop]
        # Checked here, on every rank, rather than only in the builder: a builder that failed would
        # leave the other ranks waiting at the barrier forever.
        if num_samples is not None and num_samples < 1 or num_samples is None and order != "megatron":
            raise ValueError(f"{indexed.prefix} [{start}, {stop}): num_samples must be >= 1, got {num_samples}")
        if not lengths.any():
            raise ValueError(f"{indexed.prefix}: documents [{start}, {stop}) hold no tokens")
        description = {
            "kind": "gpt", "version": INDEX_VERSION, "dataset": os.path.basename(indexed.prefix),
            "lengths": _lengths_digest(lengths), "document_range": [start, stop], "num_samples": num_samples,
            "seq_length": seq_length, "seed": seed,
        }
        if order == "megatron":
            # Megatron-LM's document index holds sequence ids of the whole file: the digest covers them all.
            description.update(order="megatron", lengths=_lengths_digest(indexed.sequence_lengths))
            build = lambda: megatron_order.build_indices(indexed.sequence_lengths, np.arange(start, stop),
                                                         num_samples, seq_length, seed)
        else:
            build = lambda: build_sample_index(lengths, num_samples, seq_length, seed)
        arrays = cache.load_or_build(f"{os.path.basename(indexed.prefix)}-{split_name}", description, self.ARRAYS,
                                     build)
        if order == "megatron":
            arrays = use_megatron_cache(cache.directory, "GPTDataset", split_name,
                                        gpt_matcher(indexed.prefix, num_samples, seed, seq_length), arrays)
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]
        # Megatron-LM's dataset exposes every sample its epochs hold (a blend member or a resumed run may
        # read past the count asked for); its document index holds sequence ids, ours positions in the split.
        self.num_samples = len(self.shuffle_index) if order == "megatron" else num_samples
        self._first_document = 0 if order == "megatron" else start

    def __len__(self) -> int:
        return self.num_samples

    def sample(self, index: int) -> np.ndarray:
        """The `seq_length + 1` token ids (int64) of sample `index`."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range ({self.num_samples} samples)")
        raw = int(self.shuffle_index[index])
        first_pos, first_off = (int(v) for v in self.sample_index[raw])
        last_pos, last_off = (int(v) for v in self.sample_index[raw + 1])
        if first_pos == last_pos:
            pieces = [self.indexed.get(self._document(first_pos), first_off, last_off - first_off + 1)]
        else:
            pieces = [self.indexed.get(self._document(first_pos), first_off)]
            pieces += [self.indexed.get(self._document(p)) for p in range(first_pos + 1, last_pos)]
            pieces.append(self.indexed.get(self._document(last_pos), 0, last_off + 1))
        return np.concatenate(pieces).astype(np.int64)

    def _document(self, position: int) -> int:
        return self._first_document + int(self.document_index[position])

    def get_batch(self, sample_indices: Sequence[int], device: torch.device | str = "cpu") -> dict:
        return make_batch(np.stack([self.sample(i) for i in sample_indices]), self.options, device)
