"""Rank every tp x pp x dp layout, microbatch size, recomputation and pipeline schedule of a training job.

    python tools/plan.py --model-preset gpt3-13b --global-batch-size 128 --num-gpus 64 \\
        --hardware a100-80gb --gpu-memory-gb 80 --intra-node-gbps 300 --inter-node-gbps 25

Prints the configurations that fit in GPU memory, fastest first (predicted step time, peak memory of the
worst pipeline rank, bubble, MFU), then the launch command of the best rows. Layer times come from
`--efficiency-file` (tools/bench_layer.py output, measured on the target GPU) or the roofline of
`--hardware`. Every registered `--pipeline-schedule` is planned, plugins included. Method, accuracy and
limits: megatron_pp/planning/planner.py (search), cost.py (memory and time) and docs/planner.md. Bad input prints one line and exits 2.
"""
import argparse
import dataclasses
import os
import sys
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_pp.cli import ExitingArgumentParser, write_json  # noqa: E402
from megatron_pp.models.presets import configured_preset, preset_names  # noqa: E402
from megatron_pp.planning.memory import DEFAULT_RESERVED_FRACTION  # noqa: E402
from megatron_pp.planning.efficiency import HARDWARE_PROFILES, load_hardware  # noqa: E402
from megatron_pp.planning.job import GIB, Cluster, Job, Plan, Prediction  # noqa: E402
from megatron_pp.planning.memory import RECOMPUTE_OPTIONS  # noqa: E402
from megatron_pp.planning.planner import DEFAULT_MAX_MICRO_BATCH, Planner, equivalence_key  # noqa: E402
from megatron_pp.planning.report import (TENSOR_PARALLEL_STATUS, TENSOR_PARALLEL_VALIDATED,  # noqa: E402
                                         launch_command, summary_row)
from megatron_pp.schedules.plugins import PluginError, add_plugin_flag, load_plugins  # noqa: E402
from megatron_pp.schedules.schedule_file import register_schedule_file  # noqa: E402
from megatron_pp.planning.verify import verify_lines, verify_top  # noqa: E402


SKIP_REASONS = 5


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        load_plugins(argv)  # a plugin's schedules are candidates like the built-in ones
    except PluginError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    p = ExitingArgumentParser(description=__doc__.splitlines()[0])
    add_plugin_flag(p)
    p.add_argument("--model-preset", required=True, help=f"one of {', '.join(preset_names())}")
    p.add_argument("--seq-length", type=int, help="override the preset's sequence length")
    p.add_argument("--hidden-dropout", type=float, help="override the preset's value")
    p.add_argument("--attention-dropout", type=float, help="override the preset's value")
    p.add_argument("--global-batch-size", type=int, required=True)
    p.add_argument("--num-gpus", type=int, required=True)
    p.add_argument("--hardware", default="a100-80gb",
                   help=f"{', '.join(HARDWARE_PROFILES)} or a JSON file of HardwareProfile fields")
    p.add_argument("--gpu-memory-gb", type=float, help="device memory in GiB (default: the hardware's)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs joined by NVLink (default: the hardware's)")
    p.add_argument("--intra-node-gbps", type=float, help="NVLink GB/s per GPU and direction (default: the hardware's)")
    p.add_argument("--inter-node-gbps", type=float,
                   help="network GB/s per GPU and direction (default: the hardware's)")
    p.add_argument("--host-link-gbps", type=float, help="PCIe GB/s per GPU and direction, for offload "
                   "(default: PCIe 4.0 x16 for A100, 5.0 x16 for H100/H200)")
    p.add_argument("--efficiency-file", help="tools/bench_layer.py JSON measured on the target GPU; default: the "
                   "roofline of --hardware at its achieved matmul efficiency (printed with its source)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu plans this repository's fp32 CPU path on gloo (no --bf16 in the commands), with a "
                        "--hardware JSON describing the machine")
    p.add_argument("--attention-backend", choices=("flash", "sdpa", "reference"),
                   help="reference = the unfused path that stores the s x s scores (default: flash on cuda, sdpa "
                        "on cpu, where flash-attn does not run)")
    p.add_argument("--schedules", help="comma-separated schedule names (default: every registered one)")
    p.add_argument("--pipeline-schedule-file", metavar="FILE",
                   help="plan the action lists in FILE (torch's compute-only CSV or our JSON, docs/plugins.md): only "
                        "layouts with its pipeline size, microbatches and chunks; its commands name the file")
    p.add_argument("--recompute-options", default=",".join(RECOMPUTE_OPTIONS),
                   help="comma-separated subset of none,selective,full")
    p.add_argument("--max-micro-batch-size", type=int, default=DEFAULT_MAX_MICRO_BATCH)
    p.add_argument("--max-virtual-stages", type=int, help="most chunks per rank to try (default: layers per rank)")
    p.add_argument("--no-distributed-optimizer", action="store_true",
                   help="plan plain data parallelism only (default: ZeRO-1 whenever dp > 1)")
    p.add_argument("--reserved-memory-fraction", type=float, default=DEFAULT_RESERVED_FRACTION,
                   help="share of memory kept for the CUDA context, NCCL buffers and fragmentation")
    p.add_argument("--top", type=int, default=15, help="rows of the table")
    p.add_argument("--commands", type=int, default=3, help="print the launch command of this many best rows")
    p.add_argument("--json", help="also write every fitting configuration to this JSON file")
    p.add_argument("--verify", type=int, default=0, metavar="N",
                   help="dry-run the worst pipeline rank of the N best distinct plans (the real job on fake tensors, "
                        "this process) and print measured beside predicted peak (docs/planner.md)")
    args = p.parse_args(argv)
    if args.attention_backend is None:
        args.attention_backend = "flash" if args.device == "cuda" else "sdpa"
    if args.top < 1 or args.commands < 0:
        p.error("--top must be >= 1 and --commands >= 0")
    if args.verify < 0:
        p.error("--verify must be >= 0")
    return args


