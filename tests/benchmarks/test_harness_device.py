"""Where benchmarks/bench_schedules.py measures (megatron_pp/benchmarks/harness.py, `run_benchmark`): on the
local GPU 0 when CUDA is there, on the CPU otherwise. The CPU suite never takes the CUDA branch, so the choice is
checked here with CUDA reported present and the measurement itself replaced by a recorder: what is held is the
device handed to it (an index moved by one, cuda:-1, would raise on a GPU at once and pass every CPU test)."""
import pytest
import torch

from megatron_pp.benchmarks import harness


class _Recorded(Exception):
    pass


@pytest.mark.parametrize("cuda", [True, False])
def test_the_benchmark_measures_on_gpu_0_or_the_cpu(monkeypatch, cuda):
    seen = {}

    def record(*args, device, **kwargs):
        seen["device"] = device
        raise _Recorded

    monkeypatch.setattr(harness.torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(harness, "_measure_rounds", record)
    with pytest.raises(_Recorded):
        harness.run_benchmark(["1f1b"], pp=2, microbatches=2, chunks=1, rounds=1, micro_batch=1,
                              config=harness.bench_config(2, 8, 2, 16, 64, "gpt-tiny"),
                              pool=object())  # a pool given: none is started (nor closed)
    assert seen["device"] == (torch.device("cuda", 0) if cuda else torch.device("cpu"))
