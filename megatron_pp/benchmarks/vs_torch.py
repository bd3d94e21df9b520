"""Side by side with torch.distributed.pipelining: the same chunks, data and microbatches under both runtimes.

Each worker builds this project's pipeline for one of our schedules (`build_pipeline`: the layer split,
the chunks of its rank, the executor) and wraps *the same chunk modules* as torch `PipelineStage`s, one per
local chunk, at the global stage our schedule gives it, so both sides run identical weights split the same
way; torch's schedule of the pair then runs them. Pairs (ours -> torch): `1f1b` -> Schedule1F1B,
`interleaved-1f1b` -> ScheduleInterleaved1F1B (loop placement on both), `zb-h1` and `zb-h2` ->
ScheduleInterleavedZeroBubble with one stage per rank (torch's ZB1P, i.e. ZB-H1), `zb-v` ->
ScheduleZBVZeroBubble (V placement, stages r and 2p-1-r on rank r, on both).

What each side does in a timed step is only the pipeline's forward and backward of all microbatches:
gradients are set to None (untimed) before it, and neither side reduces or steps anything after it
(torch's `scale_grads=False`; our loss is already scaled by 1/tokens, and torch's last stage reduces its
per-token loss with the same scale). The loss is the sum over microbatches of `sum(per-token loss *
loss_mask) / tokens` on both sides; `worker_check` compares it and every gradient between the two
runtimes before timing.

Peak activation bytes are measured the same way for both, in an untimed step of each side: an
`ActivationStore` (saved-tensor hooks, deduplicated by storage, parameters excluded) per rank. Our executor
runs every chunk forward inside it and releases a stash after its backward (or its BW); torch's stages are
wrapped (`_CountedStage`) so each `forward_one_chunk` runs inside the same kind of store, released after
`backward_one_chunk`, or, for a split backward, after `backward_weight_one_chunk`, with what torch keeps
between I and W (the intermediate gradients of its parameter groups and the received output gradient)
held in the count as our BI's output gradients are. Timed torch steps run without that store (our
executor's store is part of our runtime and stays in ours).

The worker-side functions live in the package (not in tools/) so spawned workers can import them.
"""
from __future__ import annotations

import time
from typing import Optional

import torch
from torch import nn

from megatron_pp.core import comm
from megatron_pp.data.mock import MockData
from megatron_pp.models.config import TransformerConfig
from megatron_pp.schedules.registry import build_schedule
from megatron_pp.schedules.store import ActivationStore

TORCH_PAIRS = {
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",
    "zb-h2": "ScheduleInterleavedZeroBubble",
    "zb-v": "ScheduleZBVZeroBubble",
}
"""Our schedule -> the torch.distributed.pipelining schedule class it is compared with."""


def chunks_per_rank(name: str, chunks: int) -> int:
    """Local chunks each side runs: `chunks` for the interleaved pair, two for the V, else one."""
    return {"interleaved-1f1b": chunks, "zb-v": 2}.get(name, 1)


class _StageAdapter(nn.Module):
    """Our chunk behind torch's calling convention: activations positional, the batch as keyword tensors.

    The first stage is handed the tokens positionally (torch's first stage needs a real input tensor) and
    reads them from the batch like every other stage. The last stage reduces its per-token loss to the
    scaled masked sum itself, as our executor does inside the chunk's stash, so both sides count the
    tensors that reduction saves (torch would otherwise run it outside the stage, uncounted)."""

    def __init__(self, chunk: nn.Module, first: bool, loss_scale: Optional[float]) -> None:
        super().__init__()
        self.chunk = chunk
        self.first = first
        self.loss_scale = loss_scale  # None except on the last stage

    def forward(self, x: torch.Tensor, loss_mask: torch.Tensor, **batch: torch.Tensor) -> torch.Tensor:
        y = self.chunk(None if self.first else x, batch)
        if self.loss_scale is None:
            return y
        return (y.float() * loss_mask).sum() * self.loss_scale


