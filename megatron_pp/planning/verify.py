"""The planner held to the dry run: a plan's configuration run as the real job on fake tensors, measured beside
predicted (`tools/plan.py --verify N`, docs/planner.md "Against the dry run").

`verify(job, cluster, prediction)` takes the flags the plan prints (`report.launch_flags`, plus mock data and
two iterations), passes them through the training script's one check (`training.arguments.validate_args` at
the plan's world size), and dry-runs the plan's worst pipeline rank (`training.dry_run.run_rank`: tp 0,
dp 0 of that pipeline rank, in this process). The dry run builds the AdamW kernel the plan's job runs
(`--dry-run-optimizer`, the job's `optimizer`: fused for a cuda job, foreach for a cpu one), so the plan's own
prediction is what it is compared with. A dry run made earlier is compared (`compare_dry_run`) with the kernel
its rows say it built (`optimizer_of`: rows from before the rows named it ran foreach AdamW).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence

from megatron_pp.planning.cost import Evaluator
from megatron_pp.planning.job import Cluster, Configuration, Job, Prediction

MIB = 2 ** 20

DRY_RUN_OPTIMIZER = "fused"
"""The AdamW kernel the dry run builds by default (`--dry-run-optimizer`): what a GPU job runs."""


DRY_RUN_WEIGHT_GRAD_FOLD = "upcast"
"""How the dry run's bf16 linear layers add weight gradients into the fp32 main gradient: its fake tensors are
CPU tensors, so `core.tensor_parallel.layers.add_to_main_grad` takes its CPU branch (fp32 copies of both GEMM
operands) where a GPU with fp32-output GEMMs makes one fp32 product of the weight's size
(`memory.WEIGHT_GRAD_FOLDS`)."""


def optimizer_of(rows: Sequence[dict]) -> str:
    """'fused' or 'foreach': the AdamW kernel a dry run's rows (`RankReport.row()`) built. Rows without
    `optimizer_implementation` come from before `--dry-run-optimizer`, when the dry run's CPU tensors made
    the job's code pick foreach."""
    names = {r.get("optimizer_implementation") or "torch.optim.AdamW (foreach)" for r in rows}
    kinds = {"foreach" if "foreach" in n else "fused" for n in names}
    if len(kinds) != 1:
        raise ValueError(f"the dry run's ranks built different optimizers: {sorted(names)}")
    return kinds.pop()


def dry_run_flags(job: Job, cluster: Cluster, c: Configuration, pipeline_rank: int) -> list[str]:
    """The plan's training flags plus what the dry run of one pipeline rank needs."""
    from megatron_pp.planning.report import launch_flags

    return launch_flags(job, c) + ["--mock-data", "--train-iters", "2", "--dry-run", str(cluster.num_gpus),
                                   "--dry-run-ranks", str(pipeline_rank * c.tp * c.dp),
                                   "--dry-run-optimizer", job.optimizer]


def compared_prediction(job: Job, cluster: Cluster, c: Configuration, optimizer: Optional[str] = None) -> Prediction:
    """`c` evaluated exactly (no extrapolation in m) with the AdamW kernel the dry run built (default: the
    job's own, which `dry_run_flags` asks the dry run to build)."""
    same = dataclasses.replace(job, optimizer_implementation=optimizer or job.optimizer,
                               weight_grad_fold=DRY_RUN_WEIGHT_GRAD_FOLD)
    return Evaluator(same, cluster).evaluate(c, exact=True)


def phase_of(peak_at: str) -> str:
    """'optimizer' or 'pipeline', from the dry run's `peak_at` ("step 2, optimizer", "step 2, B0.0")."""
    return "optimizer" if peak_at.endswith("optimizer") else "pipeline"


