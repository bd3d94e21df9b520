"""Predict a seed paper's headline experiment at full scale and measure its trend at small scale.

    python tools/reproduce.py bpipe                 # every model / cell, plus the CPU trends
    python tools/reproduce.py pipeoffload --quick   # smallest model / cell only: under a minute on a CPU
    python tools/reproduce.py all --quick --json runs/reproduce.json
    python tools/reproduce.py 2bw --no-measure      # full-scale rows only (no processes started)
    python tools/reproduce.py bpipe --hardware h100-sxm --efficiency-file runs/bench_layer_gpt3.json
    python tools/reproduce.py all --check           # recompute every simulated table, compare with the docs
    nice -n 10 python tools/reproduce.py bpipe --dry-run-cells   # dry-run the memory cells' jobs (minutes each)

PAPER is one of bpipe, bpipe-reeval, pipeoffload, 2bw, breadth-first, layered, or all. Full-scale rows come from
the paper's configs in launch/configs/ and GPU profiles in launch/hardware/ (`--hardware` overrides the
paper's GPU); the method is in megatron_pp/planning/reproduce.py and the recorded tables with their
discussion in docs/reproduction.md. `--check` recomputes the full-scale tables (no measurement) and exits 1
with one line per cell where docs/reproduction.md disagrees (with `--quick`, only the cells it computes).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_pp.planning.papers.dry_run_cells import CELLS, cell_text, run_dry_run, write_record  # noqa: E402
from megatron_pp.planning.reproduce import PAPERS, SmallScale, check_document, document_tables, reproduce  # noqa: E402


def dry_run_cells(papers, keys: str, extra: str) -> int:
    """Regenerate the dry-run JSONs of the memory cells (megatron_pp/planning/papers/dry_run_cells.py)."""
    try:
        extra_ranks = [int(r) for r in extra.split(",") if r]
    except ValueError:
        print(f"reproduce.py: error: --dry-run-extra-ranks takes pipeline ranks like 0,11, got {extra!r}",
              file=sys.stderr)
        return 2
    known = {cell.key for paper in papers for cell in CELLS.get(paper, ())}
    wanted = known if keys == "all" else set(keys.split(","))
    if not known or wanted - known:
        print(f"reproduce.py: error: --dry-run-cells: unknown cell(s) {', '.join(sorted(wanted - known)) or keys}; "
              f"{', '.join(papers)} has {', '.join(sorted(known)) or 'none'}", file=sys.stderr)
        return 2
    for paper in papers:
        if not any(cell.key in wanted for cell in CELLS.get(paper, ())):
            continue
        report = reproduce(paper, quick=True, measure=False)  # every cell with a dry run is in the quick set
        for job in report.dry_runs:
            if job.cell.key in wanted:
                start = time.perf_counter()
                try:
                    record = run_dry_run(job, extra_ranks)
                except subprocess.CalledProcessError as exc:
                    print(f"reproduce.py: error: the dry run of cell {job.cell.key} exited {exc.returncode} (its own "
                          "message above); nothing written", file=sys.stderr)
                    return 1
                write_record(job, record)
                print(f"{job.cell.key}: {cell_text(job)} ({time.perf_counter() - start:.0f} s)")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paper", choices=(*PAPERS, "all"))
    parser.add_argument("--quick", action="store_true", help="smallest model / cell of each paper")
    parser.add_argument("--no-measure", action="store_true", help="skip the small-scale CPU measurements")
    parser.add_argument("--hardware", default=None,
                        help="GPU profile in launch/hardware/ instead of the paper's (e.g. h100-sxm)")
    parser.add_argument("--efficiency-file", default=None,
                        help="bpipe, bpipe-reeval: layer times from a tools/bench_layer.py report, not the roofline")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--check", action="store_true",
                        help="compare the full-scale tables with docs/reproduction.md (implies --no-measure); exit 1 "
                             "naming every cell that differs")
    parser.add_argument("--dry-run-cells", nargs="?", const="all", default=None, metavar="KEY,KEY",
                        help="dry-run the job of each memory cell that shows the dry run (all of PAPER's, or these "
                             "keys) and write docs/results/repro_dry_run_KEY.json; nothing else is computed")
    parser.add_argument("--dry-run-extra-ranks", default="", metavar="P,P",
                        help="with --dry-run-cells: also run these pipeline ranks (is the planner's worst the "
                             "dry run's?)")
    args = parser.parse_args(argv)
    papers = PAPERS if args.paper == "all" else (args.paper,)
    if args.dry_run_cells is not None:
        return dry_run_cells(papers, args.dry_run_cells, args.dry_run_extra_ranks)
    if args.check:
        if args.hardware or args.efficiency_file:
            print("reproduce.py: error: --check compares the recorded tables, which use the papers' own hardware "
                  "and the roofline: drop --hardware / --efficiency-file", file=sys.stderr)
            return 2
        args.no_measure = True
        try:
            sections = document_tables()
        except (ValueError, OSError) as exc:
            print(f"reproduce.py: error: {exc}", file=sys.stderr)
            return 2
    small = None if args.no_measure else SmallScale()
    reports, problems = [], []
    try:
        for paper in papers:
            start = time.perf_counter()
            try:
                report = reproduce(paper, quick=args.quick, small=small, measure=not args.no_measure,
                                   hardware=args.hardware, efficiency_file=args.efficiency_file)
            except (ValueError, OSError) as exc:
                print(f"reproduce.py: error: {exc}", file=sys.stderr)
                return 2
            if args.check:
                found = check_document(report, sections, complete=not args.quick)
                problems += found
                print(f"{paper}: {len(found)} cell(s) differ ({time.perf_counter() - start:.0f} s)")
            else:
                print(report.format())
                print(f"({paper}: {time.perf_counter() - start:.0f} s)\n")
            reports.append(report.to_dict())
    finally:
        if small is not None:
            small.close()
    if args.json:
        with open(args.json + ".tmp", "w") as f:
            json.dump({"command": "python tools/reproduce.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                       "reports": reports}, f, indent=2)
        os.replace(args.json + ".tmp", args.json)
    for line in problems:
        print(line, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
