"""The dry-run figure beside a paper reproduction's memory cells (issue 33, item 6).

A memory cell of the BPipe and PipeOffload tables is the planner's prediction for one variant of a paper
config. Beside it the page shows what the dry run (docs/dry_run.md: the job's own code on fake tensors)
counted for the very same job: the config variant's flags, plus what the cell chose that the flags leave
open (BPipe's resident bound K), run as the planner's worst pipeline rank (tensor rank 0, data rank 0) with
the paper's microbatch count. The dry run's per-rank rows are committed as
`docs/results/repro_dry_run_<key>.json` by `python tools/reproduce.py PAPER --dry-run-cells`; the cell text
is read from that JSON, so `tools/reproduce.py --check` fails when a JSON and the page disagree, and a JSON
whose flags are no longer the cell's job reads as stale instead of as a figure.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Optional, Sequence

import yaml

from megatron_pp.planning.papers.common import CONFIG_DIR, GB, GIB, ROOT, _flags

RESULTS = os.path.join(ROOT, "docs", "results")
KEEP = ("rank", "pipeline_rank", "tensor_rank", "data_rank", "parameter_bytes", "gradient_bytes", "optimizer_bytes",
        "stash_peak_bytes", "transient_peak_bytes", "peak_bytes", "peak_at", "host_peak_bytes", "guest_peak_bytes")
"""The per-rank fields of the dry run's JSON that a committed cell keeps (no timings: they are not the cell's)."""

UNITS = {"GiB": GIB, "GB": GB}


@dataclass(frozen=True)
class DryRunCell:
    """A memory cell that shows the dry run: `variant` of launch/configs/`config`.yaml with `sets` (YAML keys),
    compared on `figure`, the dry run's per-rank field the cell's number is (peak_bytes: the worst stage's
    total; stash_peak_bytes: the activation), in `unit`."""

    key: str
    config: str
    variant: str
    figure: str
    unit: str
    sets: tuple[tuple[str, object], ...] = ()

    @property
    def path(self) -> str:
        return os.path.join(RESULTS, f"repro_dry_run_{self.key}.json")


CELLS: dict[str, tuple[DryRunCell, ...]] = {
    "bpipe": tuple(DryRunCell(f"bpipe_gpt3_96b_{v.replace('-', '_')}", "bpipe_gpt3_96b", v, "peak_bytes", "GiB")
                   for v in ("1f1b", "bpipe", "bpipe-mb2")),
    "pipeoffload": tuple(DryRunCell(f"pipeoffload_10.5b_s4k_{v.replace('-', '_')}", "pipeoffload_10.5b", v,
                                    "stash_peak_bytes", "GB", (("seq-length", 4096),)) for v in ("1f1b-i", "gis-h")),
}


def find_cell(paper: str, config: str, variant: str, sets: dict) -> Optional[DryRunCell]:
    for cell in CELLS.get(paper, ()):
        if (cell.config, cell.variant, dict(cell.sets)) == (config, variant, sets):
            return cell
    return None


@dataclass
class CellJob:
    """One cell's job as the planner predicted it: the flags the dry run must run, the world, the planner's
    worst pipeline rank and its figure per pipeline rank (bytes)."""

    cell: DryRunCell
    flags: list[str]
    world: int
    tp: int
    dp: int
    planner_rank: int
    planner_bytes: list[float] = field(default_factory=list)

    @property
    def global_rank(self) -> int:
        """Tensor rank 0, data rank 0 of the planner's worst pipeline rank (parallel_state's layout)."""
        return self.tp * self.dp * self.planner_rank


def job_flags(cell: DryRunCell, extra: Optional[dict] = None) -> tuple[list[str], int]:
    """The flags of `cell`'s job (the config variant's, its `sets`, `extra`; two iterations: the dry run needs
    two steps, memory does not depend on the count) and its world size."""
    with open(os.path.join(CONFIG_DIR, cell.config + ".yaml")) as f:
        raw = yaml.safe_load(f)
    values = {**raw["args"], **(raw["variants"][cell.variant] or {}), **dict(cell.sets), **(extra or {})}
    if "seq-length" in dict(cell.sets):
        values["max-position-embeddings"] = values["seq-length"]
    values["train-iters"] = 2
    world = int(raw["cluster"]["nodes"]) * int(raw["cluster"]["gpus_per_node"])
    return _flags(values), world


def dry_run_text(record: Optional[dict], job: CellJob) -> str:
    """What the cell says of the dry run in `record` (a repro_dry_run JSON, None when there is none):
    'dry run X UNIT (planner/dry run R)' for the planner's worst rank, or why there is no figure."""
    cell = job.cell
    unit = UNITS[cell.unit]
    if record is None:
        return f"dry run: none recorded (python tools/reproduce.py {_paper(cell)} --dry-run-cells {cell.key})"
    if record.get("flags") != job.flags or record.get("world") != job.world:
        return "dry run: stale, its JSON ran other flags than this cell's job"
    rows = {row["pipeline_rank"]: row for row in record.get("ranks", ())
            if row.get("tensor_rank") == 0 and row.get("data_rank") == 0}
    row = rows.get(job.planner_rank)
    if row is None:
        return f"dry run: pipeline rank {job.planner_rank} (the planner's worst) not in its JSON"
    measured = row[cell.figure]
    planner = job.planner_bytes[job.planner_rank]
    text = f"dry run {measured / unit:.1f} {cell.unit} (planner/dry run {planner / measured:.3f})"
    worst = max(rows.values(), key=lambda r: r[cell.figure])
    if worst[cell.figure] > measured:
        text += (f"; the dry run's worst of the ranks it ran is pipeline rank {worst['pipeline_rank']}, "
                 f"{worst[cell.figure] / unit:.1f} {cell.unit}")
    return text


