"""Emulated compute (megatron_pp/benchmarks/emulate.py): orderings and causality of short emulated runs at p = 4,
never wall-clock targets. Each run is a real executor over gloo with every compute action sleeping 20 ms a
unit; what is asserted holds on any machine load (a bound that involves time is one whole action wide, and the
check that no rank idles while its next action is ready counts the rank's voluntary waits, not time)."""
from collections import defaultdict

import pytest

from megatron_pp.benchmarks.emulate import Emulator, cost_model, family_schedule, worker_emulate
from megatron_pp.benchmarks.emulate_measure import critical_path, measure
from megatron_pp.schedules.ir import Op
from megatron_pp.schedules.simulate import CostModel, receives_ahead, simulate
from tests.dist import run_distributed

UNIT_S = 0.02


def _run(name: str, m: int, unit_s: float = UNIT_S, account: bool = False) -> tuple:
    schedule = family_schedule(name, 4, m)
    costs = cost_model("equal", unit_s)
    runs = run_distributed(4, worker_emulate, schedule, [costs], 2, account=account)
    return schedule, [runs[r][0][1] for r in range(4)]  # the second step (the first builds and warms up)


def _messages(schedule, step):
    """Per message: (send post, receive post, consumer's compute record) from the lists and the records."""
    sends, recvs = defaultdict(list), defaultdict(list)
    for rank, record in enumerate(step):
        for kind, peer, when in record["posts"]:
            (sends if kind == "send" else recvs)[(rank, peer) if kind == "send" else (peer, rank)].append(when)
    compute = [{label: rec for label, *rec in record["compute"]} for record in step]
    out = []
    for rank, actions in enumerate(schedule.actions):
        k = defaultdict(int)
        for a in actions:
            if a.op in (Op.RECV_F, Op.RECV_B):
                link = (a.peer, rank)
                consumer = f"{'F' if a.op is Op.RECV_F else ('B' if f'B{a.microbatch}.{a.chunk}' in compute[rank] else 'BI')}" \
                           f"{a.microbatch}.{a.chunk}"
                out.append((sends[link][k[link]], recvs[link][k[link]], compute[rank][consumer]))
                k[link] += 1
    return out


def _receives_posted_where_the_plan_says(schedule, step) -> None:
    """On each rank's own clock (so on any load): with K receives kept ahead on a link
    (`simulate.receives_ahead`, which `tests/schedules/test_receive_posting.py` shows puts every receive before
    its send on the simulated timeline), receive j of the link is posted before the compute action after
    receive j - K in the list starts (the first K before the list's first compute action), and not before the
    compute action before receive j - K has begun: at most K buffers early."""
    ahead = receives_ahead(schedule)
    for rank, record in enumerate(step):
        begins = [begin for _, begin, *_ in record["compute"]]
        posts = defaultdict(list)
        for kind, peer, when in record["posts"]:
            if kind == "recv":
                posts[peer].append(when)
        compute_seen, at, links = 0, [], defaultdict(list)  # per action: compute actions before it
        for index, a in enumerate(schedule.actions[rank]):
            at.append(compute_seen)
            compute_seen += a.is_compute
            if a.op in (Op.RECV_F, Op.RECV_B):
                links[a.peer].append(index)
        for peer, positions in links.items():
            k = ahead[rank].get(peer, 1)
            assert len(posts[peer]) == len(positions), (rank, peer)
            for j, when in enumerate(posts[peer]):
                trigger = at[positions[j - k]] if j >= k else 0  # compute actions run before the post is due
                if trigger < len(begins):
                    assert when <= begins[trigger], (rank, peer, j)
                if j >= k and trigger > 0:
                    assert when >= begins[trigger - 1], (rank, peer, j)


@pytest.mark.parametrize("name,m", [("1f1b", 8), ("zb-v", 8), ("interleaved-1f1b", 8)])
def test_receives_are_posted_before_their_send_and_no_input_is_used_before_it_is_sent(name, m):
    schedule, step = _run(name, m)
    messages = _messages(schedule, step)
    assert len(messages) == sum(a.op in (Op.RECV_F, Op.RECV_B) for acts in schedule.actions for a in acts)
    for send, recv, (begin, end, waited, own, cost, slack) in messages:
        assert end >= send  # the consumer finished only after its input was sent (causality)
    _receives_posted_where_the_plan_says(schedule, step)
    # Each rank ran its compute in list order, every action once.
    for rank, record in enumerate(step):
        assert [label for label, *_ in record["compute"]] == [str(a) for a in schedule.actions[rank] if a.is_compute]


