"""Should I turn BPipe on for this job? Memory per stage, what fits, predicted step times and the speedup.

    python tools/estimate_bpipe.py --model-preset gpt3-13b --hidden-dropout 0.1 --attention-dropout 0.1 \\
        --tensor-model-parallel-size 1 --pipeline-model-parallel-size 8 --global-batch-size 128 \\
        --gpu-memory-gb 80 --attention-backend reference --recompute-options none,full

Layer times come from `--efficiency-file` (written by tools/bench_layer.py on the target GPU) or, without
one, from the roofline of `--hardware`. `--all-layouts GPUS` compares every tp x pp x dp layout of GPUS
GPUs instead of the one given. `--config launch/configs/bpipe_gpt3_96b.yaml --variant 1f1b` takes the model,
layout, global batch, attention backend, sequence parallelism and optimizer sharding from a paper's launch
config (the assumptions tools/reproduce.py uses) instead of the flags. Method and assumptions:
megatron_pp/planning/bpipe_estimator.py and docs/bpipe.md. Bad input prints one line and exits 2.
"""
import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Optional

import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_pp.cli import ExitingArgumentParser  # noqa: E402
from megatron_pp.models.presets import get_preset, preset_names  # noqa: E402
from megatron_pp.planning.bpipe_estimator import (DEFAULT_RESERVED_FRACTION, Candidate, Estimate, Job,  # noqa: E402
                                                  efficiency_model, estimate, layouts)
from megatron_pp.planning.efficiency import HARDWARE_PROFILES, load_hardware, mfu_curve  # noqa: E402
from megatron_pp.planning.memory import RECOMPUTE_OPTIONS, attention_kind  # noqa: E402
from megatron_pp.planning.papers.common import job_for, load_setting  # noqa: E402

GIB = 2 ** 30


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = ExitingArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-preset", help=f"one of {', '.join(preset_names())} (or --config)")
    p.add_argument("--config", help="a launch config YAML (launch/configs/*.yaml): model, layout, batch, attention, "
                                    "sequence parallelism and optimizer from it; replaces the model and layout flags")
    p.add_argument("--variant", help="with --config: which of its variants (default: the first)")
    for name in ("num-layers", "hidden-size", "num-attention-heads", "num-query-groups", "ffn-hidden-size",
                 "seq-length"):
        p.add_argument(f"--{name}", type=int, help="override the preset's value")
    p.add_argument("--hidden-dropout", type=float, help="override the preset's value (GPT-3 runs: 0.1)")
    p.add_argument("--attention-dropout", type=float, help="override the preset's value (GPT-3 runs: 0.1)")
    p.add_argument("--tensor-model-parallel-size", "--tp", dest="tp", type=int, help="default 1")
    p.add_argument("--pipeline-model-parallel-size", "--pp", dest="pp", type=int, help="default 1")
    p.add_argument("--data-parallel-size", "--dp", dest="dp", type=int, help="default 1")
    p.add_argument("--all-layouts", type=int, metavar="GPUS",
                   help="compare every tp x pp x dp layout of GPUS GPUs (tp <= 8) instead of --tp/--pp/--dp")
    p.add_argument("--global-batch-size", type=int, help="required without --config")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--use-distributed-optimizer", action="store_true", help="ZeRO-1 sharding of Adam over dp")
    p.add_argument("--attention-backend", choices=("flash", "sdpa", "reference"),
                   help="reference = the unfused path that stores the s x s scores; flash (default) and sdpa (on "
                        "GPU) do not")
    p.add_argument("--hardware", default="a100-80gb",
                   help=f"{', '.join(HARDWARE_PROFILES)} or a JSON file of HardwareProfile fields")
    p.add_argument("--gpu-memory-gb", type=float, help="device memory in GiB (default: the hardware's)")
    p.add_argument("--reserved-memory-fraction", type=float, default=DEFAULT_RESERVED_FRACTION,
                   help="share of memory kept for CUDA context, NCCL buffers and fragmentation")
    p.add_argument("--efficiency-file", help="tools/bench_layer.py JSON; default: roofline of --hardware")
    p.add_argument("--recompute-options", default=",".join(RECOMPUTE_OPTIONS),
                   help="comma-separated subset of none,selective,full to consider")
    p.add_argument("--max-micro-batch-size", type=int, default=16)
    p.add_argument("--pairs-on-node", action="store_true",
                   help="BPipe pairs (x, p-1-x) share a node: evict/load over NVLink instead of the network")
    p.add_argument("--json", help="also write every candidate to this JSON file")
    args = p.parse_args(argv)
    shape_flags = [f"--{name.replace('_', '-')}" for name in _SHAPE + ("tp", "pp", "dp", "global_batch_size",
                                                                          "attention_backend", "model_preset")
                   if getattr(args, name) is not None]
    if args.config:
        if shape_flags:
            p.error(f"--config sets the model, layout, batch and attention; drop {', '.join(shape_flags)}")
        if args.sequence_parallel:
            p.error("--config sets sequence parallelism; drop --sequence-parallel")
    else:
        if args.variant:
            p.error("--variant needs --config")
        for flag, value in (("--model-preset", args.model_preset), ("--global-batch-size", args.global_batch_size)):
            if value is None:
                p.error(f"the following arguments are required: {flag} (or --config)")
    return args


