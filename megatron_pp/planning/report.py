"""What the planner hands a user: the launch flags and command line of a configuration (the flags
`pretrain_gpt.py` / `pretrain_llama.py` take), the training script's own verdict on them (`refusal`, which
the planner asks before it ranks a configuration), and a prediction as a plain table row (tools/plan.py's
table and JSON)."""
from __future__ import annotations

import dataclasses
import warnings
from typing import Mapping, Optional

from megatron_pp.models.config import TransformerConfig, flag
from megatron_pp.models.presets import get_preset
from megatron_pp.planning.job import GIB, Cluster, Configuration, Job, Prediction
from megatron_pp.schedules.offload import OffloadWarning
from megatron_pp.schedules.registry import schedule_options


def entry_point(config: TransformerConfig) -> str:
    """pretrain_llama.py for the LLaMA family (RoPE), else pretrain_gpt.py; both accept every preset."""
    return "pretrain_llama.py" if config.position_embedding_type == "rope" else "pretrain_gpt.py"


def _model_flags(job: Job) -> list[str]:
    """`--model-preset` plus a flag for every config field the job changes from the preset."""
    flags = ["--model-preset", job.preset]
    base = get_preset(job.preset)
    for f in dataclasses.fields(TransformerConfig):
        if f.name == "params_dtype":
            continue
        value, default = getattr(job.config, f.name), getattr(base, f.name)
        if value == default:
            continue
        if f.name == "add_bias_linear" and value is False:
            flags.append("--disable-bias-linear")
        elif f.name == "untie_embeddings_and_output_weights" and value is True:
            flags.append("--untie-embeddings-and-output-weights")
        elif isinstance(value, bool) or value is None:
            raise ValueError(f"{flag(f.name)}: the launch flags cannot switch this preset's value back; use "
                             "another preset")
        else:
            flags += [flag(f.name), str(value)]
    return flags


def launch_flags(job: Job, c: Configuration) -> list[str]:
    """The training flags of configuration `c` (add data and length flags: `--data-path`/`--mock-data`,
    `--train-iters`/`--train-samples`)."""
    option_flags = {o.name: o.flag for o in schedule_options()}
    flags = _model_flags(job)
    flags += ["--tensor-model-parallel-size", str(c.tp), "--pipeline-model-parallel-size", str(c.pp)]
    if c.num_chunks > 1:
        flags += ["--num-layers-per-virtual-pipeline-stage", str(job.config.num_layers // (c.pp * c.num_chunks))]
    for plugin in job.plugins:
        flags += ["--schedule-plugin", plugin]
    files = dict(job.schedule_files)
    flags += ["--pipeline-schedule-file", files[c.schedule]] if c.schedule in files else ["--pipeline-schedule",
                                                                                          c.schedule]
    for name, value in c.options:
        if name not in option_flags:
            raise ValueError(f"schedule option {name!r} has no registered flag (registry.register_option)")
        if isinstance(value, bool):  # on/off options are --flag / --no-flag (training.arguments)
            flags.append(option_flags[name] if value else "--no-" + option_flags[name][2:])
        else:
            flags += [option_flags[name], f"{value:g}" if isinstance(value, float) else str(value)]
    if c.sequence_parallel:
        flags.append("--sequence-parallel")
    if c.distributed_optimizer:
        flags.append("--use-distributed-optimizer")
    flags += ["--micro-batch-size", str(c.micro_batch_size), "--global-batch-size", str(job.global_batch_size)]
    if c.recompute == "full":
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    elif c.recompute == "selective":
        flags += ["--recompute-granularity", "selective"]
    if job.bf16:
        flags.append("--bf16")
    return flags


def refusal(job: Job, cluster: Cluster, c: Configuration, parser=None) -> Optional[str]:
    """The training script's own argument check (`training.arguments.validate_args`, the function
    `pretrain_gpt.py` runs, not a copy) on the flags `c` prints, with mock data and one iteration standing in
    for the data and length flags the user adds, at the cluster's world size and without asking this machine
    for CUDA: the first error, or None when the script would start. `parser`: a `build_parser()` to reuse
    (building one takes longer than most checks)."""
    from megatron_pp.training import arguments  # looked up at call time: the script's function as it is now

    parser = arguments.build_parser() if parser is None else parser
    flags = launch_flags(job, c) + ["--mock-data", "--train-iters", "1"]
    with warnings.catch_warnings():
        # Stashes the offload pass cannot place stay on the device: the plan's memory already shows them.
        warnings.simplefilter("ignore", OffloadWarning)
        errors = arguments.validate_args(parser.parse_args(flags), world_size=cluster.num_gpus, this_machine=False)
    return errors[0] if errors else None


def launch_command(job: Job, cluster: Cluster, c: Configuration) -> str:
    """A shell line that starts `c`: launch/local.sh on one node, launch/slurm/pretrain.sbatch beyond."""
    per_node = cluster.hardware.gpus_per_node
    script = entry_point(job.config)
    flags = " ".join(launch_flags(job, c))
    if cluster.num_gpus <= per_node:
        return f"NPROC={cluster.num_gpus} bash launch/local.sh {script} {flags}"
    nodes = -(-cluster.num_gpus // per_node)
    return f"GPUS_PER_NODE={per_node} sbatch --nodes {nodes} launch/slurm/pretrain.sbatch {script} {flags}"


STEP_TIME_VALIDATED = False
"""Whether `tools/validate_planner.py` has put the predicted step times of tp = 1 configurations within 15% of
measured ones. Its recorded run (docs/planner.md, 'Accuracy on CPU') missed by −40% to +211% on a loaded
machine, so no row's step time is validated yet; the JSON rows of tools/plan.py say so."""
TENSOR_PARALLEL_VALIDATED = False
TENSOR_PARALLEL_STATUS = ("tools/validate_planner.py has not put the tensor-parallel term within 15% of a measured "
                          "step (docs/planner.md, 'Accuracy on CPU'); measure the target GPU with tools/bench_layer.py "
                          "--tp before trusting tp > 1 rows")
"""Whether `tools/validate_planner.py` put tp > 1 step times within 15% of measured ones (docs/planner.md,
'Accuracy on CPU'); until it does, tools/plan.py marks those rows and their JSON says so."""


def summary_row(p: Prediction) -> Mapping[str, object]:
    """The columns of the ranked table, as plain values (also the JSON rows of tools/plan.py)."""
    c = p.configuration
    return {
        "configuration": c.label(), "schedule": c.schedule, "v": c.num_chunks, "options": dict(c.options), "tp": c.tp, "pp": c.pp, "dp": c.dp,
        "micro_batch_size": c.micro_batch_size, "num_microbatches": p.num_microbatches, "recompute": c.recompute,
        "distributed_optimizer": c.distributed_optimizer, "weight_versions": p.weight_versions,
        "peak_memory_gib": p.peak_memory_bytes / GIB, "worst_rank": p.worst_rank,
        "stash_gib": [b / GIB for b in p.stash_bytes], "peak_stashes": list(p.peak_stashes),
        "optimizer_step_gib": [b / GIB for b in p.optimizer_step_bytes],
        "step_s": p.step_s, "pipeline_s": p.pipeline_s, "reduce_s": p.reduce_s,
        "bubble_fraction": p.bubble_fraction, "mfu": p.mfu, "tokens_per_s": p.tokens_per_s,
        "extrapolated": p.extrapolated,
        "step_time_validated": STEP_TIME_VALIDATED and (c.tp == 1 or TENSOR_PARALLEL_VALIDATED),
    }
