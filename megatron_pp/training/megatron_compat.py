"""Megatron-LM's launch flags that this project has no machinery of its own for: declared so that a
Megatron-LM launch script runs with only its entry point changed, each one sorted into what it does here.

Three kinds. Flags that change what is computed are implemented where the computation lives and only
declared here when they belong to no other group (`--lr-warmup-fraction`, `--decoupled-lr`,
`--grad-reduce-in-bf16`, `--ckpt-format`, `--overlap-param-gather`, the last implemented in
`core.distributed_optimizer`; `--apply-layernorm-1p` and `--rotary-percent` are model fields,
`TransformerConfig`). Flags that tune Megatron-LM's own machinery (its kernels, its data loader
processes, its garbage collector, its profiler hooks) are accepted and named in one start-up line,
`accepted_without_effect`; what each does in Megatron-LM and why nothing changes here is in
`NO_EFFECT` and docs/training.md. Flags that need what this project does not have (fp8 without
TransformerEngine, context parallelism) are refused by `check_megatron_compat`, one line each, before
anything is built. Example: the flags of Megatron-LM's llama3 8B script (bf16, mock data) start with

    Megatron-LM flags accepted with no effect here: --use-mcore-models, --cross-entropy-loss-fusion,
    --empty-unused-memory-level 1, ... (docs/training.md, "Megatron-LM launch scripts")
"""
from __future__ import annotations

import argparse
from typing import Optional

NO_EFFECT: dict[str, str] = {
    "--use-mcore-models": "Megatron-LM: build the megatron-core model instead of its legacy one. "
                          "There is one model here.",
    "--cross-entropy-loss-fusion": "Megatron-LM: one fused kernel for the vocabulary-parallel cross entropy. "
                                   "The loss here is the same fp32 vocabulary-parallel cross entropy, op by op.",
    "--empty-unused-memory-level": "Megatron-LM: torch.cuda.empty_cache() after each step (1) or also after "
                                   "validation (2): returns cached blocks to the driver; no value changes.",
    "--tiktoken-pattern": "Megatron-LM: the pre-tokenization regex of its TikTokenizer (v1 or v2), read by "
                          "no other tokenizer type; none of this project's tokenizers reads it.",
    "--no-create-attention-mask-in-dataloader": "Megatron-LM: do not build a [s, s] causal mask per sample "
                                                "in the data loader. No mask is built here: attention is causal "
                                                "in the kernel (cu_seqlens with --reset-attention-mask).",
    "--no-mmap-bin-files": "Megatron-LM: read .bin files with plain reads instead of a memory map. The "
                           "tokens are the same; .bin files are memory-mapped here.",
    "--num-workers": "Megatron-LM: torch DataLoader worker processes. Samples are read in the training "
                     "process here (an index lookup and a memory-map slice per sample).",
    "--profile": "Megatron-LM: start the CUDA profiler (nsys) or torch.profiler between --profile-step-start "
                 "and --profile-step-end. Use --trace-file here (every rank's actions on one clock).",
    "--profile-step-start": "Megatron-LM: first profiled step (with --profile).",
    "--profile-step-end": "Megatron-LM: last profiled step (with --profile).",
    "--profile-ranks": "Megatron-LM: ranks that profile (with --profile).",
    "--use-pytorch-profiler": "Megatron-LM: profile with torch.profiler instead of nsys (with --profile).",
}
"""Accepted, named at start-up, and nothing here changes: what each flag does in Megatron-LM and why."""

MEGATRON_ATTENTION_BACKENDS = {"fused": "sdpa", "unfused": "reference", "local": "reference"}
"""Megatron-LM's --attention-backend names this project spells otherwise: `fused` (TransformerEngine's
cuDNN kernels) runs PyTorch SDPA, whose CUDA kernels are fused too; `unfused` and `local` (softmax of
the full score matrix) run the reference attention. `flash` and `auto` are the same names here."""

FP8_FLAGS = ("--fp8-format", "--fp8-recipe", "--fp8-margin", "--fp8-interval", "--fp8-amax-history-len",
             "--fp8-amax-compute-algo", "--fp8-param-gather")
"""TransformerEngine's fp8 training: refused when given (no fp8 GEMMs here)."""

