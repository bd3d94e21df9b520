"""Paired step-time benchmark of pipeline schedules against a single-process baseline.

Machines here are shared and noisy (the same CPU step can vary 2x from minute to minute), so a lone
time means nothing. This module alternates, round by round, one baseline step (the whole model, one
process, one thread, plain forward/backward over the same microbatches) and one step of each schedule
(pp processes on a local gloo world, one thread each), and reports each schedule's time as a ratio to
the *same round's* ideal:

    ideal = baseline / p x (1 + bubble),  bubble = (p-1)/m for 1F1B and GPipe, (p-1)/(v m) interleaved

i.e. perfect p-way splitting of the baseline's compute plus the schedule's own fill/drain bubble with
F:B = 1:2. A ratio of 1.00 means the executor, communication and stage imbalance cost nothing.

Each round also runs a *contention control*: every worker runs the whole baseline step at the same
time. On a small VM two busy processes slow each other (shared caches, memory bandwidth, host
scheduling), so `baseline / p` is not reachable even with zero overhead; `control / p x (1 + bubble)`
is the ideal under the same contention, and the ratio to it isolates what the pipeline machinery and
the stage split cost. CPU-seconds per rank and the seconds each rank spent blocked in receives are
reported beside it, together with tokens/s, TFLOP/s per device and MFU (MFU only against a known device
peak, never on CPU), the simulated bubble of the same action lists next to the measured one (1 − the
rank's compute time / step time, compute excluding time blocked in receives), and peak activation
memory per pipeline rank (saved-for-backward bytes; on CUDA also the allocator's peak).
The worker-side functions live here (not in tools/) so spawned workers can import them.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Optional, Sequence

import torch

from megatron_pp.core import comm
from megatron_pp.core.local_world import WorkerPool
from megatron_pp.core.parallel_state import default_device
from megatron_pp.data.mock import MockData
from megatron_pp.models.config import TransformerConfig
from megatron_pp.models.transformer import build_model
from megatron_pp.schedules.registry import build_schedule

_PIPELINES: dict = {}


def bench_config(layers: int, hidden: int, heads: int, seq: int, vocab: int, preset: str) -> TransformerConfig:
    from megatron_pp.models.presets import get_preset

    return dataclasses.replace(
        get_preset(preset), num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        num_query_groups=None, ffn_hidden_size=4 * hidden, seq_length=seq, max_position_embeddings=seq,
        vocab_size=vocab,
    )


def add_bench_arguments(parser, *, vocab_size: int) -> None:
    """The pipeline, rounds and tiny-model flags the paired schedule benchmarks share (`bench_config_from`)."""
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=2, help="virtual stages per rank for interleaved schedules")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--model-preset", default="gpt-tiny")
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=vocab_size)


def bench_config_from(args) -> TransformerConfig:
    """`bench_config` from the flags of `add_bench_arguments`."""
    return bench_config(args.num_layers, args.hidden_size, args.num_attention_heads, args.seq_length,
                        args.vocab_size, args.model_preset)


def ideal_bubble(name: str, p: int, m: int, v: int) -> float:
    return (p - 1) / (m * v) if name.startswith("interleaved") else (p - 1) / m


COMPUTE_PREFIXES = ("F", "B")  # F, B, BI, BW: action labels of compute (communication starts SEND_/RECV_)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _worker_step(ctx, config, name, pp, m, v, micro_batch, seed):
    """One timed training step (forward, backward, gradient finalisation) of schedule `name`."""
    from megatron_pp.training.train import build_pipeline, train_step

    key = (name, pp, m, v)
    if key not in _PIPELINES:
        state = ctx.parallel_state(1, pp)
        schedule = build_schedule(name, pp, m, v)
        # Tracing costs two clock reads per action on CPU; on CUDA it synchronises after every action,
        # which is why CUDA timings come from an untraced step.
        pipe = build_pipeline(config, state, schedule, micro_batch_size=micro_batch, seed=seed,
                              trace=state.device.type != "cuda")
        data = MockData(seed, config.seq_length, config.vocab_size, micro_batch, micro_batch * m * state.dp_size, state.dp_size)
        _PIPELINES[key] = (pipe, data.step_microbatches(0, state.dp_rank, state.device))
    pipe, microbatches = _PIPELINES[key]
    device = pipe.state.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    comm.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    result, _ = train_step(pipe, microbatches)
    _sync(device)
    wall = time.perf_counter() - wall
    compute = sum(end - start for label, start, end in result.events if label.startswith(COMPUTE_PREFIXES))
    return {
        "wall_s": wall, "cpu_s": time.process_time() - cpu, "wait_s": result.comm_wait_s,
        # Receives are waited for inside the compute action that consumes them: take that wait out.
        "busy_s": max(compute - result.comm_wait_s, 0.0) if result.events else None,
        "peak_stash_bytes": result.peak_stash_bytes,
        "peak_cuda_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }


_CONTROL: dict = {}


def _worker_control(ctx, config, micro_batch, m, seed):
    """Contention control: every worker runs the whole single-process baseline step at once."""
    if "model" not in _CONTROL:
        device = default_device()
        data = MockData(seed, config.seq_length, config.vocab_size, micro_batch, micro_batch * m)
        batches = data.step_microbatches(0, 0, device)
        _CONTROL["model"] = (build_model(config, seed=seed, device=device), batches,
                             float(sum(b["loss_mask"].sum() for b in batches)))
    model, batches, tokens = _CONTROL["model"]
    comm.barrier()
    return _baseline_step(model, batches, tokens)


def _baseline_step(model, microbatches, tokens: float) -> float:
    for p in model.parameters():
        p.grad = None
    device = next(model.parameters()).device
    _sync(device)
    start = time.perf_counter()
    for batch in microbatches:
        loss = (model(None, batch).float() * batch["loss_mask"]).sum() / tokens
        loss.backward()
    _sync(device)
    return time.perf_counter() - start


def run_benchmark(
    schedules: Sequence[str],
    *,
    pp: int,
    microbatches: int,
    chunks: int,
    rounds: int,
    micro_batch: int,
    config: TransformerConfig,
    seed: int = 1234,
    pool: Optional[WorkerPool] = None,
) -> dict:
    """Per round: the one-process baseline step, the contention control and one step of each schedule on a
    pool of `pp` processes; then the report of benchmarks/bench_schedules.py (docs/benchmarks.md)."""
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    own_pool = pool is None
    pool = pool or WorkerPool(pp, backend="nccl" if cuda else "gloo")
    v_of = {name: (chunks if name.startswith("interleaved") else 1) for name in schedules}
    try:
        samples, baselines, controls = _measure_rounds(
            schedules, v_of, pool, pp=pp, microbatches=microbatches, rounds=rounds, micro_batch=micro_batch,
            config=config, seed=seed, device=torch.device("cuda", 0) if cuda else torch.device("cpu"))
    finally:
        if own_pool:
            pool.close()
    device_name = samples[schedules[0]][0]["device"] if schedules else "cpu"
    report = {
        "device": device_name,
        "pp": pp, "microbatches": microbatches, "chunks": chunks, "rounds": rounds, "micro_batch_size": micro_batch,
        "model": {"num_layers": config.num_layers, "hidden_size": config.hidden_size, "seq_length": config.seq_length,
                  "vocab_size": config.vocab_size, "num_attention_heads": config.num_attention_heads},
        "baseline_step_s_median": statistics.median(baselines),
        "contention_slowdown_median": statistics.median(c / b for c, b in zip(controls, baselines)),
        "schedules": {},
    }
    for name, rows in samples.items():
        report["schedules"][name] = _schedule_summary(name, rows, baselines, device_name, pp=pp,
                                                      microbatches=microbatches, v=v_of[name],
                                                      micro_batch=micro_batch, config=config)
    return report


def _measure_rounds(schedules, v_of, pool, *, pp, microbatches, rounds, micro_batch, config, seed, device):
    """Warm every path once, untimed; then `rounds` rounds of baseline, control and each schedule. Returns
    the per-schedule samples (one dict per round) and the rounds' baseline and control step times."""
    model = build_model(config, seed=seed, device=device)
    data = MockData(seed, config.seq_length, config.vocab_size, micro_batch, micro_batch * microbatches)
    batches = data.step_microbatches(0, 0, device)
    tokens = float(sum(b["loss_mask"].sum() for b in batches))
    samples: dict[str, list[dict]] = {name: [] for name in schedules}
    baselines: list[float] = []
    controls: list[float] = []
    _baseline_step(model, batches, tokens)
    pool.run(_worker_control, config, micro_batch, microbatches, seed)
    for name in schedules:
        pool.run(_worker_step, config, name, pp, microbatches, v_of[name], micro_batch, seed)
    for _ in range(rounds):
        base = _baseline_step(model, batches, tokens)
        control = max(pool.run(_worker_control, config, micro_batch, microbatches, seed))
        baselines.append(base)
        controls.append(control)
        for name in schedules:
            per_rank = pool.run(_worker_step, config, name, pp, microbatches, v_of[name], micro_batch, seed)
            wall = max(r["wall_s"] for r in per_rank)
            bubble = 1 + ideal_bubble(name, pp, microbatches, v_of[name])
            samples[name].append({"wall_s": wall, "ratio_to_ideal": wall / (base / pp * bubble),
                                  "ratio_to_contended_ideal": wall / (control / pp * bubble),
                                  "cpu_s": [r["cpu_s"] for r in per_rank], "wait_s": [r["wait_s"] for r in per_rank],
                                  "busy_s": [r["busy_s"] for r in per_rank],
                                  "peak_stash_bytes": [r["peak_stash_bytes"] for r in per_rank],
                                  "peak_cuda_bytes": [r["peak_cuda_bytes"] for r in per_rank],
                                  "device": per_rank[0]["device"]})
    return samples, baselines, controls


