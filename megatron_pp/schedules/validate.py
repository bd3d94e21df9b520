"""The validator: one function that says whether a schedule (with its communication) can run correctly.

`validate` checks, in this order, so that each check may rely on the previous ones: every action's
fields are in range and every send or receive talks to the one rank its stage's neighbour lives on;
both ends of every directed link list the same messages in the same order; each rank's list in
isolation (one F and one backward per (microbatch, chunk), backward after forward, inputs received or
computed before use, results sent after they exist, gradients reduced after the last backward (of each
group of `microbatches_per_reduction` microbatches, when the schedule sets that option), at most
two live weight versions, stashes parked off-device only between their F and their backward and back
before it, peer parking in disjoint pairs, a hosted stash returned once after it was accepted); and a replay of
all ranks under blocking (rendezvous) semantics finishes, which together with the previous checks proves every
cross-rank data dependency is met. BPipe's parking takes part in the link and replay checks: each EVICT is
matched by an ACCEPT and each LOAD by a RETURN on the partner, in the same order on both sides of each pair
group, and the replay treats every one of them as a blocking operation of its own, so the lists cannot
deadlock even where every NCCL operation holds its rank's device queue until the peer joins. Failures raise
`ScheduleError` naming the rank, the index in its list and the action.
"""
from __future__ import annotations

from collections import Counter, defaultdict

from megatron_pp.schedules.comm import (PARKING_SENDS, PRODUCER_OFFSET, Message, RendezvousReplay, expected_peer,
                                        forward_neighbours, link_of)
from megatron_pp.schedules.ir import (COMM_OPS, HOSTING_OPS, PARTNER_OP, RETURN_TRANSFER, SEND_OPS, TRANSFER_OPS,
                                      Action, Op, Schedule, ScheduleError, whole_schedule_pass)

__all__ = ["ScheduleError", "validate"]


def _error(rank: int, index: int, action: Action | str, reason: str) -> ScheduleError:
    return ScheduleError(f"rank {rank}, action {index} ({action}): {reason}")


@whole_schedule_pass
def validate(schedule: Schedule) -> None:
    """Raise ScheduleError at the first rule `schedule` breaks; return None when it is runnable."""
    _check_fields(schedule)
    _check_links(schedule)
    for rank in range(schedule.num_ranks):
        _check_rank(schedule, rank)
    _check_parking_links(schedule)
    _check_deadlock(schedule)


def _check_fields(schedule: Schedule) -> None:
    m, v, p = schedule.num_microbatches, schedule.num_chunks, schedule.num_ranks
    parks_on = _parking_peers(schedule)
    hosts_for: dict[int, int] = {}
    for rank, acts in enumerate(schedule.actions):
        # Every (op, chunk, peer) that passes the checks below whatever its microbatch, stash transfers and
        # hosting aside: one set lookup settles almost every action; the rest take the checks in order.
        fine = {(op, chunk, None) for op in (Op.F, Op.B, Op.BI, Op.BW, Op.REDUCE_GRAD) for chunk in range(v)}
        fine.add((Op.STEP, None, None))
        for op in COMM_OPS:
            for chunk in range(v):
                peer = expected_peer(schedule, rank, Action(op, 0, chunk, 0))  # depends on op and chunk only
                if peer is not None:
                    fine.add((op, chunk, peer))
        for i, a in enumerate(acts):
            if (a.microbatch is None or a.microbatch < m) and (a.op, a.chunk, a.peer) in fine:
                continue
            if a.microbatch is not None and a.microbatch >= m:
                raise _error(rank, i, a, f"microbatch {a.microbatch} out of range (m={m})")
            if a.chunk is not None and a.chunk >= v:
                raise _error(rank, i, a, f"chunk {a.chunk} out of range ({v} chunks per rank)")
            if a.peer is not None and not (0 <= a.peer < p and a.peer != rank):
                raise _error(rank, i, a, f"peer {a.peer} is not another rank of {p}")
            if a.op in COMM_OPS:
                peer = expected_peer(schedule, rank, a)
                if peer is None:
                    raise _error(rank, i, a, "no message is needed: the neighbouring stage is on this rank "
                                             "or does not exist")
                if peer != a.peer:
                    raise _error(rank, i, a, f"the neighbouring stage lives on rank {peer}, not {a.peer}")
            if a.op in TRANSFER_OPS:
                _check_transfer(rank, i, a, parks_on)
            elif a.op in HOSTING_OPS:
                _check_hosting(rank, i, a, parks_on, hosts_for)


