"""Schedules from files: torch.distributed.pipelining's compute-only CSV and this project's own JSON form.

`--pipeline-schedule-file FILE` runs an action list that no generator made: one written by hand, exported
from a registered schedule (`tools/plot_schedule.py --export-schedule`) and edited, or produced by torch's
schedule classes (`_dump_csv(path, format="compute_only")`). The file's compute order then goes through
what a registered schedule goes through: the passes the flags ask for (host offload, BPipe), insertion
of the communication, and validation. So torch's orders gain the validator, the simulator, the pictures
and the offload and BPipe passes.

**torch's CSV.** One row per pipeline rank; each cell is `{stage}{F|B|I|W}{microbatch}` with a *global*
stage index (`I` is the input-gradient half of a split backward, `W` the weight-gradient half), an empty
cell is an idle slot, and `(a;b)OVERLAP_F_B` runs a and b together, which here means one after the
other. Communication and FSDP cells (`SEND_F`, `RECV_B`, `UNSHARD`, `RESHARD`, `REDUCE_GRAD`) are skipped:
communication is derived from the compute order. The placement of stages on ranks is read from the rows:
stage s lives on the rank whose row computes it, and its local chunk is its position among that rank's
stages in increasing order (rank 0 of a looped placement with p = 2 holds stages 0 and 2 as chunks 0 and
1; of the V placement, stages 0 and 3). Every rank must hold the same number of stages.

**JSON.** `{"format": "megatron_pp.schedule/1", "name", "num_ranks", "num_microbatches", "num_chunks",
"placement": [[rank, chunk], ...] by global stage, "options": {...}, "actions": [[action text, ...] per
rank]}` with actions in the IR's text form (`F3.1`, `SEND_B3.1>0`, `OFFLOAD3.1`, ...). A list that holds
communication is taken as it is; a compute-only list gets its communication inserted. Passes run on the
compute order, so asking for one strips the file's communication first.

Everything here is torch-free, so the argument checks load and validate a file before any process group
or model exists.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import re
from typing import Optional

from megatron_pp.schedules.comm import insert_communication
from megatron_pp.schedules.ir import COMM_OPS, HOSTING_OPS, Action, Op, Schedule, ScheduleError
from megatron_pp.schedules.validate import validate

JSON_FORMAT = "megatron_pp.schedule/1"
FILE_SCHEDULE_OPTIONS = ("offload_chunks", "offload_fraction", "offload_time", "bpipe_max_resident")
"""The schedule options that apply to a schedule file: the passes that rewrite any compute order."""
_TORCH_CELL = re.compile(r"(\d+)(F|B|I|W)(\d+)")
_TORCH_SKIPPED = re.compile(r"\d+(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)\d*")
_TORCH_OPS = {"F": Op.F, "B": Op.B, "I": Op.BI, "W": Op.BW}


class ScheduleFileError(ValueError):
    """A schedule file that cannot be read or run; the message names the file and the place."""


# Reading ------------------------------------------------------------------------------------------------


def _torch_cells(path: str, text: str) -> list[list[tuple[int, Op, int]]]:
    """Per rank, the (global stage, op, microbatch) of each compute cell, in order."""
    rows = []
    for rank, row in enumerate(csv.reader(io.StringIO(text))):
        cells: list[tuple[int, Op, int]] = []
        for column, raw in enumerate(row):
            cell = raw.strip()
            if not cell or _TORCH_SKIPPED.fullmatch(cell):
                continue
            parts = [cell]
            overlap = re.fullmatch(r"\((.*)\)OVERLAP_F_B", cell)
            if overlap:
                parts = [p.strip() for p in overlap.group(1).split(";") if p.strip()]
            for part in parts:
                match = _TORCH_CELL.fullmatch(part)
                if not match:
                    raise ScheduleFileError(f"{path}: row {rank + 1}, column {column + 1}: cannot read cell {raw!r} "
                                            "(expected e.g. 2F0, 1I3, 0W1, 1B2 or (0F1;1B0)OVERLAP_F_B)")
                stage, op, microbatch = match.groups()
                cells.append((int(stage), _TORCH_OPS[op], int(microbatch)))
        rows.append(cells)
    while rows and not rows[-1]:
        rows.pop()  # a trailing empty line
    if not rows:
        raise ScheduleFileError(f"{path}: no rows: expected one row of actions per pipeline rank")
    return rows


def read_torch_csv(path: str, text: Optional[str] = None) -> Schedule:
    """The compute-only schedule of a torch.distributed.pipelining CSV (see the module docstring)."""
    text = _read_text(path) if text is None else text
    rows = _torch_cells(path, text)
    p = len(rows)
    owner: dict[int, int] = {}
    for rank, cells in enumerate(rows):
        for stage, _, _ in cells:
            if owner.setdefault(stage, rank) != rank:
                raise ScheduleFileError(f"{path}: stage {stage} is computed on rank {owner[stage]} and on rank {rank}; "
                                        "a stage must live on one rank")
    if not owner:
        raise ScheduleFileError(f"{path}: no compute cells")
    stages = sorted(owner)
    if stages != list(range(len(stages))):
        missing = sorted(set(range(max(stages) + 1)) - set(stages))
        raise ScheduleFileError(f"{path}: stages {missing} are never computed (stages must be 0..{max(stages)})")
    per_rank = {rank: sorted(s for s, r in owner.items() if r == rank) for rank in range(p)}
    counts = {len(held) for held in per_rank.values()}
    if len(counts) != 1:
        raise ScheduleFileError(f"{path}: ranks hold different numbers of stages "
                                f"({', '.join(f'rank {r}: {len(h)}' for r, h in per_rank.items())}); every rank must "
                                "hold the same number")
    v = counts.pop()
    chunk_of = {stage: held.index(stage) for held in per_rank.values() for stage in held}
    placement = [(owner[s], chunk_of[s]) for s in stages]
    microbatches = {mb for cells in rows for _, _, mb in cells}
    m = max(microbatches) + 1
    actions = [[Action(op, mb, chunk_of[stage]) for stage, op, mb in cells] for cells in rows]
    name = f"file:{os.path.basename(path)}"
    return Schedule(name, p, m, v, placement, actions, options={"source": "torch-csv"})


def schedule_to_json(schedule: Schedule) -> dict:
    """The JSON form of `schedule` (what `--export-schedule` writes)."""
    return {
        "format": JSON_FORMAT,
        "name": schedule.name,
        "num_ranks": schedule.num_ranks,
        "num_microbatches": schedule.num_microbatches,
        "num_chunks": schedule.num_chunks,
        "placement": [list(loc) for loc in schedule.placement],
        "options": schedule.options,
        "actions": [[str(a) for a in acts] for acts in schedule.actions],
    }


def read_schedule_json(path: str, text: Optional[str] = None) -> Schedule:
    text = _read_text(path) if text is None else text
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ScheduleFileError(f"{path}: not JSON ({err})") from None
    if not isinstance(data, dict) or data.get("format") != JSON_FORMAT:
        raise ScheduleFileError(f"{path}: expected a JSON object with \"format\": \"{JSON_FORMAT}\"")
    missing = [k for k in ("num_ranks", "num_microbatches", "num_chunks", "placement", "actions") if k not in data]
    if missing:
        raise ScheduleFileError(f"{path}: missing {', '.join(missing)}")
    actions = []
    for rank, acts in enumerate(data["actions"]):
        parsed = []
        for i, token in enumerate(acts):
            try:
                parsed.append(Action.parse(token))
            except ValueError as err:
                raise ScheduleFileError(f"{path}: rank {rank}, action {i}: cannot read {token!r} ({err})") from None
        actions.append(parsed)
    try:
        return Schedule(f"file:{os.path.basename(path)}", data["num_ranks"], data["num_microbatches"],
                        data["num_chunks"], [tuple(loc) for loc in data["placement"]], actions,
                        options=dict(data.get("options") or {}))
    except (ValueError, TypeError) as err:
        raise ScheduleFileError(f"{path}: {err}") from None


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as err:
        raise ScheduleFileError(f"--pipeline-schedule-file {path}: {err.strerror or err}") from None


def read_schedule_file(path: str) -> Schedule:
    """The schedule in `path`: JSON when it starts with '{', else torch's CSV."""
    text = _read_text(path)
    if text.lstrip().startswith("{"):
        return read_schedule_json(path, text)
    return read_torch_csv(path, text)


