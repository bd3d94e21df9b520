"""The interaction matrix: cases over the factors that meet in one training job, every pair of levels covered.

Factors (levels): precision (fp32, bf16, fp16 with dynamic loss scaling from 4096), schedule (every registered
schedule, a schedule file, a plugin), layout (tp x pp x dp, world <= 4), virtual stages per rank (1, 2), sequence
parallelism, recompute (none, selective, full), offload (none, `--offload-chunks 1`, `--offload-fraction 0.5`),
distributed optimizer, embeddings (tied, untied), attention (MHA, GQA) and model family (gpt-tiny, llama-tiny).

How the array is built (`covering_array`), deterministic for a seed: the feasible pairs of levels are every pair
that some feasible full case contains (found by enumerating all of them, 110,592 rows of which the constraints
keep a fraction); while one is uncovered, a new row starts from the first uncovered pair in a fixed order, then
fills the other factors one by one (in an order drawn from the seed) with the level that covers the most
uncovered pairs against the levels already chosen, among the levels that keep the row feasible (ties: the
lowest level index). `candidates` rows are drawn per step (different factor orders) and the one covering most
is kept. This is the AETG idea (Cohen et al., 1997) in its plainest form; a row always covers its seed pair,
so the loop ends, and tests/training/test_interaction_matrix.py checks every feasible pair is covered.

Constraints (`infeasible`) are only those that hold by construction, each counted by `skipped_pairs`: what a
schedule declares in the registry (no virtual stages, exactly two chunks, which options it takes), sequence
parallelism without tensor parallelism, and llama-tiny has no flag that ties its embeddings. What the code
refuses beyond that is an outcome each case checks (`refusal`): one line that names a flag the case gave.

A case runs the real job (`pretrain`, argument checks included) for two steps on a gloo world from
tests/dist.py's pool, gpt-tiny / llama-tiny shrunk to hidden 32, 4 heads, sequence 16, one layer per stage.
fp32 cases equal a single-process AdamW loop (`reference`): loss and every gradient tensor within 1e-5
relative at both steps (step 2 checks the update). bf16 and fp16 cases equal the same precision's 1F1B run
(pp 2, tp 1, dp 1, nothing else) within LOW_PRECISION_TOL (see there). Every case's losses and gradient norms
are finite, and every parameter tensor changed in a step that was applied (none in a skipped fp16 step).
dev/interaction_matrix.py draws larger arrays (other seeds, several arrays) and runs them the same way.
"""
from __future__ import annotations

import itertools
import math
import os
import random
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN = os.path.join(ROOT, "tests", "interaction_plugin.py")
PLUGIN_SCHEDULE = "matrix-plugin"
FILE_LEVEL, PLUGIN_LEVEL = "file", "plugin"
SEED = 7
LR, CLIP, WEIGHT_DECAY = 1e-2, 1.0, 0.01
TOL = 1e-5
# bf16 keeps 8 significant bits (unit roundoff 2^-9 ~ 2e-3), fp16 11 (2^-12 ~ 2.4e-4). A different schedule or
# layout sums the same products in another order and rounds the activations of other tensor shards, so two
# correct runs differ by a few roundoffs per layer: measured up to ~1e-3 relative on these models' loss. A
# factor ~10 over that for the loss, and 5e-2 for the gradient norm (a sum over every tensor, where bf16's
# error in the small ones adds up), still catch a lost or doubled microbatch (>= 1/m of the gradient, m <= 5).
LOW_PRECISION_TOL = {"loss": 1e-2, "grad_norm": 5e-2}
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

    return [e for e in registered_schedules() if getattr(e.builder, "__module__", "").startswith("megatron_pp.")]


_BUILTIN = _builtin_entries()


def _schedule_traits(name: str) -> tuple[Optional[bool], Optional[int], tuple]:
    """(supports virtual stages, fixed chunks per rank, option names) as the schedule declares them."""
    if name == FILE_LEVEL:  # a file holds any chunk count; the file job takes the offload flags
        return True, None, ("offload_chunks", "offload_fraction")
    if name == PLUGIN_LEVEL:  # tests/interaction_plugin.py
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


