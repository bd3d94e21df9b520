"""Tensor-parallel layers, mappings, cross-entropy and RNG against single-process references.

Distributed checks run on gloo worlds of 2 and 4 ranks (tp=2, tp=4, and tp=2 x dp=2 so that group ranks
differ from global ranks). Each world runs one worker function that performs every check and returns
{check name: relative error}; the parent asserts on them, so a failure names the check. Every rank
builds the same full tensors from a fixed seed, computes the plain-PyTorch reference, and compares its
own shard (or the gathered tensor) with it.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_pp.core.parallel_state import RankLayout
from megatron_pp.core.tensor_parallel import (
    TENSOR_PARALLEL_RNG,
    ColumnParallelLinear,
    RNGTracker,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel_linear,
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    gather_tensor,
    get_default_rng_state,
    model_parallel_seed,
    param_is_partitioned,
    param_is_replicated_in_tp,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
    set_default_rng_state,
    shard_tensor,
    vocab_parallel_cross_entropy,
)
from tests.dist import run_distributed

TOL = 1e-6
S, B, H, FFN, VOCAB = 8, 2, 8, 16, 32  # S, FFN and VOCAB divide by 2 * 4 (tp x stride)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


def _randn(gen, *shape, scale=1.0):
    return torch.randn(*shape, generator=gen) * scale


def _rows(x, rank, tp):
    """Sequence-parallel shard: this rank's rows of dim 0."""
    return shard_tensor(x, 0, 1, rank, tp)


def _cols(x, rank, tp, stride=1):
    """Tensor-parallel shard of the last dim."""
    return shard_tensor(x, x.dim() - 1, stride, rank, tp)


# Linear layers ----------------------------------------------------------------------------------------


