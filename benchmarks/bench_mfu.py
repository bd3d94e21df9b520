"""Single-device MFU of a LLaMA-3-8B-shaped stack, and its throughput against Hugging Face's LlamaForCausalLM.

    python benchmarks/bench_mfu.py --json runs/bench_mfu_h100.json            # GPU: 4 layers, seq 4096, bf16
    python benchmarks/bench_mfu.py --scale tiny --rounds 3 --json runs/tiny.json   # CPU smoke test, seconds

Builds a few layers (default 4) of the `llama3-8b` preset (hidden 4096, MLP 14336, 32 query heads in 8
key/value groups, RoPE theta 500000, vocabulary 128256, untied output) with the framework's model code,
and the same shapes as `transformers`' LlamaForCausalLM with our initial weights copied in (see
`megatron_pp.benchmarks.harness`). Both train full steps (forward, backward, clipping, AdamW) on one
fixed batch; rounds alternate the two models (ours first in even rounds, HF first in odd ones), each round
timing `--steps` back-to-back steps per model after `--warmup` untimed ones (CUDA events on a GPU).
Reported: per-model median step time with min/max over rounds, tokens/s, model TFLOP/s (Megatron's
count, `megatron_pp/training/flops.py`), MFU against the device's dense bf16 peak (`HardwareProfile` of
`megatron_pp/planning/efficiency.py`, `--peak-tflops` to override; null on CPU or an unknown GPU), the
per-round ratio of our tokens/s to HF's with its median and spread, both models' parameter counts and
first losses (which must agree: same weights, same batch), and the issue's targets (MFU >= 50%, ratio
>= 1.2x). Attention: flash-attn (HF's "flash_attention_2") when the package is installed and the run is
bf16 on CUDA, else SDPA in both. The GPU is used only when `torch.cuda.is_available()`.
"""
import argparse
import dataclasses
import datetime
import importlib.metadata
import os
import platform
import sys
from typing import Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: both models are built from configs
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_pp.cli import write_json  # noqa: E402
from megatron_pp.models.attention import resolve_backend  # noqa: E402
from megatron_pp.models.config import TransformerConfig  # noqa: E402
from megatron_pp.models.presets import get_preset, preset_names  # noqa: E402
from megatron_pp.planning.efficiency import hardware_for_device  # noqa: E402
from megatron_pp.benchmarks.harness import HF_ATTENTION, MFU_FORMAT, run_mfu_benchmark  # noqa: E402
from megatron_pp.training.flops import device_peak_tflops  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# --scale tiny: LLaMA-3's architecture (GQA, theta 500000, untied output) at llama-tiny's sizes: hidden 64,
# 8 heads of 8 in 4 groups, MLP 176, vocabulary 512 (a multiple of 128, so no padding rows).
TINY_SEQ_LENGTH = 64


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", choices=("full", "tiny"), default="full",
                   help="full: the --preset's shapes; tiny: a tiny LLaMA-3-like shape in fp32 that runs on CPU in "
                        "seconds (for tests)")
    p.add_argument("--preset", default="llama3-8b",
                   help=f"model preset at --scale full; one of {', '.join(preset_names())}")
    p.add_argument("--layers", type=int, default=4, help="transformer layers of the stack")
    p.add_argument("--seq-length", type=int, help=f"default: 4096 (full), {TINY_SEQ_LENGTH} (tiny)")
    p.add_argument("--micro-batch-size", type=int, default=1, help="sequences per training step")
    p.add_argument("--rounds", type=int, default=5, help="paired rounds (each times both models)")
    p.add_argument("--steps", type=int, default=5, help="timed training steps per model per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per model before the first round")
    p.add_argument("--dtype", choices=tuple(DTYPES), help="default: bf16 on CUDA at --scale full, else fp32")
    p.add_argument("--attention-backend", choices=("auto", "flash", "sdpa"), default="auto",
                   help="auto: flash-attn when installed and the run is bf16 on CUDA, else sdpa")
    p.add_argument("--peak-tflops", type=float, help="device peak for MFU (default: the device's dense bf16 peak)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", help="write the report to this JSON file")
    args = p.parse_args(argv)
    for name in ("layers", "micro_batch_size", "rounds", "steps", "warmup"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.seq_length is not None and args.seq_length < 1:
        p.error(f"--seq-length must be >= 1, got {args.seq_length}")
    return args


def bench_model_config(args: argparse.Namespace, device: torch.device) -> TransformerConfig:
    """The stack's config with the attention backend resolved for `device` and the dtype."""
    cuda = device.type == "cuda"
    dtype = DTYPES[args.dtype or ("bf16" if cuda and args.scale == "full" else "fp32")]
    if args.scale == "tiny":
        base = dataclasses.replace(get_preset("llama-tiny"), rotary_base=500000.0)
        seq = args.seq_length or TINY_SEQ_LENGTH
    else:
        base = get_preset(args.preset)
        seq = args.seq_length or 4096
    config = dataclasses.replace(base, num_layers=args.layers, seq_length=seq, max_position_embeddings=seq,
                                 params_dtype=dtype)
    if config.normalization != "RMSNorm" or config.activation != "swiglu" or config.position_embedding_type != "rope":
        raise ValueError(f"--preset {args.preset} is not a LLaMA shape (RMSNorm, SwiGLU, RoPE): HF's "
                         "LlamaForCausalLM cannot compute it")
    probe = torch.empty(1, device=device, dtype=dtype)
    backend = resolve_backend(args.attention_backend, probe)
    if backend == "flash" and resolve_backend("auto", probe) != "flash":
        raise ValueError("--attention-backend flash needs the flash_attn package and a bf16 run on CUDA")
    return dataclasses.replace(config, attention_backend=backend)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"cpu: {line.split(':', 1)[1].strip()}"
    return f"cpu: {platform.processor() or 'unknown'}"


def device_peak(device: torch.device, name: str, override: Optional[float]) -> tuple[Optional[float], Optional[str]]:
    """(dense bf16 peak TFLOP/s, where it comes from); (None, None) on CPU and unknown GPUs."""
    if override is not None:
        return override, "--peak-tflops"
    if device.type != "cuda":
        return None, None
    profile = hardware_for_device(name)
    if profile is not None:
        return profile.peak_tflops, profile.sources.get("peak_tflops", profile.name)
    peak = device_peak_tflops(name)  # PCIe / NVL variants, which have no HardwareProfile
    return (peak, "megatron_pp.training.flops.BF16_DENSE_PEAK_TFLOPS") if peak is not None else (None, None)


def versions() -> dict:
    import transformers

    try:
        flash = importlib.metadata.version("flash_attn")
    except importlib.metadata.PackageNotFoundError:
        flash = None
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "cuda": torch.version.cuda, "flash_attn": flash}