def _schedule_summary(name, rows, baselines, device_name, *, pp, microbatches, v, micro_batch, config) -> dict:
    """One schedule's entry of the report: medians and spreads over its rounds, throughput, simulated and
    measured bubble, peaks per rank."""
    from megatron_pp.schedules.simulate import simulate
    from megatron_pp.training.flops import iteration_flops, peak_tflops

    flops = iteration_flops(config, micro_batch * microbatches).model
    peak = peak_tflops(torch.device("cuda")) if device_name != "cpu" else None
    tokens = micro_batch * microbatches * config.seq_length
    step = statistics.median(r["wall_s"] for r in rows)
    busy = [statistics.median(r["busy_s"][k] for r in rows) if rows[0]["busy_s"][k] is not None else None
            for k in range(pp)]
    tflops = flops / step / pp / 1e12
    return {
        "step_time_s_median": step,
        "step_time_s_spread": [min(r["wall_s"] for r in rows), max(r["wall_s"] for r in rows)],
        "tokens_per_s": tokens / step,
        "tflops_per_device": tflops,
        "mfu": tflops / peak if peak else None,
        "bubble_simulated": simulate(build_schedule(name, pp, microbatches, v)).bubble_fraction,
        "bubble_measured": (statistics.mean(1 - b / step for b in busy) if None not in busy else None),
        "peak_stash_bytes_per_rank": [max(r["peak_stash_bytes"][k] for r in rows) for k in range(pp)],
        "peak_cuda_bytes_per_rank": ([max(r["peak_cuda_bytes"][k] for r in rows) for k in range(pp)]
                                     if rows[0]["peak_cuda_bytes"][0] is not None else None),
        "v": v,
        "ratio_to_ideal_median": statistics.median(r["ratio_to_ideal"] for r in rows),
        "ratio_to_ideal_min": min(r["ratio_to_ideal"] for r in rows),
        "ratio_to_ideal_max": max(r["ratio_to_ideal"] for r in rows),
        "ratio_to_contended_ideal_median": statistics.median(r["ratio_to_contended_ideal"] for r in rows),
        "speedup_vs_baseline_median": statistics.median(b / r["wall_s"] for b, r in zip(baselines, rows)),
        "cpu_s_per_rank_median": [statistics.median(r["cpu_s"][k] for r in rows) for k in range(pp)],
        "comm_wait_s_per_rank_median": [statistics.median(r["wait_s"][k] for r in rows) for k in range(pp)],
    }


