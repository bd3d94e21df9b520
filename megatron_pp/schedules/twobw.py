"""PipeDream-2BW: 1F1B without a flush between optimizer steps, on two weight versions (arXiv 2006.09503).

**Order.** Rank s runs 1F1B with w_s = p − s − 1 warm-up forwards, but the steady state never stops at
a step boundary: the last w_s forwards of the call that runs batch t already belong to batch t+1. The
warm-up is paid once after a flush and the cool-down only before one (end of training, checkpoint,
evaluation, early exit), so a steady step costs m·(t_F + t_B) instead of 1F1B's (m + p − 1)·(t_F + t_B).

**Versions.** Batch t runs forward and backward on weight version `@t`, which holds W(t−1) (W(−1) = W(0):
versions 0 and 1 are both the initial weights). Version v lives in buffer v mod 2. `STEP@v` is the
update that creates version v: it applies batch v−2's gradient, W(v−1) = W(v−2) − lr·u(g(W(v−3))),
i.e. W(t+1) = W(t) − lr·u(g(W(t−1))), and writes buffer v mod 2, whose previous tenant v−2 (batch v−2)
has finished by then. So every backward runs on its forward's weights, forwards of the next batch run on
the newer version, and two buffers always suffice; m ≥ p is required, since with m < p a rank would
still hold version v−2 in flight when STEP@v needs its buffer (a third version).

**Deferred update.** STEP@(t+2) is not placed where batch t ends but as late as the versions allow:
right before the rank's first forward of batch t+2, or, on the last rank (which runs no forward of the
next batch before its step ends), right before its last backward of batch t+1. By then every rank has
finished batch t: the last stage finishes it first and stage 0 last, and in the simulator, with uniform
stages and m ≥ p, the last finish precedes the first STEP@(t+2) by at least a forward's time. So the
step's global operations (gradient-norm clipping, the inf/NaN check under fp16, the tied-embedding
sum between the first and last stage) complete in the background and never stall a rank: each rank
posts them when it finishes batch t and waits for them at STEP@(t+2) (`training.weight_versions`).

One call of the executor runs one batch: a rank's list is cut after its last backward of the batch (and
the communication batch that follows it; no STEP can come right there: with m >= p every rank still has
forwards of the next batch to run before that batch's update). Four kinds of call exist
(`CallKind`): WARMUP (after a start or a flush), STEADY, COOLDOWN (ends in a flush: no next-batch
forwards, both pending steps applied) and SINGLE (a warm-up and a cool-down at once).

Steady call of batch 1, p=4, m=8 (`steady_table()`): microbatches 8..15 of batch 1 run on version 1,
16..18 (the first forwards of batch 2) on version 2, which STEP@2 (batch 0's update) creates just before
them; the last rank has none before its last backward and steps there:

    rank 0 | F11.0@1 B8.0@1  F12.0@1 B9.0@1  F13.0@1 B10.0@1 F14.0@1 B11.0@1 F15.0@1
    rank 1 | F10.0@1 B8.0@1  F11.0@1 B9.0@1  F12.0@1 B10.0@1 F13.0@1 B11.0@1 F14.0@1
    rank 2 | F9.0@1  B8.0@1  F10.0@1 B9.0@1  F11.0@1 B10.0@1 F12.0@1 B11.0@1 F13.0@1
    rank 3 | F8.0@1  B8.0@1  F9.0@1  B9.0@1  F10.0@1 B10.0@1 F11.0@1 B11.0@1 F12.0@1

    rank 0 | B12.0@1 STEP@2  F16.0@2 B13.0@1 F17.0@2 B14.0@1 F18.0@2 B15.0@1
    rank 1 | B12.0@1 F15.0@1 B13.0@1 STEP@2  F16.0@2 B14.0@1 F17.0@2 B15.0@1
    rank 2 | B12.0@1 F14.0@1 B13.0@1 F15.0@1 B14.0@1 STEP@2  F16.0@2 B15.0@1
    rank 3 | B12.0@1 F13.0@1 B13.0@1 F14.0@1 B14.0@1 F15.0@1 STEP@2  B15.0@1

The first p−s−1 forwards of batch 1 on rank s (F8..F10 on rank 0, F8 on rank 2) ran in the previous call
and their stashes waited for it; F16.. stay in flight into the next call. Every call runs m forwards and
m backwards per rank; in the simulator a steady call lasts exactly m·(t_F + t_B) on every rank.

`two_bw(p, m, steps)` unrolls `steps` calls (warm-up, steady..., cool-down; `steps=1` is one SINGLE call,
the form `--pipeline-schedule 2bw` registers). `check_weight_versions` proves what is specific to 2BW;
the generic validator proves the rest. `StepPlan` holds each rank's segment per kind of call, cut from
validated unrolled lists, and shifts them to any batch.
"""
from __future__ import annotations

