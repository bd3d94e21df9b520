"""Paired A/B timings of the cheap speed-ups against the code paths they replaced (JSON out).

    python tools/bench_cheap_speed.py --rounds 7 --json docs/results/cheap_speed_cpu.json

Each case runs its old path (A) and new path (B) alternately, `--rounds` times, and reports the median
of the per-round ratios B/A with the medians of both times (so drift on a shared machine hits both
alike). The old paths are written out here as they were:

- `grad_norm`: the per-tensor fp64 loop over the reducer's held gradient pieces vs `norm_and_found_inf`
  (one multi-tensor norm over merged bucket views), on a 24-layer GPT's gradient buffers.
- `init`: drawing a parameter's full tensor and slicing it vs `initial_shard`, for one LLaMA-2-7B-shaped
  layer's weights as TP rank 0 and rank 7 of 8 (rank 7 skips the most draws); also the largest CPU
  tensor each path allocates.
- `norm`: bf16 RMSNorm forward+backward through plain autograd vs `_LowPrecisionNorm`, with the bytes
  each saves for the backward.
- `rope`: bf16 rotation forward+backward through plain autograd vs the `_Rotary` Function (op by op;
  `--fused-rope` also compiles it, which needs a working `torch.compile` for the device).
- `main_grad`: a bf16 step of 4 microbatches with bf16 `.grad`s folded by the hook vs weight gradients
  added straight into the fp32 slots, and each path's relative error against the fp64 sum of the
  microbatches' fp32 contributions.
"""
import argparse
import dataclasses
import datetime
import os
import platform
import statistics
import sys
import time
from typing import Callable, Optional

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_pp.cli import ExitingArgumentParser, write_json  # noqa: E402
from megatron_pp.core import grads  # noqa: E402
from megatron_pp.core.grads import GradientReducer  # noqa: E402
from megatron_pp.core.parallel_state import ParallelState  # noqa: E402
from megatron_pp.core.tensor_parallel import layers, shard_tensor  # noqa: E402
from megatron_pp.data.mock import MockData  # noqa: E402
from megatron_pp.models import transformer  # noqa: E402
from megatron_pp.models.layout import StageSpec  # noqa: E402
from megatron_pp.models.presets import get_preset  # noqa: E402
from megatron_pp.models.transformer import StageModel, build_model  # noqa: E402

CASES = ("grad_norm", "init", "norm", "rope", "main_grad")


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = ExitingArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument("--rounds", type=int, default=7, help="A/B pairs per case (medians are reported)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available); init always draws on CPU")
    p.add_argument("--fused-rope", action="store_true", help="also time the torch.compile'd rotation")
    p.add_argument("--json", required=True, help="output file")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    return args


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def paired(a: Callable[[], object], b: Callable[[], object], rounds: int, device: torch.device) -> dict:
    """Median seconds of `a` and `b` (alternating, one warm-up each) and the median per-round ratio b/a."""
    a(), b()
    times: dict[str, list[float]] = {"a": [], "b": []}
    for _ in range(rounds):
        for key, fn in (("a", a), ("b", b)):
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            times[key].append(time.perf_counter() - start)
    ratios = [tb / ta for ta, tb in zip(times["a"], times["b"])]
    return {"old_s": statistics.median(times["a"]), "new_s": statistics.median(times["b"]),
            "ratio_new_over_old": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}


# Cases ----------------------------------------------------------------------------------------------------


def bench_grad_norm(rounds: int, device: torch.device) -> dict:
    config = dataclasses.replace(get_preset("gpt-tiny"), num_layers=24, hidden_size=128, num_attention_heads=4)
    model = build_model(config, seed=1, device=device)
    reducer = GradientReducer([model], ParallelState.build(device=device), overlap=False)
    for bucket in reducer.buckets:
        bucket.grad.normal_()
    reducer.grads_reduced = True
    pieces = [p.grad for p in reducer.held_pieces()]

    def loop() -> float:  # the per-tensor loop, as it was
        total = torch.zeros((), dtype=torch.float64, device=device)
        for g in pieces:
            flat = g.reshape(-1)
            for start in range(0, flat.numel(), grads._NORM_CHUNK):
                total += torch.linalg.vector_norm(flat[start:start + grads._NORM_CHUNK], dtype=torch.float64).square()
        return float(total)

    reps = 20
    result = paired(lambda: [loop() for _ in range(reps)],
                    lambda: [reducer.norm_and_found_inf() for _ in range(reps)], rounds, device)
    return {**result, "repeats_per_timing": reps, "tensors_old": len(pieces),
            "tensors_new": sum(len(side) for side in reducer._norm_views), "buckets": len(reducer.buckets),
            "elements": sum(g.numel() for g in pieces)}


def bench_init(rounds: int, device: torch.device) -> dict:
    # One LLaMA-2-7B layer, parameters described on the meta device (shapes and TP tags, no memory).
    config = dataclasses.replace(get_preset("llama2-7b"), num_layers=1)
    model = StageModel(config, StageSpec(0, 0, 1, has_embedding=False, has_head=False), device=torch.device("meta"))
    params = [(n, p) for n, p in model.named_parameters() if isinstance(transformer._init_rule(config, n), float)]
    size = 8
    out: dict = {"tp": size, "parameters": [n for n, _ in params]}
    for rank in (0, size - 1):
        def old() -> None:
            for name, p in params:  # tp = 1 parameters: their shapes are the full shapes
                full = transformer.initial_value(config, name, tuple(p.shape), 1)
                shard_tensor(full, p.partition_dim, p.partition_stride, rank, size)

        def new() -> None:
            for name, p in params:
                transformer.initial_shard(config, name, tuple(p.shape), 1, (p.partition_dim, p.partition_stride),
                                          rank, size)

        out[f"rank{rank}"] = paired(old, new, rounds, torch.device("cpu"))
    largest = max(p.numel() for _, p in params)
    out["largest_cpu_tensor_bytes_old"] = largest * 4  # the full fp32 tensor
    out["largest_cpu_tensor_bytes_new"] = largest // size * 4  # the shard (plus under 32 alignment elements per run)
    return out


