"""Small building blocks of the transformer: the norms (LayerNorm / RMSNorm, with a bf16 path that saves
only its low-precision input), rotary position embeddings (op by op, or one compiled kernel each way on
CUDA), and hidden dropout under the tensor-parallel RNG tracker."""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_pp.core.tensor_parallel import TENSOR_PARALLEL_RNG, RNGTracker, mark_replicated
from megatron_pp.models.config import TransformerConfig

Rotary = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [s, b, 1, head_dim / 2] in fp32


class Norm(nn.Module):
    """LayerNorm or RMSNorm over the hidden dim, computed in fp32 whatever the activation dtype.

    Weights are replicated on every TP rank. Under sequence parallelism each rank normalises only its
    rows, so its weight gradient is a partial sum: the parameters are tagged `sequence_parallel` and the
    training code sums their gradients over the TP group.

    With a bf16/fp16 input, autograd through the fp32 computation would keep the fp32 upcast of the
    input (4 bytes per element, twice the input itself) until the backward; `_LowPrecisionNorm` keeps
    only the input and recomputes the rest in the backward.
    """

    one_plus = False
    """Apply 1 + weight as the scale (--apply-layernorm-1p; the stored weight is zero-centred)."""

    def __init__(self, config: TransformerConfig, sequence_parallel: bool, device: Optional[torch.device]):
        super().__init__()
        self.eps = config.norm_epsilon
        self.one_plus = config.apply_layernorm_1p  # the scale applied is 1 + weight (--apply-layernorm-1p)
        shape = (config.hidden_size,)
        self.weight = nn.Parameter(torch.empty(shape, dtype=config.params_dtype, device=device))
        if config.normalization == "LayerNorm":
            self.bias = nn.Parameter(torch.empty(shape, dtype=config.params_dtype, device=device))
        else:
            self.register_parameter("bias", None)
        for param in self.parameters():
            mark_replicated(param)
            param.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 and torch.is_grad_enabled():
            return _LowPrecisionNorm.apply(x, self.weight, self.bias, self.eps, self.one_plus)
        return norm_fp32(x, self.weight, self.bias, self.eps, self.one_plus)


def norm_fp32(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
              one_plus: bool = False) -> torch.Tensor:
    """RMSNorm (`bias` None) or LayerNorm of `x` over its last dim in fp32, returned in `x`'s dtype.
    With `one_plus` the scale is 1 + weight, added in fp32 (a stored weight of 0.02 scales by 1.02)."""
    scale = weight.float() + 1.0 if one_plus else weight.float()
    if bias is None:
        y = F.rms_norm(x.float(), weight.shape, scale, eps)
    else:
        y = F.layer_norm(x.float(), weight.shape, scale, bias.float(), eps)
    return y.to(x.dtype)


class _LowPrecisionNorm(torch.autograd.Function):
    """`norm_fp32` that saves only its (bf16/fp16) input and parameters.

    The backward rebuilds the very same fp32 graph from them and differentiates it, so its gradients
    are bit-identical to autograd through `norm_fp32`; the fp32 upcast lives only inside the backward.
    Recomputing a norm is one read of the input, small beside the matmuls around it.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
                one_plus: bool) -> torch.Tensor:
        ctx.eps, ctx.one_plus = eps, one_plus
        ctx.save_for_backward(x, weight, bias)
        return norm_fp32(x, weight, bias, eps, one_plus)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        inputs = [None if t is None else t.detach().requires_grad_(need)
                  for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad)]
        wanted = [t for t in inputs if t is not None and t.requires_grad]
        with torch.enable_grad():
            y = norm_fp32(*inputs, ctx.eps, ctx.one_plus)
        found = iter(torch.autograd.grad(y, wanted, grad))
        return (*(next(found) if t is not None and t.requires_grad else None for t in inputs), None, None)


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, base: float) -> Rotary:
    """cos and sin of RoPE's angles `position * base^(-2i/d)` for positions `[b, s]`, as `[s, b, 1, d/2]`.
    `head_dim` is the rotated width d: `config.rotary_dim` (the whole head unless --rotary-percent < 1)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=position_ids.device) / head_dim)
    angles = position_ids.t().float().unsqueeze(-1) * inv_freq  # [s, b, d/2]
    return angles.cos().unsqueeze(2), angles.sin().unsqueeze(2)


def apply_rotary(x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """Rotate `[s, b, heads, d]` pairs (x_i, x_{i+d/2}) by RoPE's angles (the "rotate half" convention of
    Hugging Face's LLaMA, so converted checkpoints need no permutation of q and k).

    A rotation's backward is the rotation by the opposite angle, so `_Rotary` runs one function each way
    (about nine elementwise kernels op by op, one after `use_fused_rotary`) and keeps only cos and sin.
    """
    cos, sin = rotary
    rotated = 2 * cos.shape[-1]
    if rotated < x.shape[-1]:  # partial rotary (--rotary-percent): the last channels pass unrotated
        return torch.cat((apply_rotary(x[..., :rotated], rotary), x[..., rotated:]), dim=-1)
    if torch.is_grad_enabled() and not (cos.requires_grad or sin.requires_grad):
        return _Rotary.apply(x, cos, sin)
    return rotate(x, cos, sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE's rotation of `x` by the angles whose cos and sin are given, computed in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


_rotate_kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = rotate
"""What `_Rotary` runs, forward and backward: `rotate` op by op, or one fused kernel after
`use_fused_rotary()`."""


def use_fused_rotary(enabled: bool = True) -> None:
    """Run RoPE's rotation as one `torch.compile`-generated kernel each way instead of about nine.

    Compilation happens lazily, on the first rotation (seconds, once per process and shape). The fused
    kernel may contract multiply-adds, so its results can differ from the op-by-op path in the last bit
    of fp32; the op-by-op path (the default, and what the CPU tests run) matches the plain autograd
    formula exactly.
    """
    global _rotate_kernel
    _rotate_kernel = torch.compile(rotate, dynamic=None) if enabled else rotate


class _Rotary(torch.autograd.Function):
    """`rotate(x, cos, sin)`, saving only cos and sin: the gradient is `rotate(grad, cos, -sin)`, which
    is bit-identical to what autograd derives from `rotate` (negating a product is exact)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate_kernel(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate_kernel(grad, cos, -sin), None, None


def hidden_dropout(
    x: torch.Tensor, p: float, *, training: bool, sequence_parallel: bool, rng_tracker: RNGTracker
) -> torch.Tensor:
    """Dropout on the residual stream. Replicated across TP ranks it must draw the same mask everywhere
    (the default generator, seeded alike on all TP ranks); split by sequence it must differ per rank."""
    if not training or p == 0.0:
        return x
    with _fork_if(sequence_parallel, rng_tracker):
        return F.dropout(x, p)


def _fork_if(condition: bool, rng_tracker: RNGTracker) -> ContextManager:
    return rng_tracker.fork(TENSOR_PARALLEL_RNG) if condition else contextlib.nullcontext()
