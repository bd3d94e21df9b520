"""Tokenizers under Megatron-LM's type names, and training new ones on a local corpus.

`build_tokenizer(type, ...)` returns an object with `.vocab_size`, `.eod` (the end-of-document id that
`--append-eod` appends and `--eod-mask-loss` masks), `.tokenize(text) -> list[int]` and
`.detokenize(ids) -> str`:

    GPT2BPETokenizer        byte-level BPE from --vocab-file vocab.json + --merge-file merges.txt
                            (or a tokenizer.json as --tokenizer-model), via the `tokenizers` package
    SentencePieceTokenizer  a SentencePiece --tokenizer-model file (LLaMA's tokenizer.model)
    HuggingFaceTokenizer    --tokenizer-model: a bare tokenizer.json file, or a saved tokenizer directory;
                            adds the tokenizer's special tokens (BOS) as Megatron-LM's does, unless
                            add_special_tokens=False (preprocess_data.py --no-special-tokens)
    NullTokenizer           ids written as decimal text ("5 17 3"), for mock and pre-tokenized data

Nothing is ever fetched from a model hub: paths must exist locally (a missing directory would
otherwise be taken for a hub repository name, and the lookup stalls without a network), and the
Hugging Face libraries are put into offline mode before they are imported. The end-of-document id is
`--eod-token` when given, else the first of `<|endoftext|>`, `</s>` and the tokenizer's own eos token
that the vocabulary has.

The embedding pads this vocabulary to a multiple of 128 × tp (`TransformerConfig.padded_vocab_size`);
the tokenizer reports the unpadded size. `train_bpe` and `train_sentencepiece` build tokenizers from
text, since none can be downloaded at run time (`tools/train_tokenizer.py` is their command line).
"""
from __future__ import annotations

import io
import os
import tempfile
from abc import ABC, abstractmethod
from typing import Callable, Iterable, Optional, Sequence

import sentencepiece
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as RustTokenizer

TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer", "NullTokenizer")
EOD_CANDIDATES = ("<|endoftext|>", "</s>")
BPE_EOD = "<|endoftext|>"


class Tokenizer(ABC):
    """Text ↔ token ids, plus the vocabulary size and the end-of-document id."""

    vocab_size: int
    eod: int

    @abstractmethod
    def tokenize(self, text: str) -> list[int]: ...

    @abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str: ...


def _resolve_eod(lookup: Callable[[str], Optional[int]], eos_token: Optional[str], eod_token: Optional[str],
                 source: str) -> int:
    """Id of `eod_token` if given, else of the first known end-of-document token the vocabulary has."""
    if eod_token is not None:
        token_id = lookup(eod_token)
        if token_id is None:
            raise ValueError(f"--eod-token {eod_token!r} is not in the vocabulary of {source}")
        return token_id
    for candidate in (*EOD_CANDIDATES, eos_token):
        token_id = lookup(candidate) if candidate else None
        if token_id is not None:
            return token_id
    raise ValueError(f"{source} has none of {', '.join(EOD_CANDIDATES)} and no eos token; "
                     f"name its end-of-document token with --eod-token")


class FastTokenizer(Tokenizer):
    """A Rust `tokenizers.Tokenizer` ("fast" in Hugging Face terms): GPT-2 byte-level BPE, or any tokenizer.json."""

    def __init__(self, tokenizer: RustTokenizer, source: str, eod_token: Optional[str] = None,
                 add_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._add_special_tokens = add_special_tokens
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eod = _resolve_eod(tokenizer.token_to_id, None, eod_token, source)

    @classmethod
    def from_vocab_and_merges(cls, vocab_file: str, merge_file: str,
                              eod_token: Optional[str] = None) -> "FastTokenizer":
        tokenizer = RustTokenizer(models.BPE.from_file(vocab_file, merge_file))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        # GPT-2's vocabulary carries <|endoftext|> as an ordinary entry; registering it as special
        # makes the literal string in a document map to its id, as GPT-2's own tokenizer does.
        if tokenizer.token_to_id(BPE_EOD) is not None:
            tokenizer.add_special_tokens([AddedToken(BPE_EOD, special=True)])
        return cls(tokenizer, vocab_file, eod_token)

    @classmethod
    def from_file(cls, tokenizer_json: str, eod_token: Optional[str] = None,
                  add_special_tokens: bool = False) -> "FastTokenizer":
        try:
            tokenizer = RustTokenizer.from_file(tokenizer_json)
        except Exception as exc:  # the Rust library raises a bare Exception on a malformed file
            raise ValueError(f"{tokenizer_json} is not a readable tokenizer.json: {exc}") from None
        return cls(tokenizer, tokenizer_json, eod_token, add_special_tokens)

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=self._add_special_tokens).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


