"""Communication insertion (`schedules.comm`): the lists it builds are pinned, and its replay is linear.

The golden files under `comm_golden/` are registered schedules at small sizes, each with its communication,
as `Schedule.to_text` writes them; they were written by the first version of the pass (the one that
rescanned every rank after each hoist). The test strips the communication and inserts it again: the lists
must come back identical, action for action. Pinning the pass's input and output together (rather than
building from the registry) keeps the test about this pass alone: a generator that changes its compute
order changes what it builds, not what these files check. Cases cover every kind of list the pass meets:
no hoist (gpipe, 1f1b, bpipe, 2bw, layered looped-bfs), hoists in interleaved, GIS and PO orders, the
`hoist_to_send_only_batches` option (looped-bfs) and stash transfers between computes (offload, bpipe).

Regenerate (only when a change to the pass is meant to change its lists, and say so in the commit):
`python -m tests.schedules.test_comm --regenerate`.
"""
from __future__ import annotations

import dataclasses
import pathlib
import sys

import pytest

from megatron_pp.schedules import comm
from megatron_pp.schedules.comm import RendezvousReplay, insert_communication
from megatron_pp.schedules.ir import COMM_OPS, HOSTING_OPS, Schedule
from megatron_pp.schedules.validate import validate

GOLDEN = pathlib.Path(__file__).parent / "comm_golden"
CASES = [("gpipe", 4, 8, 1, {}), ("1f1b", 4, 8, 1, {}), ("1f1b", 5, 9, 1, {"offload_chunks": 1}),
         ("interleaved-1f1b", 4, 8, 2, {}), ("interleaved-1f1b", 3, 7, 3, {}),
         ("interleaved-1f1b", 4, 8, 3, {"microbatch_group_size": 8}), ("interleaved-1f1b", 8, 32, 4, {}),
         ("gis", 4, 8, 2, {}), ("gis", 4, 8, 4, {"interleave_group_size": 1}), ("gis-h", 5, 10, 2, {}),
         ("po-h", 4, 8, 2, {}), ("po-f", 4, 8, 2, {}), ("bpipe", 4, 8, 1, {}), ("looped-bfs", 4, 8, 2, {}),
         ("looped-bfs", 3, 6, 2, {"layered_grad_accumulation": True, "breadth_first_microbatches": 3}),
         ("2bw", 4, 8, 1, {})]


def _file(name: str, p: int, m: int, v: int, options: dict) -> pathlib.Path:
    extra = "".join(f"_{key}-{value}" for key, value in sorted(options.items()))
    return GOLDEN / f"{name}_p{p}_m{m}_v{v}{extra}.txt"


def _compute_only(schedule: Schedule) -> Schedule:
    dropped = COMM_OPS | HOSTING_OPS  # the acceptor's ACCEPT/RETURN are communication too
    return dataclasses.replace(schedule, actions=[[a for a in acts if a.op not in dropped] for acts in schedule.actions])


@pytest.mark.parametrize("case", CASES, ids=lambda c: _file(*c).stem)
def test_insertion_reproduces_the_pinned_lists(case):
    expected = Schedule.from_text(_file(*case).read_text())
    built = insert_communication(_compute_only(expected))
    assert built.to_text() == expected.to_text()
    validate(built)


class RecordingReplay(RendezvousReplay):
    """Keeps every replay the pass runs, to read their `work` counters."""

    made: list[RendezvousReplay] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        RecordingReplay.made.append(self)


def _work_and_comm_actions(schedule: Schedule) -> tuple[int, int]:
    """The replays' total work while inserting `schedule`'s communication, and the communication actions."""
    RecordingReplay.made = []
    built = insert_communication(schedule)
    comm_actions = sum(a.op in COMM_OPS for acts in built.actions for a in acts)
    return sum(replay.work for replay in RecordingReplay.made), comm_actions


@pytest.mark.parametrize("name, p, v, pinned", [("interleaved-1f1b", 8, 4, (9455, 19695)), ("gis", 4, 4, (3378, 7050))])
def test_replay_work_is_linear_in_the_actions(name, p, v, pinned, monkeypatch):
    # Each hoist re-runs the replay. The first version rescanned every rank after each hoist: counted the
    # same way, its work per communication action was 4.8 -> 5.3 here for interleaved 1F1B (m -> 2m) and
    # 3.9 -> 4.2 for GIS, and 13.9 -> 15.8 at p = 32. Waking only the rank a posting can unblock keeps it
    # about flat (2.4 -> 2.5, 3.5 -> 3.7).
    from megatron_pp.schedules.registry import get_schedule

    monkeypatch.setattr(comm, "RendezvousReplay", RecordingReplay)
    builder = get_schedule(name).builder
    measured = [_work_and_comm_actions(builder(p, m, v)) for m in (4 * p, 8 * p)]
    per_action = [work / comm_actions for work, comm_actions in measured]
    assert max(per_action) <= 4
    assert per_action[1] <= 1.05 * per_action[0]
    # The counts themselves are pinned, like the lists above: a change to the replay that changes its work
    # (rank visits, batch members checked, ranks looked at between hoists) must say so and update them.
    assert tuple(work for work, _ in measured) == pinned


