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

- Point-to-point transfers: with a `p2p_latency` in the cost model (the planner's, from a full-size
  activation's bytes over the pipeline link), a consumer's input is in no earlier than its transfer's end
  as one link per direction moving one message at a time has it, from when both its send and its receive
  were posted (`Emulator.transfer_end`; ranks publish their send times in a shared file, `link_times`).
  With latency 0 (the schedule grids) only gloo's own time.

What the executor adds beyond the costs is taken apart along each measured step's critical path
(`emulate_measure.critical_path`): overruns, the executor's work between a rank's compute actions,
producer-to-consumer hops, waits. This module is the ranks' side; `emulate_measure` reads their records.

This is a benchmark mode: it lives here and in `tools/trace_vs_sim.py --emulate`, never behind a training
flag. Times are `time.perf_counter()` (CLOCK_MONOTONIC on Linux: one clock for every process of a host),
so rank timelines line up without a clock exchange.

Worked numbers (equal costs, unit 20 ms): F = 20 ms, B = 40 ms, BI = BW = 20 ms on a rank's whole share of the
layers (10, 20, 10, 10 ms per chunk with two chunks per rank); 1F1B at p = 4, m = 8 simulates to
(8·3 + 3·3)·20 ms = 660 ms, bubble 9/33 = 0.27.
"""
from __future__ import annotations

import gc
import json
import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_pp.schedules.ir import Op, Schedule
from megatron_pp.schedules.simulate import CostModel

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


def thread_blocking() -> tuple[float, int]:
    """The calling thread's time off the CPU by its own choice so far (up to a constant) and its voluntary
    context switches. Off-CPU time is the wall clock less the thread's CPU time less the time it spent
    runnable in a run queue waiting for a core (/proc/thread-self/schedstat's second field, up to date
    when the running thread reads it): what a loaded host takes from a rank is run-queue time, which this
    leaves out; what remains is sleeping or blocking. Linux only (OSError elsewhere)."""
    with open("/proc/thread-self/schedstat") as f:
        queued = int(f.read().split()[1]) / 1e9
    return _now() - time.thread_time() - queued, resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw


def _since(mark: tuple[float, int], now: tuple[float, int]) -> tuple[float, int]:
    return now[0] - mark[0], now[1] - mark[1]


@dataclass
class Emulator:
    """Wraps one executor's handlers so compute and stash copies take `costs`' durations (module docstring).
    Records, per step, every compute action's (label, start, end, waited, own, cost) and every copy's
    (label, start, end) on the shared clock, and every message posting (`posts`). With `account`, also
    where the rank's thread blocked (`blocking`, per compute action: `thread_blocking` in the gap since the
    previous compute action ended, and inside the action's handler outside the wait for its own received
    input), which `tests/benchmarks/test_emulate.py` holds to the list's own waits."""

    executor: object
    schedule: Schedule
    costs: CostModel
    compute: list = field(default_factory=list)
    copies: list = field(default_factory=list)
    posts: list = field(default_factory=list)
    account: bool = False
    blocking: list = field(default_factory=list)
    sent: object = None
    """With a point-to-point latency in `costs`: a tensor [p, p, messages] of float64 mapped shared between the
    ranks (`link_times`), where each rank writes when it posted its k-th send to each peer before posting it."""

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
        if self.account:
            self._account_input_waits()
        self._inputs = consumed_messages(self.schedule, ex.rank)
        self.reset()

    def reset(self) -> None:
        self.compute, self.copies, self.posts, self.blocking = [], [], [], []
        self._mark: tuple | None = None  # thread_blocking() when the last compute action ended
        self._sends: dict = {}  # peer -> sends posted to it this step
        self._receives: dict = {}  # peer -> when each receive from it was posted this step
        self._arrivals: dict = {}  # peer -> emulated end of each transfer from it (`transfer_end`)
        self._in_takes = (0.0, 0)  # thread_blocking() spent in the executor's waits for received inputs
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
            if self.account:
                marks = [thread_blocking()]
                self._in_takes = (0.0, 0)
            called = _now()
            real(action)
            returned = _now()
            if self.account:
                marks.append(thread_blocking())
            input_wait = self.executor._wait_s - waited_before
            duration = self.costs.duration(action.op, self._stage[action.chunk])
            ready = begin + copy_wait + input_wait
            transfer_wait = 0.0  # the emulated transfer's end beyond the data being in (after the handler)
            if self.costs.p2p_latency > 0:
                arrived = max((self.transfer_end(peer, k) for peer, k in self._inputs.get(str(action), ())),
                              default=ready)
                transfer_wait = max(0.0, arrived - ready)
                ready += transfer_wait
            deadline = ready + duration
            _sleep_until(deadline)
            self.compute.append((str(action), begin, _now(), copy_wait + input_wait + transfer_wait,
                                 returned - called - input_wait, duration, deadline - returned))
            if self.account:
                self._record_blocking(str(action), marks)
        return run

    def transfer_end(self, peer: int, k: int) -> float:
        """When the k-th message from `peer` this step is in, as a link that moves one message at a time
        would have it: it starts when both its send and its receive are posted (a transfer cannot start
        before its receive is posted) and the link has finished the message before it, and takes the cost
        model's `p2p_latency`. The simulator has only send + latency. The sender published its posting time
        before posting the send, so it is there once the data is."""
        ends = self._arrivals.setdefault(peer, [])
        rank = self.executor.rank
        while len(ends) <= k:
            j = len(ends)
            start = max(float(self.sent[peer, rank, j]), self._receives[peer][j], ends[-1] if ends else 0.0)
            ends.append(start + self.costs.p2p_latency)
        return ends[k]

    def _account_input_waits(self) -> None:
        """Wrap the executor's take of a received input (where it waits for it) to add up `thread_blocking`
        inside those waits: the one place an action's handler may block."""
        take = self.executor._take

        def taking(table, key):
            mark = thread_blocking()
            try:
                return take(table, key)
            finally:
                blocked, switches = _since(mark, thread_blocking())
                self._in_takes = (self._in_takes[0] + blocked, self._in_takes[1] + switches)

        self.executor._take = taking

    def _record_blocking(self, label: str, marks: list) -> None:
        """(label, gap blocked s, gap switches, handler blocked s, handler switches) of one compute action: the
        gap from the previous compute action's end to this one's call (none for the first: the step's start
        is a barrier), the handler less its waits for received inputs."""
        called, returned = marks
        gap = _since(self._mark, called) if self._mark is not None else (0.0, 0)
        inside = _since(called, returned)
        self.blocking.append((label, *gap, inside[0] - self._in_takes[0], inside[1] - self._in_takes[1]))
        self._mark = thread_blocking()

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
            for _, peer, _ in sends:
                k = self._sends[peer] = self._sends.get(peer, -1) + 1
                if self.sent is not None:
                    self.sent[self.executor.rank, peer, k] = now  # before the data can reach the peer
            for _, peer in recvs:
                self._receives.setdefault(peer, []).append(now)
            return post(sends, recvs)

        def posting_receive(buffer, peer):
            now = _now()
            self.posts.append(("recv", peer, now))
            self._receives.setdefault(peer, []).append(now)
            return post_receive(buffer, peer)

        comm.post, comm.post_receive = posting, posting_receive