def build(args: argparse.Namespace) -> Planner:
    config = configured_preset(args.model_preset, args.seq_length, args.hidden_dropout, args.attention_dropout)
    hardware = load_hardware(args.hardware)
    overrides = {"memory_gib": args.gpu_memory_gb, "gpus_per_node": args.gpus_per_node,
                 "tp_link_gbps": args.intra_node_gbps, "pair_link_gbps": args.inter_node_gbps}
    hardware = dataclasses.replace(hardware, **{k: v for k, v in overrides.items() if v is not None})
    files: tuple[tuple[str, str], ...] = ()
    schedules = None if args.schedules is None else [x.strip() for x in args.schedules.split(",") if x.strip()]
    if args.pipeline_schedule_file:
        if schedules is not None:
            raise ValueError("give --schedules or --pipeline-schedule-file, not both")
        name = register_schedule_file(args.pipeline_schedule_file)
        files, schedules = ((name, args.pipeline_schedule_file),), [name]
    job = Job(args.model_preset, config, args.global_batch_size, attention_backend=args.attention_backend,
              device_type=args.device, plugins=tuple(args.schedule_plugin), schedule_files=files)
    cluster = Cluster(args.num_gpus, hardware, host_link_gbps=args.host_link_gbps,
                      reserved_fraction=args.reserved_memory_fraction)
    recompute = tuple(x.strip() for x in args.recompute_options.split(",") if x.strip())
    return Planner(job, cluster, efficiency_file=args.efficiency_file, schedules=schedules,
                   recompute_options=recompute, max_micro_batch_size=args.max_micro_batch_size,
                   max_virtual_stages=args.max_virtual_stages,
                   distributed_optimizer=(False,) if args.no_distributed_optimizer else (True,))


def header(plan: Plan, seconds: float) -> list[str]:
    cfg, hw = plan.job.config, plan.cluster.hardware
    lines = [
        f"plan: {plan.job.preset} ({cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} "
        f"heads, {cfg.query_groups} kv groups), seq {cfg.seq_length}, global batch {plan.job.global_batch_size}, "
        f"{plan.job.attention} attention",
        f"cluster: {plan.cluster.num_gpus} x {hw.name}, {hw.memory_gib:g} GiB ({plan.cluster.capacity_bytes / GIB:.1f} "
        f"usable), {hw.gpus_per_node} per node, NVLink {hw.tp_link_gbps:g} GB/s, network {hw.pair_link_gbps:g} GB/s, "
        f"host link {plan.cluster.host_bytes_per_s / 1e9:g} GB/s",
        f"layer times: {plan.efficiency}",
    ]
    if plan.efficiency.startswith("roofline"):
        source = hw.sources.get("matmul_efficiency", "no source given in the hardware profile")
        lines.append(f"  matmul efficiency {hw.matmul_efficiency:g} assumed: {source}; --efficiency-file replaces "
                     "the roofline with layer times measured on the target GPU (tools/bench_layer.py)")
    lines += [f"warning: {w}" for w in plan.warnings]
    lines.append(f"{plan.considered} configurations in {seconds:.1f} s: {plan.over_memory} over memory, "
                 f"{sum(plan.skipped.values())} refused (by their schedule or the training script's check), {plan.dominated} dominated (one with "
                 f"less recompute/offload fits), {plan.evaluated} built, {len(plan.ranked)} timed and ranked, "
                 f"{plan.untimed} left out (their step-time lower bound cannot rank)")
    for reason, count in sorted(plan.skipped.items(), key=lambda kv: -kv[1])[:SKIP_REASONS]:
        lines.append(f"  refused {count} x {reason}")  # whole: the script's reason names the flag to change
    return lines


