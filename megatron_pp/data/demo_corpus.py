"""A real-text demo corpus from what every Python install carries: the standard library's docstrings.

`prepare_demo_data(cache_dir)` walks the standard library's source files in sorted order (test
directories excluded), takes every module, class and function docstring with its qualified name,
adds the `pydoc_data` help topics, and so gets a few MB of English technical prose in some hundreds of
documents (docs/results/demo_corpus.json has the counts for one Python), shuffled with a fixed seed so a
`--split` puts representative modules in every split.
It then runs the same pipeline a user runs on their own corpus: train a byte-level BPE
(`train_bpe`, 4096 tokens), tokenize with `preprocess_jsonl` (EOD appended), and return the flags'
values for `pretrain_gpt.py`. Nothing is downloaded; it takes a few seconds.

Everything lands in `cache_dir/stdlib-docs-<key>/`, where the key hashes the recipe version, the
Python version and the standard library's location: a second call returns at once, and a changed
recipe or interpreter builds a new directory. The directory is built under a temporary name and
renamed when complete, so concurrent callers and interrupted builds never see half a corpus.

    python -m megatron_pp.data.demo_corpus runs/demo-data   # prints the --data-path/--tokenizer-* flags
    python -m megatron_pp.data.demo_corpus runs/demo-data --stats-json stats.json   # and writes its counts
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import random
import shutil
import shlex
import sys
import sysconfig
import tempfile
import tokenize
import warnings
from typing import Iterator, Optional

from megatron_pp.data.preprocess import preprocess_jsonl
from megatron_pp.data.indexed import IndexedDataset, apply_umask
from megatron_pp.data.megatron_order import split_bounds
from megatron_pp.data.tokenizers import build_tokenizer, train_bpe

# Bump when anything below changes what gets built: old caches are then left alone and rebuilt.
RECIPE_VERSION = 1
VOCAB_SIZE = 4096
SHUFFLE_SEED = 0
DEMO_SPLIT = "95,5,0"  # launch/demo.sh's --split: the split the stats JSON counts
_SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3"}
_DEFINITIONS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _docstrings(node: ast.AST, qualname: str) -> Iterator[str]:
    """'qualified.name' + newline + docstring for `node` and every definition in it, in source order."""
    doc = ast.get_docstring(node, clean=True) if isinstance(node, (ast.Module, *_DEFINITIONS)) else None
    if doc:
        yield f"{qualname}\n{doc}"
    for child in ast.iter_child_nodes(node):
        if isinstance(child, _DEFINITIONS):
            yield from _docstrings(child, f"{qualname}.{child.name}")
        elif not isinstance(child, ast.expr):
            yield from _docstrings(child, qualname)


def _module_sources(root: str) -> Iterator[tuple[str, str]]:
    """(module name, path) of the standard library's .py files, in sorted order."""
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _SKIPPED_DIRS and not d.startswith("."))
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                module = os.path.relpath(path, root)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                yield module, path


def stdlib_documents() -> list[str]:
    """The demo corpus: one document per standard-library module with docstrings, then one per pydoc
    help topic, in a fixed shuffled order."""
    documents = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # invalid escape sequences in old sources warn on parse
        for module, path in _module_sources(sysconfig.get_paths()["stdlib"]):
            try:
                with tokenize.open(path) as f:
                    tree = ast.parse(f.read(), path)
            except (SyntaxError, UnicodeDecodeError, OSError):
                continue  # a few stdlib files are deliberately unparsable templates
            text = "\n\n".join(_docstrings(tree, module))
            if text:
                documents.append(text)
    from pydoc_data.topics import topics

    documents += [f"{name}\n{topics[name].strip()}" for name in sorted(topics)]
    random.Random(SHUFFLE_SEED).shuffle(documents)
    return documents


def _recipe_key() -> str:
    recipe = {"version": RECIPE_VERSION, "vocab_size": VOCAB_SIZE, "python": sys.version,
              "stdlib": sysconfig.get_paths()["stdlib"]}
    return hashlib.blake2b(json.dumps(recipe, sort_keys=True).encode(), digest_size=6).hexdigest()


