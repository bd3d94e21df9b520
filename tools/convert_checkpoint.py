"""Convert checkpoints between Hugging Face, megatron_pp and Megatron-LM (torch and torch_dist formats), or reshard.

    # Hugging Face LLaMA / GPT-2 -> megatron_pp for tp=2, pp=2 (then train with --load OUT --finetune)
    python tools/convert_checkpoint.py --source-format hf --target-format megatron_pp \
        --load-dir llama-hf --save-dir llama-tp2pp2 \
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2
    # megatron_pp -> Hugging Face (loadable with from_pretrained)
    python tools/convert_checkpoint.py --source-format megatron_pp --target-format hf \
        --load-dir checkpoints/run1 --save-dir run1-hf --tokenizer-dir llama-hf
    # reshard: any tp / pp / virtual stages / uneven split / the V placement of zb-v and v-half
    python tools/convert_checkpoint.py --source-format megatron_pp --target-format megatron_pp \
        --load-dir llama-tp2pp2 --save-dir llama-pp4vp2 --target-pipeline-parallel-size 4 \
        --target-num-virtual-stages-per-pipeline-rank 2
    # Megatron-LM torch-format checkpoint (mp_rank_*/model_optim_rng.pt) -> megatron_pp
    python tools/convert_checkpoint.py --source-format megatron_lm --target-format megatron_pp \
        --load-dir megatron-ckpt --save-dir ours --true-vocab-size 50257
    # megatron_pp -> Megatron-LM: torch format for tp=2, pp=2 (or --target-format torch_dist)
    python tools/convert_checkpoint.py --source-format megatron_pp --target-format megatron_lm \
        --load-dir checkpoints/run1 --save-dir run1-megatron \
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2

Weights stream one tensor at a time; the output appears only when complete, in a --save-dir that must
be new or empty. Bad input prints one line on stderr and exits with status 2. See
docs/checkpoint_conversion.md for the layouts and conventions.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Optional, Sequence

# Runnable as `python tools/convert_checkpoint.py` from a checkout without installing the package.
_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from megatron_pp.cli import OneLineArgumentParser, UsageError  # noqa: E402
from megatron_pp.convert import (  # noqa: E402
    DEFAULT_MAX_SHARD_BYTES,
    SOURCE_FORMATS,
    TARGET_FORMATS,
    TRANSFORMER_IMPLS,
    TargetLayout,
    convert_checkpoint,
    training_flags,
)

_PROG = "convert_checkpoint.py"
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """Bytes in '5GB', '500MiB' or '1000000' (decimal units as in Hugging Face's max_shard_size)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 5GB, 500MiB or 1000000")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog=_PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--source-format", choices=SOURCE_FORMATS, required=True)
    parser.add_argument("--target-format", choices=TARGET_FORMATS, required=True)
    parser.add_argument("--load-dir", required=True,
                        help="Hugging Face model directory, megatron_pp --save directory (or one iter_* in it), or "
                             "Megatron-LM checkpoint directory (torch or torch_dist format)")
    parser.add_argument("--save-dir", required=True, help="new or empty directory for the result")

    layout = parser.add_argument_group("target layout of megatron_pp and Megatron-LM targets (the training run's "
                                       "flags, with --target-)")
    layout.add_argument("--target-tensor-parallel-size", type=int, default=1)
    layout.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    layout.add_argument("--target-num-virtual-stages-per-pipeline-rank", type=int, default=None)
    layout.add_argument("--target-num-layers-per-virtual-pipeline-stage", type=int, default=None)
    layout.add_argument("--target-decoder-first-pipeline-num-layers", type=int, default=None)
    layout.add_argument("--target-decoder-last-pipeline-num-layers", type=int, default=None)
    layout.add_argument("--target-account-for-embedding-in-pipeline-split", action="store_true")
    layout.add_argument("--target-account-for-loss-in-pipeline-split", action="store_true")
    layout.add_argument("--target-pipeline-schedule", default=None, metavar="NAME",
                        help="the run's --pipeline-schedule: it places the stages on ranks (zb-v and v-half: stages r "
                             "and 2p-1-r on rank r, two per rank) and so decides an uneven split (default: the "
                             "interleaved placement, stage g on rank g mod p, of every other schedule)")
    layout.add_argument("--make-vocab-size-divisible-by", type=int, default=None,
                        help="vocabulary padding rule of a megatron_pp target (default: the source's, else 128)")

    other = parser.add_argument_group("other")
    other.add_argument("--target-params-dtype", choices=sorted(_DTYPES), default=None,
                       help="cast the weights (default: keep the source's dtype)")
    other.add_argument("--tokenizer-dir", default=None,
                       help="take the tokenizer files from here instead of from the source checkpoint")
    other.add_argument("--true-vocab-size", type=int, default=None,
                       help="the real vocabulary size: embedding rows beyond it are dropped (e.g. set it to the "
                            "tokenizer's size); Megatron-LM default: args.vocab_size, else the padded size")
    other.add_argument("--target-transformer-impl", choices=TRANSFORMER_IMPLS, default="transformer_engine",
                       help="Megatron-LM targets: the --transformer-impl the checkpoint will be loaded with; it "
                            "decides the norms' names in the torch format (default: Megatron-LM's, "
                            "transformer_engine)")
    other.add_argument("--max-shard-size", type=parse_size, default=DEFAULT_MAX_SHARD_BYTES,
                       help="Hugging Face targets: largest safetensors file (default 5GiB)")
    other.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        layout = TargetLayout(
            tp=args.target_tensor_parallel_size,
            pp=args.target_pipeline_parallel_size,
            vp=args.target_num_virtual_stages_per_pipeline_rank,
            layers_per_virtual_stage=args.target_num_layers_per_virtual_pipeline_stage,
            first_stage_layers=args.target_decoder_first_pipeline_num_layers,
            last_stage_layers=args.target_decoder_last_pipeline_num_layers,
            account_for_embedding=args.target_account_for_embedding_in_pipeline_split,
            account_for_loss=args.target_account_for_loss_in_pipeline_split,
            schedule=args.target_pipeline_schedule,
        )
        if not os.path.isdir(args.load_dir):
            raise UsageError(f"--load-dir {args.load_dir} is not a directory")
        result = convert_checkpoint(
            args.source_format, args.target_format, args.load_dir, args.save_dir, layout=layout,
            dtype=_DTYPES[args.target_params_dtype] if args.target_params_dtype else None,
            tokenizer_dir=args.tokenizer_dir, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
            true_vocab_size=args.true_vocab_size, max_shard_bytes=args.max_shard_size,
            transformer_impl=args.target_transformer_impl, progress=not args.no_progress,
        )
    except (UsageError, ValueError, OSError) as exc:
        print(f"{_PROG}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(f"{result.save_dir}: {args.target_format} checkpoint, {len(result.files)} weight file(s)")
    if result.stages is not None:
        split = ", ".join(f"{s.layer_start}-{s.layer_end}" for s in result.stages)
        print(f"layers per global stage: [{split}]")
    if args.target_format == "megatron_pp":
        flags = ["--load", result.save_dir, "--finetune", *layout.training_flags(), *training_flags(result.config)]
        print("train it with:", " ".join(flags))
        if result.iteration > 0:
            print(f"(--finetune starts at iteration 0; to continue this run at iteration {result.iteration}, "
                  f"{result.consumed_samples} samples consumed, pass --no-load-optim --no-load-rng instead)")
    elif args.target_format in ("megatron_lm", "torch_dist"):
        print("load it in Megatron-LM with: --load", result.save_dir, "--use-checkpoint-args --finetune",
              "(or --no-load-optim --no-load-rng to continue at its iteration)" if args.target_format == "megatron_lm"
              else "(or without --finetune to continue at its iteration)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
