"""Tokenizers: trained BPE and SentencePiece round-trip text, end-of-document ids, offline loading."""
from __future__ import annotations

import json
import os
import socket

import pytest

from megatron_pp.data.tokenizers import (
    NullTokenizer,
    build_tokenizer,
    check_tokenizer_args,
    train_bpe,
    train_sentencepiece,
)
from tests.data import sample_texts

ROUND_TRIP = [
    "Pipeline stage 3 sends activations to stage 4.",
    "Grüße aus Köln — naïve café, 123 + 456 = 579!",
    "two\nlines\n\n  indented\ttab",
    "emoji 🙂 and CJK 並列",
]


@pytest.fixture(scope="module")
def bpe_files(tmp_path_factory):
    return train_bpe(sample_texts(), 400, str(tmp_path_factory.mktemp("bpe")))


@pytest.fixture(scope="module")
def sp_file(tmp_path_factory):
    return train_sentencepiece(sample_texts(), 400, str(tmp_path_factory.mktemp("sp")))["tokenizer.model"]


def test_trained_bpe_round_trips_text(bpe_files):
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=bpe_files["tokenizer.json"])
    assert tok.vocab_size == 400
    assert tok.eod == 0  # <|endoftext|> is the first special token
    for text in ROUND_TRIP + sample_texts(5, seed=1):
        ids = tok.tokenize(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.detokenize(ids) == text
    # Trained merges compress the training vocabulary well below one token per byte.
    text = sample_texts(1)[0]
    assert len(tok.tokenize(text)) < len(text.encode()) / 2


def test_gpt2_vocab_and_merges_give_the_same_ids_as_tokenizer_json(bpe_files):
    from_json = build_tokenizer("GPT2BPETokenizer", tokenizer_model=bpe_files["tokenizer.json"])
    from_files = build_tokenizer("GPT2BPETokenizer", vocab_file=bpe_files["vocab.json"],
                                 merge_file=bpe_files["merges.txt"])
    assert from_files.vocab_size == from_json.vocab_size and from_files.eod == from_json.eod
    for text in ROUND_TRIP:
        assert from_files.tokenize(text) == from_json.tokenize(text)
    # The literal end-of-document string is the EOD id, as in GPT-2.
    assert from_files.tokenize("a<|endoftext|>b")[1] == from_files.eod
    assert from_files.detokenize([from_files.eod]) == "<|endoftext|>"


def test_bpe_training_is_deterministic(bpe_files, tmp_path):
    again = train_bpe(sample_texts(), 400, str(tmp_path))
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        assert open(again[name], "rb").read() == open(bpe_files[name], "rb").read()
    assert sorted(os.listdir(tmp_path)) == ["merges.txt", "tokenizer.json", "vocab.json"]


def test_trained_sentencepiece_round_trips_text(sp_file):
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_file)
    assert tok.vocab_size == 400
    assert tok.eod == 2  # LLaMA layout: unk 0, <s> 1, </s> 2
    for text in ROUND_TRIP:
        ids = tok.tokenize(text)
        assert 1 not in ids and 2 not in ids  # no BOS/EOS added by tokenize
        assert tok.detokenize(ids) == text
    assert build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_file, eod_token="<s>").eod == 1


def test_eod_token_override_and_unknown_eod(bpe_files, sp_file):
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=bpe_files["tokenizer.json"], eod_token="e")
    assert tok.eod == tok.tokenize("e")[0]
    with pytest.raises(ValueError, match="--eod-token '<nope>' is not in the vocabulary of"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=bpe_files["tokenizer.json"], eod_token="<nope>")
    with pytest.raises(ValueError, match="--eod-token '<nope>' is not in the vocabulary of"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_file, eod_token="<nope>")


