"""Blending datasets by weight: `--data-path 0.3 prefixA 0.7 prefixB`.

`parse_blend` reads Megatron's list forms: `[prefix]`, `[w1, prefix1, w2, prefix2, ...]` or
`[prefix1, prefix2, ...]` (the builder then weights each by its token count). Weights are
normalised.

`blend_index` assigns each of the blend's samples to a dataset deterministically, with no sampling
noise: dataset d's k-th sample is due at time (k + ½) / w_d and samples are taken in order of due
time (ties to the lower dataset). After any n samples, dataset d has contributed w_d·n of them to
within one sample per dataset. Example, weights (0.25, 0.75): due times are A 2, 6, 10, … and
B ⅔, 2, 3⅓, 4⅔, 6, …, so the order is B A B B B A B B … (A, B, B, B repeating from the 2nd sample).
The index is cached like the GPT indices, and each dataset is then built with exactly the number of
samples the blend draws from it.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import torch

from megatron_pp.data import megatron_order
from megatron_pp.data.gpt_dataset import GPTDataset, IndexCache, make_batch
from megatron_pp.data.megatron_cache import blend_matcher, use_megatron_cache

# Bump when blend_index changes: cached blend indices are then rebuilt.
BLEND_VERSION = 1


def _as_weight(value: str) -> Optional[float]:
    try:
        return float(value)
    except ValueError:
        return None


def parse_blend(values: Sequence[str], flag: str = "--data-path") -> tuple[list[str], Optional[list[float]]]:
    """(prefixes, normalised weights or None) from a Megatron blend list; ValueError naming `flag`."""
    values = list(values)
    if not values:
        raise ValueError(f"{flag} is empty")
    if _as_weight(values[0]) is None:
        looks_like_weight = [v for v in values if _as_weight(v) is not None]
        if looks_like_weight:
            raise ValueError(f"{flag}: {looks_like_weight[0]!r} looks like a weight, but the list does not start with "
                             f"one; give WEIGHT PREFIX pairs or prefixes only")
        return values, None
    if len(values) % 2:
        raise ValueError(f"{flag}: {len(values)} values; give WEIGHT PREFIX pairs (w1 prefix1 w2 prefix2 ...)")
    weights, prefixes = values[0::2], values[1::2]
    parsed = []
    for weight, prefix in zip(weights, prefixes):
        w = _as_weight(weight)
        if w is None:
            raise ValueError(f"{flag}: weight {weight!r} (before {prefix}) is not a number")
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"{flag}: weight {weight} of {prefix} must be a finite number >= 0")
        if _as_weight(prefix) is not None:
            raise ValueError(f"{flag}: {prefix!r} stands where a dataset prefix belongs (after weight {weight})")
        parsed.append(w)
    total = sum(parsed)
    if total <= 0:
        raise ValueError(f"{flag}: the weights sum to 0")
    return prefixes, [w / total for w in parsed]


def blend_index(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset of each sample, that dataset's sample number) for `num_samples` blended samples."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or not len(w) or np.any(w < 0) or not np.isfinite(w).all() or w.sum() <= 0:
        raise ValueError(f"blend weights must be finite, >= 0 and not all 0, got {list(weights)}")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    w = w / w.sum()
    times, datasets, numbers = [], [], []
    for d, weight in enumerate(w.tolist()):
        if weight == 0:
            continue
        # The n-th due time overall is at most n + (number of datasets)/2, so this many per dataset
        # always covers the first num_samples picks.
        count = math.ceil(weight * (num_samples + len(w))) + 1
        k = np.arange(count, dtype=np.int64)
        times.append((k + 0.5) / weight)
        datasets.append(np.full(count, d, dtype=np.int16 if len(w) < 2**15 else np.int32))
        numbers.append(k)
    all_times, all_datasets, all_numbers = (np.concatenate(a) for a in (times, datasets, numbers))
    order = np.lexsort((all_datasets, all_times))[:num_samples]
    return all_datasets[order], all_numbers[order]


def cached_blend_index(weights: Sequence[float], num_samples: int, cache: IndexCache,
                       name: str) -> tuple[np.ndarray, np.ndarray]:
    """`blend_index`, built once by the builder rank and loaded from `cache` by all."""
    description = {"kind": "blend", "version": BLEND_VERSION, "weights": [float(w) for w in weights],
                   "num_samples": num_samples}
    arrays = cache.load_or_build(
        name, description, ("dataset_index", "dataset_sample_index"),
        lambda: dict(zip(("dataset_index", "dataset_sample_index"), blend_index(weights, num_samples))),
    )
    return arrays["dataset_index"], arrays["dataset_sample_index"]


def cached_megatron_blend(weights: Sequence[float], size: int, cache: IndexCache, name: str,
                          prefixes: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Megatron-LM's greedy blend (`megatron_order.blending_indices`) of `size` samples, built once by the
    builder rank; Megatron-LM's own cached blend for the same datasets and size is used when identical."""
    description = {"kind": "blend", "order": "megatron", "version": BLEND_VERSION,
                   "weights": [float(w) for w in weights], "size": size}
    arrays = cache.load_or_build(
        name, description, ("dataset_index", "dataset_sample_index"),
        lambda: dict(zip(("dataset_index", "dataset_sample_index"), megatron_order.blending_indices(weights, size))),
    )
    split_name = name.removeprefix("blend-")
    arrays = use_megatron_cache(cache.directory, "BlendedDataset", split_name, blend_matcher(prefixes, size), arrays)
    return arrays["dataset_index"], arrays["dataset_sample_index"]


class BlendedDataset:
    """Sample i is sample `dataset_sample_index[i]` of `datasets[dataset_index[i]]`."""

    def __init__(self, datasets: Sequence[GPTDataset], dataset_index: np.ndarray,
                 dataset_sample_index: np.ndarray) -> None:
        if len({(d.seq_length, d.options) for d in datasets}) != 1:
            raise ValueError("blended datasets must share seq_length and batch options")
        if len(dataset_index) != len(dataset_sample_index):
            raise ValueError("dataset_index and dataset_sample_index differ in length")
        self.datasets = list(datasets)
        self.dataset_index = dataset_index
        self.dataset_sample_index = dataset_sample_index

    def __len__(self) -> int:
        return len(self.dataset_index)

    def sample(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range ({len(self)} samples)")
        return self.datasets[int(self.dataset_index[index])].sample(int(self.dataset_sample_index[index]))

    def get_batch(self, sample_indices: Sequence[int], device: torch.device | str = "cpu") -> dict:
        return make_batch(np.stack([self.sample(i) for i in sample_indices]), self.datasets[0].options, device)
