"""`step_metrics` packs the loss and the per-rank peaks into one vector for one max all-reduce; the
CUDA layout (loss, stash peaks, device-memory peaks) is checked here without a GPU by standing in for the
collective and the allocator."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_pp.training import step


@pytest.mark.parametrize("pp_rank,pp", [(0, 1), (1, 3)])
def test_cuda_layout_has_one_memory_peak_per_pipeline_rank(monkeypatch, pp_rank, pp):
    def all_reduce(tensor, group=None, op="sum"):
        if op != "max":
            return tensor
        # The max over the pipeline ranks: the others fill their own slots with smaller figures.
        filled = tensor.clone()
        filled[1:][torch.isinf(filled[1:])] = 0.0
        return filled

    monkeypatch.setattr(step.comm, "all_reduce", all_reduce)
    monkeypatch.setattr(step, "take_peak_memory", lambda device: 4096)
    state = SimpleNamespace(pp_size=pp, pp_rank=pp_rank, dp_group=None, dp_size=1, device=torch.device("cuda"))
    result = SimpleNamespace(loss_sum=torch.tensor(6.0), peak_stash_bytes=100)
    metrics = step.step_metrics(SimpleNamespace(state=state), result, tokens=3.0)
    assert math.isclose(metrics.loss, 2.0)
    assert metrics.peak_stash_bytes == [100 if r == pp_rank else 0 for r in range(pp)]
    assert metrics.peak_memory_bytes == [4096 if r == pp_rank else 0 for r in range(pp)]
    assert metrics.tokens == 3.0  # the last slot, after the memory peaks (not a peak read as the count)
