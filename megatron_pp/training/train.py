"""The pretraining loop: arguments → parallel state → schedule → model chunks → steps → metrics.

One step: the rank's microbatches of the global batch go through the pipeline executor (which runs the
validated action list of the chosen schedule), then gradients are finalised (sequence-parallel, tied
embedding and data-parallel reductions), the global gradient norm is computed and clipped, the
optimizer steps and the learning rate advances. Rank 0 prints a Megatron-style line and, with
`--metrics-file`, appends one JSON object per iteration.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megatron_pp.core.grads import clip_gradients, finalize_gradients, global_grad_norm, unique_parameters
from megatron_pp.core.p2p import PipelineComm
from megatron_pp.core.parallel_state import ParallelState, init_distributed
from megatron_pp.data.mock import MockData
from megatron_pp.models.config import TransformerConfig
from megatron_pp.models.layout import split_layers
from megatron_pp.schedules.execute import PipelineExecutor, StepResult
from megatron_pp.schedules.ir import Schedule
from megatron_pp.schedules.registry import build_schedule, options_from_args
from megatron_pp.training.arguments import model_config_from_args, num_chunks, parse_args
from megatron_pp.training.model import build_model_chunks
from megatron_pp.training.optimizer import MixedPrecisionOptimizer, learning_rate


@dataclass
class Pipeline:
    """Everything one rank needs to run steps."""

    state: ParallelState
    config: TransformerConfig
    schedule: Schedule
    chunks: list[nn.Module]
    executor: PipelineExecutor


def build_pipeline(
    config: TransformerConfig,
    state: ParallelState,
    schedule: Schedule,
    *,
    micro_batch_size: int,
    seed: int,
    sequence_parallel: bool = False,
    first_stage_layers: Optional[int] = None,
    last_stage_layers: Optional[int] = None,
    account_for_embedding: bool = False,
    account_for_loss: bool = False,
    trace: bool = False,
) -> Pipeline:
    layout = split_layers(
        config.num_layers, state.pp_size, schedule.num_chunks,
        first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers,
        account_for_embedding=account_for_embedding, account_for_loss=account_for_loss,
    )
    chunks = build_model_chunks(config, layout, schedule, state, seed=seed, sequence_parallel=sequence_parallel)
    seq = config.seq_length // state.tp_size if sequence_parallel else config.seq_length
    comm = PipelineComm(state.pp_group, state.pp_ranks) if state.pp_size > 1 else None
    executor = PipelineExecutor(
        schedule, state.pp_rank, chunks, comm=comm,
        activation_shape=(seq, micro_batch_size, config.hidden_size),
        dtype=config.params_dtype, device=state.device, trace=trace,
    )
    return Pipeline(state, config, schedule, chunks, executor)


def global_token_count(microbatches: Sequence[dict], state: ParallelState) -> float:
    """Loss-bearing tokens of the whole global batch (all microbatches, all dp replicas)."""
    count = torch.stack([mb["loss_mask"].sum() for mb in microbatches]).sum().double()
    if state.dp_group is not None and state.dp_size > 1:
        dist.all_reduce(count, group=state.dp_group)
    return float(count)


def train_step(pipe: Pipeline, microbatches: Sequence[dict]) -> tuple[StepResult, float]:
    """Forward and backward of one global batch; gradients are final (reduced) on return.

    Returns the executor's result and the global token count used to normalise the loss.
    """
    for p in unique_parameters(pipe.chunks):
        p.grad = None
    tokens = global_token_count(microbatches, pipe.state)
    result = pipe.executor.run(microbatches, loss_scale=1.0 / tokens)
    finalize_gradients(pipe.chunks, pipe.state)
    return result, tokens


def step_metrics(pipe: Pipeline, result: StepResult, tokens: float) -> tuple[float, list[int]]:
    """(global-batch mean loss, peak stash bytes per pipeline rank), identical on every rank.

    The loss lives on the last pipeline stage; peaks are maxed over each pipeline rank's tp and dp
    replicas. Two small collectives: a dp sum of the loss, then a world max that carries it to rank 0.
    """
    state = pipe.state
    loss = result.loss_sum.double() if result.loss_sum is not None else torch.zeros((), dtype=torch.float64)
    if state.dp_group is not None and state.dp_size > 1:
        dist.all_reduce(loss, group=state.dp_group)
    vec = torch.full((1 + state.pp_size,), -math.inf, dtype=torch.float64)
    if result.loss_sum is not None:
        vec[0] = float(loss) / tokens
    vec[1 + state.pp_rank] = float(result.peak_stash_bytes)
    if dist.is_initialized() and state.world_size > 1:
        dist.all_reduce(vec, op=dist.ReduceOp.MAX)
    return float(vec[0]), [int(v) for v in vec[1:].tolist()]


def write_trace(path: str, events_by_rank: list[list[tuple[str, float, float]]]) -> None:
    """Chrome-trace / Perfetto JSON: one process row per global rank, one slice per action."""
    trace = []
    for rank, events in enumerate(events_by_rank):
        for label, start, end in events:
            trace.append({"name": label, "ph": "X", "pid": rank, "tid": 0, "ts": start * 1e6, "dur": (end - start) * 1e6,
                          "cat": label.split()[0].rstrip("0123456789.@<>")})
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)
    os.replace(tmp, path)


def pretrain(args: argparse.Namespace) -> list[dict]:
    """Run the configured training job; returns rank 0's metric rows (empty on other ranks)."""
    init_distributed(args.distributed_backend)
    state = ParallelState.build(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    config = model_config_from_args(args)
    global_batch = args.global_batch_size or args.micro_batch_size * state.dp_size
    data = MockData(args.seed, config.seq_length, config.vocab_size, args.micro_batch_size, global_batch, state.dp_size)
    options = options_from_args(args, args.pipeline_schedule)
    schedule = build_schedule(args.pipeline_schedule, state.pp_size, data.num_microbatches, num_chunks(args, config), **options)
    pipe = build_pipeline(
        config, state, schedule, micro_batch_size=args.micro_batch_size, seed=args.seed,
        sequence_parallel=args.sequence_parallel,
        first_stage_layers=args.decoder_first_pipeline_num_layers,
        last_stage_layers=args.decoder_last_pipeline_num_layers,
        account_for_embedding=args.account_for_embedding_in_pipeline_split,
        account_for_loss=args.account_for_loss_in_pipeline_split,
        trace=bool(args.trace_file),
    )
    optimizer = MixedPrecisionOptimizer.from_args(unique_parameters(pipe.chunks), args)
    is_logger = state.rank == 0
    metrics_file = open(args.metrics_file, "a") if (args.metrics_file and is_logger) else None
    if is_logger:
        print(
            f"megatron_pp: world {state.world_size} = tp {state.tp_size} x pp {state.pp_size} x dp {state.dp_size}, "
            f"schedule {schedule.name} (m={schedule.num_microbatches}, v={schedule.num_chunks}), "
            f"{config.num_parameters(state.tp_size) / 1e6:.2f}M parameters",
            flush=True,
        )
    rows: list[dict] = []
    traces: list[list[tuple[str, float, float]]] = []
    try:
        for iteration in range(1, args.train_iters + 1):
            start = time.perf_counter()
            microbatches = data.step_microbatches(iteration - 1, state.dp_rank, state.device)
            lr = learning_rate(args, iteration - 1)
            result, tokens = train_step(pipe, microbatches)
            grad_norm = global_grad_norm(pipe.chunks, state)
            clip_gradients(pipe.chunks, args.clip_grad, grad_norm)
            optimizer.step(lr)
            loss, peaks = step_metrics(pipe, result, tokens)
            step_time = time.perf_counter() - start
            if args.trace_file:
                traces.append([(f"{lbl}", s, e) for lbl, s, e in result.events])
            row = {
                "iteration": iteration,
                "loss": loss,
                "grad_norm": grad_norm,
                "lr": lr,
                "step_time_s": step_time,
                "tokens_per_s": tokens / step_time,
                "peak_stash_bytes": peaks,
                "comm_wait_s": result.comm_wait_s,
            }
            if is_logger:
                rows.append(row)
                if metrics_file:
                    metrics_file.write(json.dumps(row) + "\n")
                    metrics_file.flush()
                if iteration % args.log_interval == 0 or iteration == args.train_iters:
                    print(
                        f" iteration {iteration:6d}/{args.train_iters} | loss {loss:.6f} | grad norm {grad_norm:.4f} | "
                        f"lr {lr:.3e} | {step_time * 1e3:.1f} ms | {tokens / step_time:.0f} tokens/s | "
                        f"peak stash MB per pp rank {[round(p / 2**20, 2) for p in peaks]}",
                        flush=True,
                    )
        if args.trace_file:
            _gather_and_write_trace(args.trace_file, traces, state)
    finally:
        if metrics_file:
            metrics_file.close()
    return rows


def _gather_and_write_trace(path: str, traces: list, state: ParallelState) -> None:
    # Steps follow each other on the time axis: offset every step by the previous steps' durations.
    events: list[tuple[str, float, float]] = []
    offset = 0.0
    for step_events in traces:
        events += [(lbl, s + offset, e + offset) for lbl, s, e in step_events]
        offset = events[-1][2] if events else offset
    gathered = [events]
    if dist.is_initialized() and state.world_size > 1:
        gathered = [None] * state.world_size
        dist.all_gather_object(gathered, events)
    if state.rank == 0:
        write_trace(path, gathered)


def main(argv: Optional[Sequence[str]] = None, description: str = "megatron_pp pretraining") -> None:
    args = parse_args(argv, description)
    torch.manual_seed(args.seed)
    pretrain(args)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
