"""Write the first N samples a job reads, in the order it reads them, to diff against Megatron-LM's dataset.

    python tools/print_samples.py --data-path 0.3 data/a_text_document 0.7 data/b_text_document \
        --split 969,30,1 --seq-length 2048 --seed 1234 --train-iters 1000 --global-batch-size 256 \
        --num-samples 512 --json samples.jsonl

Give the job's data and batch flags (the rest of a pretrain_gpt.py command line may stay: flags this tool
does not know are ignored). Each output line is one sample, a JSON list of seq_length + 1 token ids:
tokens are its first seq_length, labels its last. At dp 1 a job consumes samples in index order from
`--first-sample` (a checkpoint's consumed_samples); at dp > 1 each global batch holds the same samples, rank r
taking micro-batch slices r·mbs of every mbs·dp. `--split-name valid` prints the validation samples
(evaluation k reads the k-th block of eval_iters global batches). Bad flags: one line, exit status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_pp.cli import ExitingArgumentParser  # noqa: E402
from megatron_pp.training.batch_ramp import BatchSizes  # noqa: E402
from megatron_pp.data.builder import (  # noqa: E402
    SPLIT_NAMES, add_data_args, build_datasets, check_data_args, data_config_from_args, split_sample_counts,
)


def build_parser() -> argparse.ArgumentParser:
    parser = ExitingArgumentParser(prog="print_samples.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-length", type=int, required=True, help="tokens per sample fed to the model")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the shuffles (the job's --seed)")
    parser.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer's vocabulary (unused here)")
    parser.add_argument("--train-iters", type=int, default=None, help="the job's iterations")
    parser.add_argument("--train-samples", type=int, default=None, help="the job's samples (instead of iterations)")
    parser.add_argument("--global-batch-size", type=int, required=True, help="samples per iteration")
    parser.add_argument("--rampup-batch-size", nargs=3, type=int, default=None,
                        metavar=("START", "INCREMENT", "SAMPLES"), help="the job's batch-size ramp-up: it sets the run's iterations, hence the validation count")
    parser.add_argument("--eval-iters", type=int, default=100, help="global batches per evaluation (default 100)")
    parser.add_argument("--eval-interval", type=int, default=None, help="iterations between evaluations")
    parser.add_argument("--num-samples", type=int, required=True, help="samples to write")
    parser.add_argument("--first-sample", type=int, default=0, help="start here (a checkpoint's consumed_samples)")
    parser.add_argument("--split-name", choices=SPLIT_NAMES, default="train", help="which split (default train)")
    parser.add_argument("--json", required=True, help="output: one JSON list of token ids per line")
    add_data_args(parser)
    return parser


def _errors(args: argparse.Namespace) -> list[str]:
    errors = []
    if (args.train_iters is None) == (args.train_samples is None):
        errors.append("give one of --train-iters and --train-samples")
    for flag in ("seq_length", "global_batch_size", "num_samples"):
        if getattr(args, flag) < 1:
            errors.append(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.first_sample < 0:
        errors.append(f"--first-sample must be >= 0, got {args.first_sample}")
    config = data_config_from_args(args, seq_length=args.seq_length)
    # The tokenizer is not needed to read samples: only the dataset flags are checked.
    return errors + [e for e in check_data_args(config, mock_data=False) if "tokenizer" not in e]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, _ignored = build_parser().parse_known_args(argv)
    errors = _errors(args)
    if errors:
        print(f"print_samples.py: error: {errors[0]}", file=sys.stderr)
        return 2
    train_samples = args.train_samples or args.train_iters * args.global_batch_size
    # The job's iterations (the batch-size ramp-up's included, as Megatron-LM counts them) decide how many
    # validation samples it asks for, hence the validation split's order.
    train_iters = args.train_iters or BatchSizes.from_args(args).train_iters(train_samples)
    counts = split_sample_counts(train_samples, args.global_batch_size, args.eval_iters, args.eval_interval,
                                 train_iters)
    split = SPLIT_NAMES.index(args.split_name)
    if args.split_name != "test":  # the job builds no test split (it never reads one): nor is it needed here
        counts = (counts[0], counts[1], 0)
    try:
        datasets = build_datasets(data_config_from_args(args, seq_length=args.seq_length), counts, eod_id=0)
    except ValueError as exc:  # DataFlagError, CacheMismatch: the flags or the cache directory
        print(f"print_samples.py: error: {exc}", file=sys.stderr)
        return 2
    dataset = datasets[split]
    if dataset is None:
        print(f"print_samples.py: error: --split {args.split} and the batch flags give no {args.split_name} samples",
              file=sys.stderr)
        return 2
    last = args.first_sample + args.num_samples
    if last > len(dataset):
        print(f"print_samples.py: error: --num-samples: the {args.split_name} split holds {len(dataset)} samples, "
              f"fewer than {last}", file=sys.stderr)
        return 2
    with open(args.json + ".tmp", "w") as f:
        for index in range(args.first_sample, last):
            f.write(json.dumps(dataset.sample(index).tolist()) + "\n")
    os.replace(args.json + ".tmp", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