_SHAPE = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "seq_length",
          "hidden_dropout", "attention_dropout")


def build_config(args: argparse.Namespace):
    config = get_preset(args.model_preset)
    changes = {name: getattr(args, name) for name in _SHAPE if name != "seq_length" and getattr(args, name) is not None}
    if args.seq_length is not None:
        changes.update(seq_length=args.seq_length, max_position_embeddings=args.seq_length)
    return dataclasses.replace(config, **changes)


def build_jobs(args: argparse.Namespace) -> list[Job]:
    """The jobs to estimate: the one layout given (flags or --config) or, with --all-layouts, every layout.
    A config's own layout keeps the config's stage split (uneven first/last stages included)."""
    if args.config:
        variant = args.variant
        if variant is None:
            with open(args.config) as f:
                variant = next(iter(yaml.safe_load(f).get("variants") or {"": None}))
        # --use-distributed-optimizer adds ZeRO-1 to the config (it matters on re-tuned layouts with dp > 1).
        extra = {"use-distributed-optimizer": True} if args.use_distributed_optimizer else {}
        setting = load_setting(args.config, variant, **extra)
        config, own = setting.config, job_for(setting)
        if not args.all_layouts:
            return [own]
        sp, zero1 = setting.args.sequence_parallel, bool(setting.args.use_distributed_optimizer)
        gbs, attention = setting.args.global_batch_size, setting.attention
    else:
        config, own = build_config(args), None
        sp, zero1, gbs = args.sequence_parallel, args.use_distributed_optimizer, args.global_batch_size
        attention = attention_kind(args.attention_backend or "flash", "cuda", config.attention_dropout)
    if args.all_layouts:
        # Layouts whose data-parallel size does not divide the global batch cannot run it: left out.
        grid = [(tp, pp, dp) for tp, pp, dp in layouts(config, args.all_layouts) if gbs % dp == 0]
        if own is not None and (own.tp, own.pp, own.dp) not in grid and own.tp * own.pp * own.dp == args.all_layouts:
            grid.append((own.tp, own.pp, own.dp))
        if not grid:
            raise ValueError(f"no tp x pp x dp layout of {args.all_layouts} GPUs fits this model's heads and layers "
                             f"and divides the global batch {gbs}")
    else:
        grid = [(args.tp or 1, args.pp or 1, args.dp or 1)]
    jobs = []
    for tp, pp, dp in grid:
        if own is not None and (tp, pp, dp) == (own.tp, own.pp, own.dp):
            jobs.append(own)
            continue
        jobs.append(Job(config, tp, pp, dp, gbs, attention, sequence_parallel=sp and tp > 1,
                        distributed_optimizer=zero1 and dp > 1))
    return jobs


def gib(x: float) -> str:
    return f"{x / GIB:.1f}"


