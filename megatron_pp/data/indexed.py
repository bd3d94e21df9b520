"""The indexed dataset format: token ids in a memory-mapped `.bin`, their layout in a small `.idx`.

A dataset `PREFIX` is two files. `PREFIX.bin` holds the token ids of every sequence back to back, in
the smallest integer dtype that fits the vocabulary (`best_dtype`: uint16 for a 50k GPT-2 vocabulary,
so 2 bytes a token). `PREFIX.idx` is Megatron-LM's MMIDIDX layout, so files written by either
project read in the other:

    offset  size      field
    0       9         magic b"MMIDIDX\\x00\\x00"
    9       8  <Q     format version (1)
    17      1  <B     dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16)
    18      8  <Q     n: number of sequences
    26      8  <Q     d: number of document boundaries (documents + 1)
    34      4n <i4    sequence lengths in tokens
    34+4n   8n <i8    sequence byte offsets into .bin
    34+12n  8d <i8    document boundaries: document j is sequences [b[j], b[j+1])

Example: documents [5, 6, 7] and [8, 9] written as uint16 give lengths [3, 2], pointers [0, 6],
boundaries [0, 1, 2] and a 10-byte `.bin`. A document may hold several sequences (Megatron's
sentence-split datasets); `tools/preprocess_data.py` writes one sequence per document.

`IndexedDataset` checks the whole header against both file sizes and the arrays against each other
when it opens a pair, so a foreign, truncated or mismatched file fails with `IndexFormatError` naming
the file instead of yielding garbage tokens. `IndexedDatasetWriter` writes to temporary files and
renames them into place only when the dataset is complete.
"""
from __future__ import annotations

import os
import struct
import tempfile
from types import TracebackType
from typing import Iterable, Optional, Sequence

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")
HEADER_SIZE = _HEADER.size  # 34

# Megatron's dtype codes. Its float codes (6, 7) exist for other data and are rejected as token ids.
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    8: np.dtype(np.uint16),
}
_CODE_OF = {dtype: code for code, dtype in DTYPE_CODES.items()}


class IndexFormatError(ValueError):
    """A `.idx`/`.bin` pair that is not a valid indexed dataset; the message names the file."""


def best_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype (or int32/int64 beyond 16 bits) that holds ids 0 .. vocab_size - 1."""
    if vocab_size < 1:
        raise ValueError(f"vocabulary size must be >= 1, got {vocab_size}")
    for dtype in (np.uint8, np.uint16, np.int32):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.int64)


def apply_umask(path: str) -> None:
    """Give a file made by `tempfile` (mode 0600, dirs 0700) the mode a plain open() would have, so
    datasets and caches on a shared filesystem stay readable by the group as the umask allows."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o777 if os.path.isdir(path) else 0o666) & ~umask)


def data_file_paths(prefix: str) -> tuple[str, str]:
    """(`PREFIX.bin`, `PREFIX.idx`)."""
    return prefix + ".bin", prefix + ".idx"


