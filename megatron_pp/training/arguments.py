"""Command-line arguments with Megatron-LM's flag names, YAML config files, and validation.

One source of truth per kind of flag: model-shape flags are generated from `TransformerConfig`'s fields
(a new field gets its flag, with the field's docstring as help), schedule options from the schedule
registry (`register_option`), data and tokenizer flags from the data package's `DataConfig`; the
training flags are declared here. Where Megatron spells a model setting differently from the field
(`--disable-bias-linear` for `add_bias_linear=False`, `--swiglu`, `--use-flash-attn`), its spelling is
registered as well. Model flags default to None so that a `--model-preset` supplies the base and only
flags given explicitly override it.

`--config FILE` reads a YAML mapping whose keys are flag names (with dashes or underscores: `lr`,
`micro-batch-size`, `pipeline_schedule`); it is expanded into flags placed *before* the command line,
so a flag given on the command line wins. An on/off flag set in the file cannot be switched off again
on the command line. A key that names no flag is an error naming the key and the file.

`validate_args` returns every problem at once, one line each, naming the flag, and touches nothing;
`parse_args` prints them and exits with status 2 before any process group, model or data exists, then
derives what Megatron derives (`--global-batch-size` defaults to micro-batch × data-parallel size;
`--train-samples` becomes `--train-iters`).
"""
from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import inspect
import os
import sys
import typing
from typing import Any, Callable, Optional, Sequence

import torch

from megatron_pp.core import comm
from megatron_pp.core.parallel_state import read_launch_env
from megatron_pp.data.builder import add_data_args, check_data_args, data_config_from_args, parse_split
from megatron_pp.models.config import TransformerConfig, flag
from megatron_pp.schedules.ir import Schedule
from megatron_pp.schedules.plugins import PluginError, add_plugin_flag, load_plugins
from megatron_pp.schedules.registry import schedule_options
from megatron_pp.schedules.schedule_file import FILE_SCHEDULE_OPTIONS
from megatron_pp.training.errors import agree_on_usage_errors

# Fields that are not set by their own generated flag (Megatron spells them differently, or they are
# derived from precision flags).
_SPECIAL_FIELDS = {"add_bias_linear", "untie_embeddings_and_output_weights", "params_dtype"}


def _field_docs() -> dict[str, str]:
    """Attribute docstrings of TransformerConfig (the string literal after each field)."""
    tree = ast.parse(inspect.getsource(TransformerConfig))
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = str(nxt.value.value)  # type: ignore[attr-defined]
    return docs


def _base_type(annotation: Any) -> type:
    hints = typing.get_args(annotation)
    return next((h for h in hints if h is not type(None)), annotation) if hints else annotation


# The parser -------------------------------------------------------------------------------------------


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
    group.add_argument("--use-flash-attn", action="store_true",
                       help="flash-attn kernels (same as --attention-backend flash).")
    group.add_argument("--model-preset", default=None, help="Named preset (e.g. gpt3-125m, llama2-7b, gpt-tiny).")


class ArgumentError(Exception):
    """Usage errors found while parsing and validating, one line each (see `parse_args`)."""

    def __init__(self, lines: Sequence[str]) -> None:
        super().__init__("; ".join(lines))
        self.lines = list(lines)


class _OneLineParser(argparse.ArgumentParser):
    """argparse prints a usage block before its message; a bad flag here is one line, like every other
    argument error (`error: ...`, exit status 2)."""

    def error(self, message: str) -> typing.NoReturn:  # type: ignore[override]
        raise ArgumentError([message])


