"""Validation and parsing of the training scripts' arguments (flags in `flags`, config files in `config_files`).

`validate_args` returns every problem at once, one line each, naming the flag, and touches nothing;
`parse_args` prints them and exits with status 2 before any process group, model or data exists, then
derives what Megatron derives (`--global-batch-size` defaults to micro-batch × data-parallel size;
`--train-samples` becomes `--train-iters`).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
from typing import Callable, Optional, Sequence

import torch

from megatron_pp.core import comm
from megatron_pp.core.parallel_state import read_launch_env
from megatron_pp.data.builder import check_data_args, data_config_from_args, parse_split
from megatron_pp.models.config import TransformerConfig, flag
from megatron_pp.schedules.ir import Schedule
from megatron_pp.schedules.plugins import PluginError, load_plugins
from megatron_pp.schedules.schedule_file import FILE_SCHEDULE_OPTIONS
from megatron_pp.training.config_files import ConfigFileError, expand_config_file
from megatron_pp.training.errors import agree_on_usage_errors
from megatron_pp.training.flags import ArgumentError, build_parser
from megatron_pp.training.batch_ramp import BatchSizes, check_rampup
from megatron_pp.training.megatron_compat import MEGATRON_ATTENTION_BACKENDS, check_megatron_compat
from megatron_pp.training.job_schedule import (build_job_schedule, check_ramp_sizes, fixed_placement,
                                               job_schedule_options, num_chunks, schedule_source,
                                               schedule_takes_offload_time, virtual_stages_given)

# The names other modules take from here; the flag, config-file and schedule ones live in their own modules.
__all__ = ["ArgumentError", "build_parser", "build_job_schedule", "derive_args", "expand_config_file",
           "model_config_from_args", "num_chunks", "parse_args", "schedule_takes_offload_time", "uses_file_data",
           "validate_args"]


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
    elif overrides.get("attention_backend") in MEGATRON_ATTENTION_BACKENDS:  # Megatron-LM's names for its kernels
        overrides["attention_backend"] = MEGATRON_ATTENTION_BACKENDS[overrides["attention_backend"]]
    overrides["params_dtype"] = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    if args.model_preset:
        return dataclasses.replace(get_preset(args.model_preset), **overrides)
    missing = [flag(n) for n in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size")
               if n not in overrides]
    if missing:
        raise ValueError(f"give --model-preset or all of {', '.join(missing)}")
    return TransformerConfig(**overrides)


# Validation -------------------------------------------------------------------------------------------


def _dry_run_world(args: argparse.Namespace) -> Optional[int]:
    """`--dry-run N`: the job is checked as if launched on N ranks (None: not a dry run)."""
    return getattr(args, "dry_run", None)


def _check_dry_run(args: argparse.Namespace) -> list[str]:
    """--dry-run N needs N >= 1; --dry-run-ranks is `all` or global ranks below N."""
    world, ranks = _dry_run_world(args), getattr(args, "dry_run_ranks", None)
    jobs = getattr(args, "dry_run_jobs", None)
    if world is None:
        return [f"--dry-run-ranks needs --dry-run N"] if ranks is not None else []
    if jobs is not None and jobs < 1:
        return [f"--dry-run-jobs {jobs}: needs at least one worker"]
    if world < 1:
        return [f"--dry-run {world}: the world must have at least one rank"]
    if ranks is None or ranks == "all":
        return []
    try:
        listed = [int(r) for r in ranks.split(",")]
    except ValueError:
        return [f"--dry-run-ranks {ranks!r}: expected 'all' or global ranks such as 0,7,63"]
    bad = [r for r in listed if not 0 <= r < world]
    return [f"--dry-run-ranks: rank {bad[0]} is not in a world of {world} (ranks 0..{world - 1})"] if bad else []


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
        sized = argparse.Namespace(**{**vars(args), "global_batch_size": gbs})
        schedule = build_job_schedule(sized, dp, chunks)
        _build_ramp_schedules(sized, dp, chunks)
        if args.pipeline_schedule_file and chunks is None:
            split_layers(config.num_layers, pp, schedule.num_chunks,
                         account_for_embedding=args.account_for_embedding_in_pipeline_split,
                         account_for_loss=args.account_for_loss_in_pipeline_split)
    except ValueError as exc:
        return [" ".join(str(exc).split())], None
    return _check_weight_versions(args, schedule), schedule


def _data_parallel_size(args: argparse.Namespace, world: int) -> Optional[int]:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    return world // (tp * pp) if min(tp, pp) >= 1 and world % (tp * pp) == 0 else None


def _check_rampup(args: argparse.Namespace, world: int) -> list[str]:
    dp = _data_parallel_size(args, world)
    gbs = args.global_batch_size if args.global_batch_size is not None or not dp else args.micro_batch_size * dp
    return check_rampup(argparse.Namespace(**{**vars(args), "global_batch_size": gbs}), dp)


def _build_ramp_schedules(args: argparse.Namespace, dp: int, chunks: Optional[int]) -> None:
    """The batch-size ramp-up's other microbatch counts, checked as `job_schedule.check_ramp_sizes` says."""
    if getattr(args, "rampup_batch_size", None) is None or check_rampup(args, dp):
        return  # no ramp, or a bad one (its own lines)
    counts = [size // (args.micro_batch_size * dp) for size in BatchSizes.from_args(args).distinct_sizes()
              if size != args.global_batch_size]
    check_ramp_sizes(args, dp, chunks, counts)


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
                placement=fixed_placement(args),
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


def validate_args(args: argparse.Namespace, world_size: Optional[int] = None, *,
                  this_machine: bool = True) -> list[str]:
    """Every problem with the arguments, one line each (empty list: fine). Reads no data and builds no model
    or process group; it does build the job's action lists (pure and quick), so a schedule that cannot run
    at these sizes is refused here.

    `world_size` stands in for the launcher's (tools that check a configuration for another job size).
    `this_machine` (default) also checks that this machine has what the flags need (CUDA, flash-attn);
    tools that check a configuration meant for other machines (a cluster's launch script, a plan) pass False."""
    world = _dry_run_world(args) or (_world_size() if world_size is None else world_size)
    errors = _check_parallel_and_batch(args, world)
    errors += _check_length_and_lr(args)
    errors += _check_optimizer_and_precision(args)
    errors += _check_recompute(args)
    errors += _check_checkpointing_and_exit(args)
    errors += _check_faults(args)
    errors += _check_evaluation_and_logging(args)
    errors += check_megatron_compat(args)
    errors += _check_rampup(args, world)
    model_errors, config = _check_model(args)
    schedule_errors, schedule = _check_schedule(args, config, world)
    errors += schedule_errors
    errors += _check_sharding(args, schedule)
    errors += model_errors
    errors += _check_flash_precision(args, config)
    errors += _check_dry_run(args)
    if this_machine and not _dry_run_world(args):  # a dry run checks a job meant for other machines
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
    world = _dry_run_world(args) or (_world_size() if world_size is None else world_size)
    dp = world // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size)
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    if args.data_parallel_sharding_strategy != "no_shard":  # every sharding strategy shards the optimizer
        args.use_distributed_optimizer = True
    if args.tensor_model_parallel_size == 1 and args.sequence_parallel:  # Megatron-LM's rule: nothing to split
        args.sequence_parallel, args.sequence_parallel_at_tp1 = False, True
    if args.train_iters is None:  # Megatron-LM's count, the batch-size ramp-up's iterations included
        args.train_iters = BatchSizes.from_args(args).train_iters(args.train_samples)
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