def compare_rank(predicted: Prediction, measured: dict) -> dict:
    """One pipeline rank: the dry run's row (`RankReport.row()`) beside the prediction, bytes and ratios."""
    r = measured["pipeline_rank"]
    state = measured["parameter_bytes"] + measured["gradient_bytes"] + measured["optimizer_bytes"]
    return {
        "pipeline_rank": r, "measured_peak_bytes": measured["peak_bytes"],
        "predicted_peak_bytes": predicted.memory_bytes[r],
        "predicted_over_measured": predicted.memory_bytes[r] / measured["peak_bytes"],
        "measured_state_bytes": state, "predicted_state_bytes": predicted.state_bytes[r],
        "measured_stash_peak_bytes": measured["stash_peak_bytes"], "predicted_stash_bytes": predicted.stash_bytes[r],
        "measured_transient_bytes": measured["transient_peak_bytes"],
        "measured_host_peak_bytes": measured.get("host_peak_bytes", 0),
        "measured_peak_at": measured["peak_at"], "measured_phase": phase_of(measured["peak_at"]),
        "predicted_phase": predicted.peak_phase(r),
        "predicted_optimizer_step_bytes": predicted.optimizer_step_bytes[r],
        "predicted_backward_bytes": predicted.backward_bytes[r] if predicted.backward_bytes else 0.0,
    }


def verify(job: Job, cluster: Cluster, plan_prediction: Prediction, device: str = "cpu") -> dict:
    """Dry-run the worst pipeline rank of a planned configuration; measured beside predicted. A configuration
    the training script refuses comes back with `refused` (the script's first error) and nothing measured."""
    import torch

    from megatron_pp.training import dry_run
    from megatron_pp.training.arguments import build_parser, validate_args

    c = plan_prediction.configuration
    predicted = compared_prediction(job, cluster, c)
    rank = predicted.worst_rank
    flags = dry_run_flags(job, cluster, c, rank)
    out = {"configuration": c.label(), "pipeline_rank": rank, "flags": flags,
           "plan_peak_bytes": plan_prediction.memory_bytes[rank],
           "plan_optimizer": job.optimizer, "compared_optimizer": job.optimizer}
    args = build_parser().parse_args(flags)
    errors = validate_args(args, world_size=cluster.num_gpus, this_machine=False)
    if errors:
        return {**out, "refused": errors[0]}
    began = time.process_time()
    report = dry_run.run_rank(args, rank * c.tp * c.dp, torch.device(device))
    row = report.row()
    if optimizer_of([row]) != job.optimizer:  # the flag reached the optimizer, or the comparison is void
        raise RuntimeError(f"the dry run built {row['optimizer_implementation']}, the plan runs {job.optimizer}")
    return {**out, **compare_rank(predicted, row), "cpu_seconds": time.process_time() - began}


def verify_lines(results: Sequence[dict]) -> list[str]:
    """The printed table: one row per verified plan (MiB)."""
    lines = ["verify (dry run of each plan's worst pipeline rank, building the plan's AdamW kernel):",
             f"{'#':>3} {'configuration':<48} {'rank':>4} {'measured':>9} {'predicted':>9} {'pred/meas':>9} "
             f"{'peak (measured / predicted)':<28} {'plan':>9}   (MiB)"]
    for i, r in enumerate(results, 1):
        if "refused" in r:
            lines.append(f"{i:>3} {r['configuration']:<48} refused: {r['refused']}")
            continue
        phases = f"{r['measured_phase']} / {r['predicted_phase']}"
        lines.append(f"{i:>3} {r['configuration']:<48} {r['pipeline_rank']:>4} {r['measured_peak_bytes'] / MIB:>9.1f} "
                     f"{r['predicted_peak_bytes'] / MIB:>9.1f} {r['predicted_over_measured']:>9.3f} {phases:<28} "
                     f"{r['plan_peak_bytes'] / MIB:>9.1f}")
    return lines


def verify_top(job: Job, cluster: Cluster, ranked: Sequence[Prediction], n: int,
               device: str = "cpu", on_result: Optional[callable] = None) -> list[dict]:
    """`verify` for the first `n` of `ranked` (each a distinct configuration), in order."""
    results = []
    for prediction in ranked[:n]:
        results.append(verify(job, cluster, prediction, device))
        if on_result is not None:
            on_result(results)
    return results


# A dry run already made: its command back to a planned configuration --------------------------------------