def build_parser(description: str = "megatron_pp pretraining") -> argparse.ArgumentParser:
    parser = _OneLineParser(description=description, allow_abbrev=False)
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="YAML file of flag values (keys are flag names); command-line flags override it.")
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
    par.add_argument("--pipeline-schedule", default="1f1b", action=_NamedSchedule,
                     help="Pipeline schedule by name (see docs/schedules.md).")
    par.add_argument("--pipeline-schedule-file", default=None, metavar="FILE",
                     help="Run the action lists in FILE instead of a registered schedule: torch.distributed.pipelining's "
                          "compute-only CSV or this project's JSON (docs/plugins.md). Ranks, microbatches and chunks "
                          "come from the file; --offload-chunks / --offload-fraction / --bpipe-max-resident apply.")
    add_plugin_flag(par)
    for option in schedule_options():  # declared by the schedules themselves (registry.register_option)
        if option.type is bool:  # on/off: --flag and --no-flag, None when neither is given
            par.add_argument(option.flag, dest=option.name, action=argparse.BooleanOptionalAction, default=None,
                             help=option.help)
        else:
            par.add_argument(option.flag, dest=option.name, type=option.type, default=None, help=option.help)
    par.add_argument("--measure-offload-time", action=argparse.BooleanOptionalAction, default=None,
                     help="Measure --offload-time at start-up (one layer's forward vs the copy of its stash to host; "
                          "training/offload_probe.py) when a schedule offloads and --offload-time is not given. "
                          "Default: on with CUDA, off on CPU (where it is a host-to-host copy and the documented "
                          "0.25 is used).")
    par.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None,
                     help="Default: nccl on CUDA, gloo on CPU.")
    par.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                     help="Process-group timeout: a collective waiting longer than this fails instead of hanging.")
    par.add_argument("--use-distributed-optimizer", action="store_true",
                     help="ZeRO-1: shard the optimizer state over the data-parallel group.")
    par.add_argument("--overlap-grad-reduce", action="store_true",
                     help="Reduce gradients in buckets while the backward is still running.")
    par.add_argument("--data-parallel-sharding-strategy", choices=("no_shard", "optim", "optim_grads_params"),
                     default="no_shard",
                     help="What the data-parallel ranks shard: optim = --use-distributed-optimizer (ZeRO-1); "
                          "optim_grads_params also shards the weights, all-gathered per chunk before it runs and "
                          "freed after, gradients reduce-scattered into the shard (ZeRO-3; docs/layered.md).")

    tr = parser.add_argument_group("training length and batch")
    tr.add_argument("--micro-batch-size", type=int, default=1)
    tr.add_argument("--global-batch-size", type=int, default=None, help="Default: micro-batch size x dp.")
    tr.add_argument("--train-iters", type=int, default=None, help="Iterations to train (or give --train-samples).")
    tr.add_argument("--train-samples", type=int, default=None,
                    help="Samples to train; iterations = this // global batch size.")
    tr.add_argument("--seed", type=int, default=1234)

    lr = parser.add_argument_group("learning rate")
    lr.add_argument("--lr", type=float, default=1e-3)
    lr.add_argument("--min-lr", type=float, default=0.0)
    lr.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine", "WSD"), default="constant")
    lr.add_argument("--lr-warmup-iters", type=int, default=0)
    lr.add_argument("--lr-warmup-samples", type=int, default=0, help="Warmup length with --train-samples.")
    lr.add_argument("--lr-decay-iters", type=int, default=None, help="Decay length (default: --train-iters).")
    lr.add_argument("--lr-decay-samples", type=int, default=None, help="Decay length with --train-samples.")
    lr.add_argument("--lr-wsd-decay-style", choices=("exponential", "linear", "cosine", "minus_sqrt"),
                    default=None, help="Shape of the final decay of --lr-decay-style WSD (default linear).")
    lr.add_argument("--lr-wsd-decay-iters", type=int, default=None, help="Length of WSD's final decay.")
    lr.add_argument("--lr-wsd-decay-samples", type=int, default=None,
                    help="Length of WSD's final decay with --train-samples.")

    opt = parser.add_argument_group("optimizer")
    opt.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    opt.add_argument("--weight-decay", type=float, default=0.01)
    opt.add_argument("--adam-beta1", type=float, default=0.9)
    opt.add_argument("--adam-beta2", type=float, default=0.999)
    opt.add_argument("--adam-eps", type=float, default=1e-8)
    opt.add_argument("--sgd-momentum", type=float, default=0.9)
    opt.add_argument("--clip-grad", type=float, default=1.0, help="Global gradient-norm clip (0: off).")

    mp = parser.add_argument_group("mixed precision")
    mp.add_argument("--bf16", action="store_true")
    mp.add_argument("--fp16", action="store_true")
    mp.add_argument("--loss-scale", type=float, default=None, help="Static fp16 loss scale (default: dynamic).")
    mp.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    mp.add_argument("--min-loss-scale", type=float, default=1.0)
    mp.add_argument("--loss-scale-window", type=int, default=1000, help="Good steps before the scale grows.")
    mp.add_argument("--hysteresis", type=int, default=2, help="Overflows tolerated before the scale backs off.")
    mp.add_argument("--apply-rope-fusion", action="store_true",
                    help="CUDA: run RoPE's rotation as one torch.compile-generated kernel each way (compiled on first "
                         "use; may differ from the op-by-op path in the last bit).")

    rc = parser.add_argument_group("activation recomputation")
    rc.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    rc.add_argument("--recompute-method", choices=("uniform", "block"), default=None)
    rc.add_argument("--recompute-num-layers", type=int, default=None,
                    help="Layers per recomputed group (uniform) or recomputed layers per chunk (block); default 1.")

    ck = parser.add_argument_group("checkpointing")
    ck.add_argument("--save", default=None, metavar="DIR", help="Directory to save checkpoints to.")
    ck.add_argument("--load", default=None, metavar="DIR",
                    help="Directory to resume from; a missing checkpoint starts from scratch.")
    ck.add_argument("--save-interval", type=int, default=None, help="Iterations between checkpoints.")
    ck.add_argument("--no-save-optim", action="store_true", help="Leave the optimizer state out of checkpoints.")
    ck.add_argument("--no-load-optim", action="store_true", help="Do not restore the optimizer state.")
    ck.add_argument("--no-load-rng", action="store_true", help="Do not restore the random-number generators.")
    ck.add_argument("--finetune", action="store_true",
                    help="Load the weights only; start at iteration 0 with a fresh optimizer and data position.")
    ck.add_argument("--exit-on-missing-checkpoint", action="store_true",
                    help="Exit with an error when --load holds no checkpoint.")

    ex = parser.add_argument_group("stopping early")
    ex.add_argument("--exit-signal-handler", action="store_true",
                    help="On SIGTERM or SIGUSR1: finish the step, save a checkpoint and exit 0.")
    ex.add_argument("--exit-interval", type=int, default=None, help="Save and exit when iteration %% N == 0.")
    ex.add_argument("--exit-duration-in-mins", type=float, default=None,
                    help="Save and exit after this many minutes of wall-clock time.")

    ft = parser.add_argument_group("faults and numerics (docs/reliability.md)")
    ft.add_argument("--heartbeat-timeout-seconds", type=float, default=60.0,
                    help="Multi-process runs: a rank whose heartbeat stops this long is reported by rank and every "
                         "rank exits 1 (0: no watchdog).")
    ft.add_argument("--max-consecutive-nonfinite", type=int, default=1,
                    help="bf16/fp32: stop (exit 1, no checkpoint written) after this many consecutive steps with a "
                         "NaN/Inf loss or gradient; each such step is skipped. fp16 overflows are the loss scaler's.")
    ft.add_argument("--loss-spike-factor", type=float, default=None,
                    help="Log a warning when the loss exceeds this multiple of the median of the last "
                         "--loss-spike-window losses (default: off).")
    ft.add_argument("--loss-spike-window", type=int, default=20, help="Losses in the running median.")
    ft.add_argument("--continue-on-save-failure", action="store_true",
                    help="A checkpoint that cannot be written (disk full, quota) is reported and training goes on; "
                         "default: report it and exit 1.")

    ev = parser.add_argument_group("evaluation")
    ev.add_argument("--eval-interval", type=int, default=None,
                    help="Iterations between validation passes (and one at the end); default: none.")
    ev.add_argument("--eval-iters", type=int, default=100, help="Global batches per validation pass.")

    data = parser.add_argument_group("mock data")
    data.add_argument("--mock-data", action="store_true",
                      help="Deterministic synthetic tokens, a function of --seed and the sample index.")
    add_data_args(parser)

    log = parser.add_argument_group("logging")
    log.add_argument("--log-interval", type=int, default=1, help="Iterations between console lines.")
    log.add_argument("--log-throughput", action="store_true", help="Show TFLOP/s per GPU and MFU on the console.")
    log.add_argument("--peak-tflops", type=float, default=None,
                     help="Peak TFLOP/s per device for MFU (default: the device's dense bf16 datasheet peak).")
    log.add_argument("--metrics-file", default=None, help="JSON-lines file of per-iteration metrics (rank 0).")
    log.add_argument("--trace-file", default=None,
                     help="Chrome-trace / Perfetto JSON of the executed actions of every rank (one file).")
    log.add_argument("--tensorboard-dir", default=None, help="Write TensorBoard scalars here (rank 0).")
    log.add_argument("--wandb-project", default=None, help="Log to wandb (offline unless WANDB_API_KEY is set).")
    log.add_argument("--wandb-exp-name", default=None, help="wandb run name.")
    log.add_argument("--wandb-save-dir", default=None, help="Directory for wandb's files (default: ./wandb).")
    return parser


