"""FLOPs formula against hand counts, recompute variants, and the peak-TFLOP/s table."""
from __future__ import annotations

import pytest
import torch

from megatron_pp.models.presets import get_preset
from megatron_pp.training.flops import device_peak_tflops, iteration_flops, layer_flops_per_token, peak_tflops


def test_gpt3_125m_matches_a_hand_count():
    # h = 768, 12 heads of 64 (MHA), f = 3072 (GELU), 12 layers, s = 2048, vocabulary 50257 -> 50304.
    qkv = 2 * 768 * (3 * 768)  # 3,538,944
    scores = context = 2 * 2048 * 768  # 3,145,728 each
    projection = 2 * 768 * 768  # 1,179,648
    mlp = 2 * 2 * 768 * 3072  # 9,437,184
    layer = qkv + scores + context + projection + mlp
    assert layer == 20_447_232
    forward_per_token = 12 * layer + 2 * 768 * 50304
    assert forward_per_token == 322_633_728
    flops = iteration_flops(get_preset("gpt3-125m"), global_batch_size=8)
    assert flops.model == flops.hardware == 3 * forward_per_token * 8 * 2048
    assert flops.model == 15_858_092_998_656  # ~1.98 TFLOPs per 2048-token sequence


def test_llama3_8b_counts_grouped_query_attention_and_swiglu():
    # h = 4096, 32 query heads of 128, 8 key/value groups, f = 14336 (SwiGLU: three matrices), 32 layers,
    # s = 8192, vocabulary 128256 (already a multiple of 128), untied output layer.
    config = get_preset("llama3-8b")
    layer = layer_flops_per_token(config)
    assert layer.qkv == 2 * 4096 * (32 + 2 * 8) * 128 == 50_331_648
    assert layer.scores == layer.context == 2 * 8192 * 32 * 128 == 67_108_864
    assert layer.projection == 2 * 4096 * 4096
    assert layer.mlp == 3 * 2 * 4096 * 14336 == 352_321_536
    forward_per_token = 32 * 570_425_344 + 2 * 4096 * 128256
    assert layer.total == 570_425_344
    assert iteration_flops(config, 1).model == 3 * forward_per_token * 8192


def test_recompute_adds_the_recomputed_forwards():
    config = get_preset("gpt3-125m")
    tokens = 4 * 2048
    layer = layer_flops_per_token(config)
    base = iteration_flops(config, 4)
    full = iteration_flops(config, 4, recompute_granularity="full")
    block = iteration_flops(config, 4, recompute_granularity="full", recomputed_layers=3)
    selective = iteration_flops(config, 4, recompute_granularity="selective")
    assert full.model == block.model == selective.model == base.model  # MFU's numerator never changes
    assert full.hardware - base.hardware == tokens * 12 * layer.total  # layers x 4, logits x 3
    assert block.hardware - base.hardware == tokens * 3 * layer.total
    assert selective.hardware - base.hardware == tokens * 12 * (layer.scores + layer.context)
    with pytest.raises(ValueError, match="recompute-granularity"):
        iteration_flops(config, 4, recompute_granularity="partial")


def test_padded_vocabulary_depends_on_tensor_parallel_size():
    config = get_preset("gpt3-125m")  # 50257 -> 50304 at tp 1, 51200 at tp 8
    difference = iteration_flops(config, 1, tp=8).model - iteration_flops(config, 1, tp=1).model
    assert difference == 3 * 2048 * 2 * 768 * (51200 - 50304)


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100-PCIE-40GB", 312.0),
    ("NVIDIA H100 80GB HBM3", 989.5),
    ("NVIDIA H100 PCIe", 756.5),
    ("NVIDIA H100 NVL", 835.5),
    ("NVIDIA H200", 989.5),
    ("NVIDIA H200 NVL", 835.5),
    ("NVIDIA GH200 480GB", 989.5),
    ("NVIDIA GeForce RTX 4090", None),
    ("Tesla V100-SXM2-32GB", None),
])
def test_peak_table_matches_device_names(name, peak):
    assert device_peak_tflops(name) == peak


def test_peak_is_none_on_cpu_unless_given():
    assert peak_tflops(torch.device("cpu")) is None
    assert peak_tflops(torch.device("cpu"), override=123.0) == 123.0


def test_layers_recomputed_for_the_flops_count_follow_the_recompute_method():
    # Block recompute re-runs only the first N layers of each stage; uniform and selective count as
    # "all layers" (None) in `iteration_flops`, which then charges selective its attention core only.
    from types import SimpleNamespace

    from megatron_pp.models.recompute import RecomputeConfig
    from megatron_pp.training.train import _recomputed_layers

    pipe = SimpleNamespace(layout=[SimpleNamespace(num_layers=3), SimpleNamespace(num_layers=1)])
    assert _recomputed_layers(RecomputeConfig("full", "block", 2), pipe) == 2 + 1
    assert _recomputed_layers(RecomputeConfig("full", "uniform", 2), pipe) is None
    assert _recomputed_layers(RecomputeConfig("selective"), pipe) is None
    assert _recomputed_layers(RecomputeConfig(), pipe) is None
