"""What layered gradient accumulation and sharded weights add to a training step (docs/layered.md).

The schedule says *when*; the optimizer's objects do the work; this module connects the two through the
executor's extension points (schedules never import training):

- `REDUCE_GRAD.c` -> `LayeredGradientReducer.reduce_chunk(c)` (`PipelineExecutor.reduce_grad_hook`);
- sharded weights (ZeRO-3): `WeightResidency` reads the rank's action list once and wraps the compute
  handlers so that each chunk's weights are all-gathered when its run of consecutive compute actions
  starts (the next run's gather is prefetched then) and freed when the run ends;
- `schedule_recompute`: the memory mode a schedule asks for when no `--recompute-*` flag is given
  (looped-bfs: keep only each layer's input, `checkpoint_layer_inputs`).

Residency, p=4, m=8, v=2 looped-bfs, any rank: the compute actions form the runs
`F*.0 | F*.1 B*.1 | B*.0`, so chunk 0 is gathered for its forwards, chunk 1 (prefetched meanwhile) for
its forwards and backwards, chunk 0 again for its backwards: 3 gathers of a chunk per step, whatever m.
Interleaved 1F1B switches chunks after nearly every action and gathers about 2·m·v times.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, ContextManager, Optional

from megatron_pp.core.layered_grads import LayeredGradientReducer
from megatron_pp.core.sharded_weights import ShardedWeights
from megatron_pp.models.recompute import RecomputeConfig
from megatron_pp.schedules.execute import PipelineExecutor
from megatron_pp.schedules.ir import COMPUTE_OPS, TRANSFER_OPS, Action, Op, Schedule
from megatron_pp.schedules.store import ActivationStore
from megatron_pp.training.optimizer import TrainingOptimizer

LAYER_INPUTS = RecomputeConfig("full", "uniform", 1)
"""Keep each transformer layer's input only; the backward reruns the layer."""


def schedule_recompute(schedule: Schedule, recompute: Optional[RecomputeConfig]) -> RecomputeConfig:
    """`recompute` if given (the `--recompute-*` flags), else the schedule's own memory mode."""
    if recompute is not None:
        return recompute
    return LAYER_INPUTS if schedule.options.get("checkpoint_layer_inputs") else RecomputeConfig()


class WeightResidency:
    """When each chunk's sharded weights are resident on one rank, from its action list.

    A *run* is a maximal sequence of consecutive compute actions (F, B, BI, BW) on one chunk, whatever
    communication lies between them. At a run's first action its chunk's gathers are completed (started
    at the previous run's start, or now for the step's first run) and the next run's gathers start; at
    its last action the chunk is released. At most two chunks' weights are resident at a time.
    """

    def __init__(self, actions: list[Action], weights: ShardedWeights) -> None:
        self.weights = weights
        compute = [a for a in actions if a.op in COMPUTE_OPS]
        self.runs: list[int] = []  # chunk of each run, in order
        self._starts: dict[Action, int] = {}  # first action of a run -> the run's index
        self._ends: dict[Action, int] = {}
        for i, a in enumerate(compute):
            if i == 0 or compute[i - 1].chunk != a.chunk:
                self._starts[a] = len(self.runs)
                self.runs.append(a.chunk)
            if i + 1 == len(compute) or compute[i + 1].chunk != a.chunk:
                self._ends[a] = len(self.runs) - 1

    def before(self, action: Action) -> None:
        run = self._starts.get(action)
        if run is None:
            return
        if run == 0:
            self.weights.acquire(self.runs[0])
        self.weights.wait(self.runs[run])
        if run + 1 < len(self.runs):
            self.weights.acquire(self.runs[run + 1])

    def after(self, action: Action) -> None:
        run = self._ends.get(action)
        if run is not None:
            self.weights.release(self.runs[run])

    def wrap(self, executor: PipelineExecutor) -> None:
        """Route the executor's compute handlers through `before` and `after`."""
        for op in COMPUTE_OPS:
            executor.handlers[op] = self._wrapped(executor.handlers[op])

    def _wrapped(self, handler: Callable[[Action], None]) -> Callable[[Action], None]:
        def run(action: Action) -> None:
            self.before(action)
            handler(action)
            self.after(action)
        return run


def connect_optimizer(executor: PipelineExecutor, optimizer: TrainingOptimizer) -> None:
    """Hand the executor the optimizer's per-chunk reduction and weight residency (once, after both exist)."""
    schedule = executor.schedule
    layered_list = any(a.op is Op.REDUCE_GRAD for a in executor.actions)
    layered_reducer = isinstance(optimizer.reducer, LayeredGradientReducer)
    if layered_list != layered_reducer:
        raise ValueError(
            f"--pipeline-schedule {schedule.name}: the schedule {'has' if layered_list else 'has no'} REDUCE_GRAD "
            f"actions but the optimizer was built {'without' if layered_list else 'with'} "
            "layered_grad_accumulation; pass the same --layered-grad-accumulation to both")
    if layered_reducer:
        executor.reduce_grad_hook = optimizer.reducer.reduce_chunk
    weights = optimizer.sharded_weights
    if weights is None:
        return
    if any(a.op in TRANSFER_OPS for a in executor.actions) or type(executor.store) is not ActivationStore:
        raise ValueError(f"--pipeline-schedule {schedule.name} parks stashes off the device, which sharded weights "
                         "(--data-parallel-sharding-strategy optim_grads_params) do not support")
    # The store tells parameters from activations by storage address, and every gather gives the weights
    # a new one: a fresh store (the old one still excludes the addresses the weights had before sharding)
    # excludes them while they are gathered.
    store = ActivationStore(exclude=[b for chunk in executor.chunks for b in chunk.buffers()])
    executor.store = store
    weights.on_gathered = store.exclude
    weights.on_freeing = store.include
    WeightResidency(executor.actions, weights).wrap(executor)


def all_weights(optimizer: Optional[TrainingOptimizer], write_back: bool = False) -> ContextManager[None]:
    """Every chunk's full weights inside the block (evaluation, checkpoints); a no-op without sharding.
    `write_back=True` makes what the block wrote into the parameters the new shards (loading)."""
    weights = optimizer.sharded_weights if optimizer is not None else None
    return weights.gathered(write_back) if weights is not None else nullcontext()
