"""Draw a registered pipeline schedule: the simulated timeline of every rank and its stash curve.

    python tools/plot_schedule.py --schedule interleaved-1f1b --pp 4 --microbatches 8 --chunks 2 \\
        --out docs/img/schedule_interleaved.png --json schedule.json
    python tools/plot_schedule.py --compare interleaved-1f1b,gis,gis-h,po-h,po-f --pp 4 --microbatches 8 \\
        --chunks 4 --out docs/img/pipeoffload_memory.png
    python tools/plot_schedule.py --compare 1f1b,bpipe --pp 8 --microbatches 16 --out docs/img/bpipe_memory.png

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
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

# Runnable as `python tools/plot_schedule.py` from a checkout without installing the package.
_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from megatron_pp.cli import OneLineArgumentParser, UsageError, write_json  # noqa: E402
from megatron_pp.schedules.ir import HOSTING_OPS, TRANSFER_OPS, Op, Schedule  # noqa: E402
from megatron_pp.schedules.plugins import add_plugin_flag, load_plugins  # noqa: E402
from megatron_pp.schedules.registry import (build_schedule, get_schedule, registered_schedules,  # noqa: E402
                                           schedule_options)
from megatron_pp.schedules.schedule_file import (FILE_SCHEDULE_OPTIONS, build_schedule_from_file,  # noqa: E402
                                                 schedule_to_json)
from megatron_pp.schedules.simulate import DEFAULT_TRANSFER, CostModel, SimResult, simulate  # noqa: E402

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
            schedule = build_schedule(name, args.pp, args.microbatches, args.chunks or 1, **opts)
            runs.append((schedule, simulate(schedule, costs)))
        if args.out is not None:
            if args.compare is None:
                draw(*runs[0], args.out)
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


def draw(schedule: Schedule, result: SimResult, path: str) -> None:
    """Write the timeline and stash curves of `result` as a PNG."""
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
    fig, (ax_time, ax_mem) = plt.subplots(
        2, 1, figsize=(width, 1.6 + 0.55 * p + 2.4), sharex=True,
        gridspec_kw={"height_ratios": [max(p, 2), 2.2]})
    palette = plt.get_cmap("tab10" if m <= 10 else "tab20")

    def colour(op: Op, microbatch: int) -> tuple[float, float, float]:
        base = to_rgb(palette(microbatch % palette.N))
        mix = _LIGHTEN[op]
        return tuple(c + (1.0 - c) * mix for c in base)

    fig.canvas.draw()  # fixes the axes geometry so label widths can be measured in pixels
    px_per_unit = ax_time.get_window_extent().width / span
    font = 7
    seen_ops: set[Op] = set()
    seen_transfers: set[Op] = set()
    for rank, entries in enumerate(result.timeline):
        for action, start, end in entries:
            if action.op in HOSTING_OPS:
                # The acceptor's post of its side of a BPipe transfer: a marker on its copy lane.
                seen_transfers.add(action.op)
                ax_time.plot([start], [rank + 0.48], marker=_HOSTING_MARKER[action.op], markersize=4,
                             color=_TRANSFER_COLOUR[Op.EVICT if action.op is Op.ACCEPT else Op.LOAD], linestyle="none")
                continue
            if action.op in TRANSFER_OPS and end > start:
                # The copy lane: a thin bar under the rank's compute row.
                seen_transfers.add(action.op)
                ax_time.broken_barh([(start, end - start)], (rank + 0.42, 0.12),
                                    facecolors=[_TRANSFER_COLOUR[action.op]], linewidth=0)
                continue
            if not action.is_compute or end <= start:
                continue
            seen_ops.add(action.op)
            ax_time.broken_barh([(start, end - start)], (rank - 0.4, 0.8),
                                facecolors=[colour(action.op, action.microbatch)], edgecolor="black",
                                linewidth=0.4, hatch=_HATCH[action.op])
            label = str(action)
            if (end - start) * px_per_unit > 0.62 * font * len(label) + 4:
                ax_time.text((start + end) / 2, rank, label, ha="center", va="center", fontsize=font,
                             bbox={"facecolor": "white", "alpha": 0.6, "pad": 0.4, "linewidth": 0}
                             if action.op is not Op.F else None)
    ax_time.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax_time.set_ylim(p - 0.4 if seen_transfers else p - 0.5, -0.5)
    ax_time.set_xlim(0, span)
    ax_time.legend(handles=[Patch(facecolor=colour(op, 0), edgecolor="black", hatch=_HATCH[op], label=op.value)
                            for op in (Op.F, Op.B, Op.BI, Op.BW) if op in seen_ops]
                   + [Patch(facecolor=_TRANSFER_COLOUR[op], label=f"{op.value} (copy lane)")
                      for op in (Op.OFFLOAD, Op.RELOAD, Op.EVICT, Op.LOAD) if op in seen_transfers]
                   + [Line2D([], [], marker=_HOSTING_MARKER[op], linestyle="none", markersize=5,
                             color=_TRANSFER_COLOUR[Op.EVICT if op is Op.ACCEPT else Op.LOAD],
                             label=f"{op.value} (acceptor posts)") for op in (Op.ACCEPT, Op.RETURN)
                      if op in seen_transfers],
                   loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title="colour = microbatch",
                   title_fontsize=7)
    options = ", ".join(f"{k}={v}" for k, v in schedule.options.items())
    ax_time.set_title(f"{schedule.name}: p={p}, m={m}, v={schedule.num_chunks}{', ' + options if options else ''}"
                      f" | makespan {result.makespan:g}, bubble {result.bubble_fraction:.1%}", fontsize=10)

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
