"""The project's central test: every exact schedule reproduces the single-process loss and gradients.

For each case, the reference is a plain loop in this (parent) process: the whole model built as one
stage, every sample of the global batch, per-token mean loss, one backward. The pipelined run executes
the schedule's validated action lists on a gloo world (tp x pp x dp), then the test gathers each
parameter's full gradient (TP shards concatenated, every pipeline rank's stages merged by global name)
and compares: loss relative difference <= 1e-5, per tensor ||g - g_ref|| / ||g_ref|| <= 1e-5, fp32,
dropout 0.

The same worker run also reports each pipeline rank's measured peak stash (count and bytes), which is
checked against the simulator of the very same schedule object.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_pp.core.tensor_parallel import gather_tensor
from megatron_pp.data.mock import MockData
from megatron_pp.models.presets import get_preset
from megatron_pp.models.transformer import build_model
from megatron_pp.schedules.registry import build_schedule
from megatron_pp.schedules.simulate import simulate
from megatron_pp.training.train import build_pipeline, step_metrics, train_step
from tests.dist import run_distributed

SEED = 1234
MICRO_BATCH = 2
TOL = 1e-5


def _config(preset: str, num_layers: int):
    return dataclasses.replace(get_preset(preset), num_layers=num_layers)


def reference(preset: str, num_layers: int, global_batch: int):
    """Single-process loss and named gradients of the global batch's per-token mean loss."""
    config = _config(preset, num_layers)
    model = build_model(config, seed=SEED)
    data = MockData(SEED, config.seq_length, config.vocab_size, MICRO_BATCH, global_batch, dp_size=1)
    batches = data.step_microbatches(0, dp_rank=0)
    tokens = sum(float(b["loss_mask"].sum()) for b in batches)
    total = 0.0
    for batch in batches:
        loss = (model(None, batch).float() * batch["loss_mask"]).sum() / tokens
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def pipeline_run(ctx, preset, num_layers, tp, pp, schedule_name, m, v, sequence_parallel=False, options=None,
                 layout=None):
    """Worker side: one training step's loss, full named gradients (from tp/dp rank 0) and stash peaks.
    `options` go to the schedule builder, `layout` (e.g. account_for_embedding=True) to build_pipeline."""
    state = ctx.parallel_state(tp, pp)
    config = _config(preset, num_layers)
    schedule = build_schedule(schedule_name, pp, m, v, **(options or {}))
    pipe = build_pipeline(config, state, schedule, micro_batch_size=MICRO_BATCH, seed=SEED,
                          sequence_parallel=sequence_parallel, **(layout or {}))
    data = MockData(SEED, config.seq_length, config.vocab_size, MICRO_BATCH, MICRO_BATCH * m * state.dp_size, state.dp_size)
    result, tokens = train_step(pipe, data.step_microbatches(0, state.dp_rank))
    loss = step_metrics(pipe, result, tokens).loss
    grads = {}
    for chunk in pipe.chunks:
        for name, p in chunk.named_parameters():
            g = p.grad.detach()
            if getattr(p, "tensor_model_parallel", False):
                g = gather_tensor(g, p.partition_dim, p.partition_stride, state.tp_group)
            grads[name] = g
    keep = state.tp_rank == 0 and state.dp_rank == 0
    return {
        "loss": loss,
        "grads": grads if keep else {},
        "pp_rank": state.pp_rank,
        "peak_count": result.peak_stash_count,
        "peak_bytes": result.peak_stash_bytes,
        "peak_host_bytes": result.peak_host_bytes,
    }


def check(results, ref_loss, ref_grads, case):
    losses = {r["loss"] for r in results}
    assert len(losses) == 1, f"{case}: ranks disagree on the loss {losses}"
    loss = losses.pop()
    assert abs(loss - ref_loss) <= TOL * abs(ref_loss), f"{case}: loss {loss} vs reference {ref_loss}"
    merged = {}
    for r in results:
        for name, g in r["grads"].items():
            if name in merged:  # the tied embedding copy on the last stage must equal the first's
                assert torch.equal(merged[name], g), f"{case}: copies of {name} differ"
            merged[name] = g
    assert set(merged) == set(ref_grads), f"{case}: parameter names differ: {set(merged) ^ set(ref_grads)}"
    for name, ref in ref_grads.items():
        err = (merged[name] - ref).norm() / ref.norm()
        assert err <= TOL, f"{case}: gradient of {name} off by {err:.2e}"


