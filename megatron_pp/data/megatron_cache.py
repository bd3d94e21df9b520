"""Megatron-LM's own index cache, read where it holds what these flags give.

Megatron-LM names its cached index files `{md5 of a description}-{GPTDataset|BlendedDataset}-{split}-
{array}.npy` beside a `...-description.txt` holding that description as JSON (the dataset path, split,
sample count, seed, sequence length, ...). The hash covers absolute paths and megatron-core's own config
fields, so we do not recompute it; instead, given the same `--data-cache-path`, we read each description
file in the directory and pick the one describing the dataset, split, sample count, seed and sequence
length we are building. Its arrays are then compared with ours (built or loaded from our own cache, which
stays keyed by content): identical, they are what the run reads; different, the run stops with one line
naming the file (a cache made for other flags or by another version) rather than train on either silently.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Callable, Optional, Sequence

import numpy as np


class CacheMismatch(ValueError):
    """A cached index that claims these flags but holds other arrays. Exit status 2 (a usage error:
    the user gave a cache directory that does not fit the flags)."""

    exit_status = 2


def _descriptions(directory: str, class_name: str, split_name: str) -> list[tuple[str, dict]]:
    found = []
    for path in sorted(glob.glob(os.path.join(glob.escape(directory), f"*-{class_name}-{split_name}-description.txt"))):
        try:
            with open(path) as f:
                found.append((path, json.load(f)))
        except (OSError, ValueError):
            continue  # not a Megatron-LM description: not ours to judge
    return found


def _same_dataset(description_path: Optional[str], prefix: str) -> bool:
    return description_path is not None and os.path.basename(description_path) == os.path.basename(prefix)


def gpt_matcher(prefix: str, num_samples: Optional[int], seed: int, seq_length: int) -> Callable[[dict], bool]:
    """Whether a GPTDataset description is the one of `prefix`'s split for these numbers."""
    def match(d: dict) -> bool:
        return (_same_dataset(d.get("dataset_path"), prefix) and d.get("num_samples") == num_samples
                and d.get("random_seed") == seed and d.get("sequence_length") == seq_length
                and d.get("add_extra_token_to_sequence", True) is True)
    return match


def blend_matcher(prefixes: Sequence[str], size: int) -> Callable[[dict], bool]:
    """Whether a BlendedDataset description blends `prefixes` (in order) into `size` samples."""
    def match(d: dict) -> bool:
        members = d.get("datasets") or []
        return (d.get("size") == size and len(members) == len(prefixes)
                and all(isinstance(m, dict) and _same_dataset(m.get("dataset_path"), p)
                        for m, p in zip(members, prefixes)))
    return match


def use_megatron_cache(directory: Optional[str], class_name: str, split_name: str, match: Callable[[dict], bool],
                       ours: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Megatron-LM's cached arrays for these flags when `directory` holds them and they equal `ours`;
    `ours` when it holds none; CacheMismatch naming the file when they differ."""
    if directory is None or not os.path.isdir(directory):
        return ours
    for description_path, description in _descriptions(directory, class_name, split_name):
        if not match(description):
            continue
        stem = description_path[: -len("description.txt")]
        theirs = {}
        for name, array in ours.items():
            path = stem + f"{name}.npy"
            try:
                theirs[name] = np.load(path, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError) as exc:
                raise CacheMismatch(f"{path}: Megatron-LM's cached {name} for these flags is unreadable "
                                    f"({exc}); remove it or give another --data-cache-path") from None
            if theirs[name].shape != array.shape or not np.array_equal(theirs[name], array):
                raise CacheMismatch(
                    f"{path}: Megatron-LM's cached {name} for this {split_name} split differs from the one "
                    f"these flags give (made by another version or for other --split/--data-path); remove "
                    f"it or give another --data-cache-path")
        return theirs
    return ours
