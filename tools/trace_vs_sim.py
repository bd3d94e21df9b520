"""Check the simulator against real runs: the bubble of a CPU training run's `--trace-file` against the
bubble the simulator predicts for the same lists from the costs measured in that very trace.

    python tools/trace_vs_sim.py --pp 2,4 --schedules 1f1b,interleaved-1f1b,zb-h1,zb-v \\
        --json docs/results/trace_vs_sim_cpu.json

For each (pipeline size, schedule) the tool runs `pretrain_gpt.py` under torchrun (gloo, one thread per
rank, mock data) with `--trace-file`, then reads the trace back. Every step after the first (warm-up)
is cut out of it by the rank's own action list (the executor writes one slice per compute action and
one per batch of communication, in list order). Measured per compute action (F, B, BI, BW) of a step:

    cost = (start of the rank's next compute slice, or the end of its last slice of the step)
           - (start of this slice) - (time blocked inside it on its received input)

i.e. the action's own compute plus the executor's work up to the next compute action (posting the
sends and receives after it, the loop's Python): everything the rank does that is not waiting. The
time blocked is the executor's "wait <action>" slice nested in the action's (`schedules.execute`).
The point-to-point latency is the trace's own measurement of the link: half the shortest round trip
of the clock synchronisation (`core.clock`, the trace's `error_bound_s`). The JSON also gives, for
every receive its consumer blocked on, the time from the end of the sender's slice that posted the send
to the end of the wait: that is the latency plus whatever held the message up on a loaded host (the
gloo threads of both processes must be scheduled), selected towards long delays (a consumer blocks only
when the data is late), so it is reported, not simulated.

The simulator then gets `CostModel(measured={(op, stage): median cost}, p2p_latency=link latency)`:
medians over every measured step and microbatch, nothing fitted. The bubble is defined the same way
for both, as `simulate` does: over the step window W (from the first compute's own work, after any wait,
to the end of the last rank's last action), the mean over ranks of (W - busy) / W, busy being the sum of
the rank's action costs. The trace's figure is the median over its measured steps. The JSON also
states, per run, how much of the busy time is executor work outside compute slices, and the relative
error |trace - sim| / sim against the 15% the zero-bubble issue asks for.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from megatron_pp.cli import OneLineArgumentParser, UsageError, write_json  # noqa: E402
from megatron_pp.schedules.ir import COMM_OPS, Action, Op, Schedule  # noqa: E402
from megatron_pp.schedules.registry import list_schedules  # noqa: E402
from megatron_pp.schedules.simulate import CostModel, simulate  # noqa: E402

TARGET = 0.15
VIRTUAL = {"interleaved-1f1b": 2}  # virtual stages per rank given on the command line (zb-v fixes its own)


DEFAULT_SCHEDULES = "1f1b,interleaved-1f1b,zb-h1,zb-v"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="trace_vs_sim.py", description=__doc__.splitlines()[0])
    parser.add_argument("--pp", default="2,4", help="pipeline sizes, comma-separated")
    parser.add_argument("--schedules", default=None,
                        help=f"comma-separated (default: {DEFAULT_SCHEDULES}); with --emulate 'all' takes "
                             "every family, and with --calibrate-only the lists named are calibrated too")
    parser.add_argument("--microbatches", default="8",
                        help="microbatches per step; with --emulate a comma-separated list where Np means N x pp "
                             "(default there: 2p,4p)")
    parser.add_argument("--iters", type=int, default=6, help="training iterations; the first is warm-up")
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per training run")
    parser.add_argument("--keep-traces", default=None, metavar="DIR", help="keep each run's trace here")
    parser.add_argument("--json", default=None)
    parser.add_argument("--emulate", action="store_true",
                        help="emulated compute (megatron_pp/benchmarks/emulate.py): every compute action ends at its "
                             "start plus its cost-model time and every stash copy takes its cost-model time, on a "
                             "tiny model, so p = 16 fits on 2 cores; compares step time and bubble with the "
                             "simulator and takes the excess apart along the critical path")
    parser.add_argument("--costs", default="equal,split", help="--emulate: cost sets, comma-separated (equal, split)")
    parser.add_argument("--unit-ms", type=float, default=20.0, help="--emulate: one forward, in milliseconds")
    parser.add_argument("--steps", type=int, default=2, help="--emulate: measured steps after one warm-up step")
    parser.add_argument("--replay", action="store_true",
                        help="--emulate: instead of the grid's rows, run each (schedule, m, costs) once and replay it in "
                             "the simulator with each message's measured latency (megatron_pp/benchmarks/"
                             "emulate_replay.py), into --json")
    parser.add_argument("--calibrate-only", action="store_true",
                        help="--emulate: only the host-cost calibrations of a grid, into --json: the common one per --pp (1f1b, "
                             "m = 3p, equal costs, at --unit-ms) and, with --schedules, each named list's own (its "
                             "family at m = 3p under each of --costs): megatron_pp/benchmarks/emulate_calibrate.py")
    parser.add_argument("--plan", action="append", default=[], metavar="ARGS",
                        help="--emulate: instead of the schedule grid, emulate the best plan tools/plan.py prints for "
                             "these arguments (one quoted string; repeatable) with the planner's per-action times "
                             "scaled so a rank's forward share takes --unit-ms, against its predicted step time "
                             "(megatron_pp/benchmarks/emulate_plan.py)")
    return parser


def training_argv(args: argparse.Namespace, schedule: str, pp: int, trace: str) -> list[str]:
    argv = ["--model-preset", "gpt-tiny", "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", str(args.num_attention_heads), "--ffn-hidden-size", str(4 * args.hidden_size),
            "--seq-length", str(args.seq_length), "--max-position-embeddings", str(args.seq_length),
            "--vocab-size", str(args.vocab_size), "--mock-data", "--micro-batch-size", "1",
            "--global-batch-size", str(args.microbatches), "--train-iters", str(args.iters),
            "--pipeline-model-parallel-size", str(pp), "--pipeline-schedule", schedule,
            "--log-interval", "1000", "--seed", "1", "--trace-file", trace]
    if schedule in VIRTUAL:
        argv += ["--num-virtual-stages-per-pipeline-rank", str(VIRTUAL[schedule])]
    return argv


def job_schedule(argv: Sequence[str], pp: int) -> Schedule:
    """The lists the run executes, checked and built the way `pretrain` builds them (data parallel size 1)."""
    from megatron_pp.training.arguments import (build_job_schedule, build_parser, derive_args,
                                                model_config_from_args, num_chunks, validate_args)

    args = build_parser().parse_args(list(argv))
    errors = validate_args(args, world_size=pp)
    if errors:
        raise UsageError(f"the training run for p={pp} would be refused: {errors[0]}")
    args = derive_args(args, world_size=pp)
    return build_job_schedule(args, 1, num_chunks(args, model_config_from_args(args)))


def run_training(argv: Sequence[str], pp: int, timeout: float) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(pp),
           str(_ROOT / "pretrain_gpt.py"), *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=_ROOT)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"training run failed (exit {proc.returncode}): {' '.join(argv)}: {tail[0]}")


# Reading the trace ------------------------------------------------------------------------------------------


@dataclass
class Slice:
    label: str
    start: float
    end: float
    waits: list[tuple[float, float]] = field(default_factory=list)

    @property
    def action(self) -> Optional[Action]:
        return None if " " in self.label else Action.parse(self.label)

    @property
    def waited(self) -> float:
        return sum(e - s for s, e in self.waits)


def slices_per_step(actions: Sequence[Action]) -> int:
    """How many slices the executor writes per step for this list: one per run of communication actions,
    one per other action."""
    count, previous_comm = 0, False
    for a in actions:
        comm = a.op in COMM_OPS
        count += not (comm and previous_comm)
        previous_comm = comm
    return count


def read_steps(path: str, schedule: Schedule) -> list[list[list[Slice]]]:
    """steps[k][rank] = rank's slices of step k, in order, each with the waits nested in it."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    by_rank: dict[int, list[dict]] = defaultdict(list)
    for e in events:
        by_rank[int(e["pid"])].append(e)
    if sorted(by_rank) != list(range(schedule.num_ranks)):
        raise UsageError(f"{path}: ranks {sorted(by_rank)}, the schedule has {schedule.num_ranks}")
    per_rank = []
    for rank in range(schedule.num_ranks):
        ordered = sorted(by_rank[rank], key=lambda e: (e["ts"], e["name"].startswith("wait ")))
        slices: list[Slice] = []
        for e in ordered:
            start, end = e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6
            if e["name"].startswith("wait "):
                if not slices or slices[-1].label != e["name"][len("wait "):]:
                    raise UsageError(f"{path}: rank {rank}: {e['name']!r} outside its action's slice")
                slices[-1].waits.append((start, end))
            else:
                slices.append(Slice(e["name"], start, end))
        n = slices_per_step(schedule.actions[rank])
        if len(slices) % n:
            raise UsageError(f"{path}: rank {rank} has {len(slices)} slices, not a whole number of steps of {n}")
        per_rank.append([slices[i:i + n] for i in range(0, len(slices), n)])
    steps = {len(s) for s in per_rank}
    if len(steps) != 1:
        raise UsageError(f"{path}: ranks ran different numbers of steps {sorted(steps)}")
    return [[per_rank[r][k] for r in range(schedule.num_ranks)] for k in range(steps.pop())]


