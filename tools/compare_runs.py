"""Compare training runs from their `--metrics-file` JSONL files, wandb run directories or TensorBoard directories.

    python tools/compare_runs.py runs/a.jsonl runs/b.jsonl --labels 1f1b interleaved --plot runs/cmp.png
    python tools/compare_runs.py runs/ref.jsonl runs/new.jsonl --assert-equal-loss --rtol 1e-5 \
        --max-slowdown 0.05

A TensorBoard directory (`--tensorboard-dir` of ours, or of a Megatron-LM run) is read through tensorboard's
event reader: Megatron-LM's scalar names (`lm loss`, `iteration-time`, `learning-rate`, ...) map back to the
row keys (`loss`, `step_time_s`, `lr`, ...; `metrics.MEGATRON_TENSORBOARD_NAMES`), `peak_stash_bytes/ppK`
back to a list, and the `... vs samples` copies are skipped, so a Megatron-LM run and ours compare
directly (a Megatron-LM run has no tokens/s or peak stash: those columns are then NaN or empty).

Training rows (those with `loss`) are aligned by iteration; the first run is the reference. Prints a
table of medians (step time, tokens/s, peak stash per pipeline rank) and ratios to the reference, the
largest relative loss difference over the common iterations, and optionally draws loss and throughput
curves. Assertion mode exits 1 with one line per failed check, so it can gate CI:
`--assert-equal-loss` (every common iteration's loss within `--rtol` of the reference) and
`--max-slowdown F` (median step time at most (1 + F) x the reference's). Warm-up iterations
(`--skip-warmup N`, default 1) are left out of the timing medians.
"""
from __future__ import annotations

import argparse
import json
import os
import glob
import math
import re
import statistics
import sys
from dataclasses import dataclass, field
from typing import Optional, Sequence

# Runnable as `python tools/compare_runs.py` from a checkout without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_pp.training.metrics import MEGATRON_TENSORBOARD_NAMES  # noqa: E402


class RunError(ValueError):
    """A run file that cannot be read; the message names the file."""


@dataclass
class Run:
    label: str
    path: str
    rows: dict[int, dict] = field(default_factory=dict)  # iteration -> training row

    def values(self, key: str, skip: int = 0) -> list:
        return [r[key] for it, r in sorted(self.rows.items()) if key in r and it > skip]


def _metrics_path(path: str) -> str:
    """A JSONL file, or a wandb offline run directory's `files/metrics.jsonl` written by our logger."""
    if os.path.isdir(path):
        for candidate in ("metrics.jsonl", os.path.join("files", "metrics.jsonl")):
            full = os.path.join(path, candidate)
            if os.path.isfile(full):
                return full
        raise RunError(f"{path}: directory holds no metrics.jsonl and no TensorBoard events (expected a "
                       f"--metrics-file, a wandb run dir or a --tensorboard-dir)")
    if not os.path.isfile(path):
        raise RunError(f"{path}: no such file")
    return path


_ROW_KEY = {name: key for key, name in MEGATRON_TENSORBOARD_NAMES.items()}
_PER_RANK = re.compile(r"(.+)/pp(\d+)$")