def test_tokenizer_json_without_any_eod_token_asks_for_eod_token(bpe_files, tmp_path):
    spec = json.load(open(bpe_files["tokenizer.json"], encoding="utf-8"))
    spec["added_tokens"] = []
    spec["model"]["vocab"] = {("<eos>" if t == "<|endoftext|>" else t): i for t, i in spec["model"]["vocab"].items()}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    with pytest.raises(ValueError, match="has none of <\\|endoftext\\|>, </s> and no eos token; name its "
                                         "end-of-document token with --eod-token"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(path))
    assert build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(path), eod_token="<eos>").eod == 0


def test_hugging_face_directory_loads_offline_with_its_eos(bpe_files, tmp_path):
    from transformers import PreTrainedTokenizerFast

    saved = PreTrainedTokenizerFast(tokenizer_file=bpe_files["tokenizer.json"], eos_token="<|endoftext|>")
    saved.save_pretrained(str(tmp_path / "tok"))
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "tok"))
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert tok.vocab_size == 400 and tok.eod == 0
    for text in ROUND_TRIP:
        assert tok.detokenize(tok.tokenize(text)) == text


def test_missing_tokenizer_paths_fail_fast_without_a_hub_lookup(tmp_path, monkeypatch):
    # No network: a hub lookup would try to connect (a check that holds on any load, unlike a time bound).
    def no_network(*args, **kwargs):
        raise AssertionError(f"a network connection was attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    with pytest.raises(ValueError, match="no such file or directory \\(models are never downloaded"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model="gpt2")  # a hub name, not a local path
    assert check_tokenizer_args("SentencePieceTokenizer") == [
        "--tokenizer-type SentencePieceTokenizer needs --tokenizer-model (a SentencePiece .model file)"
    ]
    assert check_tokenizer_args("BertTokenizer")[0].startswith("unknown --tokenizer-type 'BertTokenizer'")
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="is not a SentencePiece model"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(bad))
    with pytest.raises(ValueError, match="is not a readable tokenizer.json"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(bad))


def test_null_tokenizer_follows_megatron():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert isinstance(tok, NullTokenizer)
    assert (tok.vocab_size, tok.eod) == (101, 100)
    assert tok.tokenize(" 5 17\n3 ") == [5, 17, 3]
    assert tok.detokenize([5, 17, 3]) == "5 17 3"
    with pytest.raises(ValueError, match="id 101 outside the vocabulary 0..100"):
        tok.tokenize("1 101")
    with pytest.raises(ValueError, match="reads whitespace-separated integers"):
        tok.tokenize("five")
    with pytest.raises(ValueError, match="NullTokenizer needs --vocab-size >= 1, got None"):
        build_tokenizer("NullTokenizer")


def test_training_rejects_a_vocabulary_below_the_byte_alphabet(tmp_path):
    with pytest.raises(ValueError, match="--vocab-size 100 is too small for byte-level BPE"):
        train_bpe(["some text"], 100, str(tmp_path))


def test_hugging_face_tokenizer_adds_its_special_tokens_as_megatron_lm_does(tmp_path):
    """Megatron-LM's HuggingFaceTokenizer calls the tokenizer with its defaults, so a LLaMA-style post-processor's
    BOS starts every document; GPT2BPETokenizer on the same file adds none; --no-special-tokens turns it off."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models as rust_models
    from tokenizers import pre_tokenizers as rust_pre
    from tokenizers.processors import TemplateProcessing

    from megatron_pp.data.tokenizers import build_tokenizer

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "pipeline": 3, "stage": 4}
    rust = RustTokenizer(rust_models.WordLevel(vocab, unk_token="<unk>"))
    rust.pre_tokenizer = rust_pre.Whitespace()
    rust.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    path = str(tmp_path / "tokenizer.json")
    rust.save(path)
    assert build_tokenizer("HuggingFaceTokenizer", tokenizer_model=path).tokenize("pipeline stage") == [0, 3, 4]
    assert build_tokenizer("HuggingFaceTokenizer", tokenizer_model=path,
                           add_special_tokens=False).tokenize("pipeline stage") == [3, 4]
    assert build_tokenizer("GPT2BPETokenizer", tokenizer_model=path).tokenize("pipeline stage") == [3, 4]