@dataclass
class StepMeasure:
    costs: list[list[tuple[Action, float]]]  # per rank, (compute action, cost) in list order
    window: float
    bubble: float
    busy: list[float]
    in_slices: list[float]  # per rank, compute-slice time net of waits (the rest of busy is executor work)
    delays: list[float]  # send post -> end of the consumer's wait, for every receive it blocked on


def measure_step(step: list[list[Slice]], schedule: Schedule) -> StepMeasure:
    costs, in_slices, work_from, ends = [], [], [], []
    posted: dict[tuple[Op, int, int, int], float] = {}  # (send op, microbatch, chunk, peer) -> when posted
    for rank, slices in enumerate(step):
        compute = [s for s in slices if s.action is not None and s.action.is_compute]
        step_end = slices[-1].end
        rank_costs = []
        for i, s in enumerate(compute):
            until = compute[i + 1].start if i + 1 < len(compute) else step_end
            rank_costs.append((s.action, until - s.start - s.waited))
        costs.append(rank_costs)
        in_slices.append(sum(s.end - s.start - s.waited for s in compute))
        first = compute[0]
        work_from.append(first.waits[-1][1] if first.waits else first.start)
        ends.append(step_end)
        for s in slices:
            for text in s.label.split():
                a = Action.parse(text)
                if a.op in (Op.SEND_F, Op.SEND_B):
                    posted[a.op, a.microbatch, a.chunk, rank] = s.end
    window = max(ends) - min(work_from)
    busy = [sum(c for _, c in rank_costs) for rank_costs in costs]
    bubble = sum((window - b) / window for b in busy) / len(busy)
    return StepMeasure(costs, window, bubble, busy, in_slices, _blocked_delays(step, schedule, posted))


