"""Pipeline communication: which messages a schedule needs, how they pair up, and the pass that inserts them.

A generator emits compute only. `insert_communication` adds a SEND after every compute whose result goes
to another rank and a RECV before every compute whose input comes from another rank (and, for BPipe's
EVICT/LOAD, the partner's ACCEPT/RETURN: `bpipe.add_hosting`), then moves receives
earlier where needed: (1) so that every directed link (rank a -> rank b) receives in the order it sends,
since messages on a link match in posting order whatever their kind, and (2) so that the lists cannot
deadlock under blocking (rendezvous) semantics with the batching rule of `ir` (consecutive communication
actions form one batch that completes as a unit). A send placed right after F and a receive right before
the next B are adjacent and so already batch as Megatron's `send_forward_recv_backward`; a receive is
hoisted further only when the rendezvous replay finds a send blocked on it, into the batch where its rank
is waiting anyway, so no receive is posted earlier than it must be. The replay used for that is the one
the validator runs (`RendezvousReplay`).
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass

from megatron_pp.schedules.ir import (COMM_OPS, HOSTING_OPS, PARTNER_OP, SEND_OPS, SIDE_OPS, Action, Op, Schedule,
                                      ScheduleError)

Message = tuple[str, int, int]
"""What travels on a link: ("F" activation | "B" gradient, microbatch, global stage that produced it)."""
Link = tuple
"""A directed pipeline link (sending rank, receiving rank); a BPipe parking link also names its group
(sending rank, receiving rank, "EVICT" or "LOAD")."""
PARKING_SENDS = frozenset({Op.EVICT, Op.RETURN})
"""The sending side of each parking link (EVICT -> ACCEPT, RETURN -> LOAD)."""
HOIST_TO_SEND_ONLY_BATCHES = "hoist_to_send_only_batches"
"""Schedule option: when a receive must be hoisted, prefer a peer blocked in a batch without receives
(see `RendezvousReplay.hoist_receive`)."""


def forward_neighbours(schedule: Schedule, rank: int, chunk: int) -> tuple[int | None, int | None]:
    """(rank holding the previous stage, rank holding the next stage) of (rank, chunk), each None when
    there is no such stage or it sits on the same rank (then tensors are handed over in memory)."""
    stage = schedule.stage_of(rank, chunk)
    prev_rank = schedule.location(stage - 1)[0] if stage > 0 else None
    next_rank = schedule.location(stage + 1)[0] if stage + 1 < schedule.num_stages else None
    return (None if prev_rank == rank else prev_rank), (None if next_rank == rank else next_rank)


def expected_peer(schedule: Schedule, rank: int, action: Action) -> int | None:
    """The only rank a communication action of (rank, action.chunk) may talk to, or None if it needs none."""
    prev_rank, next_rank = forward_neighbours(schedule, rank, action.chunk)
    # Activations flow to the next stage; gradients flow back, so RECV_B comes from the next stage too.
    return {Op.SEND_F: next_rank, Op.RECV_B: next_rank, Op.RECV_F: prev_rank, Op.SEND_B: prev_rank}[action.op]


def message_of(schedule: Schedule, rank: int, action: Action) -> Message:
    """The message a communication action sends or receives, named the same way on both ends."""
    stage = schedule.stage_of(rank, action.chunk)
    producer = {Op.SEND_F: stage, Op.SEND_B: stage, Op.RECV_F: stage - 1, Op.RECV_B: stage + 1}[action.op]
    return ("F" if action.op in (Op.SEND_F, Op.RECV_F) else "B", action.microbatch, producer)


def link_of(rank: int, action: Action) -> Link:
    if action.op in PARTNER_OP:  # BPipe parking: its own group per pair and direction
        kind = "EVICT" if action.op in (Op.EVICT, Op.ACCEPT) else "LOAD"
        return (rank, action.peer, kind) if action.op in PARKING_SENDS else (action.peer, rank, kind)
    return (rank, action.peer) if action.op in SEND_OPS else (action.peer, rank)


Slot = tuple[Link, bool, int]
"""Where a communication action sits on its link: (link, is it the sending side, position on that side)."""


def link_slots(actions: list[list[Action]], parking: bool = False) -> list[list[Slot | None]]:
    """Per rank and action, its `Slot` (None for non-communication; with `parking`, BPipe's EVICT, ACCEPT,
    LOAD and RETURN get slots on their parking links too). The k-th send and the k-th receive on a link
    are partners: NCCL and gloo match point-to-point messages between two ranks in posting order."""
    slots: list[list[Slot | None]] = []
    for rank, acts in enumerate(actions):
        seen: dict[tuple[Link, bool], int] = defaultdict(int)
        row: list[Slot | None] = []
        for a in acts:
            if a.op in COMM_OPS or (parking and a.op in PARTNER_OP):
                key = (link_of(rank, a), a.op in SEND_OPS or a.op in PARKING_SENDS)
                row.append((*key, seen[key]))
                seen[key] += 1
            else:
                row.append(None)
        slots.append(row)
    return slots


@dataclass(frozen=True)
class Blocked:
    """A rank stuck in a batch: the batch's first index and the members whose partner is not posted."""

    rank: int
    index: int
    waiting: tuple[tuple[int, Action], ...]

    def describe(self) -> str:
        members = ", ".join(f"{a} (action {i})" for i, a in self.waiting)
        return f"rank {self.rank}, action {self.index}: blocked on {members}"


