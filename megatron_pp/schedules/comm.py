"""Pipeline communication: which messages a schedule needs, how they pair up, and the pass that inserts them.

A generator emits compute only. `insert_communication` adds a SEND after every compute whose result goes
to another rank and a RECV before every compute whose input comes from another rank, then moves receives
earlier where needed: (1) so that every directed link (rank a -> rank b) receives in the order it sends,
since messages on a link match in posting order whatever their kind, and (2) so that the lists cannot
deadlock under blocking (rendezvous) semantics with the batching rule of `ir` (consecutive communication
actions form one batch that completes as a unit). A send placed right after F and a receive right before
the next B are adjacent and so already batch as Megatron's `send_forward_recv_backward`; a receive is
hoisted further only when the rendezvous replay finds a send blocked on it, into the batch where its rank
is waiting anyway, so no receive is posted earlier than it must be. The replay used for that is the one
the validator runs (`RendezvousReplay`).

Last, it runs the passes registered with `register_communication_pass` for the operations the lists contain.
This pass knows no schedule by name: a schedule whose actions need more than sends and receives (BPipe's
EVICT/LOAD need the partner's ACCEPT/RETURN, placed by `bpipe.add_hosting`) registers its pass for those
operations, the way a plugin would.
"""
from __future__ import annotations

import dataclasses
import heapq
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from megatron_pp.schedules.ir import (COMM_OPS, HOSTING_OPS, PARTNER_OP, SEND_OPS, SIDE_OPS, Action, Op, Schedule,
                                      ScheduleError, whole_schedule_pass)

Message = tuple[str, int, int]
"""What travels on a link: ("F" activation | "B" gradient, microbatch, global stage that produced it)."""
Link = tuple
"""A directed pipeline link (sending rank, receiving rank); a BPipe parking link also names its group
(sending rank, receiving rank, "EVICT" or "LOAD")."""
PARKING_SENDS = frozenset({Op.EVICT, Op.RETURN})

CommunicationPass = Callable[[Schedule], Schedule]
_PASSES_AFTER_COMMUNICATION: list[tuple[frozenset[Op], CommunicationPass]] = []


def register_communication_pass(ops: frozenset[Op] | set[Op], pass_fn: CommunicationPass) -> None:
    """Run `pass_fn` at the end of every `insert_communication` whose input contains one of `ops`.

    Passes run in registration order on the lists with their sends and receives in place; each returns the
    schedule it was given or a rewritten copy. Registering the same (ops, pass) again is a no-op, so a module
    imported twice (a plugin file reloaded) registers once.
    """
    entry = (frozenset(ops), pass_fn)
    if not entry[0]:
        raise ValueError("register_communication_pass: name at least one operation that triggers the pass")
    if entry not in _PASSES_AFTER_COMMUNICATION:
        _PASSES_AFTER_COMMUNICATION.append(entry)
"""The sending side of each parking link (EVICT -> ACCEPT, RETURN -> LOAD)."""
HOIST_TO_SEND_ONLY_BATCHES = "hoist_to_send_only_batches"
"""Schedule option: when a receive must be hoisted, prefer a peer blocked in a batch without receives
(see `RendezvousReplay.hoist_receive`)."""


def forward_neighbours(schedule: Schedule, rank: int, chunk: int) -> tuple[int | None, int | None]:
    """(rank holding the previous stage, rank holding the next stage) of (rank, chunk), each None when
    there is no such stage or it sits on the same rank (then tensors are handed over in memory)."""
    return schedule.neighbour_ranks(rank, chunk)


def expected_peer(schedule: Schedule, rank: int, action: Action) -> int | None:
    """The only rank a communication action of (rank, action.chunk) may talk to, or None if it needs none."""
    prev_rank, next_rank = schedule.neighbour_ranks(rank, action.chunk)
    # Activations flow to the next stage; gradients flow back, so RECV_B comes from the next stage too.
    return next_rank if action.op is Op.SEND_F or action.op is Op.RECV_B else prev_rank


PRODUCER_OFFSET = {Op.SEND_F: ("F", 0), Op.SEND_B: ("B", 0), Op.RECV_F: ("F", -1), Op.RECV_B: ("B", 1)}
"""Communication op -> (kind of its `Message`, producing stage relative to the stage of the action's chunk):
the message a send or receive carries, named the same way on both ends."""