# (preset, layers, tp, pp, schedule, m, v, sequence_parallel), grouped by world size.
WORLD2 = [
    ("gpt-tiny", 4, 1, 2, "gpipe", 2, 1, False),
    ("llama-tiny", 4, 1, 2, "gpipe", 3, 1, False),
    ("gpt-tiny", 4, 1, 2, "1f1b", 2, 1, False),
    ("gpt-tiny", 4, 1, 2, "1f1b", 4, 1, False),
    ("llama-tiny", 4, 1, 2, "1f1b", 3, 1, False),
    ("gpt-tiny", 4, 1, 2, "interleaved-1f1b", 2, 2, False),
    ("llama-tiny", 4, 1, 2, "interleaved-1f1b", 4, 2, False),
    ("gpt-tiny", 4, 1, 2, "interleaved-1f1b", 3, 2, False),
    ("gpt-tiny", 4, 2, 1, "1f1b", 2, 1, True),
]
WORLD4 = [
    ("gpt-tiny", 4, 1, 4, "1f1b", 4, 1, False),
    ("llama-tiny", 4, 1, 4, "1f1b", 8, 1, False),
    ("gpt-tiny", 4, 1, 4, "1f1b", 5, 1, False),
    ("llama-tiny", 4, 1, 4, "gpipe", 4, 1, False),
    ("gpt-tiny", 8, 1, 4, "interleaved-1f1b", 4, 2, False),
    ("llama-tiny", 8, 1, 4, "interleaved-1f1b", 8, 2, False),
    ("gpt-tiny", 4, 2, 2, "1f1b", 4, 1, False),
    ("llama-tiny", 4, 2, 2, "1f1b", 2, 1, True),
    ("gpt-tiny", 8, 2, 2, "interleaved-1f1b", 4, 2, True),
    ("gpt-tiny", 4, 1, 2, "1f1b", 2, 1, False),  # dp = 2
    ("llama-tiny", 8, 1, 2, "interleaved-1f1b", 2, 2, False),  # dp = 2
    ("gpt-tiny", 4, 1, 2, "gpipe", 3, 1, False),  # dp = 2
    ("llama-tiny", 4, 2, 2, "gpipe", 2, 1, True),
]

_REF_CACHE: dict = {}


def _reference_cached(preset, layers, global_batch):
    key = (preset, layers, global_batch)
    if key not in _REF_CACHE:
        _REF_CACHE[key] = reference(preset, layers, global_batch)
    return _REF_CACHE[key]


def _run_case(world, case):
    preset, layers, tp, pp, name, m, v, sp = case
    dp = world // (tp * pp)
    results = run_distributed(world, pipeline_run, preset, layers, tp, pp, name, m, v, sp)
    ref_loss, ref_grads = _reference_cached(preset, layers, MICRO_BATCH * m * dp)
    check(results, ref_loss, ref_grads, case)
    return results


@pytest.mark.parametrize("case", WORLD2, ids=lambda c: f"{c[0]}-L{c[1]}-tp{c[2]}-pp{c[3]}-{c[4]}-m{c[5]}-v{c[6]}{'-sp' if c[7] else ''}")
def test_exact_world2(case):
    _run_case(2, case)


@pytest.mark.parametrize("case", WORLD4, ids=lambda c: f"{c[0]}-L{c[1]}-tp{c[2]}-pp{c[3]}-{c[4]}-m{c[5]}-v{c[6]}{'-sp' if c[7] else ''}")
def test_exact_world4(case):
    _run_case(4, case)


