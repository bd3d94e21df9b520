"""The planner's step time at full size, its schedule part, emulated: the best plan `tools/plan.py` prints
for a job, run by the real executor with every action taking the planner's own time for it
(`planning.cost.Evaluator.costs`: F, B, BI, BW per stage from the layer times, offload and peer copies and
point-to-point transfers from their bytes over the links), scaled by one factor so that a rank's share of
a forward takes `unit_s` (tens of milliseconds, so that 16 sleeping ranks fit on 2 cores), against the
planner's predicted step time scaled by the same factor.

Both sides use the same per-action times, so kernel times cancel: the difference is what the planner's
timeline leaves out. The planner replays the lists in the simulator (extrapolated linearly in m above
3p + r microbatches) with transfers that take their latency from the send and never wait for a receive
or for the link; the emulation has the executor's order and posting, a transfer that starts once both
its send and its receive are posted and the link (one per direction) has moved the message before it
(`emulate.Emulator.transfer_end`), and this host's per-action executor work. The data-parallel
reduction and the optimizer step after each rank's last action are closed forms in the planner
(`Evaluator.after_pipeline_s`); the emulated step adds each rank's (scaled) to its end, so they are not
checked here. What is not validated at all is the per-action times themselves (the roofline or
`--efficiency-file`): that needs the target GPU.

Worked numbers: a plan whose mean rank runs forwards of 40 ms of real time per microbatch, at
`unit_s` = 20 ms, is emulated at scale 0.5: a predicted step of 6.0 s is held against an emulated step
of 3.0 s; an emulated 3.06 s is read as 6.12 s, +2.0%.
"""
from __future__ import annotations

import statistics
import tempfile
from dataclasses import dataclass

from megatron_pp.benchmarks.emulate import new_link_file, worker_emulate
from megatron_pp.benchmarks.emulate_measure import critical_path, measure, step_window
from megatron_pp.schedules.ir import Op, Schedule
from megatron_pp.schedules.simulate import CostModel, receives_ahead, simulate


@dataclass
class PlanCase:
    """One plan ready to emulate: its lists at the plan's m, its cost model in real seconds and scaled."""

    label: str
    prediction: object  # planning.job.Prediction
    schedule: Schedule
    costs: CostModel  # the planner's, real seconds
    after_s: list[float]  # per rank, the planner's seconds after the last action (reduction, optimizer)
    scale: float  # emulated seconds per real second
    message_bytes: int = 0  # one point-to-point message (a stage boundary's activation or its gradient)


def rank_forward_s(schedule: Schedule, costs: CostModel) -> list[float]:
    """Per rank, the forward time of its whole share of the layers (its chunks' F summed)."""
    return [sum(costs.duration(Op.F, schedule.stage_of(rank, c)) for c in range(schedule.num_chunks))
            for rank in range(schedule.num_ranks)]


def scaled(costs: CostModel, scale: float) -> CostModel:
    """`costs` (a measured table and a latency, as the planner builds them) with every time times `scale`."""
    return CostModel(measured={key: scale * value for key, value in costs.measured.items()},
                     p2p_latency=scale * costs.p2p_latency)


def plan_case(label: str, evaluator, prediction, unit_s: float) -> PlanCase:
    """The plan of `prediction` (a ranked row of `evaluator`, a `planning.Planner`) at its own m, with the
    evaluator's cost model and after-pipeline times; scale: the mean rank's forward share takes `unit_s`."""
    c, m = prediction.configuration, prediction.num_microbatches
    schedule = evaluator.schedule(c, m)
    prepared = evaluator.prepare(c, exact=True)
    costs = prepared.costs
    forward = rank_forward_s(schedule, costs)
    config = evaluator.job.config
    rows = config.seq_length * c.micro_batch_size // (c.tp if c.sequence_parallel else 1)
    return PlanCase(label, prediction, schedule, costs, list(prepared.after), unit_s * len(forward) / sum(forward),
                    rows * config.hidden_size * evaluator.job.numerics.activation_bytes)


def early_receive_bytes(case: PlanCase) -> list[int]:
    """Per rank, the buffers of the receives a gloo executor keeps posted ahead (K per incoming link,
    `simulate.receives_ahead`), at most all held at once: K x one message's bytes, summed over the links.
    NCCL posts every receive with its batch (none early)."""
    return [sum(ahead.values()) * case.message_bytes for ahead in receives_ahead(case.schedule)]