def link_of(rank: int, action: Action) -> Link:
    if action.op in PARTNER_OP:  # BPipe parking: its own group per pair and direction
        kind = "EVICT" if action.op in (Op.EVICT, Op.ACCEPT) else "LOAD"
        return (rank, action.peer, kind) if action.op in PARKING_SENDS else (action.peer, rank, kind)
    return (rank, action.peer) if action.op in SEND_OPS else (action.peer, rank)


Side = tuple[int, int, int, bool]
"""Where a communication action sits on its link, in numbers for the replays' inner loops: (its side of the
link: 2l sends on link l and 2l+1 receives, links numbered in order of first appearance, so a side's
partner is `side ^ 1`; its position k on that side; the rank at the other end; whether it is a pipeline
transfer, which batches with its neighbours, rather than a parking one, a batch of its own)."""

# Op -> whether it is the sending side of its link, for the ops `link_sides` places on a link.
_PIPELINE_SIDES = {op: op in SEND_OPS for op in COMM_OPS}
_ALL_SIDES = {**_PIPELINE_SIDES, **{op: op in PARKING_SENDS for op in PARTNER_OP}}


def link_sides(actions: list[list[Action]], parking: bool = False) -> tuple[list[list[Side | None]], int]:
    """Per rank and action, its `Side` (None for non-communication; with `parking`, BPipe's EVICT, ACCEPT,
    LOAD and RETURN get sides on their parking links too), and the number of links. The k-th send and the
    k-th receive on a link are partners: NCCL and gloo match point-to-point messages between two ranks in
    posting order."""
    sending = _ALL_SIDES if parking else _PIPELINE_SIDES
    link_ids: dict[Link, int] = {}
    sides: list[list[Side | None]] = []
    for rank, acts in enumerate(actions):
        # (peer, op) -> [side, messages so far, peer, pipeline?]: on one rank, an op and a peer name the link.
        seen: dict[tuple[int, Op], list] = {}
        row: list[Side | None] = []
        for a in acts:
            is_send = sending.get(a.op)
            if is_send is None:
                row.append(None)
                continue
            entry = seen.get((a.peer, a.op))
            if entry is None:
                side = 2 * link_ids.setdefault(link_of(rank, a), len(link_ids)) + (not is_send)
                # Ops on the same side of the same link (SEND_F and SEND_B) share one counter.
                entry = next((e for e in seen.values() if e[0] == side), None) or [side, 0, a.peer, a.op in COMM_OPS]
                seen[a.peer, a.op] = entry
            row.append((entry[0], entry[1], entry[2], entry[3]))
            entry[1] += 1
        sides.append(row)
    return sides, len(link_ids)


@dataclass(frozen=True)
class Blocked:
    """A rank stuck in a batch: the batch's first index and the members whose partner is not posted."""

    rank: int
    index: int
    waiting: tuple[tuple[int, Action], ...]

    def describe(self) -> str:
        members = ", ".join(f"{a} (action {i})" for i, a in self.waiting)
        return f"rank {self.rank}, action {self.index}: blocked on {members}"


class Wakeups:
    """Which rank a replay advances next: only ranks a posting may have unblocked, in the order that
    repeated passes over ranks 0..p-1 would reach them (a rank woken by a higher rank waits for the next
    pass). Replays built on it do work proportional to the actions, not to passes x ranks, and still
    visit ranks in exactly the order of the pass loop, so anything a replay records across ranks (the
    simulator's stash events on a BPipe partner) comes out in the same order."""

    def __init__(self, num_ranks: int):
        self._heap = [(0, rank) for rank in range(num_ranks)]  # (pass, rank); sorted, hence a heap
        self._queued = [True] * num_ranks
        self._pass, self._rank = 0, -1

    def wake(self, rank: int) -> None:
        if not self._queued[rank]:
            self._queued[rank] = True
            heapq.heappush(self._heap, (self._pass if rank > self._rank else self._pass + 1, rank))

    def next(self) -> int | None:
        """The next rank to advance, or None when no rank can move."""
        if not self._heap:
            return None
        self._pass, self._rank = heapq.heappop(self._heap)
        self._queued[self._rank] = False
        return self._rank

    def restart(self) -> None:
        """Begin a new round of passes (after the lists changed between two replays)."""
        self._pass, self._rank = 0, -1


