"""One rank's pipeline: the schedule's list, this rank's model chunks and the executor that runs them.

`build_pipeline` is the one place a schedule meets model code: it splits the layers over the stages the
schedule places on this rank, builds those chunks, and gives the executor the stash store its list needs
(host offload, BPipe's peer parking) and, for lists with weight versions, the 2BW hooks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import argparse
from typing import Callable, Optional

from torch import nn

from megatron_pp.core.distributed_optimizer import ShardedMainParams
from megatron_pp.core.p2p import PipelineComm
from megatron_pp.core.parallel_state import ParallelState
from megatron_pp.models.config import TransformerConfig
from megatron_pp.models.layout import StageSpec, split_layers
from megatron_pp.models.recompute import RecomputeConfig
from megatron_pp.schedules.execute import PipelineExecutor
from megatron_pp.schedules.ir import Schedule
from megatron_pp.schedules.peer_store import peer_store_for
from megatron_pp.training.layered import schedule_recompute
from megatron_pp.training.model import build_model_chunks
from megatron_pp.training.weight_versions import WeightVersions, uses_weight_versions


@dataclass
class Pipeline:
    """Everything one rank needs to run steps."""

    state: ParallelState
    config: TransformerConfig
    schedule: Schedule
    layout: list[StageSpec]
    chunks: list[nn.Module]
    executor: PipelineExecutor
    versions: Optional[WeightVersions] = None
    """2BW: the two weight versions the executor switches between (None for single-version schedules)."""
    recompute: Optional[RecomputeConfig] = None
    """What the chunks recompute: the `--recompute-*` flags, else the schedule's own memory mode."""
    schedule_for: Optional[Callable[[int], Schedule]] = None
    """The batch-size ramp-up: the job's validated schedule at another microbatch count (None: one count)."""
    on_new_executor: Optional[Callable[[PipelineExecutor], None]] = None
    """Called with each executor `executor_for` builds (the optimizer connects its hooks)."""
    ramp_executors: dict[int, PipelineExecutor] = field(default_factory=dict)

    def executor_for(self, num_microbatches: int) -> PipelineExecutor:
        """The executor of a step of `num_microbatches`: the main one at the schedule's count, else (the
        batch-size ramp-up) one per count over the same chunks, built on first use and kept. Every rank
        reaches each count at the same iteration, so the collective setup of a stash store (BPipe's pairs)
        happens in step."""
        if num_microbatches == self.schedule.num_microbatches:
            return self.executor
        executor = self.ramp_executors.get(num_microbatches)
        if executor is not None:
            return executor
        if self.schedule_for is None:
            raise ValueError(f"schedule expects {self.schedule.num_microbatches} microbatches, got {num_microbatches}")
        if self.versions is not None:
            # Weight versions carry microbatches in flight from one step into the next: one count throughout
            # (the argument checks refuse a ramp-up with such a list, `job_schedule.check_ramp_sizes`).
            raise ValueError(f"{self.schedule.name}: a list with weight versions runs one microbatch count "
                             f"({self.schedule.num_microbatches}), not {num_microbatches}")
        schedule = self.schedule_for(num_microbatches)
        main = self.executor
        executor = PipelineExecutor(schedule, self.state.pp_rank, self.chunks, comm=main.comm,
                                    activation_shape=main.activation_shape, dtype=main.dtype, device=main.device,
                                    trace=main.trace, store=peer_store_for(schedule, self.state))
        if self.on_new_executor is not None:
            self.on_new_executor(executor)
        self.ramp_executors[num_microbatches] = executor
        return executor

    @property
    def stage_ids(self) -> list[int]:
        """Global stage of each of this rank's chunks."""
        return [self.schedule.stage_of(self.state.pp_rank, c) for c in range(self.schedule.num_chunks)]


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
    recompute: Optional[RecomputeConfig] = None,
    trace: bool = False,
) -> Pipeline:
    layout = split_layers(
        config.num_layers, state.pp_size, schedule.num_chunks,
        first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers,
        account_for_embedding=account_for_embedding, account_for_loss=account_for_loss,
        placement=schedule.placement,
    )
    recompute = schedule_recompute(schedule, recompute)  # None: the schedule's own memory mode
    chunks = build_model_chunks(config, layout, schedule, state, seed=seed, sequence_parallel=sequence_parallel,
                                recompute=recompute)
    seq = config.seq_length // state.tp_size if sequence_parallel else config.seq_length
    pipeline_comm = PipelineComm(state.pp_group, state.pp_ranks) if state.pp_size > 1 else None
    versions = WeightVersions(chunks) if uses_weight_versions(schedule) else None
    executor = PipelineExecutor(
        schedule, state.pp_rank, chunks, comm=pipeline_comm,
        activation_shape=(seq, micro_batch_size, config.hidden_size),
        dtype=config.params_dtype, device=state.device, trace=trace,
        store=peer_store_for(schedule, state),  # BPipe: collective, creates the pairs' process groups
        hooks=versions,
    )
    if versions is not None:
        executor.store.exclude(versions.buffers[1])  # the second weight buffer is no activation either
    return Pipeline(state, config, schedule, layout, chunks, executor, versions, recompute)


def build_job_pipeline(args: argparse.Namespace, config: TransformerConfig, state: ParallelState, schedule: Schedule,
                       *, trace: bool = False) -> Pipeline:
    """The pipeline a job's flags ask for (recomputation, layer split, sequence parallelism): the one function
    `pretrain` and the dry run both call, so the dry run builds what the job builds."""
    recompute = RecomputeConfig(
        args.recompute_granularity, args.recompute_method,
        (args.recompute_num_layers or 1) if args.recompute_granularity == "full" else None,
    ) if args.recompute_granularity else None
    return build_pipeline(
        config, state, schedule, micro_batch_size=args.micro_batch_size, seed=args.seed,
        sequence_parallel=args.sequence_parallel, recompute=schedule_recompute(schedule, recompute),
        first_stage_layers=args.decoder_first_pipeline_num_layers,
        last_stage_layers=args.decoder_last_pipeline_num_layers,
        account_for_embedding=args.account_for_embedding_in_pipeline_split,
        account_for_loss=args.account_for_loss_in_pipeline_split,
        trace=trace,
    )


def connect_param_gather(args: argparse.Namespace, pipe: Pipeline, optimizer: object) -> bool:
    """--overlap-param-gather with the distributed optimizer: leave each update's parameter all-gathers in
    flight, each chunk's finished by its first forward (`ShardedMainParams.overlap_param_gather`; collective:
    it creates the gathers' process group). Returns whether it did; sharded weights (optim_grads_params)
    gather per chunk run already and are left as they are."""
    main = getattr(optimizer, "main", None)
    if not getattr(args, "overlap_param_gather", False) or type(main) is not ShardedMainParams:
        return False
    main.overlap_param_gather(pipe.chunks)
    return True


def finish_param_gather(optimizer: object) -> None:
    """Complete the overlapped parameter gathers still in flight (before a checkpoint, an evaluation, the
    end of training); nothing to do otherwise."""
    main = getattr(optimizer, "main", None)
    if isinstance(main, ShardedMainParams):
        main.finish_param_gather()
