"""Blending: exact weighted sampling, Megatron's --data-path list forms, the blended dataset."""
from __future__ import annotations

import numpy as np
import pytest

from megatron_pp.data.blend import BlendedDataset, blend_index, cached_blend_index, parse_blend
from megatron_pp.data.builder import DataConfig, build_datasets
from megatron_pp.data.gpt_dataset import IndexCache
from tests.data import write_numbered_dataset


def test_quarter_three_quarters_over_10000_samples_is_exact_and_deterministic():
    datasets, numbers = blend_index([0.25, 0.75], 10_000)
    counts = np.bincount(datasets, minlength=2)
    assert abs(counts[0] / 10_000 - 0.25) < 0.01 and abs(counts[1] / 10_000 - 0.75) < 0.01
    assert counts.tolist() == [2500, 7500]
    # Not only at the end: after every prefix of n samples each dataset is within one sample of w·n.
    running = np.cumsum(np.eye(2, dtype=np.int64)[datasets], axis=0)
    n = np.arange(1, 10_001)[:, None]
    assert np.abs(running - n * np.array([0.25, 0.75])).max() <= 1.0
    # Each dataset's samples are drawn in order 0, 1, 2, ... with none skipped.
    for d in range(2):
        assert numbers[datasets == d].tolist() == list(range(counts[d]))
    again = blend_index([0.25, 0.75], 10_000)
    np.testing.assert_array_equal(datasets, again[0])
    np.testing.assert_array_equal(numbers, again[1])


def test_documented_order_for_a_quarter_and_three_quarters():
    datasets, _ = blend_index([1, 3], 9)  # weights are normalised
    assert "".join("AB"[d] for d in datasets) == "BABBBABBB"


def test_zero_weight_and_three_way_blend():
    datasets, _ = blend_index([0.5, 0.0, 0.3, 0.2], 1000)
    assert np.bincount(datasets, minlength=4).tolist() == [500, 0, 300, 200]
    with pytest.raises(ValueError, match="not all 0"):
        blend_index([0, 0], 10)


def test_blend_index_is_cached(tmp_path):
    cache = IndexCache(str(tmp_path))
    first = cached_blend_index([0.4, 0.6], 500, cache, "blend-train")
    assert len(list(tmp_path.iterdir())) == 3
    second = cached_blend_index([0.4, 0.6], 500, cache, "blend-train")
    np.testing.assert_array_equal(first[0], second[0])
    assert len(list(tmp_path.iterdir())) == 3


@pytest.mark.parametrize(
    "values, expected",
    [
        (["data/a"], (["data/a"], None)),
        (["0.3", "a", "0.7", "b"], (["a", "b"], [0.3, 0.7])),
        (["1", "a", "3", "b"], (["a", "b"], [0.25, 0.75])),
        (["a", "b"], (["a", "b"], None)),
    ],
)
def test_parse_blend_forms(values, expected):
    assert parse_blend(values) == expected


@pytest.mark.parametrize(
    "values, message",
    [
        ([], "--data-path is empty"),
        (["0.3", "a", "b"], "3 values; give WEIGHT PREFIX pairs"),
        (["0.3", "a", "x", "b"], "weight 'x' \\(before b\\) is not a number"),
        (["-1", "a", "2", "b"], "weight -1 of a must be a finite number >= 0"),
        (["0", "a", "0", "b"], "the weights sum to 0"),
        (["a", "0.5", "b"], "'0.5' looks like a weight"),
        (["0.5", "0.5"], "'0.5' stands where a dataset prefix belongs"),
    ],
)
def test_parse_blend_errors_name_the_flag(values, message):
    with pytest.raises(ValueError, match="--data-path: " + message if values else message):
        parse_blend(values)


def test_blended_dataset_draws_samples_from_the_weighted_datasets(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_numbered_dataset(a, [20] * 10)  # tokens 0..199
    write_numbered_dataset(b, [20] * 10, first=1000)  # tokens 1000..1199
    config = DataConfig(seq_length=8, data_path=["0.25", a, "0.75", b], split="1,0,0", cache_dir=str(tmp_path / "c"),
                        data_order="epoch-exact")
    train, valid, test = build_datasets(config, (400, 0, 0), eod_id=-1)
    assert valid is None and test is None
    assert isinstance(train, BlendedDataset) and len(train) == 400
    assert [len(d) for d in train.datasets] == [100, 300]
    from_b = [bool(train.sample(i)[0] >= 1000) for i in range(len(train))]
    assert sum(from_b) == 300
    assert from_b[:4] == [True, False, True, True]
    batch = train.get_batch([0, 1])
    assert batch["tokens"][0].min() >= 1000 and batch["tokens"][1].max() < 200
