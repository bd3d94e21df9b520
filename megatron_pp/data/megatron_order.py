"""Megatron-LM's sample order (`--data-order megatron`, the default): the same flags read the same samples
in the same order as Megatron-LM's GPT dataset, blend and batch sampler (megatron-core's
`megatron/core/datasets`), written here from its documented behaviour and checked against megatron-core
itself in tests/data/test_megatron_order.py.

One `numpy.random.RandomState(seed)` per split dataset, drawn from in this order:

1. document index: the split's document ids repeated for E epochs (E the smallest with
   E·tokens ≥ N·s + 1, N samples of s tokens) and shuffled together — except that when the last epoch
   would supply fewer than 80 % of an epoch's samples, the first E − 1 epochs are shuffled together and
   the last epoch apart, after them (so a short last epoch does not thin out every epoch's documents);
2. sample index: sample i starts at stream token i·s (one token shared with its neighbour, the label
   of the last input), stored as (position in the document index, offset); *all* (E·tokens − 1) // s
   samples of the E epochs are indexed, not only N;
3. shuffle index: the samples of the first E − 1 epochs (or of all E) shuffled, and with a separate last
   epoch that epoch's samples shuffled apart after them; uint32 below 2³² − 2 samples, else int64.

Worked example, s = 4, documents of 3, 5, 2 tokens (10 tokens an epoch), N = 4: N·s + 1 = 17 tokens
need E = 2 epochs; (2·10 − 1) // 4 = 4 samples; the first epoch alone gives (10 − 1) // 4 = 2, so the
last epoch supplies 2 ≥ int(0.8 · 2) = 1 samples: not separated, all 6 document positions are shuffled
together and all 4 samples are shuffled together.

A blend `--data-path W1 P1 W2 P2 ...` normalises the weights, builds dataset d with
ceil(ceil(N·w_d)·(1 + 0.005)) samples and a blend of Σ_d ceil(N·w_d) samples whose sample i comes
from the dataset with the largest error w_d·max(i, 1) − (samples taken from d so far), the first on ties
(no random numbers). Example, weights 0.25, 0.75: errors at i = 0 are 0.25, 0.75 → B; i = 1: 0.25,
−0.25 → A; i = 2: −0.5, 0.5 → B; i = 3: −0.25, 0.25 → B; i = 4: 0, 0 → A (tie: first) ...
Prefixes without weights are built for one epoch each, weighted by their sample counts, and the blend
holds min(N, Σ counts) samples.

`--split 969,30,1` is normalised, summed left to right into book-ends (0, .969), (.969, .999),
(.999, 1.0), and split k reads sequences [round(lo·n), round(hi·n)) of n; a zero share builds no split.
"""
from __future__ import annotations

import math
import re
from typing import Optional, Sequence

import numpy as np

# Each blend member is built with this fraction more samples than the blend takes from it (Megatron-LM's
# `mid_level_dataset_surplus` default), so a blend's rounding never runs a member dry.
BLEND_SURPLUS = 0.005
# A last epoch that would supply fewer than this fraction of an epoch's samples is shuffled apart.
SEPARATE_LAST_EPOCH_BELOW = 0.80


def normalise(values: Sequence[float]) -> list[float]:
    """values / their float64 sum, as Python floats (the arithmetic Megatron-LM's order depends on)."""
    array = np.asarray(values, dtype=np.float64)
    return (array / np.sum(array)).tolist()


def split_bounds(split: str, num_sequences: int) -> list[Optional[tuple[int, int]]]:
    """Sequence range of each of train, valid, test (None where the share is 0).

    Example: '969,30,1' over 1000 sequences → (0, 969), (969, 999), (999, 1000); '98,2' over 10 →
    (0, 10), (10, 10), None (round(9.8) = 10 leaves the valid range empty).
    """
    shares = [float(v) for v in re.findall(r"[.0-9]+", split)]
    shares += [0.0] * (3 - len(shares))
    shares = normalise(shares)
    edges = [0.0]
    for share in shares:
        edges.append(edges[-1] + share)
    bounds: list[Optional[tuple[int, int]]] = []
    for share, lo, hi in zip(shares, edges[:-1], edges[1:]):
        # A zero share has lo == hi: Megatron-LM builds no dataset for it.
        bounds.append(None if hi <= lo else (int(round(lo * num_sequences)), int(round(hi * num_sequences))))
    return bounds


def num_epochs(tokens_per_epoch: int, num_samples: Optional[int], seq_length: int) -> int:
    """The smallest E >= 1 with E·tokens_per_epoch >= num_samples·seq_length + 1 (1 for None)."""
    if num_samples is None:
        return 1
    needed = num_samples * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))


def _shuffled_epochs(documents: np.ndarray, epochs: int, rng: np.random.RandomState) -> np.ndarray:
    index = np.tile(documents.astype(np.int32), epochs)
    rng.shuffle(index)
    return index