def _paper(cell: DryRunCell) -> str:
    return next((paper for paper, cells in CELLS.items() if cell in cells), "PAPER")


def load_record(cell: DryRunCell) -> Optional[dict]:
    if not os.path.exists(cell.path):
        return None
    with open(cell.path) as f:
        return json.load(f)


def cell_text(job: CellJob) -> str:
    return dry_run_text(load_record(job.cell), job)


def script_of(cell: DryRunCell) -> str:
    with open(os.path.join(CONFIG_DIR, cell.config + ".yaml")) as f:
        return yaml.safe_load(f)["script"]


def run_dry_run(job: CellJob, extra_ranks: Sequence[int] = ()) -> dict:
    """Dry-run `job` (the planner's worst rank, plus the pipeline ranks `extra_ranks`) in a child process,
    one worker, and return the record a repro_dry_run JSON holds."""
    ranks = [job.global_rank] + [job.tp * job.dp * r for r in extra_ranks if r != job.planner_rank]
    script = script_of(job.cell)
    argv = [script, *job.flags, "--dry-run", str(job.world), "--dry-run-ranks", ",".join(map(str, ranks)),
            "--dry-run-jobs", "1"]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "dry_run.json")
        subprocess.run([sys.executable, *argv, "--dry-run-json", out], cwd=ROOT, check=True)
        with open(out) as f:
            raw = json.load(f)
    rows = raw["ranks"] if isinstance(raw, dict) else raw
    return {
        "command": f"python tools/reproduce.py {_paper(job.cell)} --dry-run-cells {job.cell.key}"
                   + (f" --dry-run-extra-ranks {','.join(map(str, extra_ranks))}" if extra_ranks else ""),
        "dry_run_command": "python " + " ".join(argv),
        "config": job.cell.config, "variant": job.cell.variant, "sets": dict(job.cell.sets),
        "flags": job.flags, "world": job.world, "figure": job.cell.figure,
        "planner": {"worst_pipeline_rank": job.planner_rank, "bytes_per_pipeline_rank": job.planner_bytes},
        "ranks": [{k: row[k] for k in KEEP if k in row} for row in rows],
    }


def write_record(job: CellJob, record: dict) -> None:
    with open(job.cell.path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    os.replace(job.cell.path + ".tmp", job.cell.path)