@pytest.mark.parametrize("name,pp,m,v", [("1f1b", 4, 8, 1), ("gpipe", 4, 4, 1), ("interleaved-1f1b", 4, 8, 2)])
def test_measured_stash_peaks_match_simulator(name, pp, m, v):
    """Real executor peaks (count per pipeline rank) equal the simulator's on the same schedule, and
    the bytes equal count x one stash's bytes on that rank."""
    layers = 4 * v
    results = run_distributed(4, pipeline_run, "gpt-tiny", layers, 1, pp, name, m, v)
    sim = simulate(build_schedule(name, pp, m, v))
    for r in results:
        assert r["peak_count"] == sim.peak_stash[r["pp_rank"]], (name, r["pp_rank"])
    one = one_stash_bytes("gpt-tiny", layers, pp, v)
    for r in results:
        if v == 1:
            assert r["peak_bytes"] == r["peak_count"] * one[r["pp_rank"]], (name, r["pp_rank"])


def one_stash_bytes(preset, layers, pp, v):
    """Bytes saved for backward by one microbatch on each pipeline rank's (single) chunk, measured alone."""
    from megatron_pp.models.layout import split_layers
    from megatron_pp.models.transformer import StageModel
    from megatron_pp.schedules.store import ActivationStore

    config = _config(preset, layers)
    data = MockData(SEED, config.seq_length, config.vocab_size, MICRO_BATCH, MICRO_BATCH)
    batch = data.microbatch(0, 0, 0)
    out = []
    for spec in split_layers(layers, pp, v)[:pp]:
        model = StageModel(config, spec, seed=SEED)
        store = ActivationStore(list(model.parameters()) + list(model.buffers()))
        x = None if spec.has_embedding else torch.randn(config.seq_length, MICRO_BATCH, config.hidden_size, requires_grad=True)
        with store.stash(0):
            y = model(x, batch)
            if spec.has_head:
                (y.float() * batch["loss_mask"]).sum()
        out.append(store.live_bytes)
    return out


# PipeOffload (arXiv 2503.01328): the GIS family with and without host offload, and 1F1B + offload. One layer
# per chunk where layers = p·v. (preset, layers, tp, pp, schedule, m, v, options), grouped by world size.
PIPEOFFLOAD_WORLD2 = [
    ("gpt-tiny", 4, 1, 2, "gis", 4, 2, {}),
    ("llama-tiny", 8, 1, 2, "gis-h", 4, 4, {}),  # p = 2: GIS-H is the uniform order
    ("gpt-tiny", 4, 1, 2, "po-h", 4, 2, {}),
    ("llama-tiny", 8, 1, 2, "po-f", 3, 4, {}),
    ("gpt-tiny", 4, 1, 2, "gis", 4, 2, {"interleave_group_size": 1, "offload_fraction": 1.0}),
    ("gpt-tiny", 4, 1, 2, "gis", 3, 2, {}),  # odd m: a short last group
]
PIPEOFFLOAD_WORLD4 = [
    ("gpt-tiny", 8, 1, 4, "gis", 8, 2, {}),
    ("llama-tiny", 16, 1, 4, "gis-h", 8, 4, {}),
    ("gpt-tiny", 16, 1, 4, "po-h", 4, 4, {}),
    ("gpt-tiny", 16, 1, 4, "po-f", 8, 4, {}),
    ("llama-tiny", 4, 1, 4, "1f1b", 8, 1, {"offload_chunks": 1}),
    ("gpt-tiny", 8, 2, 2, "po-f", 4, 2, {}),  # tp = 2
    ("gpt-tiny", 8, 2, 2, "gis", 4, 2, {}),  # tp = 2
    ("llama-tiny", 8, 1, 2, "gis", 4, 2, {}),  # dp = 2
    ("gpt-tiny", 4, 1, 2, "po-f", 4, 2, {}),  # dp = 2
]


def _pipeoffload_id(c):
    return f"{c[0]}-L{c[1]}-tp{c[2]}-pp{c[3]}-{c[4]}-m{c[5]}-v{c[6]}" + "".join(f"-{k}={v}" for k, v in c[7].items())


def _run_pipeoffload(world, case, layout=None, sequence_parallel=False):
    preset, layers, tp, pp, name, m, v, options = case
    dp = world // (tp * pp)
    results = run_distributed(world, pipeline_run, preset, layers, tp, pp, name, m, v, sequence_parallel, options,
                              layout)
    ref_loss, ref_grads = _reference_cached(preset, layers, MICRO_BATCH * m * dp)
    check(results, ref_loss, ref_grads, case)
    return results


