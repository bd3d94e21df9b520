"""`ShardedMainParams.overlap_param_gather` on one process (data-parallel size 1, so every gather is complete at
once and only the bookkeeping is under test): `copy_to_model` leaves each bucket's gathered weights out of the
model until the forward of a chunk that holds them, the next `copy_to_model` and `load_state_dict` first put
in what is left, and a parameter shared by two chunks is finished by either chunk's forward. The multi-rank
behaviour (the gathers really in flight, exactness under the schedules) is
tests/training/test_overlap_param_gather.py's."""
from __future__ import annotations

import torch
from torch import nn

from megatron_pp.core.distributed_optimizer import ShardedMainParams
from megatron_pp.core.grads import GradientReducer
from megatron_pp.core.parallel_state import ParallelState


def _setup():
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    chunks = [nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), shared), nn.Sequential(nn.Linear(4, 4))]
    chunks[1].append(shared)  # held by both chunks, as a tied embedding is when both ends share a rank
    state = ParallelState.build(1, 1, device=torch.device("cpu"))
    # 64 fp32 bytes per bucket: about one tensor each, several buckets per chunk
    reducer = GradientReducer(chunks, state, overlap=False, bucket_bytes=64, distributed_optimizer=True)
    main = ShardedMainParams(reducer)
    main.overlap_param_gather(chunks)
    return chunks, reducer, main, shared


def _values(chunk):
    return [p.detach().clone() for p in chunk.parameters()]


def _bump(main, amount):
    with torch.no_grad():
        for m in main.params:
            m.add_(amount)


def test_each_chunk_takes_its_weights_at_its_forward_and_the_next_update_takes_the_rest():
    chunks, reducer, main, shared = _setup()
    try:
        start = [_values(c) for c in chunks]
        assert len(reducer.buckets) >= 5 and all(main._chunk_buckets)
        shared_buckets = {b.index for b in reducer.buckets if any(p is shared.weight for p in b.params)}
        assert shared_buckets <= set(main._chunk_buckets[0]) & set(main._chunk_buckets[1])

        _bump(main, 1.0)
        main.copy_to_model()
        assert main.gathers_in_flight == set(range(len(reducer.buckets)))
        assert all(torch.equal(a, b) for c, s in zip(chunks, start) for a, b in zip(_values(c), s))

        chunks[1](torch.zeros(1, 4))  # its pre-hook: chunk 1's buckets (the shared weight's included) land
        assert main.gathers_in_flight == set(main._chunk_buckets[0]) - set(main._chunk_buckets[1])
        assert all(torch.equal(a, b + 1) for a, b in zip(_values(chunks[1]), start[1]))
        first_only = [p for p in chunks[0].parameters() if all(p is not q for q in chunks[1].parameters())]
        assert first_only and all(torch.equal(p.detach(), s) for p, s in zip(first_only, start[0]))

        _bump(main, 1.0)
        main.copy_to_model()  # puts in chunk 0's +1 first, then leaves the +2 in flight
        assert main.gathers_in_flight == set(range(len(reducer.buckets)))
        assert all(torch.equal(a, b + 1) for c, s in zip(chunks, start) for a, b in zip(_values(c), s))

        saved = main.state_dict()
        _bump(main, 1.0)
        main.load_state_dict(saved)  # a gather landing after the load would overwrite what it loads
        assert main.gathers_in_flight == set()
        assert all(torch.equal(a, b + 2) for c, s in zip(chunks, start) for a, b in zip(_values(c), s))
        assert all(torch.equal(m, p) for m, p in zip(main.params, saved["main"]))
    finally:
        main.close()
        reducer.close()


def test_without_overlap_copy_to_model_writes_everything_at_once():
    torch.manual_seed(0)
    chunks = [nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))]
    reducer = GradientReducer(chunks, ParallelState.build(1, 1, device=torch.device("cpu")), overlap=False,
                              bucket_bytes=64, distributed_optimizer=True)
    main = ShardedMainParams(reducer)
    try:
        start = _values(chunks[0])
        _bump(main, 1.0)
        main.copy_to_model()
        assert main.gathers_in_flight == set()
        assert all(torch.equal(a, b + 1) for a, b in zip(_values(chunks[0]), start))
    finally:
        reducer.close()
