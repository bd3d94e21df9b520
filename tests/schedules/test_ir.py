"""The schedule IR: action text form, Schedule placement lookups, text round trip, batches."""
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_pp.schedules.generators import looped_placement
from megatron_pp.schedules.ir import Action, Op, Schedule, ScheduleError, batches
from megatron_pp.schedules.registry import build_schedule

# Every operation in its canonical text form, with and without a weight version.
EXAMPLES = {
    "F3.1": Action(Op.F, 3, 1),
    "B3.1": Action(Op.B, 3, 1),
    "BI3.1": Action(Op.BI, 3, 1),
    "BW3.1": Action(Op.BW, 3, 1),
    "SEND_F3.1>2": Action(Op.SEND_F, 3, 1, peer=2),
    "RECV_F3.1<0": Action(Op.RECV_F, 3, 1, peer=0),
    "SEND_B3.1>0": Action(Op.SEND_B, 3, 1, peer=0),
    "RECV_B3.1<2": Action(Op.RECV_B, 3, 1, peer=2),
    "OFFLOAD3.1": Action(Op.OFFLOAD, 3, 1),
    "RELOAD3.1": Action(Op.RELOAD, 3, 1),
    "EVICT3.1>2": Action(Op.EVICT, 3, 1, peer=2),
    "LOAD3.1<2": Action(Op.LOAD, 3, 1, peer=2),
    "ACCEPT3.1<0": Action(Op.ACCEPT, 3, 1, peer=0),
    "RETURN3.1>0": Action(Op.RETURN, 3, 1, peer=0),
    "REDUCE_GRAD.1": Action(Op.REDUCE_GRAD, chunk=1),
    "STEP": Action(Op.STEP),
    "F3.1@1": Action(Op.F, 3, 1, version=1),
    "BW10.0@0": Action(Op.BW, 10, 0, version=0),
    "SEND_B12.3>7@1": Action(Op.SEND_B, 12, 3, peer=7, version=1),
    "STEP@2": Action(Op.STEP, version=2),
}


@pytest.mark.parametrize("text", sorted(EXAMPLES))
def test_text_form_round_trips(text):
    action = EXAMPLES[text]
    assert str(action) == text
    assert Action.parse(text) == action
    assert Action.parse(f"  {text} ") == action


def test_every_op_has_an_example():
    assert {a.op for a in EXAMPLES.values()} == set(Op)


@pytest.mark.parametrize("text", [
    "", "F", "F3", "3.1", "X3.1", "f3.1", "F3.1.2", "F-1.0", "F03.1", "F3.1>2", "SEND_F3.1<2", "RECV_B3.1>2",
    "SEND_F3.1", "REDUCE_GRAD3.1", "REDUCE_GRAD", "STEP.0", "STEP3", "F3.1@", "F3.1@x", "BX3.1", "LOAD3.1>2",
    "ACCEPT3.1>0", "RETURN3.1<0", "ACCEPT3.1", "RETURN.1>0",
])
def test_malformed_text_raises_naming_it(text):
    with pytest.raises(ValueError, match="cannot parse action") as err:
        Action.parse(text)
    assert repr(text.strip()) in str(err.value)


@pytest.mark.parametrize("kwargs, message", [
    ({"op": Op.F, "microbatch": 1}, "F needs a chunk"),
    ({"op": Op.SEND_F, "microbatch": 1, "chunk": 0}, "SEND_F needs a peer"),
    ({"op": Op.F, "microbatch": 1, "chunk": 0, "peer": 1}, "F takes no peer"),
    ({"op": Op.STEP, "chunk": 0}, "STEP takes no chunk"),
    ({"op": Op.F, "microbatch": -1, "chunk": 0}, "non-negative"),
    ({"op": Op.F, "microbatch": True, "chunk": 0}, "non-negative int"),
    ({"op": Op.F, "microbatch": 0, "chunk": 0, "version": -2}, "version"),
    ({"op": "NOPE"}, "NOPE"),
])
def test_action_rejects_bad_fields(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Action(**kwargs)


def test_action_accepts_op_as_string():
    assert Action("BI", 2, 0) == Action(Op.BI, 2, 0)
    assert Action(Op.SEND_F, 0, 0, 1).is_comm and not Action(Op.SEND_F, 0, 0, 1).is_compute
    assert Action(Op.BW, 0, 0).is_compute and not Action(Op.OFFLOAD, 0, 0).is_compute


def _empty(p: int, v: int, placement=None) -> Schedule:
    return Schedule("t", p, 1, v, looped_placement(p, v) if placement is None else placement, [[] for _ in range(p)])


def test_interleaved_placement_lookups():
    s = _empty(4, 2)
    assert s.num_stages == 8
    assert [s.location(k) for k in range(8)] == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (1, 1), (2, 1), (3, 1)]
    assert [s.stage_of(r, 1) for r in range(4)] == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="no stage 8"):
        s.location(8)
    with pytest.raises(ValueError, match="no chunk 2 on rank 0"):
        s.stage_of(0, 2)


