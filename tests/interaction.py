"""The interaction matrix's runs and checks (its cases: megatron_pp/testing/interaction.py).

`Runner(run_distributed, workdir).outcome(case)` checks one case and says "refused" or "ran": a refusal must be
one line naming a flag the case gave; a run (`pretrain`, two steps, on tests/dist.py's pool) must have finite
metrics that every rank agrees on, every parameter tensor changed by each applied step, and equal its reference:
fp32 one process computing each step's gradients from the same weights (`reference_step`, the loop of
tests/training/test_exactness_edges.py with every gradient tensor kept) and AdamW's update of the run's own
gradients (`adamw_steps`) under the house rule, bf16/fp16 the same precision's 1F1B run within LOW_PRECISION_TOL
and each step's weights AdamW's update of the run's own fp32 gradients, rounded to the model's dtype.
tests/training/test_interaction_matrix.py runs the default array; dev/interaction_matrix.py larger draws.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

from megatron_pp.testing.interaction import (LR, Job, flags_named, low_precision_reference_case, make_job,
                                             reference_argv, refusal)

TOL = 1e-5
# A step's update against AdamW's on the run's own gradients, element by element: |w - expected| within
# UPDATE_TOL x (|expected| + UPDATE_SCALE). The same update in another kernel (foreach, a flat ZeRO-1 shard)
# rounds differently by a few units of fp32's 6e-8 in the weight and in lr x g / (|g| + eps); a wrong update
# does far more: weight decay dropped is lr x wd = 1e-4 of the weight, a wrong rate or bias correction a part of
# lr = 1e-2, a lost or doubled microbatch a part of the gradient.
UPDATE_TOL, UPDATE_SCALE = 1e-6, LR
# bf16 and fp16 runs against the same precision's 1F1B run (relative, loss and gradient norm of both steps). Another
# schedule or layout sums the same products in another order and rounds other tensor shards, so correct runs
# differ by rounding: over the default array (docs/results/interaction_matrix.json) by at most 2.3e-4 (loss) and
# 8.3e-3 (norm) in bf16 (unit roundoff 2^-8 = 3.9e-3) and 5.6e-6 / 6.5e-4 in fp16 (2^-11 = 4.9e-4); a larger draw
# (--seed 11 --arrays 2, docs/results/interaction_matrix_seed11x2.json, 122 cases) by 2.9e-4 / 8.3e-3 and
# 7.2e-6 / 1.8e-3. The bounds are 3.6x or more those, and far below what a lost or doubled microbatch does: it moves the gradient by about 1/m
# (m = p + 1 <= 5, so >= 20%), as the bf16 zb-h1 fault would (it stops the run, also caught).
LOW_PRECISION_TOL = {"bf16": {"loss": 2e-3, "grad_norm": 3e-2}, "fp16": {"loss": 5e-4, "grad_norm": 1e-2}}
# A bf16 / fp16 step's update: the model's weights after each step against AdamW's update of the fp32 main weights
# from the run's own fp32 gradients (`adamw_steps`, from the model's weights before step 1, which the main weights
# copy), rounded to the model's dtype, element by element: |w - expected| within twice the dtype's unit roundoff
# x (|expected| + lr): one rounding to the model's dtype (at most u x |expected|) and the fp32 kernels' own
# rounding (UPDATE_TOL) beside it, so a correct run sits at or under half the bound. Adam's first step moves every
# element with a gradient by about lr, so an element's update lost, doubled or taken from another element misses
# by about lr / (|w| + lr) in this measure: ~0.3 for the tiny models' weights, 0.0099 for a norm scale at 1, against
# 0.0078 in bf16 (weight decay, 1e-4 of a weight, is below bf16's resolution: the fp32 cases hold it).
LOW_PRECISION_UPDATE_TOL = {"bf16": 2 * 2.0 ** -8, "fp16": 2 * 2.0 ** -11}

# The run -------------------------------------------------------------------------------------------------------


def run_job(ctx, argv: Sequence[str], capture_grads: bool) -> dict:
    """Worker side: `pretrain` for the job's steps; per step (loss, grad norm, skipped, lr), the parameters that
    did not change in it, and (`capture_grads`) every parameter's full reduced, unscaled fp32 gradient before the
    update and every parameter whole (in the model's dtype) before step 1 and after each step."""
    import torch

    from megatron_pp.training import train
    from megatron_pp.training.arguments import parse_args

    args = parse_args(list(argv))
    state = ctx.parallel_state(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    seen: dict = {}
    grads: list[dict] = []
    weights: list[dict] = []  # captured: every parameter whole, before step 1 and after each step
    unchanged: list[list[str]] = []
    build_pipeline, build_optimizer = train.build_job_pipeline, train.build_optimizer

    def named(pipe):
        return [(n, p) for chunk in pipe.chunks for n, p in chunk.named_parameters()]

    def snapshot():
        return {n: p.detach().clone() for n, p in named(seen["pipe"])}

    def capturing_pipeline(*a, **kw):
        pipe = seen["pipe"] = build_pipeline(*a, **kw)
        seen["before"], seen["host_bytes"] = snapshot(), 0
        if capture_grads:
            weights.append(_full_weights(pipe, state))
        run = pipe.executor.run

        def measured_run(*ra, **rkw):  # the most host memory the offload store held in any step
            result = run(*ra, **rkw)
            seen["host_bytes"] = max(seen["host_bytes"], getattr(result, "peak_host_bytes", 0) or 0)
            return result

        pipe.executor.run = measured_run
        return pipe

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
        if capture_grads:
            weights.append(_full_weights(seen["pipe"], state))
        now = snapshot()
        unchanged.append(sorted(n for n, p in now.items() if torch.equal(p, seen["before"][n])))
        seen["before"] = now

    train.build_job_pipeline, train.build_optimizer = capturing_pipeline, capturing_optimizer
    rows: list = []
    try:
        train.pretrain(args, state=state, on_iteration=lambda row: (after_iteration(row), rows.append(
            (row["loss"], row["grad_norm"], row["skipped"], row["lr"]))))
    finally:
        train.build_job_pipeline, train.build_optimizer = build_pipeline, build_optimizer
    keep = state.tp_rank == 0 and state.dp_rank == 0
    offloads = sum(a.op.value == "OFFLOAD" for a in seen["pipe"].schedule.actions[state.pp_rank])
    return {"rows": rows, "unchanged": unchanged, "grads": grads if keep else [], "pp_rank": state.pp_rank,
            "weights": weights if keep else [],
            "params": sorted(n for n, _ in named(seen["pipe"])), "offloads": offloads,
            "host_bytes": seen["host_bytes"]}


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


def _full_weights(pipe, state) -> dict:
    """Every parameter of this rank's chunks whole (tp shards concatenated; collective over tp)."""
    from megatron_pp.core.tensor_parallel import gather_tensor

    out = {}
    for chunk in pipe.chunks:
        for name, p in chunk.named_parameters():
            if getattr(p, "tensor_model_parallel", False):
                out[name] = gather_tensor(p.detach(), p.partition_dim, p.partition_stride, state.tp_group)
            else:
                out[name] = p.detach().clone()
    return out


def _reference_model(argv: Sequence[str], weights: Optional[dict] = None):
    """(args, the whole model in one process, in fp32, from the seed or from `weights`, its mock data)."""
    import torch

    from megatron_pp.models.transformer import build_model
    from megatron_pp.training.arguments import build_parser, model_config_from_args
    from megatron_pp.training.step_data import MockSplit

    args = build_parser().parse_args(list(argv))  # an fp32 job's flags: the model is built in fp32
    config = model_config_from_args(args)
    model = build_model(config, seed=args.seed)
    if weights is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(weights[name])
    return args, model, MockSplit(args.seed, config.seq_length, config.vocab_size)


def reference_step(argv: Sequence[str], step: int, weights: Optional[dict] = None) -> tuple:
    """(loss, grad norm, named gradients, the weights it started from) of one process computing step `step`'s
    (0-based) global batch in fp32 from `weights` (default: the seed's initial model), the loss as the job's:
    the per-token mean over the global batch (tests/training/test_exactness_edges.py's loop)."""
    args, model, split = _reference_model(argv, weights)
    gbs = args.global_batch_size
    batch = split.get_batch(range(step * gbs, (step + 1) * gbs))
    mask = batch["loss_mask"]
    loss = (model(None, batch).float() * mask).sum() / mask.sum()
    loss.backward()
    named = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    norm = math.sqrt(sum(float(g.double().square().sum()) for g in named.values()))
    return float(loss.detach()), norm, named, {n: p.detach().clone() for n, p in model.named_parameters()}


def adamw_steps(argv: Sequence[str], start: dict, grads: Sequence[dict], norms: Sequence[float],
                lrs: Sequence[float]) -> list[dict]:
    """The weights after each step of the job's optimizer applied to the given gradients from `start`: AdamW
    (torch's, betas 0.9 / 0.999, --adam-eps), weight decay on 2-D+ tensors, the gradients clipped to
    --clip-grad by the given norm (the job's: Megatron's clip factor clip / (norm + 1e-6)) and step k at lrs[k]."""
    import torch

    from megatron_pp.training.arguments import build_parser

    args = build_parser().parse_args(list(argv))
    params = {n: torch.nn.Parameter(w.clone()) for n, w in start.items()}
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params.values() if p.dim() > 1]},
         {"params": [p for p in params.values() if p.dim() <= 1], "weight_decay": 0.0}],
        lr=lrs[0], betas=(0.9, 0.999), eps=args.adam_eps, weight_decay=args.weight_decay, foreach=False)
    out = []
    for named, norm, lr in zip(grads, norms, lrs):
        scale = args.clip_grad / (norm + 1e-6) if args.clip_grad > 0 and norm > args.clip_grad else 1.0
        for name, p in params.items():
            p.grad = named[name] * scale
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        out.append({n: p.detach().clone() for n, p in params.items()})
    return out


