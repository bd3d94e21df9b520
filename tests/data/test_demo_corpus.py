"""The real-text demo corpus: built from the standard library, cached, and trainable as GPT samples."""
from __future__ import annotations

import json
import os

import pytest

from megatron_pp.data import demo_corpus, megatron_order
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


def test_stats_count_the_built_files_whole_and_per_split(demo, tmp_path):
    cache_dir, info = demo
    stats = demo_corpus.corpus_stats(info, "95,5,0")
    assert (stats["documents"], stats["tokens"], stats["corpus_bytes"]) == (
        info["num_documents"], info["num_tokens"], info["corpus_bytes"])
    train, valid, test = (stats["splits"][k] for k in ("train", "valid", "test"))
    assert test is None  # a zero share builds no split
    ds = IndexedDataset(info["data_prefix"])
    (lo, hi), _, _ = megatron_order.split_bounds("95,5,0", len(ds))
    assert (lo, train["documents"], valid["documents"]) == (0, hi, len(ds) - hi)
    assert train["tokens"] == sum(len(ds[i]) for i in range(hi))
    for key in ("documents", "tokens", "corpus_bytes"):
        assert train[key] + valid[key] == stats[key]
    third = demo_corpus.corpus_stats(info, "1,1,1")["splits"]["test"]
    assert third["documents"] == len(ds) - round(2 / 3 * len(ds)) and third["tokens"] > 0


def test_stats_json_from_the_command_line(demo, tmp_path, capsys):
    cache_dir, info = demo
    out = tmp_path / "stats.json"
    demo_corpus.main([cache_dir, "--stats-json", str(out)])
    assert capsys.readouterr().out.split() == demo_flags(info)  # the flags launch/demo.sh reads, unchanged
    written = json.loads(out.read_text())
    assert written["splits"] == demo_corpus.corpus_stats(info)["splits"] and written["split"] == "95,5,0"
    for bad, says in ((["--split", "0,0"], "--split '0,0'"), (["--stats-json", str(tmp_path / "no" / "s.json")],
                                                               "--stats-json")):
        argv = [cache_dir] + (["--stats-json", str(out)] if "--stats-json" not in bad else []) + bad
        with pytest.raises(SystemExit) as exit_:
            demo_corpus.main(argv)
        assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_committed_stats_describe_the_demo_split(demo):
    """docs/results/demo_corpus.json (docs/data.md renders it) counts launch/demo.sh's split, and its splits add
    up to the whole; on the Python version that wrote it (the corpus is that Python's standard library), a fresh
    build gives the same counts."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "results", "demo_corpus.json")) as f:
        committed = json.load(f)
    with open(os.path.join(root, "launch", "demo.sh")) as f:
        assert f"--split {committed['split']} " in f.read()
    assert committed["split"] == demo_corpus.DEMO_SPLIT
    for key in ("documents", "tokens", "corpus_bytes"):
        assert sum(s[key] for s in committed["splits"].values() if s) == committed[key]
    fresh = demo_corpus.corpus_stats(demo[1])
    if fresh["python"] == committed["python"]:
        assert fresh == {k: v for k, v in committed.items() if k != "command"}