def _check_column(errs, group, rank, tp, gen, *, bias, sp, stride=1, gather_output=False):
    name = f"column(bias={bias},sp={sp},stride={stride},gather={gather_output})"
    w, b, x, gy = _randn(gen, FFN, H), _randn(gen, FFN), _randn(gen, S, B, H), _randn(gen, S, B, FFN)
    x_ref = x.clone().requires_grad_()
    w_ref, b_ref = w.clone().requires_grad_(), b.clone().requires_grad_()
    y_ref = F.linear(x_ref, w_ref, b_ref if bias else None)
    y_ref.backward(gy)

    layer = ColumnParallelLinear(H, FFN, tp_group=group, bias=bias, sequence_parallel=sp,
                                 partition_stride=stride, gather_output=gather_output)
    assert layer.weight.shape == (FFN // tp, H) and param_is_partitioned(layer.weight)
    assert (layer.weight.partition_dim, layer.weight.partition_stride) == (0, stride)
    with torch.no_grad():
        layer.weight.copy_(shard_tensor(w, 0, stride, rank, tp))
        if bias:
            layer.bias.copy_(shard_tensor(b, 0, stride, rank, tp))
    x_in = (_rows(x, rank, tp) if sp else x).clone().requires_grad_()
    y = layer(x_in)
    if gather_output:
        errs[f"{name}/y"] = _rel(y, y_ref)
        y.backward(gy)
    else:
        errs[f"{name}/y"] = _rel(y, _cols(y_ref, rank, tp, stride))
        y.backward(_cols(gy, rank, tp, stride))
    errs[f"{name}/dx"] = _rel(x_in.grad, _rows(x_ref.grad, rank, tp) if sp else x_ref.grad)
    errs[f"{name}/dw"] = _rel(gather_tensor(layer.weight.grad, 0, stride, group), w_ref.grad)
    if bias:
        errs[f"{name}/db"] = _rel(gather_tensor(layer.bias.grad, 0, stride, group), b_ref.grad)


def _check_row(errs, group, rank, tp, gen, *, bias, sp, input_is_parallel=True):
    name = f"row(bias={bias},sp={sp},input_is_parallel={input_is_parallel})"
    w, b, x, gy = _randn(gen, H, FFN), _randn(gen, H), _randn(gen, S, B, FFN), _randn(gen, S, B, H)
    x_ref = x.clone().requires_grad_()
    w_ref, b_ref = w.clone().requires_grad_(), b.clone().requires_grad_()
    y_ref = F.linear(x_ref, w_ref, b_ref if bias else None)
    y_ref.backward(gy)

    layer = RowParallelLinear(FFN, H, tp_group=group, bias=bias, sequence_parallel=sp,
                              input_is_parallel=input_is_parallel)
    assert layer.weight.shape == (H, FFN // tp) and layer.weight.partition_dim == 1
    with torch.no_grad():
        layer.weight.copy_(shard_tensor(w, 1, 1, rank, tp))
        if bias:
            assert param_is_replicated_in_tp(layer.bias) and layer.bias.sequence_parallel == sp
            layer.bias.copy_(b)
    x_in = (_cols(x, rank, tp) if input_is_parallel else x).clone().requires_grad_()
    y = layer(x_in)
    errs[f"{name}/y"] = _rel(y, _rows(y_ref, rank, tp) if sp else y_ref)
    y.backward(_rows(gy, rank, tp) if sp else gy)
    errs[f"{name}/dx"] = _rel(x_in.grad, _cols(x_ref.grad, rank, tp) if input_is_parallel else x_ref.grad)
    errs[f"{name}/dw"] = _rel(gather_tensor(layer.weight.grad, 1, 1, group), w_ref.grad)
    if bias:
        db = layer.bias.grad.clone()
        if sp:  # each rank saw only its rows: the grad reduction must sum over the TP group
            dist.all_reduce(db, group=group)
        errs[f"{name}/db"] = _rel(db, b_ref.grad)


def _check_mlp(errs, group, rank, tp, gen, *, sp):
    """The standard pair: Column(h -> 4h, stride 2 for a fused gate/up) -> SwiGLU -> Row(2h -> h)."""
    name = f"mlp(sp={sp})"
    w1, b1, w2, b2 = _randn(gen, FFN, H), _randn(gen, FFN), _randn(gen, H, FFN // 2), _randn(gen, H)
    x, gy = _randn(gen, S, B, H), _randn(gen, S, B, H)

    def swiglu(h):
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up

    ref = [t.clone().requires_grad_() for t in (x, w1, b1, w2, b2)]
    y_ref = F.linear(swiglu(F.linear(ref[0], ref[1], ref[2])), ref[3], ref[4])
    y_ref.backward(gy)

    fc1 = ColumnParallelLinear(H, FFN, tp_group=group, sequence_parallel=sp, partition_stride=2)
    fc2 = RowParallelLinear(FFN // 2, H, tp_group=group, sequence_parallel=sp)
    with torch.no_grad():
        fc1.weight.copy_(shard_tensor(w1, 0, 2, rank, tp))
        fc1.bias.copy_(shard_tensor(b1, 0, 2, rank, tp))
        fc2.weight.copy_(shard_tensor(w2, 1, 1, rank, tp))
        fc2.bias.copy_(b2)
    x_in = (_rows(x, rank, tp) if sp else x).clone().requires_grad_()
    y = fc2(swiglu(fc1(x_in)))
    errs[f"{name}/y"] = _rel(y, _rows(y_ref, rank, tp) if sp else y_ref)
    y.backward(_rows(gy, rank, tp) if sp else gy)
    errs[f"{name}/dx"] = _rel(x_in.grad, _rows(ref[0].grad, rank, tp) if sp else ref[0].grad)
    errs[f"{name}/dw1"] = _rel(gather_tensor(fc1.weight.grad, 0, 2, group), ref[1].grad)
    errs[f"{name}/db1"] = _rel(gather_tensor(fc1.bias.grad, 0, 2, group), ref[2].grad)
    errs[f"{name}/dw2"] = _rel(gather_tensor(fc2.weight.grad, 1, 1, group), ref[3].grad)
    db2 = fc2.bias.grad.clone()
    if sp:
        dist.all_reduce(db2, group=group)
    errs[f"{name}/db2"] = _rel(db2, ref[4].grad)


def _check_embedding(errs, group, rank, tp, gen, *, reduce_scatter):
    name = f"embedding(reduce_scatter={reduce_scatter})"
    w, gy = _randn(gen, VOCAB, H), _randn(gen, S, B, H)
    ids = torch.randint(0, VOCAB, (B, S), generator=gen)
    ids[0, :2] = torch.tensor([0, VOCAB - 1])  # both ends of the vocabulary
    w_ref = w.clone().requires_grad_()
    y_ref = F.embedding(ids.t(), w_ref)
    y_ref.backward(gy)

    emb = VocabParallelEmbedding(VOCAB, H, tp_group=group, reduce_scatter_embeddings=reduce_scatter)
    with torch.no_grad():
        emb.weight.copy_(shard_tensor(w, 0, 1, rank, tp))
    y = emb(ids)
    errs[f"{name}/y"] = _rel(y, _rows(y_ref, rank, tp) if reduce_scatter else y_ref)
    y.backward(_rows(gy, rank, tp) if reduce_scatter else gy)
    errs[f"{name}/dw"] = _rel(gather_tensor(emb.weight.grad, 0, 1, group), w_ref.grad)


def _check_tied_output(errs, group, rank, tp, gen, *, sp):
    """`column_parallel_linear` with an embedding's vocabulary shard as weight (tied output layer)."""
    name = f"tied_output(sp={sp})"
    w, x, gy = _randn(gen, VOCAB, H), _randn(gen, S, B, H), _randn(gen, S, B, VOCAB)
    x_ref, w_ref = x.clone().requires_grad_(), w.clone().requires_grad_()
    F.linear(x_ref, w_ref).backward(gy)

    emb = VocabParallelEmbedding(VOCAB, H, tp_group=group)
    with torch.no_grad():
        emb.weight.copy_(shard_tensor(w, 0, 1, rank, tp))
    x_in = (_rows(x, rank, tp) if sp else x).clone().requires_grad_()
    y = column_parallel_linear(x_in, emb.weight, None, group, sequence_parallel=sp)
    errs[f"{name}/y"] = _rel(y, _cols(F.linear(x, w), rank, tp))
    y.backward(_cols(gy, rank, tp))
    errs[f"{name}/dx"] = _rel(x_in.grad, _rows(x_ref.grad, rank, tp) if sp else x_ref.grad)
    errs[f"{name}/dw"] = _rel(gather_tensor(emb.weight.grad, 0, 1, group), w_ref.grad)


def _check_cross_entropy(errs, group, rank, tp, gen, *, label_smoothing, scale, offset):
    name = f"cross_entropy(ls={label_smoothing},scale={scale})"
    logits = _randn(gen, S, B, VOCAB, scale=scale) + offset
    target = torch.randint(0, VOCAB, (S, B), generator=gen)
    gl = torch.rand(S, B, generator=gen)
    ref_logits = logits.clone().requires_grad_()
    loss_ref = F.cross_entropy(ref_logits.flatten(0, 1), target.flatten(), reduction="none",
                               label_smoothing=label_smoothing).view(S, B)
    loss_ref.backward(gl)

    local = _cols(logits, rank, tp).requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, group, label_smoothing=label_smoothing)
    assert loss.dtype == torch.float32 and loss.shape == (S, B)
    errs[f"{name}/loss"] = _rel(loss, loss_ref)
    loss.backward(gl)
    errs[f"{name}/dlogits"] = _rel(local.grad, _cols(ref_logits.grad, rank, tp))


# Mappings: forward and backward against hand-built expectations ----------------------------------------


def _mapping_errors(errs, group, rank, tp):
    """x and the incoming grad differ per rank (x_r = base + 100 r), so every expectation is exact."""
    base = torch.arange(S * B * 4, dtype=torch.float32).view(S, B, 4)
    xs = [base + 100 * r for r in range(tp)]
    gs = [base * (r + 1) for r in range(tp)]
    total_x, total_g = sum(xs), sum(gs)

    def run(fn, x, g, *args):
        x_in = x.clone().requires_grad_()
        y = fn(x_in, group, *args)
        untouched = torch.equal(x_in.detach(), x)  # forwards must not write into their input
        y.backward(g)
        return y.detach(), x_in.grad, untouched

    def check(name, got, expected):
        y, grad, untouched = got
        errs[f"mapping/{name}/fwd"] = float(not torch.equal(y, expected[0]))
        errs[f"mapping/{name}/bwd"] = float(not torch.equal(grad, expected[1]))
        errs[f"mapping/{name}/input_untouched"] = float(not untouched)

    def seq_rows(t):
        return _rows(t, rank, tp)

    def last_cols(t):
        return _cols(t, rank, tp)

    check("copy", run(copy_to_tp_region, xs[rank], gs[rank]), (xs[rank], total_g))
    check("reduce", run(reduce_from_tp_region, xs[rank], gs[rank]), (total_x, gs[rank]))
    check("scatter_tp", run(scatter_to_tp_region, base, last_cols(gs[rank])),
          (last_cols(base), torch.cat([_cols(g, r, tp) for r, g in enumerate(gs)], dim=-1)))
    check("gather_tp", run(gather_from_tp_region, last_cols(xs[rank]), gs[rank]),
          (torch.cat([_cols(x, r, tp) for r, x in enumerate(xs)], dim=-1), last_cols(gs[rank])))
    check("scatter_sp", run(scatter_to_sequence_parallel_region, base, seq_rows(gs[rank])),
          (seq_rows(base), torch.cat([_rows(g, r, tp) for r, g in enumerate(gs)], dim=0)))
    gathered = torch.cat([_rows(x, r, tp) for r, x in enumerate(xs)], dim=0)
    check("gather_sp(tp_grad)", run(gather_from_sequence_parallel_region, seq_rows(xs[rank]), gs[rank]),
          (gathered, seq_rows(total_g)))
    check("gather_sp(full_grad)",
          run(gather_from_sequence_parallel_region, seq_rows(xs[rank]), gs[rank], False),
          (gathered, seq_rows(gs[rank])))
    check("reduce_scatter_sp", run(reduce_scatter_to_sequence_parallel_region, xs[rank], seq_rows(gs[rank])),
          (seq_rows(total_x), torch.cat([_rows(g, r, tp) for r, g in enumerate(gs)], dim=0)))


def _gather_round_trip(errs, group, rank, tp, gen):
    for dim in (0, 1):
        for stride in (1, 2):
            full = _randn(gen, 2 * tp * 2, 2 * tp * 3)
            back = gather_tensor(shard_tensor(full, dim, stride, rank, tp), dim, stride, group)
            errs[f"gather_tensor(dim={dim},stride={stride})"] = float(not torch.equal(back, full))


def _shape_errors(errs, group, tp):
    """Sizes that do not divide by tp are refused with a message naming the argument."""
    cases = {
        "embedding": (lambda: VocabParallelEmbedding(VOCAB + 1, H, tp_group=group), "pad the vocabulary"),
        "column": (lambda: ColumnParallelLinear(H, tp + 2 * tp, tp_group=group, partition_stride=2),
                   "output_size with partition_stride 2"),
        "row": (lambda: RowParallelLinear(FFN + 1, H, tp_group=group), "RowParallelLinear input_size"),
        "gather_stride": (
            lambda: ColumnParallelLinear(H, FFN, tp_group=group, partition_stride=2, gather_output=True),
            "gather_output is not supported",
        ),
    }
    for name, (make, message) in cases.items():
        try:
            make()
            errs[f"shape_error/{name}"] = 1.0
        except ValueError as e:
            errs[f"shape_error/{name}"] = float(message not in str(e))


def _all_checks(ctx, tp):
    state = ctx.parallel_state(tp, 1)
    group, rank = state.tp_group, state.tp_rank
    gen = torch.Generator().manual_seed(1234)  # same tensors on every rank
    errs: dict[str, float] = {}
    for bias in (True, False):
        for sp in (False, True):
            _check_column(errs, group, rank, tp, gen, bias=bias, sp=sp)
            _check_row(errs, group, rank, tp, gen, bias=bias, sp=sp)
    _check_column(errs, group, rank, tp, gen, bias=True, sp=True, stride=2)
    _check_column(errs, group, rank, tp, gen, bias=True, sp=False, gather_output=True)
    _check_row(errs, group, rank, tp, gen, bias=True, sp=False, input_is_parallel=False)
    for sp in (False, True):
        _check_mlp(errs, group, rank, tp, gen, sp=sp)
        _check_embedding(errs, group, rank, tp, gen, reduce_scatter=sp)
        _check_tied_output(errs, group, rank, tp, gen, sp=sp)
    for label_smoothing in (0.0, 0.1):
        _check_cross_entropy(errs, group, rank, tp, gen, label_smoothing=label_smoothing, scale=1.0, offset=0.0)
        _check_cross_entropy(errs, group, rank, tp, gen, label_smoothing=label_smoothing, scale=300.0, offset=1e4)
    _mapping_errors(errs, group, rank, tp)
    _gather_round_trip(errs, group, rank, tp, gen)
    _shape_errors(errs, group, tp)
    return errs


def _all_checks_with_single_tensor_kernels(ctx, tp):
    """`_all_checks` through the NCCL code path (single-tensor all-gather / reduce-scatter), run on gloo.

    Returns None when this torch's gloo lacks those kernels (older torch builds): then the path is untestable
    without GPUs.
    """
    from megatron_pp.core.tensor_parallel import utils

    group = ctx.parallel_state(tp, 1).tp_group
    try:
        utils._reduce_scatter_single(torch.empty(1), torch.ones(tp), group=group)
    except (RuntimeError, NotImplementedError):
        return None
    saved = utils._BACKENDS_WITH_SINGLE_TENSOR_COLLECTIVES
    utils._BACKENDS_WITH_SINGLE_TENSOR_COLLECTIVES = frozenset({dist.get_backend(group)})
    try:
        return _all_checks(ctx, tp)
    finally:
        utils._BACKENDS_WITH_SINGLE_TENSOR_COLLECTIVES = saved


def _rng_draws(ctx, tp):
    state = ctx.parallel_state(tp, 1)
    tracker = RNGTracker()
    model_parallel_seed(42, state.tp_rank, state.pp_rank, tracker=tracker)
    default_before = torch.rand(4)
    with tracker.fork():
        forked = torch.rand(4)
    default_after = torch.rand(4)
    return default_before, forked, default_after


@pytest.mark.parametrize("world,tp", [(2, 2), (4, 4), (4, 2)])
def test_tensor_parallel_against_reference(world, tp):
    results = run_distributed(world, _all_checks, tp)
    for rank, errs in enumerate(results):
        assert len(errs) >= 102  # every check reported
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"rank {rank}: {bad}"


def test_single_tensor_collective_path():
    results = run_distributed(4, _all_checks_with_single_tensor_kernels, 2)
    if results[0] is None:
        pytest.skip("gloo in this torch has no single-tensor reduce-scatter")
    for rank, errs in enumerate(results):
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"rank {rank}: {bad}"


@pytest.mark.parametrize("world,tp", [(2, 2), (4, 2)])
def test_rng_streams_across_tp_ranks(world, tp):
    layout = RankLayout(world, tp)
    draws = run_distributed(world, _rng_draws, tp)
    for rank in range(world):
        # The default stream is the same everywhere (one pipeline stage) and is not advanced by the fork.
        assert torch.equal(draws[rank][0], draws[0][0]) and torch.equal(draws[rank][2], draws[0][2])
        for other in range(world):
            same_tp_rank = layout.coords(rank).tp == layout.coords(other).tp
            assert torch.equal(draws[rank][1], draws[other][1]) == same_tp_rank, (rank, other)
    reference = torch.Generator().manual_seed(42)
    assert torch.equal(draws[0][0], torch.rand(4, generator=reference))
    assert torch.equal(draws[0][2], torch.rand(4, generator=reference))  # the fork did not consume it


# Single-process checks ----------------------------------------------------------------------------------


def test_shard_tensor_stride_layout():
    full = torch.arange(8).view(8, 1)  # [g0 g1 g2 g3 | u0 u1 u2 u3]
    assert shard_tensor(full, 0, 2, 0, 2).flatten().tolist() == [0, 1, 4, 5]
    assert shard_tensor(full, 0, 2, 1, 2).flatten().tolist() == [2, 3, 6, 7]
    assert shard_tensor(full.t(), 1, 1, 1, 4).flatten().tolist() == [2, 3]
    assert shard_tensor(full.t(), 1, 2, 3, 4).flatten().tolist() == [3, 7]
    shards = [shard_tensor(full, 0, 2, r, 2) for r in range(2)]
    shards[0][0] = 99
    assert full[0, 0] == 0  # shards are copies, never views of the full tensor
    with pytest.raises(ValueError, match="split into 2 blocks over 2 ranks"):
        shard_tensor(full[:6], 0, 2, 0, 2)
    with pytest.raises(ValueError, match="outside a tensor-parallel group"):
        shard_tensor(full, 0, 1, 2, 2)


def test_layers_without_group_are_plain_torch():
    torch.manual_seed(0)
    x = torch.randn(S, B, H)
    col = ColumnParallelLinear(H, FFN, tp_group=None, sequence_parallel=True)
    row = RowParallelLinear(FFN, H, tp_group=None, sequence_parallel=True)
    emb = VocabParallelEmbedding(VOCAB, H, reduce_scatter_embeddings=True)
    for p in (*col.parameters(), *row.parameters(), *emb.parameters()):
        torch.nn.init.normal_(p)
    assert torch.equal(row(col(x)), F.linear(F.linear(x, col.weight, col.bias), row.weight, row.bias))
    ids = torch.randint(0, VOCAB, (B, S))
    assert torch.equal(emb(ids), emb.weight[ids.t()])
    assert not row.bias.sequence_parallel  # nothing is partial with one rank


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, TOL), (torch.bfloat16, 1e-2)])
def test_cross_entropy_single_rank(label_smoothing, dtype, tol):
    gen = torch.Generator().manual_seed(7)
    logits = (_randn(gen, S, B, VOCAB, scale=200.0) - 3e4).to(dtype)
    target = torch.randint(0, VOCAB, (S, B), generator=gen)
    ref_logits = logits.float().clone().requires_grad_()
    loss_ref = F.cross_entropy(ref_logits.flatten(0, 1), target.flatten(), reduction="none",
                               label_smoothing=label_smoothing).view(S, B)
    loss_ref.sum().backward()
    mine = logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(mine, target, None, label_smoothing=label_smoothing)
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()
    assert _rel(loss, loss_ref) <= TOL  # the loss is computed in fp32 even from bf16 logits
    loss.sum().backward()
    assert mine.grad.dtype == dtype
    assert _rel(mine.grad, ref_logits.grad) <= tol
    assert torch.equal(mine.detach(), logits)  # the caller's logits are not modified