@pytest.mark.parametrize("placement, message", [
    ([(0, 0), (1, 0), (0, 1)], "3 stages, expected"),
    ([(0, 0), (1, 0), (0, 1), (0, 1)], "stages 2 and 3 both placed on"),
    ([(0, 0), (2, 0), (0, 1), (1, 1)], "outside 2 ranks"),
])
def test_schedule_rejects_bad_placement(placement, message):
    with pytest.raises(ValueError, match=message):
        _empty(2, 2, placement)


def test_schedule_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_microbatches must be a positive int"):
        Schedule("t", 1, 0, 1, [(0, 0)], [[]])
    with pytest.raises(ValueError, match="2 action lists for 1 ranks"):
        Schedule("t", 1, 1, 1, [(0, 0)], [[], []])


def test_text_round_trip_of_a_built_schedule():
    schedule = build_schedule("interleaved-1f1b", 4, 8, 2)
    text = schedule.to_text()
    assert text.splitlines()[:6] == [
        "schedule: interleaved-1f1b", "ranks: 4", "microbatches: 8", "chunks: 2",
        "placement: 0.0 1.0 2.0 3.0 0.1 1.1 2.1 3.1", 'options: {"microbatch_group_size": 4}']
    assert text.splitlines()[6].startswith("rank 0: F0.0 SEND_F0.0>1 F1.0 SEND_F1.0>1")
    again = Schedule.from_text(text)
    assert again == schedule
    assert again.to_text() == text


@pytest.mark.parametrize("text, message", [
    ("schedule: x\nranks: 1\nmicrobatches: 1\nchunks: 1\nplacement: 0.0\n", "action lists for ranks"),
    ("schedule: x\nranks: 1\nchunks: 1\nplacement: 0.0\nrank 0: F0.0 B0.0\n", "lacks microbatches"),
    ("schedule: x\ncolour: red\n", "unknown key 'colour'"),
    ("schedule: x\nranks: 1\nmicrobatches: 1\nchunks: 1\nplacement: 0-0\nrank 0: F0.0\n", "bad placement entry"),
    ("schedule: x\nranks: 1\nmicrobatches: 1\nchunks: 1\nplacement: 0.0\nrank 0: F0.0 Q\n", "cannot parse action 'Q'"),
    ("just words\n", "line 1"),
])
def test_from_text_errors(text, message):
    with pytest.raises(ValueError, match=message):
        Schedule.from_text(text)


def test_batches_are_maximal_runs_of_communication():
    acts = [Action.parse(t) for t in "F0.0 SEND_F0.0>1 RECV_B0.0<1 B0.0 SEND_B0.0>0 F1.0 RECV_F2.0<0".split()]
    assert batches(acts) == [(1, 3), (4, 5), (6, 7)]
    assert batches([]) == []


def test_format_table_wraps_rows():
    s = Schedule("t", 2, 3, 1, looped_placement(2, 1), [
        [Action.parse(t) for t in "F0.0 SEND_F0.0>1 F1.0 F2.0 B0.0 B1.0 B2.0".split()],
        [Action.parse(t) for t in "F0.0 B0.0 F1.0 B1.0 F2.0 B2.0".split()],
    ])
    assert s.format_table(per_row=4) == (
        "rank 0 | F0.0 F1.0 F2.0 B0.0\n"
        "rank 1 | F0.0 B0.0 F1.0 B1.0\n"
        "\n"
        "rank 0 | B1.0 B2.0\n"
        "rank 1 | F2.0 B2.0")


def test_schedule_error_is_a_value_error():
    assert issubclass(ScheduleError, ValueError)


def test_pure_half_imports_without_torch():
    # Planners use the validator and simulator on machines without torch; make importing torch fail.
    code = ("import sys; sys.modules['torch'] = None\n"
            "from megatron_pp.schedules import ir, generators, comm, validate, simulate, registry\n"
            "print(simulate.simulate(registry.build_schedule('1f1b', 2, 2)).makespan)")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "9.0\n"
