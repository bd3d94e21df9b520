"""Step time of two source trees (before/after a change), alternated invocation by invocation (JSON out).

    git worktree add ../before <commit>
    python tools/bench_p2p_paired.py --before-tree ../before --pairs 5 --json docs/results/p2p_async_cpu.json

Each pair runs `benchmarks/bench_schedules.py` once from the other tree and once from this one (the order flips
every pair, so a drift in machine load favours neither), each invocation on the same model, data and
schedules, and takes each schedule's median step time over its rounds. The reported ratio is the median
over pairs of after / before: below 1 means this tree is faster. Any change can be compared this way
because nothing but the source tree differs between the two sides of a pair.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

from megatron_pp.cli import write_json  # noqa: E402


def one_run(tree: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        cmd = [sys.executable, os.path.join(tree, "benchmarks", "bench_schedules.py"), "--schedules", *args.schedules,
               "--pp", str(args.pp), "--microbatches", str(args.microbatches), "--chunks", str(args.chunks),
               "--rounds", str(args.rounds), "--num-layers", str(args.num_layers),
               "--hidden-size", str(args.hidden_size), "--seq-length", str(args.seq_length),
               "--vocab-size", str(args.vocab_size), "--json", out]
        env = dict(os.environ, PYTHONPATH=tree)
        subprocess.run(cmd, check=True, env=env, cwd=tree, stdout=subprocess.DEVNULL)
        with open(out) as f:
            report = json.load(f)
    return {name: entry["step_time_s_median"] for name, entry in report["schedules"].items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before-tree", required=True, help="a checkout of the revision to compare against")
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "interleaved-1f1b"])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per invocation (bench_schedules.py)")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=2)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    before = os.path.abspath(args.before_tree)
    if not os.path.isfile(os.path.join(before, "benchmarks", "bench_schedules.py")):
        parser.error(f"--before-tree {args.before_tree}: no benchmarks/bench_schedules.py there")
    pairs, load_start = [], os.getloadavg()[0]
    for k in range(args.pairs):
        order = [("before", before), ("after", HERE)]
        if k % 2:
            order.reverse()
        times = {side: one_run(tree, args) for side, tree in order}
        pairs.append(times)
        print(f"pair {k}: " + "  ".join(f"{name} {times['before'][name]:.3f} -> {times['after'][name]:.3f} s"
                                        for name in args.schedules), flush=True)
    ratios = {name: [p["after"][name] / p["before"][name] for p in pairs] for name in args.schedules}
    report = {"pairs": pairs, "ratio_after_over_before": ratios,
              "ratio_median": {name: statistics.median(r) for name, r in ratios.items()},
              "settings": {k: v for k, v in vars(args).items() if k not in ("json", "before_tree")},
              "load_average_start": load_start, "load_average_end": os.getloadavg()[0], "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
              "command": "python tools/bench_p2p_paired.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    for name, r in report["ratio_median"].items():
        print(f"{name}: after/before median {r:.3f} over {len(pairs)} pairs")
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
