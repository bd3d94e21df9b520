"""The norm's and RoPE's autograd Functions against plain autograd through the same formulas.

The norm's Function keeps its bf16/fp16 input instead of the fp32 upcast; RoPE's runs one function each
way, which `use_fused_rotary` can compile into one kernel. Outputs and gradients must be bit-identical
to autograd through `norm_fp32` / `rotate` (the model's formulas before the Functions), what autograd
saves is checked with saved-tensor hooks, and a whole bf16 model gives bit-identical gradients with and
without the Functions, with and without activation recomputation.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_pp.data.mock import MockData
from megatron_pp.models import layers, ops
from megatron_pp.models.presets import get_preset
from megatron_pp.models.ops import apply_rotary, norm_fp32, rotary_cos_sin, rotate
from megatron_pp.models.recompute import RecomputeConfig
from megatron_pp.models.transformer import build_model

S, B, H = 6, 3, 32
LOW = [torch.bfloat16, torch.float16]


def saved_tensors(fn, *args) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`fn(*args)` and every tensor autograd saved for its backward."""
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, saved


def grads_of(out: torch.Tensor, inputs: list[torch.Tensor], seed: int = 0) -> list[torch.Tensor]:
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    return list(torch.autograd.grad(out, inputs, upstream))


def norm_inputs(dtype: torch.dtype, layer_norm: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(S, B, H, generator=g) * 3 + 1).to(dtype).requires_grad_()
    weight = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype).requires_grad_()
    bias = (0.1 * torch.randn(H, generator=g)).to(dtype).requires_grad_() if layer_norm else None
    return [x, weight, bias]


def run_norm(inputs: list, eps: float = 1e-5) -> torch.Tensor:
    x, weight, bias = inputs
    module = ops.Norm.__new__(ops.Norm)
    torch.nn.Module.__init__(module)
    module.weight, module.eps = weight, eps
    module.bias = bias
    return module(x)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("layer_norm", [False, True], ids=["RMSNorm", "LayerNorm"])
def test_low_precision_norm_is_bit_identical_and_keeps_no_fp32_copy(dtype, layer_norm):
    inputs = norm_inputs(dtype, layer_norm)
    wanted = [t for t in inputs if t is not None]
    ref, ref_saved = saved_tensors(norm_fp32, *inputs, 1e-5)
    out, out_saved = saved_tensors(run_norm, inputs)
    assert out.dtype == dtype and torch.equal(out, ref)
    for got, expected in zip(grads_of(out, wanted), grads_of(ref, wanted)):
        assert got.dtype == dtype and torch.equal(got, expected)
    x = inputs[0]
    # Plain autograd keeps an fp32 upcast of the input; the Function keeps the input itself and the parameters.
    assert any(t.dtype == torch.float32 and t.numel() >= x.numel() for t in ref_saved)
    assert all(t.dtype == dtype for t in out_saved)
    assert sum(t.numel() for t in out_saved) == sum(t.numel() for t in wanted)


def test_fp32_norm_and_no_grad_use_the_plain_formula():
    inputs = norm_inputs(torch.float32, True)
    _, saved = saved_tensors(run_norm, inputs)
    assert any(t is inputs[0] for t in saved)  # autograd's own rms/layer_norm, which saves x itself
    with torch.no_grad():
        low = norm_inputs(torch.bfloat16, False)
        assert torch.equal(run_norm(low), norm_fp32(*low, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_is_bit_identical_and_keeps_cos_and_sin_once(dtype):
    g = torch.Generator().manual_seed(2)
    positions = torch.randint(0, 1000, (B, S), generator=g)  # per-sequence positions, as packed documents have
    cos, sin = rotary_cos_sin(positions, 16, 10000.0)
    x = torch.randn(S, B, 4, 16, generator=g).to(dtype).requires_grad_()
    ref, ref_saved = saved_tensors(rotate, x, cos, sin)
    out, out_saved = saved_tensors(apply_rotary, x, (cos, sin))
    assert out.dtype == dtype and torch.equal(out, ref)
    (got,), (expected,) = grads_of(out, [x]), grads_of(ref, [x])
    assert got.dtype == dtype and torch.equal(got, expected)
    # Plain autograd also keeps nothing but cos and sin (each twice); the Function keeps each once.
    assert {id(t) for t in ref_saved} == {id(cos), id(sin)}
    assert len(out_saved) == 2 and out_saved[0] is cos and out_saved[1] is sin


def model_gradients(preset: str, dtype: torch.dtype, plain: bool, recompute: RecomputeConfig, monkeypatch):
    with monkeypatch.context() as patch:
        if plain:  # the formulas as plain autograd sees them
            patch.setattr(ops.Norm, "forward", lambda self, x: norm_fp32(x, self.weight, self.bias, self.eps))
            patch.setattr(layers, "apply_rotary", lambda x, rotary: rotate(x, *rotary))
        config = dataclasses.replace(get_preset(preset), params_dtype=dtype)
        model = build_model(config, seed=3)
        model.recompute = recompute
        for batch in MockData(3, config.seq_length, config.vocab_size, 2, 4).step_microbatches(0, 0):
            (model(None, batch) * batch["loss_mask"]).sum().backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny"])
def test_bf16_model_gradients_are_bit_identical(preset, monkeypatch):
    reference = model_gradients(preset, torch.bfloat16, True, RecomputeConfig(), monkeypatch)
    for recompute in (RecomputeConfig(), RecomputeConfig("full", "uniform", 2)):
        grads = model_gradients(preset, torch.bfloat16, False, recompute, monkeypatch)
        for name, ref in reference.items():
            assert torch.equal(grads[name], ref), (recompute, name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused rotation is compiled for CUDA")
def test_fused_rotary_matches_the_op_by_op_path():
    device = torch.device("cuda")
    positions = torch.arange(128, device=device).expand(2, 128)
    cos, sin = rotary_cos_sin(positions, 64, 10000.0)
    x = torch.randn(128, 2, 8, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    ref = apply_rotary(x, (cos, sin))
    (ref_grad,) = grads_of(ref, [x])
    ops.use_fused_rotary()
    try:
        out = apply_rotary(x, (cos, sin))
        (grad,) = grads_of(out, [x])
    finally:
        ops.use_fused_rotary(False)
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)  # bf16 outputs, fp32 arithmetic either way
    torch.testing.assert_close(grad, ref_grad, rtol=1e-2, atol=1e-2)