# Checks ---------------------------------------------------------------------------------------------------------


def check_run(job: Job, results: list[dict], compare: Callable[[list[dict]], None]) -> None:
    """What every case must show: ranks agree, finite numbers, each applied step changed every parameter tensor
    (a skipped one none), every parameter present somewhere; then `compare` (exactness or tolerance)."""
    rows = results[0]["rows"]
    assert all(r["rows"] == rows for r in results), f"{job.name}: ranks disagree on the metrics"
    assert len(rows) == 2, f"{job.name}: {len(rows)} steps"
    for step, (loss, norm, skipped, _) in enumerate(rows, 1):
        assert math.isfinite(loss), f"{job.name}: step {step} loss {loss}"
        assert not skipped and math.isfinite(norm), f"{job.name}: step {step} skipped (grad norm {norm})"
    # An offload flag is not dropped on the way (issue 37 saw a schedule file run without its --offload-fraction):
    # the job's lists offload (1F1B offloads on ranks 0..p-3 only, so none at p = 2), and every rank whose list
    # offloads held stashes in host memory (the models are sized so that every stash has something to move).
    settings = job.settings
    if settings["offload"] != "none" and not (settings["schedule"] == "1f1b" and settings["layout"][1] == 2):
        assert sum(r["offloads"] for r in results), f"{job.name}: --offload-{settings['offload']} offloads nothing"
    for r in results:
        assert not r["offloads"] or r["host_bytes"] > 0, f"{job.name}: rank {r['pp_rank']} offloads, moved nothing"
    if job.settings["schedule"] == "2bw":
        # 2BW's rows come when its deferred update has run, not after each step's own update (two steps: both
        # updates run in the job's last call), so the check is over the job: every tensor moved in some step.
        for r in results:
            never = sorted(set(r["unchanged"][0]).intersection(*r["unchanged"][1:]))
            assert never == [], f"{job.name}: rank {r['pp_rank']}: never changed {never[:4]}"
        compare(results)
        return
    for r in results:
        for step, names in enumerate(r["unchanged"], 1):
            assert names == [], f"{job.name}: step {step}, rank {r['pp_rank']}: unchanged {names[:4]}"
    compare(results)