def _tensors(tree) -> list[torch.Tensor]:
    """The tensors in nested lists and tuples (torch keeps a tuple of gradients per intermediate)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _tensors(item)]
    return []


def _counted_stage_class():
    from torch.distributed.pipelining import PipelineStage

    class _CountedStage(PipelineStage):
        """A PipelineStage whose saved activations are counted by `store` (while it is set), as our executor
        counts ours. Timed steps run with `store` None: torch pays no counting hooks there."""

        def __init__(self, *args, store: Optional[ActivationStore], **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.store = store

        def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
            if self.store is None:
                return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
            with self.store.stash((fwd_chunk_id, self.stage_index)):
                return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)

        def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
            super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                       last_backward=last_backward)
            if self.store is None:
                return
            key = (bwd_chunk_id, self.stage_index)
            if full_backward:
                self.store.release(key)
                return
            # What torch keeps for W: the gradients of the intermediates its parameter groups start from,
            # and the output gradient it received.
            _, param_groups, _, output_grads = self.backward_state[bwd_chunk_id]
            grads = [group.get("grads") or () for group in param_groups or ()]
            self.store.hold(key, _tensors([grads, output_grads]))

        def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
            if self.store is not None:
                self.store.release((bwd_chunk_id, self.stage_index))

    return _CountedStage


class _Sides:
    """One worker's two runtimes for one pair: our pipeline and torch's schedule over the same chunks."""

    def __init__(self, ctx, config: TransformerConfig, name: str, pp: int, m: int, v: int, micro_batch: int,
                 seed: int) -> None:
        from torch.distributed.pipelining import schedules as torch_schedules

        from megatron_pp.training.pipeline import build_pipeline

        state = ctx.parallel_state(1, pp)
        self.state = state
        self.pipe = build_pipeline(config, state, build_schedule(name, pp, m, v), micro_batch_size=micro_batch,
                                   seed=seed)
        data = MockData(seed, config.seq_length, config.vocab_size, micro_batch, micro_batch * m)
        self.microbatches = data.step_microbatches(0, 0, state.device)
        tokens = float(sum(b["loss_mask"].sum() for b in self.microbatches))
        self.loss_scale = 1.0 / tokens
        self.params = [p for chunk in self.pipe.chunks for p in chunk.parameters()]

        schedule = self.pipe.schedule
        stage_ids = self.pipe.stage_ids
        n = schedule.num_stages
        seq, hidden = config.seq_length, config.hidden_size
        # Example tensors make torch's stages static (no shape inference); requires_grad marks what carries
        # gradients between stages, as the real activations do.
        act = torch.empty(seq, micro_batch, hidden, dtype=config.params_dtype, device=state.device,
                          requires_grad=True)
        self.torch_store = ActivationStore()
        stage_class = _counted_stage_class()
        self.stages = []
        for chunk, s in zip(self.pipe.chunks, stage_ids):
            self.torch_store.exclude(chunk.parameters())
            self.torch_store.exclude(chunk.buffers())
            example_in = (torch.empty(micro_batch, seq, dtype=torch.long, device=state.device) if s == 0 else act)
            example_out = torch.zeros((), device=state.device, requires_grad=True) if s == n - 1 else act
            adapter = _StageAdapter(chunk, first=s == 0, loss_scale=self.loss_scale if s == n - 1 else None)
            self.stages.append(stage_class(adapter, s, n, state.device, input_args=example_in,
                                           output_args=example_out, group=state.pp_group, store=self.torch_store))

        def loss_fn(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return loss  # the last stage's adapter has reduced it already

        cls = getattr(torch_schedules, TORCH_PAIRS[name])
        stages = self.stages[0] if issubclass(cls, torch_schedules.PipelineScheduleSingle) else self.stages
        self.torch_schedule = cls(stages, m, loss_fn=loss_fn, scale_grads=False)
        self.has_first = 0 in stage_ids
        self.has_last = n - 1 in stage_ids
        cat = {k: torch.cat([b[k] for b in self.microbatches])
               for k in ("tokens", "labels", "position_ids", "loss_mask")}
        self.torch_args = (cat["tokens"],) if self.has_first else ()
        self.torch_kwargs = cat
        # torch hands its loss function a target per microbatch; ours ignores it (the adapter used the mask).
        self.torch_target = cat["loss_mask"] if self.has_last else None

    def run(self, side: str, count: bool = False) -> dict:
        """One step of `side` ('ours' or 'torch'): wall and CPU seconds, loss and, where counted, peak
        activation bytes. Ours always counts (its executor's store is part of our runtime); torch's stages
        count only with `count`, so its timed steps carry no hooks of ours."""
        for p in self.params:
            p.grad = None
        comm.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        if side == "ours":
            result = self.pipe.executor.run(self.microbatches, self.loss_scale)
            loss = float(result.loss_sum) * self.loss_scale if result.loss_sum is not None else None
            peak = result.peak_stash_bytes
        else:
            for stage in self.stages:
                stage.store = self.torch_store if count else None
            self.torch_store.reset_peak()
            losses: list = []
            self.torch_schedule.step(*self.torch_args, target=self.torch_target, losses=losses,
                                     return_outputs=False, **self.torch_kwargs)
            loss = float(sum(float(x.detach()) for x in losses)) if self.has_last else None
            peak = self.torch_store.peak_bytes if count else None
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if side == "torch" and self.torch_store.live:
            raise RuntimeError(f"torch side left stashes {sorted(self.torch_store.live)} after its step")
        return {"wall_s": wall, "cpu_s": cpu, "peak_activation_bytes": peak, "loss": loss}

    def grads(self) -> list[Optional[torch.Tensor]]:
        return [None if p.grad is None else p.grad.detach().clone() for p in self.params]


_SIDES: dict = {}


def _sides(ctx, config, name, pp, m, v, micro_batch, seed) -> _Sides:
    key = (name, pp, m, v, micro_batch, seed)
    if key not in _SIDES:
        _SIDES[key] = _Sides(ctx, config, name, pp, m, v, micro_batch, seed)
    return _SIDES[key]


def worker_check(ctx, config, name, pp, m, v, micro_batch, seed) -> dict:
    """Untimed: one step of each side from zero gradients, both counting activations: the loss (on the last
    stage's rank), the peak activation bytes of each side, and the worst relative gradient difference
    over this rank's parameters, torch's gradients as the reference."""
    sides = _sides(ctx, config, name, pp, m, v, micro_batch, seed)
    ours = sides.run("ours")
    ours_grads = sides.grads()
    theirs = sides.run("torch", count=True)
    worst = 0.0
    for mine, ref in zip(ours_grads, sides.grads()):
        if (mine is None) != (ref is None):
            worst = float("inf")
        elif mine is not None:
            worst = max(worst, float((mine - ref).norm() / ref.norm().clamp_min(1e-30)))
    return {"ours_loss": ours["loss"], "torch_loss": theirs["loss"], "grad_rel_diff": worst,
            "ours_peak_activation_bytes": ours["peak_activation_bytes"],
            "torch_peak_activation_bytes": theirs["peak_activation_bytes"]}


def worker_step(ctx, config, name, pp, m, v, micro_batch, seed, side) -> dict:
    """One timed step of `side` of pair `name` (built on first use)."""
    return _sides(ctx, config, name, pp, m, v, micro_batch, seed).run(side)


def worker_profile(ctx, config, name, pp, m, v, micro_batch, seed, side, steps, top=15) -> list[dict]:
    """cProfile of `steps` steps of `side` on this rank: the `top` functions by own time, per step.

    Timed by the main thread's CPU clock, so that on a shared machine the profile shows the work this rank
    does, not the time other processes held the cores (waits in receives then cost almost nothing)."""
    import cProfile
    import pstats

    sides = _sides(ctx, config, name, pp, m, v, micro_batch, seed)
    profiler = cProfile.Profile(time.thread_time)
    profiler.enable()
    for _ in range(steps):
        sides.run(side)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, function) -> (calls, primitive calls, own, cumulative, callers)
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    return [{"function": f"{_short(path)}:{line}({func})", "calls_per_step": calls / steps,
             "own_s_per_step": own / steps, "cumulative_s_per_step": cum / steps}
            for (path, line, func), (_, calls, own, cum, _) in rows]


def _short(path: str) -> str:
    """A source path from its package down (no machine-specific prefix in reports)."""
    if "site-packages/" in path:
        return path[path.rindex("site-packages/") + len("site-packages/"):]
    if "megatron_pp/" in path:
        return path[path.rindex("megatron_pp/"):]
    return path.rsplit("/", 1)[-1]
