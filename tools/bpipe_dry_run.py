"""BPipe's bound at full size: the dry run's per-rank stash peaks of `bpipe` and `1f1b` beside the simulator's.

    python tools/bpipe_dry_run.py --pp 4 --microbatches 8 --out docs/results/bpipe_dry_run_96b_p4.json
    python tools/bpipe_dry_run.py --pp 8 --microbatches 16 --num-layers 80 --out docs/results/bpipe_dry_run_96b_p8_80layers.json
    python tools/bpipe_dry_run.py --pp 8 --microbatches 16 --num-layers 16 --out docs/results/bpipe_dry_run_96b_p8.json

(`--dry-run-schedules 1f1b` dry-runs 1F1B only and simulates BPipe, for a quicker look.)

The model is the BPipe reproduction's GPT-3 96B (`launch/configs/bpipe_gpt3_96b.yaml`: 84 layers, hidden 9728,
76 heads, sequence 2048, unfused attention with dropout 0.1, bf16, tp 4 with sequence parallelism), at
pipeline size p, dp 1, micro-batch 1. Each schedule runs through the training script's own `--dry-run` path
(`training.dry_run.run_rank`: the real job on fake tensors) for one rank per pipeline rank; BPipe's runs its
EVICT/ACCEPT/LOAD/RETURN on the fake backend, each acceptor first dry-running its partner up to its first
eviction to learn the stash layout it hosts (`training.dry_run_bpipe`), and its rows count the device memory
held for the partner apart (`guest_peak_bytes`, inside `stash_peak_bytes`). BPipe promises that no rank holds
more than K + 1 stashes (K = ⌈(p+2)/2⌉), so its worst rank's stash peak is at most (K + 1)/p of 1F1B's rank 0
(`bound`); the JSON has both, per rank, with the ratio, and the tool exits 1 when the dry run's or the
simulated worst rank exceeds it, or when the simulated ranks disagree (a send without its receive).

The bound is over what BPipe moves, the stashes' activations: the stores count the step's batch tensors apart
(`training.dry_run_bpipe.BatchApart`; `batch_saved_bytes` per rank). The step holds every microbatch's batch
on the device from its start to its end under any schedule, so neither schedule can free them, and BPipe
leaves them home when it parks a stash; the dry run of the command alone counts a batch tensor that a stash
saved (GPT's learned position embedding keeps its position ids for its backward) in every live stash that
saved it, parked or not: at their peaks 1F1B's rank 0 and BPipe's evictor both count p microbatches' ids (BPipe's
K + 1 resident and the parked ones), which puts BPipe that many bytes above (K + 1)/p in that count.
The totals (`peak_bytes`: every live storage) are the dry run's own, batch included.

"Simulated" is the schedule simulator's resident-stash curve of the same action lists (default costs, the
timeline the lists were placed on) with each stage's stash weighed by the bytes one stash of that stage
holds as the 1F1B dry run measured it (its rank s peak over its min(p − s, m) stashes), so the comparison
isolates when stashes are held (list order, ACCEPT placement, the acceptor's hosting bound) from what a
stash weighs. A hosted stash counts on its host from the ACCEPT that allocates its buffers until the
partner's LOAD has taken it back (`cost.resident_peaks`).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron_pp.planning.cost import resident_peaks  # noqa: E402
from megatron_pp.schedules.ir import Op  # noqa: E402
from megatron_pp.schedules.simulate import CostModel, simulate  # noqa: E402
from megatron_pp.training import dry_run  # noqa: E402
from megatron_pp.training.arguments import parse_args  # noqa: E402
from megatron_pp.training.dry_run_bpipe import BatchApart, acceptor_prepare, both  # noqa: E402
from megatron_pp.training.job_schedule import build_job_schedule  # noqa: E402

MODEL = ["--num-layers", "84", "--hidden-size", "9728", "--num-attention-heads", "76", "--seq-length", "2048",
         "--max-position-embeddings", "2048", "--vocab-size", "51200", "--hidden-dropout", "0.1",
         "--attention-dropout", "0.1", "--attention-backend", "reference", "--tensor-model-parallel-size", "4",
         "--sequence-parallel", "--bf16", "--mock-data", "--micro-batch-size", "1"]


STASH_NOTE = ("stash_peak_bytes: the store's peak of the stashes' activations, the step's batch tensors counted apart "
              "(batch_saved_bytes: those some stash of the rank saved, every microbatch's; the command alone counts "
              "a saved batch tensor in every live stash that saved it)")


def within(peak: float, bound_num: int, pp: int, rank0: float) -> bool:
    """peak <= (bound_num / pp) * rank0, exactly for integer bytes (the dry run's), to 1e-12 for the simulator's
    float bytes (one stash's bytes are a 1F1B peak divided by a count)."""
    if isinstance(peak, int) and isinstance(rank0, int):
        return peak * pp <= bound_num * rank0
    return peak * pp <= bound_num * rank0 * (1 + 1e-12)


def argv_of(schedule: str, pp: int, m: int, num_layers: int | None) -> list[str]:
    layers = ["--num-layers", str(num_layers)] if num_layers else []
    return MODEL + layers + ["--pipeline-model-parallel-size", str(pp), "--pipeline-schedule", schedule,
                             "--global-batch-size", str(m), "--train-iters", "2", "--dry-run", str(4 * pp)]


def run_rank(args, rank: int) -> tuple[dry_run.RankReport, int]:
    """The dry run of global rank `rank` with its store counting the step's batch tensors apart
    (`dry_run_bpipe.BatchApart`), and the bytes of the batch storages its stashes saved."""
    device = torch.device(args.dry_run_device)
    apart = BatchApart()

    def run_partner(partner: int, stop):  # an acceptor learns its partner's stash layout, counted the same way
        return dry_run.run_rank(args, partner, device, 1, both(BatchApart(), stop))
    report = dry_run.run_rank(args, rank, device, 2, both(apart, acceptor_prepare(args, rank, run_partner)))
    return report, apart.saved_bytes


def run_schedule(argv: list[str]) -> dict:
    """Dry-run one rank per pipeline rank of the job `argv` describes; rows and their communication check."""
    from megatron_pp.training.dry_run_agree import disagreements

    args = parse_args(argv)
    reports, rows = [], []
    for rank in dry_run.chosen_ranks(args):
        report, batch_saved = run_rank(args, rank)
        reports.append(report)
        rows.append({**report.row(), "batch_saved_bytes": batch_saved})
    return {"command": "python pretrain_gpt.py " + " ".join(argv), "stash": STASH_NOTE, "ranks": rows,
            "disagreements": disagreements({r.rank: r.comm for r in reports})}


def simulated_peaks(argv: list[str], stage_bytes: list[float]) -> tuple[list[float], list[int]]:
    """Per pipeline rank: the simulator's resident-stash peak of the job's lists in bytes, and in stashes."""
    args = parse_args(argv)
    schedule = build_job_schedule(args, 1, 1)
    sim = simulate(schedule, CostModel())
    return resident_peaks(schedule, sim, stage_bytes), [int(n) for n in sim.peak_stash]


def accept_slack(argv: list[str]) -> list[int]:  # noqa: C901 - one walk over the timeline
    """Per rank, the most compute actions of its own that an ACCEPT precedes in its list although they end,
    on the simulated timeline, before the eviction it receives starts: an ACCEPT posted that much earlier
    than the transfer needs it holds the guest's buffers over them. 0 on every rank: no ACCEPT is early."""
    args = parse_args(argv)
    schedule = build_job_schedule(args, 1, 1)
    sim = simulate(schedule, CostModel())
    out = []
    for rank, line in enumerate(sim.timeline):
        evict_start = {(a.microbatch, a.chunk): start for peer in sim.timeline for a, start, _ in peer
                       if a.op is Op.EVICT and a.peer == rank}
        slack = 0
        for i, (a, start, _) in enumerate(line):
            if a.op is not Op.ACCEPT:
                continue
            arrival = evict_start[(a.microbatch, a.chunk)]
            early = sum(1 for b, _, end in line[i + 1:] if b.op in (Op.F, Op.B, Op.BI, Op.BW) and end <= arrival)
            slack = max(slack, early)
        out.append(slack)
    return out


def measure(pp: int, m: int, num_layers: int | None, dry_run_schedules: tuple[str, ...] = ("1f1b", "bpipe"),
            done: dict | None = None, on_progress=lambda partial: None) -> dict:
    """Dry-run `dry_run_schedules` (1F1B always: its per-stage stash bytes weigh the simulation), then simulate
    both. `done`: runs recorded by an earlier call with the same sizes (a stopped run resumes from them)."""
    k = math.ceil((pp + 2) / 2)
    result: dict = {"pp": pp, "microbatches": m, "num_layers": num_layers or 84, "K": k,
                    "bound": (k + 1) / pp, "runs": {}}
    for schedule in ("1f1b", "bpipe"):
        argv = argv_of(schedule, pp, m, num_layers)
        if done and schedule in done and done[schedule]["command"] == "python pretrain_gpt.py " + " ".join(argv):
            result["runs"][schedule] = done[schedule]
        elif schedule in dry_run_schedules:
            began, load = time.process_time(), os.getloadavg()
            result["runs"][schedule] = run_schedule(argv)
            result["runs"][schedule].update(cpu_seconds=time.process_time() - began, load_average_before=list(load),
                                            load_average_after=list(os.getloadavg()))
        else:
            result["runs"][schedule] = {"command": "python pretrain_gpt.py " + " ".join(argv), "ranks": []}
        on_progress(result)
    one = result["runs"]["1f1b"]["ranks"]
    stage_bytes = [r["stash_peak_bytes"] / min(pp - r["pipeline_rank"], m) for r in one]
    for schedule, run in result["runs"].items():
        peaks, counts = simulated_peaks(argv_of(schedule, pp, m, num_layers), stage_bytes)
        run["simulated_stash_peak_bytes"], run["simulated_peak_stashes"] = peaks, counts
    bp = result["runs"]["bpipe"]
    result["early_accepts"] = accept_slack(argv_of("bpipe", pp, m, num_layers))
    rank0 = one[0]["stash_peak_bytes"]
    result["simulated_worst_over_1f1b_rank0"] = max(bp["simulated_stash_peak_bytes"]) / rank0
    result["simulated_holds_bound"] = within(max(bp["simulated_stash_peak_bytes"]), k + 1, pp, rank0)
    if bp["ranks"]:
        worst = max(r["stash_peak_bytes"] for r in bp["ranks"])
        result["worst_over_1f1b_rank0"] = worst / rank0
        result["holds_bound"] = within(worst, k + 1, pp, rank0)
    on_progress(result)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, required=True, help="pipeline-parallel size p")
    parser.add_argument("--microbatches", type=int, required=True, help="microbatches per step m")
    parser.add_argument("--num-layers", type=int, default=None, help="instead of the 96B's 84 (p must divide it)")
    parser.add_argument("--dry-run-schedules", default="1f1b,bpipe",
                        help="which schedules to dry-run (1f1b always; bpipe's peaks are also simulated either way)")
    parser.add_argument("--out", required=True, help="JSON to write (rewritten after each schedule)")
    parser.add_argument("--resume", action="store_true", help="keep the runs --out already holds for these sizes")
    args = parser.parse_args(argv)
    layers = args.num_layers or 84
    schedules = tuple(x.strip() for x in args.dry_run_schedules.split(",") if x.strip())
    if args.pp < 2 or layers % args.pp:
        print(f"error: --pp {args.pp} must be >= 2 and divide --num-layers {layers}", file=sys.stderr)
        return 2
    if args.microbatches < args.pp:
        print(f"error: --microbatches {args.microbatches} must be >= --pp {args.pp} for BPipe to evict", file=sys.stderr)
        return 2
    if "1f1b" not in schedules or not set(schedules) <= {"1f1b", "bpipe"}:
        print(f"error: --dry-run-schedules {args.dry_run_schedules!r}: 1f1b, optionally bpipe", file=sys.stderr)
        return 2
    done = json.loads(Path(args.out).read_text())["runs"] if args.resume and Path(args.out).exists() else None
    command = "python tools/bpipe_dry_run.py " + " ".join(sys.argv[1:] if argv is None else argv)

    def write(partial: dict) -> None:
        Path(args.out).write_text(json.dumps({"command": command, **partial}, indent=1) + "\n")

    result = measure(args.pp, args.microbatches, args.num_layers, schedules, done, write)
    measured = (f"dry run {result['worst_over_1f1b_rank0']:.3f}, " if "worst_over_1f1b_rank0" in result else "")
    problems = [line for run in result["runs"].values() for line in run.get("disagreements", [])]
    for line in problems:
        print(f"disagreement: {line}")
    ok = result.get("holds_bound", True) and result["simulated_holds_bound"] and not problems
    print(f"p {args.pp}: BPipe worst rank / 1F1B rank 0: {measured}simulated "
          f"{result['simulated_worst_over_1f1b_rank0']:.3f}; bound {result['bound']:.3f}: "
          f"{'holds' if ok else 'VIOLATED'}; early ACCEPTs per rank {result['early_accepts']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
