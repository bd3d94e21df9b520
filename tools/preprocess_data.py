"""Tokenize a JSON-lines corpus into Megatron indexed datasets (`.bin` + `.idx`), with Megatron's flags.

    python tools/preprocess_data.py --input corpus.jsonl.zst --json-keys text --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt --append-eod --workers 8

writes `data/corpus_text_document.bin/.idx`, for `pretrain_gpt.py --data-path data/corpus_text_document`.
Input may be `.jsonl`, `.jsonl.gz` or `.jsonl.zst`. A line that is not a JSON object with the keys as
strings stops the run with its line number, or with `--skip-bad-lines` is skipped and reported. The
output is identical for any `--workers`. Bad input prints one line on stderr and exits with status 2;
nothing is written unless the whole corpus succeeds.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

# Runnable as `python tools/preprocess_data.py` from a checkout without installing the package.
_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from megatron_pp.cli import OneLineArgumentParser, UsageError  # noqa: E402
from megatron_pp.data.preprocess import BadLine, preprocess_jsonl  # noqa: E402
from megatron_pp.data.tokenizers import TOKENIZER_TYPES, check_tokenizer_args  # noqa: E402

_PROG = "preprocess_data.py"
_BAD_LINES_SHOWN = 20


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog=_PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="JSON-lines corpus (.jsonl, .jsonl.gz or .jsonl.zst)")
    parser.add_argument("--json-keys", nargs="+", default=["text"],
                        help="keys to tokenize; one output dataset per key (default: text)")
    parser.add_argument("--output-prefix", required=True,
                        help="writes {output_prefix}_{key}_document.bin/.idx (the directory must exist)")
    parser.add_argument("--tokenizer-type", required=True, help=" | ".join(TOKENIZER_TYPES))
    parser.add_argument("--tokenizer-model", default=None,
                        help="SentencePiece .model, tokenizer.json or a local Hugging Face tokenizer directory")
    parser.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocab.json")
    parser.add_argument("--merge-file", default=None, help="GPT-2 BPE merges.txt")
    parser.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer vocabulary size")
    parser.add_argument("--eod-token", default=None, help="end-of-document token (default: <|endoftext|>, </s> "
                                                          "or the tokenizer's eos token)")
    parser.add_argument("--no-special-tokens", action="store_true",
                        help="HuggingFaceTokenizer: do not add the tokenizer's special tokens (e.g. BOS) to each "
                             "document; Megatron-LM adds them, so the default does too")
    parser.add_argument("--append-eod", action="store_true", help="append the end-of-document token to every document")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    parser.add_argument("--skip-bad-lines", action="store_true",
                        help="skip and report lines that are not JSON objects with the keys as strings "
                             "(default: stop at the first)")
    return parser


def _input_errors(args: argparse.Namespace) -> list[str]:
    errors = []
    if not os.path.isfile(args.input):
        errors.append(f"--input {args.input}: no such file")
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(out_dir):
        errors.append(f"--output-prefix {args.output_prefix}: directory {out_dir} does not exist")
    if args.workers < 1:
        errors.append(f"--workers must be >= 1, got {args.workers}")
    return errors + check_tokenizer_args(args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                                         vocab_file=args.vocab_file, merge_file=args.merge_file,
                                         vocab_size=args.vocab_size)


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        errors = _input_errors(args)
        if errors:
            raise UsageError(errors[0])
        shown = 0

        def report(bad: BadLine) -> None:
            nonlocal shown
            shown += 1
            if shown <= _BAD_LINES_SHOWN:
                print(f"{_PROG}: warning: skipped {bad}", file=sys.stderr)

        tokenizer_args = dict(tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                              vocab_file=args.vocab_file, merge_file=args.merge_file, vocab_size=args.vocab_size,
                              eod_token=args.eod_token, add_special_tokens=not args.no_special_tokens)
        result = preprocess_jsonl(args.input, args.output_prefix, tokenizer_args, json_keys=args.json_keys,
                                  append_eod=args.append_eod, workers=args.workers,
                                  skip_bad_lines=args.skip_bad_lines, on_bad_line=report,
                                  progress=sys.stderr.isatty())
    except BadLine as exc:
        print(f"{_PROG}: error: {exc}; pass --skip-bad-lines to skip such lines", file=sys.stderr)
        return 2
    except (UsageError, ValueError, OSError) as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return 2
    for key, prefix in result.outputs.items():
        print(f"{prefix}.bin/.idx: {result.documents} documents, {result.tokens[key]} tokens ({result.dtype})")
    if result.bad_lines:
        lines = ", ".join(str(bad.line) for bad in result.bad_lines[:_BAD_LINES_SHOWN])
        more = " ..." if len(result.bad_lines) > _BAD_LINES_SHOWN else ""
        print(f"{len(result.bad_lines)} bad lines skipped (lines {lines}{more})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