def distinct(ranked: list[Prediction]) -> list[tuple[Prediction, int]]:
    """One row per `equivalence_key` class (its best-ranked member) with the number of members folded in."""
    rows: dict[tuple, list] = {}
    for p in ranked:
        key = equivalence_key(p)
        if key in rows:
            rows[key][1] += 1
        else:
            rows[key] = [p, 0]
    return [(p, n) for p, n in rows.values()]


def option_text(p: Prediction) -> str:
    return ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in p.configuration.options) or "-"


def table(rows: list[tuple[Prediction, int]]) -> list[str]:
    width = max([len("options")] + [len(option_text(p)) for p, _ in rows])
    lines = [f"{'#':>3} {'schedule':<17} {'v':>2} {'options':<{width}} {'tp':>3} {'pp':>3} {'dp':>3} {'b':>2} "
             f"{'m':>4} {'recompute':<9} {'W':>1} {'mem GiB (rank)':>14} {'step s':>8} {'bubble%':>7} {'MFU%':>5} "
             f"{'tokens/s':>9} {'alt':>3}"]
    for i, (p, equivalents) in enumerate(rows, 1):
        c = p.configuration
        tp = f"{c.tp}*" if c.tp > 1 and not TENSOR_PARALLEL_VALIDATED else str(c.tp)
        lines.append(f"{i:>3} {c.schedule:<17} {c.num_chunks:>2} {option_text(p):<{width}} {tp:>3} {c.pp:>3} "
                     f"{c.dp:>3} {c.micro_batch_size:>2} {p.num_microbatches:>4} {c.recompute:<9} "
                     f"{p.weight_versions:>1} {p.peak_memory_bytes / GIB:>8.1f} ({p.worst_rank:>2}) {p.step_s:>8.3f} "
                     f"{100 * p.bubble_fraction:>7.1f} {100 * p.mfu:>5.1f} {p.tokens_per_s:>9.0f} {equivalents:>3}")
    lines.append("W = weight versions per stage; alt = equivalent variants not shown (same layout and step time); "
                 "zero1 (--use-distributed-optimizer) whenever dp > 1 unless --no-distributed-optimizer, and "
                 "plain data parallelism where pretrain_gpt.py refuses zero1 (schedules with weight versions, "
                 "W = 2: 2BW); sequence parallelism whenever tp > 1")
    if any(p.configuration.tp > 1 for p, _ in rows) and not TENSOR_PARALLEL_VALIDATED:
        lines.append(f"tp* = step time unvalidated: {TENSOR_PARALLEL_STATUS}")
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    try:
        planner = build(args)
        plan = planner.plan(top=args.top, fold=True)
        rows = distinct(plan.ranked)  # each passed the training script's own check inside the planner
        commands = [launch_command(plan.job, plan.cluster, p.configuration) for p, _ in rows[:args.commands]]
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    lines = header(plan, time.perf_counter() - started)
    if not plan.ranked:
        lines.append("nothing fits: more GPUs, more memory, a shorter sequence or a smaller global batch")
        print("\n".join(lines))
        return 0
    lines += [""] + table(rows)
    if commands:
        lines += ["", "launch (add data and length flags, e.g. --data-path ... --train-iters ...):"]
        lines += [f"#{i} {command}" for i, command in enumerate(commands, 1)]
    print("\n".join(lines))
    verified = []
    if args.verify:
        print()
        verified = verify_top(plan.job, plan.cluster, [p for p, _ in rows], args.verify)
        lines += [""] + verify_lines(verified)
        print("\n".join(verify_lines(verified)))
    if args.json:
        ranked = [{**summary_row(p), "command": launch_command(plan.job, plan.cluster, p.configuration)}
                  for p in plan.ranked]
        write_json(args.json, {"command": "python tools/plan.py " + " ".join(sys.argv[1:] if argv is None else argv),
                               "efficiency": plan.efficiency, "warnings": plan.warnings, "ranked": ranked,
                               **({"verify": verified} if args.verify else {}),
                               "printed": lines})  # what the run printed, which docs/planner.md shows
    return 0


if __name__ == "__main__":
    sys.exit(main())
