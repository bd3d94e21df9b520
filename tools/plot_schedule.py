"""Draw a registered pipeline schedule: the simulated timeline of every rank and its stash curve.

    python tools/plot_schedule.py --schedule interleaved-1f1b --pp 4 --microbatches 8 --chunks 2 \\
        --out docs/img/schedule_interleaved.png --json schedule.json
    python tools/plot_schedule.py --compare interleaved-1f1b,gis,gis-h,po-h,po-f --pp 4 --microbatches 8 \\
        --chunks 4 --out docs/img/pipeoffload_memory.png
    python tools/plot_schedule.py --compare 1f1b,bpipe --pp 8 --microbatches 16 --out docs/img/bpipe_memory.png
    python tools/plot_schedule.py --compare 1f1b,zb-v,v-half --pp 4 --microbatches 8 --out docs/img/vshape_memory.png

The schedule is built exactly as training builds it (generator, passes, communication, validation), then
timed by the simulator. The top panel has one row per rank with a box per compute action, coloured by
microbatch (backwards lighter and hatched), so bubbles show as empty space; stash transfers (OFFLOAD,
RELOAD, EVICT, LOAD) are thin bars on a lane under their rank's row, and a BPipe acceptor's ACCEPT and
RETURN are markers on its lane where it posts them. The bottom panel shows how many
(microbatch, chunk) stashes each rank holds in device memory over time (BPipe's acceptors include
the stashes they host). `--compare` draws several schedules' stash curves side by side on one scale
instead, with a last panel of every rank's peak under each. `--offload-time` is the one-way transfer
time of a stash in units of its chunk's forward (default 0.25): it times the transfers and, for
schedules that take it, places them. `--json` writes the validated action lists in text form with makespan, bubble
fraction, peak stashes and the options (with `--compare`, one such record per schedule). Bad input
prints one line on stderr and exits with status 2.

The training scripts' flags draw the run they describe: `--pipeline-schedule`, `--pipeline-model-parallel-size`,
`--num-virtual-stages-per-pipeline-rank` or `--num-layers` with `--num-layers-per-virtual-pipeline-stage`
(v derived by the training code's own `num_chunks`), `--global-batch-size` with `--micro-batch-size` (and
`--data-parallel-size`) for m, and every schedule option's flag (`--interleave-group-size`, ...).

`--trace-file` takes a training run's `--trace-file` (one process per pipeline rank) and draws what the
run executed, on the trace's one clock in milliseconds, between the simulated timeline and the stash
curves, so the bubbles the simulator predicts can be checked against the ones the run had; every action
in the trace must be in the schedule's lists (draw it with the flags the run used).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence

# Runnable as `python tools/plot_schedule.py` from a checkout without installing the package.
_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from megatron_pp.cli import OneLineArgumentParser, UsageError, write_json  # noqa: E402
from megatron_pp.schedules.ir import HOSTING_OPS, TRANSFER_OPS, Action, Op, Schedule  # noqa: E402
from megatron_pp.schedules.plugins import add_plugin_flag, load_plugins  # noqa: E402
from megatron_pp.schedules.registry import (build_schedule, get_schedule, registered_schedules,  # noqa: E402
                                           schedule_options)
from megatron_pp.schedules.schedule_file import (FILE_SCHEDULE_OPTIONS, build_schedule_from_file,  # noqa: E402
                                                 schedule_to_json)
from megatron_pp.schedules.simulate import DEFAULT_TRANSFER, CostModel, SimResult, simulate  # noqa: E402
from megatron_pp.training.arguments import num_chunks  # noqa: E402

_PROG = "plot_schedule.py"


def build_parser() -> argparse.ArgumentParser:
    known = " | ".join(f"{e.name}: {e.description}" for e in registered_schedules())
    parser = OneLineArgumentParser(prog=_PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", "--pipeline-schedule", dest="schedule", default=None,
                        help=f"registered schedule name or alias ({known})")
    parser.add_argument("--compare", default=None, metavar="NAME,NAME,...",
                        help="instead of --schedule: several schedules' stash curves side by side")
    parser.add_argument("--pipeline-schedule-file", default=None, metavar="FILE",
                        help="instead of --schedule: torch's compute-only CSV or our JSON (docs/plugins.md); p, m and v "
                             "come from the file (--pp/--microbatches/--chunks, when given, must agree)")
    add_plugin_flag(parser)
    parser.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=int, default=None,
                        help="pipeline ranks p (required with --schedule/--compare)")
    parser.add_argument("--microbatches", type=int, default=None,
                        help="microbatches per step m (required with --schedule/--compare)")
    parser.add_argument("--chunks", "--num-virtual-stages-per-pipeline-rank", dest="chunks", type=int, default=None,
                        help="model chunks per rank v (default 1)")
    # The training scripts' way to give v and m, so their command line draws as it trains.
    parser.add_argument("--num-layers", type=int, default=None, help="with --num-layers-per-virtual-pipeline-stage")
    parser.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                        help="v = layer slots / (p x this), as pretrain_gpt.py derives it")
    parser.add_argument("--account-for-embedding-in-pipeline-split", action="store_true")
    parser.add_argument("--account-for-loss-in-pipeline-split", action="store_true")
    parser.add_argument("--global-batch-size", type=int, default=None,
                        help="with --micro-batch-size (and --data-parallel-size): m = global / (micro x dp)")
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--data-parallel-size", type=int, default=1, help="data-parallel replicas (default 1)")
    # The schedules' own option flags, as the training scripts take them, so a run's flags can be pasted.
    for option in schedule_options():
        if option.flag == "--offload-time":  # this tool's own flag: it also times the copies
            continue
        if option.type is bool:
            parser.add_argument(option.flag, dest=f"option_{option.name}", action=argparse.BooleanOptionalAction,
                                default=None, help=option.help)
        else:
            parser.add_argument(option.flag, dest=f"option_{option.name}", type=option.type, default=None,
                                help=option.help)
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="schedule option, repeatable (e.g. microbatch_group_size=4); VALUE is read as JSON "
                             "when it parses, else as a string")
    parser.add_argument("--forward-time", type=float, default=CostModel.forward, help="F per chunk (default 1)")
    parser.add_argument("--backward-time", type=float, default=CostModel.backward, help="B per chunk (default 2)")
    parser.add_argument("--p2p-latency", type=float, default=CostModel.p2p_latency, help="send latency (default 0)")
    parser.add_argument("--offload-time", type=float, default=None,
                        help="one-way stash transfer time in units of its chunk's forward "
                             f"(default {DEFAULT_TRANSFER})")
    parser.add_argument("--stage-weights", default=None, metavar="W0,W1,...",
                        help="per global stage multiplier of compute times (e.g. layers per stage)")
    parser.add_argument("--trace-file", default=None, metavar="FILE",
                        help="a run's --trace-file (pretrain_*.py) with one process per pipeline rank: its executed "
                             "actions are drawn under the simulated timeline of the same lists")
    parser.add_argument("--out", default=None, help="PNG file to write")
    parser.add_argument("--json", default=None, help="also write the lists and results to this JSON file")
    parser.add_argument("--export-schedule", default=None, metavar="FILE",
                        help="write the validated schedule in the JSON form --pipeline-schedule-file reads (a start "
                             "for a hand-edited schedule)")
    return parser


def _parse_options(items: Sequence[str]) -> dict[str, object]:
    options: dict[str, object] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name:
            raise UsageError(f"--option expects NAME=VALUE, got {item!r}")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        options[name.replace("-", "_")] = value
    return options


def _training_sizes(args: argparse.Namespace) -> None:
    """Fill --chunks and --microbatches from the training flags that imply them (UsageError on a clash)."""
    if args.num_layers_per_virtual_pipeline_stage is not None:
        if args.num_layers is None or args.pp is None:
            raise UsageError("--num-layers-per-virtual-pipeline-stage needs --num-layers and "
                             "--pipeline-model-parallel-size")
        try:
            chunks = num_chunks(argparse.Namespace(**{**vars(args), "num_virtual_stages_per_pipeline_rank": args.chunks,
                                                      "pipeline_model_parallel_size": args.pp}),
                                argparse.Namespace(num_layers=args.num_layers))
        except ValueError as err:
            raise UsageError(str(err)) from None
        args.chunks = chunks
    if args.global_batch_size is not None or args.micro_batch_size is not None:
        if args.global_batch_size is None or args.micro_batch_size is None:
            raise UsageError("give --global-batch-size and --micro-batch-size together")
        per_step = args.micro_batch_size * args.data_parallel_size
        if args.micro_batch_size < 1 or args.data_parallel_size < 1 or args.global_batch_size % per_step:
            raise UsageError(f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
                             f"{args.micro_batch_size} x --data-parallel-size {args.data_parallel_size}")
        m = args.global_batch_size // per_step
        if args.microbatches is not None and args.microbatches != m:
            raise UsageError(f"--microbatches {args.microbatches} disagrees with --global-batch-size / "
                             f"(--micro-batch-size x --data-parallel-size) = {m}")
        args.microbatches = m


def _parse_weights(text: str | None) -> list[float] | None:
    if text is None:
        return None
    try:
        return [float(w) for w in text.split(",")]
    except ValueError:
        raise UsageError(f"--stage-weights expects comma-separated numbers, got {text!r}") from None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        load_plugins(argv)  # before the parser, whose help lists the registered schedules
        args = build_parser().parse_args(argv)
        if sum(x is not None for x in (args.schedule, args.compare, args.pipeline_schedule_file)) != 1:
            raise UsageError("give exactly one of --schedule, --compare and --pipeline-schedule-file")
        if args.out is None and args.json is None and args.export_schedule is None:
            raise UsageError("nothing to write: give --out, --json or --export-schedule")
        _training_sizes(args)
        if args.pipeline_schedule_file is None and (args.pp is None or args.microbatches is None):
            raise UsageError("--pp and --microbatches are required with --schedule and --compare")
        options = _parse_options(args.option)
        for option in schedule_options():
            value = getattr(args, f"option_{option.name}", None)
            if value is not None:
                if option.name in options and options[option.name] != value:
                    raise UsageError(f"{option.flag} {value} and --option {option.name}={options[option.name]} disagree")
                options[option.name] = value
        costs = CostModel(forward=args.forward_time, backward=args.backward_time, p2p_latency=args.p2p_latency,
                          stage_weights=_parse_weights(args.stage_weights), transfer=args.offload_time)
        runs = []
        if args.pipeline_schedule_file is not None:
            wrong = sorted(set(options) - set(FILE_SCHEDULE_OPTIONS))
            if wrong:
                raise UsageError(f"--option {wrong[0]} does not apply to --pipeline-schedule-file (its options: "
                                 f"{', '.join(FILE_SCHEDULE_OPTIONS)})")
            if args.offload_time is not None and ("offload_chunks" in options or "offload_fraction" in options):
                options.setdefault("offload_time", args.offload_time)
            schedule = build_schedule_from_file(args.pipeline_schedule_file, num_ranks=args.pp,
                                                num_microbatches=args.microbatches, num_chunks=args.chunks, **options)
            runs.append((schedule, simulate(schedule, costs)))
        names = [] if args.pipeline_schedule_file else (
            [args.schedule] if args.compare is None else [n.strip() for n in args.compare.split(",") if n.strip()])
        for name in names:
            opts = dict(options)
            if args.offload_time is not None and "offload_time" in get_schedule(name).options:
                opts.setdefault("offload_time", args.offload_time)  # place the copies as they are timed
            chunks = args.chunks or get_schedule(name).chunks_per_rank or 1  # the V shapes always take 2
            schedule = build_schedule(name, args.pp, args.microbatches, chunks, **opts)
            runs.append((schedule, simulate(schedule, costs)))
        executed = None
        if args.trace_file is not None:
            if args.compare is not None or args.out is None:
                raise UsageError("--trace-file draws under one schedule's timeline: give --out and --schedule or "
                                 "--pipeline-schedule-file, not --compare")
            executed = read_trace(args.trace_file, runs[0][0])
        if args.out is not None:
            if args.compare is None:
                draw(*runs[0], args.out, executed=executed)
            else:
                draw_comparison(runs, args.out)
        if args.export_schedule:
            write_json(args.export_schedule, schedule_to_json(runs[0][0]))
        if args.json:
            records = [to_json(schedule, result, costs) for schedule, result in runs]
            Path(args.json).write_text(_format_json(records[0]) if args.compare is None else
                                       "[\n" + ",\n".join(_format_json(r) for r in records) + "]\n")
    except (UsageError, ValueError, OSError) as err:
        print(f"{_PROG}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    return 0


def _format_json(record: dict) -> str:
    # One key per line and one line per rank's list, so two runs diff action by action.
    lines = [f" {json.dumps(key)}: {json.dumps(value)}" for key, value in record.items() if key != "actions"]
    lines.append(' "actions": [\n  ' + ",\n  ".join(json.dumps(acts) for acts in record["actions"]) + "\n ]")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def to_json(schedule: Schedule, result: SimResult, costs: CostModel) -> dict:
    return {
        "schedule": schedule.name,
        "num_ranks": schedule.num_ranks,
        "num_microbatches": schedule.num_microbatches,
        "num_chunks": schedule.num_chunks,
        "options": schedule.options,
        "placement": [list(loc) for loc in schedule.placement],
        "costs": {"forward": costs.forward, "backward": costs.backward, "p2p_latency": costs.p2p_latency,
                  "stage_weights": None if costs.stage_weights is None else list(costs.stage_weights),
                  "transfer": costs.transfer},
        "actions": [[str(a) for a in acts] for acts in schedule.actions],
        "makespan": result.makespan,
        "bubble_fraction": result.bubble_fraction,
        "busy": result.busy,
        "peak_stash": result.peak_stash,
        "peak_parked": result.peak_parked,
        "transfer_busy": result.transfer_busy,
    }


_HATCH = {Op.F: None, Op.B: "///", Op.BI: "\\\\\\", Op.BW: "xxx"}
_LIGHTEN = {Op.F: 0.0, Op.B: 0.45, Op.BI: 0.45, Op.BW: 0.65}
_TRANSFER_COLOUR = {Op.OFFLOAD: "#444444", Op.RELOAD: "#999999", Op.EVICT: "#7a3b00", Op.LOAD: "#d9a066"}
_HOSTING_MARKER = {Op.ACCEPT: "v", Op.RETURN: "^"}  # where the acceptor posts its side of a peer transfer
_HOSTING_COLOUR = {Op.ACCEPT: _TRANSFER_COLOUR[Op.EVICT], Op.RETURN: _TRANSFER_COLOUR[Op.LOAD]}


Executed = list[list[tuple[Action, float, float]]]
"""Per pipeline rank, the (action, start, end) a real run executed, seconds from the trace's first slice."""