def _saved_bytes(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    unique = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved
              if not isinstance(t, torch.nn.Parameter)}
    return out, sum(unique.values())


def bench_norm(rounds: int, device: torch.device) -> dict:
    s, b, h = (2048, 1, 4096) if device.type == "cuda" else (512, 1, 1024)
    x = torch.randn(s, b, h, device=device).to(torch.bfloat16).requires_grad_()
    w = torch.nn.Parameter(torch.ones(h, device=device, dtype=torch.bfloat16))
    grad = torch.randn(s, b, h, device=device).to(torch.bfloat16)

    def old_fwd() -> torch.Tensor:
        return transformer.norm_fp32(x, w, None, 1e-5)

    def new_fwd() -> torch.Tensor:
        return transformer._LowPrecisionNorm.apply(x, w, None, 1e-5)

    _, old_bytes = _saved_bytes(old_fwd)
    _, new_bytes = _saved_bytes(new_fwd)
    reps = 10
    result = paired(lambda: [torch.autograd.grad(old_fwd(), (x, w), grad) for _ in range(reps)],
                    lambda: [torch.autograd.grad(new_fwd(), (x, w), grad) for _ in range(reps)], rounds, device)
    return {**result, "shape": [s, b, h], "repeats_per_timing": reps,
            "saved_bytes_old": old_bytes, "saved_bytes_new": new_bytes, "input_bytes": x.numel() * 2}


def bench_rope(rounds: int, device: torch.device, fused: bool) -> dict:
    s, b, heads, d = (4096, 1, 32, 128) if device.type == "cuda" else (512, 1, 8, 64)
    cos, sin = transformer.rotary_cos_sin(torch.arange(s, device=device).expand(b, s), d, 10000.0)
    x = torch.randn(s, b, heads, d, device=device).to(torch.bfloat16).requires_grad_()
    grad = torch.randn_like(x)
    reps = 10

    def old() -> None:
        for _ in range(reps):
            torch.autograd.grad(transformer.rotate(x, cos, sin), x, grad)

    def new() -> None:
        for _ in range(reps):
            torch.autograd.grad(transformer.apply_rotary(x, (cos, sin)), x, grad)

    out = {"shape": [s, b, heads, d], "repeats_per_timing": reps, "eager": paired(old, new, rounds, device)}
    if fused:
        transformer.use_fused_rotary()
        try:
            out["fused"] = paired(old, new, rounds, device)
        finally:
            transformer.use_fused_rotary(False)
    return out


def bench_main_grad(rounds: int, device: torch.device) -> dict:
    config = dataclasses.replace(get_preset("llama-tiny"), num_layers=4, hidden_size=128, num_attention_heads=8,
                                 ffn_hidden_size=352, seq_length=64, params_dtype=torch.bfloat16)
    model = build_model(config, seed=1, device=device)
    reducer = GradientReducer([model], ParallelState.build(device=device), overlap=False)
    batches = [{k: v.to(device) for k, v in mb.items()}
               for mb in MockData(1, config.seq_length, config.vocab_size, 2, 8).step_microbatches(0, 0)]
    real = layers.folds_into_main_grad

    def step(fold: bool, one: Optional[int] = None) -> dict[str, torch.Tensor]:
        layers.folds_into_main_grad = real if fold else (lambda weight: False)
        try:
            todo = batches if one is None else [batches[one]]
            reducer.start_step(len(todo))
            for mb in todo:
                ((model(None, mb).float() * mb["loss_mask"]).sum() / 1000).backward()
            reducer.finish()
        finally:
            layers.folds_into_main_grad = real
        return {n: reducer.grad_view(p) for n, p in model.named_parameters() if n.endswith("linear_fc1.weight")}

    exact = {n: sum(step(True, i)[n].double() for i in range(len(batches))) for n in step(True, 0)}
    errors = {}
    for fold in (False, True):
        got = step(fold)
        errors["new" if fold else "old"] = max(((got[n].double() - exact[n]).norm() / exact[n].norm()).item()
                                              for n in exact)
    result = paired(lambda: step(False), lambda: step(True), rounds, device)
    return {**result, "microbatches": len(batches), "fc1_relative_error_old": errors["old"],
            "fc1_relative_error_new": errors["new"]}


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    report: dict = {"command": " ".join(["python tools/bench_cheap_speed.py"] + (argv or sys.argv[1:])),
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "device": str(device), "cpu": platform.processor() or platform.machine(),
                    "torch": torch.__version__, "threads": torch.get_num_threads(), "rounds": args.rounds}
    for case in args.cases:
        print(f"{case} ...", flush=True)
        if case == "rope":
            report[case] = bench_rope(args.rounds, device, args.fused_rope)
        else:
            report[case] = globals()[f"bench_{case}"](args.rounds, device)
        print(report[case], flush=True)
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
