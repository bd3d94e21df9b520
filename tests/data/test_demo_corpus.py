"""The real-text demo corpus: built from the standard library, cached, and trainable as GPT samples."""
from __future__ import annotations

import json
import os

import pytest

from megatron_pp.data import demo_corpus
from megatron_pp.data.builder import DataConfig, build_datasets, check_data_args
from megatron_pp.data.demo_corpus import demo_flags, prepare_demo_data
from megatron_pp.data.indexed import IndexedDataset
from megatron_pp.data.tokenizers import build_tokenizer


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    cache_dir = str(tmp_path_factory.mktemp("demo"))
    return cache_dir, prepare_demo_data(cache_dir)


def test_demo_corpus_is_real_text_of_a_few_megabytes(demo):
    _, info = demo
    assert info["tokenizer_type"] == "HuggingFaceTokenizer"
    assert info["vocab_size"] == 4096
    assert info["num_documents"] > 400
    assert 1_000_000 < info["corpus_bytes"] < 8_000_000
    assert info["num_tokens"] > 200_000
    ds = IndexedDataset(info["data_prefix"])
    assert ds.num_documents == info["num_documents"] and ds.num_tokens == info["num_tokens"]
    tok = build_tokenizer(info["tokenizer_type"], tokenizer_model=info["tokenizer_model"])
    assert tok.eod == info["eod_id"]
    with open(info["corpus_file"], encoding="utf-8") as f:
        first = json.loads(f.readline())["text"]
    assert ds[0][-1] == tok.eod
    assert tok.detokenize(ds[0][:-1].tolist()) == first
    assert "\n" in first and len(first.split()) > 10


def test_second_call_returns_the_cache_at_once(demo, monkeypatch):
    cache_dir, info = demo

    def no_rebuild(directory):
        raise AssertionError("the cached corpus should have been used")

    monkeypatch.setattr(demo_corpus, "_build", no_rebuild)
    assert prepare_demo_data(cache_dir) == info  # `_build` refuses to run: the cache was used, on any load
    assert [n for n in os.listdir(cache_dir) if not n.startswith("stdlib-docs-")] == []  # no leftovers


def test_a_changed_recipe_builds_elsewhere(demo, monkeypatch):
    cache_dir, info = demo
    key = demo_corpus._recipe_key()
    assert os.path.basename(os.path.dirname(info["data_prefix"])) == f"stdlib-docs-{key}"
    monkeypatch.setattr(demo_corpus, "RECIPE_VERSION", demo_corpus.RECIPE_VERSION + 1)
    assert demo_corpus._recipe_key() != key


def test_demo_flags_feed_the_data_pipeline(demo, tmp_path):
    _, info = demo
    flags = demo_flags(info)
    assert flags == ["--data-path", info["data_prefix"], "--tokenizer-type", "HuggingFaceTokenizer",
                     "--tokenizer-model", info["tokenizer_model"]]
    config = DataConfig(seq_length=64, data_path=[info["data_prefix"]], split="95,5,0",
                        tokenizer_type=info["tokenizer_type"], tokenizer_model=info["tokenizer_model"],
                        cache_dir=str(tmp_path), eod_mask_loss=True)
    assert check_data_args(config) == []
    train, valid, test = build_datasets(config, (64, 16, 0), eod_id=info["eod_id"])
    assert test is None and len(train) >= 64 and len(valid) >= 16  # Megatron-LM's order indexes whole epochs
    batch = valid.get_batch([0, 1, 2, 3])
    assert batch["tokens"].shape == (4, 64) and int(batch["tokens"].max()) < info["vocab_size"]
    tok = build_tokenizer(**config.tokenizer_args())
    text = tok.detokenize(batch["tokens"][0].tolist())
    assert sum(c.isalpha() for c in text) > len(text) / 2  # prose, not noise
