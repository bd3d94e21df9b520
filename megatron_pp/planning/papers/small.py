"""Small-scale measurements for the paper reproductions: a tiny GPT on a local gloo world with the real
executor (or the real training loop, for 2BW), its measured peak stash bytes and bubble next to the
simulator's prediction for the same setting."""
from __future__ import annotations

import contextlib
import dataclasses
import io
from typing import Optional, Sequence

from megatron_pp.models.config import TransformerConfig
from megatron_pp.models.layout import split_layers
from megatron_pp.planning.cost import resident_peaks
from megatron_pp.planning.memory import CPU_FP32, attention_kind, stash_bytes
from megatron_pp.planning.papers.common import PaperReport, Trend, relative_error
from megatron_pp.schedules.registry import build_schedule
from megatron_pp.schedules.simulate import CostModel, simulate


def tiny_config(layers: int = 8, hidden: int = 64, heads: int = 4, seq: int = 32, vocab: int = 256,
                **overrides: object) -> TransformerConfig:
    from megatron_pp.models.presets import get_preset

    return dataclasses.replace(get_preset("gpt-tiny"), num_layers=layers, hidden_size=hidden,
                               num_attention_heads=heads, seq_length=seq, max_position_embeddings=seq,
                               vocab_size=vocab, **overrides)


def measure_worker(ctx, config: TransformerConfig, name: str, pp: int, m: int, v: int, options: dict,
                   micro_batch: int, steps: int = 1) -> dict:
    """One rank: build `name` on pp ranks (dp = world / pp), run `steps` training steps, return the peak
    of resident stash bytes and the traced busy and wall seconds of the last step."""
    import time

    from megatron_pp.core import comm
    from megatron_pp.data.mock import MockData
    from megatron_pp.training.train import build_pipeline, train_step

    state = ctx.parallel_state(1, pp)
    schedule = build_schedule(name, pp, m, v, **options) if v > 1 else build_schedule(name, pp, m, **options)
    pipe = build_pipeline(config, state, schedule, micro_batch_size=micro_batch, seed=1234, trace=True)
    data = MockData(1234, config.seq_length, config.vocab_size, micro_batch, micro_batch * m * state.dp_size,
                    state.dp_size)
    micro = data.step_microbatches(0, state.dp_rank, state.device)
    result = None
    wall = 0.0
    for _ in range(steps):
        comm.barrier()
        start = time.perf_counter()
        result, _ = train_step(pipe, micro)
        wall = time.perf_counter() - start
    # Compute actions print as F/B/BI/BW; communication as SEND_/RECV_ (benchmark.COMPUTE_PREFIXES).
    compute = sum(end - begin for label, begin, end in result.events if label.startswith(("F", "B")))
    return {"peak_stash_bytes": result.peak_stash_bytes, "busy_s": max(compute - result.comm_wait_s, 0.0),
            "wall_s": wall}


def predicted_stash_peaks(config: TransformerConfig, name: str, pp: int, m: int, v: int, options: dict,
                          micro_batch: int, recompute: str = "none") -> list[float]:
    """Per rank, the simulator's peak resident stash bytes for the CPU fp32 executor: the stash curve of
    the schedule weighed with `stash_bytes` per global stage (transfers instant, as they are synchronous on
    CPU; the attention formula follows the config's backend on CPU), BPipe's acceptors at their hosting bound."""
    schedule = build_schedule(name, pp, m, v, **options) if v > 1 else build_schedule(name, pp, m, **options)
    specs = split_layers(config.num_layers, pp, v)
    attention = attention_kind(config.attention_backend, "cpu", config.attention_dropout)
    stash = [stash_bytes(config, s, micro_batch, attention=attention, recompute=recompute, numerics=CPU_FP32)
             for s in specs]
    # A BPipe acceptor frees a guest at its partner's pace: charged its list's hosting bound, as the planner does.
    return resident_peaks(schedule, simulate(schedule, CostModel(stash_bytes=stash, transfer=0.0)), stash)


def simulated_bubble(name: str, pp: int, m: int, v: int, options: Optional[dict] = None) -> float:
    schedule = build_schedule(name, pp, m, v, **(options or {})) if v > 1 else build_schedule(name, pp, m,
                                                                                              **(options or {}))
    return simulate(schedule).bubble_fraction


def train_worker(ctx, argv: list[str], pp: int) -> Optional[list[dict]]:
    """One rank of a short training run through the real loop (`training.train.pretrain`, which picks
    the 2BW trainer for `--pipeline-schedule 2bw`); rank 0 returns its metric rows."""
    from megatron_pp.training.arguments import parse_args
    from megatron_pp.training.train import pretrain

    with contextlib.redirect_stdout(io.StringIO()):  # the loop's log lines; the rows carry the numbers
        rows = pretrain(parse_args(argv), state=ctx.parallel_state(1, pp))
    return rows if ctx.rank == 0 else None


class SmallScale:
    """Local gloo worlds for the small-scale measurements, started lazily, one per world size."""

    def __init__(self) -> None:
        self._pools: dict = {}

    def _pool(self, world: int):
        from megatron_pp.core.local_world import WorkerPool

        if world not in self._pools:
            self._pools[world] = WorkerPool(world)
        return self._pools[world]

    def run(self, *args: object, world: int = 4) -> list[dict]:
        """`measure_worker(*args)` on every rank of a `world`-process world."""
        return self._pool(world).run(measure_worker, *args)

    def train(self, argv: list[str], pp: int, world: int) -> list[dict]:
        """Rank 0's metric rows of `pretrain(argv)` on a `world`-process world."""
        return self._pool(world).run(train_worker, argv, pp)[0]

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools = {}


def peak_trend(report: PaperReport, small: SmallScale, label: str, config: TransformerConfig, runs: Sequence[tuple],
                micro_batch: int = 1) -> dict:
    """Measured vs predicted worst-rank stash peaks for several (name, pp, m, v, options, recompute) runs;
    one Trend per run (worst rank) plus the returned {name: (measured, predicted)} for ratio rows."""
    out = {}
    for key, name, pp, m, v, options, recompute in runs:
        measured = small.run(config, name, pp, m, v, options, micro_batch, world=pp)
        per_rank_measured = [r["peak_stash_bytes"] for r in measured][:pp]
        predicted = predicted_stash_peaks(config, name, pp, m, v, options, micro_batch, recompute)
        errors = [relative_error(pr, me) for pr, me in zip(predicted, per_rank_measured) if me]
        worst = max(errors, key=abs) if errors else None
        report.trends.append(Trend(
            f"{label}: peak stash per rank, {key}", f"pp {pp}, m {m}, v {v}, b {micro_batch}",
            " / ".join(f"{x / 1024:.0f}" for x in per_rank_measured) + " KiB",
            " / ".join(f"{x / 1024:.0f}" for x in predicted) + " KiB", worst))
        out[key] = (max(per_rank_measured), max(predicted), per_rank_measured, predicted)
    return out


def ratio_trend(report: PaperReport, label: str, setting: str, a: tuple, b: tuple) -> None:
    measured, predicted = a[0] / b[0], a[1] / b[1]
    report.trends.append(Trend(label, setting, f"{measured:.2f}", f"{predicted:.2f}",
                               relative_error(predicted, measured)))
