"""Time one transformer layer's forward and backward per microbatch size and attention backend (JSON out).

    python tools/bench_layer.py --model-preset gpt3-175b --tp 8 --micro-batch-sizes 1 2 4 8 \\
        --hidden-dropout 0.1 --attention-dropout 0.1 --out runs/bench_layer_gpt3_tp8.json

Runs one GPU's tensor-parallel shard of a layer of the preset (a/t heads, g/t key/value groups, f/t MLP
width, full hidden size; no communication) on the current device: CUDA in bf16 when there is one, else
the CPU in fp32 with tiny shapes. Backends: `flash` (flash-attn, CUDA only, when installed), `sdpa`
(PyTorch's fused kernels) and `reference` (the unfused matmul-softmax path that keeps the s×s scores).
Rounds alternate every (backend, b) so slow drift on a shared machine hits all alike; medians are
reported. Per row: forward, backward and attention-core forward milliseconds, the model FLOPs they did
(Megatron's convention, see megatron_pp/planning/efficiency.py), achieved TFLOP/s, MFU when the device's
peak is known, and the bytes the layer saved for backward (measured by `ActivationStore`, and predicted
by `planning.memory` where a formula covers the device and dtype). `tools/estimate_bpipe.py
--efficiency-file` reads the file. Results go in docs/benchmarks.md.
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
from megatron_pp.core.tensor_parallel import TENSOR_PARALLEL_RNG, RNGTracker  # noqa: E402
from megatron_pp.models.attention import attention, resolve_backend  # noqa: E402
from megatron_pp.models.config import TransformerConfig  # noqa: E402
from megatron_pp.models.layout import StageSpec  # noqa: E402
from megatron_pp.models.presets import configured_preset, preset_names  # noqa: E402
from megatron_pp.models.init import initial_value  # noqa: E402
from megatron_pp.models.layers import TransformerLayer
from megatron_pp.models.ops import rotary_cos_sin
from megatron_pp.planning.efficiency import BENCH_FORMAT, LayerShape, hardware_for_device  # noqa: E402
from megatron_pp.planning.memory import CPU_FP32, attention_kind, stash_bytes  # noqa: E402
from megatron_pp.schedules.store import ActivationStore  # noqa: E402

SEED = 1234


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = ExitingArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-preset", default="gpt-tiny", help=f"one of {', '.join(preset_names())}")
    p.add_argument("--seq-length", type=int, help="override the preset's sequence length")
    p.add_argument("--tensor-model-parallel-size", "--tp", dest="tp", type=int, default=1,
                   help="benchmark the shard one GPU of this TP degree runs")
    p.add_argument("--hidden-dropout", type=float, help="override the preset's value")
    p.add_argument("--attention-dropout", type=float, help="override the preset's value")
    p.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--backends", nargs="+", choices=("flash", "sdpa", "reference"),
                   help="default: every backend available on the device")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (medians are reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--peak-tflops", type=float, help="device peak for MFU (default: known GPU models; none on CPU)")
    p.add_argument("--out", required=True, help="JSON report path")
    args = p.parse_args(argv)
    if min(args.micro_batch_sizes) < 1 or args.repeats < 1 or args.warmup < 0:
        p.error("--micro-batch-sizes and --repeats must be >= 1, --warmup >= 0")
    return args


def shard_config(config: TransformerConfig, shape: LayerShape, dtype: torch.dtype) -> TransformerConfig:
    """The per-GPU shard of a tensor-parallel layer, as a tp = 1 config with fewer heads and a narrower MLP."""
    return dataclasses.replace(
        config, num_attention_heads=shape.num_heads, num_query_groups=shape.num_query_groups,
        kv_channels=shape.head_dim, ffn_hidden_size=shape.ffn_hidden_size, params_dtype=dtype,
    )


def build_layer(config: TransformerConfig, backend: str, device: torch.device, tracker: RNGTracker) -> TransformerLayer:
    config = dataclasses.replace(config, attention_backend=backend)
    layer = TransformerLayer(config, None, False, tracker, device)
    with torch.no_grad():  # same weights for every backend: the comparison is of kernels only
        for name, param in layer.named_parameters():
            param.copy_(initial_value(config, name, tuple(param.shape), SEED))
    return layer.train()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def measure(layer: TransformerLayer, config: TransformerConfig, b: int, device: torch.device,
            dtype: torch.dtype) -> dict:
    """One forward + backward of the layer and one forward of its attention core, in seconds; bytes saved."""
    s, h = config.seq_length, config.hidden_size
    rotary = None
    if config.position_embedding_type == "rope":
        positions = torch.arange(s, device=device).expand(b, s)
        rotary = rotary_cos_sin(positions, config.rotary_dim, config.rotary_base)
    x = torch.randn(s, b, h, device=device, dtype=dtype, requires_grad=True)
    store = ActivationStore(list(layer.parameters()))
    with store.stash(0):
        forward_s, y = timed(lambda: layer(x, rotary, None, None), device)
    saved = store.live_bytes
    grad = torch.randn_like(y)
    backward_s, _ = timed(lambda: y.backward(grad), device)

    heads, groups, d = config.num_attention_heads, config.query_groups, config.head_dim
    q = torch.randn(b, s, heads, d, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, s, groups, d, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    core_s, _ = timed(lambda: attention(q, k, v, causal=True, dropout_p=config.attention_dropout,
                                        backend=layer.self_attention.backend), device)
    return {"forward_s": forward_s, "backward_s": backward_s, "core_s": core_s, "stash_bytes": saved}


def predicted_stash(config: TransformerConfig, backend: str, b: int, device: torch.device, dtype: torch.dtype):
    """planning.memory's bytes for this layer, where a profile covers the device (CPU in fp32 only)."""
    if device.type != "cpu" or dtype != torch.float32:
        return None
    try:
        kind = attention_kind(backend, "cpu", config.attention_dropout)
    except ValueError:
        return None
    return stash_bytes(config, StageSpec(0, 0, 1, False, False), b, attention=kind, numerics=CPU_FP32)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or "cpu"