def _read_index(idx_path: str, bin_size: int) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    """Parse and cross-check a `.idx`; returns (dtype, lengths, pointers, document boundaries)."""
    idx_size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        head = f.read(HEADER_SIZE)
    if not MAGIC.startswith(head[: len(MAGIC)]):
        raise IndexFormatError(f"{idx_path}: not an indexed-dataset index (bad magic bytes {head[:9]!r})")
    if len(head) < HEADER_SIZE:
        raise IndexFormatError(f"{idx_path}: truncated header ({idx_size} bytes, need {HEADER_SIZE})")
    _, version, code, n, d = _HEADER.unpack(head)
    if version != VERSION:
        raise IndexFormatError(f"{idx_path}: unsupported format version {version} (this reader knows {VERSION})")
    if code not in DTYPE_CODES:
        raise IndexFormatError(f"{idx_path}: dtype code {code} is not an integer token dtype "
                               f"(known: {sorted(DTYPE_CODES)})")
    expected = HEADER_SIZE + 12 * n + 8 * d
    if idx_size != expected:
        what = "truncated" if idx_size < expected else "has trailing bytes"
        raise IndexFormatError(f"{idx_path}: {what}: header says {n} sequences and {d} document boundaries "
                               f"({expected} bytes), file has {idx_size} bytes")
    if d < 1:
        raise IndexFormatError(f"{idx_path}: no document boundaries (need at least the leading 0)")
    dtype = DTYPE_CODES[code]
    # Memory-mapped: a 100M-document index is 2 GB and only the pieces in use need to be paged in.
    raw = np.memmap(idx_path, dtype=np.uint8, mode="r")
    lengths = np.frombuffer(raw, dtype="<i4", count=n, offset=HEADER_SIZE)
    pointers = np.frombuffer(raw, dtype="<i8", count=n, offset=HEADER_SIZE + 4 * n)
    boundaries = np.frombuffer(raw, dtype="<i8", count=d, offset=HEADER_SIZE + 12 * n)
    if n and lengths.min() < 0:
        raise IndexFormatError(f"{idx_path}: negative sequence length at sequence {int(np.argmin(lengths))}")
    ends = np.cumsum(lengths, dtype=np.int64) * dtype.itemsize
    if n:
        expected_pointers = ends - lengths.astype(np.int64) * dtype.itemsize
        bad = np.flatnonzero(pointers != expected_pointers)
        if bad.size:
            raise IndexFormatError(f"{idx_path}: sequence {int(bad[0])} starts at byte {int(pointers[bad[0]])}, "
                                   f"but the lengths before it put it at {int(expected_pointers[bad[0]])}")
    if boundaries[0] != 0 or boundaries[-1] != n or (d > 1 and np.any(np.diff(boundaries) < 0)):
        raise IndexFormatError(f"{idx_path}: document boundaries must rise from 0 to the sequence count {n}")
    data_bytes = int(ends[-1]) if n else 0
    if bin_size != data_bytes:
        raise IndexFormatError(
            f"{idx_path[:-4]}.bin has {bin_size} bytes but its .idx describes {data_bytes} "
            f"({n} sequences of {dtype.name}): the two files do not belong together or one is truncated"
        )
    return dtype, lengths, pointers, boundaries


class IndexedDataset:
    """Read-only view of `PREFIX.bin`/`PREFIX.idx`; sequence i is `dataset[i]` (a numpy array).

    Arrays returned are views into the memory map (no copy): convert before modifying.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        bin_path, idx_path = data_file_paths(prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"indexed dataset file {path} does not exist")
        bin_size = os.path.getsize(bin_path)
        self.dtype, self.sequence_lengths, self.sequence_pointers, self.document_indices = _read_index(
            idx_path, bin_size
        )
        # np.memmap refuses empty files; an empty dataset is still a valid one.
        self._tokens = (
            np.memmap(bin_path, dtype=self.dtype, mode="r") if bin_size else np.empty(0, dtype=self.dtype)
        )

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, index: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence `index` (to its end when length is None)."""
        if not 0 <= index < len(self):
            raise IndexError(f"sequence {index} out of range for {self.prefix} ({len(self)} sequences)")
        size = int(self.sequence_lengths[index])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence {index} of "
                             f"{self.prefix} (length {size})")
        start = int(self.sequence_pointers[index]) // self.dtype.itemsize + offset
        return self._tokens[start : start + length]

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)