# Single-device MFU against Hugging Face's LlamaForCausalLM (benchmarks/bench_mfu.py) ---------------------------
#
# One device, no pipeline: the whole model (a few layers of a LLaMA shape) as one stage, trained step by
# step on one fixed batch. "Ours" is the framework's real training step: `StageModel` forward and
# backward, then `TrainingOptimizer` (fp32 gradient buckets, global norm and clipping, AdamW on fp32 main
# weights copied back into the bf16 model). "HF" is `transformers`' LlamaForCausalLM with the same
# numbers and *our* initial weights copied in through `megatron_pp.models.hf`, its built-in loss, gradient
# clipping and torch's AdamW (fused on CUDA) with the same hyperparameters and weight-decay groups, on its
# own parameters (bf16 parameters and optimizer state in a bf16 run: less memory traffic than ours, so
# the comparison does not flatter us). Both see identical tokens, labels and initial weights, so their
# first losses agree (exactly up to kernel rounding in fp32).

MFU_FORMAT = "megatron_pp.bench_mfu/1"
HF_ATTENTION = {"flash": "flash_attention_2", "sdpa": "sdpa", "reference": "eager"}
"""Our resolved attention backend -> the Hugging Face `attn_implementation` running the same kernel."""
MFU_TARGET = 0.5
"""issue 10: ours at >= 50% of the device's dense bf16 peak ..."""
HF_RATIO_TARGET = 1.2
"""... and >= 1.2x Hugging Face's tokens/s on the same shapes."""