# Building ------------------------------------------------------------------------------------------------


def _compute_only(schedule: Schedule) -> Schedule:
    # BPipe's ACCEPT/RETURN are the acceptor's communication: insert_communication places them again.
    return dataclasses.replace(schedule, actions=[[a for a in acts if a.op not in COMM_OPS and a.op not in HOSTING_OPS]
                                                  for acts in schedule.actions])


def build_schedule_from_file(path: str, *, num_ranks: Optional[int] = None, num_microbatches: Optional[int] = None,
                             num_chunks: Optional[int] = None, offload_chunks: Optional[int] = None,
                             offload_fraction: Optional[float] = None, offload_time: Optional[float] = None,
                             bpipe_max_resident: Optional[int] = None) -> Schedule:
    """Read `path`, check it against the job's sizes (None: not checked), run the passes asked for, insert
    the communication and validate: a runnable schedule, or ScheduleFileError with one line."""
    schedule = read_schedule_file(path)
    for flag, want, got in (("--pipeline-model-parallel-size", num_ranks, schedule.num_ranks),
                            ("microbatches per step (--global-batch-size / (--micro-batch-size x data-parallel size))",
                             num_microbatches, schedule.num_microbatches),
                            ("chunks per rank (virtual stages)", num_chunks, schedule.num_chunks)):
        if want is not None and want != got:
            raise ScheduleFileError(f"--pipeline-schedule-file {path} has {got} for {flag}, the job has {want}")
    has_comm = any(a.op in COMM_OPS for acts in schedule.actions for a in acts)
    wants_offload = offload_chunks is not None or offload_fraction is not None
    try:
        if wants_offload or bpipe_max_resident is not None or not has_comm:
            schedule = _compute_only(schedule)
            if wants_offload:
                from megatron_pp.schedules.offload import add_offload

                schedule = add_offload(schedule, offload_chunks, offload_fraction=offload_fraction,
                                       offload_time=offload_time)
            if bpipe_max_resident is not None:
                from megatron_pp.schedules.bpipe import add_bpipe

                schedule = add_bpipe(schedule, bpipe_max_resident)
            schedule = insert_communication(schedule)
        validate(schedule)
    except ScheduleError as err:
        raise ScheduleFileError(f"--pipeline-schedule-file {path}: {err}") from None
    except ValueError as err:
        raise ScheduleFileError(f"--pipeline-schedule-file {path}: {err}") from None
    return schedule


def register_schedule_file(path: str) -> str:
    """Register the compute order in `path` as a schedule named `file:<file name>` that builds only at the
    file's own (ranks, microbatches, chunks), so a planner searches it like a registered schedule and skips
    the layouts it does not fit. Returns the name (registering the same file twice is harmless)."""
    from megatron_pp.schedules.registry import list_schedules, register_schedule

    schedule = read_schedule_file(path)
    name = schedule.name
    if name in list_schedules():
        return name
    compute = _compute_only(schedule)
    sizes = (schedule.num_ranks, schedule.num_microbatches, schedule.num_chunks)

    def from_file(num_ranks: int, num_microbatches: int, num_chunks: int) -> Schedule:
        if (num_ranks, num_microbatches, num_chunks) != sizes:
            raise ValueError(f"--pipeline-schedule-file {path} is for (pp, microbatches, chunks) = {sizes}")
        return compute

    register_schedule(name, from_file, supports_virtual=True, description=f"the action lists in {path}")
    return name

