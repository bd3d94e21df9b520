"""The emulated runs' cost sets (megatron_pp/benchmarks/emulate.py, `cost_model`), figure by figure.

The emulator's grids charge every action these costs, so a wrong ratio (a backward of 3 forwards where the docs
say 2) shifts every emulated row while the emulator itself still agrees with the simulator under the same wrong
costs, which is what tests/benchmarks/test_emulate.py checks. Here each cost is held to its definition: `equal`
F = 1, B = 2, BI = BW = 1 unit; `split` F = 1, B = 2 units, B divided into BI and BW as the committed
split-backward measurement (docs/results/split_backward_cpu.json) says."""
import json

import pytest

from megatron_pp.benchmarks.emulate import SPLIT_BACKWARD_JSON, cost_model

UNIT = 0.003


def test_equal_costs_are_one_two_one_one_units():
    costs = cost_model("equal", UNIT)
    assert (costs.forward, costs.backward, costs.backward_input, costs.backward_weight) == (
        UNIT, 2 * UNIT, UNIT, UNIT)


def test_split_costs_divide_a_two_unit_backward_as_measured():
    measured = json.loads(SPLIT_BACKWARD_JSON.read_text())
    costs = cost_model("split", UNIT)
    assert costs.forward == UNIT and costs.backward == pytest.approx(2 * UNIT, rel=1e-12)
    assert costs.backward_input == pytest.approx(2 * UNIT * measured["input_over_whole"], rel=1e-12)
    assert costs.backward_input + costs.backward_weight == pytest.approx(
        2 * UNIT * measured["split_over_whole"], rel=1e-12)  # the split backward costs more than the whole
    assert 0 < costs.backward_input < costs.backward and costs.backward_weight > 0


def test_an_unknown_cost_set_is_named():
    with pytest.raises(ValueError, match="unknown cost set 'other'"):
        cost_model("other", UNIT)