def build_hf_llama(config: TransformerConfig, attn_implementation: str, device: torch.device) -> torch.nn.Module:
    """`LlamaForCausalLM` computing what `config` computes (see `models.hf.hf_config_from`), in
    `config.params_dtype` on `device`, in training mode, without a KV cache. Weights are HF's own init."""
    from transformers import LlamaForCausalLM

    from megatron_pp.models.hf import hf_config_from

    hf_config = hf_config_from(config, attn_implementation=attn_implementation)
    hf_config.use_cache = False  # a training step has no use for the KV cache
    with torch.device(device):
        model = LlamaForCausalLM(hf_config)
    running = hf_attention_in_use(model)
    if running != attn_implementation:
        raise ValueError(f"Hugging Face baseline: asked for attention {attn_implementation!r}, the model runs "
                         f"{running!r}")
    return model.to(dtype=config.params_dtype).train()


def hf_attention_in_use(model: torch.nn.Module) -> Optional[str]:
    """The attention implementation a transformers model dispatches to at run time (what its attention
    modules look up on every call), not the one its config was asked for."""
    return getattr(model.config, "_attn_implementation", None)


@torch.no_grad()
def copy_weights_to_hf(ours: torch.nn.Module, hf: torch.nn.Module, config: TransformerConfig) -> None:
    """Set every parameter of `hf` from `ours` (a single-stage model of `config`) via `tensor_maps`.

    Raises ValueError unless the two models' parameters correspond one to one with equal shapes (vocabulary
    padding dropped), which is what makes their parameter counts comparable.
    """
    from megatron_pp.models.hf import VOCAB_PARAMETERS, resize_vocab_rows, tensor_maps

    params = dict(ours.named_parameters())
    hf_params = dict(hf.named_parameters())
    mapped = set()
    for tensor_map in tensor_maps(config):
        tensor = params[tensor_map.name].detach()
        if tensor_map.name in VOCAB_PARAMETERS:
            tensor = resize_vocab_rows(tensor, config.vocab_size)
        for name, value in zip(tensor_map.hf_names, tensor_map.to_hf(tensor, config)):
            if name not in hf_params or hf_params[name].shape != value.shape:
                got = tuple(hf_params[name].shape) if name in hf_params else "missing"
                raise ValueError(f"Hugging Face parameter {name}: {got}, ours gives {tuple(value.shape)}")
            hf_params[name].copy_(value)
            mapped.add(name)
    unmapped = sorted(set(hf_params) - mapped)
    if unmapped:
        raise ValueError(f"Hugging Face parameters with no counterpart in ours: {', '.join(unmapped[:5])}")