def _blocked_delays(step: list[list[Slice]], schedule: Schedule, posted: dict) -> list[float]:
    """Send post -> end of the consumer's wait, for every received input whose consumer waited."""
    out = []
    last = schedule.num_stages - 1
    for rank, slices in enumerate(step):
        for s in slices:
            a = s.action
            if a is None or not s.waits or a.op is Op.BW:
                continue
            stage = schedule.stage_of(rank, a.chunk)
            neighbour = stage - 1 if a.op is Op.F else stage + 1
            if not 0 <= neighbour <= last:
                continue
            peer, chunk = schedule.location(neighbour)
            if peer == rank:
                continue
            sent = posted.get((Op.SEND_F if a.op is Op.F else Op.SEND_B, a.microbatch, chunk, peer))
            if sent is not None:
                out.append(s.waits[-1][1] - sent)
    return out


def compare(trace: str, schedule: Schedule) -> dict:
    steps = read_steps(trace, schedule)
    if len(steps) < 2:
        raise UsageError(f"{trace}: {len(steps)} step(s); need a warm-up step and at least one more")
    measured = [measure_step(step, schedule) for step in steps[1:]]
    samples: dict[tuple[Op, int], list[float]] = defaultdict(list)
    for m in measured:
        for rank, rank_costs in enumerate(m.costs):
            for action, cost in rank_costs:
                samples[action.op, schedule.stage_of(rank, action.chunk)].append(cost)
    table = {key: statistics.median(v) for key, v in samples.items()}
    delays = [x for m in measured for x in m.delays]
    with open(trace) as f:
        latency = max(json.load(f)["otherData"]["error_bound_s"])
    sim = simulate(schedule, CostModel(measured=table, p2p_latency=latency))
    trace_bubble = statistics.median(m.bubble for m in measured)
    busy = [sum(m.busy[r] for m in measured) for r in range(schedule.num_ranks)]
    own = [sum(m.in_slices[r] for m in measured) for r in range(schedule.num_ranks)]
    return {
        "pp": schedule.num_ranks, "chunks": schedule.num_chunks, "microbatches": schedule.num_microbatches,
        "steps_measured": len(measured),
        "costs_ms": {f"{op.value}.{stage}": 1e3 * t
                     for (op, stage), t in sorted(table.items(), key=lambda kv: (kv[0][1], kv[0][0].value))},
        "cost_samples": {f"{op.value}.{stage}": len(v) for (op, stage), v in samples.items()},
        "p2p_latency_ms": 1e3 * latency,
        "blocked_receive_delay_ms": {"median": 1e3 * statistics.median(delays) if delays else None,
                                     "samples": len(delays)},
        "executor_share_of_busy": [1 - o / b if b > 0 else 0.0 for o, b in zip(own, busy)],
        "trace_window_ms": [1e3 * m.window for m in measured],
        "trace_bubble_per_step": [m.bubble for m in measured],
        "trace_bubble": trace_bubble,
        "sim_makespan_ms": 1e3 * sim.makespan,
        "sim_busy_ms": [1e3 * b for b in sim.busy],
        "sim_bubble": sim.bubble_fraction,
        "relative_error": abs(trace_bubble - sim.bubble_fraction) / sim.bubble_fraction,
    }


