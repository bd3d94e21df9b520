"""core.comm: collectives that put each tensor on its backend's device, and the rule that only `core` talks
to torch.distributed (so an NCCL job never gets a host tensor from a module that forgot which backend runs)."""
from __future__ import annotations

import ast
import math
import os

import pytest
import torch

from megatron_pp.core import comm
from tests.dist import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ABOVE_CORE = ("training", "schedules", "planning")


def _direct_uses(path: str) -> list[str]:
    """Lines of `path` that import or reach torch.distributed other than through megatron_pp.core."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if a.name.startswith("torch.distributed")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
            found.append(f"{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and any(a.name == "distributed" for a in node.names):
            found.append(f"{node.lineno}: from torch import distributed")
        elif (isinstance(node, ast.Attribute) and node.attr == "distributed" and isinstance(node.value, ast.Name)
              and node.value.id == "torch"):
            found.append(f"{node.lineno}: torch.distributed")
    return found


def test_only_core_calls_torch_distributed():
    offenders = []
    for package in ABOVE_CORE:
        for folder, _, files in os.walk(os.path.join(ROOT, "megatron_pp", package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    offenders += [f"{os.path.relpath(path, ROOT)}:{line}" for line in _direct_uses(path)]
    # The one exception: the side-by-side benchmark runs torch.distributed.pipelining's own runtime (its peer),
    # so it imports that package; its communication otherwise goes through core like everyone else's.
    offenders = [o for o in offenders
                 if not (o.startswith("megatron_pp/benchmarks/vs_torch.py:") and "torch.distributed.pipelining" in o)]
    assert not offenders, "call megatron_pp.core (comm, p2p, parallel_state) instead:\n" + "\n".join(offenders)


def test_the_scan_sees_every_spelling(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import torch.distributed as dist\nfrom torch import distributed\n"
                      "from torch.distributed import barrier\nimport torch\ntorch.distributed.barrier()\n")
    assert [line.split(":")[0] for line in _direct_uses(str(source))] == ["1", "2", "3", "5"]


def test_single_process_calls_are_no_ops():
    t = torch.tensor([1.0, 2.0])
    assert comm.all_reduce(t) is t and t.tolist() == [1.0, 2.0]
    assert comm.all_reduce_async(t).result() is t
    assert comm.all_gather_object({"a": 1}) == [{"a": 1}]
    comm.barrier()
    assert not comm.is_distributed() and comm.world_size() == 1 and comm.backend_device() == torch.device("cpu")


def _collectives(ctx):
    import torch.distributed as dist

    rank = dist.get_rank()
    summed = comm.all_reduce(torch.tensor([float(rank + 1)], dtype=torch.float64))
    maxed = comm.all_reduce(torch.tensor([float(rank), -float(rank)]), op="max")
    pending = comm.all_reduce_async(torch.full((3,), float(rank)))
    objects = comm.all_gather_object(("rank", rank))
    comm.barrier()
    return summed.tolist(), maxed.tolist(), pending.result().tolist(), objects, comm.backend_name()


def test_collectives_on_gloo():
    results = run_distributed(2, _collectives)
    for summed, maxed, pending, objects, backend in results:
        assert summed == [3.0] and maxed == [1.0, 0.0] and pending == [1.0] * 3
        assert objects == [("rank", 0), ("rank", 1)] and backend == "gloo"


def test_bad_reduce_op_is_named():
    with pytest.raises(ValueError, match="reduce op"):
        comm._op("mean")


def _train_with_checked_devices(ctx, argv):
    """pretrain with every torch.distributed collective checked: each tensor must already be on the device
    the group's backend takes (what NCCL enforces and gloo does not)."""
    import torch.distributed as dist

    from megatron_pp.training.arguments import parse_args
    from megatron_pp.training.train import pretrain

    seen = []
    originals = {name: getattr(dist, name) for name in ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor")}

    def checked(name):
        def call(tensor, *args, **kwargs):
            group = kwargs.get("group")
            want = comm.backend_device(group)
            if tensor.device != want:
                raise AssertionError(f"{name} got a {tensor.device} tensor for a {comm.backend_name(group)} group")
            seen.append(name)
            return originals[name](tensor, *args, **kwargs)
        return call

    for name in originals:
        setattr(dist, name, checked(name))
    try:
        args = parse_args(argv)
        rows = pretrain(args, state=ctx.parallel_state(args.tensor_model_parallel_size, args.pipeline_model_parallel_size))
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return rows, len(seen)


def test_data_and_pipeline_parallel_run_with_evaluation_matches_one_process():
    """dp 2 x pp 2 with evaluation: the step metrics and evaluation reductions go through comm, on the right
    device, and give the single-process losses."""
    from megatron_pp.training.arguments import parse_args
    from megatron_pp.training.train import pretrain

    argv = ["--model-preset", "gpt-tiny", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--train-iters", "2", "--lr", "1e-3", "--seed", "7", "--eval-interval", "2", "--eval-iters", "1"]
    reference = pretrain(parse_args(argv))
    rows, collectives = run_distributed(4, _train_with_checked_devices, argv + ["--pipeline-model-parallel-size", "2"])[0]
    assert collectives > 0
    train_ref = [r["loss"] for r in reference if "loss" in r]
    train = [r["loss"] for r in rows if "loss" in r]
    evals, eval_ref = [r["eval_loss"] for r in rows if "eval_loss" in r], [r["eval_loss"] for r in reference if "eval_loss" in r]
    assert len(train) == 2 and len(evals) == 1 and math.isfinite(evals[0])
    for a, b in zip(train + evals, train_ref + eval_ref):
        assert abs(a - b) <= 1e-5 * abs(b), (train, evals, train_ref, eval_ref)