@pytest.mark.parametrize("case", PIPEOFFLOAD_WORLD2, ids=_pipeoffload_id)
def test_exact_pipeoffload_world2(case):
    _run_pipeoffload(2, case)


@pytest.mark.parametrize("case", PIPEOFFLOAD_WORLD4, ids=_pipeoffload_id)
def test_exact_pipeoffload_world4(case):
    results = _run_pipeoffload(4, case)
    if case[4] == "po-f":  # offloading really happened: host buffers were used on the first rank
        assert max(r["peak_host_bytes"] for r in results if r["pp_rank"] == 0) > 0


@pytest.mark.parametrize("case", [("gpt-tiny", 8, 2, 2, "gis", 4, 2, {}), ("llama-tiny", 8, 2, 2, "gis-h", 4, 2, {}),
                                  ("gpt-tiny", 8, 2, 2, "po-h", 4, 2, {})], ids=_pipeoffload_id)
def test_exact_pipeoffload_sequence_parallel(case):
    _run_pipeoffload(4, case, sequence_parallel=True)


@pytest.mark.parametrize("pp, v", [(2, 4), (4, 2)])
def test_exact_pipeoffload_paper_layout(pp, v):
    """PipeOffload's layout: v·p − 2 layers, the embedding and the head each taking a layer's slot, so the
    first stage holds only the embedding and the last only the head."""
    case = ("gpt-tiny", v * pp - 2, 1, pp, "po-f", 4, v, {})
    _run_pipeoffload(4 if pp == 4 else 2, case, {"account_for_embedding": True, "account_for_loss": True})


# Layered gradient accumulation on the modular (looped-bfs) pipeline (arXiv 2106.02679): every case runs one step
# through the training optimizer's reducer, data-parallel width 2, one of three sharding strategies: all-reduce
# (no_shard), reduce-scatter into the distributed optimizer's shard (optim), or that plus sharded weights
# all-gathered per chunk (optim_grads_params, ZeRO-3). Two chunks per rank, 1 or 2 layers per stage, m = 2p,
# B = m (one breadth-first group) or m/2 (two groups, each chunk reduced twice). The schedule's default memory
# mode (layer inputs only, recomputed) is on. (preset, pp, layers per stage, B = m or m/2, layered, sharding).
LOOPED_BFS = [
    (preset, pp, per_stage, split, layered, sharding)
    for pp, preset in ((2, "gpt-tiny"), (4, "llama-tiny"))
    for per_stage in (1, 2)
    for split in (1, 2)
    for layered in (True, False)
    for sharding in ("no_shard", "optim", "optim_grads_params")
]
LOOPED_BUCKET_BYTES = 16 * 1024  # several buckets per chunk, so launch order and per-chunk ownership matter


def looped_run(ctx, preset, num_layers, pp, m, v, options, sharding, tp=1, sequence_parallel=False):
    """Worker side: one step of looped-bfs with the optimizer's reducer; full reduced gradients by name."""
    from megatron_pp.training.layered import connect_optimizer
    from megatron_pp.training.optimizer import OptimizerConfig, build_optimizer

    state = ctx.parallel_state(tp, pp)
    schedule = build_schedule("looped-bfs", pp, m, v, **options)
    pipe = build_pipeline(_config(preset, num_layers), state, schedule, micro_batch_size=MICRO_BATCH, seed=SEED,
                          sequence_parallel=sequence_parallel)
    optimizer = build_optimizer(pipe.chunks, state, OptimizerConfig(
        use_distributed_optimizer=sharding != "no_shard", data_parallel_sharding_strategy=sharding,
        overlap_grad_reduce=True, layered_grad_accumulation=bool(options.get("layered_grad_accumulation")),
        bucket_bytes=LOOPED_BUCKET_BYTES))
    connect_optimizer(pipe.executor, optimizer)
    config = pipe.config
    data = MockData(SEED, config.seq_length, config.vocab_size, MICRO_BATCH, MICRO_BATCH * m * state.dp_size,
                    state.dp_size)
    result, tokens = train_step(pipe, data.step_microbatches(0, state.dp_rank), optimizer)
    loss = step_metrics(pipe, result, tokens).loss
    reducer = optimizer.reducer
    where = {id(p): (bucket, offset) for bucket in reducer.buckets for p, offset in zip(bucket.params, bucket.offsets)}
    full = {}
    for bucket in reducer.buckets:
        shard = bucket.grad[bucket.shard_start:bucket.shard_end]
        if sharding == "no_shard":
            full[bucket.index] = bucket.grad
        else:  # only this rank's shard is reduced: assemble the others'
            parts = [torch.empty_like(shard) for _ in range(state.dp_size)]
            torch.distributed.all_gather(parts, shard, group=state.dp_group)
            full[bucket.index] = torch.cat(parts)
    grads = {}
    for chunk in pipe.chunks:
        for name, p in chunk.named_parameters():
            bucket, offset = where[id(p)]
            g = full[bucket.index][offset:offset + p.numel()].view(p.shape)
            if getattr(p, "tensor_model_parallel", False):
                g = gather_tensor(g, p.partition_dim, p.partition_stride, state.tp_group)
            grads[name] = g.clone()
    keep = state.dp_rank == 0 and state.tp_rank == 0
    return {"loss": loss, "grads": grads if keep else {}, "peak_count": result.peak_stash_count}