# Config files -----------------------------------------------------------------------------------------


class ConfigFileError(ValueError):
    """Problems with a --config file, one line each (`lines`)."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("; ".join(lines))
        self.lines = lines


# Flags that name something the run writes. A config file is data that travels between people and
# clusters, so its output paths stay below the run directory; the command line (the operator) may point
# anywhere.
OUTPUT_PATH_FLAGS = ("save", "metrics_file", "trace_file", "tensorboard_dir", "wandb_save_dir", "cache_dir")


def _escapes_run_directory(path: str) -> bool:
    return os.path.isabs(path) or path.startswith("~") or ".." in path.replace("\\", "/").split("/")


def config_file_arguments(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """The flags equivalent to the YAML mapping in `path` (see the module docstring)."""
    import yaml

    try:
        with open(path) as f:
            values = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigFileError([f"--config {path}: {exc.strerror}"]) from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise ConfigFileError([f"--config {path}: not valid YAML{at}"]) from None
    if values is None:
        return []
    if not isinstance(values, dict):
        raise ConfigFileError([f"--config {path}: expected a mapping of flag names to values, "
                               f"got a {type(values).__name__}"])
    # argparse keeps no public table of its actions; `_actions` has been stable since Python 2.7.
    actions = {option: action for action in parser._actions for option in action.option_strings}
    tokens: list[str] = []
    errors: list[str] = []
    for key, value in values.items():
        option = "--" + str(key).replace("_", "-")
        action = actions.get(option)
        if action is None or option in ("--config", "--help"):
            errors.append(f"--config {path}: unknown key {key!r} (there is no flag {option})")
            continue
        if value is None:
            continue
        if action.dest in OUTPUT_PATH_FLAGS and isinstance(value, str) and _escapes_run_directory(value):
            errors.append(f"--config {path}: {key} {value!r} points outside the run directory (absolute, '~' or '..'); "
                          f"a config file may only name outputs below the directory the job starts in; give "
                          f"{option} on the command line to write elsewhere")
            continue
        if action.nargs == 0:  # on/off flags
            if not isinstance(value, bool):
                errors.append(f"--config {path}: {key} must be true or false, got {value!r}")
            elif value:
                tokens.append(option)
            elif isinstance(action, argparse.BooleanOptionalAction):
                tokens.append("--no-" + option[2:])
        elif isinstance(value, list):
            if action.nargs not in ("*", "+"):
                errors.append(f"--config {path}: {key} takes one value, got a list")
            else:
                tokens += [option, *map(str, value)]
        elif isinstance(value, dict):
            errors.append(f"--config {path}: {key} takes a value, got a mapping")
        else:
            tokens += [option, str(value)]
    if errors:
        raise ConfigFileError(errors)
    return tokens


def expand_config_file(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """`argv` with the flags of its `--config FILE` (if any) put in front, so the command line wins."""
    pre = _OneLineParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config is None:
        return list(argv)
    return config_file_arguments(parser, known.config) + list(argv)


# The model config -------------------------------------------------------------------------------------


def uses_file_data(args: argparse.Namespace) -> bool:
    """True when batches come from --data-path style datasets (whose tokenizer sets the vocabulary)."""
    return not args.mock_data


def model_config_from_args(args: argparse.Namespace, vocab_size: Optional[int] = None) -> TransformerConfig:
    """The model config: the preset (if any) overridden by every model flag given explicitly.

    `vocab_size` is the tokenizer's, which decides the embedding with file datasets (as in Megatron,
    where `--vocab-size` only parametrises the NullTokenizer).
    """
    from megatron_pp.models.presets import get_preset

    overrides = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(TransformerConfig)
        if f.name != "params_dtype" and getattr(args, f.name, None) is not None
    }
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    if args.use_flash_attn:
        overrides["attention_backend"] = "flash"
    overrides["params_dtype"] = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    if args.model_preset:
        return dataclasses.replace(get_preset(args.model_preset), **overrides)
    missing = [flag(n) for n in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size")
               if n not in overrides]
    if missing:
        raise ValueError(f"give --model-preset or all of {', '.join(missing)}")
    return TransformerConfig(**overrides)


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
        return _fixed_chunks(args) or 1
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


class _NamedSchedule(argparse.Action):
    """Stores --pipeline-schedule and notes that it was given (its default, 1f1b, cannot tell), so that
    naming a schedule beside --pipeline-schedule-file is refused rather than one of the two ignored."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.pipeline_schedule_given = True


