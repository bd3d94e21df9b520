"""Check the planner against real CPU training runs: predicted vs measured step time and peak stash bytes.

    python tools/validate_planner.py --iterations 8 --profile-out docs/results/planner_validation_profile.json \
        --json docs/results/planner_validation.json

For each configuration below, the planner predicts (megatron_pp/planning/cost.py, CPU fp32 numerics)
and the training code runs it on a local gloo world (`core.local_world.WorkerPool`, one process per
rank, one thread each), launched with the planner's own flags (`pretrain` with `--mock-data`). Measured:
the median `step_time_s` of the iterations after the first two (the first builds buffers; 2BW's first is
its warm-up), and each pipeline rank's peak stash bytes as the executor's activation store counts them.

The planner's inputs are measured on this machine first, with every worker measuring at once so that
the contention of the real run (processes sharing cores and memory bandwidth) is in them: the layer
profile (`tools/bench_layer.py`'s measurement, written as its JSON report and read back through
`efficiency.MeasuredCurve`), the matrix-product rate of the output layer's shape, a memory copy rate,
and a gloo point-to-point transfer between two ranks. They are taken again after the runs, and the
planner uses the mean of the two; the drift between them is reported, since on a shared machine it is
what limits step-time accuracy. Results go in docs/planner.md.
"""
import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Optional

os.environ.setdefault("OMP_NUM_THREADS", "1")
TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(TOOLS))

from megatron_pp.cli import write_json  # noqa: E402
from megatron_pp.core.local_world import WorkerPool  # noqa: E402
from megatron_pp.models.presets import get_preset  # noqa: E402
from megatron_pp.planning.efficiency import HardwareProfile  # noqa: E402
from megatron_pp.planning.job import Cluster, Configuration, Job  # noqa: E402
from megatron_pp.planning.planner import Planner  # noqa: E402
from megatron_pp.planning.report import launch_flags  # noqa: E402

PRESET = "gpt-tiny"
# Large enough that compute, not per-action overhead, dominates a CPU step (as in benchmarks/bench_schedules.py).
SHAPE = dict(num_layers=8, hidden_size=256, num_attention_heads=8, seq_length=128, max_position_embeddings=128,
             vocab_size=2048)
BACKEND = "sdpa"  # PyTorch's CPU flash kernel: the model's default attention on CPU
GLOBAL_BATCH = 16
PROFILE_SIZES = (1, 2, 4)
TIMED = [  # two processes: what two cores can run without oversubscription
    Configuration(1, 2, 1, 2, "none", "1f1b"),
    Configuration(1, 2, 1, 2, "none", "gpipe"),
    Configuration(1, 2, 1, 2, "none", "interleaved-1f1b", 2),
    Configuration(1, 2, 1, 1, "none", "1f1b"),
    Configuration(1, 2, 1, 2, "full", "1f1b"),
    Configuration(1, 2, 1, 2, "none", "2bw"),
    Configuration(1, 2, 1, 2, "none", "looped-bfs", 2),
    Configuration(1, 2, 1, 2, "none", "po-h", 2),
    Configuration(1, 1, 2, 2, "none", "1f1b", 1, (), True),
    Configuration(2, 1, 1, 2, "selective", "1f1b"),
]
MEMORY_ONLY = [  # four processes on two cores: the memory is exact, the timing would be contention
    Configuration(1, 4, 1, 1, "none", "1f1b"),
    Configuration(1, 4, 1, 1, "none", "bpipe"),
    Configuration(1, 4, 1, 1, "none", "1f1b", 1, (("offload_chunks", 1),)),
    Configuration(1, 4, 1, 1, "selective", "gis-h", 2),
]


# Workers ---------------------------------------------------------------------------------------------------