import dataclasses
import enum
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from megatron_pp.schedules.comm import insert_communication, link_of
from megatron_pp.schedules.generators import looped_placement
from megatron_pp.schedules.ir import COMM_OPS, SEND_OPS, Action, Op, Schedule, ScheduleError, positive_int
from megatron_pp.schedules.validate import validate

NAME = "2bw"


class CallKind(str, enum.Enum):
    """Which part of the unrolled list one executor call runs."""

    WARMUP = "warmup"
    """First call after the start or a flush; the next call continues without one."""
    STEADY = "steady"
    COOLDOWN = "cooldown"
    """Last call before a flush: no forwards of the next batch; both pending updates applied at the end."""
    SINGLE = "single"
    """A warm-up that is also a cool-down (a flush right after one batch)."""

    @classmethod
    def of(cls, fresh: bool, flush: bool) -> "CallKind":
        """The kind of a call that starts after a flush (`fresh`) and/or ends with one (`flush`)."""
        if fresh:
            return cls.SINGLE if flush else cls.WARMUP
        return cls.COOLDOWN if flush else cls.STEADY


def _check_sizes(num_ranks: int, num_microbatches: int, steps: int) -> None:
    positive_int("num_ranks", num_ranks)
    positive_int("num_microbatches", num_microbatches)
    positive_int("steps", steps)
    if num_microbatches < num_ranks:
        raise ValueError(
            f"2bw needs at least as many microbatches per optimizer step as pipeline stages (m >= p), got "
            f"m={num_microbatches}, p={num_ranks}: with fewer, a rank would still run batch t on version t when "
            f"the update for batch t+1 needs its buffer (a third weight version); raise --global-batch-size or "
            f"lower --micro-batch-size")


def call_actions(num_ranks: int, num_microbatches: int, rank: int, batch: int, kind: CallKind) -> list[Action]:
    """Compute actions (and STEPs) of `rank` in the call that runs `batch`; microbatch i of batch b is
    numbered b·m + i and runs on version b."""
    p, m = num_ranks, num_microbatches
    fresh = kind in (CallKind.WARMUP, CallKind.SINGLE)
    flush = kind in (CallKind.COOLDOWN, CallKind.SINGLE)
    warmup = min(p - rank - 1, m)

    def forward(b: int, i: int) -> Action:
        return Action(Op.F, b * m + i, 0, version=b)

    actions = [forward(batch, i) for i in range(warmup)] if fresh else []
    forwards = [forward(batch, i) for i in range(warmup, m)]
    if not flush:
        forwards += [forward(batch + 1, i) for i in range(warmup)]  # the next batch's warm-up, no flush
    backwards = [Action(Op.B, batch * m + j, 0, version=batch) for j in range(m)]
    body: list[Action] = []
    for j, f in enumerate(forwards):
        body += [f, backwards[j]]
    body += backwards[len(forwards):]
    if not fresh:
        # The update for batch-1 creates version batch+1: before its first user, or before the last
        # backward of this batch, whichever comes first (the pending gradient slot must be free when this
        # batch's gradient is complete).
        first_user = next((k for k, a in enumerate(body) if a.op is Op.F and a.version == batch + 1), len(body))
        body.insert(min(first_user, len(body) - 1), Action(Op.STEP, version=batch + 1))
    if flush:
        body.append(Action(Op.STEP, version=batch + 2))
    return actions + body


def call_kinds(steps: int) -> list[CallKind]:
    """Kinds of the calls of an unrolled run of `steps` batches flushed only at its end."""
    if steps == 1:
        return [CallKind.SINGLE]
    return [CallKind.WARMUP] + [CallKind.STEADY] * (steps - 2) + [CallKind.COOLDOWN]


