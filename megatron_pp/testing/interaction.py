"""The interaction matrix: cases over the factors that meet in one training job, every pair of levels covered.

Factors (levels): precision (fp32, bf16, fp16 with dynamic loss scaling from 4096), schedule (every registered
schedule, a schedule file, a plugin), layout (tp x pp x dp, world <= 4), virtual stages per rank (1, 2), sequence
parallelism, recompute (none, selective, full), offload (none, `--offload-chunks 1`, `--offload-fraction 0.5`),
distributed optimizer, embeddings (tied, untied), attention (MHA, GQA) and model family (gpt-tiny, llama-tiny).

How the array is built (`covering_array`), deterministic for a seed: the feasible pairs of levels are every pair
that some feasible full case contains (a pair no constraint rules out that a depth-first search over the other
factors completes; the full space is 110,592 cases); while one is uncovered, a new row starts from the first uncovered pair in a fixed order, then
fills the other factors one by one (in an order drawn from the seed) with the level that covers the most
uncovered pairs against the levels already chosen, among the levels that keep the row feasible (ties: the
lowest level index). `candidates` rows are drawn per step (different factor orders) and the one covering most
is kept. This is the AETG idea (Cohen et al., 1997) in its plainest form; a row always covers its seed pair,
so the loop ends, and tests/training/test_interaction_matrix.py checks every feasible pair is covered.

Constraints (`infeasible`) are only those that hold by construction, each counted by `skipped_pairs`: what a
schedule declares in the registry (no virtual stages, exactly two chunks, which options it takes), sequence
parallelism without tensor parallelism, and llama-tiny has no flag that ties its embeddings. What the code
refuses beyond that is an outcome each case checks (`refusal`): one line that names a flag the case gave.

A case is a command line (`job_argv`): gpt-tiny / llama-tiny at hidden 64, 4 heads, FFN 64, sequence 48, one
layer per pipeline stage, m = p + 1 microbatches of 1 sample, two steps of AdamW. tests/interaction.py runs it
(the real `pretrain` on tests/dist.py's gloo pool) and checks it against its reference; `refusal` is the
start-up path's verdict, which tools/schedule_matrix.py lists for the array's refused cases. This module is in
the package, not under tests/, because that tool must not import tests; dev/interaction_matrix.py draws larger
arrays (`--seed`, `--arrays`) from it.
"""
from __future__ import annotations

import itertools
import os
import random
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

PLUGIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "matrix_plugin.py")  # passed as a file path
PLUGIN_SCHEDULE = "matrix-plugin"
FILE_LEVEL, PLUGIN_LEVEL = "file", "plugin"
SEED = 7
LR, CLIP, WEIGHT_DECAY = 1e-2, 1.0, 0.01
SPLIT_BACKWARD = ("zb-h1", "zb-h2", "zb-v", "v-half")
LAYOUTS = ((1, 2, 1), (1, 2, 2), (2, 2, 1), (1, 4, 1))  # (tp, pp, dp), world <= 4


def factors() -> dict[str, tuple]:
    """Factor name -> levels, in the order the array is printed. Schedules: the registry's, then file, plugin."""
    return {
        "precision": ("fp32", "bf16", "fp16"),
        "schedule": tuple(e.name for e in _BUILTIN) + (FILE_LEVEL, PLUGIN_LEVEL),
        "layout": LAYOUTS,
        "virtual": (1, 2),
        "sequence_parallel": (False, True),
        "recompute": ("none", "selective", "full"),
        "offload": ("none", "chunks", "fraction"),
        "distributed_optimizer": (False, True),
        "embeddings": ("tied", "untied"),
        "attention": ("mha", "gqa"),
        "model": ("gpt-tiny", "llama-tiny"),
    }


def _builtin_entries() -> list:
    """The project's registered schedules: those whose builder lives in the package (plugins that other tests
    load into the same process register theirs too, and must not change the array)."""
    from megatron_pp.schedules.registry import registered_schedules

    return [e for e in registered_schedules() if getattr(e.builder, "__module__", "").startswith("megatron_pp.")
            and not e.name.startswith("file:")]  # a schedule file registered by the planner is not a built-in


_BUILTIN = _builtin_entries()


def _schedule_traits(name: str) -> tuple[Optional[bool], Optional[int], tuple]:
    """(supports virtual stages, fixed chunks per rank, option names) as the schedule declares them."""
    if name == FILE_LEVEL:  # a file holds any chunk count; the file job takes the offload flags
        return True, None, ("offload_chunks", "offload_fraction")
    if name == PLUGIN_LEVEL:  # megatron_pp/testing/matrix_plugin.py
        return True, None, ("offload_chunks", "offload_fraction")
    entry = next(e for e in _BUILTIN if e.name == name)
    return entry.supports_virtual, entry.chunks_per_rank, entry.options


