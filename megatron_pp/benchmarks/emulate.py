"""Emulated compute: the real executor, real gloo transfers and real stash stores, with every compute action
and every stash copy taking the time a simulator `CostModel` gives it, so pipelines of 16 ranks fit on
2 cores and the trace shows the executor's own behaviour (posting, waiting, the p2p path, the stores).

A rank that sleeps needs no CPU. Each rank's chunks are the cheapest the executor accepts (an embedding on
the first stage, one tensor-parallel linear layer of width 8 over 4 tokens, a per-token loss on the last:
`emulated_chunk`), whose own compute is tens of microseconds, and it wraps the executor's handlers (its public table,
the way `ExecutorHooks` adds behaviour without touching the loop):

- F, B, BI, BW run the real handler (which waits for the received input, as always) and end at a deadline:
  the action's start (when the executor called it, pushed back by its waits: the copies below and its
  input, `PipelineExecutor._wait_s`) plus the cost model's duration. The model's compute and the
  executor's work inside the handler are absorbed into the duration; what they leave of it is the action's
  slack, recorded per action, and an action whose own work exceeded its cost is counted in its row
  (`actions_over_cost`). The JSON reports the model's share of busy time (`model_share`). The wait sleeps,
  then spins its last 0.15 ms, with the timer slack at 1 ns: a sleep alone wakes 0.05-0.13 ms late.
- OFFLOAD, RELOAD (host copies, one lane per rank) and EVICT, LOAD (BPipe, one lane per peer and
  direction) run the real store's handler and then occupy their lane for `CostModel.transfer_time`
  seconds, as the simulator times them: a copy back starts once the copy out is done, a B or BI waits
  for its stash's copy back, an F for the EVICTs issued before it (`schedules.simulate`). The acceptor's
  side of an EVICT (its ACCEPT post) is not waited for here: the real `PeerStore` does what it does.

Not emulated: point-to-point transfer time beyond gloo's own; the simulator is given latency 0, so a
full-size activation's link time is outside this comparison. What the executor adds beyond the costs is
taken apart along each measured step's critical path (`critical_path`): overruns, the executor's work
between a rank's compute actions, producer-to-consumer hops, waits.

This is a benchmark mode: it lives here and in `tools/trace_vs_sim.py --emulate`, never behind a training
flag. Times are `time.perf_counter()` (CLOCK_MONOTONIC on Linux: one clock for every process of a host),
so rank timelines line up without a clock exchange.

Worked numbers (equal costs, unit 20 ms): F = 20 ms, B = 40 ms, BI = BW = 20 ms on a rank's whole share of the
layers (10, 20, 10, 10 ms per chunk with two chunks per rank); 1F1B at p = 4, m = 8 simulates to
(8·3 + 3·3)·20 ms = 660 ms, bubble 9/33 = 0.27.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_pp.schedules.ir import Op, Schedule
from megatron_pp.schedules.simulate import CostModel, simulate

# Virtual stages and builder options per schedule family: the variant the issue names (PO-H offloads, the
# looped schedule reduces layer by layer).
FAMILIES: dict[str, tuple[int, dict]] = {
    "1f1b": (1, {}), "interleaved-1f1b": (2, {}), "gpipe": (1, {}), "zb-h1": (1, {}), "zb-h2": (1, {}),
    "zb-v": (2, {}), "v-half": (2, {}), "bpipe": (1, {}), "gis": (2, {}), "gis-h": (2, {}), "po-h": (2, {}),
    "looped-bfs": (2, {"layered_grad_accumulation": True}), "2bw": (1, {}),
}
SPLIT_BACKWARD_JSON = Path(__file__).resolve().parents[2] / "docs" / "results" / "split_backward_cpu.json"


def family_schedule(name: str, pp: int, microbatches: int) -> Schedule:
    """The validated lists of family `name` at (pp, microbatches) with its emulated variant's options."""
    from megatron_pp.schedules.registry import build_schedule

    if name not in FAMILIES:
        raise ValueError(f"no emulated variant of schedule {name!r}; known: {', '.join(FAMILIES)}")
    chunks, options = FAMILIES[name]
    return build_schedule(name, pp, microbatches, chunks, **options)