class RendezvousReplay:
    """Replays every rank's list under blocking semantics: a posted send or receive is matched once the
    peer has posted its partner (the same position on the same directed link), and a rank leaves a batch
    only when all its members are matched. Compute never blocks here: its inputs arrived through receives
    that completed before it. The lists must already agree on every link (see `validate`).

    Only a posting on one of its links can unblock a rank, so a posting wakes the rank at the link's
    other end (`Wakeups`) and nothing else is looked at again. `work` counts rank visits, batch members
    checked and ranks looked at between hoists; it stays proportional to the communication actions.

    With `parking`, BPipe's EVICT/ACCEPT and LOAD/RETURN take part too, each a batch of its own that
    blocks until its partner is posted: the strictest reading of NCCL, where every operation may hold its
    rank's device queue until the peer joins (one hardware queue, `CUDA_DEVICE_MAX_CONNECTIONS=1`)."""

    def __init__(self, actions: list[list[Action]], prefer_send_only_batches: bool = False, parking: bool = False):
        self.actions = actions
        self.prefer_send_only_batches = prefer_send_only_batches
        self._sides, num_links = link_sides(actions, parking)
        # How many actions each side of each link has posted, indexed by side: the hot loop indexes a list
        # instead of hashing (link, is_send) keys.
        self._posted = [0] * (2 * num_links)
        self._side_index: dict[int, dict[tuple[int, int], int]] = {}  # per rank, built when a roll-back needs it
        self.pos = [0] * len(actions)
        self.batch_end: list[int | None] = [None] * len(actions)
        self.wakeups = Wakeups(len(actions))
        self.work = 0

    def _matched(self, side: Side) -> bool:
        return self._posted[side[0] ^ 1] > side[1]

    def run(self) -> list[Blocked]:
        """Advance every rank as far as possible; return the blocked ranks (empty when all finished)."""
        return [] if self.settle() else self.blocked()

    def settle(self) -> bool:
        """Advance every rank as far as possible; True when every rank reached the end of its list."""
        actions, all_sides, posted, batch_end, pos = self.actions, self._sides, self._posted, self.batch_end, self.pos
        wakeups = self.wakeups
        queued, wake = wakeups._queued, wakeups.wake  # `wake` does nothing for a queued rank: skip the call
        work = 0
        # Advance each rank the wake-ups name as far as it goes: post a batch (waking the peers), leave it
        # once every member's partner is posted, run what follows; stop in a batch that still waits.
        while (rank := wakeups.next()) is not None:
            sides = all_sides[rank]
            i, n = pos[rank], len(sides)
            work += 1
            while i < n:
                if sides[i] is None:
                    i += 1
                    continue
                end = batch_end[rank]
                if end is None:
                    end = i
                    while end < n and (side := sides[end]) is not None:
                        posted[side[0]] += 1
                        if not queued[side[2]]:
                            wake(side[2])
                        end += 1
                        # A parking action (with `parking`) is a batch of its own.
                        if not side[3] or (end < n and sides[end] is not None and not sides[end][3]):
                            break
                    batch_end[rank] = end
                for j in range(i, end):
                    work += 1
                    side = sides[j]
                    if posted[side[0] ^ 1] <= side[1]:
                        break
                else:
                    i, batch_end[rank] = end, None
                    continue
                break
            pos[rank] = i
        wakeups.restart()
        self.work += work + len(actions)
        return all(pos[rank] == len(acts) for rank, acts in enumerate(actions))

    def blocked(self) -> list[Blocked]:
        """The ranks that have not reached the end of their list, each with what it waits for."""
        return [self._blocked(rank) for rank, acts in enumerate(self.actions) if self.pos[rank] < len(acts)]

    def replace(self, changed: dict[int, tuple[int, list[Action]]]) -> None:
        """Rewrite part of some lists and go on from the current state instead of replaying from scratch.

        `changed[rank] = (start, window)` puts `window` in place of as many actions from `start` on: the
        same actions reordered, each keeping its place on its link (its `Side`), as when BPipe moves an
        acceptor's hosting action past others. Exact: a replay's end state does not depend on the order
        ranks advance in (postings only grow, and a rank's progress only grows with them), so settling from
        any state that the new lists can reach ends where a fresh replay would. Such a state is made by
        rolling back: a changed rank to the batch where its list first differs (where it got that far), and
        every rank that got past a batch by a posting so withdrawn to that batch, and so on. The work is the
        windows and the rolled-back part, not the lists.
        """
        undo: list[tuple[int, int]] = []
        for rank, (start, window) in changed.items():
            old = self.actions[rank]
            first = next((start + j for j, a in enumerate(window) if old[start + j] != a), start + len(window))
            self.work += first - start + 1
            if first < start + len(window) and first <= self._posted_end(rank):
                undo.append((rank, self._batch_start(rank, min(first, self.pos[rank]))))
        while undo:
            rank, at = undo.pop()
            self._roll_back(rank, at, undo)
        for rank, (start, window) in changed.items():
            end = start + len(window)
            acts, sides = self.actions[rank], self._sides[rank]
            side_of = dict(zip(acts[start:end], sides[start:end]))
            acts[start:end] = window
            sides[start:end] = [side_of[a] for a in window]
            index = self._side_index.get(rank)
            if index is not None:
                index.update((sides[j][:2], j) for j in range(start, end) if sides[j] is not None)
            self.work += len(window)
            self.wakeups.wake(rank)

    def _posted_end(self, rank: int) -> int:
        """One past the last action `rank` has posted or passed."""
        end = self.batch_end[rank]
        return self.pos[rank] if end is None else end

    def _batch_start(self, rank: int, index: int) -> int:
        """The start of the run of pipeline transfers just before `index` (`index` where there is none): the
        batch that holds it, or one that a changed action at `index` could join; at most one batch early."""
        sides = self._sides[rank]
        while index > 0 and sides[index - 1] is not None and sides[index - 1][3]:
            index -= 1
            self.work += 1
        return index

    def _roll_back(self, rank: int, start: int, undo: list[tuple[int, int]]) -> None:
        """Withdraw what `rank` posted from `start` on and put it back there; queue the peers that got past a
        batch with one of those postings."""
        end = self._posted_end(rank)
        if start >= end and start >= self.pos[rank]:
            return
        sides = self._sides[rank]
        for j in range(start, end):
            self.work += 1
            side = sides[j]
            if side is None:
                continue
            self._posted[side[0]] -= 1  # the rank's latest on this link: it posts in list order
            if self._matched(side):  # the peer posted the partner and may be past it
                peer = side[2]
                index = self._index_of(peer)[side[0] ^ 1, side[1]]
                if index < self.pos[peer]:
                    undo.append((peer, self._batch_start(peer, index)))
        self.pos[rank], self.batch_end[rank] = start, None
        self.wakeups.wake(rank)

    def _index_of(self, rank: int) -> dict[tuple[int, int], int]:
        """(side, position on it) -> index in `rank`'s list."""
        if rank not in self._side_index:
            self._side_index[rank] = {side[:2]: j for j, side in enumerate(self._sides[rank]) if side is not None}
            self.work += len(self._sides[rank])
        return self._side_index[rank]

    def _blocked(self, rank: int) -> Blocked:
        i, end = self.pos[rank], self.batch_end[rank]
        waiting = tuple((j, self.actions[rank][j]) for j in range(i, end)
                        if not self._matched(self._sides[rank][j]))
        return Blocked(rank, i, waiting)

    def _blocked_sends(self):
        """(rank, index) of every send that waits for its receive, by rank then index; lazily, since the
        hoisting pass mostly needs only the first."""
        for rank, acts in enumerate(self.actions):
            end = self.batch_end[rank]
            self.work += 1
            if end is None:
                continue
            for j in range(self.pos[rank], end):
                side = self._sides[rank][j]
                if side[0] % 2 == 0 and not self._matched(side):
                    yield rank, j

    def hoist_receive(self) -> bool:
        """Move the receive that one blocked send waits for into the batch where its rank is blocked.

        Legal because a receive may be posted any time before its consumer, and order-preserving on the
        link because every earlier receive on it is already posted. Returns False when no blocked send
        exists, i.e. every stuck rank waits for data that is never produced: a true deadlock.

        The first blocked send wins, or, with `prefer_send_only_batches`, the first whose peer is blocked
        in a batch without receives: a compute waits for every receive of its batch, so the moved receive
        delays nothing there. A ring that closes on itself needs that (looped-bfs: rank 0 then posts the
        receives from rank p−1 beside its own sends instead of rank 1 batching two receives and waiting
        for both). It is a schedule option (`HOIST_TO_SEND_ONLY_BATCHES`) so that other lists stay as they
        were. It matters where a batch completes as a unit (NCCL's coalesced batches): there it never
        lengthened a makespan of the built-in schedules (p ≤ 8, m ≤ 16, v ≤ 4) and shortens some (GIS
        p=4, m=8, v=4: 113 -> 104, simulated with batch-wide completion). Where each receive completes
        on its own (gloo, and the simulator) the two placements time the same.
        """
        candidates = self._blocked_sends()
        first = next(candidates, None)
        if first is None:
            return False
        rank, index = first
        if self.prefer_send_only_batches:
            rank, index = next((c for c in (first, *candidates)
                                if not self._batch_receives(self.actions[c[0]][c[1]].peer)), first)
        peer = self.actions[rank][index].peer
        sent, k, _, _ = self._sides[rank][index]
        peer_acts, peer_sides = self.actions[peer], self._sides[peer]
        end = self.batch_end[peer]
        j = peer_sides.index((sent ^ 1, k, rank, True), end)  # not posted yet, so after the peer's batch
        # Rotate [end, j] by one in place: the work is the distance moved, not the list's length.
        for seq in (peer_acts, peer_sides):
            seq[end:j + 1] = [seq[j]] + seq[end:j]
        self.batch_end[peer] = end + 1
        self._posted[sent ^ 1] += 1
        self.wakeups.wake(rank)
        self.wakeups.wake(peer)
        return True

    def _batch_receives(self, rank: int) -> bool:
        """Whether the batch `rank` is blocked in holds a receive."""
        return any(self._sides[rank][i][0] % 2 for i in range(self.pos[rank], self.batch_end[rank]))