def infeasible(case: dict) -> Optional[str]:
    """Why a (partial) case cannot exist by construction, or None. Reads only the factors `case` sets."""
    if "schedule" in case:
        virtual, fixed, options = _schedule_traits(case["schedule"])
        if "virtual" in case:
            if not virtual and case["virtual"] > 1:
                return "schedule has no virtual stages"
            if fixed is not None and case["virtual"] != fixed:
                return f"schedule runs exactly {fixed} chunks per rank"
        if case.get("offload", "none") != "none" and f"offload_{case['offload']}" not in options:
            return "schedule takes no offload option"
    if case.get("sequence_parallel") and "layout" in case and case["layout"][0] == 1:
        return "sequence parallelism splits along tensor-parallel ranks"
    if case.get("model") == "llama-tiny" and case.get("embeddings") == "tied":
        return "llama-tiny's embeddings are untied and no flag ties them"
    return None


def _pairs(row: Sequence[int]) -> Sequence[tuple[int, int, int, int]]:
    return [(i, row[i], j, row[j]) for i, j in itertools.combinations(range(len(row)), 2)]


def _as_case(names: Sequence[str], levels: Sequence[tuple], row: Sequence[Optional[int]]) -> dict:
    return {n: levels[i][v] for i, (n, v) in enumerate(zip(names, row)) if v is not None}


class _Space:
    """The factors as level indices, with the pairs `infeasible` rules out. Every constraint reads at most two
    factors, so a case is feasible exactly when none of its pairs is ruled out (a unit test holds this)."""

    def __init__(self, table: dict) -> None:
        self.names, self.levels = list(table), list(table.values())
        self.bad = {(i, a, j, b) for i, j in itertools.combinations(range(len(self.names)), 2)
                    for a in range(len(self.levels[i])) for b in range(len(self.levels[j]))
                    if infeasible({self.names[i]: self.levels[i][a], self.names[j]: self.levels[j][b]}) is not None}

    def consistent(self, row: Sequence[Optional[int]], k: int) -> bool:
        """Factor k's level in `row` is ruled out with none of the levels set so far."""
        return all((min(k, m), row[min(k, m)], max(k, m), row[max(k, m)]) not in self.bad
                   for m in range(len(row)) if m != k and row[m] is not None)

    def completable(self, row: list) -> bool:
        """Some feasible full case extends `row` (depth-first; `row` itself is consistent)."""
        if None not in row:
            return True
        k = row.index(None)
        for v in range(len(self.levels[k])):
            row[k] = v
            if self.consistent(row, k) and self.completable(row):
                row[k] = None
                return True
        row[k] = None
        return False

    def feasible_pairs(self) -> set:
        pairs = set()
        for i, j in itertools.combinations(range(len(self.names)), 2):
            for a in range(len(self.levels[i])):
                for b in range(len(self.levels[j])):
                    row: list = [None] * len(self.names)
                    row[i], row[j] = a, b
                    if (i, a, j, b) not in self.bad and self.completable(row):
                        pairs.add((i, a, j, b))
        return pairs


def feasible_pairs(table: Optional[dict] = None) -> set:
    """Every pair of levels (factor i, level a, factor j, level b; i < j) that some feasible full case holds."""
    return _Space(table or factors()).feasible_pairs()


def skipped_pairs(table: Optional[dict] = None) -> int:
    """Pairs of levels no feasible case holds (e.g. gpipe x v = 2), skipped by construction."""
    table = table or factors()
    sizes = [len(lv) for lv in table.values()]
    return sum(a * b for a, b in itertools.combinations(sizes, 2)) - len(feasible_pairs(table))


def covering_array(seed: int = SEED, candidates: int = 4, table: Optional[dict] = None,
                   accepts: Optional[Callable[[dict], bool]] = None) -> list[dict]:
    """Cases (factor name -> level) covering every feasible pair of levels; see the module docstring.

    `accepts(case)` (the start-up path's verdict, e.g. `refusal(...) is None`) adds a repair pass: a pair held
    only by refused cases gets a case of its own that runs, where one exists."""
    space = _Space(table or factors())
    rng = random.Random(seed)
    uncovered = space.feasible_pairs()
    rows = []
    while uncovered:
        best = _best_row(space, min(uncovered), uncovered, rng, candidates)
        uncovered -= set(_pairs(best))
        rows.append(best)
    if accepts is not None:
        rows += _repair(space, rows, accepts, rng, candidates)
    return [_as_case(space.names, space.levels, row) for row in rows]


