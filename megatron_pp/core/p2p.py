"""Point-to-point transfers between pipeline ranks.

The executor hands this module the sends and receives of one *batch* at a time (the consecutive
communication actions of a schedule) and gets back handles. Batching is kept only where the backend
needs it. On NCCL a send blocks its pair's stream until the peer posts the matching receive, so two
ranks that send to each other at the same point of their lists would deadlock; the batch is posted with
`torch.distributed.batch_isend_irecv`, which groups it, and the validator guarantees both ends post the
same messages in the same order and that the batches cannot deadlock. On gloo every send and receive is
its own asynchronous operation with its own completion, so the members are posted one by one, and the
executor may post a receive ahead of its batch (`post_receive`) as long as it keeps the order of the
receives on each link. Activation shapes are fixed by (sequence length, micro-batch size, hidden size),
so receive buffers are allocated from a shape known ahead and nothing is exchanged to learn shapes.

Receives complete lazily: `Transfer.wait()` is called by the consumer right before it needs the data,
so a receive posted early overlaps with compute. Sends are never waited for by compute: they stay in
flight until `PipelineComm.poll` sees them complete or `drain` waits for them at the end of the step, and
only then may the sender free the sent storage.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_pp.core import comm


@dataclass
class Transfer:
    """One posted receive: the buffer and the work that fills it."""

    buffer: torch.Tensor
    work: Optional[dist.Work]
    on_wait: Optional[Callable[[dist.Work], None]] = None
    """Told the work once it was waited for: NCCL may coalesce a batch into one work shared by its sends,
    which are then complete too (`PipelineComm.note_waited`)."""

    def wait(self) -> tuple[torch.Tensor, float]:
        """Block until the data has arrived; return the buffer and the seconds spent blocked (0.0 when the
        data was already in: the call's own few microseconds are not a wait, and a trace's wait slice
        then marks exactly the receives the consumer had to wait for)."""
        if self.work is None:
            return self.buffer, 0.0
        start = time.perf_counter()
        blocked = not self.work.is_completed()
        self.work.wait()
        if self.on_wait is not None:
            self.on_wait(self.work)
        self.work = None
        return self.buffer, time.perf_counter() - start if blocked else 0.0


@dataclass
class PendingSend:
    work: dist.Work
    tensor: torch.Tensor  # kept referenced until the send is done: the backend reads it asynchronously
    on_complete: Optional[Callable[[], None]]
    waited: bool = False
    """Its work was waited for explicitly: done, whatever `Work.is_completed()` says (the fake backend's
    works never say so)."""


@dataclass
class PipelineComm:
    """Batched p2p on one pipeline group; peers are given as pipeline ranks."""

    group: Optional[dist.ProcessGroup]
    global_ranks: list[int]  # pipeline rank -> global rank
    pending: deque = field(default_factory=deque)
    wait_s: float = 0.0  # time blocked in send completion during drain (receives report their own)
    batched: Optional[bool] = None
    """Whether a batch must be posted as one group (NCCL); None: decided from the group's backend."""

    def __post_init__(self) -> None:
        if self.batched is None:
            self.batched = needs_batches(self.group)

    def post(
        self,
        sends: list[tuple[torch.Tensor, int, Optional[Callable[[], None]]]],
        recvs: list[tuple[torch.Tensor, int]],
    ) -> list[Transfer]:
        """Post sends (tensor, peer pp rank, callback run once the send is done) and receives (buffer,
        peer pp rank) of one batch: as one group where the backend needs it, else one by one. Returns one
        Transfer per receive, in order."""
        send_list = [(t, self.global_ranks[peer]) for t, peer, _ in sends]
        recv_list = [(buf, self.global_ranks[peer]) for buf, peer in recvs]
        if self.batched:
            works = post_batch(send_list, recv_list, self.group)
        else:
            works = [dist.isend(t, peer, group=self.group) for t, peer in send_list]
            works += [dist.irecv(buf, peer, group=self.group) for buf, peer in recv_list]
        for (tensor, _, callback), work in zip(sends, works[: len(sends)]):
            self.pending.append(PendingSend(work, tensor, callback))
            if completes_at_once(self.group):
                work.wait()  # the fake backend: done on posting; the explicit wait is what retires it
                self.pending[-1].waited = True
        return [Transfer(buf, work, self.note_waited) for (buf, _), work in zip(recvs, works[len(sends):])]

    def post_receive(self, buffer: torch.Tensor, peer: int) -> Transfer:
        """Post one receive from pipeline rank `peer` on its own, ahead of its batch. Only where batches
        are not needed (`batched` is False): the caller keeps the order of receives on each link."""
        if self.batched:
            raise RuntimeError("post_receive: this backend needs every receive posted with its batch")
        return Transfer(buffer, dist.irecv(buffer, self.global_ranks[peer], group=self.group))

    def note_waited(self, work: dist.Work) -> None:
        """`work` was waited for explicitly: the sends it carries are done, whatever `is_completed()` says."""
        for item in self.pending:
            if item.work is work:
                item.waited = True

    def poll(self) -> None:
        """Retire sends that have completed, oldest first, without blocking."""
        while self.pending and (self.pending[0].waited or self.pending[0].work.is_completed()):
            self._retire(self.pending.popleft())

    def drain(self) -> None:
        """Wait for every send still in flight (end of step)."""
        start = time.perf_counter()
        while self.pending:
            item = self.pending.popleft()
            item.work.wait()
            self._retire(item)
        self.wait_s += time.perf_counter() - start

    @staticmethod
    def _retire(item: PendingSend) -> None:
        if item.on_complete is not None:
            item.on_complete()