_INSERTED_OPS = COMM_OPS | HOSTING_OPS
"""What `insert_communication` adds, so what its input must not hold."""


def _receive(message: Message, chunk: int, source: int) -> Action:
    """The RECV of `message` from rank `source` for the consumer on local `chunk`."""
    kind, microbatch, _ = message
    return Action(Op.RECV_F if kind == "F" else Op.RECV_B, microbatch, chunk, source)


@whole_schedule_pass
def insert_communication(schedule: Schedule) -> Schedule:
    """Return a copy of a compute-only `schedule` with SEND_*/RECV_* actions inserted (see module docstring).

    Raises ScheduleError when a compute needs a message that no rank produces, or when the compute order
    itself deadlocks (some rank waits for data that can only come after it proceeds).
    """
    present = _compute_only_ops(schedule)
    sends_after, sent, wanted = _messages(schedule)
    lists = _merge(schedule, _receives_before(schedule, sent, wanted), sends_after)
    replay = RendezvousReplay(lists, bool(schedule.options.get(HOIST_TO_SEND_ONLY_BATCHES)))
    while not replay.settle():
        if not replay.hoist_receive():
            raise ScheduleError(f"schedule {schedule.name!r} deadlocks: "
                                + "; ".join(b.describe() for b in replay.blocked()))
    return _passes_after_communication(dataclasses.replace(schedule, actions=lists), present, schedule.name)