CKPT_FORMATS = {"torch": "megatron_lm", "torch_dist": "torch_dist"}
"""--ckpt-format values and the `tools/convert_checkpoint.py --target-format` that writes each from our
checkpoints; --save / --load always use this project's resumable checkpoints (per-rank torch files and
metadata)."""


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def add_megatron_compat_args(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's flags declared nowhere else: the no-effect ones, the refused ones, and the few
    implemented ones whose computation has no flag group of its own."""
    mc = parser.add_argument_group("Megatron-LM compatibility (docs/training.md, \"Megatron-LM launch scripts\")")
    mc.add_argument("--lr-warmup-fraction", type=float, default=None,
                    help="Warm-up length as a fraction of the decay length (--lr-decay-iters / --lr-decay-samples, "
                         "default the run's length); excludes --lr-warmup-iters / --lr-warmup-samples.")
    mc.add_argument("--decoupled-lr", type=float, default=None,
                    help="Peak LR of the word embedding and the output layer (their own schedule, same shape).")
    mc.add_argument("--decoupled-min-lr", type=float, default=None,
                    help="Floor of --decoupled-lr's schedule (default --min-lr).")
    mc.add_argument("--grad-reduce-in-bf16", action="store_true",
                    help="Accumulate and data-parallel-reduce gradients in bf16 (with --bf16); default fp32.")
    mc.add_argument("--calculate-per-token-loss", action="store_true",
                    help="Loss = sum over the global batch's loss tokens / their number: what is always computed "
                         "here (docs/training.md).")
    mc.add_argument("--ckpt-format", choices=sorted(CKPT_FORMATS), default=None,
                    help="Megatron-LM's checkpoint format: --save/--load use this project's checkpoints either way; "
                         "tools/convert_checkpoint.py writes Megatron-LM's torch or torch_dist files from them.")
    mc.add_argument("--context-parallel-size", type=int, default=None,
                    help="Context parallelism: only 1 (none, the default) is supported here.")
    mc.add_argument("--rampup-batch-size", nargs=3, type=int, default=None, metavar=("START", "INCREMENT", "SAMPLES"),
                    help="Megatron-LM's batch-size ramp-up (with --train-samples): the global batch grows from START by "
                         "INCREMENT over SAMPLES consumed samples to --global-batch-size; each microbatch count "
                         "runs its own validated action list (docs/training.md).")
    mc.add_argument("--overlap-param-gather", action="store_true",
                    help="With --use-distributed-optimizer: leave each update's parameter all-gathers in flight; each "
                         "model chunk's first forward of the next step waits for its own (docs/training.md).")
    mc.add_argument("--manual-gc", action="store_true",
                    help="Switch Python's automatic garbage collector off for the training loop and collect by hand "
                         "at iteration boundaries, the same on every rank (training/manual_gc.py).")
    mc.add_argument("--manual-gc-interval", type=int, default=0,
                    help="With --manual-gc: collect after every N-th iteration (0, the default: not between "
                         "iterations, only before the first and around evaluations).")
    mc.add_argument("--no-manual-gc-eval", action="store_true",
                    help="With --manual-gc: do not collect before and after each evaluation.")
    for name in ("--use-mcore-models", "--cross-entropy-loss-fusion",
                 "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--profile",
                 "--use-pytorch-profiler"):
        mc.add_argument(name, dest=_dest(name), action="store_true", help=NO_EFFECT[name])
    for name, kind, default in (("--empty-unused-memory-level", int, None),
                                ("--tiktoken-pattern", str, None), ("--num-workers", int, None),
                                ("--profile-step-start", int, None), ("--profile-step-end", int, None)):
        mc.add_argument(name, dest=_dest(name), type=kind, default=default, help=NO_EFFECT[name])
    mc.add_argument("--profile-ranks", nargs="+", type=int, default=None, help=NO_EFFECT["--profile-ranks"])
    for name in FP8_FLAGS:
        if name == "--fp8-param-gather":
            mc.add_argument(name, dest=_dest(name), action="store_true", help="Refused: fp8 needs TransformerEngine.")
        else:
            mc.add_argument(name, dest=_dest(name), default=None, help="Refused: fp8 needs TransformerEngine.")


def _given_no_effect(args: argparse.Namespace) -> list[str]:
    """The no-effect flags this run gave, as they would be written (`--num-workers 1`)."""
    given = []
    for name in NO_EFFECT:
        value = getattr(args, _dest(name), None)
        if value is None or value is False:
            continue
        if value is True:
            given.append(name)
        elif isinstance(value, list):
            given.append(f"{name} {' '.join(map(str, value))}")
        else:
            given.append(f"{name} {value}")
    return given


def accepted_without_effect(args: argparse.Namespace) -> Optional[str]:
    """The start-up line naming the Megatron-LM flags given that change nothing here (None: none given)."""
    given = _given_no_effect(args)
    if getattr(args, "calculate_per_token_loss", False):
        given.append("--calculate-per-token-loss (the loss here is always per token)")
    if getattr(args, "sequence_parallel_at_tp1", False):
        given.append("--sequence-parallel (off at tensor-parallel size 1, as in Megatron-LM)")
    if getattr(args, "ckpt_format", None) is not None:
        given.append(f"--ckpt-format {args.ckpt_format} (--save writes this project's checkpoints; "
                     f"tools/convert_checkpoint.py --target-format {CKPT_FORMATS[args.ckpt_format]} "
                     "writes Megatron-LM's)")
    if getattr(args, "context_parallel_size", None) == 1:
        given.append("--context-parallel-size 1")
    if getattr(args, "overlap_param_gather", False) and getattr(args, "data_parallel_sharding_strategy",
                                                                 "no_shard") == "optim_grads_params":
        given.append("--overlap-param-gather (sharded weights gather per chunk run, the next run's gather "
                     "started ahead, either way)")
    if not given:
        return None
    return ("Megatron-LM flags accepted with no effect here: " + ", ".join(given)
            + " (docs/training.md, \"Megatron-LM launch scripts\")")


def check_megatron_compat(args: argparse.Namespace) -> list[str]:
    """One line per Megatron-LM flag this run gives that cannot be honoured, or a bad value of one."""
    errors = []
    fp8 = [name for name in FP8_FLAGS if getattr(args, _dest(name), None) not in (None, False)]
    if fp8:
        errors.append(f"{fp8[0]}: fp8 training needs TransformerEngine's fp8 GEMMs, which this project does not "
                      "use; drop the fp8 flags (train in --bf16)")
    if args.context_parallel_size not in (None, 1):
        errors.append(f"--context-parallel-size {args.context_parallel_size}: context parallelism is not "
                      "implemented here; only 1 is accepted (split the sequence with --sequence-parallel under tp)")
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        errors.append("--overlap-param-gather needs --use-distributed-optimizer (as in Megatron-LM): only its "
                      "parameter all-gather can be overlapped")
    if args.grad_reduce_in_bf16 and not args.bf16:
        errors.append("--grad-reduce-in-bf16 applies only to --bf16 (fp32 and fp16 runs reduce in fp32)")
    if args.pipeline_schedule == "2bw":  # 2BW's weight versions keep their own fp32 gradients and groups
        errors += [f"--{name.replace('_', '-')} is not supported with --pipeline-schedule 2bw"
                   for name in ("grad_reduce_in_bf16", "decoupled_lr") if getattr(args, name) not in (None, False)]
    if args.grad_reduce_in_bf16 and getattr(args, "layered_grad_accumulation", False):
        errors.append("--grad-reduce-in-bf16 is not supported with --layered-grad-accumulation (fp32 buffers)")
    if args.grad_reduce_in_bf16 and args.data_parallel_sharding_strategy == "optim_grads_params":
        errors.append("--grad-reduce-in-bf16 is not supported with --data-parallel-sharding-strategy "
                      "optim_grads_params (its weight shards read fp32 gradient buffers)")
    if args.lr_warmup_fraction is not None:
        if not 0.0 <= args.lr_warmup_fraction < 1.0:
            errors.append(f"--lr-warmup-fraction must be in [0, 1), got {args.lr_warmup_fraction}")
        for name in ("lr_warmup_iters", "lr_warmup_samples"):
            if getattr(args, name):
                errors.append(f"--lr-warmup-fraction and --{name.replace('_', '-')} cannot be combined "
                              "(give one warm-up length)")
    for name in ("decoupled_lr", "decoupled_min_lr"):
        value = getattr(args, name)
        if value is not None and value < 0:
            errors.append(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        errors.append("--decoupled-min-lr needs --decoupled-lr")
    elif args.decoupled_lr is not None and 0 <= args.decoupled_lr < (
            args.decoupled_min_lr if args.decoupled_min_lr is not None else args.min_lr):
        errors.append(f"--decoupled-lr {args.decoupled_lr} is below its floor (--decoupled-min-lr, default --min-lr)")
    if getattr(args, "manual_gc_interval", 0) < 0:
        errors.append(f"--manual-gc-interval must be >= 0 (0: no collection between iterations), got "
                      f"{args.manual_gc_interval}")
    if args.empty_unused_memory_level is not None and args.empty_unused_memory_level not in (0, 1, 2):
        errors.append(f"--empty-unused-memory-level must be 0, 1 or 2, got {args.empty_unused_memory_level}")
    return errors