def covering_array(seed: int = SEED, candidates: int = 4, table: Optional[dict] = None) -> list[dict]:
    """Cases (factor name -> level) covering every feasible pair of levels; see the module docstring."""
    space = _Space(table or factors())
    rng = random.Random(seed)
    uncovered = space.feasible_pairs()
    rows = []
    while uncovered:
        i, a, j, b = min(uncovered)
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
        uncovered -= set(_pairs(best))
        rows.append(_as_case(space.names, space.levels, best))
    return rows


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
        s = self.settings
        tp, pp, dp = s["layout"]
        return (f"{s['precision']}-{s['schedule']}-tp{tp}pp{pp}dp{dp}v{s['virtual']}"
                f"{'-sp' if s['sequence_parallel'] else ''}-rc:{s['recompute']}-off:{s['offload']}"
                f"{'-zero1' if s['distributed_optimizer'] else ''}-{s['embeddings']}-{s['attention']}-{s['model']}")


def microbatches(pp: int) -> int:
    """m = p + 1: not a multiple of p, so every schedule's uneven tail runs, and small."""
    return pp + 1


def model_flags(case: dict) -> list[str]:
    """The smallest models: the preset at hidden 32, 4 heads, sequence 16, one layer per pipeline stage."""
    tp, pp, dp = case["layout"]
    flags = ["--model-preset", case["model"], "--num-layers", str(pp * case["virtual"]), "--hidden-size", "32",
             "--num-attention-heads", "4", "--ffn-hidden-size", "64", "--seq-length", "16",
             "--max-position-embeddings", "16"]
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


# The run -------------------------------------------------------------------------------------------------------


def run_job(ctx, argv: Sequence[str], capture_grads: bool) -> dict:
    """Worker side: `pretrain` for the job's steps; per step (loss, grad norm, skipped), the parameters that did
    not change in it, and (fp32) every parameter's full reduced, unscaled gradient before the update."""
    import torch

    from megatron_pp.training import train
    from megatron_pp.training.arguments import parse_args

    args = parse_args(list(argv))
    state = ctx.parallel_state(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    seen: dict = {}
    grads: list[dict] = []
    unchanged: list[list[str]] = []
    build_pipeline, build_optimizer = train.build_pipeline, train.build_optimizer

    def named(pipe):
        return [(n, p) for chunk in pipe.chunks for n, p in chunk.named_parameters()]

    def snapshot():
        return {n: p.detach().clone() for n, p in named(seen["pipe"])}

    def capturing_pipeline(*a, **kw):
        seen["pipe"] = build_pipeline(*a, **kw)
        seen["before"] = snapshot()
        return seen["pipe"]

    def capturing_optimizer(*a, **kw):
        optimizer = build_optimizer(*a, **kw)
        inner_step = optimizer.step

        def step(*a, **kw):
            if capture_grads:
                grads.append(_full_grads(seen["pipe"], optimizer, state))
            return inner_step(*a, **kw)

        optimizer.step = step
        return optimizer

    def after_iteration(row):
        now = snapshot()
        unchanged.append(sorted(n for n, p in now.items() if torch.equal(p, seen["before"][n])))
        seen["before"] = now

    train.build_pipeline, train.build_optimizer = capturing_pipeline, capturing_optimizer
    rows: list = []
    try:
        train.pretrain(args, state=state, on_iteration=lambda row: (after_iteration(row), rows.append(
            (row["loss"], row["grad_norm"], row["skipped"]))))
    finally:
        train.build_pipeline, train.build_optimizer = build_pipeline, build_optimizer
    keep = state.tp_rank == 0 and state.dp_rank == 0
    return {"rows": rows, "unchanged": unchanged, "grads": grads if keep else [], "pp_rank": state.pp_rank,
            "params": sorted(n for n, _ in named(seen["pipe"]))}


def _full_grads(pipe, optimizer, state) -> dict:
    """Every parameter's whole gradient (dp shards gathered, tp shards concatenated), divided by the loss scale."""
    import torch

    from megatron_pp.core.tensor_parallel import gather_tensor

    reducer = optimizer.reducer
    where = {id(p): (b, off) for b in reducer.buckets for p, off in zip(b.params, b.offsets)}
    full = {}
    for bucket in reducer.buckets:
        if bucket.shard_end - bucket.shard_start == bucket.grad.numel() or state.dp_size == 1:
            full[bucket.index] = bucket.grad.clone()
        else:
            shard = bucket.grad[bucket.shard_start:bucket.shard_end]
            parts = [torch.empty_like(shard) for _ in range(state.dp_size)]
            torch.distributed.all_gather(parts, shard.contiguous(), group=state.dp_group)
            full[bucket.index] = torch.cat(parts)
    out = {}
    for chunk in pipe.chunks:
        for name, p in chunk.named_parameters():
            bucket, offset = where[id(p)]
            g = full[bucket.index][offset:offset + p.numel()].view(p.shape) / optimizer.loss_multiplier
            if getattr(p, "tensor_model_parallel", False):
                g = gather_tensor(g, p.partition_dim, p.partition_stride, state.tp_group)
            out[name] = g.clone()
    return out


def reference(argv: Sequence[str], steps: int = 2) -> list[tuple[float, float, dict]]:
    """Per step (loss, grad norm, named gradients) of one process training the whole global batch in fp32 with
    the job's AdamW, weight decay on 2-D+ tensors and clipping (tests/training/test_exactness_edges.py's loop)."""
    import torch

    from megatron_pp.models.transformer import build_model
    from megatron_pp.training.arguments import build_parser, model_config_from_args
    from megatron_pp.training.step_data import MockSplit

    args = build_parser().parse_args(list(argv))  # an fp32 job's flags: the model is built in fp32
    config = model_config_from_args(args)
    model = build_model(config, seed=args.seed)
    split = MockSplit(args.seed, config.seq_length, config.vocab_size)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() > 1]},
         {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=args.weight_decay)
    gbs, out = args.global_batch_size, []
    for step in range(steps):
        batch = split.get_batch(range(step * gbs, (step + 1) * gbs))
        optimizer.zero_grad(set_to_none=True)
        mask = batch["loss_mask"]
        loss = (model(None, batch).float() * mask).sum() / mask.sum()
        loss.backward()
        named = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in params))
        if norm > args.clip_grad:
            for p in params:
                p.grad.mul_(args.clip_grad / (norm + 1e-6))
        optimizer.step()
        out.append((float(loss.detach()), norm, named))
    return out


