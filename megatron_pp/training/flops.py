"""Floating-point operations of one training iteration, and model FLOPs utilisation (MFU).

Only matrix multiplications are counted: a product of an `[m, k]` and a `[k, n]` matrix is `2·m·k·n`
FLOPs (one multiply and one add per term). Norms, softmax, activations, dropout, rotary embeddings and
the optimizer are left out; in a transformer they are well under 1% of the total. Per token and per
layer, with hidden size `h`, sequence length `s`, `a` query heads of size `d`, `g` key/value groups
(grouped-query attention; `g = a` is plain multi-head attention) and MLP width `f`, a forward pass does

    QKV projection      2 · h · (a + 2g) · d      queries for every head, one key and one value per group
    attention scores    2 · s · a · d             q·kᵀ against all s keys, every head
    attention context   2 · s · a · d             probabilities times values, every head
    output projection   2 · a · d · h
    MLP                 2 · h · f · 2             GELU: fc1 and fc2
                        2 · h · f · 3             SwiGLU: gate, up and down

and the output layer adds `2 · h · V` per token, with `V` the vocabulary as padded for the embedding
(`TransformerConfig.padded_vocab_size(tp)`); the embedding lookup is a gather, not a product. The
scores and context use the full `s × s` square although a causal mask needs only half, as Megatron-LM
and the PaLM paper's MFU count it, so numbers compare with theirs.

Backward does two products per forward product (one for the input gradient, one for the weight
gradient), hence **model FLOPs = 3 × forward**. Recomputation re-runs forwards that the model FLOPs do
not count, so the work the hardware does is more:

    full recompute       + one forward of every recomputed layer (layers × 4 instead of × 3; the
                           output layer stays × 3: it is never recomputed). `--recompute-method block`
                           recomputes only `--recompute-num-layers` layers per chunk.
    selective recompute  + the attention scores and context of every layer (the core of attention).

Worked example, GPT-3 125M (h = 768, 12 heads of 64, f = 3072, 12 layers, s = 2048, V = 50304):
per token and layer 3,538,944 (QKV) + 3,145,728 (scores) + 3,145,728 (context) + 1,179,648 (output
projection) + 9,437,184 (MLP) = 20,447,232; times 12 layers plus 77,266,944 for the logits gives
322,633,728 forward FLOPs per token, 967,901,184 model FLOPs per trained token, 1.98 TFLOPs per
2048-token sequence.

MFU (model FLOPs utilisation, Chowdhery et al. 2022) divides the model FLOPs per second by the peak of
the hardware used, so recomputation lowers it; HFU divides the hardware FLOPs instead. The peak is the
device's dense bf16 tensor-core rate from NVIDIA's datasheets (`BF16_DENSE_PEAK_TFLOPS`) or
`--peak-tflops`; on a device not in the table, or on CPU, MFU is not reported rather than guessed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_pp.models.config import TransformerConfig

# Dense BF16 tensor-core peaks, TFLOP/s, matched against `torch.cuda.get_device_name()` in order (most
# specific name first: "H100 NVL" before "H100"). The datasheets list the rate *with 2:4 structured
# sparsity*; dense training runs at half of it, which is what is stored here:
#   A100 (SXM4 and PCIe, 40 and 80 GB): "NVIDIA A100 Tensor Core GPU" datasheet, BFLOAT16 Tensor Core
#       312 TFLOPS | 624 TFLOPS with sparsity (nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/
#       nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf).
#   H100: "NVIDIA H100 Tensor Core GPU" datasheet, BF16 Tensor Core 1,979 TFLOPS (SXM), 1,671 (NVL),
#       1,513 (PCIe), all with sparsity.
#   H200 (and GH200, the same GH100 compute): "NVIDIA H200 Tensor Core GPU" datasheet, BF16 Tensor Core
#       1,979 TFLOPS (SXM), 1,671 (NVL), with sparsity.
BF16_DENSE_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200 NVL", 1671 / 2),
    ("H200", 1979 / 2),
    ("H100 NVL", 1671 / 2),
    ("H100 PCIe", 1513 / 2),
    ("H100", 1979 / 2),
    ("A100", 624 / 2),
)


@dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs of one transformer layer for one token, by matmul (see the module docstring)."""

    qkv: int
    scores: int
    context: int
    projection: int
    mlp: int

    @property
    def attention_core(self) -> int:
        """What selective recomputation re-runs: scores and context."""
        return self.scores + self.context

    @property
    def total(self) -> int:
        return self.qkv + self.scores + self.context + self.projection + self.mlp


@dataclass(frozen=True)
class IterationFlops:
    """FLOPs of one training iteration (forward and backward of a global batch)."""

    model: int
    """3 × forward: what MFU and TFLOP/s per GPU count."""
    hardware: int
    """model + recomputed forwards: what the devices execute (HFU)."""


def layer_flops_per_token(config: TransformerConfig) -> LayerFlops:
    h, s, d = config.hidden_size, config.seq_length, config.head_dim
    heads, groups, f = config.num_attention_heads, config.query_groups, config.ffn_size
    mlp_matrices = 3 if config.activation == "swiglu" else 2
    return LayerFlops(
        qkv=2 * h * (heads + 2 * groups) * d,
        scores=2 * s * heads * d,
        context=2 * s * heads * d,
        projection=2 * heads * d * h,
        mlp=2 * h * f * mlp_matrices,
    )


def logits_flops_per_token(config: TransformerConfig, tp: int = 1) -> int:
    return 2 * config.hidden_size * config.padded_vocab_size(tp)


def iteration_flops(
    config: TransformerConfig,
    global_batch_size: int,
    *,
    tp: int = 1,
    recompute_granularity: Optional[str] = None,
    recomputed_layers: Optional[int] = None,
) -> IterationFlops:
    """FLOPs of one iteration over `global_batch_size` sequences of `config.seq_length` tokens.

    `recompute_granularity` is None, "full" or "selective"; with "full", `recomputed_layers` is how many
    layers of the whole model are re-run in the backward (default: all of them).
    """
    tokens = global_batch_size * config.seq_length
    layer = layer_flops_per_token(config)
    forward = tokens * (config.num_layers * layer.total + logits_flops_per_token(config, tp))
    if recompute_granularity is None:
        extra = 0
    elif recompute_granularity == "full":
        layers = config.num_layers if recomputed_layers is None else recomputed_layers
        if not 0 <= layers <= config.num_layers:
            raise ValueError(f"recomputed_layers {layers} outside [0, --num-layers {config.num_layers}]")
        extra = tokens * layers * layer.total
    elif recompute_granularity == "selective":
        extra = tokens * config.num_layers * layer.attention_core
    else:
        raise ValueError(f"--recompute-granularity {recompute_granularity!r} is not one of full, selective")
    return IterationFlops(model=3 * forward, hardware=3 * forward + extra)


def device_peak_tflops(device_name: str) -> Optional[float]:
    """Dense bf16 peak of a CUDA device from its name, or None when the table does not know it."""
    lowered = device_name.lower()
    for needle, peak in BF16_DENSE_PEAK_TFLOPS:
        if needle.lower() in lowered:
            return peak
    return None


def peak_tflops(device: torch.device, override: Optional[float] = None) -> Optional[float]:
    """`override` (--peak-tflops) if given, else the table's value for `device`; None on CPU."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    return device_peak_tflops(torch.cuda.get_device_name(device))