def _compute_only_ops(schedule: Schedule) -> set[Op]:
    """The operations of a compute-only input (for the passes registered after communication); a list that
    already communicates is refused."""
    present: set[Op] = set()
    for rank, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            if a.op in _INSERTED_OPS:
                raise ScheduleError(f"rank {rank}, action {i} ({a}): schedule {schedule.name!r} already has "
                                    "communication; insert_communication expects compute-only lists")
            present.add(a.op)
    return present


def _messages(schedule: Schedule) -> tuple[list[dict[int, Action]], dict, dict]:
    """Who sends what to whom: per rank, the SEND after each producing compute (a compute sends to one
    rank at most); per link, in the sender's order, (message, index of its producer in the sender's list);
    and on the receiving side, message -> (index of its consumer, its chunk)."""
    sends_after: list[dict[int, Action]] = [{} for _ in range(schedule.num_ranks)]
    sent: dict[Link, list[tuple[Message, int]]] = defaultdict(list)
    wanted: dict[Link, dict[Message, tuple[int, int]]] = defaultdict(dict)
    for rank, acts in enumerate(schedule.actions):
        chunks: dict[int, tuple[int | None, int | None, int]] = {}  # chunk -> (prev rank, next rank, stage)
        for i, a in enumerate(acts):
            if a.op is Op.F:
                kind, send_op, towards = "F", Op.SEND_F, 1
            elif a.op is Op.B or a.op is Op.BI:  # BI produces the input gradient; BW sends nothing
                kind, send_op, towards = "B", Op.SEND_B, -1
            else:
                continue
            if a.chunk not in chunks:
                chunks[a.chunk] = (*schedule.neighbour_ranks(rank, a.chunk), schedule.stage_of(rank, a.chunk))
            prev_rank, next_rank, stage = chunks[a.chunk]
            source, target = (prev_rank, next_rank) if towards == 1 else (next_rank, prev_rank)
            if source is not None:  # message named as in `PRODUCER_OFFSET`: the stage that produced it
                wanted[source, rank][kind, a.microbatch, stage - towards] = (i, a.chunk)
            if target is not None:
                sends_after[rank][i] = Action(send_op, a.microbatch, a.chunk, target)
                sent[rank, target].append(((kind, a.microbatch, stage), i))
    return sends_after, sent, wanted