def run(args: argparse.Namespace, command: str) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but no CUDA device is available")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = configured_preset(args.model_preset, args.seq_length, args.hidden_dropout, args.attention_dropout)
    shape = LayerShape.from_config(config, args.tp)
    local = shard_config(config, shape, dtype)

    available = ["sdpa", "reference"]
    if resolve_backend("auto", torch.empty(1, device=device, dtype=dtype)) == "flash":  # flash-attn importable
        available.insert(0, "flash")
    backends = args.backends or available
    missing = [b for b in backends if b not in available]
    if missing:
        raise ValueError(f"backend {missing[0]} is not available on {device.type} (available: {', '.join(available)})")

    tracker = RNGTracker()
    tracker.add(TENSOR_PARALLEL_RNG, SEED)
    torch.manual_seed(SEED)
    layers = {name: build_layer(local, name, device, tracker) for name in backends}
    samples: dict[tuple[str, int], list[dict]] = {(n, b): [] for n in backends for b in args.micro_batch_sizes}
    for round_index in range(args.warmup + args.repeats):
        for name in backends:
            for b in args.micro_batch_sizes:
                sample = measure(layers[name], local, b, device, dtype)
                if round_index >= args.warmup:
                    samples[(name, b)].append(sample)

    peak = args.peak_tflops
    if peak is None and device.type == "cuda":
        profile = hardware_for_device(device_name(device))
        peak = profile.peak_tflops if profile else None
    results = []
    for (name, b), rows in samples.items():
        forward_ms = 1e3 * statistics.median(r["forward_s"] for r in rows)
        backward_ms = 1e3 * statistics.median(r["backward_s"] for r in rows)
        core_ms = 1e3 * statistics.median(r["core_s"] for r in rows)
        flops = shape.forward_model_flops(b)
        achieved = 3 * flops / ((forward_ms + backward_ms) / 1e3) / 1e12
        results.append({
            "backend": name, "micro_batch_size": b,
            "forward_ms": forward_ms, "backward_ms": backward_ms, "core_forward_ms": core_ms,
            "forward_flops": flops, "backward_flops": 2 * flops,
            "core_forward_flops": shape.core_forward_model_flops(b),
            "achieved_tflops": achieved, "mfu": None if peak is None else achieved / peak,
            "stash_bytes": rows[0]["stash_bytes"],
            "stash_bytes_predicted": predicted_stash(local, name, b, device, dtype),
        })
    return {
        "format": BENCH_FORMAT,
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": {"type": device.type, "name": device_name(device), "threads": torch.get_num_threads(),
                   "torch": torch.__version__},
        "dtype": str(dtype).removeprefix("torch."),
        "peak_tflops": peak,
        "model_preset": args.model_preset,
        "layer": dataclasses.asdict(shape),
        "warmup": args.warmup,
        "repeats": args.repeats,
        "results": results,
    }


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    command = "python tools/bench_layer.py " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        report = run(args, command)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    write_json(args.out, report)
    header = (f"{'backend':<10} {'b':>3} {'fwd ms':>9} {'bwd ms':>9} {'core ms':>8} {'TFLOP/s':>8} {'MFU':>6} "
              f"{'stash MB':>9}")
    print(f"{report['device']['name']} ({report['dtype']}), {args.model_preset} tp {args.tp} shard -> {args.out}")
    print(header)
    for r in report["results"]:
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        print(f"{r['backend']:<10} {r['micro_batch_size']:>3} {r['forward_ms']:>9.2f} {r['backward_ms']:>9.2f} "
              f"{r['core_forward_ms']:>8.2f} {r['achieved_tflops']:>8.3f} {mfu:>6} {r['stash_bytes'] / 1e6:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
