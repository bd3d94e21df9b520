"""Preprocessing (behind `tools/preprocess_data.py`): JSON lines into `.bin/.idx`.

`preprocess_jsonl` reads `.jsonl`, `.jsonl.gz` or `.jsonl.zst`, tokenizes the `--json-keys` fields of
every line in worker processes (results kept in input order, so any `--workers` gives the same bytes)
and writes `{output_prefix}_{key}_document.bin/.idx`, as Megatron-LM names them. A line that is not
valid UTF-8 JSON with the keys as strings is a *bad line*: fatal by default, skipped and reported with
its line number with `skip_bad_lines`. `iter_corpus_texts` reads the same corpora for tokenizer training.
"""
from __future__ import annotations

import collections
import gzip
import io
import json
import multiprocessing as mp
import sys
from contextlib import ExitStack, closing
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterator, Optional, Sequence

import numpy as np
import zstandard
from tqdm import tqdm

from megatron_pp.data.indexed import IndexedDatasetWriter, best_dtype
from megatron_pp.data.tokenizers import Tokenizer, build_tokenizer

# ------------------------------------------------------------------------------------------------
# Reading JSON-lines corpora
# ------------------------------------------------------------------------------------------------


def open_corpus(path: str) -> BinaryIO:
    """Binary stream of a corpus file, decompressing `.gz` and `.zst` by suffix."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        return io.BufferedReader(_ZstdFrames(path), buffer_size=1 << 20)
    return open(path, "rb")


class _ZstdFrames(io.RawIOBase):
    """Every frame of a .zst file, decompressed, raising EOFError on a truncated last frame.

    zstandard's own stream reader ends quietly at a truncated frame, which would turn a damaged
    corpus into a silently shorter dataset.
    """

    def __init__(self, path: str) -> None:
        super().__init__()
        self._file = open(path, "rb")
        self._context = zstandard.ZstdDecompressor()
        self._frame = self._context.decompressobj()
        self._frame_started = False
        self._out = b""
        self._pos = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self._pos == len(self._out):
            data = self._file.read(1 << 20)
            if not data:
                if self._frame_started:
                    raise EOFError("the last zstd frame is truncated")
                return 0
            self._out, self._pos = self._decompress(data), 0
        count = min(len(buffer), len(self._out) - self._pos)
        buffer[:count] = self._out[self._pos : self._pos + count]
        self._pos += count
        return count

    def _decompress(self, data: bytes) -> bytes:
        pieces = []
        while data:
            self._frame_started = True
            pieces.append(self._frame.decompress(data))
            data = b""
            if self._frame.eof:  # a frame ended inside this chunk: the rest begins the next one
                data = self._frame.unused_data
                self._frame = self._context.decompressobj()
                self._frame_started = False
        return b"".join(pieces)

    def close(self) -> None:
        self._file.close()
        super().close()


class BadLine(ValueError):
    """A corpus line that cannot be used; `line` is 1-based."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        super().__init__(f"{path}:{line}: {reason}")
        self.path, self.line, self.reason = path, line, reason


def parse_json_line(raw: bytes, keys: Sequence[str]) -> list[str]:
    """The string values of `keys` in one JSON-lines record; ValueError with the reason otherwise."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"a JSON {_json_type(record)}, not an object")
    texts = []
    for key in keys:
        if key not in record:
            raise ValueError(f"no key {key!r}")
        if not isinstance(record[key], str):
            raise ValueError(f"{key!r} is a JSON {_json_type(record[key])}, not a string")
        texts.append(record[key])
    return texts


def _json_type(value: object) -> str:
    """JSON's name for the type of a decoded value."""
    if isinstance(value, bool):
        return "boolean"
    names = {int: "number", float: "number", list: "array", dict: "object", str: "string", type(None): "null"}
    return names[type(value)]