def candidate_row(plain: Candidate, bpipe: Candidate) -> str:
    return (f"{plain.micro_batch_size:>3} {plain.num_microbatches:>5}  {plain.recompute:<9} | "
            f"{gib(plain.peak_bytes):>6} ({plain.worst_stage:>2})  {'yes' if plain.fits else 'no':<3} | "
            f"{bpipe.resident_bound:>3}  {gib(bpipe.peak_bytes):>6} ({bpipe.worst_stage:>2})  "
            f"{'yes' if bpipe.fits else 'no':<3} | {plain.step_s:>8.2f} {100 * plain.mfu:>5.1f} "
            f"{100 * plain.bubble_fraction:>6.1f} | {bpipe.transfer_overhead_s:>8.2f}")


def explain(e: Estimate) -> list[str]:
    """The table and the answer, as lines of text."""
    job, cfg = e.job, e.job.config
    lines = [
        f"BPipe estimate: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads "
        f"({cfg.query_groups} kv groups), seq {cfg.seq_length}, dropout {cfg.hidden_dropout}/{cfg.attention_dropout}; "
        f"tp {job.tp} x pp {job.pp} x dp {job.dp}, global batch {job.global_batch_size}"
        + (", sequence parallel" if job.sequence_parallel else "")
        + (", distributed optimizer" if job.distributed_optimizer else ""),
        f"attention: {job.attention}; usable memory {gib(e.capacity_bytes)} GiB per GPU; layer times: {e.efficiency}",
    ]
    lines += [f"warning: {w}" for w in e.warnings]
    sizes = sorted({c.micro_batch_size for c in e.candidates})
    lines.append("")
    lines.append("  b     m  recompute | 1F1B peak GiB (stage) fits | BPipe K  peak GiB (stage) fits |"
                 "   step s  MFU%  idle% | transfer s")
    by_key: dict = {}
    for c in e.candidates:
        by_key.setdefault((c.micro_batch_size, c.recompute), {})[c.bpipe] = c
    for b in sizes:
        for recompute in RECOMPUTE_OPTIONS:
            pair = by_key.get((b, recompute))
            if pair:
                lines.append(candidate_row(pair[False], pair[True]))
    lines.append("(step s, MFU and idle% (mean idle share of the ranks: fill, drain, stage imbalance) are the same "
                 "with and without BPipe, which adds the transfer column)")
    lines.append("")
    plain, bpipe = e.best_plain, e.best_bpipe
    for name, best in (("best 1F1B :", plain), ("best BPipe:", bpipe)):
        text = f"{best.label()}  step {best.step_s:.2f} s, MFU {100 * best.mfu:.1f}%" if best else "nothing fits"
        lines.append(f"{name} {text}")
    S = e.speedup
    if S is None:
        lines.append("answer: nothing fits even with BPipe; shard more (tp, pp, distributed optimizer) or recompute")
    elif math.isinf(S):
        lines.append("answer: turn BPipe ON: only with BPipe does any configuration fit")
    else:
        compute = (plain.per_microbatch_s / plain.micro_batch_size) / (bpipe.per_microbatch_s / bpipe.micro_batch_size)
        fill_plain = plain.step_s / (plain.num_microbatches * plain.per_microbatch_s)
        fill_bpipe = (bpipe.step_s - bpipe.transfer_overhead_s) / (bpipe.num_microbatches * bpipe.per_microbatch_s)
        transfer = (bpipe.step_s - bpipe.transfer_overhead_s) / bpipe.step_s
        lines.append(f"predicted speedup S = {S:.3f} = per-sample compute {compute:.3f} x pipeline fill "
                     f"{fill_plain / fill_bpipe:.3f} x transfers {transfer:.3f}")
        verdict = "ON" if e.turn_on else "OFF"
        reason = "S > 1" if e.turn_on else "S <= 1: the memory BPipe frees buys nothing faster here"
        lines.append(f"answer: turn BPipe {verdict} for this job ({reason})")
    return lines


CANDIDATE_FIELDS = [f.name for f in dataclasses.fields(Candidate)]


def _short(value):
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.6g}")
    if isinstance(value, (list, tuple)):
        return [_short(v) for v in value]
    return value


def _row(candidate: dict) -> list:
    return [_short(candidate[name]) for name in CANDIDATE_FIELDS]