def _looped_id(c):
    preset, pp, per_stage, split, layered, sharding = c
    return f"pp{pp}-lps{per_stage}-B{'m' if split == 1 else 'm/2'}-{'layered' if layered else 'hooks'}-{sharding}"


@pytest.mark.parametrize("case", LOOPED_BFS, ids=_looped_id)
def test_exact_looped_bfs(case):
    preset, pp, per_stage, split, layered, sharding = case
    dp, v, m = 2, 2, 2 * pp
    layers = pp * v * per_stage
    options = {"breadth_first_microbatches": m // split, "layered_grad_accumulation": layered}
    results = run_distributed(pp * dp, looped_run, preset, layers, pp, m, v, options, sharding)
    ref_loss, ref_grads = _reference_cached(preset, layers, MICRO_BATCH * m * dp)
    check(results, ref_loss, ref_grads, case)
    assert {r["peak_count"] for r in results} == {v * m // split}  # v chunks x B stashes on every rank


# BPipe (Kim et al., ICML 2023): 1F1B with stashes parked on the partner rank p-1-x. One layer per stage.
# (preset, tp, pp, m, options, sequence_parallel).
BPIPE = [
    ("gpt-tiny", 1, 4, 4, {}, False),  # m = p, K = 3: rank 0 parks one stash per step on rank 3
    ("gpt-tiny", 1, 4, 5, {"bpipe_max_resident": 2}, False),  # odd m
    ("llama-tiny", 1, 4, 8, {"bpipe_max_resident": 2}, False),  # m = 2p: ranks 0 and 1 park on 3 and 2
    ("gpt-tiny", 1, 5, 10, {"bpipe_max_resident": 3}, False),  # odd p: rank 2 has no partner
    ("gpt-tiny", 1, 8, 8, {}, False),  # K = 5: ranks 0, 1, 2 park up to 3, 2, 1 stashes
    ("llama-tiny", 2, 4, 4, {"bpipe_max_resident": 2}, True),  # tp = 2 with sequence parallelism
]


def _bpipe_id(c):
    preset, tp, pp, m, options, sp = c
    return f"{preset}-tp{tp}-pp{pp}-m{m}" + "".join(f"-K{v}" for v in options.values()) + ("-sp" if sp else "")


@pytest.mark.parametrize("case", BPIPE, ids=_bpipe_id)
def test_exact_bpipe(case):
    preset, tp, pp, m, options, sp = case
    results = run_distributed(tp * pp, pipeline_run, preset, pp, tp, pp, "bpipe", m, 1, sp, options)
    ref_loss, ref_grads = _reference_cached(preset, pp, MICRO_BATCH * m)
    check(results, ref_loss, ref_grads, case)
    # The parking really ran: every rank's measured resident peak is the simulated one, except on the
    # ranks that host, whose guests leave when the partner's LOAD takes them (timing): there, the bound.
    from megatron_pp.schedules.runtime import hosting_bound, runtime_needs

    schedule = build_schedule("bpipe", pp, m, **options)
    sim = simulate(schedule)
    hosts = runtime_needs(schedule).hosting_ranks
    assert hosts and sim.peak_parked[0] > 0
    for r in results:
        rank = r["pp_rank"]
        if rank in hosts:
            assert r["peak_count"] <= min(pp - rank, m) + hosting_bound(schedule.actions[rank]), r
        else:
            assert r["peak_count"] == sim.peak_stash[rank], r


@pytest.mark.parametrize("tp, pp, m, split, sharding, v", [
    (2, 2, 4, 2, "optim_grads_params", 2),  # tp 2 x pp 2 x dp 2 with sequence parallelism, two groups
    (1, 2, 3, 1, "optim", 2),  # odd m (>= p), one group
    (1, 2, 4, 2, "no_shard", 1),  # one contiguous stage of 4 layers per rank, breadth-first
], ids=["tp2-sp-pp2-dp2-zero3", "pp2-dp2-m3", "pp2-dp2-v1"])
def test_exact_looped_bfs_tensor_parallel_and_odd_m(tp, pp, m, split, sharding, v):
    dp, layers = 2, 8
    options = {"breadth_first_microbatches": m // split, "layered_grad_accumulation": True}
    results = run_distributed(tp * pp * dp, looped_run, "gpt-tiny", layers, pp, m, v, options, sharding, tp, tp > 1)
    ref_loss, ref_grads = _reference_cached("gpt-tiny", layers, MICRO_BATCH * m * dp)
    check(results, ref_loss, ref_grads, (tp, pp, m, split, sharding))


# Zero-bubble ZB-H1 / ZB-H2 (arXiv 2401.10241 §2): split backward with BW deferred behind other compute, so the
# weight-gradient GEMMs really wait in the store. One layer per stage. (preset, layers, tp, pp, schedule, m, v,
# options), grouped by world size; m < p, m not a multiple of p and m ≥ 2p − 1 (zb-h2's full warm-up) all appear.
ZERO_BUBBLE_WORLD2 = [
    ("gpt-tiny", 4, 1, 2, "zb-h1", 3, 1, {}),
    ("llama-tiny", 4, 1, 2, "zb-h2", 4, 1, {}),
]
ZERO_BUBBLE_WORLD4 = [
    ("gpt-tiny", 4, 1, 4, "zb-h1", 5, 1, {}),
    ("llama-tiny", 4, 1, 4, "zb-h2", 8, 1, {}),
    ("gpt-tiny", 4, 1, 4, "zb-h2", 3, 1, {}),  # m < p
    ("llama-tiny", 4, 2, 2, "zb-h1", 4, 1, {}),  # tp = 2
    ("gpt-tiny", 4, 2, 2, "zb-h2", 3, 1, {}),  # tp = 2
    ("gpt-tiny", 4, 1, 2, "zb-h1", 4, 1, {}),  # dp = 2
    ("llama-tiny", 4, 1, 2, "zb-h2", 3, 1, {}),  # dp = 2
    ("gpt-tiny", 4, 1, 4, "zb-h1", 8, 1, {"offload_chunks": 1}),
    ("llama-tiny", 4, 1, 4, "zb-h2", 8, 1, {"offload_chunks": 1}),
]


@pytest.mark.parametrize("case", ZERO_BUBBLE_WORLD2, ids=_pipeoffload_id)
def test_exact_zero_bubble_world2(case):
    _run_pipeoffload(2, case)


@pytest.mark.parametrize("case", ZERO_BUBBLE_WORLD4, ids=_pipeoffload_id)
def test_exact_zero_bubble_world4(case):
    results = _run_pipeoffload(4, case)
    # Stashes count until BW (the executor's store and the simulator alike), offloaded ones while on the host.
    sim = simulate(build_schedule(case[4], case[3], case[5], **case[7]))
    assert {(r["pp_rank"], r["peak_count"]) for r in results} == set(enumerate(sim.peak_stash))
    if case[7]:
        assert max(r["peak_host_bytes"] for r in results if r["pp_rank"] == 0) > 0


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])
def test_exact_zero_bubble_sequence_parallel_and_full_recompute(name):
    """tp 2 with sequence parallelism, every layer recomputed in BI: BI re-runs the layer and keeps only
    what BW needs (the linear layers' inputs and output gradients) until BW."""
    from megatron_pp.models.recompute import RecomputeConfig

    case = ("gpt-tiny", 4, 2, 2, name, 4, 1, {})
    _run_pipeoffload(4, case, {"recompute": RecomputeConfig("full", "uniform", 1)}, sequence_parallel=True)


@pytest.mark.parametrize("name, extra", [
    ("zb-h1", ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]),
    ("zb-h2", ["--overlap-grad-reduce", "--use-distributed-optimizer"]),
])
def test_zero_bubble_trains_like_one_process_across_a_resume(tmp_path, name, extra):
    """The training loop (arguments, Adam, clipping) at pp 2 × dp 2, m = 3: three steps equal a single
    process step by step, and two steps, save, exit, resume for the third equal the three straight. With
    overlapped reduction the reducer hears of the weight gradients BW adds long after their BI."""
    from tests.training.test_exactness_edges import BUCKET_BYTES, ITERS, TOL as STEP_TOL, _argv, _train
    from tests.training.test_exactness_edges import reference as training_reference

    layers, gbs = 4, 6
    argv = _argv("gpt-tiny", layers, 1, gbs, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", name,
                                              *extra])
    straight = run_distributed(4, _train, argv, BUCKET_BYTES)[0]
    assert len(straight) == ITERS
    for (_, _, loss, norm, _), (ref_loss, ref_norm) in zip(straight, training_reference("gpt-tiny", layers, gbs)):
        assert abs(loss - ref_loss) <= STEP_TOL * ref_loss and abs(norm - ref_norm) <= STEP_TOL * ref_norm
    ck = str(tmp_path / "ck")
    first = run_distributed(4, _train, argv + ["--save", ck, "--exit-interval", "2"], BUCKET_BYTES)[0]
    resumed = run_distributed(4, _train, argv + ["--load", ck], BUCKET_BYTES)[0]
    assert first + resumed == straight


