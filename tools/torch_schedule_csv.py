"""Write one of torch.distributed.pipelining's schedules as its compute-only CSV, for --pipeline-schedule-file.

    python tools/torch_schedule_csv.py --schedule ZBVZeroBubble --pp 4 --microbatches 8 --out zbv.csv
    python tools/plot_schedule.py --pipeline-schedule-file zbv.csv --out zbv.png

torch's schedule classes compute every rank's order when they are built; they only read a few attributes
of the stages they are given, so stand-ins are enough and no process group or model is needed. The file is
written by torch's own writer (`_dump_csv(..., format="compute_only")`, a private API of torch, which is
why this lives in a tool and not in the package). Stages per rank: 2 (`--chunks`); V-shaped classes
(ZBVZeroBubble, DualPipeV) place stages r and 2p-1-r on rank r.
"""
from __future__ import annotations

import argparse
import sys
import types
from typing import Optional

import torch

CLASSES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")


def write_torch_csv(path: str, name: str, p: int, m: int, chunks: int = 2) -> str:
    """Write torch's compute-only CSV of `Schedule<name>` for p ranks and m microbatches; return `path`."""
    from torch.distributed.pipelining import schedules

    name = name.removeprefix("Schedule")
    if name not in CLASSES:
        raise ValueError(f"--schedule must be one of {', '.join(CLASSES)}, got {name!r}")
    if name in V_SHAPED and chunks != 2:
        raise ValueError(f"{name} places exactly 2 stages on each rank (--chunks 2)")
    n = p * chunks
    stage_ids = [0, n - 1] if name in V_SHAPED else [c * p for c in range(chunks)]
    stages = [types.SimpleNamespace(group_size=p, group_rank=0, stage_index=s, num_stages=n, is_first=s == 0,
                                    is_last=s == n - 1, stage_index_to_group_rank={}, submod=torch.nn.Identity())
              for s in stage_ids]
    schedule = getattr(schedules, f"Schedule{name}")(stages, m, loss_fn=lambda out, target: out)
    schedule._dump_csv(path, format="compute_only")
    return path


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", required=True, help=", ".join(CLASSES))
    parser.add_argument("--pp", type=int, required=True)
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=2, help="stages per rank (default 2)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        write_torch_csv(args.out, args.schedule, args.pp, args.microbatches, args.chunks)
    except (ValueError, RuntimeError, AssertionError) as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
