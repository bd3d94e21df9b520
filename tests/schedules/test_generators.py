"""Generators (GPipe, 1F1B, interleaved 1F1B) and the registry that turns names into validated schedules."""
from pathlib import Path

import pytest

from megatron_pp.schedules import generators
from megatron_pp.schedules.generators import (gpipe, group_order, interleaved_1f1b, looped_placement,
                                              one_f_one_b)
from megatron_pp.schedules.ir import Action, Op, Schedule
from megatron_pp.schedules.registry import (build_schedule, get_schedule, list_schedules, register_schedule,
                                            registered_schedules, unregister_schedule)
from megatron_pp.schedules.validate import validate


@pytest.mark.parametrize("fn, schedule", [
    (gpipe, lambda: gpipe(4, 8)),
    (one_f_one_b, lambda: one_f_one_b(4, 8)),
    (interleaved_1f1b, lambda: interleaved_1f1b(4, 8, 2)),
])
def test_docstring_tables_are_the_generated_lists(fn, schedule):
    doc = "\n".join(line.strip() for line in fn.__doc__.splitlines())
    assert schedule().format_table() in doc


def _compute(schedule: Schedule, rank: int) -> list[str]:
    return [str(a) for a in schedule.actions[rank]]


def _leading_forwards(actions: list[Action]) -> int:
    return next((i for i, a in enumerate(actions) if a.op is not Op.F), len(actions))


def test_gpipe_runs_all_forwards_then_all_backwards_in_order():
    s = gpipe(3, 4)
    for rank in range(3):
        assert _compute(s, rank) == [f"F{i}.0" for i in range(4)] + [f"B{i}.0" for i in range(4)]
    assert s.placement == [(0, 0), (1, 0), (2, 0)] and s.name == "gpipe"


@pytest.mark.parametrize("p", [1, 2, 4, 7])
@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_one_f_one_b_warmup_and_pairs(p, m):
    s = one_f_one_b(p, m)
    for rank in range(p):
        warmup = min(p - rank - 1, m)
        acts = s.actions[rank]
        # Warm-up forwards, then the first steady forward (if any), then backwards in order.
        assert _leading_forwards(acts) == min(warmup + 1, m)
        assert [a.microbatch for a in acts if a.op is Op.B] == list(range(m))
        assert [a.microbatch for a in acts if a.op is Op.F] == list(range(m))
        steady = acts[warmup:warmup + 2 * (m - warmup)]
        assert [a.op for a in steady] == [Op.F, Op.B] * (m - warmup)


def test_one_f_one_b_p4_m8_rank1():
    assert " ".join(_compute(one_f_one_b(4, 8), 1)) == (
        "F0.0 F1.0 F2.0 B0.0 F3.0 B1.0 F4.0 B2.0 F5.0 B3.0 F6.0 B4.0 F7.0 B5.0 B6.0 B7.0")


def test_group_order_example_and_last_partial_group():
    assert group_order(5, 2, 2) == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1), (4, 0), (4, 1)]
    assert group_order(3, 2, 4) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]


def test_looped_placement():
    assert looped_placement(3, 2) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]


@pytest.mark.parametrize("p, m, v, g", [(4, 8, 2, None), (2, 6, 3, None), (4, 12, 2, 6), (3, 5, 2, None)])
def test_interleaved_warmup_and_orders(p, m, v, g):
    s = interleaved_1f1b(p, m, v, g)
    group = p if g is None else g
    order = group_order(m, v, group)
    for rank in range(p):
        acts = s.actions[rank]
        assert [(a.microbatch, a.chunk) for a in acts if a.op is Op.F] == order
        assert [(a.microbatch, a.chunk) for a in acts if a.op is Op.B] == [(i, v - 1 - c) for i, c in order]
        warmup = min(2 * (p - rank - 1) + (v - 1) * group, m * v)
        assert _leading_forwards(acts) == min(warmup + 1, m * v)
    assert s.options == {"microbatch_group_size": group}
    assert s.placement == looped_placement(p, v)


def test_interleaved_with_one_chunk_is_one_f_one_b():
    for p, m in [(1, 3), (4, 8), (5, 3)]:
        assert interleaved_1f1b(p, m, 1).actions == one_f_one_b(p, m).actions


