"""Command-line arguments with Megatron-LM's flag names, and their validation.

Model-shape flags are generated from `TransformerConfig`'s fields (one source of truth: a new config
field gets its flag automatically, with the field's docstring as help). Where Megatron spells a setting
differently from the field (`--disable-bias-linear` for `add_bias_linear=False`, `--swiglu` for
`activation='swiglu'`, `--untie-embeddings-and-output-weights`), the Megatron spelling is registered as
well. Model flags default to None so that a `--model-preset` supplies the base and only flags given
explicitly override it.

`validate_args` returns every problem at once, one line each, naming the flag; `parse_args` prints
them and exits with status 2 before any process group, model or data is touched.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import sys
import typing
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_pp.core.parallel_state import read_launch_env
from megatron_pp.models.config import TransformerConfig, flag
from megatron_pp.schedules.registry import schedule_options

# Fields that are not set by their own generated flag (Megatron spells them differently, or they are
# derived from precision flags).
_SPECIAL_FIELDS = {"add_bias_linear", "untie_embeddings_and_output_weights", "params_dtype"}


def _field_docs() -> dict[str, str]:
    """Attribute docstrings of TransformerConfig (the string literal after each field)."""
    import inspect

    tree = ast.parse(inspect.getsource(TransformerConfig))
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = str(nxt.value.value)  # type: ignore[attr-defined]
    return docs


def _base_type(annotation) -> type:
    hints = typing.get_args(annotation)
    return next((h for h in hints if h is not type(None)), annotation) if hints else annotation


def add_model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model (generated from TransformerConfig)")
    docs = _field_docs()
    hints = typing.get_type_hints(TransformerConfig)
    for f in dataclasses.fields(TransformerConfig):
        if f.name in _SPECIAL_FIELDS:
            continue
        kind = _base_type(hints[f.name])
        group.add_argument(flag(f.name), dest=f.name, type=kind, default=None, help=docs.get(f.name, ""))
    group.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false", default=None,
                       help="No biases in the attention and MLP linear layers (LLaMA).")
    group.add_argument("--untie-embeddings-and-output-weights", dest="untie_embeddings_and_output_weights",
                       action="store_true", default=None, help="Separate output layer instead of the tied embedding.")
    group.add_argument("--swiglu", dest="activation", action="store_const", const="swiglu",
                       help="SwiGLU MLP (same as --activation swiglu).")
    group.add_argument("--group-query-attention", action="store_true",
                       help="Use grouped-query attention with --num-query-groups key/value heads.")
    group.add_argument("--model-preset", default=None, help="Named preset (e.g. gpt3-125m, llama2-7b, gpt-tiny).")


def build_parser(description: str = "megatron_pp pretraining") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, allow_abbrev=False)
    add_model_args(parser)

    par = parser.add_argument_group("parallelism")
    par.add_argument("--tensor-model-parallel-size", type=int, default=1)
    par.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    par.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                     help="Layers per virtual stage; chunks per rank v = layer slots / (pp x this).")
    par.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                     help="Chunks per rank v directly (alternative to --num-layers-per-virtual-pipeline-stage).")
    par.add_argument("--sequence-parallel", action="store_true")
    par.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    par.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    par.add_argument("--account-for-embedding-in-pipeline-split", action="store_true")
    par.add_argument("--account-for-loss-in-pipeline-split", action="store_true")
    par.add_argument("--pipeline-schedule", default="1f1b", help="Pipeline schedule by name (see docs/schedules.md).")
    for option in schedule_options():  # declared by the schedules themselves (registry.register_option)
        par.add_argument(option.flag, dest=option.name, type=option.type, default=None, help=option.help)
    par.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None,
                     help="Default: nccl on CUDA, gloo on CPU.")

    tr = parser.add_argument_group("training")
    tr.add_argument("--micro-batch-size", type=int, default=1)
    tr.add_argument("--global-batch-size", type=int, default=None, help="Default: micro-batch size x dp.")
    tr.add_argument("--train-iters", type=int, default=10)
    tr.add_argument("--lr", type=float, default=1e-3)
    tr.add_argument("--min-lr", type=float, default=0.0)
    tr.add_argument("--lr-warmup-iters", type=int, default=0)
    tr.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="constant")
    tr.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    tr.add_argument("--weight-decay", type=float, default=0.01)
    tr.add_argument("--adam-beta1", type=float, default=0.9)
    tr.add_argument("--adam-beta2", type=float, default=0.999)
    tr.add_argument("--adam-eps", type=float, default=1e-8)
    tr.add_argument("--sgd-momentum", type=float, default=0.0)
    tr.add_argument("--clip-grad", type=float, default=1.0)
    tr.add_argument("--seed", type=int, default=1234)
    tr.add_argument("--bf16", action="store_true")
    tr.add_argument("--fp16", action="store_true")

    data = parser.add_argument_group("data")
    data.add_argument("--mock-data", action="store_true",
                      help="Deterministic synthetic tokens, a function of --seed and the sample index.")

    log = parser.add_argument_group("logging")
    log.add_argument("--log-interval", type=int, default=1)
    log.add_argument("--metrics-file", default=None, help="JSON-lines file of per-iteration metrics (rank 0).")
    log.add_argument("--trace-file", default=None,
                     help="Chrome-trace / Perfetto JSON of the executed actions of every rank (one file).")
    return parser


def model_config_from_args(args: argparse.Namespace) -> TransformerConfig:
    """The model config: the preset (if any) overridden by every model flag given explicitly."""
    from megatron_pp.models.presets import get_preset

    overrides = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(TransformerConfig)
        if f.name != "params_dtype" and getattr(args, f.name, None) is not None
    }
    overrides["params_dtype"] = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    if args.model_preset:
        return dataclasses.replace(get_preset(args.model_preset), **overrides)
    missing = [flag(n) for n in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size")
               if n not in overrides]
    if missing:
        raise ValueError(f"give --model-preset or all of {', '.join(missing)}")
    return TransformerConfig(**overrides)


def validate_args(args: argparse.Namespace) -> list[str]:
    """Every problem with the arguments, one line each (empty list: fine). Pure: touches nothing."""
    from megatron_pp.models.layout import split_layers
    from megatron_pp.schedules.registry import list_schedules, options_from_args

    errors: list[str] = []
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "micro_batch_size", "train_iters"):
        if getattr(args, name) < 1:
            errors.append(f"{flag(name)} must be >= 1, got {getattr(args, name)}")
    if args.global_batch_size is not None and args.global_batch_size < 1:
        errors.append(f"--global-batch-size must be >= 1, got {args.global_batch_size}")
    if args.bf16 and args.fp16:
        errors.append("--bf16 and --fp16 are mutually exclusive")
    if args.fp16:
        errors.append("--fp16 needs dynamic loss scaling, which is not implemented yet; use --bf16")
    if not args.mock_data:
        errors.append("no data source: pass --mock-data (file datasets are not supported yet)")
    if args.lr < 0:
        errors.append(f"--lr must be >= 0, got {args.lr}")
    if args.sequence_parallel and tp == 1:
        errors.append("--sequence-parallel needs --tensor-model-parallel-size > 1")
    known = list_schedules()
    if args.pipeline_schedule not in known:
        errors.append(f"unknown --pipeline-schedule {args.pipeline_schedule!r}; known: {', '.join(known)}")
    else:
        try:
            options_from_args(args, args.pipeline_schedule)
        except ValueError as exc:
            errors.append(str(exc))
    # An embedding program (tests, notebooks) may have initialised the world already; else the launcher says.
    world = dist.get_world_size() if dist.is_initialized() else read_launch_env().world_size
    if tp >= 1 and pp >= 1:
        if world % (tp * pp) != 0:
            errors.append(
                f"world size {world} is not divisible by --tensor-model-parallel-size {tp} x "
                f"--pipeline-model-parallel-size {pp}"
            )
        elif args.global_batch_size is not None and args.micro_batch_size >= 1:
            dp = world // (tp * pp)
            if args.global_batch_size % (args.micro_batch_size * dp) != 0:
                errors.append(
                    f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
                    f"{args.micro_batch_size} x data-parallel size {dp}"
                )
    if args.group_query_attention and args.num_query_groups is None and not args.model_preset:
        errors.append("--group-query-attention needs --num-query-groups")
    try:
        config = model_config_from_args(args)
    except ValueError as exc:
        return errors + [str(exc)]
    try:
        config.validate(max(tp, 1))
    except ValueError as exc:
        errors.append(str(exc))
    try:
        num_chunks(args, config)
        if min(tp, pp) >= 1:
            split_layers(
                config.num_layers, pp, num_chunks(args, config),
                first_stage_layers=args.decoder_first_pipeline_num_layers,
                last_stage_layers=args.decoder_last_pipeline_num_layers,
                account_for_embedding=args.account_for_embedding_in_pipeline_split,
                account_for_loss=args.account_for_loss_in_pipeline_split,
            )
    except ValueError as exc:
        errors.append(str(exc))
    return errors


def num_chunks(args: argparse.Namespace, config: TransformerConfig) -> int:
    """Virtual stages per pipeline rank implied by --num-layers-per-virtual-pipeline-stage."""
    per_stage = args.num_layers_per_virtual_pipeline_stage
    direct = getattr(args, "num_virtual_stages_per_pipeline_rank", None)
    if direct is not None:
        if per_stage is not None:
            raise ValueError("--num-virtual-stages-per-pipeline-rank and --num-layers-per-virtual-pipeline-stage "
                             "are mutually exclusive")
        if direct < 1:
            raise ValueError(f"--num-virtual-stages-per-pipeline-rank must be >= 1, got {direct}")
        return direct
    if per_stage is None:
        return 1
    slots = config.num_layers + int(args.account_for_embedding_in_pipeline_split) + int(
        args.account_for_loss_in_pipeline_split
    )
    pp = args.pipeline_model_parallel_size
    if per_stage < 1 or slots % (pp * per_stage) != 0:
        raise ValueError(
            f"--num-layers-per-virtual-pipeline-stage {per_stage} does not divide {slots} layer slots into "
            f"--pipeline-model-parallel-size {pp} ranks evenly"
        )
    return slots // (pp * per_stage)


def parse_args(argv: Optional[Sequence[str]] = None, description: str = "megatron_pp pretraining") -> argparse.Namespace:
    parser = build_parser(description)
    args = parser.parse_args(argv)
    errors = validate_args(args)
    if errors:
        for line in errors:
            print(f"error: {line}", file=sys.stderr)
        sys.exit(2)
    return args