def cost_model(kind: str, unit_s: float) -> CostModel:
    """Costs in seconds. `equal`: F = 1, B = 2, BI = BW = 1 unit. `split`: F = 1, B = 2 and B split as
    measured here (docs/results/split_backward_cpu.json: BI = B x input_over_whole, BW = B x
    (split_over_whole - input_over_whole)); F = B/2 is our assumption, that file times no forward."""
    if kind == "equal":
        return CostModel(forward=unit_s, backward=2 * unit_s, backward_input=unit_s, backward_weight=unit_s)
    if kind == "split":
        measured = json.loads(SPLIT_BACKWARD_JSON.read_text())
        b = 2 * unit_s
        return CostModel(forward=unit_s, backward=b, backward_input=b * measured["input_over_whole"],
                         backward_weight=b * (measured["split_over_whole"] - measured["input_over_whole"]))
    raise ValueError(f"unknown cost set {kind!r}; known: equal, split")


# Worker side --------------------------------------------------------------------------------------------


def _now() -> float:
    return time.perf_counter()


SPIN_S = 1.5e-4
"""The last part of a wait is spun on the clock, not slept: a sleep wakes up late by a scheduler's tick
(0.05-0.13 ms here, median, with the timer slack at 1 ns or the default 50 us), which would lengthen every
action by that much."""


def _sleep_until(deadline: float) -> float:
    """Wait until `deadline` (sleeping, then spinning its last `SPIN_S`); returns how long that was."""
    gap = deadline - _now()
    if gap > SPIN_S:
        time.sleep(gap - SPIN_S)
    while _now() < deadline:
        pass
    return max(gap, 0.0)