def _check_hosting(rank: int, index: int, action: Action, parks_on: dict[int, int],
                   hosts_for: dict[int, int]) -> None:
    """An ACCEPT/RETURN names the one rank that parks its stashes here."""
    peer = action.peer
    if parks_on.get(peer) != rank:
        raise _error(rank, index, action, f"rank {peer} parks no stashes on rank {rank} (no EVICT or LOAD of it "
                                          f"names rank {rank})")
    first = hosts_for.setdefault(rank, peer)
    if first != peer:
        raise _error(rank, index, action, f"hosts stashes of rank {peer} but already hosts rank {first}'s; an "
                                          "acceptor hosts one evictor")


def _parking_peers(schedule: Schedule) -> dict[int, int]:
    """Rank -> the peer its first EVICT/LOAD names (ranks that park nothing left out); a transfer naming
    another peer is refused at that transfer (`_check_transfer`)."""
    peers: dict[int, int] = {}
    for rank, acts in enumerate(schedule.actions):
        first = next((a.peer for a in acts if a.op in (Op.EVICT, Op.LOAD)), None)
        if first is not None:
            peers[rank] = first
    return peers


def _check_transfer(rank: int, index: int, action: Action, parks_on: dict[int, int]) -> None:
    """Field rules of stash transfers; their order rules (between F and backward, back before it) are in
    `_check_rank`. OFFLOAD/RELOAD need nothing more. EVICT/LOAD (BPipe) also involve the acceptor, whose
    ACCEPT/RETURN serve them on the pair's own groups; the stores hold one partner each, so parking pairs
    are disjoint: the evictor parks on one peer, the peer hosts for no one else and parks nothing of its own."""
    if action.op not in (Op.EVICT, Op.LOAD):
        return
    peer, first = action.peer, parks_on[rank]
    if peer != first:
        raise _error(rank, index, action, f"parks on rank {peer} but already parks on rank {first}; a rank parks "
                                          "its stashes on one partner")
    if peer in parks_on:
        raise _error(rank, index, action, f"rank {peer} parks stashes of its own on rank {parks_on[peer]}; a rank "
                                          "that hosts another's stashes must not park any")
    others = [r for r, parks in parks_on.items() if r < rank and parks == peer]  # reported at the later one
    if others:
        raise _error(rank, index, action, f"rank {peer} already hosts stashes of rank {others[0]}; an acceptor "
                                          "hosts one evictor")


def _check_stash_transfer(rank: int, index: int, action: Action, forward_at: dict, backward_at: dict,
                          parked: dict[tuple[int, int], tuple[Action, int]], returned: set) -> None:
    """A stash leaves the device (OFFLOAD, EVICT) only between its F and its backward, at most once, and
    comes back (RELOAD, LOAD from the same peer) before that backward."""
    key = (action.microbatch, action.chunk)
    if action.op in RETURN_TRANSFER:
        if key not in forward_at:
            raise _error(rank, index, action, f"nothing to move: F{key[0]}.{key[1]} has not run before it")
        if key in backward_at:
            raise _error(rank, index, action, f"the backward of this stash already ran at action {backward_at[key]}")
        if key in parked or key in returned:
            raise _error(rank, index, action, "this stash already left the device once in this step")
        parked[key] = (action, index)
        return
    if key not in parked:
        raise _error(rank, index, action, "this stash is not parked off the device here")
    away, at = parked[key]
    if RETURN_TRANSFER[away.op] is not action.op or away.peer != action.peer:
        raise _error(rank, index, action, f"brings back a stash that {away} (action {at}) sent elsewhere")
    del parked[key]
    returned.add(key)


