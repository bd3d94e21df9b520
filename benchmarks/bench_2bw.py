"""Benchmark PipeDream-2BW against 1F1B (PipeDream-Flush): training step time, paired round by round.

    python benchmarks/bench_2bw.py --pp 2 --microbatches 2 4 8 --rounds 5 --json runs/bench_2bw.json

Each round trains the same small GPT on mock data with `--pipeline-schedule 1f1b` and with `2bw` (the
order alternates from round to round) on a local gloo world of pp processes, one thread each, through
the real training loop (optimizer, clipping, metrics). A run's step time is the median over its steady
iterations (the first two and the last are left out: warm-up and 2BW's cool-down). Reported per m: the
median over rounds of each schedule's step time and of the per-round ratio 1F1B / 2BW, next to what the
simulator predicts for the same lists (F:B = 1:2: (m + p − 1) / m, the flush term 2BW removes), and the
CPU seconds per iteration summed over ranks (setup included), which show 2BW's own costs (the extra weight
and gradient copies) apart from waiting, and the seconds per step rank 0 spends blocked in receives (its
share of the bubble). Machines here are shared and noisy; only the paired ratios mean anything
(docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_pp.core.local_world import WorkerPool  # noqa: E402
from megatron_pp.schedules.registry import build_schedule  # noqa: E402
from megatron_pp.schedules.simulate import simulate  # noqa: E402
from megatron_pp.schedules.twobw import unrolled  # noqa: E402

SCHEDULES = ("1f1b", "2bw")


def _train(ctx, argv: list[str], pp: int) -> tuple[list[dict], float]:
    """Worker: one training run; returns (rank 0's metric rows, this rank's CPU seconds)."""
    from megatron_pp.training.arguments import parse_args
    from megatron_pp.training.train import pretrain

    cpu = time.process_time()
    rows = pretrain(parse_args(argv), state=ctx.parallel_state(1, pp))
    return rows, time.process_time() - cpu


def simulated_ratio(pp: int, m: int) -> float:
    """1F1B step / 2BW steady step under the simulator's default costs."""
    flush = simulate(build_schedule("1f1b", pp, m)).makespan
    spans = [simulate(unrolled(pp, m, steps)).makespan for steps in (3, 4)]
    return flush / (spans[1] - spans[0])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=12, help="training iterations per run")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)
    model = ["--model-preset", "gpt-tiny", "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
             "--num-attention-heads", str(args.num_attention_heads), "--ffn-hidden-size", str(4 * args.hidden_size),
             "--seq-length", str(args.seq_length), "--max-position-embeddings", str(args.seq_length),
             "--vocab-size", str(args.vocab_size), "--mock-data", "--micro-batch-size", str(args.micro_batch_size),
             "--train-iters", str(args.iterations), "--lr", "1e-4", "--log-interval", str(10 ** 6),
             "--pipeline-model-parallel-size", str(args.pp)]
    pool = WorkerPool(args.pp)
    report = {"command": "python benchmarks/bench_2bw.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "pp": args.pp, "cases": {}}
    try:
        for m in args.microbatches:
            times: dict[str, list[float]] = {name: [] for name in SCHEDULES}
            cpu: dict[str, list[float]] = {name: [] for name in SCHEDULES}
            wait: dict[str, list[float]] = {name: [] for name in SCHEDULES}
            ratios = []
            for r in range(args.rounds):
                step = {}
                for name in (SCHEDULES if r % 2 == 0 else SCHEDULES[::-1]):
                    argv_run = model + ["--global-batch-size", str(args.micro_batch_size * m),
                                        "--pipeline-schedule", name]
                    results = pool.run(_train, argv_run, args.pp)
                    steady = results[0][0][2:-1]
                    step[name] = statistics.median(r["step_time_s"] for r in steady)
                    wait[name].append(statistics.median(r["comm_wait_s"] for r in steady))
                    times[name].append(step[name])
                    cpu[name].append(sum(seconds for _, seconds in results) / args.iterations)
                ratios.append(step["1f1b"] / step["2bw"])
                print(f"m={m} round {r}: 1f1b {step['1f1b']:.4f} s, 2bw {step['2bw']:.4f} s, "
                      f"ratio {ratios[-1]:.3f}", flush=True)
            report["cases"][str(m)] = {
                "step_time_s_median": {name: statistics.median(v) for name, v in times.items()},
                "cpu_s_per_iteration_all_ranks_median": {name: statistics.median(v) for name, v in cpu.items()},
                "rank0_recv_wait_s_median": {name: statistics.median(v) for name, v in wait.items()},
                "ratio_1f1b_over_2bw_median": statistics.median(ratios),
                "ratio_min_max": [min(ratios), max(ratios)],
                "ratio_simulated": simulated_ratio(args.pp, m),
                "ratio_ideal": (m + args.pp - 1) / m,
            }
    finally:
        pool.close()
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json + ".tmp", "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        os.replace(args.json + ".tmp", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