def two_bw(num_ranks: int, num_microbatches: int, steps: int = 1) -> Schedule:
    """The compute lists of `steps` consecutive optimizer steps of 2BW, flushed only at the end.

    `num_microbatches` is m per step; the schedule numbers microbatches across steps (steps·m of them)
    and says so in its options (`steps`, `microbatches_per_step`). Raises ValueError for m < p.
    """
    _check_sizes(num_ranks, num_microbatches, steps)
    kinds = call_kinds(steps)
    actions = [[a for batch, kind in enumerate(kinds)
                for a in call_actions(num_ranks, num_microbatches, rank, batch, kind)]
               for rank in range(num_ranks)]
    schedule = Schedule(
        name=NAME,
        num_ranks=num_ranks,
        num_microbatches=steps * num_microbatches,
        num_chunks=1,
        placement=looped_placement(num_ranks, 1),
        actions=actions,
        options={"steps": steps, "microbatches_per_step": num_microbatches},
    )
    check_weight_versions(schedule)
    return schedule


def check_weight_versions(schedule: Schedule) -> None:
    """The 2BW rules the generic validator does not know (it checks versions of live stashes only).

    On every rank: batch t (microbatches t·m .. t·m+m−1) runs on version t; two buffers hold versions
    (v mod 2) and every compute finds its version in its buffer; STEP@v comes after the rank's last
    backward of batch v−2 and overwrites version v−2 only once no stash of it is live; every forward of
    batch t+1 comes before the update for batch t (STEP@(t+2)); and no rank drains between steps: when a
    rank's last backward of batch t runs (t not the last batch), exactly min(p−1−s, m) forwards of batch
    t+1 have already run on it, as in 1F1B's steady state. Communication actions are ignored, so the check
    holds before and after `insert_communication`.
    """
    m = schedule.options.get("microbatches_per_step", schedule.num_microbatches)
    steps = schedule.num_microbatches // m
    for rank, acts in enumerate(schedule.actions):
        buffers = [0, 1]  # version held by buffer 0 and buffer 1: both start as W(0)
        live: Counter[int] = Counter()  # versions of stashes between their F and B
        forwards: Counter[int] = Counter()  # forwards run per batch
        backwards: Counter[int] = Counter()
        stepped: dict[int, int] = {}  # version -> index of its STEP
        warmup = min(schedule.num_ranks - 1 - rank, m)

        def fail(i: int, action: Action, reason: str) -> ScheduleError:
            return ScheduleError(f"rank {rank}, action {i} ({action}): {reason}")

        for i, a in enumerate(acts):
            if a.op is Op.STEP:
                v = a.version
                if v is None or v < 2 or v in stepped:
                    raise fail(i, a, "a STEP must create a new version v >= 2, once")
                if backwards[v - 2] != m:
                    raise fail(i, a, f"updates with batch {v - 2}'s gradient before its last backward on this rank")
                if buffers[v % 2] != v - 2 or live[v - 2]:
                    raise fail(i, a, f"buffer {v % 2} still holds version {buffers[v % 2]} in use "
                                     f"({live[v - 2]} stashes live): a third weight version would be needed")
                if v - 1 < steps and forwards[v - 1] != m:
                    raise fail(i, a, f"the update for batch {v - 2} comes before the last forward of batch {v - 1}")
                buffers[v % 2] = v
                stepped[v] = i
                continue
            if a.op not in (Op.F, Op.B):
                continue
            batch = a.microbatch // m
            if a.version != batch:
                raise fail(i, a, f"microbatch {a.microbatch} belongs to batch {batch} and must run on version {batch}")
            if buffers[batch % 2] != batch:
                raise fail(i, a, f"version {batch} is not in buffer {batch % 2} (it holds {buffers[batch % 2]}): "
                                 f"STEP@{batch} has not run")
            if a.op is Op.F:
                forwards[batch] += 1
                live[batch] += 1
            else:
                backwards[batch] += 1
                live[batch] -= 1
                if backwards[batch] == m and batch + 1 < steps and forwards[batch + 1] != warmup:
                    raise fail(i, a, f"batch {batch} ends with {forwards[batch + 1]} forwards of batch {batch + 1} "
                                     f"in flight, expected {warmup}: the pipeline drains between steps")
        expected = set(range(2, steps + 2))
        if set(stepped) != expected:
            raise ScheduleError(f"rank {rank}: STEPs create versions {sorted(stepped)}, expected {sorted(expected)}")


def shift(actions: Sequence[Action], batches: int, num_microbatches: int) -> list[Action]:
    """`actions` moved `batches` optimizer steps later: microbatch numbers by batches·m, versions by batches."""
    if batches == 0:
        return list(actions)
    out = []
    for a in actions:
        changes = {}
        if a.microbatch is not None:
            changes["microbatch"] = a.microbatch + batches * num_microbatches
        if a.version is not None:
            changes["version"] = a.version + batches
        out.append(dataclasses.replace(a, **changes))
    return out


