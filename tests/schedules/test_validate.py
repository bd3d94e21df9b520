"""The communication pass and the validator: hand-built and hand-broken schedules."""
import dataclasses
import re

import pytest

from megatron_pp.schedules.comm import RendezvousReplay, insert_communication
from megatron_pp.schedules.generators import looped_placement, one_f_one_b
from megatron_pp.schedules.ir import COMM_OPS, Action, Op, Schedule, ScheduleError, batches
from megatron_pp.schedules.registry import build_schedule
from megatron_pp.schedules.validate import validate


def make(rows: list[str], m: int, v: int = 1, placement=None) -> Schedule:
    """A schedule from one line of text-form actions per rank."""
    p = len(rows)
    return Schedule("hand", p, m, v, looped_placement(p, v) if placement is None else placement,
                    [[Action.parse(t) for t in row.split()] for row in rows])


def rejects(schedule: Schedule, rank: int, index: int, action: str, reason: str) -> str:
    with pytest.raises(ScheduleError) as err:
        validate(schedule)
    message = str(err.value)
    assert message.startswith(f"rank {rank}, action {index} ({action}): "), message
    assert re.search(reason, message), message
    return message


# 1F1B, p=2, m=2, as the communication pass lays it out.
GOOD = [
    "F0.0 SEND_F0.0>1 F1.0 SEND_F1.0>1 RECV_B0.0<1 B0.0 RECV_B1.0<1 B1.0",
    "RECV_F0.0<0 F0.0 B0.0 SEND_B0.0>0 RECV_F1.0<0 F1.0 B1.0 SEND_B1.0>0",
]


def test_pass_output_for_1f1b_p2_m2_is_the_reference():
    schedule = build_schedule("1f1b", 2, 2)
    assert [" ".join(map(str, acts)) for acts in schedule.actions] == GOOD
    validate(make(GOOD, 2))


def test_1f1b_steady_state_batches_send_with_receive():
    # Megatron's send_forward_recv_backward / send_backward_recv_forward appear as two-member batches.
    acts = build_schedule("1f1b", 4, 8).actions[1]
    groups = [" ".join(str(a) for a in acts[i:j]) for i, j in batches(acts)]
    assert "SEND_F2.0>2 RECV_B0.0<2" in groups
    assert "SEND_B0.0>0 RECV_F3.0<0" in groups
    assert groups[0] == "RECV_F0.0<0"


def test_single_rank_needs_no_communication():
    s = build_schedule("interleaved-1f1b", 1, 3, 2)
    assert not any(a.is_comm for a in s.actions[0])


def test_same_rank_neighbours_hand_over_without_messages():
    # Stages 0,1 on rank 0 and 2,3 on rank 1: only the 1 -> 2 boundary crosses ranks.
    placement = [(0, 0), (0, 1), (1, 0), (1, 1)]
    compute = make(["F0.0 F0.1 F1.0 F1.1 B0.1 B0.0 B1.1 B1.0",
                    "F0.0 F0.1 B0.1 B0.0 F1.0 F1.1 B1.1 B1.0"], 2, 2, placement)
    s = insert_communication(compute)
    validate(s)
    assert [str(a) for a in s.actions[0] if a.is_comm] == [
        "SEND_F0.1>1", "SEND_F1.1>1", "RECV_B0.1<1", "RECV_B1.1<1"]
    assert [str(a) for a in s.actions[1] if a.is_comm] == [
        "RECV_F0.0<0", "SEND_B0.0>0", "RECV_F1.0<0", "SEND_B1.0>0"]


def test_receives_follow_the_senders_order_on_a_link():
    # Rank 1 consumes microbatch 1 first, but rank 0 sends 0 first: both receives go before F1.0.
    s = insert_communication(make(["F0.0 F1.0 B1.0 B0.0", "F1.0 F0.0 B1.0 B0.0"], 2))
    validate(s)
    assert " ".join(map(str, s.actions[1])) == (
        "RECV_F0.0<0 RECV_F1.0<0 F1.0 F0.0 B1.0 SEND_B1.0>0 B0.0 SEND_B0.0>0")


SPLIT_COMPUTE = ["F0.0 F1.0 F2.0 B0.0 B1.0 B2.0",
                 "F0.0 BI0.0 BW0.0 F1.0 BI1.0 BW1.0 F2.0 BI2.0 BW2.0"]