def merged(results: list[dict], key: str, index: int) -> dict:
    """Step `index`'s `key` ("grads", "weights") of every rank, by name; a tied embedding's two copies equal."""
    import torch

    out: dict = {}
    for r in results:
        for name, t in (r[key][index] if len(r[key]) > index else {}).items():
            if name in out:
                assert torch.equal(out[name], t), f"{key}[{index}]: the copies of {name} differ"
            out[name] = t
    return out


def exact_compare(job: Job, ref: list, seen: Optional[dict] = None) -> Callable[[list[dict]], None]:
    """fp32, the house rule, from the same weights at each step: `ref` is step 1 from the seed's initial model and
    step 2 from the run's own weights after step 1 (`reference_step`). Each step's loss, gradient norm and every
    gradient tensor within TOL relative; the run starts from the seed's model bit for bit; and each step's
    update is AdamW's on the run's own gradients (`adamw_steps`) element by element within UPDATE_TOL.
    Comparing step 2 against a reference that went on from its own step 1 instead (to 1e-4 on the norm before
    this) depends on luck: Adam's first step moves an element by lr x g / (|g| + eps), whose slope at g = 0 is
    lr / eps = 1e6 here, so a gradient element within rounding of zero moves by up to lr either way
    (docs/reliability.md, "The interaction matrix"). 2BW: step 1 only, the only step whose weights a flushed
    loop shares (its optimizer is not the one run_job captures gradients from). `seen` gets the largest relative
    gradient-tensor and update-element errors ("gradient", "update")."""
    import torch

    seen = {} if seen is None else seen

    def compare(results: list[dict]) -> None:
        rows = results[0]["rows"]
        two_bw = job.settings["schedule"] == "2bw"
        for step in range(1 if two_bw else 2):
            ref_loss, ref_norm = ref[step][:2]
            loss, norm = rows[step][:2]
            assert abs(loss - ref_loss) <= TOL * abs(ref_loss), f"{job.name}: step {step + 1} loss {loss} vs {ref_loss}"
            assert abs(norm - ref_norm) <= TOL * ref_norm, f"{job.name}: step {step + 1} grad norm {norm} vs {ref_norm}"
        if two_bw:
            return
        grads = [merged(results, "grads", k) for k in range(2)]
        for step in range(2):
            ref_grads = ref[step][2]
            assert set(grads[step]) == set(ref_grads), f"{job.name}: names differ {set(grads[step]) ^ set(ref_grads)}"
            for name, g_ref in ref_grads.items():
                err = float((grads[step][name] - g_ref).norm() / g_ref.norm())
                seen["gradient"] = max(seen.get("gradient", 0.0), err)
                assert err <= TOL, f"{job.name}: step {step + 1}: gradient of {name} off by {err:.2e}"
        weights = [merged(results, "weights", k) for k in range(3)]
        for name, w in ref[0][3].items():
            assert torch.equal(weights[0][name], w), f"{job.name}: {name} does not start from the seed's model"
        expected = adamw_steps(job.argv, weights[0], grads, [row[1] for row in rows], [row[3] for row in rows])
        for step in range(2):
            for name, e in expected[step].items():
                err = float(((weights[step + 1][name] - e).abs() / (e.abs() + UPDATE_SCALE)).max())
                seen["update"] = max(seen.get("update", 0.0), err)
                assert err <= UPDATE_TOL, f"{job.name}: step {step + 1}'s update of {name} off by {err:.2e}"
    return compare


