"""Flag declarations of the training scripts, with Megatron-LM's flag names.

One source of truth per kind of flag: model-shape flags are generated from `TransformerConfig`'s fields
(a new field gets its flag, with the field's docstring as help), schedule options from the schedule
registry (`register_option`), data and tokenizer flags from the data package's `DataConfig`; the
training flags are declared here. Where Megatron spells a model setting differently from the field
(`--disable-bias-linear` for `add_bias_linear=False`, `--swiglu`, `--use-flash-attn`), its spelling is
registered as well. Model flags default to None so that a `--model-preset` supplies the base and only
flags given explicitly override it. Checks live in `arguments`, config files in `config_files`.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import typing
from typing import Any, Sequence

from megatron_pp.data.builder import add_data_args
from megatron_pp.training.megatron_compat import add_megatron_compat_args
from megatron_pp.models.config import TransformerConfig, flag
from megatron_pp.schedules.plugins import add_plugin_flag
from megatron_pp.schedules.registry import schedule_options

# Fields that are not set by their own generated flag (Megatron spells them differently, or they are
# derived from precision flags).
_SPECIAL_FIELDS = {"add_bias_linear", "untie_embeddings_and_output_weights", "params_dtype", "apply_layernorm_1p"}


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
    group.add_argument("--apply-layernorm-1p", dest="apply_layernorm_1p", action="store_true", default=None,
                       help=docs["apply_layernorm_1p"])
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


class _NamedSchedule(argparse.Action):
    """Stores --pipeline-schedule and notes that it was given (its default, 1f1b, cannot tell), so that
    naming a schedule beside --pipeline-schedule-file is refused rather than one of the two ignored."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.pipeline_schedule_given = True


def build_parser(description: str = "megatron_pp pretraining") -> argparse.ArgumentParser:
    """The full parser: --config, the model flags (generated), then parallelism, training and run flags."""
    parser = _OneLineParser(description=description, allow_abbrev=False)
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="YAML file of flag values (keys are flag names); command-line flags override it.")
    add_model_args(parser)
    add_parallel_args(parser)
    add_training_args(parser)
    add_run_args(parser)
    add_dry_run_args(parser)
    add_megatron_compat_args(parser)
    return parser


def add_dry_run_args(parser: argparse.ArgumentParser) -> None:
    """The dry run (docs/dry_run.md): the job's real code for chosen ranks of a world of N, on fake tensors."""
    dry = parser.add_argument_group("dry run")
    dry.add_argument("--dry-run", type=int, default=None, metavar="N",
                     help="Run the job as if launched on N ranks, on fake tensors and torch's fake process "
                          "group, one chosen rank after another in this process; print per-rank memory.")
    dry.add_argument("--dry-run-ranks", default=None, metavar="all|R,R,...",
                     help="Global ranks to run (default: one per distinct pipeline rank and tp position).")
    dry.add_argument("--dry-run-json", default=None, metavar="FILE", help="Write one JSON object per rank.")
    dry.add_argument("--dry-run-device", choices=("cpu", "meta"), default="cpu",
                     help="Device of the fake tensors: meta also checks every collective's tensors are on it.")
    dry.add_argument("--dry-run-optimizer", choices=("fused", "foreach"), default="fused",
                     help="AdamW kernel the dry run builds: fused (default: what a GPU job runs, torch's fused "
                          "kernel standing for apex's, both in place) or foreach (what a CPU job runs).")
    dry.add_argument("--dry-run-jobs", type=int, default=None, metavar="N",
                     help="Worker processes running the chosen ranks (default: one per usable core, at most one "
                          "per rank; 1: one after another in this process).")


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    """Parallel sizes, the pipeline schedule (its options declared by the schedules), communication."""
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


def add_training_args(parser: argparse.ArgumentParser) -> None:
    """Training length and batch, learning rate, optimizer, precision, recomputation."""
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


def add_run_args(parser: argparse.ArgumentParser) -> None:
    """Checkpointing, stopping early, faults, evaluation, data and logging."""
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