def test_pass_hoists_a_receive_only_where_a_send_would_block():
    s = insert_communication(make(SPLIT_COMPUTE, 3))
    validate(s)
    # Placed next to their consumers, rank 1 would post SEND_B0.0 alone while rank 0 posts SEND_F1.0 alone
    # (see test_deadlocking_pair_of_blocking_sends). The pass moves RECV_F1.0 (and likewise RECV_F2.0) into
    # the batch where rank 1 waits; rank 0, which never blocks, keeps its receives next to its backwards.
    assert " ".join(map(str, s.actions[1])) == (
        "RECV_F0.0<0 F0.0 BI0.0 SEND_B0.0>0 RECV_F1.0<0 BW0.0 F1.0 BI1.0 SEND_B1.0>0 RECV_F2.0<0 BW1.0 "
        "F2.0 BI2.0 SEND_B2.0>0 BW2.0")
    assert " ".join(map(str, s.actions[0])) == (
        "F0.0 SEND_F0.0>1 F1.0 SEND_F1.0>1 F2.0 SEND_F2.0>1 RECV_B0.0<1 B0.0 RECV_B1.0<1 B1.0 RECV_B2.0<1 B2.0")


def test_pass_rejects_lists_with_communication_or_missing_producers():
    with pytest.raises(ScheduleError, match=r"rank 0, action 1 \(SEND_F0.0>1\): .* already has communication"):
        insert_communication(make(GOOD, 2))
    with pytest.raises(ScheduleError, match=r"rank 1, action 1 \(F1.0\): needs RECV_F1.0<0, but rank 0 never"):
        insert_communication(make(["F0.0 B0.0", "F0.0 F1.0 B0.0 B1.0"], 2))
    with pytest.raises(ScheduleError, match=r"rank 0, action 1 \(F1.0\): its result goes to rank 1, which never"):
        insert_communication(make(["F0.0 F1.0 B0.0 B1.0", "F0.0 B0.0"], 2))


def test_pass_keeps_bookkeeping_actions_in_place():
    s = insert_communication(make(["F0.0 B0.0 REDUCE_GRAD.0 STEP", "F0.0 B0.0 REDUCE_GRAD.0 STEP"], 1))
    validate(s)
    assert " ".join(map(str, s.actions[0])) == "F0.0 SEND_F0.0>1 RECV_B0.0<1 B0.0 REDUCE_GRAD.0 STEP"


def test_pass_reports_a_compute_order_that_cannot_complete():
    # Rank 0 wants B0 before anything reached rank 1: no placement of messages can fix that.
    with pytest.raises(ScheduleError, match=r"deadlocks: rank 0, action 0: blocked on RECV_B0.0<1"):
        insert_communication(make(["B0.0 F0.0", "F0.0 B0.0"], 1))


# Hand-broken schedules -------------------------------------------------------------------------------------

def test_missing_backward():
    rows = [GOOD[0].replace(" B1.0", ""), GOOD[1]]
    rejects(make(rows, 2), 0, 2, "F1.0", r"no backward \(B1.0, or BI and BW\) follows")


def test_swapped_send_order_on_a_link():
    rows = ["F0.0 F1.0 SEND_F1.0>1 SEND_F0.0>1 RECV_B0.0<1 B0.0 RECV_B1.0<1 B1.0", GOOD[1]]
    rejects(make(rows, 2), 1, 0, "RECV_F0.0<0",
            r"message #0 on link 0->1 is received here but rank 0 sends SEND_F1.0>1 \(action 2\)")


def test_backward_before_forward():
    rows = [GOOD[0], "RECV_F0.0<0 B0.0 F0.0 SEND_B0.0>0 RECV_F1.0<0 F1.0 B1.0 SEND_B1.0>0"]
    rejects(make(rows, 2), 1, 1, "B0.0", "no stash to consume: F0.0 has not run before it")


def test_receive_without_send():
    rows = [GOOD[0].replace(" SEND_F1.0>1", ""), GOOD[1]]
    rejects(make(rows, 2), 1, 4, "RECV_F1.0<0", "no matching send: rank 0 sends only 1 messages to rank 1")


