"""Train a tokenizer on a local JSON-lines corpus (nothing can be downloaded at run time).

    python tools/train_tokenizer.py --input corpus.jsonl --tokenizer-type GPT2BPETokenizer \\
        --vocab-size 32000 --output-dir tokenizers/bpe32k

GPT2BPETokenizer / HuggingFaceTokenizer train a GPT-2 style byte-level BPE (`tokenizer.json`,
`vocab.json`, `merges.txt`; end of document `<|endoftext|>`); SentencePieceTokenizer trains a
LLaMA-style SentencePiece BPE (`tokenizer.model`; end of document `</s>`). The last line printed is
the tokenizer flags for `tools/preprocess_data.py` and `pretrain_gpt.py`. Bad input prints one line
on stderr and exits with status 2.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

# Runnable as `python tools/train_tokenizer.py` from a checkout without installing the package.
_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from megatron_pp.cli import OneLineArgumentParser, UsageError  # noqa: E402
from megatron_pp.data.preprocess import BadLine, iter_corpus_texts  # noqa: E402
from megatron_pp.data.tokenizers import describe_tokenizer_files, train_bpe, train_sentencepiece  # noqa: E402

_PROG = "train_tokenizer.py"
_BAD_LINES_SHOWN = 20
_TYPES = ("GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog=_PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="JSON-lines files (.jsonl, .jsonl.gz, .jsonl.zst)")
    parser.add_argument("--json-keys", nargs="+", default=["text"],
                        help="keys whose text is trained on (default: text)")
    parser.add_argument("--tokenizer-type", required=True, help=" | ".join(_TYPES))
    parser.add_argument("--vocab-size", type=int, required=True, help="vocabulary size to train")
    parser.add_argument("--output-dir", required=True, help="directory for the tokenizer files (created if needed)")
    parser.add_argument("--skip-bad-lines", action="store_true", help="skip and report bad lines instead of stopping")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        missing = [path for path in args.input if not os.path.isfile(path)]
        if missing:
            raise UsageError(f"--input {missing[0]}: no such file")
        if args.tokenizer_type not in _TYPES:
            raise UsageError(f"--tokenizer-type {args.tokenizer_type!r} cannot be trained here; "
                              f"one of {', '.join(_TYPES)}")
        if args.vocab_size < 1:
            raise UsageError(f"--vocab-size must be >= 1, got {args.vocab_size}")
        skipped = []
        texts = iter_corpus_texts(args.input, args.json_keys, skip_bad_lines=args.skip_bad_lines,
                                  on_bad_line=skipped.append)
        train = train_sentencepiece if args.tokenizer_type == "SentencePieceTokenizer" else train_bpe
        files = train(texts, args.vocab_size, args.output_dir)
    except BadLine as exc:
        print(f"{_PROG}: error: {exc}; pass --skip-bad-lines to skip such lines", file=sys.stderr)
        return 2
    except (UsageError, ValueError, OSError) as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return 2
    for bad in skipped[:_BAD_LINES_SHOWN]:
        print(f"{_PROG}: warning: skipped {bad}", file=sys.stderr)
    if len(skipped) > _BAD_LINES_SHOWN:
        print(f"{_PROG}: warning: {len(skipped)} bad lines skipped in all", file=sys.stderr)
    print("wrote " + ", ".join(sorted(files.values())))
    print(describe_tokenizer_files(args.tokenizer_type, files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