def _result(directory: str) -> Optional[dict]:
    """The manifest of a complete demo directory with absolute paths, or None if not built."""
    try:
        with open(os.path.join(directory, "manifest.json"), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    for key in ("data_prefix", "tokenizer_model", "vocab_file", "merge_file", "corpus_file"):
        manifest[key] = os.path.join(directory, manifest[key])
    return manifest


def _build(directory: str) -> None:
    documents = stdlib_documents()
    corpus = os.path.join(directory, "corpus.jsonl")
    with open(corpus, "w", encoding="utf-8") as f:
        for text in documents:
            f.write(json.dumps({"text": text}) + "\n")
    files = train_bpe(documents, VOCAB_SIZE, directory)
    tokenizer_args = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": files["tokenizer.json"]}
    result = preprocess_jsonl(corpus, os.path.join(directory, "stdlib_docs"), tokenizer_args, append_eod=True)
    tokenizer = build_tokenizer(**tokenizer_args)
    manifest = {
        "data_prefix": os.path.basename(result.outputs["text"]),
        "tokenizer_type": "HuggingFaceTokenizer",
        "tokenizer_model": "tokenizer.json",
        "vocab_file": "vocab.json",
        "merge_file": "merges.txt",
        "corpus_file": "corpus.jsonl",
        "vocab_size": tokenizer.vocab_size,
        "eod_id": tokenizer.eod,
        "num_documents": result.documents,
        "num_tokens": result.tokens["text"],
        "corpus_bytes": os.path.getsize(corpus),
        "recipe_version": RECIPE_VERSION,
        "python": sys.version,
    }
    with open(os.path.join(directory, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)


def prepare_demo_data(cache_dir: str) -> dict:
    """Build (once) and describe the demo corpus; see the module doc.

    Returns data_prefix, tokenizer_type ("HuggingFaceTokenizer"), tokenizer_model (tokenizer.json;
    vocab_file + merge_file serve GPT2BPETokenizer equally), vocab_size, eod_id, num_documents,
    num_tokens, corpus_file, corpus_bytes.
    """
    final = os.path.join(cache_dir, f"stdlib-docs-{_recipe_key()}")
    cached = _result(final)
    if cached is not None:
        return cached
    os.makedirs(cache_dir, exist_ok=True)
    building = tempfile.mkdtemp(dir=cache_dir, prefix=".building-stdlib-docs-")
    try:
        _build(building)
        apply_umask(building)
        try:
            os.rename(building, final)
        except OSError:
            # `final` appeared meanwhile: a concurrent caller finished first (keep its copy), or
            # someone damaged it (replace it).
            if _result(final) is None:
                shutil.rmtree(final)
                os.rename(building, final)
    finally:
        shutil.rmtree(building, ignore_errors=True)  # nothing left to remove once renamed
    built = _result(final)
    assert built is not None
    IndexedDataset(built["data_prefix"])  # the header check: fail here, not in the training job
    return built


def demo_flags(info: dict) -> list[str]:
    """pretrain_gpt.py flags that train on the prepared corpus."""
    return ["--data-path", info["data_prefix"], "--tokenizer-type", info["tokenizer_type"],
            "--tokenizer-model", info["tokenizer_model"]]


def corpus_stats(info: dict, split: str = DEMO_SPLIT) -> dict:
    """What a prepared corpus holds, whole and per split: documents, bytes of its JSON lines (each line with
    its newline) and tokens (EOD included), each split the documents `split_bounds` gives it (Megatron-LM's
    rule: one sequence per document here); a split with a zero share is None. Counted from the built files."""
    dataset = IndexedDataset(info["data_prefix"])
    with open(info["corpus_file"], "rb") as f:
        line_bytes = [len(line) for line in f]
    if len(line_bytes) != len(dataset) or dataset.num_documents != len(dataset):
        raise ValueError(f"{info['corpus_file']} has {len(line_bytes)} lines, {info['data_prefix']} "
                         f"{len(dataset)} sequences in {dataset.num_documents} documents: not one per line")
    tokens = dataset.sequence_lengths.astype("int64")
    splits = {}
    for name, bounds in zip(("train", "valid", "test"), split_bounds(split, len(dataset))):
        lo, hi = bounds if bounds is not None else (0, 0)
        splits[name] = None if bounds is None else {
            "documents": hi - lo, "corpus_bytes": sum(line_bytes[lo:hi]), "tokens": int(tokens[lo:hi].sum())}
    return {"documents": len(dataset), "corpus_bytes": sum(line_bytes), "tokens": int(tokens.sum()),
            "vocab_size": info["vocab_size"], "recipe_version": info["recipe_version"],
            "python": info["python"].split()[0], "split": split,
            "split_rule": "megatron_order.split_bounds (--data-order megatron, the default)", "splits": splits}


def _write_json(path: str, data: dict) -> None:
    """`data` as indented JSON at `path`, written under a temporary name and renamed."""
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="Build (once) the demo corpus; print its pretrain_gpt.py flags.")
    parser.add_argument("cache_dir", nargs="?", default="runs/demo-data")
    parser.add_argument("--stats-json", metavar="PATH",
                        help="also write its documents, bytes and tokens, whole and per split of --split")
    parser.add_argument("--split", default=DEMO_SPLIT, help=f"train,valid,test shares (default {DEMO_SPLIT}, "
                        "launch/demo.sh's)")
    args = parser.parse_args(argv)
    if args.stats_json and not os.path.isdir(os.path.dirname(os.path.abspath(args.stats_json))):
        parser.exit(2, f"--stats-json: directory of {args.stats_json} does not exist\n")
    if args.stats_json:
        from megatron_pp.data.builder import parse_split  # here: the builder imports torch, the demo's flags need not

        try:
            parse_split(args.split)
        except ValueError as exc:
            parser.exit(2, f"{exc}\n")
    info = prepare_demo_data(args.cache_dir)
    if args.stats_json:
        stats = corpus_stats(info, args.split)
        where = "CACHE_DIR" if os.path.isabs(args.cache_dir) else args.cache_dir
        stats["command"] = f"python -m megatron_pp.data.demo_corpus {where} --stats-json {args.stats_json}" + (
            "" if args.split == DEMO_SPLIT else f" --split {args.split}")
        _write_json(args.stats_json, stats)
    print(shlex.join(demo_flags(info)))


if __name__ == "__main__":
    main()
