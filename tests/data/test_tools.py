"""The data tools end to end: train_tokenizer → preprocess_data → merge_datasets, and their errors."""
from __future__ import annotations

import gzip
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import zstandard

from megatron_pp.data.preprocess import preprocess_jsonl
from megatron_pp.data.indexed import IndexedDataset
from megatron_pp.data.tokenizers import build_tokenizer, train_bpe
from tests.data import sample_texts, write_jsonl

ROOT = Path(__file__).resolve().parents[2]


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


preprocess_data = _tool("preprocess_data")
merge_datasets = _tool("merge_datasets")
train_tokenizer = _tool("train_tokenizer")

TEXTS = sample_texts(120)


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    return train_bpe(TEXTS, 320, str(tmp_path_factory.mktemp("tok")))["tokenizer.json"]


@pytest.fixture
def corpus(tmp_path):
    path = str(tmp_path / "corpus.jsonl")
    write_jsonl(path, TEXTS)
    return path


def _preprocess(tokenizer_json, *args):
    return preprocess_data.main(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer_json,
                                 *map(str, args)])


def _files(prefix):
    return open(prefix + ".bin", "rb").read(), open(prefix + ".idx", "rb").read()


def test_two_workers_write_the_same_bytes_as_one(tokenizer_json, corpus, tmp_path, capsys):
    one, two = tmp_path / "one", tmp_path / "two"
    assert _preprocess(tokenizer_json, "--input", corpus, "--output-prefix", one, "--append-eod", "--workers", 1) == 0
    assert _preprocess(tokenizer_json, "--input", corpus, "--output-prefix", two, "--append-eod", "--workers", 2) == 0
    assert _files(f"{one}_text_document") == _files(f"{two}_text_document")
    assert f"{one}_text_document.bin/.idx: 120 documents" in capsys.readouterr().out
    ds = IndexedDataset(f"{one}_text_document")
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tokenizer_json)
    assert ds.num_documents == 120
    for i in (0, 7, 119):
        assert ds[i][-1] == tok.eod
        assert tok.detokenize(ds[i][:-1].tolist()) == TEXTS[i]


def test_many_small_chunks_on_workers_keep_input_order(tokenizer_json, corpus, tmp_path):
    """120 lines in chunks of 7 over 3 workers (up to 12 chunks in flight): same bytes as 1 worker."""
    assert _preprocess(tokenizer_json, "--input", corpus, "--output-prefix", tmp_path / "one") == 0
    args = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": tokenizer_json}
    result = preprocess_jsonl(corpus, str(tmp_path / "three"), args, workers=3, lines_per_chunk=7)
    assert result.documents == 120 and result.dtype == "uint16"
    assert _files(f"{tmp_path}/three_text_document") == _files(f"{tmp_path}/one_text_document")


def test_compressed_inputs_give_the_same_dataset(tokenizer_json, corpus, tmp_path):
    raw = open(corpus, "rb").read()
    with gzip.open(tmp_path / "c.jsonl.gz", "wb") as f:
        f.write(raw)
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    for name in ("plain", "gz", "zst"):
        source = corpus if name == "plain" else tmp_path / f"c.jsonl.{name}"
        assert _preprocess(tokenizer_json, "--input", source, "--output-prefix", tmp_path / name, "--workers", 2) == 0
    plain = _files(f"{tmp_path}/plain_text_document")
    assert _files(f"{tmp_path}/gz_text_document") == plain
    assert _files(f"{tmp_path}/zst_text_document") == plain