def _profile(ctx, config_dict: dict, repeats: int) -> dict:
    """Every rank at once: the layer report, the logits GEMM rate, a copy rate and a p2p rate."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, TOOLS)
    import bench_layer

    argv = ["--model-preset", PRESET, "--seq-length", str(config_dict["seq_length"]), "--micro-batch-sizes",
            *map(str, PROFILE_SIZES), "--backends", BACKEND, "--repeats", str(repeats), "--device", "cpu",
            "--out", os.devnull]
    args = bench_layer.parse_args(argv)
    # bench_layer builds the preset's layer; give it this job's shape.
    original = bench_layer.configured_preset
    bench_layer.configured_preset = lambda name, *overrides: dataclasses.replace(original(name, *overrides), **SHAPE)
    try:
        dist.barrier()
        report = bench_layer.run(args, "python tools/bench_layer.py " + " ".join(argv) + " (job shape)")
    finally:
        bench_layer.configured_preset = original

    def median_s(fn, n: int = 5) -> float:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    h, vocab, tokens = SHAPE["hidden_size"], SHAPE["vocab_size"], SHAPE["seq_length"] * 2
    a, w = torch.randn(tokens, h), torch.randn(h, vocab)
    dist.barrier()
    gemm_tflops = 2 * tokens * h * vocab / median_s(lambda: a @ w) / 1e12
    src = torch.randn(16 * 2 ** 20 // 4)
    dst = torch.empty_like(src)
    dist.barrier()
    copy_gbps = 2 * src.numel() * 4 / median_s(lambda: dst.copy_(src)) / 1e9  # bytes read + written
    message = torch.randn(SHAPE["seq_length"], 2, h)
    dist.barrier()
    if ctx.world_size >= 2 and ctx.rank < 2:
        def ping_pong():
            if ctx.rank == 0:
                dist.send(message, 1)
                dist.recv(message, 1)
            else:
                dist.recv(message, 0)
                dist.send(message, 0)
        p2p_gbps = 2 * message.numel() * 4 / median_s(ping_pong, 9) / 1e9
    else:
        p2p_gbps = None
    tiny = torch.zeros(1)
    dist.barrier()
    collective_latency_s = median_s(lambda: dist.all_reduce(tiny), 21)  # a one-element all-reduce: its fixed cost
    return {"report": report, "gemm_tflops": gemm_tflops, "copy_gbps": copy_gbps, "p2p_gbps": p2p_gbps,
            "collective_latency_s": collective_latency_s}


def _train(ctx, flags: list, tp: int, pp: int, iterations: int):
    """Run the planner's flags through the training code; rank 0's metric rows."""
    from megatron_pp.training.arguments import parse_args
    from megatron_pp.training.train import pretrain

    args = parse_args(flags + ["--mock-data", "--train-iters", str(iterations), "--log-interval", "1000"])
    return pretrain(args, ctx.parallel_state(tp, pp))


# Driver ----------------------------------------------------------------------------------------------------


def average_profile(samples: list[dict]) -> tuple[dict, dict]:
    """One bench_layer report (mean of the ranks' and rounds' medians) and the mean link/copy rates."""
    report = json.loads(json.dumps(samples[0]["report"]))
    for row in report["results"]:
        same = [r for s in samples for r in s["report"]["results"]
                if (r["backend"], r["micro_batch_size"]) == (row["backend"], row["micro_batch_size"])]
        for key in ("forward_ms", "backward_ms", "core_forward_ms"):
            row[key] = statistics.mean(r[key] for r in same)
    rates = {key: statistics.mean(s[key] for s in samples if s[key] is not None)
             for key in ("gemm_tflops", "copy_gbps", "p2p_gbps", "collective_latency_s")}
    return report, rates


def write_profile(path: str, report: dict) -> None:
    write_json(path, report)


def cpu_hardware(rates: dict) -> HardwareProfile:
    """This machine as the planner's `HardwareProfile`, every number measured by `_profile`."""
    return HardwareProfile(
        name="this CPU (measured)", peak_tflops=rates["gemm_tflops"], memory_gib=64.0, hbm_gbps=rates["copy_gbps"],
        tp_link_gbps=rates["p2p_gbps"], pair_link_gbps=rates["p2p_gbps"], gpus_per_node=64, matmul_efficiency=1.0,
        collective_latency_s=rates["collective_latency_s"],
        sources={"peak_tflops": "measured: the output layer's GEMM, every worker at once",
                 "hbm_gbps": "measured: 16 MiB tensor copy (bytes read + written), every worker at once",
                 "tp_link_gbps": "measured: gloo send/recv ping-pong of one activation between two workers",
                 "collective_latency_s": "measured: median one-element gloo all-reduce over both workers",
                 "memory_gib": "not a constraint here (the runs are tiny)"})


