"""The executor: runs one pipeline rank's action list with real model chunks.

It is the only place where schedules touch tensors, and it knows nothing about any particular schedule:
it walks the validated list in order and dispatches each action to a handler. Consecutive communication
actions form one batch, posted together where the backend needs it (NCCL; see `megatron_pp.core.p2p`).
Point-to-point is asynchronous: a send never blocks the compute after it (it completes in the background
and its activation is freed once it has), a received tensor is waited for only by the action that
consumes it, and where batches are not needed (gloo) the next receives of each incoming link are posted
ahead (as many as keep every receive posted before its send, `simulate.receives_ahead`), so their data
arrives while the rank computes. Later schedules add operations by
adding handlers (`PipelineExecutor.handlers`), never by changing the loop.

Per (microbatch, local chunk) the executor keeps the chunk's input (a leaf requiring grad, so its
`.grad` is the gradient to send upstream), its output (or, on the last stage, its scaled loss) and the
gradient of that output once received. A chunk whose neighbour stage sits on the same rank hands
tensors over in memory instead of communicating.

Split backward (BI, BW) and the stash: for a (microbatch, chunk) whose list puts other compute between its
BI and its BW (`deferred_backwards`), the forward and the BI run inside
`tensor_parallel.layers.deferring_weight_grads`, so BI computes the input gradient (sent
upstream at once) and the cheap norm, bias and embedding gradients, while the linear layers' weight GEMMs
wait in `weight_grads` with the output gradients they need; BW runs them (accumulating as autograd would,
into `.grad` or the fp32 `main_grad`, and telling the gradient reducer) and releases the stash. The stash
stays live until BW: what BI leaves for BW (those output gradients) is counted in it, and what BI frees (every
saved tensor BW does not read) stops counting as it dies (`store.Stash`). Unsplit B
is one autograd call, as before, and so is a BI whose BW comes right after it (GIS and PO place them
so): waiting would only hold the output gradients longer.

Stash transfers: when the list has OFFLOAD actions the executor uses an `OffloadStore` (unless a store
is passed) and tells it which stashes will move; OFFLOAD hands it the stash plus the tensors that must
stay on the device (the microbatch's batch tensors and the chunk output still to be sent), RELOAD asks
for it back, and autograd waits for the reload when it first reads a saved tensor. EVICT and LOAD
(BPipe) do the same with a `peer_store.PeerStore`, parking the stash on the partner rank, whose list
has the other side: ACCEPT and RETURN, run by its `AcceptorStore` at the points its list fixes;
`build_pipeline` creates both (they need a process group per pair) and the executor checks that the
store fits the list. The store hears when a step starts and ends (`begin_step`, `end_step`).

Schedules that carry state from one optimizer step to the next (2BW) run their list one *segment* per
call (`run(..., segment=...)`): microbatches in flight when a call ends keep their inputs, outputs and
stashes for the next call. Their runtime plugs in through `ExecutorHooks` (a callback before every
compute action, handlers for extra operations such as STEP), which wrap the handlers, not the loop.

REDUCE_GRAD.c (layered gradient accumulation) calls `reduce_grad_hook(c)`, which training points at its
gradient reducer; without it the action only marks the point.

Loss convention: the last stage returns a per-token loss `[b, s]`; the executor reduces it to
`sum(loss * loss_mask) * loss_scale`, where the caller passes `loss_scale = 1 / (tokens in the global
batch)` (times a loss-scaling factor under fp16). Gradients summed over microbatches and data-parallel
replicas then equal the gradient of the global per-token mean, exactly as one process would compute it.
"""
from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

import torch
from torch import nn

from megatron_pp.core.p2p import PipelineComm, Transfer, release_storage
from megatron_pp.core.tensor_parallel.layers import WeightGradStore, deferring_weight_grads
from megatron_pp.schedules.ir import Action, Op, Schedule
from megatron_pp.schedules.offload_store import OffloadStore
from megatron_pp.schedules.peer_store import prepare_store
from megatron_pp.schedules.simulate import receives_ahead
from megatron_pp.schedules.store import ActivationStore

COMM_OPS = frozenset({Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B})
FORWARD_OPS = frozenset({Op.F, Op.SEND_F, Op.RECV_F})
"""What a forward-only run (evaluation) keeps of a list."""