def planned_from_flags(argv: Sequence[str], world: int, hardware: str = "h100-sxm",
                       optimizer: str = DRY_RUN_OPTIMIZER) -> tuple[Job, Cluster, Configuration]:
    """The planner's job, cluster and configuration of a training command (`pretrain_*.py` flags) run on
    `world` ranks: the inverse of `dry_run_flags` for what the planner models. bf16 jobs are planned as
    cuda jobs (Megatron-style numerics), fp32 ones as this repository's CPU path; flash-style attention
    unless `--attention-backend reference`; `optimizer` is the AdamW kernel the dry run built. Raises
    ValueError for what the planner does not model."""
    from megatron_pp.planning.efficiency import HARDWARE_PROFILES
    from megatron_pp.training.arguments import model_config_from_args, parse_args
    from megatron_pp.training.job_schedule import job_schedule_options, num_chunks

    args = parse_args(list(argv))
    config = model_config_from_args(args)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world % (tp * pp):
        raise ValueError(f"world {world} is not divisible by tp {tp} x pp {pp}")
    if tp > 1 and not args.sequence_parallel:
        raise ValueError("the planner models tensor parallelism with --sequence-parallel only")
    if getattr(args, "pipeline_schedule_file", None):
        raise ValueError("--pipeline-schedule-file: compare a registered schedule")
    device = "cuda" if args.bf16 else "cpu"
    backend = "reference" if args.attention_backend == "reference" else ("flash" if device == "cuda" else "sdpa")
    job = Job(args.model_preset, config, args.global_batch_size, attention_backend=backend, device_type=device,
              optimizer_implementation=optimizer, weight_grad_fold=DRY_RUN_WEIGHT_GRAD_FOLD)
    recompute, options = _planned_recompute(args, job_schedule_options(args))
    c = Configuration(tp=tp, pp=pp, dp=world // (tp * pp), micro_batch_size=args.micro_batch_size,
                      recompute=recompute, schedule=args.pipeline_schedule, num_chunks=num_chunks(args, config),
                      options=tuple(sorted(options.items())),
                      distributed_optimizer=bool(args.use_distributed_optimizer),
                      overlap_param_gather=bool(getattr(args, "overlap_param_gather", False)))
    return job, Cluster(world, HARDWARE_PROFILES[hardware]), c


def _planned_recompute(args, options: dict) -> tuple[str, dict]:
    """The planner's recompute option and schedule options for the job's flags. The planner's `full` keeps
    each layer's input and reruns that one layer (`--recompute-method uniform --recompute-num-layers 1`); a
    schedule that checkpoints layer inputs by default (looped-bfs: `training.layered.schedule_recompute`) runs
    exactly that when no `--recompute-granularity` is given, and the planner names it `full`."""
    from megatron_pp.schedules.registry import get_schedule

    recompute = args.recompute_granularity
    if recompute == "full" and (args.recompute_method or "uniform", args.recompute_num_layers or 1) != ("uniform", 1):
        raise ValueError("the planner models full recomputation one layer at a time (--recompute-method uniform "
                         "--recompute-num-layers 1)")
    options = dict(options)
    if "checkpoint_layer_inputs" in get_schedule(args.pipeline_schedule).options:
        if recompute is None and options.get("checkpoint_layer_inputs", True):
            recompute = "full"
        options.pop("checkpoint_layer_inputs", None)
    return recompute or "none", options


def compare_dry_run(command: str, world: int, ranks: Sequence[dict]) -> dict:
    """A dry run's rows (`--dry-run-json` or `tools/dry_run_table.py` ranks) beside the planner's prediction
    of the same command, per pipeline rank."""
    argv = command.split()[2:]  # "python pretrain_*.py ..."
    job, cluster, c = planned_from_flags(argv, world, optimizer=optimizer_of(ranks))
    predicted = Evaluator(job, cluster).evaluate(c, exact=True)
    rows = sorted((compare_rank(predicted, r) for r in ranks), key=lambda r: r["pipeline_rank"])
    return {"command": command, "preset": job.preset, "configuration": c.label(), "optimizer": job.optimizer,
            "ranks": rows}
