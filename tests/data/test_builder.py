"""DataConfig flags, check_data_args (no data read) and build_datasets' splits."""
from __future__ import annotations

import argparse
import dataclasses
import os

import numpy as np
import pytest

from megatron_pp.data.blend import BlendedDataset
from megatron_pp.data.builder import (
    DataConfig,
    add_data_args,
    build_datasets,
    check_data_args,
    data_config_from_args,
    parse_split,
    split_ranges,
)
from megatron_pp.data.gpt_dataset import GPTDataset
from tests.data import write_numbered_dataset


@pytest.fixture
def prefix(tmp_path):
    path = str(tmp_path / "corpus_text_document")
    write_numbered_dataset(path, [10 + i % 7 for i in range(100)])  # 100 documents, tokens 0..1293
    return path


def _null_tokenizer(**kwargs) -> dict:
    return dict(tokenizer_type="NullTokenizer", vocab_size=5000, **kwargs)


def test_parse_split_and_ranges():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_split("98/2") == pytest.approx([0.98, 0.02, 0.0])
    assert split_ranges(1000, parse_split("969,30,1")) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges(100, parse_split("969,30,1")) == [(0, 97), (97, 100), (100, 100)]
    assert split_ranges(7, parse_split("1,1,1")) == [(0, 2), (2, 5), (5, 7)]
    for bad, message in [("9,a,1", "'a' is not a number"), ("1,2,3,4", "1 to 3"), ("0,0", "sum to 0"),
                         ("1,-1,1", "finite and >= 0")]:
        with pytest.raises(ValueError, match=f"--split '{bad}': .*{message}"):
            parse_split(bad)


def test_check_data_args_finds_every_problem_without_reading_data(tmp_path, prefix):
    garbage = str(tmp_path / "garbage")
    for suffix in (".bin", ".idx"):
        open(garbage + suffix, "w").write("not a dataset")  # existence is all that is checked
    config = DataConfig(seq_length=16, data_path=["0.5", prefix, "0.5", garbage], **_null_tokenizer())
    assert check_data_args(config) == []

    config = DataConfig(seq_length=0, data_path=["0.5", prefix, "x", str(tmp_path / "nope")], split="1,2,a",
                        tokenizer_type="GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"))
    errors = check_data_args(config)
    assert errors == [
        f"--data-path: weight 'x' (before {tmp_path / 'nope'}) is not a number",
        "--split '1,2,a': 'a' is not a number",
        "--seq-length must be >= 1, got 0",
        f"--vocab-file {tmp_path / 'vocab.json'}: no such file",
        "--tokenizer-type GPT2BPETokenizer needs --merge-file (merges.txt)",
    ]


def test_check_data_args_names_missing_files_and_flags(tmp_path, prefix):
    missing = str(tmp_path / "missing")
    config = DataConfig(seq_length=8, train_data_path=[prefix], valid_data_path=[missing],
                        test_data_path=[prefix + ".bin"], **_null_tokenizer())
    assert check_data_args(config) == [
        f"--valid-data-path: {missing}.bin: no such file",
        f"--test-data-path: {prefix}.bin is a data file; give the prefix without .bin/.idx",
    ]
    both = DataConfig(seq_length=8, data_path=[prefix], train_data_path=[prefix], **_null_tokenizer())
    assert check_data_args(both) == ["--data-path and --train-data-path are mutually exclusive"]
    nothing = DataConfig(seq_length=8, **_null_tokenizer())
    assert check_data_args(nothing)[0].startswith("no data: give --data-path")
    assert check_data_args(DataConfig(seq_length=8, data_path=[prefix])) == [
        "--tokenizer-type is required with file datasets (one of GPT2BPETokenizer, SentencePieceTokenizer, "
        "HuggingFaceTokenizer, NullTokenizer)"
    ]


def test_mock_data_needs_nothing_but_still_checks_what_is_given(tmp_path):
    assert check_data_args(DataConfig(seq_length=8), mock_data=True) == []
    config = DataConfig(seq_length=8, data_path=[str(tmp_path / "typo")], tokenizer_type="SentencePieceTokenizer",
                        tokenizer_model=str(tmp_path / "tok.model"))
    assert check_data_args(config, mock_data=True) == [
        f"--data-path: {tmp_path / 'typo'}.bin: no such file",
        f"--tokenizer-model {tmp_path / 'tok.model'}: no such file",
    ]


