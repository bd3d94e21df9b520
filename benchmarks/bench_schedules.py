"""Benchmark pipeline schedules against a single-process baseline, paired round by round (JSON out).

    python benchmarks/bench_schedules.py --pp 2 --microbatches 8 --rounds 7 --json runs/bench_schedules.json

See megatron_pp/benchmarks/harness.py for the method and docs/benchmarks.md for recorded results.
"""
import argparse
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_pp.benchmarks.harness import add_bench_arguments, bench_config_from, run_benchmark  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe", "interleaved-1f1b"])
    add_bench_arguments(parser, vocab_size=2048)
    parser.add_argument("--json", default=None, help="write the report here (default: stdout only)")
    parser.add_argument("--plot", default=None, help="write a PNG: step time and peak memory per schedule")
    args = parser.parse_args(argv)
    if args.num_layers % (args.pp * args.chunks) != 0 and any(s.startswith("interleaved") for s in args.schedules):
        print(f"error: --num-layers {args.num_layers} is not divisible by --pp {args.pp} x --chunks {args.chunks}",
              file=sys.stderr)
        return 2
    config = bench_config_from(args)
    report = run_benchmark(args.schedules, pp=args.pp, microbatches=args.microbatches, chunks=args.chunks,
                           rounds=args.rounds, micro_batch=args.micro_batch_size, config=config)
    report["command"] = "python benchmarks/bench_schedules.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = json.dumps(report, indent=2)
    print(format_table(report))
    if args.json:
        with open(args.json + ".tmp", "w") as f:
            f.write(text + "\n")
        os.replace(args.json + ".tmp", args.json)
    if args.plot:
        plot(report, args.plot)
    return 0


def format_table(report: dict) -> str:
    mb = 2 ** 20
    head = (f"{'schedule':<18} {'step s':>8} {'x ideal':>8} {'x contended':>11} {'tokens/s':>9} {'TFLOP/s':>8} "
            f"{'MFU':>6} {'bubble sim':>10} {'bubble meas':>11}  peak stash MB per rank")
    lines = [f"device {report['device']}, pp {report['pp']}, m {report['microbatches']}, "
             f"baseline {report['baseline_step_s_median']:.3f} s, contention x{report['contention_slowdown_median']:.3f}",
             head, "-" * len(head)]
    for name, r in report["schedules"].items():
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        meas = f"{r['bubble_measured']:.3f}" if r["bubble_measured"] is not None else "n/a"
        lines.append(
            f"{name:<18} {r['step_time_s_median']:>8.3f} {r['ratio_to_ideal_median']:>8.3f} "
            f"{r['ratio_to_contended_ideal_median']:>11.3f} {r['tokens_per_s']:>9.0f} {r['tflops_per_device']:>8.3f} "
            f"{mfu:>6} {r['bubble_simulated']:>10.3f} {meas:>11}  {[round(b / mb, 2) for b in r['peak_stash_bytes_per_rank']]}"
        )
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["schedules"])
    rows = [report["schedules"][n] for n in names]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    ax_t.bar(names, [r["ratio_to_ideal_median"] for r in rows], label="x ideal")
    ax_t.bar(names, [r["ratio_to_contended_ideal_median"] for r in rows], width=0.4, label="x contended ideal")
    ax_t.axhline(1.0, color="black", linewidth=0.8)
    ax_t.set(title=f"step time vs ideal (pp={report['pp']}, m={report['microbatches']})", ylabel="ratio")
    ax_t.legend()
    width = 0.8 / max(report["pp"], 1)
    for k in range(report["pp"]):
        ax_m.bar([i + k * width for i in range(len(names))],
                 [r["peak_stash_bytes_per_rank"][k] / 2 ** 20 for r in rows], width=width, label=f"rank {k}")
    ax_m.set_xticks([i + width * (report["pp"] - 1) / 2 for i in range(len(names))], names)
    ax_m.set(title="peak activation stash per pipeline rank", ylabel="MiB")
    ax_m.legend()
    fig.tight_layout()
    fig.savefig(path + ".tmp.png", dpi=110)
    plt.close(fig)
    os.replace(path + ".tmp.png", path)


if __name__ == "__main__":
    sys.exit(main())