@dataclass(frozen=True)
class ReceivePlan:
    """Which receives of an action list are posted ahead (gloo), K per incoming link (`ahead[peer]`, 1 where
    absent; `simulate.receives_ahead` derives it from the whole schedule): `first`, the first K receives of
    every incoming link, posted when a run starts; `after[i]`, the receive K places after receive i on its
    link, posted once receive i has been. Indices are positions in the list."""

    first: tuple[int, ...]
    after: Mapping[int, int]

    @classmethod
    def of(cls, actions: Sequence[Action], ahead: Mapping[int, int] | None = None) -> "ReceivePlan":
        first: list[int] = []
        after: dict[int, int] = {}
        seen: dict[int, list[int]] = {}
        for index, a in enumerate(actions):
            if a.op is Op.RECV_F or a.op is Op.RECV_B:
                earlier = seen.setdefault(a.peer, [])
                k = max(1, (ahead or {}).get(a.peer, 1))
                if len(earlier) < k:
                    first.append(index)
                else:
                    after[earlier[-k]] = index
                earlier.append(index)
        return cls(tuple(first), after)


@dataclass
class StepResult:
    loss_sum: Optional[torch.Tensor]  # sum of masked per-token losses over my microbatches (last stage)
    token_count: Optional[torch.Tensor]
    peak_stash_bytes: int  # device-resident (with offload: not counting what sits in host memory)
    peak_stash_count: int
    comm_wait_s: float
    # (action, start, end), seconds, when tracing; a compute action that blocked on its received input
    # also has a ("wait <action>", start, end) slice inside its own.
    events: list[tuple[str, float, float]] = field(default_factory=list)
    peak_host_bytes: int = 0  # host buffers holding offloaded stashes (PipeOffload), peak over the step
    started: float = 0.0  # time.perf_counter() when the step began: `events` are relative to it


class ExecutorHooks:
    """What a schedule's runtime adds to the executor without touching its loop (2BW's weight versions).

    `handlers` run operations the executor has no handler of its own for (2BW: STEP, the deferred
    optimizer update); `before_compute` runs before every F, B, BI and BW (2BW: point the parameters at
    the weight version the action names). Pass an instance as `PipelineExecutor(..., hooks=...)`.
    """

    handlers: Mapping[Op, Callable[[Action], None]] = {}

    def before_compute(self, action: Action) -> None:
        """Called right before the compute `action` runs."""


def deferred_backwards(actions: Sequence[Action]) -> set[tuple[int, int]]:
    """The (microbatch, chunk) keys of `actions` whose BW is not the next compute action after their BI."""
    compute = [a for a in actions if a.is_compute]
    return {(a.microbatch, a.chunk) for i, a in enumerate(compute)
            if a.op is Op.BI and not (i + 1 < len(compute) and compute[i + 1].op is Op.BW
                                      and (compute[i + 1].microbatch, compute[i + 1].chunk) == (a.microbatch, a.chunk))}