def _receives_before(schedule: Schedule, sent: dict, wanted: dict) -> list[dict[int, list[Action]]]:
    """Per rank, the RECVs to place before each compute: every message of a link received in the sender's
    order, no later than its consumer; a message produced but never consumed, or consumed but never
    produced, is an error naming both ends."""
    recvs_before: list[dict[int, list[Action]]] = [defaultdict(list) for _ in range(schedule.num_ranks)]
    for link in sorted(set(sent) | set(wanted)):
        src, dst = link
        order, needs = sent.get(link, []), wanted.get(link, {})
        for message, i in order:
            if message not in needs:
                raise ScheduleError(f"rank {src}, action {i} ({schedule.actions[src][i]}): its result goes to rank "
                                    f"{dst}, which never runs the action that consumes it")
        produced = {message for message, _ in order}
        for message, (i, chunk) in needs.items():
            if message not in produced:
                raise ScheduleError(f"rank {dst}, action {i} ({schedule.actions[dst][i]}): needs "
                                    f"{_receive(message, chunk, src)}, but rank {src} never produces that message")
        # Receive in the sender's order: a message consumed late is received no later than any message the
        # sender posts after it (suffix minimum of the consumer positions).
        at = [needs[message][0] for message, _ in order]
        for k in range(len(at) - 2, -1, -1):
            at[k] = min(at[k], at[k + 1])
        for (message, _), consumer_at in zip(order, at):
            recvs_before[dst][consumer_at].append(_receive(message, needs[message][1], src))
    return recvs_before


def _merge(schedule: Schedule, recvs_before: list, sends_after: list) -> list[list[Action]]:
    """Each rank's list with its receives before their computes and its sends after them. Stash transfers
    issued after a compute go before its sends, so that they never split the batch of those sends with the
    next compute's receives (the pairing that avoids deadlocks)."""
    lists: list[list[Action]] = []
    for rank, acts in enumerate(schedule.actions):
        out: list[Action] = []
        sends: list[Action] = []
        receives, sends_of = recvs_before[rank], sends_after[rank]
        for i, a in enumerate(acts):
            if a.op not in SIDE_OPS:
                out += sends
                sends = []
            if i in receives:
                out += receives[i]
            out.append(a)
            if i in sends_of:
                sends.append(sends_of[i])
        lists.append(out + sends)
    return lists


def _passes_after_communication(with_comm: Schedule, present: set[Op], name: str) -> Schedule:
    """Run the registered passes whose operations the input has (BPipe's hosting, a plugin's); an operation
    with a partner side that no pass placed is an error."""
    handled: set[Op] = set()
    for ops, pass_fn in _PASSES_AFTER_COMMUNICATION:
        if ops & present:
            with_comm = pass_fn(with_comm)
            handled |= ops
    unhandled = (present & set(PARTNER_OP)) - handled
    if unhandled:
        raise ScheduleError(f"schedule {name!r} has {', '.join(sorted(o.name for o in unhandled))} "
                            "actions but no pass places their partner's side: import the module that registers it "
                            "(megatron_pp.schedules.bpipe for BPipe's parking)")
    return with_comm