def tolerance_compare(job: Job, ref_rows: list, seen: Optional[dict] = None) -> Callable[[list[dict]], None]:
    """bf16 / fp16: loss and gradient norm of both steps within LOW_PRECISION_TOL of the 1F1B run, and (but 2BW,
    whose rows come after its deferred update) each step's update AdamW's of the run's own gradients within
    LOW_PRECISION_UPDATE_TOL. `seen` gets the largest relative update-element error ("update")."""
    tol = LOW_PRECISION_TOL[job.settings["precision"]]
    seen = {} if seen is None else seen

    def compare(results: list[dict]) -> None:
        rows = results[0]["rows"]
        two_bw = job.settings["schedule"] == "2bw"
        for step in range(1 if two_bw else 2):
            (loss, norm), (ref_loss, ref_norm) = rows[step][:2], ref_rows[step][:2]
            assert abs(loss - ref_loss) <= tol["loss"] * abs(ref_loss), \
                f"{job.name}: step {step + 1} loss {loss} vs 1F1B's {ref_loss}"
            assert abs(norm - ref_norm) <= tol["grad_norm"] * abs(ref_norm), \
                f"{job.name}: step {step + 1} grad norm {norm} vs 1F1B's {ref_norm}"
        if not two_bw:
            low_precision_update_check(job, results, seen)
    return compare