def tighten_timer_slack() -> bool:
    """Set this thread's timer slack to 1 ns (Linux prctl PR_SET_TIMERSLACK): sleeps end closer to their
    deadline. False where not available."""
    try:
        import ctypes

        return ctypes.CDLL(None).prctl(29, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


@dataclass
class Emulator:
    """Wraps one executor's handlers so compute and stash copies take `costs`' durations (module docstring).
    Records, per step, every compute action's (label, start, end, waited, own, cost) and every copy's
    (label, start, end) on the shared clock, and every message posting (`posts`)."""

    executor: object
    schedule: Schedule
    costs: CostModel
    compute: list = field(default_factory=list)
    copies: list = field(default_factory=list)
    posts: list = field(default_factory=list)

    def __post_init__(self) -> None:
        ex = self.executor
        self._stage = [self.schedule.stage_of(ex.rank, c) for c in range(self.schedule.num_chunks)]
        for op in (Op.F, Op.B, Op.BI, Op.BW):
            ex.handlers[op] = self._timed_compute(ex.handlers[op])
        for op in (Op.OFFLOAD, Op.RELOAD, Op.EVICT, Op.LOAD):
            ex.handlers[op] = self._timed_copy(ex.handlers[op])
        if Op.STEP in ex.handlers:  # 2BW's deferred update: no optimizer here, and outside the simulated model
            ex.handlers[Op.STEP] = lambda action: None
        if ex.comm is not None:
            self._record_posts(ex.comm)
        self.reset()

    def reset(self) -> None:
        self.compute, self.copies, self.posts = [], [], []
        self._lanes: dict = {}
        self._away: dict = {}
        self._back_at: dict = {}
        self._evicted_at = 0.0

    def _timed_compute(self, real):
        """F, B, BI, BW end at a deadline: the action's start plus its cost, the start being when the executor
        called it, pushed back by whatever it waited for (its stash's copy back or earlier evictions, as the
        simulator has them, and its received input). The model's compute and the executor's work inside the
        handler are absorbed in the cost; what they leave of it is the action's slack, negative when they
        exceeded it (the action then ends late by that much, and the row counts it)."""
        def run(action) -> None:
            key = (action.microbatch, action.chunk)
            begin = _now()
            if action.op is Op.F:
                _sleep_until(self._evicted_at)
            elif action.op is not Op.BW:
                _sleep_until(self._back_at.pop(key, 0.0))
            copy_wait = _now() - begin
            waited_before = self.executor._wait_s  # the executor's time blocked on received inputs
            called = _now()
            real(action)
            returned = _now()
            input_wait = self.executor._wait_s - waited_before
            duration = self.costs.duration(action.op, self._stage[action.chunk])
            deadline = begin + copy_wait + input_wait + duration
            _sleep_until(deadline)
            self.compute.append((str(action), begin, _now(), copy_wait + input_wait, returned - called - input_wait,
                                 duration, deadline - returned))
        return run

    def _timed_copy(self, real):
        def run(action) -> None:
            real(action)
            op, key = action.op, (action.microbatch, action.chunk)
            lane = "host" if op in (Op.OFFLOAD, Op.RELOAD) else (op.value, action.peer)
            duration = self.costs.transfer_time(op, self._stage[action.chunk], self.schedule.options.get("offload_time"))
            start = max(_now(), self._lanes.get(lane, 0.0))
            if op in (Op.RELOAD, Op.LOAD):
                start = max(start, self._away.pop(key, start))
            end = self._lanes[lane] = start + duration
            if op in (Op.OFFLOAD, Op.EVICT):
                self._away[key] = end
                if op is Op.EVICT:
                    self._evicted_at = max(self._evicted_at, end)
            else:
                self._back_at[key] = end
            self.copies.append((str(action), start, end))
        return run

    def _record_posts(self, comm) -> None:
        """Record when each send and receive is posted, per peer in order (k-th send on a link = k-th receive)."""
        post, post_receive = comm.post, comm.post_receive

        def posting(sends, recvs):
            now = _now()
            self.posts.extend([("send", peer, now) for _, peer, _ in sends] + [("recv", peer, now) for _, peer in recvs])
            return post(sends, recvs)

        def posting_receive(buffer, peer):
            self.posts.append(("recv", peer, _now()))
            return post_receive(buffer, peer)

        comm.post, comm.post_receive = posting, posting_receive


_EMULATED: dict = {}

PRIORITY = -15
"""Nice value of the emulating processes' threads where allowed (root): a rank that wakes from a sleep
preempts other jobs' busy processes at once, so a loaded host delays it little. The ranks mostly sleep, so
they take little CPU from anyone; the JSON records whether it applied."""


def raise_priority() -> bool:
    """Give every thread of this process (gloo's included) the nice value `PRIORITY`; False if not allowed."""
    try:
        for tid in os.listdir("/proc/self/task"):
            os.setpriority(os.PRIO_PROCESS, int(tid), PRIORITY)
    except (OSError, AttributeError):
        return False
    return True


HIDDEN, SEQ, VOCAB = 8, 4, 16


def emulated_chunk(first: bool, last: bool):
    """The cheapest chunk the executor accepts: an embedding on the first stage, one linear layer (the
    tensor-parallel kind, whose weight GEMM a split backward really defers to BW), a per-token loss [b, s]
    on the last. Tens of microseconds a call on an idle core, beside milliseconds of sleep."""
    import torch
    from torch import nn

    from megatron_pp.core.tensor_parallel.layers import ColumnParallelLinear

    class Chunk(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Embedding(VOCAB, HIDDEN) if first else None
            self.linear = ColumnParallelLinear(HIDDEN, HIDDEN)
            with torch.no_grad():
                nn.init.normal_(self.linear.weight, std=0.1)
                self.linear.bias.zero_()

        def forward(self, x, batch):
            if first:
                x = self.embedding(batch["tokens"]).transpose(0, 1)  # [s, b, h]
            y = self.linear(x)
            return (y * y).mean(-1).transpose(0, 1) if last else y  # [b, s] per-token loss

    return Chunk()


def emulated_pipeline(schedule: Schedule, state):
    """This rank's executor over emulated chunks, with the stores and hooks `training.pipeline` would give
    the same lists (host offload, BPipe's peer parking, 2BW's weight versions)."""
    import torch

    from megatron_pp.core.p2p import PipelineComm
    from megatron_pp.schedules.execute import PipelineExecutor
    from megatron_pp.schedules.peer_store import peer_store_for
    from megatron_pp.training.weight_versions import WeightVersions, uses_weight_versions

    torch.manual_seed(1)
    last = schedule.num_stages - 1
    chunks = [emulated_chunk(stage == 0, stage == last)
              for stage in (schedule.stage_of(state.pp_rank, c) for c in range(schedule.num_chunks))]
    versions = WeightVersions(chunks) if uses_weight_versions(schedule) else None
    executor = PipelineExecutor(schedule, state.pp_rank, chunks, comm=PipelineComm(state.pp_group, state.pp_ranks),
                                activation_shape=(SEQ, 1, HIDDEN), dtype=torch.float32, device=state.device,
                                trace=True, store=peer_store_for(schedule, state), hooks=versions)
    if versions is not None:
        executor.store.exclude(versions.buffers[1])
    return chunks, executor


def emulated_batches(microbatches: int) -> list[dict]:
    import torch

    generator = torch.Generator().manual_seed(1)
    return [{"tokens": torch.randint(0, VOCAB, (1, SEQ), generator=generator), "loss_mask": torch.ones(1, SEQ)}
            for _ in range(microbatches)]


def worker_emulate(ctx, schedule: Schedule, costs: list[CostModel], steps: int) -> list[list[dict]]:
    """Run `steps` emulated steps of `schedule` under each cost model on this rank; per cost model and step,
    this rank's records (times on the host's monotonic clock). The pipeline is built once per schedule."""
    from megatron_pp.core import comm

    state = ctx.parallel_state(1, schedule.num_ranks)
    key = (schedule.name, schedule.num_ranks, schedule.num_microbatches)
    if key not in _EMULATED:
        _EMULATED.clear()  # one pipeline at a time: a grid builds many
        chunks, executor = emulated_pipeline(schedule, state)
        _EMULATED[key] = (chunks, executor, Emulator(executor, schedule, costs[0]),
                          emulated_batches(schedule.num_microbatches))
    chunks, executor, emulator, batches = _EMULATED[key]
    prioritised = raise_priority()  # again each call: threads started since (gloo's) inherit nothing earlier
    tight = tighten_timer_slack()
    tokens = float(sum(b["loss_mask"].sum() for b in batches))
    out = []
    for model in costs:
        emulator.costs = model
        out.append([])
        for _ in range(steps):
            for chunk in chunks:
                for p in chunk.parameters():
                    p.grad = None
            emulator.reset()
            comm.barrier()
            result = executor.run(batches, loss_scale=1.0 / tokens)
            out[-1].append({"started": result.started, "events": result.events, "compute": emulator.compute,
                            "copies": emulator.copies, "posts": emulator.posts, "load": os.getloadavg()[0],
                            "prioritised": prioritised, "timer_slack_1ns": tight,
                            "receives_ahead": dict(executor.receives_ahead)})
    return out


# Parent side ---------------------------------------------------------------------------------------------


def step_window(per_rank: list[dict]) -> tuple[float, float]:
    """(start, end) of one step on the shared clock: from the first compute action's start (the simulator's
    time 0; ranks leave the barrier before it some milliseconds apart) to the last action's end."""
    start = min(r["compute"][0][1] for r in per_rank)
    end = max([r["started"] + e for r in per_rank for _, _, e in r["events"]]
              + [c[2] for r in per_rank for c in r["copies"]])
    return start, end


def measure(per_rank: list[dict]) -> dict:
    """Step time, bubble (mean over ranks of (window - busy) / window, busy = the rank's compute net of its
    waits, as `simulate` defines it), the tiny model's share of busy time, and where a measured step can
    exceed the simulated one: actions outlasting their cost (`overrun_s`, a late wake-up or own work beyond
    the cost), the executor's work between compute actions (`gap_s`: posting, the loop), medians in seconds;
    each action's slack (its cost less its own work: median and least) and the actions whose own work
    exceeded their cost (`overran`, with up to five labels)."""
    start, end = step_window(per_rank)
    window = end - start
    busy = [sum(c[2] - c[1] - c[3] for c in r["compute"]) for r in per_rank]
    own = sum(c[4] for r in per_rank for c in r["compute"])
    overrun = [c[2] - c[1] - c[3] - c[5] for r in per_rank for c in r["compute"]]
    gaps = [b[1] - a[2] for r in per_rank for a, b in zip(r["compute"], r["compute"][1:])]
    slack = [(c[6], f"rank {rank} {c[0]}") for rank, r in enumerate(per_rank) for c in r["compute"] if len(c) > 6]
    late = sorted(x for x in slack if x[0] < 0)
    return {"step_s": window, "bubble": sum((window - b) / window for b in busy) / len(busy),
            "model_share": own / sum(busy), "busy_s": busy, "overrun_s": statistics.median(overrun),
            "gap_s": statistics.median(gaps) if gaps else 0.0,
            "slack_s": statistics.median(x for x, _ in slack) if slack else None,
            "least_slack_s": min(x for x, _ in slack) if slack else None,
            "actions": len(overrun), "overran": len(late), "overran_actions": [label for _, label in late[:5]]}


def _producers(schedule: Schedule) -> dict:
    """(rank, consumer label) -> (peer, producer label) for every received input: the k-th receive of a link
    is the k-th send on it; a send's producer is the last compute action before it of its (microbatch,
    chunk) and kind (F for SEND_F, B or BI for SEND_B), a receive's consumer the next one after it."""
    forward, backward = {Op.F}, {Op.B, Op.BI}

    def near(actions, index, step, kinds, a):
        while not (actions[index].op in kinds and (actions[index].microbatch, actions[index].chunk)
                   == (a.microbatch, a.chunk)):
            index += step
        return str(actions[index])

    sent: dict = {}
    for rank, actions in enumerate(schedule.actions):
        for i, a in enumerate(actions):
            if a.op in (Op.SEND_F, Op.SEND_B):
                kinds = forward if a.op is Op.SEND_F else backward
                sent.setdefault((rank, a.peer), []).append(near(actions, i, -1, kinds, a))
    out, k = {}, {}
    for rank, actions in enumerate(schedule.actions):
        for i, a in enumerate(actions):
            if a.op in (Op.RECV_F, Op.RECV_B):
                n = k[a.peer, rank] = k.get((a.peer, rank), -1) + 1
                kinds = forward if a.op is Op.RECV_F else backward
                out[rank, near(actions, i, 1, kinds, a)] = (a.peer, sent[a.peer, rank][n])
    return out


def critical_path(schedule: Schedule, per_rank: list[dict]) -> dict:
    """The measured step taken apart along its critical path, in seconds: from the compute action that ends
    last, back through whatever each action started after (its received input, if its producer ended after
    it was called, else the previous compute action of its rank) to the step's start. The parts add up to
    the step (up to a copy ending last): `cost` (the cost model's, what the simulator has), `overrun`
    (actions outlasting their cost), `gap` (the executor's work between two compute actions of a rank),
    `hop` (a producer's end to its consumer's input being in: posting the send, gloo, the receiver's
    wake-up; the simulator's latency is 0), `wait` (a consumer waiting for a stash copy), `lead` (the path's
    first action starting after the step's)."""
    records = [r["compute"] for r in per_rank]
    index = [{c[0]: i for i, c in enumerate(rec)} for rec in records]
    producers = _producers(schedule)
    start, _ = step_window(per_rank)
    rank = max(range(len(records)), key=lambda r: records[r][-1][2])
    i = len(records[rank]) - 1
    parts = dict.fromkeys(("cost", "overrun", "gap", "hop", "wait", "lead"), 0.0)
    while True:
        label, begin, end, waited, _, cost, *_ = records[rank][i]
        parts["cost"] += cost
        parts["overrun"] += end - begin - waited - cost
        source = producers.get((rank, label))
        if source is not None and records[source[0]][index[source[0]][source[1]]][2] > begin:
            peer, produced = source
            parts["hop"] += begin + waited - records[peer][index[peer][produced]][2]
            rank, i = peer, index[peer][produced]
        elif i > 0:
            parts["wait"] += waited
            parts["gap"] += begin - records[rank][i - 1][2]
            i -= 1
        else:
            parts["wait"] += waited
            parts["lead"] += begin - start
            return parts


def run_grid(pool, pp: int, names: list[str], microbatches: list[int], kinds: list[str], unit_s: float, steps: int,
             log=print) -> list[dict]:
    """Every (schedule, m) of the grid on one pool of `pp` workers, each built once and run under every cost
    set of `kinds`: one warm-up step, then `steps` measured; rows with the median measured step and bubble
    beside the simulated ones. A forward of a rank's whole share of the layers takes `unit_s`: with v chunks
    per rank, one chunk's forward takes unit_s / v (the same model, cut finer), so step times of schedules
    with different v compare as the same job's."""
    rows = []
    for m in microbatches:
        for name in names:
            schedule = family_schedule(name, pp, m)
            costs = {kind: cost_model(kind, unit_s / schedule.num_chunks) for kind in kinds}
            runs = pool.run(worker_emulate, schedule, list(costs.values()), steps + 1, timeout=900)
            for c, (kind, model) in enumerate(costs.items()):
                row = compare(schedule, model, [[runs[r][c][k] for r in range(pp)] for k in range(steps + 1)])
                rows.append({"costs": kind, **row})
                log(f"{name:>17} p={pp:<2} m={m:<3} {kind}: step {row['measured_step_s']:.3f} s (sim "
                    f"{row['simulated_step_s']:.3f}, {100 * row['step_error']:+.1f}%)  bubble "
                    f"{row['measured_bubble']:.3f} (sim {row['simulated_bubble']:.3f})  model "
                    f"{100 * row['model_share']:.1f}%  load {row['load_average'][1]:.1f}")
    return rows


def compare(schedule: Schedule, costs: CostModel, steps: list[list[dict]]) -> dict:
    """One row: the measured steps after the first (warm-up) against `simulate(schedule, costs)`."""
    import statistics

    sim = simulate(schedule, costs)
    per_step = [{**measure(step), "path": critical_path(schedule, step)} for step in steps[1:]]
    step = statistics.median(x["step_s"] for x in per_step)
    bubble = statistics.median(x["bubble"] for x in per_step)
    loads = [rank["load"] for s in steps for rank in s[:1]]
    row = {"pp": schedule.num_ranks, "schedule": schedule.name, "chunks": schedule.num_chunks,
           "microbatches": schedule.num_microbatches, "measured_step_s": step, "simulated_step_s": sim.makespan,
           "measured_bubble": bubble, "simulated_bubble": sim.bubble_fraction, "step_error": step / sim.makespan - 1,
           "bubble_error": (bubble - sim.bubble_fraction) / sim.bubble_fraction if sim.bubble_fraction else None,
           "steps_s": [x["step_s"] for x in per_step], "bubbles": [x["bubble"] for x in per_step],
           "model_share": statistics.median(x["model_share"] for x in per_step),
           "action_overrun_ms": 1e3 * statistics.median(x["overrun_s"] for x in per_step),
           "executor_gap_ms": 1e3 * statistics.median(x["gap_s"] for x in per_step),
           "action_slack_ms": 1e3 * statistics.median(x["slack_s"] for x in per_step),
           "least_action_slack_ms": 1e3 * min(x["least_slack_s"] for x in per_step),
           "actions_per_step": per_step[0]["actions"],
           "actions_over_cost": [x["overran"] for x in per_step],
           "actions_over_cost_examples": next((x["overran_actions"] for x in per_step if x["overran"]), []),
           "receives_ahead_max": max([k for rank in steps[0] for k in rank.get("receives_ahead", {}).values()],
                                     default=1),
           "critical_path_ms": {part: 1e3 * statistics.median(x["path"][part] for x in per_step)
                                for part in per_step[0]["path"]},
           "load_average": [min(loads), max(loads)],
           "raised_priority": all(rank.get("prioritised", False) for s in steps for rank in s),
           "timer_slack_1ns": all(rank.get("timer_slack_1ns", False) for s in steps for rank in s)}
    row["within_target"] = abs(row["step_error"]) <= 0.05 and (
        row["bubble_error"] is None or abs(row["bubble_error"]) <= 0.15)
    return row