def run(args: argparse.Namespace) -> dict:
    job = Job(PRESET, dataclasses.replace(get_preset(PRESET), **SHAPE), GLOBAL_BATCH, attention_backend=BACKEND,
              device_type="cpu")
    pools = {2: WorkerPool(2)}
    try:
        before = pools[2].run(_profile, SHAPE, args.profile_repeats)
        write_profile(args.profile_out, average_profile(before)[0])
        planned, measured = {}, {}
        for c in TIMED + MEMORY_ONLY:
            world = c.tp * c.pp * c.dp
            if world not in pools:
                pools[world] = WorkerPool(world)
            # The planner fills in what it derives (offload's copy placement); the run uses exactly that.
            planner = Planner(job, Cluster(world, cpu_hardware(average_profile(before)[1])),
                              efficiency_file=args.profile_out)
            planned[c] = planner.evaluate(c).configuration
            flags = launch_flags(job, planned[c])
            measured[c] = (flags, pools[world].run(_train, flags, c.tp, c.pp, args.iterations if c in TIMED else 3)[0])
            print(f"ran {c.label()}", file=sys.stderr)
        after = pools[2].run(_profile, SHAPE, args.profile_repeats)
    finally:
        for pool in pools.values():
            pool.close()

    profile, rates = average_profile(before + after)
    drift = {key: average_profile(after)[1][key] / average_profile(before)[1][key] - 1 for key in rates}
    write_profile(args.profile_out, profile)
    rows = []
    for c, (flags, metrics) in measured.items():
        planner = Planner(job, Cluster(c.tp * c.pp * c.dp, cpu_hardware(rates)), efficiency_file=args.profile_out)
        prediction = planner.evaluate(planned[c])
        stash = [max(r["peak_stash_bytes"][k] for r in metrics) for k in range(c.pp)]
        steps = [r["step_time_s"] for r in metrics[2:]]
        rows.append({
            "configuration": planned[c].label(), "flags": flags, "timed": c in TIMED,
            "predicted_step_s": prediction.step_s, "predicted_pipeline_s": prediction.pipeline_s,
            "measured_step_s": statistics.median(steps) if c in TIMED else None,
            "measured_step_s_range": [min(steps), max(steps)] if c in TIMED else None,
            "predicted_stash_bytes": list(prediction.stash_bytes), "measured_stash_bytes": stash,
        })
    return {"command": "python tools/validate_planner.py " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rates": rates, "profile_drift": drift,
            "layer_profile": {f"b={r['micro_batch_size']}": [r["forward_ms"], r["backward_ms"]]
                              for r in profile["results"]},
            "rows": rows}


def table(result: dict) -> list[str]:
    lines = [f"{'configuration':<58} {'pred s':>7} {'meas s':>7} {'err':>7}  {'stash err per rank (pred/meas - 1)'}"]
    for row in result["rows"]:
        err = "" if row["measured_step_s"] is None else f"{row['predicted_step_s'] / row['measured_step_s'] - 1:+.1%}"
        meas = "" if row["measured_step_s"] is None else f"{row['measured_step_s']:.3f}"
        stash = " ".join(f"{p / m - 1:+.2%}" for p, m in zip(row["predicted_stash_bytes"], row["measured_stash_bytes"]))
        lines.append(f"{row['configuration']:<58} {row['predicted_step_s']:>7.3f} {meas:>7} {err:>7}  {stash}")
    drift = ", ".join(f"{k} {v:+.1%}" for k, v in result["profile_drift"].items())
    lines.append(f"profile drift between the measurements before and after the runs: {drift}")
    return lines


def against_dry_runs(paths: list[str], out: Optional[str], argv: Optional[list[str]]) -> int:
    """Per pipeline rank, the planner's peak (with the AdamW kernel the dry run built) beside the dry run's.
    Ranks of the same command are merged, apart by the optimizer their rows name."""
    from megatron_pp.planning.verify import compare_dry_run

    by_command: dict[tuple[str, str], list[dict]] = {}
    try:
        for path in paths:
            with open(path) as f:
                for result in json.load(f)["results"]:
                    words = result["command"].split()  # the same job whichever ranks a run held
                    if "--dry-run-ranks" in words:
                        del words[words.index("--dry-run-ranks"):words.index("--dry-run-ranks") + 2]
                    for row in result["ranks"]:
                        key = (" ".join(words), row.get("optimizer_implementation", ""))
                        by_command.setdefault(key, []).append(row)
        compared = [compare_dry_run(command, int(command.split("--dry-run ")[1].split()[0]), ranks)
                    for (command, _), ranks in by_command.items()]
    except (OSError, KeyError, IndexError, ValueError) as err:
        print(f"error: --dry-run-json: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    for result in compared:
        print(f"{result['configuration']} ({result['optimizer']} AdamW)")
        for r in result["ranks"]:
            print(f"  pp rank {r['pipeline_rank']}: dry run {r['measured_peak_bytes'] / 2**30:.2f} GiB "
                  f"({r['measured_phase']}), planner {r['predicted_peak_bytes'] / 2**30:.2f} GiB "
                  f"({r['predicted_phase']}), planner / dry run {r['predicted_over_measured']:.4f}")
    if out:
        write_json(out, {"command": "python tools/validate_planner.py " + " ".join(sys.argv[1:] if argv is None else argv),
                         "sources": paths, "results": compared})
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=8, help="training iterations per timed configuration")
    parser.add_argument("--profile-repeats", type=int, default=5, help="bench_layer rounds per profile")
    parser.add_argument("--profile-out", default="docs/results/planner_validation_profile.json")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--dry-run-json", nargs="+", metavar="FILE",
                        help="instead of running: the planner beside committed dry runs (tools/dry_run_table.py "
                             "JSON; the ranks of every file with the same command are merged)")
    args = parser.parse_args(argv)
    if args.dry_run_json:
        return against_dry_runs(args.dry_run_json, args.json, argv)
    if args.iterations < 4 or args.profile_repeats < 1:
        print("error: --iterations must be >= 4 and --profile-repeats >= 1", file=sys.stderr)
        return 2
    result = run(args)
    print("\n".join(table(result)))
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