class RendezvousReplay:
    """Replays every rank's list under blocking semantics: a posted send or receive is matched once the
    peer has posted its partner (the same position on the same directed link), and a rank leaves a batch
    only when all its members are matched. Compute never blocks here: its inputs arrived through receives
    that completed before it. The lists must already agree on every link (see `validate`).

    With `parking`, BPipe's EVICT/ACCEPT and LOAD/RETURN take part too, each a batch of its own that
    blocks until its partner is posted: the strictest reading of NCCL, where every operation may hold its
    rank's device queue until the peer joins (one hardware queue, `CUDA_DEVICE_MAX_CONNECTIONS=1`)."""

    def __init__(self, actions: list[list[Action]], prefer_send_only_batches: bool = False, parking: bool = False):
        self.actions = actions
        self.prefer_send_only_batches = prefer_send_only_batches
        self.slots = link_slots(actions, parking)
        self.pos = [0] * len(actions)
        self.batch_end: list[int | None] = [None] * len(actions)
        self.posted: dict[tuple[Link, bool], int] = defaultdict(int)

    def _matched(self, slot: Slot) -> bool:
        link, is_send, k = slot
        return self.posted[link, not is_send] > k

    def run(self) -> list[Blocked]:
        """Advance every rank as far as possible; return the blocked ranks (empty when all finished)."""
        progress = True
        while progress:
            progress = False
            for rank, acts in enumerate(self.actions):
                slots = self.slots[rank]
                while self.pos[rank] < len(acts):
                    i = self.pos[rank]
                    if slots[i] is None:
                        self.pos[rank] = i + 1
                        progress = True
                        continue
                    if self.batch_end[rank] is None:
                        j = i + 1
                        if acts[i].op in COMM_OPS:  # a parking action is a batch of its own
                            while j < len(acts) and acts[j].op in COMM_OPS:
                                j += 1
                        for link, is_send, _ in slots[i:j]:
                            self.posted[link, is_send] += 1
                        self.batch_end[rank] = j
                        progress = True
                    end = self.batch_end[rank]
                    if not all(self._matched(slots[j]) for j in range(i, end)):
                        break
                    self.pos[rank], self.batch_end[rank] = end, None
                    progress = True
        return [self._blocked(rank) for rank, acts in enumerate(self.actions) if self.pos[rank] < len(acts)]

    def _blocked(self, rank: int) -> Blocked:
        i, end = self.pos[rank], self.batch_end[rank]
        waiting = tuple((j, self.actions[rank][j]) for j in range(i, end)
                        if not self._matched(self.slots[rank][j]))
        return Blocked(rank, i, waiting)

    def hoist_receive(self, blocked: list[Blocked]) -> bool:
        """Move the receive that one blocked send waits for into the batch where its rank is blocked.

        Legal because a receive may be posted any time before its consumer, and order-preserving on the
        link because every earlier receive on it is already posted. Returns False when no blocked send
        exists, i.e. every stuck rank waits for data that is never produced: a true deadlock.

        The first blocked send wins, or, with `prefer_send_only_batches`, the first whose peer is blocked
        in a batch without receives: a compute waits for every receive of its batch, so the moved receive
        delays nothing there. A ring that closes on itself needs that (looped-bfs: rank 0 then posts the
        receives from rank p−1 beside its own sends instead of rank 1 batching two receives and waiting
        for both). It is a schedule option (`HOIST_TO_SEND_ONLY_BATCHES`) so that other lists stay as they
        were; it never lengthened a simulated makespan of the built-in schedules (p ≤ 8, m ≤ 16, v ≤ 4)
        and shortens some (GIS p=4, m=8, v=4: 113 -> 104).
        """
        candidates = [(stuck.rank, index, action) for stuck in blocked for index, action in stuck.waiting
                      if action.op in SEND_OPS]
        if not candidates:
            return False
        rank, index, action = candidates[0]
        if self.prefer_send_only_batches:
            rank, index, action = next((c for c in candidates if not self._batch_receives(c[2].peer)), candidates[0])
        peer = action.peer
        link, _, k = self.slots[rank][index]
        peer_slots = self.slots[peer]
        j = peer_slots.index((link, False, k))
        end = self.batch_end[peer]
        moved, slot = self.actions[peer].pop(j), peer_slots.pop(j)
        self.actions[peer].insert(end, moved)
        peer_slots.insert(end, slot)
        self.batch_end[peer] = end + 1
        self.posted[link, False] += 1
        return True

    def _batch_receives(self, rank: int) -> bool:
        """Whether the batch `rank` is blocked in holds a receive."""
        return any(not self.slots[rank][i][1] for i in range(self.pos[rank], self.batch_end[rank]))


