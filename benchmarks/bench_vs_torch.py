"""Our schedules against torch.distributed.pipelining's on the same chunks, data and microbatches (JSON out).

    python benchmarks/bench_vs_torch.py --rounds 5 --json docs/results/vs_torch_cpu.json

Pairs (ours vs torch): 1f1b vs Schedule1F1B, interleaved-1f1b vs ScheduleInterleaved1F1B, zb-h1 and zb-h2
vs ScheduleInterleavedZeroBubble (one stage per rank), zb-v vs ScheduleZBVZeroBubble. Both sides run the
chunks our model builder makes for the pair's placement (megatron_pp/benchmarks/vs_torch.py says how they are
wrapped, and how activation bytes are counted the same way on both sides). Before timing, one step of each
side must give the same loss (relative 1e-5) and the same gradients on every rank (each gradient within
1e-5 relative); every timed step's loss is checked again. A round then runs, for every pair, one torch
step and one of ours, the side that goes first alternating from round to round, so both halves of a ratio
saw the same machine (our 1f1b and zb-h1 steps run back to back as well); step time is the slowest rank's
wall time from a common barrier. Reported per pair: the ratio ours / torch (median and range over rounds),
the same ratio of CPU-seconds summed over ranks, each side's median step time, median CPU-seconds per rank
and peak activation bytes per rank, and the issue's targets: ours <= 0.95 x torch in time, ours <= torch
in peak activation bytes per rank, zb-h1 <= 0.95 x our 1f1b. With --profile-steps N, each pair that misses
its time target is profiled (cProfile on the main thread's CPU clock, N steps per side, per rank).
"""
import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_pp.cli import write_json  # noqa: E402

TIME_TARGET = 0.95
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-5


def _spread(values) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "per_round": list(values)}


def _loss(rows: list) -> float:
    (loss,) = [r["loss"] for r in rows if r["loss"] is not None]  # the rank holding the last stage
    return loss


def _agree(a: float, b: float) -> bool:
    return abs(a - b) <= LOSS_RTOL * max(abs(a), abs(b))


def _round_order(names: list, k: int) -> list:
    """(pair, side) steps of round k. Within each pair the side that goes first alternates with k. Our 1f1b
    and our zb-h1 run back to back (their order alternating too), since their ratio is a target as well."""
    first = ("ours", "torch") if k % 2 == 0 else ("torch", "ours")
    rest = list(names)
    order = []
    if "1f1b" in rest and "zb-h1" in rest:
        rest.remove("1f1b")
        rest.remove("zb-h1")
        block = [("1f1b", "torch"), ("1f1b", "ours"), ("zb-h1", "ours"), ("zb-h1", "torch")]
        order += block if k % 2 == 0 else block[::-1]
    return order + [(name, side) for name in rest for side in first]


def run(args, pool=None) -> dict:
    import torch

    from megatron_pp.core.local_world import WorkerPool
    from megatron_pp.benchmarks import vs_torch
    from megatron_pp.benchmarks.harness import bench_config_from

    torch.set_num_threads(1)
    config = bench_config_from(args)
    shape = {name: (config, name, args.pp, args.microbatches, vs_torch.chunks_per_rank(name, args.chunks),
                    args.micro_batch_size, args.seed) for name in args.schedules}
    own_pool = pool is None
    pool = pool or WorkerPool(args.pp)
    checks, samples, profiles = {}, {name: [] for name in args.schedules}, {}
    try:
        for name in args.schedules:  # builds both sides, warms them up, and checks they do the same work
            rows = pool.run(vs_torch.worker_check, *shape[name])
            ours = _loss([{"loss": r["ours_loss"]} for r in rows])
            theirs = _loss([{"loss": r["torch_loss"]} for r in rows])
            worst = max(r["grad_rel_diff"] for r in rows)
            checks[name] = {"ours_loss": ours, "torch_loss": theirs, "grad_rel_diff_max": worst,
                            "peak_activation_bytes_per_rank": {side: [r[f"{side}_peak_activation_bytes"] for r in rows]
                                                               for side in ("ours", "torch")}}
            if not _agree(ours, theirs) or not worst <= GRAD_RTOL:
                raise AssertionError(f"{name}: ours and torch's {vs_torch.TORCH_PAIRS[name]} do different work "
                                     f"(loss {ours!r} vs {theirs!r}, worst gradient difference {worst:.3g})")
        for k in range(args.rounds):
            step = {}
            for name, side in _round_order(args.schedules, k):
                step[name, side] = pool.run(vs_torch.worker_step, *shape[name], side)
            for name in args.schedules:
                rows = {side: step[name, side] for side in ("ours", "torch")}
                losses = {side: _loss(r) for side, r in rows.items()}
                if not _agree(losses["ours"], losses["torch"]):
                    raise AssertionError(f"{name}, round {k}: losses differ ({losses})")
                wall = {side: max(x["wall_s"] for x in r) for side, r in rows.items()}
                print(f"round {k} {name}: ours/torch {wall['ours'] / wall['torch']:.3f}", file=sys.stderr, flush=True)
                samples[name].append({side: {"wall_s": wall[side], "cpu_s": [x["cpu_s"] for x in r]}
                                      for side, r in rows.items()})
        report = _report(args, config, checks, samples)
        if args.profile_steps:
            for name, pair in report["pairs"].items():
                if not pair["targets"]["time_met"]:
                    profiles[name] = {side: pool.run(vs_torch.worker_profile, *shape[name], side, args.profile_steps)
                                      for side in ("ours", "torch")}
            report["profiles"] = profiles
    finally:
        if own_pool:
            pool.close()
    return report