def to_json(e: Estimate) -> dict:
    return {
        "job": {"tp": e.job.tp, "pp": e.job.pp, "dp": e.job.dp, "global_batch_size": e.job.global_batch_size,
                "attention": e.job.attention, "sequence_parallel": e.job.sequence_parallel,
                "distributed_optimizer": e.job.distributed_optimizer,
                "config": {k: v for k, v in dataclasses.asdict(e.job.config).items() if k != "params_dtype"}},
        "hardware": dataclasses.asdict(e.hardware),
        "efficiency": e.efficiency,
        "capacity_bytes": e.capacity_bytes,
        # A table (one row per candidate, the fields named once), 6 significant digits: the 48-GPU reports
        # stay small enough to commit under docs/results/.
        "candidate_fields": CANDIDATE_FIELDS,
        "candidates": [_row(dataclasses.asdict(c)) for c in e.candidates],
        "best_plain": e.best_plain and dataclasses.asdict(e.best_plain),
        "best_bpipe": e.best_bpipe and dataclasses.asdict(e.best_bpipe),
        "speedup": None if e.speedup is None else (str(e.speedup) if math.isinf(e.speedup) else e.speedup),
        "turn_on": e.turn_on,
        "warnings": e.warnings,
    }


def dump_json(reports: list[dict]) -> str:
    """One estimate per block and one candidate per line (readable diffs at a tenth of indent=1's size)."""
    blocks = []
    for report in reports:
        head = {k: v for k, v in report.items() if k != "candidates"}
        rows = ",\n  ".join(json.dumps(row) for row in report["candidates"])
        blocks.append(json.dumps(head)[:-1] + ',\n "candidates": [\n  ' + rows + "]}")
    return "[\n" + ",\n".join(blocks) + "\n]\n"


def run(args: argparse.Namespace) -> list[Estimate]:
    hardware = load_hardware(args.hardware)
    options = tuple(x.strip() for x in args.recompute_options.split(",") if x.strip())
    out = []
    for job in build_jobs(args):
        model = efficiency_model(job, hardware, args.efficiency_file)
        out.append(estimate(job, hardware, model, gpu_memory_gib=args.gpu_memory_gb,
                            reserved_fraction=args.reserved_memory_fraction, recompute_options=options,
                            max_micro_batch_size=args.max_micro_batch_size, pairs_on_node=args.pairs_on_node))
    return out


def summary(estimates: list[Estimate]) -> list[str]:
    """One line per layout, then the best 1F1B against the best BPipe over all of them."""
    lines = [f"{'layout (tp,pp,dp)':<17} | {'best 1F1B':<34} {'step s':>6} | "
             f"{'best BPipe':<34} {'step s':>6} | {'S':>5}"]
    for e in estimates:
        p, b = e.best_plain, e.best_bpipe
        S = "-" if e.speedup is None else ("inf" if math.isinf(e.speedup) else f"{e.speedup:.3f}")
        layout = f"({e.job.tp},{e.job.pp},{e.job.dp})"
        lines.append(f"{layout:<17} | {p.label() if p else 'nothing fits':<34} "
                     f"{p.step_s if p else float('nan'):>6.2f} | {b.label() if b else 'nothing fits':<34} "
                     f"{b.step_s if b else float('nan'):>6.2f} | {S:>5}")
    plains = [e.best_plain for e in estimates if e.best_plain]
    bpipes = [e.best_bpipe for e in estimates if e.best_bpipe]
    if plains and bpipes:
        bp, bb = min(plains, key=lambda c: c.step_s), min(bpipes, key=lambda c: c.step_s)
        lines.append(f"over all layouts: best 1F1B {bp.step_s:.2f} s, best BPipe {bb.step_s:.2f} s, "
                     f"S = {bp.step_s / bb.step_s:.3f}; turn BPipe {'ON' if bb.step_s < bp.step_s else 'OFF'}")
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    try:
        estimates = run(args)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if len(estimates) == 1:
        e = estimates[0]
        lines = explain(e)
        sizes = sorted({c.micro_batch_size for c in e.candidates})
        model = efficiency_model(e.job, e.hardware, args.efficiency_file)
        curve = ", ".join(f"b={b} {100 * mfu:.1f}%" for b, mfu in mfu_curve(model, sizes, e.hardware.peak_tflops))
        lines.insert(2, f"layer MFU(b) without recompute: {curve}")
    else:
        lines = summary(estimates)
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            f.write(dump_json([to_json(e) for e in estimates]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