def low_precision_update_check(job: Job, results: list[dict], seen: dict) -> None:
    """Each step's weights (in the model's dtype) are AdamW's update of the fp32 main weights by the run's own
    fp32 gradients, rounded, element by element within LOW_PRECISION_UPDATE_TOL (see there)."""
    grads = [merged(results, "grads", k) for k in range(2)]
    weights = [merged(results, "weights", k) for k in range(3)]
    every = set().union(*(r["params"] for r in results))
    assert set(grads[0]) == set(grads[1]) == set(weights[0]) == every, f"{job.name}: a parameter was not captured"
    start = {n: w.float() for n, w in weights[0].items()}
    rows = results[0]["rows"]
    expected = adamw_steps(job.argv, start, grads, [row[1] for row in rows], [row[3] for row in rows])
    tol = LOW_PRECISION_UPDATE_TOL[job.settings["precision"]]
    for step in range(2):
        for name, e in expected[step].items():
            w = weights[step + 1][name]
            err = float(((w.float() - e).abs() / (e.abs() + UPDATE_SCALE)).max())
            seen["update"] = max(seen.get("update", 0.0), err)
            assert err <= tol, f"{job.name}: step {step + 1}'s update of {name} off by {err:.2e} (bound {tol:.1e})"


class Runner:
    """Runs jobs on a `run_distributed(world, fn, *args)` pool, caching the references."""

    def __init__(self, run_distributed: Callable, workdir: str) -> None:
        self.run_distributed = run_distributed
        self.workdir = workdir
        self._fp32: dict = {}
        self._low: dict = {}
        self.deviations: dict[str, dict[str, float]] = {}
        """Per case run, the largest relative difference of its loss and gradient norm from its reference's
        (the steps compared): what LOW_PRECISION_TOL is set from."""

    def outcome(self, case: dict) -> str:
        """'refused' (after checking the line) or 'ran' (after checking the run); raises AssertionError."""
        job = make_job(case, self.workdir)
        lines = refusal(job.argv, job.world)
        if lines is not None:
            assert len(lines) == 1, f"{job.name}: refused in {len(lines)} lines: {lines}"
            assert flags_named(lines[0], job.argv), f"{job.name}: refusal names none of its flags: {lines[0]}"
            return "refused"
        fp32 = case["precision"] == "fp32"
        steps = 1 if case["schedule"] == "2bw" else 2
        results = self.run_distributed(job.world, run_job, list(job.argv), True)
        if fp32:  # step 1 from the seed's model; step 2 from the run's weights after step 1
            ref = [self._fp32_reference(job)]
            if steps == 2:
                after_step1 = merged(results, "weights", 1)
                ref.append(reference_step(job.argv, 1, after_step1) if after_step1 else (math.nan, math.nan, {}, {}))
        else:
            ref = self._low_reference(case)
        deviation = self.deviations[job.name] = {
            key: max(abs(row[i] - r[i]) / abs(r[i]) for row, r in zip(results[0]["rows"][:steps], ref))
            for i, key in enumerate(("loss", "grad_norm"))}
        check_run(job, results, exact_compare(job, ref, deviation) if fp32 else tolerance_compare(job, ref, deviation))
        return "ran"

    def _fp32_reference(self, job: Job) -> tuple:
        key = (job.settings["model"], job.settings["embeddings"], job.settings["attention"],
               job.argv[job.argv.index("--num-layers") + 1], job.argv[job.argv.index("--global-batch-size") + 1])
        if key not in self._fp32:
            self._fp32[key] = reference_step(job.argv, 0)
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