_EMULATED: dict = {}

PRIORITY = -15
"""Nice value of the emulating processes' threads and of their autogroup where allowed (root): a rank that
wakes from a sleep preempts other jobs' busy processes at once, so a loaded host delays it little. The ranks
mostly sleep, so they take little CPU from anyone; the JSON records whether it applied."""


def raise_priority() -> bool:
    """Give every thread of this process (gloo's included) the nice value `PRIORITY`, and its scheduler
    autogroup too; False if not allowed. Where Linux groups processes by session (autogroups,
    /proc/sys/kernel/sched_autogroup_enabled), a thread's nice value weighs only against its own session's
    threads and every busy session gets an equal share of the cores: another engineer's job in its own
    session then delays a waking rank whatever the rank's nice value (measured here at a load of 20: 1f1b at
    p = 8 ran 10-36% over its simulated step). The autogroup's own nice value is what weighs between sessions."""
    try:
        for tid in os.listdir("/proc/self/task"):
            os.setpriority(os.PRIO_PROCESS, int(tid), PRIORITY)
    except (OSError, AttributeError):
        return False
    return set_autogroup_nice(PRIORITY) or not os.path.exists("/proc/self/autogroup")


def make_realtime() -> bool:
    """Run every thread of this process (gloo's included; threads started later inherit it) under the
    real-time policy SCHED_FIFO at its lowest priority, where allowed (root): a waking rank then preempts
    every ordinary job at once, where a nice value, even its autogroup's, still leaves it behind a running
    task's time slice (a few ms late at a load of 30 here). Safe for these processes: they sleep or block
    except for an action's own work, the executor's posting and the last `SPIN_S` of each wait, and the
    kernel's real-time throttling keeps a share of each second for other tasks whatever they do."""
    try:
        for tid in os.listdir("/proc/self/task"):
            os.sched_setscheduler(int(tid), os.SCHED_FIFO, os.sched_param(1))
    except (OSError, AttributeError):
        return False
    return True


