"""The skip-ahead draw itself (megatron_pp/models/init.py, `_draw_normal_ranges`), not through `_normal_ranges`.

`_normal_ranges` checks once per process that skipping reproduces torch's normal draw and otherwise falls back to
drawing the full tensor, so a broken skip (issue 37's seed-45 mutation survivors: an odd draw count not skipped,
the skip to the last 16 elements dropped) still gave the right values, through the fallback, and
tests/models/test_init.py passed on them while every rank drew whole tensors. Here the skip path is held to the
full draw directly, at sizes whose tail (the last 16 elements, drawn apart) sits at an odd draw count, and the
self-check must find it sound on this torch."""
import pytest
import torch

from megatron_pp.models import init as transformer_init


def _full(seed: int, numel: int) -> torch.Tensor:
    return torch.empty(numel).normal_(0.0, 0.5, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("numel, ranges", [
    (37, [(0, 3), (30, 37)]),             # odd size: the tail starts 21 draws on
    (45, [(40, 45)]),                     # the tail only
    (100, [(5, 20), (90, 100)]),          # even size, not a multiple of 16
    (999, [(33, 40), (111, 130), (977, 999)]),
    (4099, [(4000, 4099)]),
])
def test_skipping_draws_exactly_the_slices_of_the_full_draw(numel, ranges):
    full = _full(11, numel)
    got = transformer_init._draw_normal_ranges(11, numel, 0.5, ranges)
    assert torch.equal(got, torch.cat([full[a:b] for a, b in ranges])), (numel, ranges)


def test_the_skip_path_is_the_one_that_runs():
    transformer_init._skipping_reproduces_normal.cache_clear()
    assert transformer_init._skipping_reproduces_normal() is True