# Checks ---------------------------------------------------------------------------------------------------------


def check_run(job: Job, results: list[dict], compare: Callable[[list[dict]], None]) -> None:
    """What every case must show: ranks agree, finite numbers, each applied step changed every parameter tensor
    (a skipped one none), every parameter present somewhere; then `compare` (exactness or tolerance)."""
    rows = results[0]["rows"]
    assert all(r["rows"] == rows for r in results), f"{job.name}: ranks disagree on the metrics"
    assert len(rows) == 2, f"{job.name}: {len(rows)} steps"
    for step, (loss, norm, skipped) in enumerate(rows, 1):
        assert math.isfinite(loss), f"{job.name}: step {step} loss {loss}"
        assert not skipped and math.isfinite(norm), f"{job.name}: step {step} skipped (grad norm {norm})"
    schedule = job.settings["schedule"]
    for r in results:
        for step, names in enumerate(r["unchanged"], 1):
            # 2BW applies step t's gradient during step t + 1 (W(t+1) = W(t) - lr g(W(t-1))): nothing moves in step 1.
            expected = r["params"] if (schedule == "2bw" and step == 1) else []
            assert names == expected, f"{job.name}: step {step}, rank {r['pp_rank']}: unchanged {names[:4]}"
    compare(results)


def exact_compare(job: Job, ref: list) -> Callable[[list[dict]], None]:
    """fp32, the house rule: step 1's loss and every gradient tensor within 1e-5 relative; step 2's loss and
    gradient norm too (tests/training/test_exactness_edges.py's criterion), which checks the update. Step 2's
    tensors are not compared one by one: Adam's first step moves an element by about lr x sign(g), so a gradient
    element within rounding of zero can move either way, and that element's effect on a small tensor's next
    gradient is not a bug (measured: 5e-5 on one LayerNorm weight of a correct run). 2BW: step 1 only, the only
    step whose weights a flushed loop shares."""
    import torch

    def compare(results: list[dict]) -> None:
        rows = results[0]["rows"]
        for step in range(1 if job.settings["schedule"] == "2bw" else 2):
            ref_loss, ref_norm, _ = ref[step]
            loss, norm, _ = rows[step]
            assert abs(loss - ref_loss) <= TOL * abs(ref_loss), f"{job.name}: step {step + 1} loss {loss} vs {ref_loss}"
            assert abs(norm - ref_norm) <= TOL * ref_norm, f"{job.name}: step {step + 1} grad norm {norm} vs {ref_norm}"
        merged: dict = {}
        for r in results:
            for name, g in (r["grads"][0] if r["grads"] else {}).items():
                if name in merged:  # a tied embedding's two copies
                    assert torch.equal(merged[name], g), f"{job.name}: copies of {name} differ"
                merged[name] = g
        ref_grads = ref[0][2]
        assert set(merged) == set(ref_grads), f"{job.name}: names differ {set(merged) ^ set(ref_grads)}"
        for name, g_ref in ref_grads.items():
            err = float((merged[name] - g_ref).norm() / g_ref.norm())
            assert err <= TOL, f"{job.name}: gradient of {name} off by {err:.2e}"
    return compare