@pytest.mark.parametrize("suffix", ["gz", "zst"])
def test_truncated_compressed_input_is_an_error_not_a_short_dataset(tokenizer_json, corpus, tmp_path, capsys, suffix):
    raw = open(corpus, "rb").read()
    data = gzip.compress(raw) if suffix == "gz" else zstandard.ZstdCompressor().compress(raw)
    path = tmp_path / f"cut.jsonl.{suffix}"
    path.write_bytes(data[: len(data) // 2])
    assert _preprocess(tokenizer_json, "--input", path, "--output-prefix", tmp_path / "o") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"preprocess_data.py: error: {path}: unreadable after line ")
    assert err.count("\n") == 1
    assert not (tmp_path / "o_text_document.idx").exists()


def test_multi_frame_zst_reads_every_frame(tokenizer_json, corpus, tmp_path):
    lines = open(corpus, "rb").read().splitlines(keepends=True)
    compressor = zstandard.ZstdCompressor()
    # Three frames, as concatenated or parallel (pzstd) compressors write them.
    frames = b"".join(compressor.compress(b"".join(lines[i : i + 50])) for i in range(0, len(lines), 50))
    (tmp_path / "frames.jsonl.zst").write_bytes(frames)
    assert _preprocess(tokenizer_json, "--input", tmp_path / "frames.jsonl.zst", "--output-prefix", tmp_path / "z") == 0
    assert _preprocess(tokenizer_json, "--input", corpus, "--output-prefix", tmp_path / "p") == 0
    assert _files(f"{tmp_path}/z_text_document") == _files(f"{tmp_path}/p_text_document")


def _corpus_with_bad_lines(path):
    lines = [json.dumps({"text": "good one"}), "{not json", json.dumps({"title": "no text key"}), "",
             json.dumps({"text": 5}), json.dumps({"text": "good two"}), b"\xff\xfe".decode("latin-1"), "[1, 2]"]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    with open(path, "ab") as f:
        f.write(b'{"text": "bad \xff byte"}\n' + json.dumps({"text": "good three"}).encode() + b"\n")


def test_bad_lines_are_counted_reported_and_skipped(tokenizer_json, tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    _corpus_with_bad_lines(path)
    assert _preprocess(tokenizer_json, "--input", path, "--output-prefix", tmp_path / "out", "--skip-bad-lines",
                       "--workers", 2) == 0
    out, err = capsys.readouterr()
    assert "6 bad lines skipped (lines 2, 3, 5, 7, 8, 9)" in out
    assert f"{path}:2: invalid JSON" in err
    assert f"{path}:3: no key 'text'" in err
    assert f"{path}:5: 'text' is a JSON number, not a string" in err
    assert f"{path}:8: a JSON array, not an object" in err
    assert f"{path}:9: not UTF-8" in err
    ds = IndexedDataset(f"{tmp_path}/out_text_document")
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tokenizer_json)
    assert [tok.detokenize(ds[i].tolist()) for i in range(len(ds))] == ["good one", "good two", "good three"]


def test_a_bad_line_is_fatal_by_default_and_nothing_is_written(tokenizer_json, tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    _corpus_with_bad_lines(path)
    assert _preprocess(tokenizer_json, "--input", path, "--output-prefix", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"preprocess_data.py: error: {path}:2: invalid JSON")
    assert err.rstrip().endswith("pass --skip-bad-lines to skip such lines")
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]


def test_text_the_tokenizer_rejects_is_a_bad_line_too(tmp_path, capsys):
    path = tmp_path / "ids.jsonl"
    write_jsonl(str(path), ["1 2 3", "4 five", "6 7"])
    argv = ["--input", str(path), "--output-prefix", str(tmp_path / "ids"), "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "10", "--append-eod", "--skip-bad-lines", "--workers", "2"]
    assert preprocess_data.main(argv) == 0
    assert f"{path}:2: NullTokenizer reads whitespace-separated integers" in capsys.readouterr().err
    ds = IndexedDataset(f"{tmp_path}/ids_text_document")
    assert ds.dtype.name == "uint8"
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 3, 10], [6, 7, 10]]


def test_several_json_keys_give_one_dataset_each(tokenizer_json, tmp_path):
    path = tmp_path / "two_keys.jsonl"
    with open(path, "w") as f:
        for i in range(5):
            f.write(json.dumps({"title": f"title {i}", "text": TEXTS[i]}) + "\n")
    assert _preprocess(tokenizer_json, "--input", path, "--output-prefix", tmp_path / "o", "--json-keys", "text",
                       "title") == 0
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tokenizer_json)
    titles = IndexedDataset(f"{tmp_path}/o_title_document")
    assert tok.detokenize(titles[3].tolist()) == "title 3"
    assert IndexedDataset(f"{tmp_path}/o_text_document").num_documents == 5


