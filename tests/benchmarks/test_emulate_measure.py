"""The emulated step's figures from its records (megatron_pp/benchmarks/emulate_measure.py, `measure`), checked on
records written by hand, each figure worked out beside it. The grids report these per row (docs/benchmarks.md);
tests/benchmarks/test_emulate.py runs real emulations, whose figures it bounds but does not derive, so a figure
read from the wrong field (issue 37's seed-45 mutation survivor took the model's share from the waits) passed."""
import pytest

from megatron_pp.benchmarks.emulate_measure import measure

# compute records: (label, start, end, wait, own model time, cost, slack), seconds on the shared clock
RANKS = [
    {"started": 0.0, "events": [("F0", 0.0, 5.0)], "copies": [],
     "compute": [("F0", 1.0, 2.0, 0.0, 0.4, 1.0, 0.6), ("B0", 3.0, 5.0, 0.5, 1.0, 1.5, 0.5)]},
    {"started": 0.0, "events": [("F0", 0.0, 4.0)], "copies": [],
     "compute": [("F0", 2.0, 3.0, 0.0, 0.3, 1.0, 0.7)]},
]


def test_each_figure_from_its_field():
    out = measure(RANKS)
    assert out["step_s"] == pytest.approx(4.0)  # first compute start 1.0 to the last end 5.0
    assert out["busy_s"] == pytest.approx([2.5, 1.0])  # (2 - 1 - 0) + (5 - 3 - 0.5); 3 - 2 - 0
    assert out["bubble"] == pytest.approx(((4 - 2.5) / 4 + (4 - 1.0) / 4) / 2)
    assert out["model_share"] == pytest.approx((0.4 + 1.0 + 0.3) / 3.5)  # own model time over busy time
    assert out["overrun_s"] == pytest.approx(0.0)  # every action took exactly its cost net of its wait
    assert out["gap_s"] == pytest.approx(1.0)  # rank 0: B0 starts 1 s after F0 ends
    assert (out["slack_s"], out["least_slack_s"]) == pytest.approx((0.6, 0.5))
    assert (out["actions"], out["overran"], out["overran_actions"]) == (3, 0, [])