def parameter_counts(ours: torch.nn.Module, hf: torch.nn.Module, config: TransformerConfig) -> dict:
    """Parameters of both models; ours pads the vocabulary rows (embedding and untied output layer) to
    `padded_vocab_size()`, which HF does not, so `ours - ours_vocab_padding` must equal `hf`."""
    padding_rows = config.padded_vocab_size() - config.vocab_size
    padding = padding_rows * config.hidden_size * (2 if config.untie_embeddings_and_output_weights else 1)
    ours_n = sum(p.numel() for p in ours.parameters())
    hf_n = sum(p.numel() for p in hf.parameters())
    return {"ours": ours_n, "hf": hf_n, "ours_vocab_padding": padding, "config_formula": config.num_parameters(),
            "match": ours_n - padding == hf_n}


def mfu_batch(config: TransformerConfig, micro_batch: int, seed: int, device: torch.device) -> dict:
    """One fixed batch of random tokens: `labels` are `tokens` shifted by one, as the data loader makes them."""
    generator = torch.Generator().manual_seed(seed)
    sequence = torch.randint(0, config.vocab_size, (micro_batch, config.seq_length + 1), generator=generator)
    return {"tokens": sequence[:, :-1].contiguous().to(device), "labels": sequence[:, 1:].contiguous().to(device)}


class OursTrainingStep:
    """The framework's single-stage training step (one microbatch): forward, backward, optimizer step."""

    name = "megatron_pp"

    def __init__(self, model: torch.nn.Module, lr: float) -> None:
        from megatron_pp.core.parallel_state import ParallelState
        from megatron_pp.training.optimizer import OptimizerConfig, build_optimizer

        self.model, self.lr = model, lr
        device = next(model.parameters()).device
        dtype = model.config.params_dtype
        config = OptimizerConfig(lr=lr, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
        self.optimizer = build_optimizer([model], ParallelState.build(device=device), config)
        self.implementation = self.optimizer.implementation

    def __call__(self, batch: dict) -> torch.Tensor:
        self.optimizer.reducer.start_step(1)
        loss = self.model(None, batch).mean()  # per-token fp32 losses [b, s]; every token counts
        loss.backward()
        self.optimizer.reducer.finish()
        self.optimizer.step(self.lr)
        return loss.detach()


class HFTrainingStep:
    """Hugging Face's training step: its loss, clipping and torch AdamW with our optimizer's settings."""

    name = "hf_llama"

    def __init__(self, model: torch.nn.Module, lr: float) -> None:
        from megatron_pp.training.optimizer import OptimizerConfig

        defaults = OptimizerConfig()
        self.model, self.clip = model, defaults.clip_grad
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() > 1]},
                  {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}]
        fused = params[0].device.type == "cuda"
        self.optimizer = torch.optim.AdamW(
            groups, lr=lr, betas=(defaults.adam_beta1, defaults.adam_beta2), eps=defaults.adam_eps,
            weight_decay=defaults.weight_decay, fused=fused, foreach=None if fused else True)
        self.implementation = "torch.optim.AdamW (fused)" if fused else "torch.optim.AdamW (foreach)"

    def __call__(self, batch: dict) -> torch.Tensor:
        # `shift_labels` hands HF's loss our already shifted labels, so both average the same s tokens.
        out = self.model(input_ids=batch["tokens"], labels=batch["labels"], shift_labels=batch["labels"])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return out.loss.detach()