def _best_row(space: "_Space", seed_pair: tuple, uncovered: set, rng: random.Random, candidates: int) -> list:
    """Of `candidates` greedy rows holding `seed_pair` (each filling the factors in a drawn order), the one
    covering most pairs of `uncovered`."""
    i, a, j, b = seed_pair
    best, best_gain = None, -1
    for _ in range(candidates):
        order = [k for k in range(len(space.names)) if k not in (i, j)]
        rng.shuffle(order)
        row: list = [None] * len(space.names)
        row[i], row[j] = a, b
        for k in order:
            row[k] = _best_level(space, k, row, uncovered)
        gain = sum(p in uncovered for p in _pairs(row))
        if gain > best_gain:
            best, best_gain = row, gain
    assert best is not None
    return best


def _repair(space: "_Space", rows: list, accepts: Callable[[dict], bool], rng: random.Random,
            candidates: int) -> list:
    """Rows that run for the pairs only refused rows hold. A refused attempt's other pairs stop attracting the
    next attempt (so it steers away from what the code refuses); after `candidates` refusals the pair stays
    covered by refusals only (e.g. 2bw x distributed optimizer, which the code always refuses)."""
    def runs(row: list) -> bool:
        return accepts(_as_case(space.names, space.levels, row))

    covered = set().union(*(set(_pairs(r)) for r in rows if runs(r)))
    pending = set().union(*(set(_pairs(r)) for r in rows)) - covered
    added = []
    for pair in sorted(pending):
        target = pending - covered
        for _ in range(candidates):
            if pair in covered:
                break
            row = _best_row(space, pair, target, rng, 1)
            if runs(row):
                added.append(row)
                covered |= set(_pairs(row))
            else:
                target -= set(_pairs(row)) - {pair}
    return added


def _best_level(space: _Space, k: int, row: list, uncovered: set) -> int:
    """The level of factor k covering most uncovered pairs with the levels set so far, among those that keep
    `row` completable (ties: the lowest level index)."""
    best, best_gain = None, -1
    for value in range(len(space.levels[k])):
        row[k] = value
        if space.consistent(row, k) and space.completable(list(row)):
            gain = sum((min(k, m), row[min(k, m)], max(k, m), row[max(k, m)]) in uncovered
                       for m in range(len(row)) if m != k and row[m] is not None)
            if gain > best_gain:
                best, best_gain = value, gain
        row[k] = None
    if best is None:  # cannot happen: the row was completable before factor k was set
        raise AssertionError(f"no feasible level for {space.names[k]} in {_as_case(space.names, space.levels, row)}")
    return best


# A case as a command line --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One case as the job it runs: its command line, world size and what its outcome is compared with."""

    case: tuple  # sorted (factor, level) items: hashable, printable
    argv: tuple
    world: int

    @property
    def settings(self) -> dict:
        return dict(self.case)

    @property
    def name(self) -> str:
        return case_name(self.settings)


def case_name(s: dict) -> str:
    """One case in a line, e.g. bf16-zb-h1-tp1pp2dp1v1-rc:none-off:chunks-tied-mha-gpt-tiny."""
    tp, pp, dp = s["layout"]
    return (f"{s['precision']}-{s['schedule']}-tp{tp}pp{pp}dp{dp}v{s['virtual']}"
            f"{'-sp' if s['sequence_parallel'] else ''}-rc:{s['recompute']}-off:{s['offload']}"
            f"{'-zero1' if s['distributed_optimizer'] else ''}-{s['embeddings']}-{s['attention']}-{s['model']}")


def microbatches(pp: int) -> int:
    """m = p + 1: not a multiple of p, so every schedule's uneven tail runs, and small."""
    return pp + 1


def model_flags(case: dict) -> list[str]:
    """The smallest models that still offload: the preset at hidden 64, 4 heads, FFN 64, sequence 48, one layer per
    pipeline stage. The host store leaves storages of <= 1,024 elements on the device (offload_store.py's
    `min_numel`), so every stash must hold larger ones in every case: under full recompute with sequence
    parallelism a stash is the layer input's shard, 24 x 64 = 1,536 elements here. (At hidden 32 and sequence 16
    --offload-* moved nothing under tp 2 or full recompute: the lists offloaded, the store found nothing to move.)"""
    tp, pp, dp = case["layout"]
    flags = ["--model-preset", case["model"], "--num-layers", str(pp * case["virtual"]), "--hidden-size", "64",
             "--num-attention-heads", "4", "--ffn-hidden-size", "64", "--seq-length", "48",
             "--max-position-embeddings", "48"]
    flags += ["--group-query-attention", "--num-query-groups", "2"] if case["attention"] == "gqa" else \
        ["--num-query-groups", "4"]
    if case["embeddings"] == "untied" and case["model"] == "gpt-tiny":
        flags.append("--untie-embeddings-and-output-weights")
    return flags


