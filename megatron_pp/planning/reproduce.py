"""The paper reproduction table: each seed paper's headline experiment predicted at full scale, and the
trend it claims measured at small scale on CPU next to the simulator's prediction for the same setting.

**Full scale.** A paper's model and layout come from its config in `launch/configs/` (the flags a cluster
run would get), its GPU from `launch/hardware/*.yaml`. Per-layer times are the layer's kernels
(`planning.efficiency.kernels`: FLOPs and bytes) on that GPU with the profile's achieved matmul
efficiency, i.e. `max(FLOPs / (peak · efficiency), bytes / HBM bandwidth)` per kernel. Where a paper
publishes an absolute figure for its *baseline* method (PipeOffload: 1F1B-I's MFU), compute time is
scaled by one factor per (model, sequence length) so the baseline's predicted MFU equals the published
one; every other method is then predicted with that factor, never fitted. Where it publishes only ratios
(BPipe, 2BW, breadth-first) the profile's efficiency is used as is. Step times come from the schedule
simulator (`schedules.simulate`) replaying the very lists `--pipeline-schedule NAME` runs; memory comes
from `planning.memory` (saved activations per stage, weights, gradients, optimizer state) and the
simulated stash curves. Each row prints the prediction next to the published figure with the relative
error `(predicted − published) / published`; a published range counts as error 0 inside it and as the
distance to its nearer end outside. Where no number is taken from the paper the row says so.

**Small scale.** A tiny GPT runs with the real executor on a local gloo world (`core.local_world`), one
training step per schedule; the executor's `ActivationStore` reports each rank's peak of resident stash
bytes. The prediction for the same setting is the simulator's stash curve weighed with
`planning.memory.stash_bytes` in the CPU fp32 profile. Timing trends (bubble against v) use the
executor's trace: busy = compute time minus receive waits, bubble = 1 − busy / step time. 2BW runs
through the real training loop (`training.train.pretrain`, which owns 2BW's delayed-update optimizer).
Worked example (pp 4, m 8, BPipe with K = 2, 8-layer GPT of h 64 and s 32 in fp32): the executor measures
778 / 774 / 772 / 819 KiB of peak stash on ranks 0-3, the simulator predicts 776 / 774 / 774 / 824 KiB;
1F1B measures and predicts 1034 / 774 / 516 / 307 KiB.

One module per paper under `planning/papers/` (its full-scale rows and its small-scale trends), the shared
rows, profiles and configs in `papers/common.py`, the small-scale harness in `papers/small.py`; this module
dispatches. `tools/reproduce.py PAPER` prints the tables; docs/reproduction.md holds them with the discussion.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

from megatron_pp.planning.papers import bpipe, breadth_first, layered, pipeoffload, twobw
from megatron_pp.planning.papers.common import ROOT, ROWS_HEADER, PaperReport
from megatron_pp.planning.papers.small import SmallScale

PAPERS = ("bpipe", "bpipe-reeval", "pipeoffload", "2bw", "breadth-first", "layered")
PREDICTORS: dict[str, Callable[..., PaperReport]] = {
    "bpipe": bpipe.predict_bpipe, "bpipe-reeval": bpipe.predict_bpipe_reeval,
    "pipeoffload": pipeoffload.predict_pipeoffload, "2bw": twobw.predict_2bw,
    "breadth-first": breadth_first.predict_breadth_first, "layered": layered.predict_layered,
}
SMALL_SCALE: dict[str, Callable[..., None]] = {
    "bpipe": bpipe.small_scale_bpipe, "bpipe-reeval": bpipe.small_scale_bpipe_reeval,
    "pipeoffload": pipeoffload.small_scale_pipeoffload, "2bw": twobw.small_scale_2bw,
    "breadth-first": breadth_first.small_scale_breadth_first, "layered": layered.small_scale_layered,
}


def reproduce(paper: str, *, quick: bool = False, small: Optional[SmallScale] = None, measure: bool = True,
              hardware: Optional[str] = None, efficiency_file: Optional[str] = None) -> PaperReport:
    """Full-scale rows (quick: the smallest model/cells only) and, with `measure`, the small-scale trends.
    `hardware` replaces the paper's GPU profile (a launch/hardware name); `efficiency_file` (BPipe and its
    re-evaluation) takes layer times from a tools/bench_layer.py report instead of the roofline."""
    if paper not in PREDICTORS:
        raise ValueError(f"unknown paper {paper!r}; one of {', '.join(PAPERS)}")
    kwargs: dict = {}
    if quick and paper == "bpipe":
        kwargs["models"] = ("96b",)
    if quick and paper == "pipeoffload":
        kwargs["cells"], kwargs["figures"] = [("10.5b", 4096)], (15,)
    if quick and paper == "layered":
        kwargs["quick"] = True  # m = p only: no larger batches, no network rows
    if hardware:
        kwargs["hardware"] = hardware
    if efficiency_file:
        if paper not in ("bpipe", "bpipe-reeval"):
            raise ValueError(f"--efficiency-file applies to bpipe and bpipe-reeval, not {paper}")
        kwargs["efficiency_file"] = efficiency_file
    report = PREDICTORS[paper](**kwargs)
    if measure:
        own = small is None
        small = small or SmallScale()
        try:
            SMALL_SCALE[paper](report, small, quick=quick)
        finally:
            if own:
                small.close()
    return report


DOCUMENT = os.path.join(ROOT, "docs", "reproduction.md")
"""Where the recorded tables live: one `### PAPER: title` section per paper, each with its `Calibration:`
line and its full-scale table exactly as `PaperReport.format` prints them."""


def document_tables(path: str = DOCUMENT) -> dict[str, dict]:
    """Per paper section of `path`: its calibration line and {claim: (published, predicted, error)} of its
    full-scale table. Raises ValueError for a claim that appears twice in one section."""
    sections: dict[str, dict] = {}
    current: Optional[dict] = None
    in_table = False
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if line.startswith("### "):
                paper = line[4:].split(":", 1)[0].strip()
                current = sections.setdefault(paper, {"calibration": None, "rows": {}})
                in_table = False
            elif current is None:
                continue
            elif line.startswith("Calibration: "):
                current["calibration"] = line[len("Calibration: "):]
            elif line == ROWS_HEADER:
                in_table = True
            elif in_table and line.startswith("|"):
                cells = [c.strip() for c in line.strip("|").split(" | ")]
                if set(cells[0]) <= {"-"} or len(cells) != 4:
                    continue
                if cells[0] in current["rows"]:
                    raise ValueError(f"{path}:{number}: claim {cells[0]!r} appears twice in its section")
                current["rows"][cells[0]] = tuple(cells[1:])
            else:
                in_table = False
    return sections


def check_document(report: PaperReport, sections: dict[str, dict], *, complete: bool = True) -> list[str]:
    """One line per cell where the recorded table disagrees with what the code computes now, naming the
    paper, the claim and the column. `complete`: also flag recorded rows the code no longer produces (off
    for a --quick report, which computes a subset of the rows)."""
    where = f"docs/reproduction.md, {report.paper}"
    section = sections.get(report.paper)
    if section is None:
        return [f"{where}: no '### {report.paper}: ...' section"]
    problems = []
    if section["calibration"] != report.calibration:
        problems.append(f"{where}: Calibration line differs; the code says: {report.calibration}")
    computed = {cells[0]: cells[1:] for cells in report.row_cells()}
    for claim, cells in computed.items():
        recorded = section["rows"].get(claim)
        if recorded is None:
            problems.append(f"{where}: row {claim!r} is missing; the code computes | {' | '.join(cells)} |")
            continue
        for column, want, got in zip(("Published", "Predicted", "Error"), cells, recorded):
            if want != got:
                problems.append(f"{where}: row {claim!r}, column {column}: the document says {got!r}, the code "
                                f"computes {want!r}")
    if complete:
        problems += [f"{where}: row {claim!r} is recorded but the code no longer produces it"
                     for claim in section["rows"] if claim not in computed]
    return problems