# V placement (schedules/vshape.py): stage r and 2p-1-r on rank r, so rank 0 holds the embedding and the head
# (gpt-tiny ties them: one parameter shared by rank 0's two chunks) and stage p-1 hands over to stage p in
# memory. One layer per stage. (preset, layers, tp, pp, schedule, m, v, options), grouped by world size.
VSHAPE_WORLD2 = [
    ("gpt-tiny", 4, 1, 2, "zb-v", 4, 2, {}),
    ("llama-tiny", 4, 1, 2, "v-half", 3, 2, {}),
]
VSHAPE_WORLD4 = [
    ("gpt-tiny", 8, 1, 4, "zb-v", 8, 2, {}),
    ("llama-tiny", 8, 1, 4, "v-half", 8, 2, {}),
    ("gpt-tiny", 8, 1, 4, "zb-v", 8, 2, {"offload_chunks": 1}),
    ("gpt-tiny", 8, 1, 4, "v-half", 8, 2, {"offload_chunks": 1}),
    ("gpt-tiny", 4, 2, 2, "zb-v", 4, 2, {}),  # tp = 2
    ("llama-tiny", 4, 2, 2, "v-half", 4, 2, {}),  # tp = 2
    ("gpt-tiny", 4, 1, 2, "v-half", 4, 2, {}),  # dp = 2
    ("llama-tiny", 4, 1, 2, "zb-v", 4, 2, {}),  # dp = 2
]


@pytest.mark.parametrize("case", VSHAPE_WORLD2, ids=_pipeoffload_id)
def test_exact_vshape_world2(case):
    _run_pipeoffload(2, case)


@pytest.mark.parametrize("case", VSHAPE_WORLD4, ids=_pipeoffload_id)
def test_exact_vshape_world4(case):
    results = _run_pipeoffload(4, case)
    if case[7].get("offload_chunks"):  # the V's first chunk really went to host memory
        assert max(r["peak_host_bytes"] for r in results if r["pp_rank"] == 0) > 0