class _RankLedger:
    """What `_check_rank` has seen of one rank's list so far: where each (microbatch, chunk) ran its forward,
    backward (B, or BI when split) and weight gradient (BW), its live stashes with their weight versions,
    the sends and receives, the chunks' reductions, and the stashes parked away or hosted for a partner."""

    def __init__(self, schedule: Schedule, rank: int) -> None:
        self.acts = schedule.actions[rank]
        self.forward_at: dict[tuple[int, int], int] = {}
        self.backward_at: dict[tuple[int, int], int] = {}  # B, or BI when split
        self.weight_grad_at: dict[tuple[int, int], int] = {}  # BW
        self.live: dict[tuple[int, int], int | None] = {}  # stashes between F and B/BW -> their weight version
        # Chunk -> weight version -> live stashes of it (versioned stashes only; kept so that the check of a
        # forward does not scan every live stash).
        self.live_versions: dict[int, Counter] = defaultdict(Counter)
        self.received: dict[tuple[Op, int, int], int] = {}
        self.sent: dict[tuple[Op, int, int], int] = {}
        self.reduced_at: dict[int, list[int]] = {}  # chunk -> indices of its REDUCE_GRADs, one per group
        # Layered accumulation may reduce a chunk once per group of g consecutive microbatches (reduction k
        # covers group k); without the option there is one group: one reduction, after every backward.
        self.group = schedule.options.get("microbatches_per_reduction") or schedule.num_microbatches
        self.num_groups = -(-schedule.num_microbatches // self.group)
        self.parked: dict[tuple[int, int], tuple[Action, int]] = {}  # stash off the device -> (transfer, index)
        self.returned: set[tuple[int, int]] = set()
        self.hosted: dict[tuple[int, int], int] = {}  # a partner's stash accepted here, not yet returned -> index
        self.given_back: dict[tuple[int, int], int] = {}
        # Per chunk, where the input of its forward and of its backward comes from (`_input_source`); chunks
        # are in range here (`_check_fields` ran).
        self.forward_input = [_input_source(schedule, rank, c, Op.RECV_F) for c in range(schedule.num_chunks)]
        self.backward_input = [_input_source(schedule, rank, c, Op.RECV_B) for c in range(schedule.num_chunks)]


def _check_rank(schedule: Schedule, rank: int) -> None:
    """Walk one rank's list in order: each action against what ran before it, then what must have run by
    the end. Communication, most of the actions, is checked inline; the rest by one helper per kind."""
    ledger = _RankLedger(schedule, rank)
    forward_at, backward_at, sent, received = ledger.forward_at, ledger.backward_at, ledger.sent, ledger.received
    for i, a in enumerate(ledger.acts):
        op = a.op
        if op in COMM_OPS:  # most actions: tested first, which no check below depends on
            comm_key = (op, a.microbatch, a.chunk)
            if op in SEND_OPS:
                producers = forward_at if op is Op.SEND_F else backward_at
                if (a.microbatch, a.chunk) not in producers:
                    what = "F" if op is Op.SEND_F else "B (or BI)"
                    raise _error(rank, i, a, f"sends the result of {what}{a.microbatch}.{a.chunk}, "
                                             "which has not run yet")
                if comm_key in sent:
                    raise _error(rank, i, a, f"already sent at action {sent[comm_key]}")
                sent[comm_key] = i
            else:
                if comm_key in received:
                    raise _error(rank, i, a, f"already received at action {received[comm_key]}")
                received[comm_key] = i
        elif op in HOSTING_OPS:
            _check_hosted(ledger, rank, i, a)
        else:
            _check_compute_or_transfer(ledger, rank, i, a)
    _check_rank_complete(schedule, rank, ledger)


def _check_hosted(ledger: _RankLedger, rank: int, i: int, a: Action) -> None:
    """ACCEPT (a partner's stash lands here, once) and RETURN (sends back one accepted earlier)."""
    key = (a.microbatch, a.chunk)
    if a.op is Op.ACCEPT:
        if key in ledger.hosted or key in ledger.given_back:
            raise _error(rank, i, a, f"stash {key[0]}.{key[1]} of rank {a.peer} is accepted a second time")
        ledger.hosted[key] = i
        return
    if key not in ledger.hosted:
        raise _error(rank, i, a, f"returns stash {key[0]}.{key[1]} to rank {a.peer} before accepting it "
                                 f"(no ACCEPT{key[0]}.{key[1]}<{a.peer} earlier in this list)")
    ledger.given_back[key] = i
    del ledger.hosted[key]


def _check_compute_or_transfer(ledger: _RankLedger, rank: int, i: int, a: Action) -> None:
    """A stash transfer, a compute action (F, B, BI, BW) or a REDUCE_GRAD. A backward needs its stash on
    the device: a parked one must have come back first."""
    key = (a.microbatch, a.chunk)
    if ledger.parked and a.op in (Op.B, Op.BI, Op.BW) and key in ledger.parked:
        away, at = ledger.parked[key]
        back = Action(RETURN_TRANSFER[away.op], *key, away.peer)
        raise _error(rank, i, a, f"its stash is off the device since {away} (action {at}); {back} must come "
                                 "before the backward")
    if a.op in TRANSFER_OPS:
        _check_stash_transfer(rank, i, a, ledger.forward_at, ledger.backward_at, ledger.parked, ledger.returned)
    elif a.op is Op.F:
        _check_forward(ledger, rank, i, a, key)
    elif a.op in (Op.B, Op.BI, Op.BW):
        _check_backward(ledger, rank, i, a, key)
    elif a.op is Op.REDUCE_GRAD:
        done = ledger.reduced_at.setdefault(a.chunk, [])
        if len(done) == ledger.num_groups:
            per_group = (f" ({ledger.num_groups} per step, one per {ledger.group} microbatches)"
                         if ledger.num_groups > 1 else "")
            raise _error(rank, i, a, f"chunk {a.chunk} already reduced at action {done[-1]}{per_group}")
        done.append(i)


def _check_forward(ledger: _RankLedger, rank: int, i: int, a: Action, key: tuple[int, int]) -> None:
    """Once per (microbatch, chunk), after its input arrived; at most two weight versions live per chunk."""
    if key in ledger.forward_at:
        raise _error(rank, i, a, f"second forward of this microbatch and chunk "
                                 f"(first at action {ledger.forward_at[key]})")
    _check_input(rank, i, a, Op.RECV_F, ledger.forward_input[a.chunk], ledger.received, ledger.forward_at)
    held = ledger.live_versions[a.chunk]
    if a.version is not None and a.version not in held and len(held) == 2:
        raise _error(rank, i, a, f"chunk {a.chunk} would hold weight versions {sorted({*held, a.version})} "
                                 "at once; at most 2 may be live")
    ledger.forward_at[key] = i
    ledger.live[key] = a.version
    if a.version is not None:
        held[a.version] += 1


def _check_backward(ledger: _RankLedger, rank: int, i: int, a: Action, key: tuple[int, int]) -> None:
    """B or BI: once, after its forward (same weight version) and its input, before the chunk's reduction.
    BW: once, after its BI, same version, before the reduction. B and BW free the stash."""
    if a.op is Op.BW:
        if key in ledger.weight_grad_at:
            raise _error(rank, i, a, f"second weight-gradient of this microbatch and chunk "
                                     f"(first at action {ledger.weight_grad_at[key]})")
        if key not in ledger.backward_at or ledger.acts[ledger.backward_at[key]].op is not Op.BI:
            raise _error(rank, i, a, f"BW needs BI{a.microbatch}.{a.chunk} before it")
    else:
        if key in ledger.backward_at:
            raise _error(rank, i, a, f"second backward of this microbatch and chunk "
                                     f"(first at action {ledger.backward_at[key]})")
        if key not in ledger.forward_at:
            raise _error(rank, i, a, f"no stash to consume: F{a.microbatch}.{a.chunk} has not run before it "
                                     "(stash count would go negative)")
    if a.version != ledger.live[key]:
        raise _error(rank, i, a, f"weight version {a.version} differs from its forward's {ledger.live[key]}")
    if a.op is not Op.BW:
        _check_input(rank, i, a, Op.RECV_B, ledger.backward_input[a.chunk], ledger.received, ledger.backward_at)
    _check_not_reduced(rank, i, a, ledger.reduced_at, ledger.group)
    if a.op is Op.BW:
        ledger.weight_grad_at[key] = i
    else:
        ledger.backward_at[key] = i
    if a.op is not Op.BI:
        _release(ledger.live, ledger.live_versions, key)


def _check_rank_complete(schedule: Schedule, rank: int, ledger: _RankLedger) -> None:
    """At the end of the list: every chunk reduced once per group, every parked stash back, every hosted
    one returned, and every (microbatch, chunk) forwarded, backwarded (BI with its BW) and its results sent
    to the neighbour stages that need them."""
    acts, num_groups, group = ledger.acts, ledger.num_groups, ledger.group
    for chunk, done in ledger.reduced_at.items():
        if len(done) < num_groups:
            last = done[-1]
            raise _error(rank, last, acts[last],
                         f"only {len(done)} of the {num_groups} reductions of chunk {chunk} (one per {group} "
                         f"microbatches): microbatches {len(done) * group}..{schedule.num_microbatches - 1} "
                         "are never reduced")
    if ledger.parked:
        (mb, chunk), (away, at) = next(iter(ledger.parked.items()))
        raise _error(rank, at, away, f"stash {mb}.{chunk} never comes back")
    if ledger.hosted:
        (mb, chunk), at = next(iter(ledger.hosted.items()))
        raise _error(rank, at, acts[at], f"hosted stash {mb}.{chunk} is never returned to rank {acts[at].peer}")
    forward_at, backward_at, sent = ledger.forward_at, ledger.backward_at, ledger.sent
    neighbours = [forward_neighbours(schedule, rank, chunk) for chunk in range(schedule.num_chunks)]
    for mb in range(schedule.num_microbatches):
        for chunk in range(schedule.num_chunks):
            key = (mb, chunk)
            if key not in forward_at:
                raise _error(rank, len(acts), "end of list", f"F{mb}.{chunk} never runs")
            f = forward_at[key]
            if key not in backward_at:
                raise _error(rank, f, acts[f], f"no backward (B{mb}.{chunk}, or BI and BW) follows")
            if acts[backward_at[key]].op is Op.BI and key not in ledger.weight_grad_at:
                raise _error(rank, backward_at[key], acts[backward_at[key]], f"BW{mb}.{chunk} never follows")
            prev_rank, next_rank = neighbours[chunk]
            for op, peer, producer in ((Op.SEND_F, next_rank, f), (Op.SEND_B, prev_rank, backward_at[key])):
                if peer is not None and (op, mb, chunk) not in sent:
                    raise _error(rank, producer, acts[producer],
                                 f"its result is never sent to rank {peer} (no {Action(op, mb, chunk, peer)})")


def _release(live: dict[tuple[int, int], int | None], live_versions: dict[int, Counter],
             key: tuple[int, int]) -> None:
    version = live.pop(key)
    if version is not None:
        held = live_versions[key[1]]
        held[version] -= 1
        if not held[version]:
            del held[version]


def _input_source(schedule: Schedule, rank: int, chunk: int, recv_op: Op) -> tuple[int, int, int] | None:
    """Where the input of a forward (`recv_op` RECV_F) or backward (RECV_B) of (rank, chunk) comes from:
    (rank, local chunk and global stage of the neighbour stage that produces it), None for the first
    stage's forward and the last stage's backward, which need none."""
    stage = schedule.stage_of(rank, chunk)
    neighbour = stage - 1 if recv_op is Op.RECV_F else stage + 1
    if not 0 <= neighbour < schedule.num_stages:
        return None
    return (*schedule.location(neighbour), neighbour)


def _check_input(rank: int, index: int, action: Action, recv_op: Op, source: tuple[int, int, int] | None,
                 received: dict[tuple[Op, int, int], int], done: dict[tuple[int, int], int]) -> None:
    """The input of a forward (activation) or backward (output gradient) must be here before it runs:
    received from another rank, or produced earlier in this list when the neighbour stage (`source`, from
    `_input_source`) is local."""
    if source is None:
        return
    peer, chunk, neighbour = source
    if peer != rank:
        if (recv_op, action.microbatch, action.chunk) not in received:
            need = Action(recv_op, action.microbatch, action.chunk, peer)
            raise _error(rank, index, action, f"needs {need} before it")
    elif (action.microbatch, chunk) not in done:
        kind = "F" if recv_op is Op.RECV_F else "B"
        raise _error(rank, index, action,
                     f"needs {kind}{action.microbatch}.{chunk} (stage {neighbour}, same rank) before it")


def _check_not_reduced(rank: int, index: int, action: Action, reduced_at: dict[int, list[int]], group: int) -> None:
    done = reduced_at.get(action.chunk, [])
    if action.microbatch // group < len(done):
        raise _error(rank, index, action, f"gradients of chunk {action.chunk} were already reduced at action "
                                          f"{done[action.microbatch // group]}, before this backward")


def _check_links(schedule: Schedule) -> None:
    # Per link, (index in its rank's list, message) of every send and receive on it, in list order (the rank
    # is the link's sending or receiving end).
    sends: dict[tuple[int, int], list[tuple[int, Message]]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[tuple[int, Message]]] = defaultdict(list)
    for rank, acts in enumerate(schedule.actions):
        stages = [schedule.stage_of(rank, chunk) for chunk in range(schedule.num_chunks)]
        for i, a in enumerate(acts):
            if a.op in COMM_OPS:
                kind, offset = PRODUCER_OFFSET[a.op]  # this rank's stages are looked up once
                message = (kind, a.microbatch, stages[a.chunk] + offset)
                if a.op in SEND_OPS:
                    sends[rank, a.peer].append((i, message))
                else:
                    recvs[a.peer, rank].append((i, message))
    for link in sorted(set(sends) | set(recvs)):
        (src, dst), out, into = link, sends.get(link, []), recvs.get(link, [])
        for k, ((s_i, sent), (r_i, received)) in enumerate(zip(out, into)):
            if sent != received:
                raise _error(dst, r_i, schedule.actions[dst][r_i], f"message #{k} on link {src}->{dst} is received "
                             f"here but rank {src} sends {schedule.actions[src][s_i]} (action {s_i}) as message #{k}")
        if len(into) > len(out):
            i = into[len(out)][0]
            raise _error(dst, i, schedule.actions[dst][i], f"no matching send: rank {src} sends only {len(out)} "
                                                           f"messages to rank {dst}")
        if len(out) > len(into):
            i = out[len(into)][0]
            raise _error(src, i, schedule.actions[src][i], f"no matching receive: rank {dst} receives only "
                                                           f"{len(into)} messages from rank {src}")


def _check_parking_links(schedule: Schedule) -> None:
    """Every EVICT has its ACCEPT and every LOAD its RETURN on the partner, the k-th on one side matching the
    k-th on the other (a pair group matches operations in posting order, as NCCL does)."""
    sides: dict[tuple[tuple, bool], list[tuple[int, int, Action]]] = defaultdict(list)
    for rank, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            if a.op in PARTNER_OP:
                sides[link_of(rank, a), a.op in PARKING_SENDS].append((rank, i, a))
    for link in sorted({link for link, _ in sides}):
        out, into = sides.get((link, True), []), sides.get((link, False), [])
        for k in range(max(len(out), len(into))):
            if k >= len(out) or k >= len(into):
                rank, i, a = (out if k < len(out) else into)[k]
                partner = Action(PARTNER_OP[a.op], a.microbatch, a.chunk, rank)
                raise _error(rank, i, a, f"rank {a.peer} has no matching {partner} (the {link[2]} group of ranks "
                                         f"{link[0]} -> {link[1]} has {len(out)} send(s), {len(into)} receive(s))")
            (s_rank, s_i, s_a), (r_rank, r_i, r_a) = out[k], into[k]
            if (s_a.microbatch, s_a.chunk) != (r_a.microbatch, r_a.chunk):
                evictor_side = (s_rank, s_i, s_a) if s_a.op is Op.EVICT else (r_rank, r_i, r_a)
                other = (r_rank, r_i, r_a) if s_a.op is Op.EVICT else (s_rank, s_i, s_a)
                raise _error(other[0], other[1], other[2],
                             f"is operation #{k} on the {link[2]} group of ranks {link[0]} and {link[1]}, where rank "
                             f"{evictor_side[0]} posts {evictor_side[2]} (action {evictor_side[1]}): the two sides "
                             "must list these transfers in the same order")


def _check_deadlock(schedule: Schedule) -> None:
    blocked = RendezvousReplay([list(acts) for acts in schedule.actions], parking=True).run()
    if blocked:
        first = blocked[0]
        index, action = first.waiting[0]
        raise _error(first.rank, index, action, "deadlock under blocking send/receive: "
                     + "; ".join(b.describe() for b in blocked))