class HuggingFaceDirectoryTokenizer(Tokenizer):
    """A tokenizer directory saved by `transformers` (tokenizer.json or tokenizer.model + configs)."""

    def __init__(self, directory: str, eod_token: Optional[str] = None, add_special_tokens: bool = True) -> None:
        self._add_special_tokens = add_special_tokens
        # Imported here: transformers takes seconds to import and must see the offline switch first.
        _set_hf_offline()
        from transformers import AutoTokenizer

        try:
            self._tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"--tokenizer-model {directory} is not a loadable tokenizer directory: {exc}") from None
        self.vocab_size = len(self._tokenizer)
        vocab = self._tokenizer.get_vocab()
        self.eod = _resolve_eod(vocab.get, self._tokenizer.eos_token, eod_token, directory)

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=self._add_special_tokens)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model; no BOS is added, the end-of-document id defaults to the model's `</s>`."""

    def __init__(self, model_file: str, eod_token: Optional[str] = None) -> None:
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(model_file)
        except (OSError, RuntimeError) as exc:
            raise ValueError(f"--tokenizer-model {model_file} is not a SentencePiece model: {exc}") from None
        self.vocab_size = self._sp.get_piece_size()
        unk = self._sp.unk_id()

        def lookup(piece: str) -> Optional[int]:
            token_id = self._sp.piece_to_id(piece)
            return None if token_id == unk and piece != self._sp.id_to_piece(unk) else token_id

        eos = self._sp.eos_id()
        self.eod = _resolve_eod(lookup, self._sp.id_to_piece(eos) if eos >= 0 else None, eod_token, model_file)

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode(list(ids))


class NullTokenizer(Tokenizer):
    """Text is whitespace-separated decimal ids. The end-of-document id is `vocab_size` itself, so the
    vocabulary has `vocab_size + 1` entries, 0..vocab_size (Megatron's convention)."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 1:
            raise ValueError(f"NullTokenizer needs --vocab-size >= 1, got {vocab_size}")
        self.vocab_size = vocab_size + 1
        self.eod = vocab_size

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(word) for word in text.split()]
        except ValueError:
            raise ValueError(f"NullTokenizer reads whitespace-separated integers, got {text[:40]!r}") from None
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"NullTokenizer: id {bad[0]} outside the vocabulary 0..{self.vocab_size - 1}")
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def _set_hf_offline() -> None:
    # Read by huggingface_hub at import: set before transformers is first imported in this process.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def check_tokenizer_args(tokenizer_type: Optional[str], *, tokenizer_model: Optional[str] = None,
                         vocab_file: Optional[str] = None, merge_file: Optional[str] = None,
                         vocab_size: Optional[int] = None) -> list[str]:
    """Problems with the tokenizer flags, one line each, found without loading anything."""
    if tokenizer_type is None:
        return ["--tokenizer-type is required with file datasets (one of " + ", ".join(TOKENIZER_TYPES) + ")"]
    if tokenizer_type not in TOKENIZER_TYPES:
        return [f"unknown --tokenizer-type {tokenizer_type!r}; known: {', '.join(TOKENIZER_TYPES)}"]
    errors: list[str] = []

    def need_file(flag: str, path: Optional[str], what: str) -> None:
        if path is None:
            errors.append(f"--tokenizer-type {tokenizer_type} needs {flag} ({what})")
        elif not os.path.isfile(path):
            errors.append(f"{flag} {path}: no such file")

    if tokenizer_type == "GPT2BPETokenizer":
        if tokenizer_model is not None and vocab_file is None and merge_file is None:
            need_file("--tokenizer-model", tokenizer_model, "a tokenizer.json")
        else:
            need_file("--vocab-file", vocab_file, "vocab.json")
            need_file("--merge-file", merge_file, "merges.txt")
    elif tokenizer_type == "SentencePieceTokenizer":
        need_file("--tokenizer-model", tokenizer_model, "a SentencePiece .model file")
    elif tokenizer_type == "HuggingFaceTokenizer":
        if tokenizer_model is None:
            errors.append("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a tokenizer.json or a "
                          "tokenizer directory)")
        elif not os.path.exists(tokenizer_model):
            errors.append(f"--tokenizer-model {tokenizer_model}: no such file or directory (models are never "
                          f"downloaded: give a local tokenizer.json or tokenizer directory)")
    elif vocab_size is None or vocab_size < 1:
        errors.append(f"--tokenizer-type NullTokenizer needs --vocab-size >= 1, got {vocab_size}")
    return errors


def build_tokenizer(tokenizer_type: str, *, tokenizer_model: Optional[str] = None, vocab_file: Optional[str] = None,
                    merge_file: Optional[str] = None, vocab_size: Optional[int] = None,
                    eod_token: Optional[str] = None, add_special_tokens: bool = True) -> Tokenizer:
    """The tokenizer named by Megatron's `--tokenizer-type` and its file flags (see the module doc).

    `add_special_tokens` (HuggingFaceTokenizer only): whatever the tokenizer's post-processor adds to each
    text, e.g. LLaMA's BOS, as Megatron-LM's HuggingFaceTokenizer does (it calls the tokenizer with its
    defaults); the other types never add any, as in Megatron-LM.
    """
    errors = check_tokenizer_args(tokenizer_type, tokenizer_model=tokenizer_model, vocab_file=vocab_file,
                                  merge_file=merge_file, vocab_size=vocab_size)
    if errors:
        raise ValueError(errors[0])
    if tokenizer_type == "GPT2BPETokenizer":
        if vocab_file is None:
            return FastTokenizer.from_file(tokenizer_model, eod_token)
        return FastTokenizer.from_vocab_and_merges(vocab_file, merge_file, eod_token)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model, eod_token)
    if tokenizer_type == "HuggingFaceTokenizer":
        if os.path.isdir(tokenizer_model):
            return HuggingFaceDirectoryTokenizer(tokenizer_model, eod_token, add_special_tokens)
        return FastTokenizer.from_file(tokenizer_model, eod_token, add_special_tokens)
    if eod_token is not None:
        raise ValueError("--eod-token does not apply to NullTokenizer (its end-of-document id is --vocab-size)")
    return NullTokenizer(vocab_size)


def _publish(files: dict[str, str], output_dir: str) -> dict[str, str]:
    """Move finished files from a temporary directory into output_dir; returns their final paths."""
    os.makedirs(output_dir, exist_ok=True)
    final = {}
    for name, tmp_path in files.items():
        final[name] = os.path.join(output_dir, name)
        os.replace(tmp_path, final[name])
    return final


def train_bpe(texts: Iterable[str], vocab_size: int, output_dir: str, *, min_frequency: int = 2) -> dict[str, str]:
    """Train a GPT-2 style byte-level BPE with `<|endoftext|>` as id 0.

    Writes `tokenizer.json` (for `HuggingFaceTokenizer`/`GPT2BPETokenizer --tokenizer-model`) and
    `vocab.json` + `merges.txt` (for `GPT2BPETokenizer --vocab-file/--merge-file`) into output_dir;
    returns {file name: path}. Deterministic for the same texts in the same order.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ValueError(f"--vocab-size {vocab_size} is too small for byte-level BPE (at least {len(alphabet) + 1}: "
                         f"256 bytes and {BPE_EOD})")
    tokenizer = RustTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[BPE_EOD],
                                  initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    os.makedirs(output_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output_dir, prefix=".train-") as tmp:
        tokenizer.save(os.path.join(tmp, "tokenizer.json"))
        tokenizer.model.save(tmp)
        return _publish({name: os.path.join(tmp, name) for name in ("tokenizer.json", "vocab.json", "merges.txt")},
                        output_dir)