def test_send_without_receive():
    rows = [GOOD[0], GOOD[1].replace("RECV_F1.0<0 ", "")]
    rejects(make(rows, 2), 0, 3, "SEND_F1.0>1", "no matching receive: rank 1 receives only 1 messages")


def test_deadlocking_pair_of_blocking_sends():
    # Each rank posts a send alone (a compute separates it from its next receive): rank 0 waits in
    # SEND_F1.0 for rank 1, rank 1 waits in SEND_B0.0 for rank 0. With asynchronous sends this order would
    # finish; under blocking semantics it cannot.
    rows = ["F0.0 SEND_F0.0>1 F1.0 SEND_F1.0>1 F2.0 RECV_B0.0<1 B0.0 SEND_F2.0>1 RECV_B1.0<1 B1.0 RECV_B2.0<1 B2.0",
            "RECV_F0.0<0 F0.0 BI0.0 SEND_B0.0>0 BW0.0 RECV_F1.0<0 F1.0 BI1.0 SEND_B1.0>0 BW1.0 "
            "RECV_F2.0<0 F2.0 BI2.0 SEND_B2.0>0 BW2.0"]
    message = rejects(make(rows, 3), 0, 3, "SEND_F1.0>1", "deadlock under blocking send/receive")
    assert "rank 1, action 3: blocked on SEND_B0.0>0 (action 3)" in message
    # The pass, given the same compute order, places the messages so that it runs.
    compute = make([" ".join(t for t in row.split() if Action.parse(t).op not in COMM_OPS) for row in rows], 3)
    validate(insert_communication(compute))


def test_receive_after_its_consumer():
    rows = ["F0.0 SEND_F0.0>1 F1.0 SEND_F1.0>1 RECV_B0.0<1 B0.0 RECV_B1.0<1 B1.0",
            "F0.0 RECV_F0.0<0 B0.0 SEND_B0.0>0 RECV_F1.0<0 F1.0 B1.0 SEND_B1.0>0"]
    rejects(make(rows, 2), 1, 0, "F0.0", "needs RECV_F0.0<0 before it")


def test_send_before_its_producer():
    rows = ["SEND_F0.0>1 F0.0 F1.0 SEND_F1.0>1 RECV_B0.0<1 B0.0 RECV_B1.0<1 B1.0", GOOD[1]]
    rejects(make(rows, 2), 0, 0, "SEND_F0.0>1", "sends the result of F0.0, which has not run yet")


def test_result_never_sent():
    # Remove both ends of one message so links still agree; the producer is blamed.
    rows = [GOOD[0].replace(" SEND_F1.0>1", ""), GOOD[1].replace("RECV_F1.0<0 ", "")]
    rejects(make(rows, 2), 0, 2, "F1.0", r"its result is never sent to rank 1 \(no SEND_F1.0>1\)")


def test_wrong_peer_and_needless_message():
    s = build_schedule("1f1b", 3, 2)
    acts = [list(a) for a in s.actions]
    acts[0][1] = Action(Op.SEND_F, 0, 0, 2)
    rejects(dataclasses.replace(s, actions=acts), 0, 1, "SEND_F0.0>2", "neighbouring stage lives on rank 1, not 2")
    rows = ["F0.0 SEND_B0.0>1 B0.0", "F0.0 B0.0"]
    rejects(make(rows, 1, placement=[(0, 0), (1, 0)]), 0, 1, "SEND_B0.0>1", "no message is needed")