def _fixed_chunks(args: argparse.Namespace) -> Optional[int]:
    """Chunks per rank a registered schedule always uses (the V shapes' 2), so that they need no flag."""
    from megatron_pp.schedules.registry import get_schedule

    name = getattr(args, "pipeline_schedule", None)
    if getattr(args, "pipeline_schedule_file", None) or name is None:
        return None
    try:
        return get_schedule(name).chunks_per_rank
    except ValueError:  # an unknown name is reported by the schedule checks
        return None


# Validation -------------------------------------------------------------------------------------------


def _world_size() -> int:
    # An embedding program (tests, notebooks) may have initialised the world already; else the launcher says.
    return comm.world_size() if comm.backend_name() != "none" else read_launch_env().world_size


def _at_least(args: argparse.Namespace, names: Sequence[str], minimum: float) -> list[str]:
    """One error per given flag below `minimum` (None means not given)."""
    return [f"{flag(n)} must be >= {minimum}, got {getattr(args, n)}"
            for n in names if getattr(args, n) is not None and getattr(args, n) < minimum]


def _check_parallel_and_batch(args: argparse.Namespace, world: int) -> list[str]:
    errors = _at_least(args, ("tensor_model_parallel_size", "pipeline_model_parallel_size", "micro_batch_size",
                              "global_batch_size"), 1)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if args.sequence_parallel and tp == 1:
        errors.append("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if tp >= 1 and pp >= 1:
        if world % (tp * pp) != 0:
            errors.append(f"world size {world} is not divisible by --tensor-model-parallel-size {tp} x "
                          f"--pipeline-model-parallel-size {pp}")
        elif args.global_batch_size is not None and args.global_batch_size >= 1 and args.micro_batch_size >= 1:
            dp = world // (tp * pp)
            if args.global_batch_size % (args.micro_batch_size * dp) != 0:
                errors.append(f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
                              f"{args.micro_batch_size} x data-parallel size {dp}")
    return errors


def _check_length_and_lr(args: argparse.Namespace) -> list[str]:
    errors = _at_least(args, ("train_iters", "train_samples"), 1)
    errors += _at_least(args, ("lr_warmup_iters", "lr_warmup_samples",
                              "lr_decay_iters", "lr_decay_samples", "lr_wsd_decay_iters", "lr_wsd_decay_samples"), 0)
    errors += _at_least(args, ("lr", "min_lr"), 0.0)
    if (args.train_iters is None) == (args.train_samples is None):
        errors.append("give exactly one of --train-iters and --train-samples")
    elif args.train_samples is not None and args.global_batch_size is not None and (
            1 <= args.train_samples < args.global_batch_size):  # below 1 has its own line
        errors.append(f"--train-samples {args.train_samples} is less than one --global-batch-size "
                      f"{args.global_batch_size}: no iteration would run")
    # Megatron's rule: lengths are counted in the unit the run is counted in.
    if args.train_iters is not None:
        wrong = [n for n in ("lr_decay_samples", "lr_wsd_decay_samples") if getattr(args, n) is not None]
        wrong += ["lr_warmup_samples"] if args.lr_warmup_samples else []
        errors += [f"{flag(n)} needs --train-samples (this run counts --train-iters; use the *-iters flag)"
                   for n in wrong]
        decay = args.lr_decay_iters or args.train_iters  # 0 is the run's length, as LRSchedule reads it
        if args.lr_warmup_iters and args.lr_warmup_iters >= decay >= 1:  # a length below 1 has its own line
            errors.append(f"--lr-warmup-iters {args.lr_warmup_iters} must be less than the decay length {decay} "
                          "(--lr-decay-iters, default --train-iters)")
    if args.train_samples is not None:
        wrong = [n for n in ("lr_decay_iters", "lr_wsd_decay_iters") if getattr(args, n) is not None]
        wrong += ["lr_warmup_iters"] if args.lr_warmup_iters else []
        errors += [f"{flag(n)} needs --train-iters (this run counts --train-samples; use the *-samples flag)"
                   for n in wrong]
        decay = args.lr_decay_samples or args.train_samples  # the same rule as --lr-warmup-iters above
        if args.lr_warmup_samples and args.lr_warmup_samples >= decay >= 1:
            errors.append(f"--lr-warmup-samples {args.lr_warmup_samples} must be less than the decay length "
                          f"{decay} (--lr-decay-samples, default --train-samples)")
    if args.min_lr > args.lr >= 0:
        errors.append(f"--min-lr {args.min_lr} is above --lr {args.lr}")
    wsd_given = [n for n in ("lr_wsd_decay_style", "lr_wsd_decay_iters", "lr_wsd_decay_samples")
                 if getattr(args, n) is not None]
    if args.lr_decay_style == "WSD":
        if args.lr_wsd_decay_iters is None and args.lr_wsd_decay_samples is None:
            errors.append("--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples)")
        elif args.lr_wsd_decay_iters is not None and args.lr_decay_iters is not None and (
                args.lr_wsd_decay_iters > args.lr_decay_iters):
            errors.append(f"--lr-wsd-decay-iters {args.lr_wsd_decay_iters} exceeds --lr-decay-iters "
                          f"{args.lr_decay_iters}")
    else:
        errors += [f"{flag(n)} applies only to --lr-decay-style WSD" for n in wsd_given]
    return errors


def _check_optimizer_and_precision(args: argparse.Namespace) -> list[str]:
    errors = []
    for name in ("adam_beta1", "adam_beta2", "sgd_momentum"):
        if not 0.0 <= getattr(args, name) < 1.0:
            errors.append(f"{flag(name)} must be in [0, 1), got {getattr(args, name)}")
    if args.adam_eps <= 0:
        errors.append(f"--adam-eps must be > 0, got {args.adam_eps}")
    errors += _at_least(args, ("weight_decay", "clip_grad"), 0.0)
    if args.bf16 and args.fp16:
        errors.append("--bf16 and --fp16 are mutually exclusive")
    if args.loss_scale is not None and not args.fp16:
        errors.append("--loss-scale applies only to --fp16")
    for name in ("loss_scale", "initial_loss_scale", "min_loss_scale"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            errors.append(f"{flag(name)} must be > 0, got {value}")
    if args.min_loss_scale > args.initial_loss_scale > 0:
        errors.append(f"--min-loss-scale {args.min_loss_scale} is above --initial-loss-scale {args.initial_loss_scale}")
    errors += _at_least(args, ("loss_scale_window", "hysteresis"), 1)
    return errors


def _check_recompute(args: argparse.Namespace) -> list[str]:
    errors = []
    granularity, method = args.recompute_granularity, args.recompute_method
    if granularity == "selective" and method is not None:
        errors.append("--recompute-method applies to --recompute-granularity full, not selective")
    elif method is not None and granularity != "full":
        errors.append("--recompute-method needs --recompute-granularity full")
    elif granularity == "full" and method is None:
        errors.append("--recompute-granularity full needs --recompute-method uniform or block")
    if args.recompute_num_layers is not None:
        if method is None:
            errors.append("--recompute-num-layers needs --recompute-method")
        errors += _at_least(args, ("recompute_num_layers",), 1)
    return errors


def _check_faults(args: argparse.Namespace) -> list[str]:
    errors = _at_least(args, ("max_consecutive_nonfinite",), 1) + _at_least(args, ("loss_spike_window",), 2)
    errors += _at_least(args, ("heartbeat_timeout_seconds",), 0.0)
    if args.distributed_timeout_minutes <= 0:
        errors.append(f"--distributed-timeout-minutes must be > 0, got {args.distributed_timeout_minutes}")
    if args.loss_spike_factor is not None and not args.loss_spike_factor > 1.0:
        errors.append(f"--loss-spike-factor must be > 1, got {args.loss_spike_factor}")
    if args.continue_on_save_failure and args.save is None:
        errors.append("--continue-on-save-failure needs --save")
    return errors


def _not_a_directory(option: str, path: Optional[str]) -> list[str]:
    if path is not None and os.path.exists(path) and not os.path.isdir(path):
        return [f"{option} {path} is a file, not a directory"]
    return []


def _writable_file(option: str, path: Optional[str]) -> list[str]:
    if path is None:
        return []
    if os.path.isdir(path):
        return [f"{option} {path} is a directory"]
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return [f"{option} {path}: directory {parent} does not exist"]
    return []


def _check_checkpointing_and_exit(args: argparse.Namespace) -> list[str]:
    errors = _at_least(args, ("save_interval", "exit_interval"), 1)
    errors += _not_a_directory("--save", args.save) + _not_a_directory("--load", args.load)
    if args.save_interval is not None and args.save is None:
        errors.append("--save-interval needs --save")
    if args.no_save_optim and args.save is None:
        errors.append("--no-save-optim needs --save")
    for name in ("finetune", "exit_on_missing_checkpoint"):
        if getattr(args, name) and args.load is None:
            errors.append(f"{flag(name)} needs --load")
    if args.exit_signal_handler and args.save is None:
        errors.append("--exit-signal-handler needs --save (it saves a checkpoint before exiting)")
    if args.exit_duration_in_mins is not None and args.exit_duration_in_mins <= 0:
        errors.append(f"--exit-duration-in-mins must be > 0, got {args.exit_duration_in_mins}")
    return errors


def _check_evaluation_and_logging(args: argparse.Namespace) -> list[str]:
    errors = _at_least(args, ("eval_interval", "log_interval"), 1) + _at_least(args, ("eval_iters",), 0)
    if args.eval_interval is not None and args.eval_iters > 0 and uses_file_data(args):
        if args.data_path:
            try:
                if parse_split(args.split)[1] == 0:
                    errors.append(f"--eval-interval needs validation data, but --split {args.split} gives the "
                                  "validation split no documents")
            except ValueError:
                pass  # reported with the data flags
        elif args.valid_data_path is None:
            errors.append("--eval-interval needs validation data: add --valid-data-path")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        errors.append(f"--peak-tflops must be > 0, got {args.peak_tflops}")
    for name in ("wandb_exp_name", "wandb_save_dir"):
        if getattr(args, name) is not None and args.wandb_project is None:
            errors.append(f"{flag(name)} needs --wandb-project")
    errors += _writable_file("--metrics-file", args.metrics_file) + _writable_file("--trace-file", args.trace_file)
    errors += _not_a_directory("--tensorboard-dir", args.tensorboard_dir)
    errors += _not_a_directory("--wandb-save-dir", args.wandb_save_dir)
    return errors


def _check_sharding(args: argparse.Namespace, schedule: Optional[Schedule]) -> list[str]:
    if args.data_parallel_sharding_strategy != "optim_grads_params":
        return []
    # Stash stores that park saved tensors elsewhere (host memory, a peer) tell parameters from
    # activations by storage address, and sharded weights get a new address at every all-gather. What
    # the list does decides, not the schedule's name: a plugin or a file that offloads is refused too.
    if schedule is not None:
        from megatron_pp.schedules.runtime import runtime_needs

        needs = runtime_needs(schedule)
        source = " ".join([schedule_source(args)] + [f"{flag(n)} {getattr(args, n)}" for n in FILE_SCHEDULE_OPTIONS
                                                     if getattr(args, n, None) is not None])
        movers = [f"{what} ({source})" for what, needed in (("host offload", needs.host_offload),
                                                            ("peer parking", needs.peer_parking)) if needed]
    else:
        movers = [flag(n) for n in ("offload_chunks", "offload_fraction") if getattr(args, n, None) is not None]
    return [f"--data-parallel-sharding-strategy optim_grads_params cannot be combined with {m}: stashes parked "
            "off the device are not supported with sharded weights" for m in movers]


def schedule_source(args: argparse.Namespace) -> str:
    """How the user named the schedule, for messages."""
    if getattr(args, "pipeline_schedule_file", None):
        return f"--pipeline-schedule-file {args.pipeline_schedule_file}"
    return f"--pipeline-schedule {args.pipeline_schedule}"


def job_schedule_options(args: argparse.Namespace) -> dict:
    """The schedule options given on the command line for this job's schedule (ValueError naming a flag
    that does not apply)."""
    from megatron_pp.schedules.registry import options_from_args, schedule_options

    if not getattr(args, "pipeline_schedule_file", None):
        return options_from_args(args, args.pipeline_schedule)
    given = {o.name: getattr(args, o.name) for o in schedule_options() if getattr(args, o.name, None) is not None}
    for name in given:
        if name not in FILE_SCHEDULE_OPTIONS:
            raise ValueError(f"{flag(name)} does not apply to --pipeline-schedule-file (its options: "
                             f"{', '.join(flag(n) for n in FILE_SCHEDULE_OPTIONS)})")
    return given


def schedule_takes_offload_time(args: argparse.Namespace) -> bool:
    """Whether this job's schedule places host copies (so `--offload-time` matters)."""
    from megatron_pp.schedules.registry import get_schedule

    movers = ("offload_chunks", "offload_fraction")
    given = any(getattr(args, name, None) is not None for name in movers)
    if getattr(args, "pipeline_schedule_file", None):
        return given
    options = get_schedule(args.pipeline_schedule).options
    if "offload_time" not in options:
        return False
    # A schedule that takes the offload time but no amount (PO-H, PO-F) always offloads; the others (1F1B,
    # the zero-bubble family, ...) offload only when --offload-chunks or --offload-fraction asks.
    return given or not any(name in options for name in movers)


def build_job_schedule(args: argparse.Namespace, data_parallel_size: int, num_chunks: Optional[int],
                       offload_time: Optional[float] = None) -> Schedule:
    """The validated schedule this job runs, from the registry or from --pipeline-schedule-file: the one
    function `pretrain` and the argument checks both call. `num_chunks` None: the file says (a registered
    schedule then has 1). Raises ValueError with one line."""
    from megatron_pp.schedules.registry import build_schedule
    from megatron_pp.schedules.schedule_file import build_schedule_from_file

    pp = args.pipeline_model_parallel_size
    m = args.global_batch_size // (args.micro_batch_size * data_parallel_size)
    options = job_schedule_options(args)
    if offload_time is not None:
        options["offload_time"] = offload_time
    if getattr(args, "pipeline_schedule_file", None):
        return build_schedule_from_file(args.pipeline_schedule_file, num_ranks=pp, num_microbatches=m,
                                        num_chunks=num_chunks, **options)
    return build_schedule(args.pipeline_schedule, pp, m, num_chunks or 1, **options)


def virtual_stages_given(args: argparse.Namespace) -> bool:
    return (args.num_layers_per_virtual_pipeline_stage is not None
            or getattr(args, "num_virtual_stages_per_pipeline_rank", None) is not None)


def _check_schedule(args: argparse.Namespace, config: Optional[TransformerConfig],
                    world: int) -> tuple[list[str], Optional[Schedule]]:
    """Errors of the schedule flags, and the schedule for the checks that read its lists: the job's own when
    its sizes are right, else the registered schedule at a size it accepts (what the lists contain does not
    depend on their length), or None."""
    from megatron_pp.models.layout import split_layers
    from megatron_pp.schedules.registry import list_schedules

    if getattr(args, "pipeline_schedule_file", None) and getattr(args, "pipeline_schedule_given", False):
        return [f"--pipeline-schedule {args.pipeline_schedule} and --pipeline-schedule-file "
                f"{args.pipeline_schedule_file} both name the schedule: give one"], None
    if not getattr(args, "pipeline_schedule_file", None):
        known = list_schedules()
        if args.pipeline_schedule not in known:
            return [f"unknown --pipeline-schedule {args.pipeline_schedule!r}; known: {', '.join(known)}"], None
    try:
        job_schedule_options(args)
    except ValueError as exc:
        return [str(exc)], None
    tp, pp, mbs = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.micro_batch_size
    dp = world // (tp * pp) if min(tp, pp) >= 1 and world % (tp * pp) == 0 else 0
    gbs = args.global_batch_size if args.global_batch_size is not None else mbs * dp  # derive_args' default
    if config is None or mbs < 1 or dp < 1 or gbs < 1 or gbs % (mbs * dp):
        # The sizes are wrong (their own checks say so): what the schedule needs still decides the rest.
        facts = _schedule_at_nominal_size(args)
        return ((_check_weight_versions(args, facts) if facts is not None else []), facts)
    try:
        chunks = num_chunks(args, config) if virtual_stages_given(args) or not args.pipeline_schedule_file else None
        schedule = build_job_schedule(argparse.Namespace(**{**vars(args), "global_batch_size": gbs}), dp, chunks)
        if args.pipeline_schedule_file and chunks is None:
            split_layers(config.num_layers, pp, schedule.num_chunks,
                         account_for_embedding=args.account_for_embedding_in_pipeline_split,
                         account_for_loss=args.account_for_loss_in_pipeline_split)
    except ValueError as exc:
        return [" ".join(str(exc).split())], None
    return _check_weight_versions(args, schedule), schedule


def _schedule_at_nominal_size(args: argparse.Namespace) -> Optional[Schedule]:
    """The job's registered schedule at a size it accepts (2p microbatches per step), or None: for the checks
    that depend on what its lists contain, not on their length, when the job's own sizes are wrong."""
    if getattr(args, "pipeline_schedule_file", None) or args.pipeline_model_parallel_size < 1:
        return None
    from megatron_pp.schedules.registry import build_at_nominal_size

    try:
        return build_at_nominal_size(args.pipeline_schedule, args.pipeline_model_parallel_size,
                                     **job_schedule_options(args))
    except ValueError:
        return None


def _check_weight_versions(args: argparse.Namespace, schedule: Schedule) -> list[str]:
    """Lists with weight versions (2BW's deferred update, training/weight_versions.py) keep whole fp32 main
    weights and gradients per stage: refused with sharding here, before the model is built."""
    from megatron_pp.schedules.runtime import runtime_needs

    if not runtime_needs(schedule).weight_versions:
        return []
    sharded = ["--use-distributed-optimizer"] if args.use_distributed_optimizer else []
    if args.data_parallel_sharding_strategy != "no_shard":
        sharded.append(f"--data-parallel-sharding-strategy {args.data_parallel_sharding_strategy}")
    return [f"{schedule_source(args)} keeps whole fp32 main weights and gradients per stage (weight versions): "
            f"{s} is not supported with it" for s in sharded]


def _check_model(args: argparse.Namespace) -> tuple[list[str], Optional[TransformerConfig]]:
    from megatron_pp.models.layout import split_layers

    errors = []
    if args.group_query_attention and args.num_query_groups is None and not args.model_preset:
        errors.append("--group-query-attention needs --num-query-groups")
    if args.use_flash_attn and args.attention_backend not in (None, "flash"):
        errors.append(f"--use-flash-attn contradicts --attention-backend {args.attention_backend}")
    # With file datasets the vocabulary is the tokenizer's, unknown until it is loaded; no shape check
    # here depends on it, so a stand-in keeps the other checks running.
    stand_in = 1 if uses_file_data(args) else None
    try:
        config = model_config_from_args(args, vocab_size=stand_in)
    except ValueError as exc:
        return errors + [str(exc)], None
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    try:
        config.validate(max(tp, 1))
    except ValueError as exc:
        errors.append(str(exc))
    try:
        chunks = num_chunks(args, config)
        if min(tp, pp) >= 1:
            split_layers(
                config.num_layers, pp, chunks,
                first_stage_layers=args.decoder_first_pipeline_num_layers,
                last_stage_layers=args.decoder_last_pipeline_num_layers,
                account_for_embedding=args.account_for_embedding_in_pipeline_split,
                account_for_loss=args.account_for_loss_in_pipeline_split,
                placement=_fixed_placement(args),
            )
    except ValueError as exc:
        errors.append(str(exc))
    return errors, config


def _flash_flag(args: argparse.Namespace, config: Optional[TransformerConfig]) -> Optional[str]:
    """The flag that asks for flash-attn kernels (as the user spelled it), or None."""
    if args.use_flash_attn:
        return "--use-flash-attn"
    if args.attention_backend == "flash" or (config is not None and config.attention_backend == "flash"):
        return "--attention-backend flash"
    return None


def _check_flash_precision(args: argparse.Namespace, config: Optional[TransformerConfig]) -> list[str]:
    flash = _flash_flag(args, config)
    if flash is not None and not (args.bf16 or args.fp16):
        return [f"{flash} needs --bf16 or --fp16 (flash-attn kernels take only half-precision tensors)"]
    return []


def _check_this_machine(args: argparse.Namespace, config: Optional[TransformerConfig]) -> list[str]:
    """What the flags need from the machine that runs them: CUDA and the flash-attn package. Without this
    check a missing kernel is found at the first forward, after the model, optimizer and data are built."""
    from megatron_pp.models import attention

    errors = []
    cuda = torch.cuda.is_available()
    if getattr(args, "apply_rope_fusion", False) and not cuda:
        errors.append("--apply-rope-fusion needs CUDA (the CPU path runs the op-by-op rotation)")
    flash = _flash_flag(args, config)
    if flash is not None and not cuda:
        errors.append(f"{flash} needs CUDA (flash-attn has no CPU kernels); use --attention-backend auto or sdpa")
    elif flash is not None and not attention.flash_attn_available():
        errors.append(f"{flash}: the flash-attn package does not import here (pip install flash-attn), "
                      f"or use --attention-backend auto or sdpa")
    return errors


def _fixed_placement(args: argparse.Namespace) -> Optional[list[tuple[int, int]]]:
    """The stage placement of a schedule with a fixed chunk count (the V shapes), for the layer split; None
    (the interleaved placement) for the others, and when the schedule cannot be built (reported elsewhere)."""
    if _fixed_chunks(args) is None or args.pipeline_model_parallel_size < 1:
        return None
    from megatron_pp.schedules.registry import build_at_nominal_size

    try:
        return build_at_nominal_size(args.pipeline_schedule, args.pipeline_model_parallel_size).placement
    except ValueError:
        return None


def validate_args(args: argparse.Namespace, world_size: Optional[int] = None, *,
                  this_machine: bool = True) -> list[str]:
    """Every problem with the arguments, one line each (empty list: fine). Reads no data and builds no model
    or process group; it does build the job's action lists (pure and quick), so a schedule that cannot run
    at these sizes is refused here.

    `world_size` stands in for the launcher's (tools that check a configuration for another job size).
    `this_machine` (default) also checks that this machine has what the flags need (CUDA, flash-attn);
    tools that check a configuration meant for other machines (a cluster's launch script, a plan) pass False."""
    world = _world_size() if world_size is None else world_size
    errors = _check_parallel_and_batch(args, world)
    errors += _check_length_and_lr(args)
    errors += _check_optimizer_and_precision(args)
    errors += _check_recompute(args)
    errors += _check_checkpointing_and_exit(args)
    errors += _check_faults(args)
    errors += _check_evaluation_and_logging(args)
    model_errors, config = _check_model(args)
    schedule_errors, schedule = _check_schedule(args, config, world)
    errors += schedule_errors
    errors += _check_sharding(args, schedule)
    errors += model_errors
    errors += _check_flash_precision(args, config)
    if this_machine:
        errors += _check_this_machine(args, config)
    seq_length = config.seq_length if config is not None else 1
    errors += check_data_args(data_config_from_args(args, seq_length=seq_length), mock_data=args.mock_data)
    # One line per problem: the layer split and the schedule both read the virtual-stage flags, so a bad
    # value there is found twice.
    errors = list(dict.fromkeys(errors))
    if not errors:
        errors += _check_lr_schedule(args)
    return errors


def _check_lr_schedule(args: argparse.Namespace) -> list[str]:
    """The LR schedule training will build, built now: the flag checks above do not cover every
    combination it refuses (a WSD decay longer than what the warm-up leaves, sample-based lengths), and
    its refusal in `pretrain` would come after the model and the datasets are built."""
    from megatron_pp.training.optimizer import LRSchedule

    try:
        LRSchedule.from_args(derive_args(copy.copy(args)))
    except ValueError as exc:
        return [str(exc)]
    return []


# Parsing ----------------------------------------------------------------------------------------------


def derive_args(args: argparse.Namespace, world_size: Optional[int] = None) -> argparse.Namespace:
    """Fill in what the flags imply (in place, as Megatron does): the global batch size and train_iters."""
    world = _world_size() if world_size is None else world_size
    dp = world // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size)
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    if args.data_parallel_sharding_strategy != "no_shard":  # every sharding strategy shards the optimizer
        args.use_distributed_optimizer = True
    if args.train_iters is None:
        args.train_iters = args.train_samples // args.global_batch_size
    return args


def _parse_and_validate(argv: Sequence[str], description: str, default_preset: Optional[str]) -> argparse.Namespace:
    """Parse (with --config) and validate; raises ArgumentError with every problem found."""
    argv = list(argv)
    try:
        load_plugins(argv)  # before the parser: a plugin's schedules and option flags are part of it
    except PluginError as exc:
        raise ArgumentError([str(exc)]) from exc
    parser = build_parser(description)
    try:
        argv = expand_config_file(parser, argv)
    except ConfigFileError as exc:
        raise ArgumentError(exc.lines) from exc
    args = parser.parse_args(argv)
    if default_preset is not None and args.model_preset is None and args.num_layers is None:
        args.model_preset = default_preset
    errors = validate_args(args)
    if errors:
        raise ArgumentError(errors)
    return args


def parse_args(argv: Optional[Sequence[str]] = None, description: str = "megatron_pp pretraining",
               default_preset: Optional[str] = None,
               agree: Optional[Callable[[list[str]], None]] = None) -> argparse.Namespace:
    """Parse (with --config), validate and derive; on usage errors print one line per problem and exit 2.

    `default_preset` is the entry point's model when neither the command line nor the config file
    names one (`--model-preset`) or describes one (`--num-layers`). `agree(lines)` replaces the printing
    and exit for a launched job: every rank calls it, with or without problems, and it returns only
    when no rank has one (`errors.agree_on_usage_errors`).
    """
    try:
        args, lines = _parse_and_validate(sys.argv[1:] if argv is None else argv, description, default_preset), []
    except ArgumentError as exc:
        args, lines = None, exc.lines
    (agree or (lambda found: agree_on_usage_errors(found, None, 0, 1)))(lines)
    assert args is not None  # `agree` returns only when no rank found a problem
    return derive_args(args)