def _shuffled_range(lo: int, hi: int, dtype: type, rng: np.random.RandomState) -> np.ndarray:
    index = np.arange(lo, hi, dtype=dtype)
    rng.shuffle(index)
    return index


def sample_positions(lengths: np.ndarray, document_index: np.ndarray, seq_length: int,
                     num_samples: int) -> np.ndarray:
    """[num_samples + 1, 2] (document position, offset) of stream tokens 0, s, 2s, ...: row i starts
    sample i and holds the last token of sample i − 1. Empty documents are skipped (a token lies in the
    first document ending after it)."""
    ends = np.cumsum(lengths[document_index], dtype=np.int64)
    first_tokens = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    positions = np.searchsorted(ends, first_tokens, side="right")
    offsets = first_tokens - (ends[positions] - lengths[document_index[positions]])
    # Megatron-LM's width: int32 while every document position and document length fits.
    wide = max(len(document_index), int(lengths.max())) > np.iinfo(np.int32).max
    return np.stack([positions, offsets], axis=1).astype(np.int64 if wide else np.int32)


def build_indices(lengths: np.ndarray, documents: np.ndarray, num_samples: Optional[int], seq_length: int,
                  seed: int) -> dict[str, np.ndarray]:
    """Document, sample and shuffle index (module doc) of the split `documents` (sequence ids into
    `lengths`, the whole dataset's sequence lengths) for `num_samples` samples (None: one epoch).

    The document index holds sequence ids (not positions in the split), as Megatron-LM's does.
    """
    lengths = np.asarray(lengths)
    documents = np.asarray(documents)
    tokens_per_epoch = int(lengths[documents].sum(dtype=np.int64))
    if tokens_per_epoch < 2 or seq_length < 1:
        raise ValueError(f"a split needs >= 2 tokens and seq_length >= 1 (got {tokens_per_epoch} tokens, "
                         f"seq_length {seq_length})")
    epochs = num_epochs(tokens_per_epoch, num_samples, seq_length)
    separate_last = False
    samples_before_last = 0
    if epochs > 1:
        samples_before_last = ((epochs - 1) * tokens_per_epoch - 1) // seq_length
        samples_per_epoch = (tokens_per_epoch - 1) // seq_length
        assert num_samples is not None
        separate_last = num_samples - samples_before_last < int(SEPARATE_LAST_EPOCH_BELOW * samples_per_epoch)
    rng = np.random.RandomState(seed)
    if separate_last:
        document_index = np.concatenate([_shuffled_epochs(documents, epochs - 1, rng),
                                         _shuffled_epochs(documents, 1, rng)])
    else:
        document_index = _shuffled_epochs(documents, epochs, rng)
    total = (epochs * tokens_per_epoch - 1) // seq_length
    sample_index = sample_positions(lengths, document_index, seq_length, total)
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    if separate_last:
        shuffle_index = np.concatenate([_shuffled_range(0, samples_before_last, dtype, rng),
                                        _shuffled_range(samples_before_last, total, dtype, rng)])
    else:
        shuffle_index = _shuffled_range(0, total, dtype, rng)
    return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}


def blend_sizes(weights: Sequence[float], num_samples: int) -> tuple[list[int], list[int]]:
    """(samples the blend takes from each dataset, samples each dataset is built with).

    Example: weights 0.3, 0.7 of 1000 samples → taken 300, 700; built 302, 704 (ceil(300·1.005) = 302).
    """
    weights = normalise(weights)
    taken = [int(math.ceil(num_samples * w)) for w in weights]
    built = [int(math.ceil(t * (1 + BLEND_SURPLUS))) for t in taken]
    return taken, built


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset of each blended sample, int16; its number within that dataset, int64): the greedy
    largest-error choice of the module doc, over the normalised `weights`.

    A plain Python loop over the samples (megatron-core's is C++): slow for very large blends, but it runs
    once, on the builder rank, and is cached.
    """
    w = normalise(weights)
    if len(w) >= 2**15:
        raise ValueError(f"a blend holds at most 32767 datasets, got {len(w)}")
    # Python lists and floats (IEEE doubles, the same products and differences as a C++ loop), converted
    # once at the end: writing numpy elements one at a time costs more than the choice itself.
    taken = [0] * len(w)
    chosen = [0] * size
    numbers = [0] * size
    others = list(enumerate(w))[1:]
    for i in range(size):
        scale = float(max(i, 1))
        best, best_error = 0, w[0] * scale - taken[0]
        for d, weight in others:
            error = weight * scale - taken[d]
            if error > best_error:
                best, best_error = d, error
        chosen[i] = best
        numbers[i] = taken[best]
        taken[best] += 1
    dataset_index = np.array(chosen, dtype=np.int16)
    dataset_sample_index = np.array(numbers, dtype=np.int64)
    return dataset_index, dataset_sample_index