@pytest.mark.parametrize("rows, m, rank, index, action, reason", [
    (["F2.0 B2.0"], 2, 0, 0, "F2.0", r"microbatch 2 out of range \(m=2\)"),
    (["F0.1 B0.1"], 1, 0, 0, "F0.1", r"chunk 1 out of range \(1 chunks per rank\)"),
    (["F0.0 F0.0 B0.0"], 1, 0, 1, "F0.0", r"second forward .* \(first at action 0\)"),
    (["F0.0 B0.0 B0.0"], 1, 0, 2, "B0.0", "second backward"),
    (["F0.0 BW0.0"], 1, 0, 1, "BW0.0", "BW needs BI0.0 before it"),
    (["F0.0 BI0.0"], 1, 0, 1, "BI0.0", "BW0.0 never follows"),
    (["F0.0 B0.0"], 2, 0, 2, "end of list", "F1.0 never runs"),
    (["F0.0 B0.0 F1.0 REDUCE_GRAD.0 B1.0"], 2, 0, 4, "B1.0", r"already reduced at action 3, before this backward"),
    (["F0.0 B0.0 REDUCE_GRAD.0 REDUCE_GRAD.0"], 1, 0, 3, "REDUCE_GRAD.0", "chunk 0 already reduced at action 2$"),
    (["F0.0 BI0.0 REDUCE_GRAD.0 BW0.0"], 1, 0, 3, "BW0.0", r"already reduced at action 2, before this backward$"),
    # A stash leaves the device once per step, and what leaves must come back.
    (["F0.0 OFFLOAD0.0 OFFLOAD0.0 RELOAD0.0 B0.0"], 1, 0, 2, "OFFLOAD0.0", "already left the device once in this step$"),
    (["F0.0 OFFLOAD0.0 RELOAD0.0 OFFLOAD0.0 RELOAD0.0 B0.0"], 1, 0, 3, "OFFLOAD0.0", "already left the device once"),
    (["F0.0 OFFLOAD0.0"], 1, 0, 1, "OFFLOAD0.0", "stash 0.0 never comes back$"),
    (["F0.0 OFFLOAD0.0 B0.0"], 1, 0, 2, "B0.0", r"off the device since OFFLOAD0.0 \(action 1\); RELOAD0.0 must"),
    (["F0.0@0 F1.0@1 F2.0@2 B0.0@0 B1.0@1 B2.0@2"], 3, 0, 2, "F2.0@2", r"versions \[0, 1, 2\] at once"),
    (["F0.0@0 B0.0@1"], 1, 0, 1, "B0.0@1", "weight version 1 differs from its forward's 0"),
    (["F0.0 F1.0 BI0.0 BI1.0 BW1.0 BW0.0@1"], 2, 0, 5, "BW0.0@1", "differs from its forward's None"),
])
def test_single_rank_rules(rows, m, rank, index, action, reason):
    rejects(make(rows, m), rank, index, action, reason)


def test_rules_that_pass():
    # Two live versions, a split backward and a reduction after the chunk's last backward are all fine.
    validate(make(["F0.0@0 F1.0@1 B0.0@0 F2.0@1 B1.0@1 B2.0@1"], 3))
    # A backward (B, or BW of a split one) ends its stash's hold on its weight version: a third may start.
    validate(make(["F0.0@0 F1.0@1 B0.0@0 F2.0@2 B1.0@1 B2.0@2"], 3))
    validate(make(["F0.0@0 F1.0@1 BI0.0@0 BW0.0@0 F2.0@2 BI1.0@1 BW1.0@1 BI2.0@2 BW2.0@2"], 3))
    validate(make(["F0.0 F1.0 BI0.0 BI1.0 BW1.0 BW0.0 REDUCE_GRAD.0 STEP"], 2))
    validate(make(["F0.1 F0.0 B0.0 REDUCE_GRAD.0 B0.1 REDUCE_GRAD.1"], 1, 2, placement=[(0, 1), (0, 0)]))


def test_replay_reports_each_blocked_rank():
    blocked = RendezvousReplay([[Action.parse("SEND_F0.0>1")], [Action.parse("SEND_B0.0>0")]]).run()
    assert [b.describe() for b in blocked] == [
        "rank 0, action 0: blocked on SEND_F0.0>1 (action 0)",
        "rank 1, action 0: blocked on SEND_B0.0>0 (action 0)"]


def test_all_registered_builtins_validate_with_split_backward():
    # A pass that splits B into BI + BW must still get valid communication (BI sends the gradient).
    base = one_f_one_b(3, 4)
    split = [[x for a in acts for x in ((Action(Op.BI, a.microbatch, 0), Action(Op.BW, a.microbatch, 0))
                                         if a.op is Op.B else (a,))] for acts in base.actions]
    s = insert_communication(dataclasses.replace(base, actions=split))
    validate(s)
    assert "BI0.0 SEND_B0.0>1 BW0.0" in " ".join(map(str, s.actions[2]))