def cut_calls(schedule: Schedule) -> list[list[list[Action]]]:
    """`[call][rank]`: each rank's list cut into one piece per batch (see the module docstring)."""
    m = schedule.options["microbatches_per_step"]
    steps = schedule.options["steps"]
    calls: list[list[list[Action]]] = [[] for _ in range(steps)]
    for acts in schedule.actions:
        start = 0
        for batch in range(steps):
            if batch == steps - 1:
                end = len(acts)
            else:
                end = max(i for i, a in enumerate(acts) if a.op is Op.B and a.microbatch // m == batch) + 1
                while end < len(acts) and acts[end].op in COMM_OPS:
                    end += 1
            calls[batch].append(acts[start:end])
            start = end
    return calls


def unrolled(num_ranks: int, num_microbatches: int, steps: int) -> Schedule:
    """`two_bw` with communication inserted and validated (generic rules and `check_weight_versions`)."""
    schedule = insert_communication(two_bw(num_ranks, num_microbatches, steps))
    validate(schedule)
    check_weight_versions(schedule)
    return schedule


@dataclass(frozen=True)
class StepPlan:
    """Each rank's segment for each kind of call, as run by batch `template[kind][0]`.

    Built from validated unrolled lists (warm-up, steady, steady, cool-down; warm-up, cool-down; single),
    and checked to be independent of their neighbours: the steady segment of batch 2 is that of batch 1
    shifted, and the warm-up and cool-down cut from two-step and four-step lists agree. Any sequence of
    calls a run makes (a warm-up, steady calls, a cool-down, repeated; or single calls) is therefore a
    shifted concatenation of validated pieces. On every directed link each call sends exactly what the
    peer's same call receives, so no transfer waits for a later call.
    """

    num_ranks: int
    num_microbatches: int
    template: dict[CallKind, tuple[int, list[list[Action]]]]

    def segment(self, kind: CallKind, rank: int, batch: int) -> list[Action]:
        """The actions `rank` runs in the call of kind `kind` that runs `batch`."""
        base, lists = self.template[kind]
        return shift(lists[rank], batch - base, self.num_microbatches)


def build_plan(num_ranks: int, num_microbatches: int) -> StepPlan:
    """The `StepPlan` for p ranks and m microbatches per step (validated; ScheduleError if inconsistent)."""
    p, m = num_ranks, num_microbatches
    four = cut_calls(unrolled(p, m, 4))
    two = cut_calls(unrolled(p, m, 2))
    single = cut_calls(unrolled(p, m, 1))
    for rank in range(p):
        pairs = ((four[2][rank], shift(four[1][rank], 1, m), "steady call of batch 2"),
                 (two[0][rank], four[0][rank], "warm-up call"),
                 (two[1][rank], shift(four[3][rank], -2, m), "cool-down call"))
        for got, want, what in pairs:
            if got != want:
                raise ScheduleError(f"2bw, p={p}, m={m}, rank {rank}: the {what} depends on the calls around it")
    for calls in (four, two, single):
        for call in calls:
            _check_call_is_closed(call)
    return StepPlan(p, m, {CallKind.WARMUP: (0, four[0]), CallKind.STEADY: (1, four[1]),
                           CallKind.COOLDOWN: (3, four[3]), CallKind.SINGLE: (0, single[0])})


def _check_call_is_closed(call: list[list[Action]]) -> None:
    sent: Counter = Counter()
    received: Counter = Counter()
    for rank, acts in enumerate(call):
        for a in acts:
            if a.op in COMM_OPS:
                (sent if a.op in SEND_OPS else received)[link_of(rank, a)] += 1
    if sent != received:
        raise ScheduleError(f"2bw: a call's messages cross into the next call (sent {dict(sent)}, "
                            f"received {dict(received)})")


def steady_table(num_ranks: int = 4, num_microbatches: int = 8, per_row: int = 9) -> str:
    """The steady call of batch 1 as an ASCII table of computes and STEPs (the module docstring's)."""
    calls = cut_calls(two_bw(num_ranks, num_microbatches, 3))
    schedule = Schedule(NAME, num_ranks, 3 * num_microbatches, 1, looped_placement(num_ranks, 1), calls[1])
    return schedule.format_table(per_row=per_row, ops=(Op.F, Op.B, Op.STEP))