def test_interleaved_rejects_small_groups_and_deadlocking_remainders():
    with pytest.raises(ValueError, match="group size of at least the pipeline size"):
        interleaved_1f1b(4, 8, 2, group_size=2)
    with pytest.raises(ValueError, match="positive int"):
        interleaved_1f1b(4, 8, 2, group_size=0)
    with pytest.raises(ValueError, match=r"p=4, m=5, v=3, group size 4 deadlocks: its last group holds 1"):
        interleaved_1f1b(4, 5, 3)


@pytest.mark.parametrize("call", [lambda: gpipe(0, 4), lambda: one_f_one_b(2, 0),
                                  lambda: interleaved_1f1b(2, 4, 0), lambda: one_f_one_b(2.0, 4)])
def test_generators_reject_bad_sizes(call):
    with pytest.raises(ValueError, match="must be a positive int"):
        call()


def test_every_accepted_grid_point_validates():
    """Generator -> communication -> validation over p <= 8, m <= 16, v <= 4 (the registry path)."""
    rejected = []
    for p in range(1, 9):
        for m in range(1, 17):
            build_schedule("gpipe", p, m)
            build_schedule("1f1b", p, m)
            for v in range(2, 5):
                try:
                    build_schedule("interleaved-1f1b", p, m, v)
                except ValueError as err:
                    assert "deadlocks: its last group" in str(err)
                    rejected.append((p, m, v))
    # Only short last groups are ever rejected: m a multiple of p, or m < p, always builds.
    assert rejected and all(m > p and 0 < m % p < p for p, m, v in rejected)
    assert (4, 5, 3) in rejected and (4, 5, 2) not in rejected


# Registry -------------------------------------------------------------------------------------------------

def test_builtin_names_and_aliases():
    names = [e.name for e in registered_schedules()]
    assert {"gpipe", "1f1b", "interleaved-1f1b"} <= set(names) and names == sorted(names)
    assert {"gpipe", "1f1b", "pipedream-flush", "interleaved-1f1b"} <= set(list_schedules())
    assert list_schedules() == sorted(list_schedules())
    assert get_schedule("pipedream-flush").name == "1f1b"
    assert get_schedule("interleaved-1f1b").options == ("microbatch_group_size",)
    flush = build_schedule("pipedream-flush", 4, 8)
    assert flush.name == "1f1b" and flush == build_schedule("1f1b", 4, 8)


def test_build_applies_options_and_validates():
    s = build_schedule("interleaved-1f1b", 4, 12, 2, microbatch_group_size=6)
    assert s.options == {"microbatch_group_size": 6}
    assert any(a.op is Op.SEND_F for a in s.actions[0])
    validate(s)


def test_build_errors():
    with pytest.raises(ValueError, match=r"unknown --pipeline-schedule 'no-such-schedule'; known: 1f1b, (.+, )?gpipe, "):
        build_schedule("no-such-schedule", 4, 8)
    with pytest.raises(ValueError, match="--num-layers-per-virtual-pipeline-stage"):
        build_schedule("1f1b", 4, 8, 2)
    with pytest.raises(ValueError, match=r"'gpipe' rejects options \['group'\].*its options: none"):
        build_schedule("gpipe", 4, 8, group=2)


def _toy_builder(num_ranks, num_microbatches, num_chunks, reverse=False):
    """All forwards then all backwards over a looped placement, optionally backwards newest first."""
    mbs = range(num_microbatches)
    order = list(reversed(mbs)) if reverse else list(mbs)
    actions = []
    for _ in range(num_ranks):
        acts = [Action(Op.F, i, c) for c in range(num_chunks) for i in mbs]
        acts += [Action(Op.B, i, c) for c in reversed(range(num_chunks)) for i in order]
        actions.append(acts)
    return Schedule("toy", num_ranks, num_microbatches, num_chunks, looped_placement(num_ranks, num_chunks),
                    actions, {"reverse": reverse})


