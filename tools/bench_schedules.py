"""Benchmark pipeline schedules against a single-process baseline, paired round by round (JSON out).

    python tools/bench_schedules.py --pp 2 --microbatches 8 --rounds 7 --json runs/bench_schedules.json

See megatron_pp/training/benchmark.py for the method and docs/benchmarks.md for recorded results.
"""
import argparse
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_pp.training.benchmark import bench_config, run_benchmark  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe", "interleaved-1f1b"])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=2, help="virtual stages per rank for interleaved schedules")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--model-preset", default="gpt-tiny")
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--json", default=None, help="write the report here (default: stdout only)")
    args = parser.parse_args(argv)
    if args.num_layers % (args.pp * args.chunks) != 0 and any(s.startswith("interleaved") for s in args.schedules):
        print(f"error: --num-layers {args.num_layers} is not divisible by --pp {args.pp} x --chunks {args.chunks}",
              file=sys.stderr)
        return 2
    config = bench_config(args.num_layers, args.hidden_size, args.num_attention_heads, args.seq_length,
                          args.vocab_size, args.model_preset)
    report = run_benchmark(args.schedules, pp=args.pp, microbatches=args.microbatches, chunks=args.chunks,
                           rounds=args.rounds, micro_batch=args.micro_batch_size, config=config)
    report["command"] = "python tools/bench_schedules.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json + ".tmp", "w") as f:
            f.write(text + "\n")
        os.replace(args.json + ".tmp", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