def regenerate() -> None:
    from megatron_pp.schedules.registry import build_schedule, get_schedule

    GOLDEN.mkdir(exist_ok=True)
    for name, p, m, v, options in CASES:
        sizes = (p, m, v) if get_schedule(name).supports_virtual else (p, m)
        _file(name, p, m, v, options).write_text(build_schedule(name, *sizes, **options).to_text())


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit("usage: python -m tests.schedules.test_comm --regenerate")
    regenerate()


def _visits(num_ranks, wakes):
    """Ranks in the order a `Wakeups` hands them out; `wakes[rank]` are the ranks woken while `rank` is visited."""
    order, wakeups = [], comm.Wakeups(num_ranks)
    while (rank := wakeups.next()) is not None:
        order.append(rank)
        for woken in wakes.pop(rank, []):
            wakeups.wake(woken)
    return order


def test_wakeups_visit_ranks_in_the_order_of_repeated_passes():
    # Visiting rank 2 wakes rank 0, which waits for the next pass (rank 3 of this one comes first); visiting
    # rank 3 wakes rank 1, which follows rank 0 in that pass, as a loop over ranks 0..p-1 would visit them.
    assert _visits(4, {2: [0, 3], 3: [1]}) == [0, 1, 2, 3, 0, 1]
    # A rank already queued is not queued twice; a rank waking itself runs again in the next pass.
    assert _visits(3, {0: [2, 2], 1: [1]}) == [0, 1, 2, 1]


def test_replay_work_counts_the_postings_a_rewrite_rolls_back():
    # `replace` goes on from the current state instead of replaying from scratch; its cost (`work`) is the
    # windows plus the rolled-back part. Swapping rank 0's first send with the next forward (1F1B, p 2, m 4)
    # withdraws that send and everything after it on both ranks; the work must count each of those
    # postings, or a replay that rolls back far would look cheaper than it is.
    from megatron_pp.schedules.registry import build_schedule

    actions = [list(acts) for acts in build_schedule("1f1b", 2, 4).actions]
    replay = RendezvousReplay(actions)
    assert replay.settle()
    same = {0: (1, actions[0][1:3])}
    replay.replace(same)  # a window equal to the list: nothing is rolled back
    assert replay.pos == [len(acts) for acts in actions] and replay.settle()
    window = [actions[0][2], actions[0][1]]  # F1 before SEND_F0: still a valid order
    replay.replace({0: (1, list(actions[0][1:3]))})  # builds the peers' side indexes, which `work` also counts
    before_pos, before_work = list(replay.pos), replay.work
    replay.replace({0: (1, window)})
    rolled_back = sum(b - a for a, b in zip(replay.pos, before_pos))
    assert replay.pos[0] == 1 and replay.pos[1] == 0  # back to the swapped send, and rank 1 to its start
    assert replay.work - before_work >= rolled_back + len(window)
    assert replay.settle()  # and the rewritten lists still finish
    assert [str(a) for a in replay.actions[0][:4]] == ["F0.0", "F1.0", "SEND_F0.0>1", "SEND_F1.0>1"]


def test_wakeups_restart_begins_a_new_round_in_rank_order():
    # After a replay drains its wake-ups, the lists may change (BPipe's `replace`) and ranks are woken again:
    # `restart` makes that a new round, visited in rank order, whichever rank the last round ended on.
    wakeups = comm.Wakeups(4)
    assert [wakeups.next() for _ in range(2)] == [0, 1]
    wakeups.wake(0)  # woken by a higher rank: next pass
    assert [wakeups.next() for _ in range(3)] == [2, 3, 0] and wakeups.next() is None
    wakeups.restart()
    for rank in (3, 0, 2):
        wakeups.wake(rank)
    assert [wakeups.next() for _ in range(3)] == [0, 2, 3] and wakeups.next() is None


def test_a_stuck_replay_names_only_the_ranks_that_did_not_finish():
    from megatron_pp.schedules.ir import Action

    lists = [[Action.parse(t) for t in text.split()] for text in
             ("F0.0 SEND_F0.0>1", "RECV_F0.0<0 F0.0 RECV_B0.0<2", "RECV_F0.0<1 F0.0")]
    replay = RendezvousReplay(lists)
    blocked = replay.run()
    assert [(b.rank, b.index) for b in blocked] == [(1, 2), (2, 0)]  # rank 0 finished: not listed
    assert blocked[0].describe() == "rank 1, action 2: blocked on RECV_B0.0<2 (action 2)"


def test_a_rewrite_that_extends_the_batch_a_rank_waits_in_rolls_it_back():
    # Rank 0 waits in the batch [SEND_F0] for rank 1, which waits in [SEND_B0] for rank 0's RECV_B0: a
    # deadlock. Moving RECV_B0 ahead of F1 puts it right at the end of rank 0's batch, so it joins it: the
    # batch must be posted again as [SEND_F0, RECV_B0] (rolled back, though nothing at the change was
    # posted), and then both ranks finish, as a fresh replay of the new lists does.
    from megatron_pp.schedules.ir import Action

    lists = [[Action.parse(t) for t in text.split()] for text in
             ("SEND_F0.0>1 F1.0 RECV_B0.0<1", "SEND_B0.0>0 F0.0 RECV_F0.0<0")]
    replay = RendezvousReplay([list(acts) for acts in lists])
    assert not replay.settle()
    assert [(b.rank, b.index) for b in replay.blocked()] == [(0, 0), (1, 0)]
    replay.replace({0: (1, [lists[0][2], lists[0][1]])})
    assert replay.settle()
    assert RendezvousReplay([list(acts) for acts in replay.actions]).settle()