def test_cross_entropy_backward_runs_once():
    logits = torch.randn(2, 1, 4, requires_grad=True)
    loss = vocab_parallel_cross_entropy(logits, torch.tensor([[1], [3]])).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward can run only once"):
        loss.backward()
    with pytest.raises(ValueError, match="does not match logits"):
        vocab_parallel_cross_entropy(logits, torch.tensor([1, 3]))


def test_rng_fork_restores_default_stream_exactly():
    tracker = RNGTracker()
    model_parallel_seed(5, tp_rank=1, pp_rank=0, tracker=tracker)
    expected = torch.Generator().manual_seed(5)
    a = torch.rand(3)
    with tracker.fork(TENSOR_PARALLEL_RNG):
        first = torch.rand(3)
    with tracker.fork():
        second = torch.rand(3)  # the named stream continues, it does not restart
    b = torch.rand(3)
    assert torch.equal(torch.cat([a, b]), torch.rand(6, generator=expected))
    named = torch.Generator().manual_seed(5 + 1_000_000 + 1)
    assert torch.equal(torch.cat([first, second]), torch.rand(6, generator=named))

    with pytest.raises(ZeroDivisionError):
        with tracker.fork():
            torch.rand(1)
            raise ZeroDivisionError
    assert torch.equal(torch.rand(3), torch.rand(3, generator=expected))  # restored despite the error