@pytest.mark.parametrize("peer", [0, 4])
def test_a_parking_transfer_must_name_another_rank_of_the_pipeline(peer):
    # EVICT/LOAD have no neighbouring stage to check their peer against: the range rule is theirs alone.
    schedule = build_schedule("bpipe", 4, 8)
    lists = [list(acts) for acts in schedule.actions]
    i = next(i for i, a in enumerate(lists[0]) if a.op is Op.EVICT)
    lists[0][i] = dataclasses.replace(lists[0][i], peer=peer)
    with pytest.raises(ScheduleError, match=rf"rank 0, action {i} \(EVICT3.0>{peer}\): peer {peer} is not another "
                                            "rank of 4$"):
        validate(dataclasses.replace(schedule, actions=lists))


def test_a_second_weight_gradient_of_one_microbatch_is_refused():
    # Split backward: BW adds the weight gradient once; a repeated BW would add it twice, silently.
    schedule = build_schedule("zb-h1", 2, 4)
    lists = [list(acts) for acts in schedule.actions]
    i = next(i for i, a in enumerate(lists[0]) if a.op is Op.BW)
    lists[0].insert(i + 1, lists[0][i])
    with pytest.raises(ScheduleError, match=rf"rank 0, action {i + 1} \(BW0.0\): second weight-gradient of this "
                                            rf"microbatch and chunk \(first at action {i}\)$"):
        validate(dataclasses.replace(schedule, actions=lists))


def test_an_input_from_a_stage_on_the_same_rank_must_be_computed_first():
    # Stages 0 and 1 both on rank 0: the hand-over is a computed result, not a message.
    two_chunks = {"v": 2, "placement": [(0, 0), (0, 1)]}
    rejects(make(["F0.1 F0.0 B0.1 B0.0"], 1, **two_chunks), 0, 0, "F0.1", r"needs F0.0 \(stage 0, same rank\) before it$")
    rejects(make(["F0.0 F0.1 B0.0 B0.1"], 1, **two_chunks), 0, 2, "B0.0", r"needs B0.1 \(stage 1, same rank\) before it$")
    validate(make(["F0.0 F0.1 B0.1 B0.0"], 1, **two_chunks))


def test_a_backward_needs_its_output_gradient_received_first():
    rows = [GOOD[0].replace("RECV_B1.0<1 B1.0", "B1.0 RECV_B1.0<1"), GOOD[1]]
    rejects(make(rows, 2), 0, 6, "B1.0", r"needs RECV_B1.0<1 before it$")


def test_layered_reductions_one_per_group_of_microbatches():
    def layered(row: str, m: int) -> Schedule:
        return dataclasses.replace(make([row], m), options={"microbatches_per_reduction": 1})
    every = "F0.0 B0.0 REDUCE_GRAD.0 F1.0 B1.0 REDUCE_GRAD.0 F2.0 B2.0 REDUCE_GRAD.0"
    validate(layered(every, 3))
    rejects(layered(every.rsplit(" ", 1)[0], 3), 0, 5, "REDUCE_GRAD.0",
            r"only 2 of the 3 reductions of chunk 0 \(one per 1 microbatches\): microbatches 2..2 are never reduced$")
    rejects(layered(every + " REDUCE_GRAD.0", 3), 0, 9, "REDUCE_GRAD.0",
            r"chunk 0 already reduced at action 8 \(3 per step, one per 1 microbatches\)$")
    # A backward of a group that was already reduced.
    rejects(layered("F0.0 F1.0 B0.0 REDUCE_GRAD.0 REDUCE_GRAD.0 B1.0", 2), 0, 5, "B1.0",
            r"gradients of chunk 0 were already reduced at action 4, before this backward$")


def test_a_deadlock_is_reported_at_the_first_unmatched_action_of_the_batch():
    # Rank 0 posts F0's send with both gradient receives; rank 1 needs F1 before it sends any gradient, and
    # rank 0 sends F1 only after that batch: both receives wait, the first is named.
    rows = ["F0.0 SEND_F0.0>1 RECV_B0.0<1 RECV_B1.0<1 F1.0 SEND_F1.0>1 B0.0 B1.0",
            "RECV_F0.0<0 F0.0 RECV_F1.0<0 F1.0 B0.0 SEND_B0.0>0 B1.0 SEND_B1.0>0"]
    message = rejects(make(rows, 2), 0, 2, "RECV_B0.0<1", "deadlock under blocking send/receive")
    assert "rank 1, action 2: blocked on RECV_F1.0<0 (action 2)" in message, message