class IndexedDatasetWriter:
    """Writes `PREFIX.bin`/`PREFIX.idx`; the files appear only on `finalize()` (or a clean `with` exit).

        with IndexedDatasetWriter("out/corpus_text_document", best_dtype(tokenizer.vocab_size)) as w:
            for ids in documents:
                w.add_document(ids)

    An exception inside the `with` block (or `abort()`) removes the temporary files, so a failed run
    never leaves a partial dataset behind.
    """

    def __init__(self, prefix: str, dtype: np.dtype | type) -> None:
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(f"token dtype must be one of {[d.name for d in _CODE_OF]}, got {self.dtype.name}")
        self._info = np.iinfo(self.dtype)
        directory = os.path.dirname(os.path.abspath(prefix))
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"output directory {directory} does not exist")
        base = os.path.basename(prefix)
        fd, self._bin_tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=".bin.tmp", dir=directory)
        self._bin = os.fdopen(fd, "wb")
        self._lengths: list[int] = []
        self._boundaries: list[int] = [0]
        self._done = False

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one document of one sequence."""
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise ValueError(f"a document is a 1-d sequence of token ids, got shape {array.shape}")
        if array.size:
            if not np.issubdtype(array.dtype, np.integer):
                raise ValueError(f"token ids must be integers, got dtype {array.dtype}")
            low, high = int(array.min()), int(array.max())
            if low < self._info.min or high > self._info.max:
                raise ValueError(f"token ids [{low}, {high}] do not fit {self.dtype.name} "
                                 f"({self._info.min}..{self._info.max}); choose a wider dtype")
        self._bin.write(array.astype(self.dtype, copy=False).tobytes())
        self._lengths.append(int(array.size))
        self._boundaries.append(len(self._lengths))

    def add_dataset(self, dataset: IndexedDataset) -> None:
        """Append every document of `dataset` unchanged (same sequences, same document grouping)."""
        if dataset.dtype != self.dtype:
            raise ValueError(f"{dataset.prefix} holds {dataset.dtype.name} tokens, the output holds "
                             f"{self.dtype.name}; merge datasets of one tokenizer only")
        with open(data_file_paths(dataset.prefix)[0], "rb") as src:
            while chunk := src.read(1 << 24):
                self._bin.write(chunk)
        start = len(self._lengths)
        self._lengths.extend(dataset.sequence_lengths.tolist())
        self._boundaries.extend((dataset.document_indices[1:] + start).tolist())

    def finalize(self) -> None:
        """Write the `.idx` and move both files into place (the `.bin` first: see `_read_index`)."""
        if self._done:
            raise RuntimeError(f"{self.prefix}: writer already finalized or aborted")
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype="<i4")
        pointers = np.zeros(len(lengths), dtype="<i8")
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        boundaries = np.asarray(self._boundaries, dtype="<i8")
        directory = os.path.dirname(self._bin_tmp)
        fd, idx_tmp = tempfile.mkstemp(prefix=f".{os.path.basename(self.prefix)}.", suffix=".idx.tmp", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[self.dtype], len(lengths), len(boundaries)))
                f.write(lengths.tobytes())
                f.write(pointers.tobytes())
                f.write(boundaries.tobytes())
            bin_path, idx_path = data_file_paths(self.prefix)
            apply_umask(self._bin_tmp)
            apply_umask(idx_tmp)
            # A reader that opens the pair between these two renames sees a size mismatch and says so.
            os.replace(self._bin_tmp, bin_path)
            os.replace(idx_tmp, idx_path)
        except BaseException:
            for path in (self._bin_tmp, idx_tmp):
                if os.path.exists(path):
                    os.unlink(path)
            raise
        finally:
            self._done = True

    def abort(self) -> None:
        """Discard everything written so far."""
        if self._done:
            return
        self._bin.close()
        os.unlink(self._bin_tmp)
        self._done = True

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def write_dataset(prefix: str, documents: Iterable[Sequence[int] | np.ndarray], dtype: np.dtype | type) -> None:
    """Write `documents` (one sequence each) as the dataset `prefix`."""
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for tokens in documents:
            writer.add_document(tokens)


def merge_datasets(prefixes: Sequence[str], output_prefix: str) -> IndexedDataset:
    """Concatenate datasets of one dtype, in the order given, into `output_prefix`."""
    if not prefixes:
        raise ValueError("nothing to merge: no input datasets")
    inputs = [IndexedDataset(p) for p in prefixes]
    out = os.path.abspath(output_prefix)
    if out in {os.path.abspath(p) for p in prefixes}:
        raise ValueError(f"output {output_prefix} is also an input")
    with IndexedDatasetWriter(output_prefix, inputs[0].dtype) as writer:
        for dataset in inputs:
            writer.add_dataset(dataset)
    return IndexedDataset(output_prefix)