def insert_communication(schedule: Schedule) -> Schedule:
    """Return a copy of a compute-only `schedule` with SEND_*/RECV_* actions inserted (see module docstring).

    Raises ScheduleError when a compute needs a message that no rank produces, or when the compute order
    itself deadlocks (some rank waits for data that can only come after it proceeds).
    """
    p = schedule.num_ranks
    for rank, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            if a.op in COMM_OPS or a.op in HOSTING_OPS:
                raise ScheduleError(f"rank {rank}, action {i} ({a}): schedule {schedule.name!r} already has "
                                    "communication; insert_communication expects compute-only lists")
    sends_after: list[dict[int, list[Action]]] = [defaultdict(list) for _ in range(p)]
    # Per link, in the sender's order: (message, index of its producer in the sender's compute list).
    sent: dict[Link, list[tuple[Message, int]]] = defaultdict(list)
    # Receiving side: message -> (index of its consumer in the compute list, the RECV action).
    wanted: dict[Link, dict[Message, tuple[int, Action]]] = defaultdict(dict)
    for rank, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            if a.op is Op.F:
                prev_rank, next_rank = forward_neighbours(schedule, rank, a.chunk)
                needed = ((Op.RECV_F, prev_rank), (Op.SEND_F, next_rank))
            elif a.op in (Op.B, Op.BI):  # BI produces the input gradient; BW sends nothing
                prev_rank, next_rank = forward_neighbours(schedule, rank, a.chunk)
                needed = ((Op.RECV_B, next_rank), (Op.SEND_B, prev_rank))
            else:
                continue
            for op, peer in needed:
                if peer is None:
                    continue
                comm = Action(op, a.microbatch, a.chunk, peer)
                if op in SEND_OPS:
                    sends_after[rank][i].append(comm)
                    sent[rank, peer].append((message_of(schedule, rank, comm), i))
                else:
                    wanted[peer, rank][message_of(schedule, rank, comm)] = (i, comm)

    recvs_before: list[dict[int, list[Action]]] = [defaultdict(list) for _ in range(p)]
    for link in sorted(set(sent) | set(wanted)):
        src, dst = link
        order, needs = sent.get(link, []), wanted.get(link, {})
        for message, i in order:
            if message not in needs:
                raise ScheduleError(f"rank {src}, action {i} ({schedule.actions[src][i]}): its result goes to rank "
                                    f"{dst}, which never runs the action that consumes it")
        produced = {message for message, _ in order}
        for message, (i, recv) in needs.items():
            if message not in produced:
                raise ScheduleError(f"rank {dst}, action {i} ({schedule.actions[dst][i]}): needs {recv}, but rank "
                                    f"{src} never produces that message")
        # Receive in the sender's order: a message consumed late is received no later than any message the
        # sender posts after it (suffix minimum of the consumer positions).
        placed: list[tuple[int, Action]] = []
        latest = None
        for message, _ in reversed(order):
            consumer, recv = needs[message]
            latest = consumer if latest is None else min(latest, consumer)
            placed.append((latest, recv))
        for at, recv in reversed(placed):
            recvs_before[dst][at].append(recv)

    lists: list[list[Action]] = []
    for rank, acts in enumerate(schedule.actions):
        out: list[Action] = []
        sends: list[Action] = []
        for i, a in enumerate(acts):
            # Stash transfers issued after a compute go before its sends, so that they never split the
            # batch of those sends with the next compute's receives (the pairing that avoids deadlocks).
            if a.op not in SIDE_OPS:
                out += sends
                sends = []
            out += recvs_before[rank].get(i, [])
            out.append(a)
            sends += sends_after[rank].get(i, [])
        lists.append(out + sends)

    replay = RendezvousReplay(lists, bool(schedule.options.get(HOIST_TO_SEND_ONLY_BATCHES)))
    while blocked := replay.run():
        if not replay.hoist_receive(blocked):
            raise ScheduleError(f"schedule {schedule.name!r} deadlocks: "
                                + "; ".join(b.describe() for b in blocked))
    with_comm = dataclasses.replace(schedule, actions=lists)
    if any(a.op in PARTNER_OP for acts in lists for a in acts):
        from megatron_pp.schedules.bpipe import add_hosting  # the acceptor's side of BPipe's parking

        with_comm = add_hosting(with_comm)
    return with_comm