def test_plugin_registers_like_a_builtin():
    register_schedule("toy-bfs", _toy_builder, aliases=("toy",), supports_virtual=True,
                      description="test plugin: breadth-first")
    try:
        s = build_schedule("toy", 3, 4, 2, reverse=True)
        assert s.name == "toy-bfs" and s.options == {"reverse": True}
        assert [str(a) for a in s.actions[2] if a.is_compute][-4:] == ["B3.0", "B2.0", "B1.0", "B0.0"]
        assert "toy-bfs" in [e.name for e in registered_schedules()]
        assert {"toy-bfs", "toy"} <= set(list_schedules())
        with pytest.raises(ValueError, match="already registered"):
            register_schedule("toy", _toy_builder, supports_virtual=False, description="again")
    finally:
        unregister_schedule("toy-bfs")
    with pytest.raises(ValueError, match="unknown --pipeline-schedule 'toy'"):
        build_schedule("toy", 3, 4, 2)


def test_registry_catches_a_builder_returning_other_sizes():
    register_schedule("toy-wrong", lambda p, m: generators.one_f_one_b(p, m + 1), supports_virtual=False,
                      description="returns m+1 microbatches")
    try:
        with pytest.raises(ValueError, match=r"returned a schedule for .* \(2, 4, 1\), asked for \(2, 3, 1\)"):
            build_schedule("toy-wrong", 2, 3)
    finally:
        unregister_schedule("toy-wrong")


def test_group_sizes_above_p_build_without_a_replay_when_groups_are_long_enough():
    # The docstring's promise: m a multiple of g, m <= g, or a last group of at least p microbatches.
    for p in (2, 3, 4):
        for v in (2, 3):
            for g in (p + 1, p + 2):
                for m in range(1, 13):
                    if m % g == 0 or m <= g or m % g >= p:
                        s = build_schedule("interleaved-1f1b", p, m, v, microbatch_group_size=g)
                        assert s.options == {"microbatch_group_size": g}


def test_docs_page_shows_the_generated_1f1b_table():
    page = (Path(__file__).resolve().parents[2] / "docs" / "schedules.md").read_text()
    assert one_f_one_b(4, 8).format_table() in page


def _generators():
    from megatron_pp.schedules import generators, gis, looped, twobw, vshape, zero_bubble
    return {  # name -> (generator, its sizes in a valid call)
        "gpipe": (generators.gpipe, {"num_ranks": 2, "num_microbatches": 4}),
        "1f1b": (generators.one_f_one_b, {"num_ranks": 2, "num_microbatches": 4}),
        "interleaved-1f1b": (generators.interleaved_1f1b, {"num_ranks": 2, "num_microbatches": 4, "num_chunks": 2}),
        "gis": (gis.gis, {"num_ranks": 2, "num_microbatches": 4, "num_chunks": 2}),
        "gis-uniform": (gis.uniform_repeating, {"num_ranks": 2, "num_microbatches": 4, "num_chunks": 2}),
        "looped-bfs": (looped.looped_bfs, {"num_ranks": 2, "num_microbatches": 4, "num_chunks": 2}),
        "2bw": (twobw.two_bw, {"num_ranks": 2, "num_microbatches": 4, "steps": 2}),
        "zb-h1": (zero_bubble.zb_h1, {"num_ranks": 2, "num_microbatches": 4}),
        "zb-h2": (zero_bubble.zb_h2, {"num_ranks": 2, "num_microbatches": 4}),
        "zb-v": (vshape.zb_v, {"num_ranks": 2, "num_microbatches": 4}),
        "v-half": (vshape.v_half, {"num_ranks": 2, "num_microbatches": 4}),
    }


@pytest.mark.parametrize("name", sorted(_generators()))
def test_every_generator_refuses_sizes_that_are_not_positive_ints_naming_the_argument(name):
    """One check (`ir.positive_int`) for every generator: 0, a negative, a bool and a float are refused for
    each size with a line that names it, and the smallest size, 1, is accepted where the schedule allows it."""
    generate, sizes = _generators()[name]
    assert generate(**sizes).num_ranks == sizes["num_ranks"]
    for arg in sizes:
        for bad in (0, -1, True, 2.0):
            with pytest.raises(ValueError, match=f"^{arg} must be a positive int, got {bad!r}$"):
                generate(**{**sizes, arg: bad})
    one = generate(**{**sizes, "num_ranks": 1})
    assert one.num_ranks == 1 and all(any(a.op.name == "F" for a in acts) for acts in one.actions)