def run_plan_case(pool, case: PlanCase, steps: int, log=print) -> dict:
    """Emulate `case` (one warm-up step, then `steps`) and compare with the planner's prediction."""
    model = scaled(case.costs, case.scale)
    with tempfile.TemporaryDirectory() as folder:
        links = new_link_file(folder, case.schedule)
        runs = pool.run(worker_emulate, case.schedule, [model], steps + 1, links=links, timeout=1800)
    per_step = [[runs[r][0][k] for r in range(case.schedule.num_ranks)] for k in range(steps + 1)][1:]
    row = plan_row(case, model, per_step)
    log(f"{case.label}: {row['schedule']} p={row['pp']} v={row['v']} m={row['microbatches']}: emulated step "
        f"{row['emulated_step_s']:.2f} s against predicted {row['predicted_step_s']:.2f} s "
        f"({100 * row['step_error']:+.1f}%), pipeline {100 * row['pipeline_error']:+.1f}%")
    return row


def _emulated_step(step: list[dict], after_s: list[float]) -> tuple[float, float]:
    """(pipeline, step) of one emulated step: the window of `measure`, and the latest rank's end plus its
    (scaled) after-pipeline time, from the same start."""
    start, _ = step_window(step)
    ends = [max([r["started"] + e for _, _, e in r["events"]] + [c[2] for c in r["copies"]]) for r in step]
    return measure(step)["step_s"], max(end + a for end, a in zip(ends, after_s)) - start


def plan_row(case: PlanCase, model: CostModel, per_step: list[list[dict]]) -> dict:
    """One JSON row: the plan, its predicted and exactly simulated times, the emulated ones read back at real
    scale (divided by `scale`), and where the emulated step went (critical path, emulated milliseconds)."""
    p, c, s = case.prediction, case.prediction.configuration, case.scale
    after = [s * a for a in case.after_s]
    measured = [_emulated_step(step, after) for step in per_step]
    pipeline = statistics.median(x for x, _ in measured) / s
    step = statistics.median(x for _, x in measured) / s
    exact = simulate(case.schedule, case.costs)
    loads = [r["load"] for st in per_step for r in st]
    ahead, early = receives_ahead(case.schedule), early_receive_bytes(case)
    parts = [critical_path(case.schedule, step_records, model.p2p_latency) for step_records in per_step]
    stats = [measure(step_records) for step_records in per_step]
    return {
        "plan": case.label, "schedule": c.schedule, "pp": c.pp, "v": c.num_chunks, "tp": c.tp, "dp": c.dp,
        "micro_batch_size": c.micro_batch_size, "microbatches": p.num_microbatches, "recompute": c.recompute,
        "options": dict(c.options), "scale": s,
        "rank_forward_ms": [1e3 * f for f in rank_forward_s(case.schedule, case.costs)],
        "p2p_latency_ms": 1e3 * case.costs.p2p_latency,
        "copy_ms": _copy_ms(case),
        "predicted_step_s": p.step_s, "predicted_pipeline_s": p.pipeline_s, "predicted_after_s": p.reduce_s,
        "predicted_extrapolated": p.extrapolated, "simulated_pipeline_s": exact.makespan,
        "simulated_bubble": exact.bubble_fraction,
        "emulated_step_s": step, "emulated_pipeline_s": pipeline,
        "emulated_bubble": statistics.median(x["bubble"] for x in stats),
        "step_error": step / p.step_s - 1, "pipeline_error": pipeline / p.pipeline_s - 1,
        "extrapolation_error": p.pipeline_s / exact.makespan - 1,
        "critical_path_ms": {part: 1e3 * statistics.median(x[part] for x in parts) for part in parts[0]},
        "actions_over_cost": [x["overran"] for x in stats],
        "model_share": statistics.median(x["model_share"] for x in stats),
        "executor_gap_ms": 1e3 * statistics.median(x["gap_s"] for x in stats),
        "steps_s": [x / s for x, _ in measured],
        "load_average": [min(loads), max(loads)],
        "message_bytes": case.message_bytes, "receives_ahead_max": max(max(k.values(), default=1) for k in ahead),
        "early_receive_bytes": early,
        "early_receive_share_of_peak": max(e / m for e, m in zip(early, p.memory_bytes)),
    }


def _copy_ms(case: PlanCase) -> dict[str, float]:
    """The planner's one-way host copy time (OFFLOAD, RELOAD) of each stage whose stashes the lists move."""
    moved = {(a.op, case.schedule.stage_of(rank, a.chunk)) for rank, acts in enumerate(case.schedule.actions)
             for a in acts if a.op in (Op.OFFLOAD, Op.RELOAD, Op.EVICT, Op.LOAD)}
    return {f"{op.value}.{stage}": 1e3 * case.costs.transfer_time(op, stage) for op, stage in sorted(
        moved, key=lambda x: (x[1], x[0].value))}


def run_plans(pool_for, cases: list[PlanCase], steps: int, log=print) -> list[dict]:
    """Every case on a pool of its pipeline size (`pool_for(pp)`, reused for cases of one size)."""
    return [run_plan_case(pool_for(case.schedule.num_ranks), case, steps, log) for case in cases]