def time_steps(step, batch: dict, steps: int, device: torch.device) -> float:
    """Seconds per step over `steps` back-to-back steps (CUDA events on a GPU, so the host may run ahead)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step(batch)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / steps
    begin = time.perf_counter()
    for _ in range(steps):
        step(batch)
    return (time.perf_counter() - begin) / steps


def _spread(values: Sequence[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "per_round": list(values)}


def run_mfu_benchmark(
    config: TransformerConfig,
    *,
    micro_batch: int,
    rounds: int,
    steps: int,
    warmup: int,
    device: torch.device,
    peak_tflops: Optional[float],
    seed: int = 1234,
    lr: float = 1e-4,
) -> dict:
    """Paired rounds of `steps` training steps of ours and of HF's model (order alternating each round:
    ours first in even rounds), after `warmup` untimed steps each. Returns the measurements; the caller
    adds the device and versions. `config.attention_backend` must be resolved (flash, sdpa or reference).
    """
    from megatron_pp.training.flops import iteration_flops

    if rounds < 1 or steps < 1 or warmup < 1:
        raise ValueError(f"--rounds {rounds} and --steps {steps} must be >= 1, --warmup {warmup} >= 1 "
                         "(the first warm-up step gives the initial losses)")
    torch.manual_seed(seed)
    ours = build_model(config, seed=seed, device=device).train()
    hf = build_hf_llama(config, HF_ATTENTION[config.attention_backend], device)
    copy_weights_to_hf(ours, hf, config)
    counts = parameter_counts(ours, hf, config)
    runners = {"ours": OursTrainingStep(ours, lr), "hf": HFTrainingStep(hf, lr)}
    batch = mfu_batch(config, micro_batch, seed, device)

    warmup_losses = {key: [float(step(batch)) for _ in range(warmup)] for key, step in runners.items()}
    times: dict[str, list[float]] = {"ours": [], "hf": []}
    peak_bytes: dict[str, list[int]] = {"ours": [], "hf": []}
    for r in range(rounds):
        for key in (("ours", "hf") if r % 2 == 0 else ("hf", "ours")):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times[key].append(time_steps(runners[key], batch, steps, device))
            if device.type == "cuda":
                peak_bytes[key].append(torch.cuda.max_memory_allocated(device))

    flops = iteration_flops(config, micro_batch).model
    tokens = micro_batch * config.seq_length
    models = {}
    for key, runner in runners.items():
        step_s = statistics.median(times[key])
        tflops = flops / step_s / 1e12
        models[key] = {
            "name": runner.name,
            "optimizer": runner.implementation,
            "step_time_s": _spread(times[key]),
            "tokens_per_s": tokens / step_s,
            "tflops": tflops,
            "mfu": tflops / peak_tflops if peak_tflops else None,
            "warmup_losses": warmup_losses[key],
            # Both models stay resident (weights, gradients and optimizer state of the other included).
            "peak_memory_allocated_bytes": max(peak_bytes[key]) if peak_bytes[key] else None,
        }
    # Throughput ratio, ours / HF, within each round: both halves of a pair saw the same machine state.
    ratios = [h / o for o, h in zip(times["ours"], times["hf"])]
    first = {"ours": warmup_losses["ours"][0], "hf": warmup_losses["hf"][0]}
    ratio = _spread(ratios)
    return {
        "parameters": counts,
        "attention_in_use": {"ours": config.attention_backend, "hf": hf_attention_in_use(hf)},
        "model_flops_per_step": flops,
        "tokens_per_step": tokens,
        "first_step_loss": {**first, "abs_diff": abs(first["ours"] - first["hf"])},
        "ours": models["ours"],
        "hf": models["hf"],
        "ratio_tokens_per_s": ratio,
        "targets": {
            "mfu": MFU_TARGET,
            "mfu_met": None if models["ours"]["mfu"] is None else models["ours"]["mfu"] >= MFU_TARGET,
            "ratio": HF_RATIO_TARGET,
            # The targets are for the bf16 GPU run; a CPU run reports the numbers without judging them.
            "ratio_met": ratio["median"] >= HF_RATIO_TARGET if device.type == "cuda" else None,
        },
    }