def tensorboard_rows(directory: str) -> dict[int, dict]:
    """Rows by iteration from the scalars of a TensorBoard directory (ours or Megatron-LM's names)."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator
    except ImportError:
        raise RunError(f"{directory}: reading TensorBoard events needs the tensorboard package "
                       f"(pip install tensorboard)") from None
    events = EventAccumulator(directory, size_guidance={SCALARS: 0})  # 0: keep every point
    try:
        events.Reload()
    except Exception as exc:  # a damaged event file: the reader raises its own types
        raise RunError(f"{directory}: cannot read TensorBoard events ({exc})") from None
    rows: dict[int, dict] = {}
    per_rank: dict[int, dict[str, dict[int, float]]] = {}
    for tag in events.Tags().get("scalars", []):
        if tag.endswith(" vs samples"):
            continue
        key = _ROW_KEY.get(tag, tag)
        match = _PER_RANK.fullmatch(key)
        for event in events.Scalars(tag):
            if match:
                per_rank.setdefault(event.step, {}).setdefault(match[1], {})[int(match[2])] = event.value
            else:
                rows.setdefault(event.step, {"iteration": event.step})[key] = event.value
    for step, lists in per_rank.items():
        for key, by_rank in lists.items():
            rows.setdefault(step, {"iteration": step})[key] = [by_rank.get(k, math.nan)
                                                               for k in range(max(by_rank) + 1)]
    return rows


def load_run(path: str, label: Optional[str] = None) -> Run:
    run = Run(label or os.path.basename(os.path.normpath(path)), path)
    if os.path.isdir(path) and glob.glob(os.path.join(path, "events.out.tfevents.*")):
        run.rows = {it: row for it, row in tensorboard_rows(path).items() if "loss" in row}
        if not run.rows:
            raise RunError(f"{path}: no training loss in its TensorBoard events (expected 'lm loss' or 'loss')")
        return run
    source = _metrics_path(path)
    with open(source) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RunError(f"{source}:{lineno}: not JSON ({exc.msg})") from None
            if "loss" in row and "iteration" in row:  # training rows only; eval rows have eval_loss
                run.rows[int(row["iteration"])] = row
    if not run.rows:
        raise RunError(f"{source}: no training rows (objects with 'iteration' and 'loss')")
    return run


def max_loss_diff(reference: Run, other: Run) -> tuple[float, Optional[int]]:
    """Largest relative loss difference over the common iterations, and where it occurs."""
    worst, where = 0.0, None
    for it in sorted(set(reference.rows) & set(other.rows)):
        ref, val = reference.rows[it]["loss"], other.rows[it]["loss"]
        diff = abs(val - ref) / max(abs(ref), 1e-30)
        if where is None or diff > worst:
            worst, where = diff, it
    return worst, where


def summarise(runs: Sequence[Run], skip_warmup: int) -> list[dict]:
    ref = runs[0]
    ref_step = statistics.median(ref.values("step_time_s", skip_warmup) or ref.values("step_time_s"))
    table = []
    for run in runs:
        steps = run.values("step_time_s", skip_warmup) or run.values("step_time_s")
        tokens = run.values("tokens_per_s", skip_warmup) or run.values("tokens_per_s")
        peaks = run.values("peak_stash_bytes")
        step = statistics.median(steps) if steps else float("nan")
        diff, at = max_loss_diff(ref, run)
        table.append({
            "label": run.label,
            "iterations": len(run.rows),
            "final_loss": run.rows[max(run.rows)]["loss"],
            "step_time_s_median": step,
            "step_time_ratio": step / ref_step if ref_step else float("nan"),
            "tokens_per_s_median": statistics.median(tokens) if tokens else float("nan"),
            "peak_stash_mb": [round(max(p[k] for p in peaks) / 2**20, 2) for k in range(len(peaks[0]))] if peaks else [],
            "max_rel_loss_diff": diff,
            "max_rel_loss_diff_at": at,
            "common_iterations": len(set(ref.rows) & set(run.rows)),
        })
    return table


def format_table(table: list[dict]) -> str:
    head = f"{'run':<20} {'iters':>5} {'final loss':>11} {'step s':>9} {'ratio':>6} {'tokens/s':>10} {'max rel dloss':>14}  peak stash MB/pp rank"
    lines = [head, "-" * len(head)]
    for r in table:
        lines.append(
            f"{r['label'][:20]:<20} {r['iterations']:>5} {r['final_loss']:>11.6f} {r['step_time_s_median']:>9.4f} "
            f"{r['step_time_ratio']:>6.3f} {r['tokens_per_s_median']:>10.0f} {r['max_rel_loss_diff']:>14.3e}  {r['peak_stash_mb']}"
        )
    return "\n".join(lines)


def check(table: list[dict], runs: Sequence[Run], rtol: Optional[float], max_slowdown: Optional[float]) -> list[str]:
    failures = []
    for r in table[1:]:
        if rtol is not None:
            if r["common_iterations"] == 0:
                failures.append(f"{r['label']}: no iterations in common with {table[0]['label']}")
            elif r["max_rel_loss_diff"] > rtol:
                failures.append(f"{r['label']}: loss differs from {table[0]['label']} by {r['max_rel_loss_diff']:.3e} "
                                f"(relative) at iteration {r['max_rel_loss_diff_at']}, above --rtol {rtol:g}")
        if max_slowdown is not None and r["step_time_ratio"] > 1 + max_slowdown:
            failures.append(f"{r['label']}: median step time {r['step_time_ratio']:.3f}x {table[0]['label']}'s, "
                            f"above --max-slowdown {max_slowdown:g}")
    return failures


def plot(runs: Sequence[Run], out: str, skip_warmup: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_tps) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        its = sorted(run.rows)
        ax_loss.plot(its, [run.rows[i]["loss"] for i in its], label=run.label)
        tp = [(i, run.rows[i]["tokens_per_s"]) for i in its if i > skip_warmup and "tokens_per_s" in run.rows[i]]
        if tp:
            ax_tps.plot(*zip(*tp), label=run.label)
    ax_loss.set(xlabel="iteration", ylabel="loss", title="training loss")
    ax_tps.set(xlabel="iteration", ylabel="tokens/s", title="throughput")
    for ax in (ax_loss, ax_tps):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    tmp = out + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="--metrics-file JSONL files, wandb run directories or TensorBoard "
                                               "directories (ours or Megatron-LM's)")
    parser.add_argument("--labels", nargs="+", default=None)
    parser.add_argument("--assert-equal-loss", action="store_true")
    parser.add_argument("--rtol", type=float, default=1e-5)
    parser.add_argument("--max-slowdown", type=float, default=None)
    parser.add_argument("--skip-warmup", type=int, default=1)
    parser.add_argument("--plot", default=None, help="write a PNG of loss and throughput curves")
    parser.add_argument("--json", default=None, help="write the summary table as JSON")
    args = parser.parse_args(argv)
    if len(args.runs) < 2:
        print("error: give at least two runs to compare", file=sys.stderr)
        return 2
    if args.labels is not None and len(args.labels) != len(args.runs):
        print(f"error: --labels has {len(args.labels)} names for {len(args.runs)} runs", file=sys.stderr)
        return 2
    try:
        runs = [load_run(p, l) for p, l in zip(args.runs, args.labels or [None] * len(args.runs))]
    except RunError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    table = summarise(runs, args.skip_warmup)
    print(format_table(table))
    if args.json:
        with open(args.json + ".tmp", "w") as f:
            json.dump(table, f, indent=2)
        os.replace(args.json + ".tmp", args.json)
    if args.plot:
        plot(runs, args.plot, args.skip_warmup)
    failures = check(table, runs, args.rtol if args.assert_equal_loss else None, args.max_slowdown)
    for line in failures:
        print(f"FAIL: {line}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