@pytest.mark.parametrize(
    "args, message",
    [
        (["--input", "{tmp}/nope.jsonl", "--output-prefix", "{tmp}/o"], "--input {tmp}/nope.jsonl: no such file"),
        (["--input", "{corpus}", "--output-prefix", "{tmp}/missing_dir/o"],
         "--output-prefix {tmp}/missing_dir/o: directory {tmp}/missing_dir does not exist"),
        (["--input", "{corpus}", "--output-prefix", "{tmp}/o", "--workers", "0"], "--workers must be >= 1, got 0"),
        (["--input", "{corpus}", "--output-prefix", "{tmp}/o", "--tokenizer-type", "Nope"],
         "unknown --tokenizer-type 'Nope'"),
        (["--input", "{corpus}"], "the following arguments are required: --output-prefix"),
    ],
)
def test_bad_arguments_print_one_line_and_exit_2(tokenizer_json, corpus, tmp_path, capsys, args, message):
    argv = [a.format(tmp=tmp_path, corpus=corpus) for a in args]
    assert _preprocess(tokenizer_json, *argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message.format(tmp=tmp_path) in err
    assert sorted(os.listdir(tmp_path)) == ["corpus.jsonl"]


def test_script_runs_standalone_and_fails_without_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input", str(tmp_path / "x.jsonl"),
         "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr == f"preprocess_data.py: error: --input {tmp_path / 'x.jsonl'}: no such file\n"


def test_merge_tool(tokenizer_json, corpus, tmp_path, capsys):
    shards = tmp_path / "shards"
    shards.mkdir()
    for name, texts in (("a", TEXTS[:3]), ("b", TEXTS[3:5])):
        write_jsonl(str(tmp_path / f"{name}.jsonl"), texts)
        assert _preprocess(tokenizer_json, "--input", tmp_path / f"{name}.jsonl", "--output-prefix", shards / name) == 0
    assert merge_datasets.main(["--input", str(shards), "--output-prefix", str(tmp_path / "all")]) == 0
    assert "all.bin/.idx: 5 documents" in capsys.readouterr().out
    merged = IndexedDataset(str(tmp_path / "all"))
    a = IndexedDataset(str(shards / "a_text_document"))
    assert merged[2].tolist() == a[2].tolist()
    assert merge_datasets.main(["--input", str(tmp_path / "nothing"), "--output-prefix", str(tmp_path / "x")]) == 2
    assert "--input" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert merge_datasets.main(["--input", str(tmp_path / "empty"), "--output-prefix", str(tmp_path / "x")]) == 2
    assert "empty: directory holds no .bin/.idx pairs" in capsys.readouterr().err
    assert not (tmp_path / "x.idx").exists()


@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "SentencePieceTokenizer"])
def test_train_tokenizer_then_preprocess(corpus, tmp_path, capsys, kind):
    assert train_tokenizer.main(["--input", corpus, "--tokenizer-type", kind, "--vocab-size", "360",
                                 "--output-dir", str(tmp_path / "tok")]) == 0
    flags = capsys.readouterr().out.strip().splitlines()[-1].split()
    assert flags[:2] == ["--tokenizer-type", kind]
    assert preprocess_data.main([*flags, "--input", corpus, "--output-prefix", str(tmp_path / "d"),
                                 "--append-eod"]) == 0
    ds = IndexedDataset(f"{tmp_path}/d_text_document")
    assert ds.num_documents == len(TEXTS)
    assert ds[0][-1] == (0 if kind == "GPT2BPETokenizer" else 2)


def test_train_tokenizer_reports_bad_lines(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    _corpus_with_bad_lines(path)
    args = ["--input", str(path), "--tokenizer-type", "SentencePieceTokenizer", "--vocab-size", "300",
            "--output-dir", str(tmp_path / "tok")]
    assert train_tokenizer.main(args) == 2
    err = capsys.readouterr().err
    assert err == f"train_tokenizer.py: error: {path}:2: invalid JSON (Expecting property name enclosed in double " \
                  f"quotes at column 2); pass --skip-bad-lines to skip such lines\n"
    assert not (tmp_path / "tok" / "tokenizer.model").exists()
