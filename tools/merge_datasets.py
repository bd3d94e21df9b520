"""Concatenate indexed datasets (`.bin` + `.idx`) of one tokenizer into one.

    python tools/merge_datasets.py --input data/shards --output-prefix data/all_text_document
    python tools/merge_datasets.py --input data/a_text_document data/b_text_document --output-prefix data/ab

Each `--input` is a dataset prefix or a directory, whose datasets are merged in sorted name order.
Documents keep their order and grouping. Bad input prints one line on stderr and exits with status 2;
the output appears only when complete.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

# Runnable as `python tools/merge_datasets.py` from a checkout without installing the package.
_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from megatron_pp.cli import OneLineArgumentParser, UsageError  # noqa: E402
from megatron_pp.data.indexed import data_file_paths, merge_datasets  # noqa: E402

_PROG = "merge_datasets.py"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog=_PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True,
                        help="dataset prefixes, or directories whose .bin/.idx pairs are merged in sorted order")
    parser.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX.bin/.idx")
    return parser


def expand_inputs(inputs: Sequence[str]) -> list[str]:
    """Dataset prefixes named by `--input` values (a directory stands for every pair in it)."""
    prefixes = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(os.path.join(item, name[:-4]) for name in os.listdir(item)
                           if name.endswith(".idx") and os.path.isfile(os.path.join(item, name[:-4] + ".bin")))
            if not found:
                raise UsageError(f"--input {item}: directory holds no .bin/.idx pairs")
            prefixes += found
        else:
            missing = [p for p in data_file_paths(item) if not os.path.isfile(p)]
            if missing:
                raise UsageError(f"--input {item}: {missing[0]}: no such file")
            prefixes.append(item)
    return prefixes


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        merged = merge_datasets(expand_inputs(args.input), args.output_prefix)
    except (UsageError, ValueError, OSError) as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.output_prefix}.bin/.idx: {merged.num_documents} documents, {merged.num_tokens} tokens "
          f"({merged.dtype.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
