"""Measure layered gradient accumulation and the modular pipeline: dp traffic, exposed reduction, bubble.

    python benchmarks/bench_layered.py traffic --microbatches 2 4 8 16
    python benchmarks/bench_layered.py exposed --steps 6
    python benchmarks/bench_layered.py bubble --steps 5

`traffic` counts the collectives on the data-parallel group (`core.comm_counter.CommCounter`) over one
training step (the reducer's run and the optimizer step; not the two scalar all-reduces of token count
and loss) on pp x dp 2 with one layer per chunk (v = layers / pp), for sharded weights in layered order
(looped-bfs with one group, and with groups of 2) against depth-first ZeRO-3 (interleaved 1F1B, same
placement and chunks), and ZeRO-1 for reference; rank 0's counts. `exposed` times, with plain data parallelism, how long each rank
waits after its last compute action for its gradient reductions (`finish()`), from the executor's
trace: layered looped-bfs against overlapped DDP in depth-first order (1F1B and interleaved 1F1B).
`exposed --link-gbps X` emulates a slower data-parallel link (`EmulatedLink`): each all-reduce on the dp
group completes no earlier than a FIFO link of X GB/s per rank would finish it, which puts the loopback
machine in the regime the method targets (a chunk's reduction slower than its backward).
`bubble` gives the simulated bubble of looped-bfs as v grows and the bubble measured on CPU (1 - compute
time / step time per rank, receive waits taken out, median over steps) on pp 2. Results and their
commands are in docs/layered.md.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_pp.cli import write_json  # noqa: E402
from megatron_pp.core.comm_counter import CommCounter  # noqa: E402
from megatron_pp.core.local_world import WorkerPool  # noqa: E402
from megatron_pp.data.mock import MockData  # noqa: E402
from megatron_pp.schedules.registry import build_schedule  # noqa: E402
from megatron_pp.schedules.simulate import simulate  # noqa: E402
from megatron_pp.benchmarks.harness import COMPUTE_PREFIXES, bench_config  # noqa: E402

SEED = 1234
MICRO_BATCH = 2

# name -> (schedule, options, sharding strategy, overlap hooks)
TRAFFIC_SETUPS = {
    "layered ZeRO-3 (looped-bfs, B = m)": ("looped-bfs", {"layered_grad_accumulation": True}, "optim_grads_params", False),
    "layered ZeRO-3 (looped-bfs, B = 2)": ("looped-bfs", {"layered_grad_accumulation": True, "breadth_first_microbatches": 2},
                                           "optim_grads_params", False),
    "depth-first ZeRO-3 (interleaved 1F1B)": ("interleaved-1f1b", {}, "optim_grads_params", True),
    "ZeRO-1 (interleaved 1F1B, distributed optimizer)": ("interleaved-1f1b", {}, "optim", True),
}
EXPOSED_SETUPS = {
    # Same compute as 1F1B: no layer-input recomputation for this comparison.
    "layered (looped-bfs)": ("looped-bfs", {"layered_grad_accumulation": True, "checkpoint_layer_inputs": False}, True),
    "overlapped DDP, 1F1B": ("1f1b", {}, True),
    "overlapped DDP, interleaved 1F1B": ("interleaved-1f1b", {}, True),
    "DDP after the backward, 1F1B": ("1f1b", {}, False),
}


class EmulatedLink:
    """Make the data-parallel all-reduces as slow as a link of `gbps` GB/s per rank, in issue order.

    Inside the `with` block, `torch.distributed.all_reduce` on `group` still runs (the result is real);
    a call issued at time t on a link busy until `free` occupies it for `2(n−1)/n · bytes / bandwidth`
    (a ring all-reduce's traffic per rank) from `max(t, free)`, and its `wait()` returns no earlier than
    that end. A synchronous call sleeps until then. Compute keeps running while a reduction is "on the
    wire", exactly as with a real network, so what is measured is how much of it the schedule hides.
    """

    def __init__(self, group, gbps: float) -> None:
        self.group, self.bytes_per_s = group, gbps * 1e9
        self.free = 0.0

    def __enter__(self) -> "EmulatedLink":
        dist = torch.distributed
        self._original = original = dist.all_reduce
        n = dist.get_world_size(self.group)

        def slow_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            work = original(tensor, op=op, group=group, async_op=async_op)
            if group is not self.group:
                return work
            start = max(time.perf_counter(), self.free)
            self.free = end = start + 2 * (n - 1) / n * tensor.numel() * tensor.element_size() / self.bytes_per_s
            if not async_op:
                time.sleep(max(0.0, end - time.perf_counter()))
                return work
            return _SlowWork(work, end)

        dist.all_reduce = slow_all_reduce
        return self

    def __exit__(self, *exc) -> None:
        torch.distributed.all_reduce = self._original


class _SlowWork:
    def __init__(self, work, end: float) -> None:
        self.work, self.end = work, end

    def wait(self, *args):
        self.work.wait(*args)
        time.sleep(max(0.0, self.end - time.perf_counter()))
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed() and time.perf_counter() >= self.end


def _pipeline(ctx, config, pp, name, m, v, options, sharding, overlap, bucket_bytes, layered, trace=False):
    from megatron_pp.training.layered import connect_optimizer
    from megatron_pp.training.optimizer import OptimizerConfig, build_optimizer
    from megatron_pp.training.train import build_pipeline

    state = ctx.parallel_state(1, pp)
    schedule = build_schedule(name, pp, m, v, **options)
    pipe = build_pipeline(config, state, schedule, micro_batch_size=MICRO_BATCH, seed=SEED, trace=trace)
    optimizer = build_optimizer(pipe.chunks, state, OptimizerConfig(
        use_distributed_optimizer=sharding != "no_shard", data_parallel_sharding_strategy=sharding,
        overlap_grad_reduce=overlap, layered_grad_accumulation=layered, bucket_bytes=bucket_bytes))
    connect_optimizer(pipe.executor, optimizer)
    data = MockData(SEED, config.seq_length, config.vocab_size, MICRO_BATCH, MICRO_BATCH * m * state.dp_size,
                    state.dp_size)
    return pipe, optimizer, data


def traffic_worker(ctx, config, setup, pp, m, v, bucket_bytes):
    """dp collectives of one step (after one uncounted step), per op: (calls, payload bytes)."""
    from megatron_pp.training.train import global_token_count

    name, options, sharding, overlap = TRAFFIC_SETUPS[setup]
    pipe, optimizer, data = _pipeline(ctx, config, pp, name, m, v, options, sharding, overlap, bucket_bytes,
                                      bool(options.get("layered_grad_accumulation")))
    state = pipe.state
    for step in range(2):
        mbs = data.step_microbatches(step, state.dp_rank)
        tokens = global_token_count(mbs, state)
        with CommCounter(state.dp_group) as counter:
            optimizer.reducer.start_step(m)
            pipe.executor.run(mbs, loss_scale=1.0 / tokens)
            optimizer.reducer.finish()
            optimizer.step(1e-4)
    weights = optimizer.sharded_weights
    return {"totals": counter.totals(),
            "peak_weight_bytes": weights.peak_resident_bytes if weights is not None else None,
            "model_bytes": sum(b.grad.numel() * 4 for b in optimizer.reducer.buckets)}


def exposed_worker(ctx, config, setup, pp, m, v, steps, bucket_bytes, link_gbps=None):
    """Per step: (start, end of the rank's last compute action, completion of its reductions), in seconds
    of the machine-wide monotonic clock, so ranks can be compared."""
    from megatron_pp.training.train import global_token_count

    name, options, overlap = EXPOSED_SETUPS[setup]
    chunks = v if name != "1f1b" else 1
    pipe, optimizer, data = _pipeline(ctx, config, pp, name, m, chunks, options, "no_shard", overlap, bucket_bytes,
                                      bool(options.get("layered_grad_accumulation")), trace=True)
    state = pipe.state
    out = []
    for step in range(steps + 1):
        mbs = data.step_microbatches(step, state.dp_rank)
        tokens = global_token_count(mbs, state)
        torch.distributed.barrier()
        optimizer.reducer.start_step(m)
        link = EmulatedLink(state.dp_group, link_gbps) if link_gbps else contextlib.nullcontext()
        with link:
            start = time.perf_counter()
            result = pipe.executor.run(mbs, loss_scale=1.0 / tokens)
            optimizer.reducer.finish()
            end = time.perf_counter()
        last_compute = start + max(e for label, s, e in result.events if label.startswith(COMPUTE_PREFIXES))
        if step:  # the first step warms up
            out.append((start, last_compute, end))
    return out


def bubble_worker(ctx, config, pp, m, v, steps):
    """Per step: 1 - (compute time - receive waits) / step time on this rank."""
    from megatron_pp.training.train import build_pipeline, train_step

    state = ctx.parallel_state(1, pp)
    schedule = build_schedule("looped-bfs", pp, m, v)
    pipe = build_pipeline(config, state, schedule, micro_batch_size=MICRO_BATCH, seed=SEED, trace=True)
    data = MockData(SEED, config.seq_length, config.vocab_size, MICRO_BATCH, MICRO_BATCH * m, 1)
    mbs = data.step_microbatches(0, 0)
    out = []
    for step in range(steps + 1):
        torch.distributed.barrier()
        start = time.perf_counter()
        result, _ = train_step(pipe, mbs)
        wall = time.perf_counter() - start
        busy = sum(e - s for label, s, e in result.events if label.startswith(COMPUTE_PREFIXES)) - result.comm_wait_s
        if step:
            out.append(1.0 - busy / wall)
    return out


# Commands -------------------------------------------------------------------------------------------------


def run_traffic(args) -> dict:
    config = bench_config(args.num_layers, args.hidden_size, args.num_attention_heads, args.seq_length,
                          args.vocab_size, "gpt-tiny")
    v = args.num_layers // args.pp  # one layer per stage
    pool = WorkerPool(2 * args.pp)
    rows = {}
    try:
        for setup in TRAFFIC_SETUPS:
            for m in args.microbatches:
                if "B = 2" in setup and m <= 2:
                    continue
                r = pool.run(traffic_worker, config, setup, args.pp, m, v, args.bucket_bytes)[0]
                rows.setdefault(setup, {})[m] = r
    finally:
        pool.close()
    mb = 2 ** 20
    lines = ["| setup | m | all-gather calls | all-gather MiB | reduction calls | reduction MiB | total MiB | "
             "peak gathered weights MiB (of the rank's model) |", "|---|---|---|---|---|---|---|---|"]
    for setup, by_m in rows.items():
        for m, r in by_m.items():
            gather = r["totals"].get("all_gather", (0, 0))
            reduce = r["totals"].get("all_reduce", (0, 0))
            reduce = (reduce[0] + r["totals"].get("reduce_scatter", (0, 0))[0],
                      reduce[1] + r["totals"].get("reduce_scatter", (0, 0))[1])
            peak = "—" if r["peak_weight_bytes"] is None else f"{r['peak_weight_bytes'] / mb:.2f} ({r['model_bytes'] / mb:.2f})"
            lines.append(f"| {setup} | {m} | {gather[0]} | {gather[1] / mb:.2f} | {reduce[0]} | {reduce[1] / mb:.2f} | "
                         f"{(gather[1] + reduce[1]) / mb:.2f} | {peak} |")
    print("\n".join(lines))
    return {"rows": {s: {str(m): r for m, r in by_m.items()} for s, by_m in rows.items()}}


def simulated_exposure() -> dict:
    """The exposure model of `looped.exposed_reduction` (F = 1, B = 2 per one-layer chunk, m = 16)."""
    from megatron_pp.schedules.comm import insert_communication
    from megatron_pp.schedules.generators import interleaved_1f1b
    from megatron_pp.schedules.looped import add_layered_reduction, depth_first_accumulation, exposed_reduction

    m = 16
    setups = {
        "p = 1, v = 8: depth-first DDP": add_layered_reduction(depth_first_accumulation(m, 8)),
        "p = 1, v = 8: layered (looped-bfs)": build_schedule("looped-bfs", 1, m, 8, layered_grad_accumulation=True),
        "p = 4, v = 4: depth-first DDP (interleaved 1F1B)": insert_communication(
            add_layered_reduction(interleaved_1f1b(4, m, 4))),
        "p = 4, v = 4: layered (looped-bfs)": build_schedule("looped-bfs", 4, m, 4, layered_grad_accumulation=True),
    }
    times = (1, 2, 4, 8, 16)
    table = {name: [max(exposed_reduction(s, r)) for r in times] for name, s in setups.items()}
    lines = [f"simulated exposed reduction (m = {m}, F = 1, B = 2 per chunk; r = one chunk's reduction time):",
             "| setup | " + " | ".join(f"r = {r}" for r in times) + " |", "|---|" + "---|" * len(times)]
    lines += [f"| {name} | " + " | ".join(f"{x:g}" for x in row) + " |" for name, row in table.items()]
    print("\n".join(lines))
    return {"reduce_times": list(times), "exposed": table}


def run_exposed(args) -> dict:
    model = simulated_exposure()
    config = bench_config(args.num_layers, args.hidden_size, args.num_attention_heads, args.seq_length,
                          args.vocab_size, "gpt-tiny")
    v = args.num_layers // args.pp
    pool = WorkerPool(args.pp * 2)
    rows = {}
    try:
        for setup in EXPOSED_SETUPS:
            if args.pp == 1 and "interleaved" in setup:  # one pipeline rank: nothing to interleave
                continue
            per_rank = pool.run(exposed_worker, config, setup, args.pp, args.microbatches, v, args.steps,
                                args.bucket_bytes, args.link_gbps)
            # Exposed: from the moment the last rank finishes computing to the moment every rank's reductions
            # are complete. (Per rank, the wait after its own compute would also count the lag of its peers,
            # which on a shared CPU is mostly scheduling noise.)
            exposed = [max(r[i][2] for r in per_rank) - max(r[i][1] for r in per_rank) for i in range(args.steps)]
            step = [max(r[i][2] for r in per_rank) - min(r[i][0] for r in per_rank) for i in range(args.steps)]
            rows[setup] = {"exposed_s_median": statistics.median(exposed), "exposed_s_min": min(exposed),
                           "step_s_median": statistics.median(step), "exposed_s": exposed, "step_s": step}
    finally:
        pool.close()
    link = f", dp link emulated at {args.link_gbps:g} GB/s" if args.link_gbps else ""
    lines = [f"measured, pp {args.pp} x dp 2, {args.num_layers} layers (one per chunk), hidden {args.hidden_size}, "
             f"seq {args.seq_length}, m {args.microbatches}{link}:",
             "| setup | exposed reduction ms, median (min) | step ms, median | exposed / step |", "|---|---|---|---|"]
    for setup, r in rows.items():
        lines.append(f"| {setup} | {1e3 * r['exposed_s_median']:.1f} ({1e3 * r['exposed_s_min']:.1f}) | "
                     f"{1e3 * r['step_s_median']:.1f} | {r['exposed_s_median'] / r['step_s_median']:.1%} |")
    print("\n".join(lines))
    return {"model": model, "rows": rows}


def run_bubble(args) -> dict:
    p, m = 4, 8
    sim_lines = ["| v (layers per stage for L = 32) | looped-bfs simulated | (p−1)/(v·m+p−1) |", "|---|---|---|"]
    simulated = {}
    for v in (1, 2, 4, 8):
        bubble = simulate(build_schedule("looped-bfs", p, m, v)).bubble_fraction
        simulated[v] = bubble
        sim_lines.append(f"| {v} ({32 // (p * v)}) | {bubble:.4f} | {(p - 1) / (v * m + p - 1):.4f} |")
    print(f"simulated, p = {p}, m = {m}, F = 1, B = 2 per chunk:")
    print("\n".join(sim_lines))
    config = bench_config(args.num_layers, args.hidden_size, args.num_attention_heads, args.seq_length,
                          args.vocab_size, "gpt-tiny")
    pool = WorkerPool(args.pp)
    measured = {}
    try:
        for v in args.chunks:
            per_rank = pool.run(bubble_worker, config, args.pp, args.microbatches, v, args.steps)
            measured[v] = {"per_rank_median": [statistics.median(r) for r in per_rank],
                           "mean_of_ranks": statistics.mean(statistics.median(r) for r in per_rank)}
    finally:
        pool.close()
    p, m = args.pp, args.microbatches
    lines = [f"measured on {torch.get_num_threads()} thread(s) per rank, pp = {p}, m = {m}, "
             f"{args.num_layers} layers, hidden {args.hidden_size}:",
             "| v | layers per stage | measured bubble (mean of ranks' medians) | per rank | (p−1)/(v·m+p−1) |",
             "|---|---|---|---|---|"]
    for v, r in measured.items():
        lines.append(f"| {v} | {args.num_layers // (p * v)} | {r['mean_of_ranks']:.3f} | "
                     f"{', '.join(f'{b:.3f}' for b in r['per_rank_median'])} | {(p - 1) / (v * m + p - 1):.3f} |")
    print("\n".join(lines))
    return {"simulated": simulated, "measured": measured}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, defaults in (("traffic", dict(hidden=64, layers=8, steps=1, pp=2, mbs=[2, 4, 8, 16], bucket=64 * 1024)),
                           ("exposed", dict(hidden=256, layers=8, steps=8, pp=1, mbs=[16], bucket=1 << 20, seq=32)),
                           ("bubble", dict(hidden=512, layers=8, steps=5, pp=2, mbs=[4], bucket=1 << 20))):
        p = sub.add_parser(name)
        p.add_argument("--hidden-size", type=int, default=defaults["hidden"])
        p.add_argument("--num-attention-heads", type=int, default=4)
        p.add_argument("--seq-length", type=int, default=defaults.get("seq", 128))
        p.add_argument("--vocab-size", type=int, default=512)
        p.add_argument("--num-layers", type=int, default=defaults["layers"])
        p.add_argument("--pp", type=int, default=defaults["pp"])
        if name != "traffic":
            p.add_argument("--steps", type=int, default=defaults["steps"], help="timed steps (after one warm-up step)")
        p.add_argument("--bucket-bytes", type=int, default=defaults["bucket"])
        if name == "traffic":
            p.add_argument("--microbatches", type=int, nargs="+", default=defaults["mbs"])
        else:
            p.add_argument("--microbatches", type=int, default=defaults["mbs"][0])
        if name == "exposed":
            p.add_argument("--link-gbps", type=float, default=None,
                           help="emulate a data-parallel link of this many GB/s per rank (EmulatedLink)")
        if name == "bubble":
            p.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4])
        p.add_argument("--json", default=None, help="also write the numbers here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    report = {"traffic": run_traffic, "exposed": run_exposed, "bubble": run_bubble}[args.command](args)
    report["command"] = "python benchmarks/bench_layered.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
