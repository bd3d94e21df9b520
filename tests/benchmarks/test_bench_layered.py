"""benchmarks/bench_layered.py's emulated data-parallel link: results stay exact, completions respect the link."""
import os
import sys
import time

import torch
import torch.distributed as dist

from tests.dist import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_layered  # noqa: E402


def _emulated(ctx):
    group = dist.new_group([0, 1])
    original = dist.all_reduce
    x = torch.full((250_000,), float(dist.get_rank() + 1))  # 1 MB, 1 MB on the wire per rank for n = 2
    with bench_layered.EmulatedLink(group, gbps=0.05) as link:  # 20 ms per call
        issued = time.perf_counter()
        first = dist.all_reduce(x, group=group, async_op=True)
        second = dist.all_reduce(x.clone(), group=group, async_op=True)  # queued behind the first
        second.wait()
        waited = time.perf_counter() - issued
        first.wait()
        other = torch.ones(4)
        dist.all_reduce(other)  # another group (the world): passes through untouched
        free = link.free - issued
    assert dist.all_reduce is original  # restored on exit
    return x[0].item(), waited, free, other[0].item()


def test_emulated_link_is_exact_and_never_early():
    for value, waited, free, other in run_distributed(2, _emulated):
        assert value == 3.0 and other == 2.0
        assert free >= 0.04 - 1e-3  # two 20 ms transfers back to back
        assert waited >= free - 1e-3  # the second completes no earlier than the link frees