def post_batch(
    sends: Sequence[tuple[torch.Tensor, int]],
    recvs: Sequence[tuple[torch.Tensor, int]],
    group: Optional[dist.ProcessGroup],
) -> list[Optional[dist.Work]]:
    """Post `sends` then `recvs` ((tensor, global peer rank) each) over `group` as one batch; one work per
    operation, in order. NCCL may coalesce a batch into a single work: every member then shares it.

    On NCCL the group must have run a collective first (`warm_up`): torch leaves a first batch that does
    not involve every rank of its group undefined. `ParallelState` warms up every group it hands out for
    point-to-point (the pipeline group, BPipe's pair groups).
    """
    ops = [dist.P2POp(dist.isend, t, peer, group=group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group=group) for t, peer in recvs]
    works = dist.batch_isend_irecv(ops) if ops else []
    if len(works) != len(ops):
        works = [works[-1]] * len(ops) if works else [None] * len(ops)
    return list(works)


def needs_batches(group: Optional[dist.ProcessGroup]) -> bool:
    """Whether point-to-point on `group` is posted in groups (`comm.BackendNeeds.batched_p2p`: NCCL, the fake
    backend, any backend not known to take operations one by one); False on gloo and without a process group."""
    if not dist.is_initialized():
        return False
    return comm.backend_needs(group).batched_p2p


def completes_at_once(group: Optional[dist.ProcessGroup]) -> bool:
    """Whether operations on `group` are complete when posted (torch's `fake` backend, which the dry run
    uses: nothing moves, and its works never report completion)."""
    return dist.is_initialized() and comm.backend_needs(group).completes_at_once


def warm_up(group: Optional[dist.ProcessGroup], device: torch.device) -> None:
    """One tiny collective over `group`, so that its first batched point-to-point is not its first call.

    NCCL creates a communicator lazily at its first operation; a `batch_isend_irecv` that is first on its
    group must involve every rank of the group, which a pipeline's first receive (one peer) does not.
    Run on every backend so the CPU tests take the same path.
    """
    if group is None:
        return
    dist.all_reduce(torch.zeros(1, device=device), group=group)


def release_storage(tensor: torch.Tensor) -> None:
    """Free a tensor's data but keep its autograd node and shape.

    Used on a stage output once it has been sent downstream: backward only needs the node (the last op
    of a stage is a residual add, which saves nothing), and `torch.autograd.backward(out, grad)` checks
    the shape, so the data is swapped for a single element broadcast to the same shape.
    """
    tensor.data = torch.empty(1, dtype=tensor.dtype, device=tensor.device).expand(tensor.shape)