def train_sentencepiece(texts: Iterable[str], vocab_size: int, output_dir: str) -> dict[str, str]:
    """Train a LLaMA-style SentencePiece BPE (unk 0, `<s>` 1, `</s>` 2, byte fallback, split digits).

    Whitespace and newlines are kept as they are (identity normalisation), so text round-trips.
    SentencePiece reads sentences, so each text is fed line by line. Writes `tokenizer.model`;
    returns {"tokenizer.model": path}.
    """
    # SentencePiece reports an exception raised by the iterator as its own RuntimeError; keep the
    # original (e.g. a corpus error naming file and line) to re-raise it.
    failure: list[Exception] = []

    def lines() -> Iterable[str]:
        try:
            for text in texts:
                yield from (line for line in text.split("\n") if line.strip())
        except Exception as exc:
            failure.append(exc)
            raise

    model = io.BytesIO()
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=lines(), model_writer=model, vocab_size=vocab_size, model_type="bpe",
            byte_fallback=True, split_digits=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            normalization_rule_name="identity", remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
            character_coverage=0.9999, max_sentence_length=1 << 16, hard_vocab_limit=False, minloglevel=2,
            num_threads=max(1, min(4, os.cpu_count() or 1)),
        )
    except RuntimeError as exc:
        if failure:
            raise failure[0] from None
        raise ValueError(f"SentencePiece training failed: {exc}") from None
    os.makedirs(output_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output_dir, prefix=".train-") as tmp:
        path = os.path.join(tmp, "tokenizer.model")
        with open(path, "wb") as f:
            f.write(model.getvalue())
        return _publish({"tokenizer.model": path}, output_dir)


def describe_tokenizer_files(tokenizer_type: str, files: dict[str, str]) -> str:
    """The preprocess/pretrain flags that select a tokenizer written by train_bpe/train_sentencepiece."""
    if tokenizer_type == "SentencePieceTokenizer":
        return f"--tokenizer-type SentencePieceTokenizer --tokenizer-model {files['tokenizer.model']}"
    if tokenizer_type == "GPT2BPETokenizer":
        return (f"--tokenizer-type GPT2BPETokenizer --vocab-file {files['vocab.json']} "
                f"--merge-file {files['merges.txt']}")
    return f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {files['tokenizer.json']}"

