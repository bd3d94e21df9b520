"""The job's pipeline schedule from its flags: chunks per rank, the options given, the validated lists.

`build_job_schedule` is the one function that both `pretrain` and the argument checks call, so the lists
that are checked are the lists that run.
"""
from __future__ import annotations

import argparse
from typing import Optional

from megatron_pp.models.config import TransformerConfig, flag
from megatron_pp.schedules.ir import Schedule
from megatron_pp.schedules.schedule_file import FILE_SCHEDULE_OPTIONS

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
        return fixed_chunks(args) or 1
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


def fixed_chunks(args: argparse.Namespace) -> Optional[int]:
    """Chunks per rank a registered schedule always uses (the V shapes' 2), so that they need no flag."""
    from megatron_pp.schedules.registry import get_schedule

    name = getattr(args, "pipeline_schedule", None)
    if getattr(args, "pipeline_schedule_file", None) or name is None:
        return None
    try:
        return get_schedule(name).chunks_per_rank
    except ValueError:  # an unknown name is reported by the schedule checks
        return None


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
                       offload_time: Optional[float] = None, num_microbatches: Optional[int] = None) -> Schedule:
    """The validated schedule this job runs, from the registry or from --pipeline-schedule-file: the one
    function `pretrain` and the argument checks both call. `num_chunks` None: the file says (a registered
    schedule then has 1). `num_microbatches` None: --global-batch-size's; else a step of the batch-size
    ramp-up (`training.batch_ramp`). Raises ValueError with one line."""
    from megatron_pp.schedules.registry import build_schedule
    from megatron_pp.schedules.schedule_file import build_schedule_from_file

    pp = args.pipeline_model_parallel_size
    m = num_microbatches or args.global_batch_size // (args.micro_batch_size * data_parallel_size)
    options = job_schedule_options(args)
    if offload_time is not None:
        options["offload_time"] = offload_time
    if getattr(args, "pipeline_schedule_file", None):
        return build_schedule_from_file(args.pipeline_schedule_file, num_ranks=pp, num_microbatches=m,
                                        num_chunks=num_chunks, **options)
    return build_schedule(args.pipeline_schedule, pp, m, num_chunks or 1, **options)


def check_ramp_sizes(args: argparse.Namespace, data_parallel_size: int, num_chunks: Optional[int],
                     counts: list[int]) -> None:
    """The batch-size ramp-up's microbatch counts, checked before the run: the smallest is built and validated
    as the main list is, and every count runs the schedule's generator (`registry.generate_schedule`, what
    `build_schedule` starts from), whose refusals (too few microbatches, a count that is not a multiple of
    the group size, a schedule file made for another count) are the ones a count can meet. Each count's list
    is built and validated in full when the job first reaches it (`Pipeline.executor_for`): building them
    all here costs about a second per count of a GPT-3 ramp at pp 16. A list with weight versions (2BW, or
    a plugin's or file's list like it) is refused: its steps overlap without a flush, so it has one count.
    Raises ValueError naming the count."""
    from megatron_pp.schedules.registry import generate_schedule
    from megatron_pp.schedules.runtime import runtime_needs

    for i, m in enumerate(sorted(counts)):
        batch = m * args.micro_batch_size * data_parallel_size
        try:
            if i == 0 or getattr(args, "pipeline_schedule_file", None):
                schedule = build_job_schedule(args, data_parallel_size, num_chunks, num_microbatches=m)
                if runtime_needs(schedule).weight_versions:
                    raise ValueError(f"{schedule_source(args)} runs on two weight versions, its optimizer steps "
                                     "overlapping without a flush, so every step needs the same microbatch count; "
                                     "a ramp-up is not supported with it")
                continue
            generate_schedule(args.pipeline_schedule, args.pipeline_model_parallel_size, m, num_chunks or 1,
                              **job_schedule_options(args))
        except ValueError as exc:
            raise ValueError(f"--rampup-batch-size: the ramp's global batch {batch} ({m} microbatches per step): "
                             f"{' '.join(str(exc).split())}") from exc


def virtual_stages_given(args: argparse.Namespace) -> bool:
    return (args.num_layers_per_virtual_pipeline_stage is not None
            or getattr(args, "num_virtual_stages_per_pipeline_rank", None) is not None)


def fixed_placement(args: argparse.Namespace) -> Optional[list[tuple[int, int]]]:
    """The stage placement of a schedule with a fixed chunk count (the V shapes), for the layer split; None
    (the interleaved placement) for the others, and when the schedule cannot be built (reported elsewhere)."""
    if fixed_chunks(args) is None or args.pipeline_model_parallel_size < 1:
        return None
    from megatron_pp.schedules.registry import build_at_nominal_size

    try:
        return build_at_nominal_size(args.pipeline_schedule, args.pipeline_model_parallel_size).placement
    except ValueError:
        return None