class PipelineExecutor:
    """Run `schedule.actions[pp_rank]` with `chunks[c]` = the module of local chunk c."""

    def __init__(
        self,
        schedule: Schedule,
        pp_rank: int,
        chunks: Sequence[nn.Module],
        *,
        comm: Optional[PipelineComm],
        activation_shape: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
        store: Optional[ActivationStore] = None,
        trace: bool = False,
        hooks: Optional[ExecutorHooks] = None,
    ) -> None:
        if len(chunks) != schedule.num_chunks:
            raise ValueError(f"schedule has {schedule.num_chunks} chunks per rank but {len(chunks)} modules were built")
        self.schedule = schedule
        self.rank = pp_rank
        self.chunks = list(chunks)
        self.comm = comm
        self.activation_shape = tuple(activation_shape)
        self.dtype = dtype
        self.device = device
        self.trace = trace
        self.actions = schedule.actions[pp_rank]
        offloaded = {(a.microbatch, a.chunk) for a in self.actions if a.op is Op.OFFLOAD}
        self.store = store or (OffloadStore(device=device) if offloaded else ActivationStore())
        if offloaded:
            if not isinstance(self.store, OffloadStore):
                raise ValueError(f"--pipeline-schedule {schedule.name} offloads stashes, which needs an OffloadStore "
                                 f"(got {type(self.store).__name__})")
            self.store.plan(offloaded)
        prepare_store(self.store, schedule, pp_rank)
        for module in self.chunks:
            self.store.exclude(module.parameters())
            self.store.exclude(module.buffers())
        self.handlers: dict[Op, Callable[[Action], None]] = {
            Op.F: self._forward, Op.B: self._backward, Op.BI: self._backward_input, Op.BW: self._backward_weight,
            Op.OFFLOAD: self._offload, Op.RELOAD: self._reload, Op.EVICT: self._evict, Op.LOAD: self._load,
            Op.ACCEPT: self._accept, Op.RETURN: self._return,
        }
        self.handlers[Op.REDUCE_GRAD] = self._reduce_grad
        # (microbatch, chunk) keys whose weight-gradient GEMMs wait for their BW: those whose list puts other
        # compute between BI and BW (where the GEMMs fill a bubble). A BW that is BI's next compute gains
        # nothing from waiting and would only hold the output gradients longer, so it runs inside BI.
        self._split = deferred_backwards(self.actions)
        self.weight_grads = WeightGradStore()
        self.reduce_grad_hook: Optional[Callable[[int], None]] = None
        """Called by REDUCE_GRAD.c with the local chunk c to start that chunk's data-parallel reduction;
        training sets it to its gradient reducer's `reduce_chunk` (schedules never import training). While
        it is None the action only marks the point, and the step's gradients are reduced after the run
        (`finalize_gradients`), as for lists without it: exact, just not overlapped."""
        if hooks is not None:
            self._install(hooks)
        self._clear_in_flight()
        unsupported = sorted({a.op.value for a in self.actions} - set(self.handlers) - COMM_OPS)
        if unsupported:
            raise ValueError(
                f"--pipeline-schedule {schedule.name}: this executor cannot run {', '.join(unsupported)} actions yet"
            )
        last = schedule.num_stages - 1
        self._stage = [schedule.stage_of(pp_rank, c) for c in range(schedule.num_chunks)]
        # Where the neighbouring stages live: (rank, chunk) or None at the ends of the pipeline.
        self._next = [schedule.location(s + 1) if s < last else None for s in self._stage]
        self._prev = [schedule.location(s - 1) if s > 0 else None for s in self._stage]
        self._is_last = [s == last for s in self._stage]
        # Derived once per action list, not per step: the rank's list is fixed for the run. Entries hold
        # their list, so an id is not reused while its entry lives; the few lists a run passes (its own,
        # its forward-only view, 2BW's per-call segments) are kept most recent first, a bounded number.
        self._plans: dict[int, tuple[Sequence[Action], ReceivePlan]] = {}
        self._forward_views: dict[int, tuple[Sequence[Action], list[Action]]] = {}
        # Receives kept posted ahead per incoming link (gloo): enough that none is posted after its send on
        # the simulated timeline (`simulate.receives_ahead`, from the whole schedule, once).
        self.receives_ahead: dict[int, int] = (receives_ahead(schedule)[pp_rank]
                                               if comm is not None and not comm.batched else {})
        self._receive_plan(self.actions)

    _PLANS_KEPT = 8

    def _install(self, hooks: ExecutorHooks) -> None:
        for op in (Op.F, Op.B, Op.BI, Op.BW):
            def compute(action: Action, run: Callable[[Action], None] = self.handlers[op]) -> None:
                hooks.before_compute(action)
                run(action)
            self.handlers[op] = compute
        self.handlers.update(hooks.handlers)

    _forward_only = False

    def _clear_in_flight(self) -> None:
        self._inputs: dict[tuple[int, int], object] = {}  # Transfer (received) or leaf tensor (local)
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._grad_outputs: dict[tuple[int, int], object] = {}  # Transfer or tensor
        self._input_grads: dict[tuple[int, int], torch.Tensor] = {}

    # The loop ---------------------------------------------------------------------------------------------
    def run(self, microbatches: Sequence[dict] | Mapping[int, dict], loss_scale: float | torch.Tensor,
            segment: Optional[Sequence[Action]] = None, forward_only: bool = False) -> StepResult:
        """Execute the rank's list once. `microbatches[i]` is the batch dict of microbatch i.

        With `segment`, run those actions instead: one call of a list that spans optimizer steps (2BW, see
        `schedules.twobw`). What is in flight when it ends (inputs, outputs and gradients of microbatches
        whose backward is in a later call, their stashes) stays for the next call, `microbatches` maps the
        segment's microbatch numbers to batch dicts, and nothing is checked for leftovers.

        With `forward_only` (evaluation; call under `torch.no_grad()`), only the list's forwards and their
        communication run, in the list's order, and nothing is kept for a backward. Removing actions from a
        deadlock-free list keeps it deadlock-free: every wait that remains was ordered the same way in the
        full list. Hooks and stash stores are bypassed (no weight switching, no parking).
        """
        if segment is None:
            if len(microbatches) != self.schedule.num_microbatches:
                raise ValueError(f"schedule expects {self.schedule.num_microbatches} microbatches, "
                                 f"got {len(microbatches)}")
            self._clear_in_flight()
        self._microbatches = microbatches
        self._loss_scale = loss_scale
        # A loss scale held as a device tensor (1 / the global token count, never read on the host) is saved
        # by each loss's multiply: one scalar of the step, not per-microbatch memory.
        scale_tensors = [loss_scale] if isinstance(loss_scale, torch.Tensor) else []
        self.store.exclude(scale_tensors)
        self._loss_sum: Optional[torch.Tensor] = None
        self._token_count: Optional[torch.Tensor] = None
        self._wait_s = 0.0
        self._forward_only = forward_only
        if not forward_only:
            self.store.begin_step()
            self.store.reset_peak()
        events: list[tuple[str, float, float]] = []
        t0 = time.perf_counter()
        self._t0, self._blocked = t0, []

        actions, i = (self.actions if segment is None else segment), 0
        if forward_only:
            actions = self._forward_view(actions)
        self._post_first_receives(actions)
        while i < len(actions):
            start = time.perf_counter() - t0 if self.trace else 0.0
            first = i
            if actions[i].op in COMM_OPS:
                while i < len(actions) and actions[i].op in COMM_OPS:
                    i += 1
                self._post_batch(actions, first, i)
            elif forward_only:
                self._forward(actions[i])
                i += 1
            else:
                self.handlers[actions[i].op](actions[i])
                i += 1
            if self.comm is not None:
                self.comm.poll()
            if self.trace:
                self._trace_slice(events, actions[first:i], start)
        if self.comm is not None:
            self.comm.drain()
        if not forward_only:
            self.store.end_step()
        if segment is None:
            self._check_nothing_left()
        self.store.include(scale_tensors)
        return StepResult(
            loss_sum=self._loss_sum,
            token_count=self._token_count,
            peak_stash_bytes=self.store.peak_bytes,
            peak_stash_count=self.store.peak_count,
            comm_wait_s=self._wait_s + (self.comm.wait_s if self.comm is not None else 0.0),
            events=events,
            peak_host_bytes=getattr(self.store, "peak_host_bytes", 0),
            started=t0,
        )

    def _trace_slice(self, events: list, actions: Sequence[Action], start: float) -> None:
        """Record the slice of `actions` that just ran (from `start`, seconds since the step began) and the time
        it was blocked on its received input, nested in it: what is left of the slice is the rank's own work
        (tools/trace_vs_sim.py measures action costs so)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        label = " ".join(map(str, actions))
        events.append((label, start, time.perf_counter() - self._t0))
        events.extend((f"wait {label}", s, e) for s, e in self._blocked)
        self._blocked.clear()

    def _check_nothing_left(self) -> None:
        leftovers = [name for name, d in (("inputs", self._inputs), ("outputs", self._outputs),
                                          ("output grads", self._grad_outputs), ("input grads", self._input_grads)) if d]
        if leftovers:
            raise RuntimeError(f"rank {self.rank}: step ended with unconsumed {', '.join(leftovers)}")

    # Compute ----------------------------------------------------------------------------------------------
    def _take(self, table: dict, key: tuple[int, int]) -> torch.Tensor:
        item = table.pop(key)
        if isinstance(item, Transfer):
            item, waited = item.wait()
            self._wait_s += waited
            if self.trace and waited > 0:
                end = time.perf_counter() - self._t0
                self._blocked.append((end - waited, end))
        return item

    def _forward(self, action: Action) -> None:
        if self._forward_only:
            return self._forward_without_grad(action)
        mb, c = action.microbatch, action.chunk
        key = (mb, c)
        batch = self._microbatches[mb]
        x = None
        if self._prev[c] is not None:
            x = self._take(self._inputs, key).requires_grad_()
        with self.store.stash(key), self._deferring(key):
            y = self.chunks[c](x, batch)
            if self._is_last[c]:
                mask = batch["loss_mask"]
                masked = (y.float() * mask).sum()
                loss = masked * self._loss_scale
        # The input stays referenced by the autograd graph; keep our own handle to read its .grad later.
        self._outputs[key] = loss if self._is_last[c] else y
        if x is not None:
            self._input_grads[key] = x  # replaced by x.grad after the backward
        if self._is_last[c]:
            detached = masked.detach()
            self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
            count = mask.sum().detach()
            self._token_count = count if self._token_count is None else self._token_count + count
        elif self._next[c][0] == self.rank:
            self._inputs[(mb, self._next[c][1])] = y.detach()

    def _forward_without_grad(self, action: Action) -> None:
        mb, c = action.microbatch, action.chunk
        batch = self._microbatches[mb]
        x = self._take(self._inputs, (mb, c)) if self._prev[c] is not None else None
        y = self.chunks[c](x, batch)
        if self._is_last[c]:
            mask = batch["loss_mask"]
            masked, count = (y.float() * mask).sum(), mask.sum()
            self._loss_sum = masked if self._loss_sum is None else self._loss_sum + masked
            self._token_count = count if self._token_count is None else self._token_count + count
        elif self._next[c][0] == self.rank:
            self._inputs[(mb, self._next[c][1])] = y
        else:
            self._outputs[(mb, c)] = y  # until its SEND_F

    def _backward(self, action: Action) -> None:
        self._backward_pass(action)
        self.store.release((action.microbatch, action.chunk))

    def _backward_input(self, action: Action) -> None:
        # The input gradient (and the cheap norm, bias and embedding gradients); the linear layers' weight
        # GEMMs are held for BW. Its input gradient can be sent right after.
        key = (action.microbatch, action.chunk)
        with self._deferring(key):
            self._backward_pass(action)
        if key in self._split:
            self.store.hold(key, self.weight_grads.held(key))  # the output gradients BW still needs

    def _backward_weight(self, action: Action) -> None:
        key = (action.microbatch, action.chunk)
        self.weight_grads.run(key)  # nothing to run when BI was not split off (see `deferred_backwards`)
        self.store.release(key)

    def _deferring(self, key: tuple[int, int]):
        """The weight-gradient deferral of `key` when its backward is split, else nothing."""
        return deferring_weight_grads(self.weight_grads, key) if key in self._split else contextlib.nullcontext()

    def _backward_pass(self, action: Action) -> None:
        mb, c = action.microbatch, action.chunk
        key = (mb, c)
        out = self._outputs.pop(key)
        if self._is_last[c]:
            torch.autograd.backward(out)
        else:
            torch.autograd.backward(out, self._take(self._grad_outputs, key))
        if self._prev[c] is not None:
            grad = self._input_grads.pop(key).grad
            prev_rank, prev_chunk = self._prev[c]
            if prev_rank == self.rank:
                self._grad_outputs[(mb, prev_chunk)] = grad
            else:
                self._input_grads[key] = grad

    # Stash transfers --------------------------------------------------------------------------------------
    def _offload(self, action: Action) -> None:
        key = (action.microbatch, action.chunk)
        self.store.offload(key, *self._moving(key))

    def _moving(self, key: tuple[int, int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """What must stay on the device when stash `key` moves, and what only the executor references."""
        # The batch feeds the microbatch's later chunks and the output may still be in flight to the next
        # stage: both stay. The chunk input is ours alone (kept to read .grad): it moves, emptied in place.
        keep = [t for t in self._microbatches[key[0]].values() if isinstance(t, torch.Tensor)]
        if key in self._outputs:
            keep.append(self._outputs[key])
        private = [self._input_grads[key]] if key in self._input_grads else []
        return keep, private

    def _reload(self, action: Action) -> None:
        self.store.reload((action.microbatch, action.chunk))

    def _evict(self, action: Action) -> None:
        key = (action.microbatch, action.chunk)
        self.store.evict(key, *self._moving(key))

    def _load(self, action: Action) -> None:
        self.store.load((action.microbatch, action.chunk))

    def _accept(self, action: Action) -> None:
        self.store.accept((action.microbatch, action.chunk))  # an AcceptorStore (checked by prepare_store)

    def _return(self, action: Action) -> None:
        self.store.give_back((action.microbatch, action.chunk))

    # Gradient reduction ----------------------------------------------------------------------------------
    def _reduce_grad(self, action: Action) -> None:
        if self.reduce_grad_hook is not None:
            self.reduce_grad_hook(action.chunk)

    # Communication ----------------------------------------------------------------------------------------
    @staticmethod
    def _remember(cache: dict, actions: Sequence[Action], derive: Callable) -> object:
        entry = cache.pop(id(actions), None)
        if entry is None or entry[0] is not actions:
            entry = (actions, derive(actions))
            while len(cache) >= PipelineExecutor._PLANS_KEPT:
                cache.pop(next(iter(cache)))
        cache[id(actions)] = entry  # re-inserted: the dict's order is least recently used first
        return entry[1]

    def _receive_plan(self, actions: Sequence[Action]) -> ReceivePlan:
        return self._remember(self._plans, actions, lambda acts: ReceivePlan.of(acts, self.receives_ahead))

    def _forward_view(self, actions: Sequence[Action]) -> list[Action]:
        """What a forward-only run of `actions` keeps (derived once per list)."""
        return self._remember(self._forward_views, actions,
                              lambda acts: [a for a in acts if a.op in FORWARD_OPS])

    def _post_first_receives(self, actions: Sequence[Action]) -> None:
        """Where batches are not needed (gloo), keep the next K receives of every incoming link posted ahead
        (`receives_ahead`): their data then flows while this rank computes, instead of after the list
        reaches them. Receives on a link match in posting order, so receive j is posted only after the ones
        before it (at the start for the first K, right after receive j - K is posted for the others); each
        holds one activation-sized buffer from its posting, so at most K per incoming link are held early.
        On NCCL every receive is posted with its batch, in the validated order."""
        self._posted_ahead: set[int] = set()
        if self.comm is None or self.comm.batched:
            self._next_receive: Mapping[int, int] = {}
            return
        plan = self._receive_plan(actions)
        self._next_receive = plan.after
        for index in plan.first:
            self._post_ahead(actions, index)

    def _post_ahead(self, actions: Sequence[Action], index: int) -> None:
        a = actions[index]
        buf = torch.empty(self.activation_shape, dtype=self.dtype, device=self.device)
        self._receive_table(a)[(a.microbatch, a.chunk)] = self.comm.post_receive(buf, a.peer)
        self._posted_ahead.add(index)

    def _receive_table(self, action: Action) -> dict:
        return self._inputs if action.op is Op.RECV_F else self._grad_outputs

    def _post_batch(self, actions: Sequence[Action], first: int, end: int) -> None:
        sends, recvs, slots = [], [], []
        for index in range(first, end):
            a = actions[index]
            key = (a.microbatch, a.chunk)
            if a.op is Op.SEND_F and self._forward_only:
                sends.append((self._outputs.pop(key), a.peer, None))
            elif a.op is Op.SEND_F:
                # The output's data is only needed by the receiver; free it once the send is done. The output
                # itself is held weakly: once its backward has run, its graph (down to the chunk input, which
                # the input's AccumulateGrad node keeps) is not the send's to keep alive, and gloo's sends
                # report completion only when waited for, at the step's end.
                out = weakref.ref(self._outputs[key])
                sends.append((out().detach(), a.peer, lambda out=out: out() is not None and release_storage(out())))
            elif a.op is Op.SEND_B:
                sends.append((self._input_grads.pop(key), a.peer, None))
            elif index not in self._posted_ahead:
                buf = torch.empty(self.activation_shape, dtype=self.dtype, device=self.device)
                recvs.append((buf, a.peer))
                slots.append((self._receive_table(a), key))
        if self.comm is None:
            raise RuntimeError(f"rank {self.rank}: schedule communicates but no pipeline group was given")
        for (table, key), transfer in zip(slots, self.comm.post(sends, recvs)):
            table[key] = transfer
        for index in range(first, end):
            ahead = self._next_receive.get(index)
            if ahead is not None and ahead not in self._posted_ahead and ahead >= end:
                self._post_ahead(actions, ahead)