def numbered_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw line) of every non-blank line; blank lines carry no document."""
    number = 0
    try:
        with open_corpus(path) as f:
            for number, raw in enumerate(f, 1):
                if raw.strip():
                    yield number, raw
    except (OSError, EOFError, zstandard.ZstdError) as exc:  # a truncated or corrupt .gz/.zst
        raise ValueError(f"{path}: unreadable after line {number}: {exc}") from None


def iter_corpus_texts(paths: Sequence[str], keys: Sequence[str], *, skip_bad_lines: bool = False,
                      on_bad_line: Optional[Callable[[BadLine], None]] = None) -> Iterator[str]:
    """Every `keys` field of every record of the JSON-lines files `paths`, in order.

    A bad line raises `BadLine`, or with `skip_bad_lines` goes to `on_bad_line` and is skipped.
    """
    for path in paths:
        for number, raw in numbered_lines(path):
            try:
                texts = parse_json_line(raw, keys)
            except ValueError as exc:
                bad = BadLine(path, number, str(exc))
                if not skip_bad_lines:
                    raise bad from None
                if on_bad_line is not None:
                    on_bad_line(bad)
                continue
            yield from texts


# ------------------------------------------------------------------------------------------------
# Preprocessing: JSON lines -> .bin/.idx
# ------------------------------------------------------------------------------------------------


@dataclass
class PreprocessResult:
    outputs: dict[str, str]
    """json key -> output prefix written."""
    documents: int
    """Documents written per output (one per good line)."""
    tokens: dict[str, int]
    """json key -> tokens written."""
    bad_lines: list[BadLine]
    """Lines skipped (only with skip_bad_lines)."""
    dtype: str
    """Token dtype of the .bin files."""


# Per worker process: (tokenizer, json keys, append_eod, dtype), set by _init_worker.
_worker: Optional[tuple[Tokenizer, tuple[str, ...], bool, np.dtype]] = None


def _init_worker(tokenizer_args: dict, keys: tuple[str, ...], append_eod: bool) -> None:
    global _worker
    tokenizer = build_tokenizer(**tokenizer_args)
    _worker = (tokenizer, keys, append_eod, best_dtype(tokenizer.vocab_size))


def _tokenize_lines(chunk: list[tuple[int, bytes]]) -> list[tuple[int, Optional[list[np.ndarray]], str]]:
    """(line number, one id array per key or None, bad-line reason) for each line of the chunk."""
    assert _worker is not None, "_init_worker must run first"
    tokenizer, keys, append_eod, dtype = _worker
    out: list[tuple[int, Optional[list[np.ndarray]], str]] = []
    for number, raw in chunk:
        try:
            texts = parse_json_line(raw, keys)
            arrays = []
            for text in texts:
                ids = tokenizer.tokenize(text)
                if append_eod:
                    ids.append(tokenizer.eod)
                arrays.append(np.asarray(ids, dtype=dtype))
        except ValueError as exc:  # bad JSON, or text this tokenizer rejects (NullTokenizer)
            out.append((number, None, str(exc)))
            continue
        out.append((number, arrays, ""))
    return out


def _chunks(lines: Iterator[tuple[int, bytes]], size: int) -> Iterator[list[tuple[int, bytes]]]:
    chunk: list[tuple[int, bytes]] = []
    for item in lines:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _ordered_results(chunks: Iterator[list], workers: int, initargs: tuple) -> Iterator[list]:
    """`_tokenize_lines` of each chunk, in input order, on `workers` processes (1: in this process).

    At most 4 chunks per worker are in flight, so memory stays bounded however large the input
    (Pool.imap would read the whole file ahead).
    """
    if workers == 1:
        _init_worker(*initargs)
        yield from map(_tokenize_lines, chunks)
        return
    # fork shares the already imported modules; spawn (elsewhere) would re-import torch per worker.
    context = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with context.Pool(workers, initializer=_init_worker, initargs=initargs) as pool:
        pending: collections.deque = collections.deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_tokenize_lines, (chunk,)))
            if len(pending) >= 4 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron's output naming: `{output_prefix}_{key}_document`."""
    return f"{output_prefix}_{key}_document"


def preprocess_jsonl(input_path: str, output_prefix: str, tokenizer_args: dict, *, json_keys: Sequence[str] = ("text",),
                     append_eod: bool = False, workers: int = 1, skip_bad_lines: bool = False,
                     on_bad_line: Optional[Callable[[BadLine], None]] = None, progress: bool = False,
                     lines_per_chunk: int = 256) -> PreprocessResult:
    """Tokenize a JSON-lines corpus into one indexed dataset per json key (see the module doc).

    `tokenizer_args` are `build_tokenizer`'s keyword arguments (each worker builds its own). Nothing
    is written unless the whole input succeeds.
    """
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    keys = tuple(json_keys)
    if not keys or len(set(keys)) != len(keys):
        raise ValueError(f"--json-keys must be distinct and non-empty, got {list(keys)}")
    dtype = best_dtype(build_tokenizer(**tokenizer_args).vocab_size)
    outputs = {key: output_prefix_for(output_prefix, key) for key in keys}
    tokens = dict.fromkeys(keys, 0)
    bad_lines: list[BadLine] = []
    documents = 0
    with ExitStack() as stack:
        writers = [stack.enter_context(IndexedDatasetWriter(outputs[key], dtype)) for key in keys]
        bar = stack.enter_context(tqdm(unit=" docs", disable=not progress, file=sys.stderr, desc=input_path))
        chunks = _chunks(numbered_lines(input_path), lines_per_chunk)
        # closing(): on an error below, stop the worker pool now rather than when garbage is collected.
        ordered = stack.enter_context(closing(_ordered_results(chunks, workers, (tokenizer_args, keys, append_eod))))
        for results in ordered:
            for number, arrays, reason in results:
                if arrays is None:
                    bad = BadLine(input_path, number, reason)
                    if not skip_bad_lines:
                        raise bad
                    bad_lines.append(bad)
                    if on_bad_line is not None:
                        on_bad_line(bad)
                    continue
                for key, writer, array in zip(keys, writers, arrays):
                    writer.add_document(array)
                    tokens[key] += len(array)
                documents += 1
            bar.update(len(results))
    return PreprocessResult(outputs, documents, tokens, bad_lines, dtype.name)