@pytest.mark.parametrize("name", ["zb-h1", "interleaved-1f1b"])
def test_no_rank_idles_while_its_next_action_is_ready(name):
    """A rank's thread blocks only where its list makes it wait: for the received input of the compute action
    it runs, or in that action's emulated cost. Between two compute actions (posting the list's sends and
    receives, the loop) and in a handler outside that wait it does not sleep or block: counted as the
    thread's voluntary context switches there (`Emulator.account`). A loaded host preempts a thread
    (involuntary switches) or delays it in a run queue, neither of which counts, so the check holds on any
    load; what a futex on a lock that gloo's own thread holds for a moment can add is allowed in one place
    out of ten. An executor that holds its ready actions blocks in nearly every gap and fails: planted by hand
    as a 1 ms sleep before each compute action in `PipelineExecutor.run`, 23 of 24 places blocked on a rank."""
    schedule, step = _run(name, 8, account=True)
    for rank, record in enumerate(step):
        blocking = record["blocking"]
        assert [label for label, *_ in blocking] == [label for label, *_ in record["compute"]]
        blocked = [label for label, _, gap, _, inside in blocking if gap or inside]
        assert len(blocked) <= len(blocking) // 10, (rank, blocked)

def test_stash_copies_finish_before_the_backward_that_needs_them():
    schedule, step = _run("po-h", 8)
    offloaded = 0
    for rank, record in enumerate(step):
        copies = {label: (start, end) for label, start, end in record["copies"]}
        compute = {label: (begin, end, waited) for label, begin, end, waited, *_ in record["compute"]}
        for label, (start, end) in copies.items():
            if not label.startswith("OFFLOAD"):
                continue
            offloaded += 1
            key = label[len("OFFLOAD"):]
            back_start, back_end = copies["RELOAD" + key]
            assert end <= back_start  # the copy back starts after the copy out is done, on the one host lane
            backward = compute.get("B" + key) or compute["BI" + key]
            assert back_end <= backward[0] + backward[2]  # the backward's work starts after the copy back
        # Copies on the one host lane never overlap, in the list's order.
        spans = [(s, e) for _, s, e in record["copies"]]
        assert all(e1 <= s2 + 1e-9 for (_, e1), (s2, _) in zip(spans, spans[1:]))
        listed = [str(a) for a in schedule.actions[rank] if a.op in (Op.OFFLOAD, Op.RELOAD)]
        assert [label for label, *_ in record["copies"]] == listed
    assert offloaded > 0


def test_measure_reads_step_and_bubble_from_records():
    """Two ranks, one 10 s window: rank 0 busy 6 s (a 1 s wait inside), rank 1 busy 4 s -> bubble 0.5; rank 0's
    second action starts 0.5 s after its first ends (executor work), and each outlasts its cost by 0.5 s; rank 1's
    action's own work exceeded its cost (negative slack) and is flagged."""
    step = [{"started": 0.0, "events": [("F0.0", 0.0, 10.0)], "copies": [],
             "compute": [("F0.0", 0.0, 4.0, 1.0, 0.25, 2.5, 2.25), ("F1.0", 4.5, 7.5, 0.0, 0.25, 2.5, 2.25)]},
            {"started": 1.0, "events": [("F0.0", 0.0, 5.0)], "copies": [],
             "compute": [("F0.0", 2.0, 6.0, 0.0, 0.5, 3.5, -0.25)]}]
    measured = measure(step)
    assert measured["step_s"] == 10.0 and measured["bubble"] == pytest.approx(0.5)
    assert measured["model_share"] == pytest.approx(0.1)
    assert measured["overrun_s"] == pytest.approx(0.5) and measured["gap_s"] == pytest.approx(0.5)
    assert measured["slack_s"] == pytest.approx(2.25) and measured["least_slack_s"] == pytest.approx(-0.25)
    assert measured["overran"] == 1 and measured["overran_actions"] == ["rank 1 F0.0"]