def run(args: argparse.Namespace, command: str) -> dict:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    config = bench_model_config(args, device)
    name = device_name(device)
    peak, peak_source = device_peak(device, name, args.peak_tflops)
    result = run_mfu_benchmark(config, micro_batch=args.micro_batch_size, rounds=args.rounds, steps=args.steps,
                               warmup=args.warmup, device=device, peak_tflops=peak, seed=args.seed)
    return {
        "format": MFU_FORMAT,
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": {"type": device.type, "name": name, "threads": torch.get_num_threads(),
                   "peak_tflops": peak, "peak_source": peak_source},
        "versions": versions(),
        "model": {
            "scale": args.scale, "preset": "llama-tiny (theta 500000)" if args.scale == "tiny" else args.preset,
            "num_layers": config.num_layers, "hidden_size": config.hidden_size,
            "ffn_hidden_size": config.ffn_size, "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.query_groups, "head_dim": config.head_dim,
            "vocab_size": config.vocab_size, "padded_vocab_size": config.padded_vocab_size(),
            "rope_theta": config.rotary_base, "rms_norm_eps": config.norm_epsilon,
            "tied_embeddings": not config.untie_embeddings_and_output_weights,
            "seq_length": config.seq_length, "micro_batch_size": args.micro_batch_size,
            "dtype": str(config.params_dtype).removeprefix("torch."),
        },
        "attention": {"ours": config.attention_backend, "hf": HF_ATTENTION[config.attention_backend]},
        "rounds": args.rounds, "steps_per_round": args.steps, "warmup_steps": args.warmup,
        **result,
    }


def format_table(report: dict) -> str:
    m, d = report["model"], report["device"]
    peak = f"peak {d['peak_tflops']:.1f} TFLOP/s" if d["peak_tflops"] else "no known peak: MFU not reported"
    lines = [
        f"{m['preset']}, {m['num_layers']} layers, seq {m['seq_length']}, micro-batch {m['micro_batch_size']}, "
        f"{m['dtype']} on {d['name']} ({peak})",
        f"{report['rounds']} paired rounds x {report['steps_per_round']} steps, {report['warmup_steps']} warm-up; "
        f"parameters ours {report['parameters']['ours']:,} / HF {report['parameters']['hf']:,}; "
        f"first loss ours {report['first_step_loss']['ours']:.6f} / HF {report['first_step_loss']['hf']:.6f}",
        f"{'model':<12} {'attention':<18} {'step ms':>9} {'[min, max]':>19} {'tokens/s':>10} {'TFLOP/s':>9} {'MFU':>6}",
    ]
    for key in ("ours", "hf"):
        r, t = report[key], report[key]["step_time_s"]
        mfu = f"{100 * r['mfu']:5.1f}%" if r["mfu"] is not None else f"{'-':>6}"
        spread = f"[{1e3 * t['min']:.2f}, {1e3 * t['max']:.2f}]"
        lines.append(f"{r['name']:<12} {report['attention_in_use'][key]:<18} {1e3 * t['median']:9.2f} {spread:>19} "
                     f"{r['tokens_per_s']:10.1f} {r['tflops']:9.3f} {mfu}")
    ratio, targets = report["ratio_tokens_per_s"], report["targets"]
    per_round = ", ".join(f"{x:.3f}" for x in ratio["per_round"])
    lines.append(f"ours / HF tokens/s: median {ratio['median']:.3f}x, spread [{ratio['min']:.3f}, {ratio['max']:.3f}], "
                 f"per round [{per_round}]")
    mfu_met = {None: "n/a", True: "met", False: "not met"}[targets["mfu_met"]]
    ratio_met = {None: "n/a (targets are for the GPU run)", True: "met", False: "not met"}[targets["ratio_met"]]
    lines.append(f"targets: MFU >= {100 * targets['mfu']:.0f}%: {mfu_met}; ours/HF >= {targets['ratio']}x: {ratio_met}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    command = "python benchmarks/bench_mfu.py " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        report = run(args, command)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        write_json(args.json, report)
    print(format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
