"""BPipe in the executor: the peer-parking stores on a gloo world, measured memory per rank against 1F1B
and the simulator, and training end to end (dp and the distributed optimizer, recompute, fp16)."""
from __future__ import annotations

import dataclasses
import time
import weakref

import pytest
import torch

from megatron_pp.core.storage import storage_key
from megatron_pp.data.mock import MockData
from megatron_pp.models.presets import get_preset
from megatron_pp.schedules.bpipe import default_max_resident
from megatron_pp.schedules.ir import Op
from megatron_pp.schedules.offload_store import StashState
from megatron_pp.schedules.peer_store import AcceptorStore, PeerLink, PeerStore
from megatron_pp.schedules.registry import build_schedule
from megatron_pp.schedules.runtime import hosting_bound, runtime_needs
from megatron_pp.schedules.simulate import CostModel, simulate
from megatron_pp.schedules.store import ActivationStore
from megatron_pp.training.train import build_pipeline, train_step
from tests.dist import run_distributed
from tests.training.test_pretrain import COMMON, _pretrain_losses, _single_process_losses

SEED = 11
MICRO_BATCH = 2


# The stores ---------------------------------------------------------------------------------------------------

def _forward(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Saves x (the private input), the tanh output `a` through three views of it, and the weight."""
    a = torch.tanh(x @ weight)
    b = a.t()
    return (b * b).sum() + (a[1:] ** 2).sum()


def _park_and_restore(ctx, delay_s: float) -> dict:
    """Rank 0 parks stash 0 on rank 1 and loads it back; rank 1 accepts it `delay_s` late."""
    state = ctx.parallel_state(1, 2)
    me, other = state.pp_rank, 1 - state.pp_rank
    link = PeerLink(state.pair_groups([(0, 1)])[other], state.pp_global_rank(other), state.device)
    torch.manual_seed(SEED)
    weight = torch.randn(64, 64, requires_grad=True)
    xs = [torch.randn(64, 64, requires_grad=True) for _ in range(2)]
    if me == 1:
        store = AcceptorStore(link=link)
        time.sleep(delay_s)
        store.begin_step()
        store.accept((0, 0))
        store.give_back((0, 0))
        store.end_step()
        return {"peak_count": store.peak_count, "peak_bytes": store.peak_bytes, "peak_guests": store.peak_guests,
                "guest_bytes": store.guest_bytes}

    reference = [torch.autograd.grad(_forward(x, weight), (x, weight)) for x in xs]
    store = PeerStore([weight], link=link)
    store.plan({(0, 0)})
    losses = []
    for i, x in enumerate(xs):
        with store.stash((i, 0)):
            losses.append(_forward(x, weight))
    one = store.live_bytes // 2
    out: dict = {"one": one, "before": (store.resident_count, store.live_bytes)}
    # The tanh output's storage: referenced by nobody but the stash's saved tensors once parked.
    private = storage_key(xs[0])
    outputs = [weakref.ref(e.storage) for k, e in store._records[0, 0].storages.items() if k != private]
    store.evict((0, 0), private=[xs[0]])
    time.sleep(delay_s / 2)
    store.poll()
    # Not freed before the partner has taken the data: gloo's send completes only against a posted receive.
    out["in_flight"] = (store.state((0, 0)), store.resident_count, store.live_bytes, xs[0].untyped_storage().nbytes(),
                        sum(ref() is not None for ref in outputs))
    ticket = store._records[0, 0].ticket
    ticket.finish()
    del ticket
    store.poll()
    out["parked"] = (store.state((0, 0)), store.resident_count, store.live_bytes, xs[0].untyped_storage().nbytes(),
                     sum(ref() is not None for ref in outputs))
    store.load((0, 0))
    out["loading"] = (store.state((0, 0)), store.resident_count, store.live_bytes)
    grads = [torch.autograd.grad(loss, (x, weight)) for loss, x in zip(losses, xs)]
    for i in range(2):
        store.release((i, 0))
    out["exact"] = all(torch.equal(g, r) for got, ref in zip(grads, reference) for g, r in zip(got, ref))
    out["after"] = (store.resident_count, store.live_bytes, store.copied_bytes)
    return out


def test_stash_goes_to_the_partner_and_comes_back_exactly():
    evictor, acceptor = run_distributed(2, _park_and_restore, 0.6)
    one = evictor["one"]  # x and the tanh output: 64 x 64 float32 each; the weight is excluded
    assert one == 2 * 64 * 64 * 4
    assert evictor["before"] == (2, 2 * one)
    assert evictor["in_flight"] == (StashState.OFFLOADING, 2, 2 * one, 64 * 64 * 4, 1)
    # Parked: both storages gone (the private input emptied in place, the output's storage freed: the finished
    # transfer no longer references it), the stash no longer resident.
    assert evictor["parked"] == (StashState.OFFLOADED, 1, one, 0, 0)
    assert evictor["loading"] == (StashState.RELOADING, 2, 2 * one)
    assert evictor["exact"]  # views rebuilt on their loaded base: bit-identical gradients
    assert evictor["after"] == (0, 0, one)
    # The acceptor counted the guest (its buffers) from their allocation until the send back completed.
    assert acceptor == {"peak_count": 1, "peak_bytes": one, "peak_guests": 1, "guest_bytes": 0}


# Memory per rank -------------------------------------------------------------------------------------------

P, M = 8, 8


def _measure(ctx, name: str, p: int = P, m: int = M, options: dict | None = None) -> dict:
    """One step of `name` on gpt-tiny with one layer per stage: this rank's peak resident stashes (count,
    bytes), the loss and the bytes one microbatch's stash takes on each rank's stage, measured alone."""
    from tests.schedules.test_exactness import one_stash_bytes

    state = ctx.parallel_state(1, p)
    config = dataclasses.replace(get_preset("gpt-tiny"), num_layers=p)
    schedule = build_schedule(name, p, m, **(options or {}))
    pipe = build_pipeline(config, state, schedule, micro_batch_size=MICRO_BATCH, seed=SEED)
    data = MockData(SEED, config.seq_length, config.vocab_size, MICRO_BATCH, MICRO_BATCH * m)
    result, _ = train_step(pipe, data.step_microbatches(0, 0))
    grads = {n: p.grad.clone() for n, p in pipe.chunks[0].named_parameters()}
    return {"pp_rank": state.pp_rank, "count": result.peak_stash_count, "bytes": result.peak_stash_bytes,
            "loss": None if result.loss_sum is None else float(result.loss_sum), "grads": grads,
            "stash_bytes": one_stash_bytes("gpt-tiny", p, p, 1) if state.pp_rank == 0 else None,
            "hosted": getattr(pipe.executor.store, "peak_guests", 0)}


def test_measured_memory_per_rank_against_1f1b_and_the_simulator():
    """p = 8, m = 8, K = 5: every rank holds at most K + 1 stashes (the forward that exceeds the bound),
    measured as a count and as bytes ÷ its own stash's bytes, where 1F1B's rank 0 holds p; the simulator,
    weighted with the measured bytes per stash, predicts both."""
    K = default_max_resident(P)
    plain = sorted(run_distributed(P, _measure, "1f1b"), key=lambda r: r["pp_rank"])
    bpipe = sorted(run_distributed(P, _measure, "bpipe"), key=lambda r: r["pp_rank"])
    per_stash = plain[0]["stash_bytes"]
    assert [r["count"] for r in plain] == [P - s for s in range(P)]
    assert plain[0]["bytes"] == P * per_stash[0]

    schedule = build_schedule("bpipe", P, M)
    sim = simulate(schedule, CostModel(stash_bytes=per_stash))
    counts = [r["count"] for r in bpipe]
    assert sim.peak_stash == [6, 6, 6, 5, 4, 4, 4, 4]
    assert max(counts) <= K + 1 and counts[0] < plain[0]["count"]
    hosts = runtime_needs(schedule).hosting_ranks
    assert hosts == (5, 6, 7)
    for r in bpipe:
        rank = r["pp_rank"]
        in_own_stashes = r["bytes"] / per_stash[rank]
        assert in_own_stashes <= K + 1 + 0.1, (rank, in_own_stashes)
        if rank not in hosts:
            # Bytes: the simulated peak with each stash at its owner's measured size; parked stashes leave
            # their tiny tensors (<= 1024 elements) behind, which the simulator does not split off.
            assert r["count"] == sim.peak_stash[rank] and r["hosted"] == 0, rank
            assert r["bytes"] == pytest.approx(sim.peak_bytes[rank], rel=0.02), rank
            continue
        # A hosted stash is held from its ACCEPT until the partner's LOAD has taken it back, which on a
        # real run depends on the partner's pace: the store holds at most its list's hosting bound.
        partner = P - 1 - rank
        bound = hosting_bound(schedule.actions[rank])
        assert 1 <= r["hosted"] <= bound <= sum(1 for a in schedule.actions[partner] if a.op is Op.EVICT)
        assert r["count"] <= plain[rank]["count"] + r["hosted"], rank
        assert r["bytes"] <= plain[rank]["bytes"] + r["hosted"] * per_stash[partner] * 1.02, rank
    # BPipe's bound in bytes: no rank above (K + 1)/p of 1F1B's rank 0 (6/8 here).
    assert max(r["bytes"] for r in bpipe) <= (K + 1) / P * plain[0]["bytes"] * 1.01
    # Same numerics as 1F1B (parking moves bytes, never values).
    assert bpipe[-1]["loss"] == plain[-1]["loss"]
    for a, b in zip(plain, bpipe):
        assert all(torch.equal(a["grads"][n], b["grads"][n]) for n in a["grads"])


@pytest.mark.parametrize("bound", [2, 3])
def test_p4_acceptor_holds_its_lists_bound_measured(bound):
    """p = 4, m = 8: rank 3 hosts rank 0's parked stashes. Its store holds at most `hosting_bound` of its
    list (2 at K = 2: it used to keep one more for a stash on its way back, which made rank 3 the worst
    rank at 1.04 of 1F1B's rank 0), so no rank exceeds (⌈(p + 2)/2⌉ + 1)/p = 1 of 1F1B's rank 0, measured
    in bytes; the other ranks' measured counts are the simulated ones."""
    p, m = 4, 8
    plain = sorted(run_distributed(p, _measure, "1f1b", p, m), key=lambda r: r["pp_rank"])
    bpipe = sorted(run_distributed(p, _measure, "bpipe", p, m, {"bpipe_max_resident": bound}),
                   key=lambda r: r["pp_rank"])
    schedule = build_schedule("bpipe", p, m, bpipe_max_resident=bound)
    sim = simulate(schedule)
    assert [r["count"] for r in bpipe[:3]] == sim.peak_stash[:3]
    # The acceptor's guests leave at its partner's pace: at most its list's count, 2 at K = 2, 1 at K = 3.
    assert bpipe[3]["hosted"] <= hosting_bound(schedule.actions[3]) == {2: 2, 3: 1}[bound]
    assert bpipe[3]["count"] <= 1 + hosting_bound(schedule.actions[3])
    assert max(r["bytes"] for r in bpipe) <= (default_max_resident(p) + 1) / p * plain[0]["bytes"]
    assert bpipe[-1]["loss"] == plain[-1]["loss"]


# Training end to end -------------------------------------------------------------------------------------

@pytest.mark.parametrize("flavour,layout", [
    ("gpt-tiny", ["--pipeline-model-parallel-size", "4"]),  # m = p = 4: rank 0 parks one stash per step
    # dp = 2 with ZeRO-1; K = 1 so that a two-stage pipeline parks at all.
    ("llama-tiny", ["--pipeline-model-parallel-size", "2", "--bpipe-max-resident", "1",
                    "--use-distributed-optimizer", "--overlap-grad-reduce"]),
    ("gpt-tiny", ["--pipeline-model-parallel-size", "4", "--recompute-granularity", "full",
                  "--recompute-method", "uniform"]),
])
def test_bpipe_trains_like_one_process(flavour, layout):
    """Three Adam steps with clipping give the single-process losses (fp32)."""
    argv = ["--model-preset", flavour, *COMMON, "--global-batch-size", "8"]
    reference = _single_process_losses(argv)
    pipelined = run_distributed(4, _pretrain_losses, argv + ["--pipeline-schedule", "bpipe"] + layout)[0]
    assert len(pipelined) == 3
    for step, (a, b) in enumerate(zip(pipelined, reference)):
        assert abs(a - b) <= 1e-5 * abs(b), (step, pipelined, reference)


def test_bpipe_fp16_with_dynamic_loss_scale_tracks_fp32():
    argv = ["--model-preset", "gpt-tiny", *COMMON, "--global-batch-size", "8"]
    reference = _single_process_losses(argv)
    fp16 = run_distributed(4, _pretrain_losses, argv + ["--fp16", "--pipeline-model-parallel-size", "4",
                                                        "--pipeline-schedule", "bpipe"])[0]
    for step, (a, b) in enumerate(zip(fp16, reference)):
        assert abs(a - b) <= 1e-2 * abs(b), (step, fp16, reference)
    assert fp16 != reference


def test_a_store_that_cannot_park_is_refused():
    schedule = build_schedule("bpipe", 4, 8)
    from megatron_pp.schedules.peer_store import prepare_store

    with pytest.raises(ValueError, match=r"rank 0 parks stashes on a peer \(BPipe\), which needs a PeerStore"):
        prepare_store(ActivationStore(), schedule, 0)
    with pytest.raises(ValueError, match=r"rank 3 hosts stashes of rank 0 \(BPipe\), which needs an AcceptorStore"):
        prepare_store(ActivationStore(), schedule, 3)
    prepare_store(ActivationStore(), schedule, 1)  # ranks 1 and 2 take no part at K = 3


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs: peer parking over NCCL on CUDA streams")
def test_bpipe_on_gpus_with_nccl_tracks_1f1b(tmp_path):
    """The CUDA path: NCCL pair groups, ACCEPT/RETURN posted by the acceptor's main thread, with
    CUDA_DEVICE_MAX_CONNECTIONS=1 (one hardware queue) as Megatron-style launches set it. Four ranks, K = 2
    (ranks 0 and 1 park on 3 and 2); bpipe's losses equal 1F1B's."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    losses = {}
    for name, extra in (("1f1b", []), ("bpipe", ["--bpipe-max-resident", "2"])):
        metrics = tmp_path / f"{name}.jsonl"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               os.path.join(root, "pretrain_gpt.py"), "--model-preset", "gpt-tiny", *COMMON,
               "--global-batch-size", "16", "--pipeline-model-parallel-size", "4", "--pipeline-schedule", name,
               *extra, "--metrics-file", str(metrics)]
        env = {**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=root, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses[name] = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert losses["bpipe"] == pytest.approx(losses["1f1b"], rel=1e-5)


def test_an_acceptor_that_hosts_nothing_reports_no_guests():
    # Memory reports read these fields whether or not a step ran them through reset_peak: an acceptor
    # whose partner parks nothing reports zero guests and only its own stash's bytes.
    weight = torch.randn(8, 8, requires_grad=True)
    store = AcceptorStore([weight], link=None)
    assert (store.peak_guests, store.guest_bytes, store.peak_count, store.peak_bytes) == (0, 0, 0, 0)
    x = torch.randn(8, 8, requires_grad=True)
    with store.stash((0, 0)):
        loss = _forward(x, weight)
    assert (store.peak_guests, store.guest_bytes, store.peak_count, store.peak_bytes) == (0, 0, 1, 2 * 8 * 8 * 4)
    loss.backward()
    store.release((0, 0))
    assert (store.resident_count, store.live_bytes, store.peak_guests) == (0, 0, 0)