def read_trace(path: str, schedule: Schedule) -> Executed:
    """The compute and transfer slices of a training trace, by rank, checked against `schedule`'s lists:
    a rank count or an action the lists do not hold means the run used another schedule (UsageError)."""
    try:
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        slices = [(int(e["pid"]), str(e["name"]), float(e["ts"]) / 1e6, float(e["dur"]) / 1e6)
                  for e in events if e.get("ph") == "X"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UsageError(f"--trace-file {path}: not a trace written by --trace-file ({err})") from None
    ranks = 1 + max((pid for pid, *_ in slices), default=-1)
    if ranks != schedule.num_ranks:
        raise UsageError(f"--trace-file {path} has {ranks} ranks, the schedule {schedule.num_ranks}: draw the trace "
                         f"of a run with pipeline parallelism only, under the schedule it ran")
    planned = [{str(a) for a in acts} for acts in schedule.actions]
    executed: Executed = [[] for _ in range(ranks)]
    for pid, name, start, duration in slices:
        if " " in name:  # a batch of sends and receives, or the wait nested in an action's slice
            continue
        action = Action.parse(name)
        if not (action.is_compute or action.op in TRANSFER_OPS):
            continue
        if str(replace(action, version=None)) not in planned[pid] and name not in planned[pid]:
            raise UsageError(f"--trace-file {path}: rank {pid} ran {name}, which is not in its list of "
                             f"{schedule.name}: draw the schedule and options the run used")
        executed[pid].append((action, start, start + duration))
    return executed


def draw(schedule: Schedule, result: SimResult, path: str, executed: Optional[Executed] = None) -> None:
    """Write the timeline and stash curves of `result` as a PNG (and, given `executed`, a real run's
    timeline of the same lists between them, on its own time axis)."""
    # Imported here so that bad command lines fail fast without loading matplotlib.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    p, m = schedule.num_ranks, schedule.num_microbatches
    span = result.makespan if result.makespan > 0 else 1.0
    width = min(30.0, max(9.0, 0.32 * span + 2.5))
    rows = [max(p, 2), max(p, 2), 2.2] if executed is not None else [max(p, 2), 2.2]
    fig, axes = plt.subplots(len(rows), 1, figsize=(width, 1.6 + 0.55 * p * (len(rows) - 1) + 2.4),
                             gridspec_kw={"height_ratios": rows})
    ax_time, ax_mem = axes[0], axes[-1]
    ax_mem.sharex(ax_time)
    palette = plt.get_cmap("tab10" if m <= 10 else "tab20")
    colours_of: dict[tuple[Op, int], tuple[float, ...]] = {}

    def colour(op: Op, microbatch: int) -> tuple[float, ...]:
        key = (op, microbatch % palette.N)
        if key not in colours_of:
            base = to_rgb(palette(key[1]))
            colours_of[key] = tuple(c + (1.0 - c) * _LIGHTEN[op] for c in base)
        return colours_of[key]

    fig.canvas.draw()  # fixes the axes geometry so label widths can be measured in pixels
    px_per_unit = ax_time.get_window_extent().width / span
    # Outlines and hatching only where a forward is wide enough to show them: at cluster scale a bar is a
    # pixel or two, an outline would paint it black and hatching costs most of the drawing time.
    detailed = _narrowest_bar(result) * px_per_unit >= 6
    seen_ops: set[Op] = set()
    seen_transfers: set[Op] = set()
    _draw_timeline(ax_time, result.timeline, colour, px_per_unit, detailed, seen_ops, seen_transfers)
    ax_time.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax_time.set_ylim(p - 0.4 if seen_transfers else p - 0.5, -0.5)
    ax_time.set_xlim(0, span)
    ax_time.legend(handles=[Patch(facecolor=colour(op, 0), edgecolor="black", hatch=_HATCH[op], label=op.value)
                            for op in (Op.F, Op.B, Op.BI, Op.BW) if op in seen_ops]
                   + [Patch(facecolor=_TRANSFER_COLOUR[op], label=f"{op.value} (copy lane)")
                      for op in (Op.OFFLOAD, Op.RELOAD, Op.EVICT, Op.LOAD) if op in seen_transfers]
                   + [Line2D([], [], marker=_HOSTING_MARKER[op], linestyle="none", markersize=5,
                             color=_HOSTING_COLOUR[op], label=f"{op.value} (acceptor posts)")
                      for op in (Op.ACCEPT, Op.RETURN) if op in seen_transfers],
                   loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title="colour = microbatch",
                   title_fontsize=7)
    options = ", ".join(f"{k}={v}" for k, v in schedule.options.items())
    ax_time.set_title(f"{schedule.name}: p={p}, m={m}, v={schedule.num_chunks}{', ' + options if options else ''}"
                      f" | makespan {result.makespan:g}, bubble {result.bubble_fraction:.1%}", fontsize=10)
    if executed is not None:
        _draw_executed(axes[1], executed, colour, p, seen_transfers)

    for rank, curve in enumerate(result.memory):
        times, levels = _step_points(curve, span)
        parked = f", {result.peak_parked[rank]} parked" if result.peak_parked and result.peak_parked[rank] else ""
        ax_mem.step(times, levels, where="post", label=f"rank {rank} (peak {result.peak_stash[rank]}{parked})")
    ax_mem.set_ylabel("resident stashes")
    ax_mem.set_xlabel("time (cost-model units; default F = 1, B = 2 per chunk)")
    ax_mem.set_ylim(bottom=0)
    ax_mem.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax_mem.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _draw_timeline(ax, timeline, colour, px_per_unit: float, detailed: bool, seen_ops: set, seen_transfers: set,
                   font: int = 7) -> None:
    """Bars of every rank's (action, start, end) on `ax`, one row per rank, labelled where they fit."""
    # One collection per rank and kind of bar, not one artist per bar: at p = 32, v = 4, m = 256 that is
    # a few hundred collections instead of 65,536 artists (each broken_barh call also rescales the axes).
    for rank, entries in enumerate(timeline):
        bars: dict[Op, tuple[list, list]] = {}
        posts: dict[Op, list[float]] = {}
        for action, start, end in entries:
            if action.op in HOSTING_OPS:  # a BPipe acceptor posting its side of a transfer: a marker
                posts.setdefault(action.op, []).append(start)
                continue
            if end <= start or not (action.is_compute or action.op in TRANSFER_OPS):
                continue
            spans, colours = bars.setdefault(action.op, ([], []))
            spans.append((start, end - start))
            if action.op in TRANSFER_OPS:
                colours.append(_TRANSFER_COLOUR[action.op])
                continue
            colours.append(colour(action.op, action.microbatch))
            label = str(action)
            if (end - start) * px_per_unit > 0.62 * font * len(label) + 4:
                ax.text((start + end) / 2, rank, label, ha="center", va="center", fontsize=font,
                        bbox={"facecolor": "white", "alpha": 0.6, "pad": 0.4, "linewidth": 0}
                        if action.op is not Op.F else None)
        for op, (spans, colours) in bars.items():
            if op in TRANSFER_OPS:  # the copy lane: thin bars under the rank's compute row
                seen_transfers.add(op)
                ax.broken_barh(spans, (rank + 0.42, 0.12), facecolors=colours, linewidth=0)
            else:
                seen_ops.add(op)
                ax.broken_barh(spans, (rank - 0.4, 0.8), facecolors=colours, edgecolor="black",
                               linewidth=0.4 if detailed else 0, hatch=_HATCH[op] if detailed else None)
        for op, starts in posts.items():
            seen_transfers.add(op)
            ax.plot(starts, [rank + 0.48] * len(starts), marker=_HOSTING_MARKER[op], markersize=4,
                    color=_HOSTING_COLOUR[op], linestyle="none")


def _draw_executed(ax, executed: Executed, colour, p: int, seen_transfers: set) -> None:
    """The real run's timeline in milliseconds, every step of the trace, on the trace's one clock."""
    end = max((e for entries in executed for _, _, e in entries), default=1.0) * 1e3 or 1.0
    ms = [[(a, s * 1e3, e * 1e3) for a, s, e in entries] for entries in executed]
    px_per_ms = ax.get_window_extent().width / end
    narrowest = min((e - s for entries in ms for a, s, e in entries if a.is_compute and e > s), default=1.0)
    _draw_timeline(ax, ms, colour, px_per_ms, narrowest * px_per_ms >= 6, set(), seen_transfers)
    busy = [sum(e - s for a, s, e in entries if a.is_compute) for entries in ms]
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_xlim(0, end)
    ax.set_xlabel("executed (ms, one clock for all ranks)")
    ax.set_title(f"executed: {end:.1f} ms for {_steps(executed)} step(s), compute busy "
                 f"{sum(busy) / (p * end):.1%}", fontsize=10)


def _steps(executed: Executed) -> int:
    firsts = [a for a, _, _ in executed[0] if a.is_compute]
    return max(1, sum(1 for a in firsts if str(a) == str(firsts[0]))) if firsts else 0


def _narrowest_bar(result: SimResult) -> float:
    """The shortest compute action's duration (cost units): the narrowest bar the timeline draws."""
    return min((end - start for entries in result.timeline for action, start, end in entries
                if action.is_compute and end > start), default=1.0)


def _step_points(curve: list[tuple[float, int]], span: float) -> tuple[list[float], list[int]]:
    # Several changes at one time (a B ending as the next F starts): draw only the level after all of them.
    level_at = dict(curve)
    return list(level_at) + [span], list(level_at.values()) + [curve[-1][1]]


def draw_comparison(runs: list[tuple[Schedule, SimResult]], path: str) -> None:
    """Stash curves of several schedules side by side, one panel each, on one y scale (rank 0 bold), and a
    last panel with every rank's peak under each schedule (how balanced the memory is)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = max(max(result.peak_stash) for _, result in runs)
    base = runs[0][1].peak_stash[0]
    fig, axes = plt.subplots(1, len(runs) + 1, figsize=(3.4 * (len(runs) + 1) + 1.0, 3.6), sharey=True,
                             squeeze=False)
    for ax, (schedule, result) in zip(axes[0], runs):
        span = result.makespan if result.makespan > 0 else 1.0
        for rank, curve in enumerate(result.memory):
            times, levels = _step_points(curve, span)
            ax.step(times, levels, where="post", linewidth=2.2 if rank == 0 else 0.9,
                    label=f"rank {rank}: {result.peak_stash[rank]}")
        share = f" = {result.peak_stash[0] / base:.0%} of {runs[0][0].name}" if schedule is not runs[0][0] else ""
        ax.set_title(f"{schedule.name}: rank 0 peak {result.peak_stash[0]}{share}\nmakespan {result.makespan:g}, "
                     f"bubble {result.bubble_fraction:.1%}", fontsize=9)
        ax.set_xlabel("time (F = 1 per chunk)")
        ax.set_ylim(0, top + 1)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    bars = axes[0][-1]
    width = 0.8 / len(runs)
    for k, (schedule, result) in enumerate(runs):
        ranks = range(len(result.peak_stash))
        bars.bar([r - 0.4 + width * (k + 0.5) for r in ranks], result.peak_stash, width, label=schedule.name)
    bars.set_title("peak per rank", fontsize=9)
    bars.set_xlabel("rank")
    bars.set_xticks(range(runs[0][0].num_ranks))
    bars.grid(True, axis="y", alpha=0.3)
    bars.legend(fontsize=7, loc="upper right")
    axes[0][0].set_ylabel("resident chunk stashes")
    s0 = runs[0][0]
    fig.suptitle(f"p={s0.num_ranks}, m={s0.num_microbatches}, v={s0.num_chunks}: device-resident stashes per rank",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
