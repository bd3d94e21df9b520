"""split_layers: golden splits (even, interleaved, uneven first/last rank, embedding/loss accounting), the
invariants every split keeps, and the one-line errors for splits that do not add up."""
import pytest

from megatron_pp.core.parallel_state import LayoutError
from megatron_pp.models.layout import StageSpec, split_layers


def ranges(specs):
    return [(s.layer_start, s.layer_end) for s in specs]


def test_even_split():
    specs = split_layers(8, 4)
    assert specs == [
        StageSpec(0, 0, 2, has_embedding=True, has_head=False),
        StageSpec(1, 2, 4, has_embedding=False, has_head=False),
        StageSpec(2, 4, 6, has_embedding=False, has_head=False),
        StageSpec(3, 6, 8, has_embedding=False, has_head=True),
    ]


def test_single_stage_holds_everything():
    assert split_layers(4, 1) == [StageSpec(0, 0, 4, has_embedding=True, has_head=True)]


def test_interleaved_split_is_in_global_stage_order():
    assert ranges(split_layers(8, 2, 2)) == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_docstring_example_last_rank_lighter():
    # Last rank (1) owns global stages 1 and 3: 2 layers, one per chunk; rank 0's stages share the rest.
    assert ranges(split_layers(10, 2, 2, last_stage_layers=2)) == [(0, 4), (4, 5), (5, 9), (9, 10)]


def test_first_stage_layers():
    assert ranges(split_layers(10, 4, first_stage_layers=1)) == [(0, 1), (1, 4), (4, 7), (7, 10)]


def test_first_and_last_stage_layers_interleaved():
    # pp=4, vp=2: rank 0 = stages 0, 4 (2 layers each); rank 3 = stages 3, 7 (1 each); 12 left over 4 stages.
    counts = [s.num_layers for s in split_layers(18, 4, 2, first_stage_layers=4, last_stage_layers=2)]
    assert counts == [2, 3, 3, 1, 2, 3, 3, 1]


def test_first_stage_may_hold_only_the_embedding():
    specs = split_layers(6, 3, first_stage_layers=0)
    assert ranges(specs) == [(0, 0), (0, 3), (3, 6)]
    assert specs[0].has_embedding and specs[0].num_layers == 0


def test_account_for_embedding_and_loss_3p_minus_2():
    for p in (2, 4):
        specs = split_layers(3 * p - 2, p, 3, account_for_embedding=True, account_for_loss=True)
        counts = [s.num_layers for s in specs]
        assert counts == [0] + [1] * (3 * p - 2) + [0]
        assert specs[0].has_embedding and not specs[0].has_head
        assert specs[-1].has_head and not specs[-1].has_embedding


def test_account_for_one_side():
    assert [s.num_layers for s in split_layers(7, 4, account_for_embedding=True)] == [1, 2, 2, 2]
    assert [s.num_layers for s in split_layers(7, 4, account_for_loss=True)] == [2, 2, 2, 1]


@pytest.mark.parametrize(
    "args,kwargs",
    [
        ((12, 4), {}),
        ((12, 2, 3), {}),
        ((13, 4), {"first_stage_layers": 4}),
        ((14, 4), {"first_stage_layers": 2, "last_stage_layers": 0}),
        ((10, 4), {"account_for_embedding": True, "account_for_loss": True}),
        ((5, 1), {"first_stage_layers": 5}),
    ],
)
def test_invariants(args, kwargs):
    num_layers, pp = args[0], args[1]
    vp = args[2] if len(args) > 2 else 1
    specs = split_layers(*args, **kwargs)
    assert len(specs) == pp * vp
    assert [s.stage for s in specs] == list(range(pp * vp))
    assert specs[0].layer_start == 0 and specs[-1].layer_end == num_layers
    for a, b in zip(specs, specs[1:]):
        assert a.layer_end == b.layer_start
    assert [s.has_embedding for s in specs] == [True] + [False] * (pp * vp - 1)
    assert [s.has_head for s in specs] == [False] * (pp * vp - 1) + [True]


@pytest.mark.parametrize(
    "args,kwargs,message",
    [
        ((10, 4), {}, "--num-layers 10 is not divisible by 4 pipeline stages"),
        ((8, 2, 3), {}, "--num-layers 8 is not divisible by 6 pipeline stages"),
        ((10, 4), {"account_for_embedding": True},
         r"--num-layers 10 \+ 1 \(--account-for-embedding-in-pipeline-split\) is not divisible by 4"),
        ((11, 4), {"first_stage_layers": 2, "last_stage_layers": 2}, "leaves 7 layers, which do not split evenly"),
        ((4, 4), {"first_stage_layers": 3, "last_stage_layers": 3}, "leaves -2 layers"),
        ((8, 2, 2), {"first_stage_layers": 3}, "--decoder-first-pipeline-num-layers 3 must be >= 0 and divisible"),
        ((6, 2, 2), {"first_stage_layers": 0}, "global pipeline stage 2 would hold no layer"),
        ((4, 1), {"first_stage_layers": 2, "last_stage_layers": 2}, "name the same rank"),
        ((4, 1), {"first_stage_layers": 3}, "leaves 1 layers"),
        ((8, 2), {"first_stage_layers": 4, "account_for_loss": True}, "cannot be combined"),
        ((8, 0), {}, "--pipeline-model-parallel-size 0"),
    ],
)
def test_bad_splits_raise_one_line(args, kwargs, message):
    with pytest.raises(LayoutError, match=message) as info:
        split_layers(*args, **kwargs)
    assert "\n" not in str(info.value)
