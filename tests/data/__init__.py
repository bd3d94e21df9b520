"""Tests of megatron_pp.data, and the tiny corpora they share."""
from __future__ import annotations

import json
import random
from typing import Sequence

import numpy as np

from megatron_pp.data.indexed import write_dataset

_WORDS = ("pipeline stage rank schedule forward backward activation memory offload evict reload "
          "gradient optimizer token sample epoch shard tensor layer weight buffer stream batch").split()


def sample_texts(count: int = 60, seed: int = 0) -> list[str]:
    """Small English-like documents with punctuation, digits, newlines and a little non-ASCII text."""
    rng = random.Random(seed)
    texts = []
    for i in range(count):
        sentences = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "."
                     for _ in range(rng.randint(1, 4))]
        accents = " Grüße, naïve café — ok." if i % 7 == 0 else ""
        texts.append(f"Document {i}: " + "\n".join(sentences) + accents)
    return texts


def write_jsonl(path: str, texts: Sequence[str], key: str = "text") -> None:
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({key: text}) + "\n")


def write_numbered_dataset(prefix: str, lengths: Sequence[int], dtype=np.int32, first: int = 0) -> list[np.ndarray]:
    """A dataset whose tokens are first, first + 1, ... in file order: each token names its document
    and offset."""
    starts = first + np.concatenate([[0], np.cumsum(lengths)])
    documents = [np.arange(starts[i], starts[i + 1], dtype=np.int64) for i in range(len(lengths))]
    write_dataset(prefix, documents, dtype)
    return documents