def _list(text: str, flag: str, kind=str) -> list:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: not a comma-separated list of {kind.__name__}") from None
    if not values:
        raise UsageError(f"{flag} is empty")
    return values


def plan_cases(args: argparse.Namespace) -> list:
    """For each --plan, the best row tools/plan.py ranks for those arguments, ready to emulate
    (`emulate_plan.plan_case`). UsageError naming the --plan whose arguments are refused or fit nothing."""
    import shlex

    if str(_ROOT / "tools") not in sys.path:
        sys.path.insert(0, str(_ROOT / "tools"))
    import plan as plan_tool

    from megatron_pp.benchmarks.emulate_plan import plan_case

    if not args.unit_ms > 0 or args.steps < 1:
        raise UsageError(f"--unit-ms must be > 0 and --steps >= 1, got {args.unit_ms} and {args.steps}")
    cases = []
    for text in args.plan:
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said):  # plan.py's parser prints its one line and exits 2
                plan_args = plan_tool.parse_args(shlex.split(text))
            planner = plan_tool.build(plan_args)
            ranked = planner.plan(top=1, fold=True).ranked
        except SystemExit:
            raise UsageError(f"--plan {text!r}: tools/plan.py says {said.getvalue().strip()}") from None
        except (ValueError, OSError) as err:
            raise UsageError(f"--plan {text!r}: {err}") from None
        if not ranked or ranked[0].configuration.pp < 2:
            raise UsageError(f"--plan {text!r}: " + ("nothing fits" if not ranked else "the best plan has no pipeline "
                                                     "(pp 1); narrow --schedules or give fewer GPUs memory"))
        cases.append(plan_case(text, planner, ranked[0], args.unit_ms / 1e3))
    return cases


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
        pps = _list(args.pp, "--pp", int)
        names = _list(args.schedules or DEFAULT_SCHEDULES, "--schedules")
        unknown = [n for n in names if n not in list_schedules() and not (args.emulate and names == ["all"])]
        if unknown:
            raise UsageError(f"--schedules: unknown schedule {unknown[0]!r}")
        if args.plan and not args.emulate:
            raise UsageError("--plan needs --emulate")
        if args.calibrate_only and (not args.emulate or args.plan):
            raise UsageError("--calibrate-only needs --emulate and no --plan")
        if args.replay and (not args.emulate or args.plan or args.calibrate_only):
            raise UsageError("--replay needs --emulate and neither --plan nor --calibrate-only")
        if args.emulate and args.plan:
            cases = plan_cases(args)  # every plan made and its lists built before the first pool starts
        elif args.emulate:
            from megatron_pp.benchmarks.emulate_report import plan_emulation, run_emulation

            plan = plan_emulation(args, pps, names)  # every list built and checked before the first pool starts
        else:
            try:
                args.microbatches = int(args.microbatches)
            except ValueError:
                raise UsageError(f"--microbatches {args.microbatches!r}: one integer (lists need --emulate)") from None
            if args.iters < 2:
                raise UsageError(f"--iters must be >= 2 (the first step is warm-up), got {args.iters}")
            # Every job's arguments and lists are checked before the first (slow) run.
            jobs = [(pp, name, job_schedule(training_argv(args, name, pp, "trace.json"), pp))
                    for pp in pps for name in names]
    except (UsageError, ValueError) as err:
        print(f"trace_vs_sim.py: error: {err}", file=sys.stderr)
        return 2
    if args.emulate and args.plan:
        from megatron_pp.benchmarks.emulate_report import run_plan_emulation

        return run_plan_emulation(args, cases, argv)
    if args.emulate and args.replay:
        from megatron_pp.benchmarks.emulate_replay import run_replay

        return run_replay(args, plan, argv)
    if args.emulate:
        return run_emulation(args, plan, argv)
    import torch

    results = []
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.keep_traces or scratch
        os.makedirs(folder, exist_ok=True)
        for pp, name, schedule in jobs:
            trace = os.path.join(folder, f"trace_{name}_pp{pp}.json")
            try:
                run_training(training_argv(args, name, pp, trace), pp, args.timeout)
            except (RuntimeError, subprocess.TimeoutExpired) as err:
                print(f"trace_vs_sim.py: {name} p={pp}: {err}", file=sys.stderr)
                return 1
            row = {"schedule": name, **compare(trace, schedule)}
            results.append(row)
            delay = row["blocked_receive_delay_ms"]["median"] or 0.0
            print(f"{name:>18} p={pp}: bubble trace {row['trace_bubble']:.3f}  sim {row['sim_bubble']:.3f}  "
                  f"error {100 * row['relative_error']:.1f}%  (blocked-receive delay {delay:.1f} ms, executor "
                  f"{100 * statistics.mean(row['executor_share_of_busy']):.1f}% of busy)", flush=True)
    report = {
        "command": "python tools/trace_vs_sim.py " + " ".join(argv),
        "device": f"CPU ({platform.machine()}, {os.cpu_count()} cores), gloo, 1 thread per rank",
        "torch": torch.__version__,
        "model": {"preset": "gpt-tiny", "layers": args.num_layers, "hidden": args.hidden_size,
                  "heads": args.num_attention_heads, "seq": args.seq_length, "vocab": args.vocab_size,
                  "micro_batch": 1, "microbatches": args.microbatches, "iters": args.iters},
        "cost_model": "per (op, global stage) the median measured action cost (own compute + executor work up to "
                      "the next compute action, time blocked on inputs excluded); p2p latency = half the shortest "
                      "clock-sync round trip in the trace; bubble = mean over ranks of (window - busy) / window, "
                      "trace: median over the steps after the first",
        "target_relative_error": TARGET,
        "runs": results,
        "within_target": {f"{r['schedule']} p={r['pp']}": r["relative_error"] <= TARGET for r in results},
    }
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