def _report(args, config, checks: dict, samples: dict) -> dict:
    from megatron_pp.benchmarks import vs_torch

    pairs = {}
    for name, rows in samples.items():
        sides = {}
        for side in ("ours", "torch"):
            sides[side] = {
                "step_time_s": _spread([r[side]["wall_s"] for r in rows]),
                "cpu_s_per_rank_median": [statistics.median(r[side]["cpu_s"][k] for r in rows) for k in range(args.pp)],
                "peak_activation_bytes_per_rank": checks[name]["peak_activation_bytes_per_rank"][side],
            }
        ratio = _spread([r["ours"]["wall_s"] / r["torch"]["wall_s"] for r in rows])
        # CPU-seconds summed over ranks, ours / torch per round: the work each runtime adds, less swayed
        # than wall time by what else the machine runs (waiting in a receive costs no CPU time).
        cpu_ratio = _spread([sum(r["ours"]["cpu_s"]) / sum(r["torch"]["cpu_s"]) for r in rows])
        memory_met = all(o <= t for o, t in zip(sides["ours"]["peak_activation_bytes_per_rank"],
                                                sides["torch"]["peak_activation_bytes_per_rank"]))
        pairs[name] = {
            "torch_schedule": vs_torch.TORCH_PAIRS[name],
            "chunks_per_rank": vs_torch.chunks_per_rank(name, args.chunks),
            "check": checks[name],
            "ratio_ours_over_torch": ratio,
            "cpu_ratio_ours_over_torch": cpu_ratio,
            "ours": sides["ours"], "torch": sides["torch"],
            "targets": {"time_met": ratio["median"] <= TIME_TARGET, "memory_met": memory_met},
        }
    report = {
        "device": "cpu", "pp": args.pp, "microbatches": args.microbatches, "rounds": args.rounds,
        "micro_batch_size": args.micro_batch_size,
        "model": {"preset": args.model_preset, "num_layers": config.num_layers, "hidden_size": config.hidden_size,
                  "num_attention_heads": config.num_attention_heads, "seq_length": config.seq_length,
                  "vocab_size": config.vocab_size},
        "activation_bytes_method": "ActivationStore saved-tensor hooks on both sides in one untimed step each "
                                   "(storage-deduplicated, parameters excluded; what each runtime keeps between "
                                   "I and W held in the count); timed torch steps run without the hooks",
        "time_target": TIME_TARGET,
        "pairs": pairs,
    }
    if "zb-h1" in samples and "1f1b" in samples:
        ratio = _spread([h["ours"]["wall_s"] / b["ours"]["wall_s"] for h, b in zip(samples["zb-h1"], samples["1f1b"])])
        report["zb_h1_over_our_1f1b"] = {**ratio, "met": ratio["median"] <= TIME_TARGET}
    import torch

    report["torch_version"] = torch.__version__
    report["cpu_count"] = os.cpu_count()
    report["date_utc"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    return report


def format_table(report: dict) -> str:
    kib = 1024
    head = (f"{'ours':<17} {'torch':<30} {'ours/torch (range)':>22} {'CPU ratio':>9} {'CPU s/rank ours | torch':>26} "
            f"{'peak act KiB/rank ours | torch':>32}")
    lines = [f"pp {report['pp']}, m {report['microbatches']}, {report['rounds']} rounds", head, "-" * len(head)]
    for name, p in report["pairs"].items():
        r = p["ratio_ours_over_torch"]
        cpu = " ".join(f"{c:.2f}" for c in p["ours"]["cpu_s_per_rank_median"]) + " | " + \
            " ".join(f"{c:.2f}" for c in p["torch"]["cpu_s_per_rank_median"])
        mem = " ".join(str(b // kib) for b in p["ours"]["peak_activation_bytes_per_rank"]) + " | " + \
            " ".join(str(b // kib) for b in p["torch"]["peak_activation_bytes_per_rank"])
        lines.append(f"{name:<17} {p['torch_schedule']:<30} {r['median']:>8.3f} ({r['min']:.3f}-{r['max']:.3f}) "
                     f"{p['cpu_ratio_ours_over_torch']['median']:>9.3f} "
                     f"{cpu:>26} {mem:>32}")
    if "zb_h1_over_our_1f1b" in report:
        z = report["zb_h1_over_our_1f1b"]
        lines.append(f"zb-h1 / our 1f1b: {z['median']:.3f} ({z['min']:.3f}-{z['max']:.3f})")
    return "\n".join(lines)


def parse_args(argv=None):
    from megatron_pp.benchmarks.harness import add_bench_arguments
    from megatron_pp.benchmarks.vs_torch import TORCH_PAIRS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=list(TORCH_PAIRS), help=", ".join(TORCH_PAIRS))
    add_bench_arguments(parser, vocab_size=1024)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="cProfile this many steps per side of each pair that misses its time target")
    parser.add_argument("--json", default=None, help="write the report here (default: stdout table only)")
    args = parser.parse_args(argv)
    unknown = [s for s in args.schedules if s not in TORCH_PAIRS]
    if unknown:
        parser.error(f"--schedules {' '.join(unknown)}: no torch counterpart; choose from {', '.join(TORCH_PAIRS)}")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds} must be >= 1")
    for name in args.schedules:
        stages = args.pp * (2 if name == "zb-v" else args.chunks if name == "interleaved-1f1b" else 1)
        if args.num_layers % stages:
            parser.error(f"--num-layers {args.num_layers} is not divisible by the {stages} stages of {name}")
    return args


def main(argv=None, pool=None) -> int:
    args = parse_args(argv)
    report = run(args, pool)
    report["command"] = "python benchmarks/bench_vs_torch.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(format_table(report))
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