def test_rng_states_round_trip_and_replay():
    tracker = RNGTracker()
    model_parallel_seed(11, tp_rank=0, pp_rank=2, tracker=tracker)
    saved_named, saved_default = tracker.get_states(), get_default_rng_state()
    with tracker.fork():
        masks = F.dropout(torch.ones(16), 0.5)
    plain = torch.rand(4)
    tracker.set_states(saved_named)
    set_default_rng_state(saved_default)
    with tracker.fork():
        assert torch.equal(F.dropout(torch.ones(16), 0.5), masks)  # recomputation replays the same mask
    assert torch.equal(torch.rand(4), plain)
    # the pipeline stage changes the default stream
    set_default_rng_state(saved_default)
    model_parallel_seed(11, tp_rank=0, pp_rank=0, tracker=RNGTracker())
    stage0 = torch.rand(4)
    set_default_rng_state(saved_default)
    assert not torch.equal(torch.rand(4), stage0)
    # states are plain tensors, loadable with weights_only=True
    import io

    buf = io.BytesIO()
    torch.save({"named": saved_named, "default": saved_default}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert torch.equal(loaded["named"][TENSOR_PARALLEL_RNG]["cpu"], saved_named[TENSOR_PARALLEL_RNG]["cpu"])


def test_rng_tracker_errors():
    tracker = RNGTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match="already used by 'a'"):
        tracker.add("b", 1)
    with pytest.raises(KeyError, match="never added"):
        with tracker.fork("missing"):
            pass
    with pytest.raises(ValueError, match="seed offsets would collide"):
        model_parallel_seed(1, tp_rank=1000, pp_rank=0, tracker=tracker)