def tolerance_compare(job: Job, ref_rows: list) -> Callable[[list[dict]], None]:
    """bf16 / fp16: loss and gradient norm of both steps within LOW_PRECISION_TOL of the 1F1B run."""
    def compare(results: list[dict]) -> None:
        steps = 1 if job.settings["schedule"] == "2bw" else 2
        for step in range(steps):
            (loss, norm, _), (ref_loss, ref_norm, _) = results[0]["rows"][step], ref_rows[step]
            assert abs(loss - ref_loss) <= LOW_PRECISION_TOL["loss"] * abs(ref_loss), \
                f"{job.name}: step {step + 1} loss {loss} vs 1F1B's {ref_loss}"
            assert abs(norm - ref_norm) <= LOW_PRECISION_TOL["grad_norm"] * abs(ref_norm), \
                f"{job.name}: step {step + 1} grad norm {norm} vs 1F1B's {ref_norm}"
    return compare


class Runner:
    """Runs jobs on a `run_distributed(world, fn, *args)` pool, caching the references."""

    def __init__(self, run_distributed: Callable, workdir: str) -> None:
        self.run_distributed = run_distributed
        self.workdir = workdir
        self._fp32: dict = {}
        self._low: dict = {}

    def outcome(self, case: dict) -> str:
        """'refused' (after checking the line) or 'ran' (after checking the run); raises AssertionError."""
        job = make_job(case, self.workdir)
        lines = refusal(job.argv, job.world)
        if lines is not None:
            assert len(lines) == 1, f"{job.name}: refused in {len(lines)} lines: {lines}"
            assert flags_named(lines[0], job.argv), f"{job.name}: refusal names none of its flags: {lines[0]}"
            return "refused"
        fp32 = case["precision"] == "fp32"
        results = self.run_distributed(job.world, run_job, list(job.argv), fp32)
        check_run(job, results, exact_compare(job, self._fp32_reference(job)) if fp32
                  else tolerance_compare(job, self._low_reference(case)))
        return "ran"

    def _fp32_reference(self, job: Job) -> list:
        key = (job.settings["model"], job.settings["embeddings"], job.settings["attention"],
               job.argv[job.argv.index("--num-layers") + 1], job.argv[job.argv.index("--global-batch-size") + 1])
        if key not in self._fp32:
            self._fp32[key] = reference(job.argv)
        return self._fp32[key]

    def _low_reference(self, case: dict) -> list:
        ref = low_precision_reference_case(case)
        key = tuple(sorted((k, v) for k, v in ref.items()))
        if key not in self._low:
            argv = reference_argv(ref, self.workdir)
            results = self.run_distributed(2, run_job, argv, False)
            rows = results[0]["rows"]
            assert all(math.isfinite(x) for row in rows for x in row[:2]), f"1F1B reference {ref}: {rows}"
            self._low[key] = rows
        return self._low[key]