def job_argv(case: dict, workdir: str, *, train_iters: int = 2) -> list[str]:
    """The command line of `case` (schedule files are written under `workdir`)."""
    tp, pp, dp = case["layout"]
    v, m = case["virtual"], microbatches(pp)
    argv = [*model_flags(case), "--mock-data", "--seed", str(SEED), "--micro-batch-size", "1",
            "--global-batch-size", str(m * dp), "--train-iters", str(train_iters), "--lr", str(LR),
            "--clip-grad", str(CLIP), "--weight-decay", str(WEIGHT_DECAY), "--log-interval", "100",
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    if case["precision"] == "bf16":
        argv.append("--bf16")
    elif case["precision"] == "fp16":  # from 2^12: the tiny models' gradients do not overflow, so steps apply
        argv += ["--fp16", "--initial-loss-scale", "4096"]
    schedule = case["schedule"]
    if schedule == FILE_LEVEL:
        argv += ["--pipeline-schedule-file", write_schedule_file(workdir, pp, m, v)]
    else:
        if schedule == PLUGIN_LEVEL:
            argv += ["--schedule-plugin", PLUGIN]
            schedule = PLUGIN_SCHEDULE
        argv += ["--pipeline-schedule", schedule]
        if v > 1:
            argv += ["--num-virtual-stages-per-pipeline-rank", str(v)]
    if case["sequence_parallel"]:
        argv.append("--sequence-parallel")
    if case["recompute"] == "selective":
        argv += ["--recompute-granularity", "selective"]
    elif case["recompute"] == "full":
        argv += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    if case["offload"] == "chunks":
        argv += ["--offload-chunks", "1"]
    elif case["offload"] == "fraction":
        argv += ["--offload-fraction", "0.5"]
    if case["distributed_optimizer"]:
        argv.append("--use-distributed-optimizer")
    return argv


def write_schedule_file(workdir: str, pp: int, m: int, v: int) -> str:
    """A JSON schedule file of the compute order (1F1B, or interleaved 1F1B for v > 1) at these sizes."""
    import json

    from megatron_pp.schedules.registry import build_schedule
    from megatron_pp.schedules.schedule_file import schedule_to_json

    path = os.path.join(workdir, f"order-p{pp}-m{m}-v{v}.json")
    if not os.path.exists(path):
        schedule = build_schedule("1f1b" if v == 1 else "interleaved-1f1b", pp, m, v)
        with open(path, "w") as f:
            json.dump(schedule_to_json(schedule), f)
    return path


def make_job(case: dict, workdir: str) -> Job:
    tp, pp, dp = case["layout"]
    return Job(tuple(sorted(case.items())), tuple(job_argv(case, workdir)), tp * pp * dp)


def low_precision_reference_case(case: dict) -> dict:
    """The same model and precision under plain 1F1B at pp 2, tp 1, dp 1 and the same global batch."""
    tp, pp, dp = case["layout"]
    return {**case, "schedule": "1f1b", "layout": (1, 2, 1), "virtual": 1, "sequence_parallel": False,
            "recompute": "none", "offload": "none", "distributed_optimizer": False,
            "_global_batch": microbatches(pp) * dp, "_layers": pp * case["virtual"]}


def reference_argv(ref: dict, workdir: str) -> list[str]:
    """`job_argv` of a reference case, with the compared case's layer count and global batch."""
    argv = job_argv({k: v for k, v in ref.items() if not k.startswith("_")}, workdir)
    argv[argv.index("--num-layers") + 1] = str(ref["_layers"])
    argv[argv.index("--global-batch-size") + 1] = str(ref["_global_batch"])
    return argv


# Refusals ------------------------------------------------------------------------------------------------------


def accepted(workdir: str) -> Callable[[dict], bool]:
    """The start-up path as `covering_array`'s `accepts`."""
    def accepts(case: dict) -> bool:
        job = make_job(case, workdir)
        return refusal(job.argv, job.world) is None
    return accepts


def refusal(argv: Sequence[str], world: int) -> Optional[list[str]]:
    """The start-up path's verdict without running anything: None if accepted, else its lines."""
    from megatron_pp.schedules.plugins import load_plugins
    from megatron_pp.training.arguments import build_parser, validate_args

    load_plugins(list(argv))
    args = build_parser().parse_args(list(argv))
    errors = validate_args(args, world_size=world)
    return errors or None


def flags_named(line: str, argv: Sequence[str]) -> list[str]:
    """The flags of `argv` that a refusal line names."""
    return [a for a in argv if a.startswith("--") and a in line]