def set_autogroup_nice(value: int) -> bool:
    """Set the nice value of this process's scheduler autogroup (its session's); False where there is none
    or it is not allowed."""
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(value))
        return autogroup_nice() == value
    except OSError:
        return False


def autogroup_nice() -> int | None:
    """The nice value of this process's autogroup ('/autogroup-N nice V'), None without autogroups."""
    try:
        with open("/proc/self/autogroup") as f:
            return int(f.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def scheduling_state() -> tuple[int, int, int, int | None]:
    """(policy, real-time priority, nice value, autogroup nice) of this process, for `restore_scheduling`."""
    return (os.sched_getscheduler(0), os.sched_getparam(0).sched_priority, os.getpriority(os.PRIO_PROCESS, 0),
            autogroup_nice())


def restore_scheduling(state: tuple[int, int, int, int | None]) -> None:
    """Put every thread of this process (and its autogroup) back as `scheduling_state` found them. The ranks
    of a test run are pooled worker processes that later tests reuse for real training: left real-time, their
    busy compute would take the cores from everything else on the host."""
    policy, priority, nice, group = state
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setscheduler(int(tid), policy, os.sched_param(priority))
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        except (OSError, AttributeError):
            pass  # a thread that ended meanwhile, or nothing was raised (no rights)
    if group is not None and autogroup_nice() != group:
        set_autogroup_nice(group)


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


def worker_emulate(ctx, schedule: Schedule, costs: list[CostModel], steps: int,
                   account: bool = False, links: str | None = None) -> list[list[dict]]:
    """Run `steps` emulated steps of `schedule` under each cost model on this rank; per cost model and step,
    this rank's records (times on the host's monotonic clock). The pipeline is built once per schedule.
    `account`: also record where the rank's thread blocked (`Emulator.account`; a few /proc reads an action,
    so the benchmark leaves it off). `links`: the file of `new_link_file`, needed when a cost model has a
    point-to-point latency (each transfer then takes it: `Emulator.transfer_end`)."""
    from megatron_pp.core import comm

    state = ctx.parallel_state(1, schedule.num_ranks)
    if links is None and any(model.p2p_latency > 0 for model in costs):
        raise ValueError("a point-to-point latency needs the shared file of send times (links=new_link_file(...))")
    key = (schedule.name, schedule.num_ranks, schedule.num_microbatches, schedule.num_chunks, account, links)
    if key not in _EMULATED:
        _EMULATED.clear()  # one pipeline at a time: a grid builds many
        chunks, executor = emulated_pipeline(schedule, state)
        sent = None if links is None else link_times(links, schedule)
        _EMULATED[key] = (chunks, executor, Emulator(executor, schedule, costs[0], account=account, sent=sent),
                          emulated_batches(schedule.num_microbatches))
    chunks, executor, emulator, batches = _EMULATED[key]
    before = scheduling_state()
    prioritised = raise_priority()  # again each call: threads started since (gloo's) inherit nothing earlier
    realtime = make_realtime()
    try:
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
                result = _step_without_collector(comm, executor, batches, tokens)
                out[-1].append({"started": result.started, "events": result.events, "compute": emulator.compute,
                                "copies": emulator.copies, "posts": emulator.posts, "blocking": emulator.blocking,
                                "load": os.getloadavg()[0],
                                "prioritised": prioritised, "timer_slack_1ns": tight,
                                "autogroup_nice": autogroup_nice(), "realtime": realtime,
                                "receives_ahead": dict(executor.receives_ahead)})
    finally:
        restore_scheduling(before)  # the process goes back to whatever runs in it next as it came
    return out


def _step_without_collector(comm, executor, batches, tokens):
    """One step with Python's cyclic garbage collector off, after collecting before the step's barrier: the
    collector's threshold-triggered full collection (tens of milliseconds with torch's objects, on whichever
    action allocates when it strikes: a forward) otherwise lands inside the step as a stall no list has.
    Production trainers collect by hand between steps for the same reason (Megatron-LM's `--manual-gc`).
    The collection runs under the ordinary policy: tens of milliseconds of CPU on every rank at once under
    SCHED_FIFO would run into the kernel's real-time throttling, which then stops every real-time task, the
    next step's ranks included, for the rest of its period."""
    _collect_as_an_ordinary_task()
    comm.barrier()
    gc.disable()
    try:
        return executor.run(batches, loss_scale=1.0 / tokens)
    finally:
        gc.enable()


def _collect_as_an_ordinary_task() -> None:
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    if policy != os.SCHED_OTHER:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    try:
        gc.collect()
    finally:
        if policy != os.SCHED_OTHER:
            os.sched_setscheduler(0, policy, param)


def _consumer(actions, index: int, a) -> str:
    """The compute action a receive at `index` feeds: the next F (RECV_F) or B/BI (RECV_B) of its (microbatch,
    chunk)."""
    kinds = {Op.F} if a.op is Op.RECV_F else {Op.B, Op.BI}
    while not (actions[index].op in kinds and (actions[index].microbatch, actions[index].chunk)
               == (a.microbatch, a.chunk)):
        index += 1
    return str(actions[index])


def consumed_messages(schedule: Schedule, rank: int) -> dict[str, list[tuple[int, int]]]:
    """Compute action label -> the (peer, k) of each message it consumes on `rank`: its input is the k-th
    receive from that peer in the list (the k-th send of the peer to this rank)."""
    out: dict[str, list[tuple[int, int]]] = {}
    count: dict[int, int] = {}
    actions = schedule.actions[rank]
    for i, a in enumerate(actions):
        if a.op in (Op.RECV_F, Op.RECV_B):
            k = count[a.peer] = count.get(a.peer, -1) + 1
            out.setdefault(_consumer(actions, i, a), []).append((a.peer, k))
    return out


def link_times(path: str, schedule: Schedule):
    """The shared [p, p, messages] float64 tensor of send posting times (`Emulator.sent`) mapped from `path`
    (a file of zeros the parent made, `new_link_file`), where every rank of the pipeline maps the same."""
    import torch

    p, n = schedule.num_ranks, max_link_messages(schedule)
    return torch.from_file(path, shared=True, size=p * p * n, dtype=torch.float64).view(p, p, n)


def max_link_messages(schedule: Schedule) -> int:
    counts: dict = {}
    for rank, actions in enumerate(schedule.actions):
        for a in actions:
            if a.op in (Op.SEND_F, Op.SEND_B):
                counts[rank, a.peer] = counts.get((rank, a.peer), 0) + 1
    return max(counts.values(), default=1)


def new_link_file(folder: str, schedule: Schedule) -> str:
    """A file of zeros for `link_times` in `folder` (the caller removes the folder)."""
    path = os.path.join(folder, f"links_{schedule.name}_{schedule.num_ranks}_{schedule.num_microbatches}.bin")
    with open(path, "wb") as f:
        f.truncate(8 * schedule.num_ranks ** 2 * max_link_messages(schedule))
    return path