def test_split_of_one_dataset(prefix, tmp_path):
    config = DataConfig(seq_length=8, data_path=[prefix], split="90,10,0", cache_dir=str(tmp_path / "cache"),
                        data_order="epoch-exact")
    train, valid, test = build_datasets(config, (50, 20, 5), eod_id=-1)
    assert isinstance(train, GPTDataset) and (train.start, train.stop, len(train)) == (0, 90, 50)
    assert isinstance(valid, GPTDataset) and (valid.start, valid.stop, len(valid)) == (90, 100, 20)
    assert test is None  # a zero share
    first_valid_token = int(np.sum([10 + i % 7 for i in range(90)]))
    assert all(train.sample(i).max() < first_valid_token for i in range(len(train)))
    assert all(valid.sample(i).min() >= first_valid_token for i in range(len(valid)))
    _, none_valid, _ = build_datasets(config, (50, 0, 0), eod_id=-1)
    assert none_valid is None  # no samples requested


def test_default_cache_is_next_to_the_data_and_barrier_is_called(prefix, tmp_path):
    calls = []
    config = DataConfig(seq_length=8, data_path=[prefix], split="1,1,0", data_order="epoch-exact")
    build_datasets(config, (10, 10, 10), eod_id=-1, barrier=lambda: calls.append(1))
    assert len(calls) == 2  # one per built index: train and valid
    assert len(os.listdir(tmp_path / "index-cache")) == 8
    train, _, _ = build_datasets(config, (10, 10, 10), eod_id=-1, barrier=lambda: calls.append(1), is_builder=False)
    assert len(calls) == 4 and len(train) == 10


def test_separate_split_paths_use_whole_datasets(tmp_path):
    a, b, c = (str(tmp_path / n) for n in "abc")
    write_numbered_dataset(a, [12] * 20)
    write_numbered_dataset(b, [12] * 5, first=10_000)
    write_numbered_dataset(c, [12] * 5, first=20_000)
    config = DataConfig(seq_length=8, train_data_path=[a], valid_data_path=["1", b, "1", c],
                        cache_dir=str(tmp_path / "cache"), split="0,0,1")  # --split is ignored here
    train, valid, test = build_datasets(config, (30, 12, 4), eod_id=-1)
    assert (train.start, train.stop) == (0, 20)
    assert isinstance(valid, BlendedDataset) and len(valid) == 12
    assert test is None
    assert sorted(int(valid.sample(i)[0]) // 10_000 for i in range(12)) == [1] * 6 + [2] * 6


def test_prefixes_without_weights_are_weighted_by_tokens(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_numbered_dataset(a, [10] * 30)  # 300 tokens
    write_numbered_dataset(b, [10] * 10, first=10_000)  # 100 tokens
    config = DataConfig(seq_length=4, data_path=[a, b], split="1,0,0", cache_dir=str(tmp_path / "cache"),
                        data_order="epoch-exact")
    train, _, _ = build_datasets(config, (40, 0, 0), eod_id=-1)
    assert [len(d) for d in train.datasets] == [30, 10]


def test_build_datasets_rejects_bad_config_before_reading(tmp_path):
    config = DataConfig(seq_length=8, data_path=[str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="missing.bin: no such file"):
        build_datasets(config, (1, 0, 0), eod_id=0)


def test_flags_are_generated_from_the_config(prefix):
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--vocab-size", type=int, default=None)
    add_data_args(parser)
    args = parser.parse_args([
        "--data-path", "0.3", prefix, "0.7", prefix, "--split", "98,2,0", "--data-cache-path", "/tmp/c",
        "--eod-mask-loss", "--reset-position-ids", "--tokenizer-type", "NullTokenizer", "--vocab-size", "77",
        "--seed", "9",
    ])
    config = data_config_from_args(args, seq_length=128)
    assert config == DataConfig(seq_length=128, data_path=["0.3", prefix, "0.7", prefix], split="98,2,0",
                                cache_dir="/tmp/c", eod_mask_loss=True, reset_position_ids=True,
                                tokenizer_type="NullTokenizer", vocab_size=77, seed=9)
    defaults = data_config_from_args(parser.parse_args([]), seq_length=4)
    assert defaults == DataConfig(seq_length=4)
    flagged = {f.name for f in dataclasses.fields(DataConfig) if "flag" in f.metadata}
    assert flagged | {"seq_length", "seed", "vocab_size"} == {f.name for f in dataclasses.fields(DataConfig)}
    help_text = parser.format_help()
    assert "--reset-attention-mask" in help_text and "Attend only within a document" in help_text
