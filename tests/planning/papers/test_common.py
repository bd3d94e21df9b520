"""The paper reproductions time a schedule with the planner's own cost function (`cost.compute_costs`)."""
import pytest

from megatron_pp.planning.efficiency import LayerShape, Roofline, head_weight_grad_s
from megatron_pp.planning.papers.common import chunk_costs, load_hardware_profile, load_setting
from megatron_pp.schedules.ir import Op


def test_a_split_backward_is_timed_from_its_weight_gradient_gemms_not_halved():
    """BW = the stage's weight-gradient GEMMs (the untied output layer's on the last stage), BI = B − BW:
    a zero-bubble or GIS row is timed as the planner times it, never with BI = BW = B/2."""
    setting = load_setting("pipeoffload_5.8b", "gis")
    hw, _ = load_hardware_profile("a100-80gb")
    specs = setting.stages(setting.chunks())
    shape = LayerShape.from_config(setting.config, setting.tp, setting.args.sequence_parallel)
    layer = Roofline(shape, hw, "flash").layer_times(setting.micro_batch)
    costs = chunk_costs(setting, hw, specs, layer, 1.0, True)
    head = head_weight_grad_s(setting.config, setting.micro_batch, setting.tp, hw)
    assert setting.config.untie_embeddings_and_output_weights
    for spec in specs:
        s = spec.stage
        expected = spec.num_layers * layer.weight_grad_s + (head if spec.has_head else 0.0)
        if not expected:
            continue  # a stage of the embedding alone: no GEMM to time (each op gets the simulator's floor)
        assert costs[(Op.BW, s)] == pytest.approx(expected)
        assert costs[(Op.BI, s)] + costs[(Op.BW, s)] == pytest.approx(costs[(Op.B, s)])
        assert costs[(Op.BW, s)] < costs[(Op.BI, s)]  # the attention core's backward is all BI
    assert (Op.BI, 0) not in chunk_costs(setting, hw, specs, layer, 1.0, False)