def test_critical_path_parts_add_up_to_the_step():
    """1F1B at p = 2, m = 2, costs F = 1, B = 2 (simulated makespan 9): every transfer takes 0.1 from its
    producer's end to its consumer's input (`hop`), every rank's next action starts 0.1 after its previous one
    ends (`gap`), rank 0's first and last actions outlast their cost by 0.1 (`overrun`). The walk goes back from
    rank 0's B1 through rank 1's B1, F1, B0, F0 to rank 0's F0: its costs are the simulated makespan's, and
    the parts sum to the step."""
    schedule = family_schedule("1f1b", 2, 2)
    labels = [[str(a) for a in acts if a.is_compute] for acts in schedule.actions]
    assert labels == [["F0.0", "F1.0", "B0.0", "B1.0"], ["F0.0", "B0.0", "F1.0", "B1.0"]]
    # (label, begin, end, waited, own, cost, slack)
    r0 = [("F0.0", 0.0, 1.1, 0.0, 0.1, 1.0, 0.9), ("F1.0", 1.2, 2.2, 0.0, 0.1, 1.0, 0.9),
          ("B0.0", 2.3, 6.4, 2.1, 0.1, 2.0, 1.9), ("B1.0", 6.5, 9.7, 1.1, 0.1, 2.0, 1.9)]
    r1 = [("F0.0", 0.05, 2.2, 1.15, 0.1, 1.0, 0.9), ("B0.0", 2.3, 4.3, 0.0, 0.1, 2.0, 1.9),
          ("F1.0", 4.4, 5.4, 0.0, 0.1, 1.0, 0.9), ("B1.0", 5.5, 7.5, 0.0, 0.1, 2.0, 1.9)]
    step = [{"started": 0.0, "events": [("B1.0", 0.0, 9.7)], "copies": [], "compute": r0},
            {"started": 0.0, "events": [("B1.0", 0.0, 7.5)], "copies": [], "compute": r1}]
    path = critical_path(schedule, step)
    assert sum(path.values()) == pytest.approx(9.7)
    assert path["cost"] == pytest.approx(9.0) == simulate(schedule, CostModel()).makespan
    assert (path["overrun"], path["hop"], path["gap"]) == pytest.approx((0.2, 0.2, 0.3))
    assert path["wait"] == pytest.approx(0.0) and path["lead"] == pytest.approx(0.0)


def test_actions_end_at_their_deadline_not_before():
    """Each emulated compute action ends no earlier than its start plus what it waited for plus its cost
    (the deadline), and its recorded slack is that deadline less the end of its own work."""
    schedule, step = _run("zb-h1", 8)
    for record in step:
        for label, begin, end, waited, own, cost, slack in record["compute"]:
            assert end >= begin + waited + cost - 1e-9, label
            assert own >= 0 and slack <= cost


def test_emulator_refuses_nothing_silently():
    """Every compute and copy handler of an executor is wrapped (a handler left unwrapped would run at the
    tiny model's speed and hide in the comparison)."""
    class FakeExecutor:
        rank, comm = 0, None
        handlers = {op: (lambda a: None) for op in (Op.F, Op.B, Op.BI, Op.BW, Op.OFFLOAD, Op.RELOAD, Op.EVICT,
                                                    Op.LOAD)}
    originals = dict(FakeExecutor.handlers)
    Emulator(FakeExecutor, family_schedule("1f1b", 2, 2), cost_model("equal", UNIT_S))
    assert all(FakeExecutor.handlers[op] is not originals[op] for op in originals)


def test_emulate_bad_input_is_one_line_before_any_pool(capsys):
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                    "tools"))
    import trace_vs_sim

    for argv in (["--costs", "fast"], ["--microbatches", "2q"], ["--schedules", "2bw", "--microbatches", "3"],
                 ["--steps", "0"], ["--schedules", "po-f"], ["--calibrate-only", "--plan", "--schedules 1f1b"]):
        assert trace_vs_sim.main(["--emulate", "--pp", "4", *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 6 and all(line.startswith("trace_vs_sim.py: error: ") for line in lines)
    assert "--costs" in lines[0] and "--microbatches" in lines[1] and "m >= p" in lines[2]
    assert "--steps" in lines[3] and "'po-f'" in lines[4] and "--calibrate-only" in lines[5]


def _scheduling(ctx) -> tuple:
    import os

    return tuple(sorted({(os.sched_getscheduler(int(tid)), os.getpriority(os.PRIO_PROCESS, int(tid)))
                         for tid in os.listdir("/proc/self/task")}))


def test_the_pooled_ranks_leave_an_emulated_run_as_they_came():
    """The emulator raises its ranks to real time; the pool's processes then serve other tests' real training,
    which must not run real-time (its busy compute would take both cores from everything else)."""
    before = run_distributed(4, _scheduling)
    _run("1f1b", 4)
    assert run_distributed(4, _scheduling) == before
