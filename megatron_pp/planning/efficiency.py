"""How long one transformer layer takes per microbatch on one GPU: measured curves or a roofline model.

The BPipe estimator needs, for each microbatch size `b` and attention backend, the forward and backward
time of one layer's tensor-parallel shard, and the forward time of its attention core (what selective
recomputation re-runs). Two sources give them as `LayerTimes`:

- `MeasuredCurve`: the JSON that `tools/bench_layer.py` writes on a device (per backend and `b`:
  forward, backward and attention-core milliseconds, and the model FLOPs they did). Between measured
  sizes the MFU is interpolated linearly in `b`; beyond them the nearest measured MFU is used. When the
  measured layer shape differs from the job's, times are scaled by the FLOP ratio (same MFU), which is
  reported as a warning: MFU depends on shape, so measure the job's shape when it matters.
- `Roofline`: no measurement. Each kernel of the layer (`kernels`) takes `max(FLOPs / (peak ·
  matmul_efficiency), bytes / HBM bandwidth)`, with the device's datasheet numbers from a
  `HardwareProfile` and an achieved matmul efficiency taken from a published training run on that GPU
  (each built-in profile names its paper; 1.0 would be the pure roofline, an upper bound no system
  reaches). Byte counts assume bf16 activations and Megatron-style fused kernels
  (scale-mask-softmax, bias-GELU, bias-dropout-add, fp32 gradient accumulation in the weight-gradient
  GEMM). Unfused attention writes and re-reads the `b·a/t·s²` score, probability and dropout tensors;
  a flash kernel reads q, k, v and writes the output only, skips the masked half of a causal square
  (Dao, "FlashAttention-2", 2023, §3.1) and recomputes the scores in its backward (2.5× the forward's
  FLOPs: five matrix products instead of two).

Both add the tensor-parallel communication the single-device benchmark cannot see: two all-reduces of
the `s·b·h` activations in each of forward and backward (or, with sequence parallelism, the same volume
as all-gathers and reduce-scatters), timed as ring collectives, `2(t−1)/t · bytes / link bandwidth`,
and not overlapped with compute (Megatron-LM's default at the time of the papers).

Model FLOPs follow Megatron-LM's convention (matrix products only, the full `s×s` square for the
attention scores and context, backward = 2 × forward), so MFU = model FLOPs / (time × peak) compares
with published figures; recomputation adds time but no model FLOPs.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Mapping, Optional, Protocol, Sequence

from megatron_pp.models.config import TransformerConfig

BF16_BYTES = 2
FP32_BYTES = 4
BOOL_BYTES = 1
BENCH_FORMAT = "megatron_pp.bench_layer/1"


# Devices ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HardwareProfile:
    """What the estimator needs to know about one GPU model, each number with its source.

    Kept flat and JSON-serialisable (`load_hardware` reads the same fields from a file) so that the
    hardware profiles of the paper-reproduction work can extend it with more links and measured numbers.
    """

    name: str
    peak_tflops: float
    """Dense bf16 tensor-core peak, TFLOP/s."""
    memory_gib: float
    """Device memory, GiB."""
    hbm_gbps: float
    """Device-memory bandwidth, GB/s."""
    tp_link_gbps: float
    """Per-GPU, per-direction bandwidth inside a node (the tensor-parallel group), GB/s."""
    pair_link_gbps: float
    """Per-GPU, per-direction bandwidth between nodes (BPipe's evict/load pairs when not on one node), GB/s."""
    gpus_per_node: int = 8
    """GPUs joined by the intra-node link."""
    matmul_efficiency: float = 1.0
    """Fraction of the peak matrix products reach; 1.0 = pure roofline. The built-in profiles take it from
    a published end-to-end training throughput on that GPU, which also pays communication and bubbles,
    so it errs low (a conservative speed) rather than high."""
    collective_latency_s: float = 0.0
    """Fixed cost of one tensor-parallel collective, seconds, on top of its bytes over `tp_link_gbps`;
    0 = bandwidth only (NVLink's few microseconds are negligible at training sizes; gloo's are not)."""
    sources: Mapping[str, str] = field(default_factory=dict)
    """Field name -> where its number comes from."""

    def __post_init__(self) -> None:
        for name in ("peak_tflops", "memory_gib", "hbm_gbps", "tp_link_gbps", "pair_link_gbps", "gpus_per_node"):
            if getattr(self, name) <= 0:
                raise ValueError(f"hardware profile {self.name!r}: {name} must be > 0, got {getattr(self, name)}")
        if self.collective_latency_s < 0:
            raise ValueError(f"hardware profile {self.name!r}: collective_latency_s must be >= 0")
        if not 0 < self.matmul_efficiency <= 1:
            raise ValueError(f"hardware profile {self.name!r}: matmul_efficiency must be in (0, 1]")


_A100_DATASHEET = "NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web)"
_HDR_IB = ("HDR InfiniBand, 200 Gb/s = 25 GB/s per direction per adapter; one adapter per GPU as in the DGX A100 "
           "(8 single-port ConnectX-6 for compute); the BPipe paper names HDR InfiniBand, not the adapter count")

_A100_ACHIEVED = ("PipeOffload (arXiv 2503.01328, Fig. 1 and its offload-time formula) takes 220 TFLOP/s achieved "
                  "on A100 in training: 220 / 312 = 0.705")
_H100_ACHIEVED = ("Llama 3 (arXiv 2407.21783, §3.3.2, Table 4): 430 TFLOP/s per GPU, BF16 MFU 43%, pretraining the "
                  "405B model on 8,192 H100s: 430 / 989.5 = 0.435, an end-to-end figure (bubbles and communication "
                  "included), so a lower bound on the matmul efficiency. PipeOffload's public code assumes 440 TFLOP/s (0.445), "
                  "a code constant rather than a measurement; the published run is preferred")

A100_80GB = HardwareProfile(
    name="A100-SXM4-80GB",
    peak_tflops=312.0,
    memory_gib=80.0,
    hbm_gbps=2039.0,
    tp_link_gbps=300.0,
    pair_link_gbps=25.0,
    matmul_efficiency=0.705,
    sources={
        "peak_tflops": f"{_A100_DATASHEET}: BFLOAT16 Tensor Core 312 TFLOPS (624 with sparsity)",
        "memory_gib": "80 GB HBM2e (datasheet); nvidia-smi reports 81920 MiB",
        "hbm_gbps": f"{_A100_DATASHEET}: GPU memory bandwidth 2,039 GB/s (80GB SXM)",
        "tp_link_gbps": f"{_A100_DATASHEET}: NVLink 600 GB/s, i.e. 300 GB/s per direction",
        "pair_link_gbps": _HDR_IB,
        "gpus_per_node": "DGX A100 / HGX A100 baseboard: 8 GPUs per node",
        "matmul_efficiency": _A100_ACHIEVED,
    },
)
H100_SXM = HardwareProfile(
    name="H100-SXM5-80GB",
    peak_tflops=989.5,
    memory_gib=80.0,
    hbm_gbps=3350.0,
    tp_link_gbps=450.0,
    pair_link_gbps=50.0,
    matmul_efficiency=0.435,
    sources={
        "peak_tflops": "NVIDIA H100 Tensor Core GPU datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity (SXM)",
        "memory_gib": "H100 datasheet: 80 GB (SXM), taken as GiB: an upper bound, the driver reports a little less",
        "hbm_gbps": "H100 datasheet: GPU memory bandwidth 3.35 TB/s (SXM)",
        "tp_link_gbps": "H100 datasheet: NVLink 900 GB/s, i.e. 450 GB/s per direction",
        "pair_link_gbps": "NDR InfiniBand, 400 Gb/s = 50 GB/s per direction, one adapter per GPU (DGX H100)",
        "gpus_per_node": "DGX H100 / HGX H100 baseboard: 8 GPUs per node",
        "matmul_efficiency": _H100_ACHIEVED,
    },
)
H200_SXM = HardwareProfile(
    name="H200-SXM-141GB",
    peak_tflops=989.5,
    memory_gib=141.0,
    hbm_gbps=4800.0,
    tp_link_gbps=450.0,
    pair_link_gbps=50.0,
    matmul_efficiency=0.435,
    sources={
        "peak_tflops": "NVIDIA H200 Tensor Core GPU datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity (SXM)",
        "memory_gib": "H200 datasheet: 141 GB, taken as GiB: an upper bound, the driver reports a little less",
        "hbm_gbps": "H200 datasheet: GPU memory bandwidth 4.8 TB/s",
        "tp_link_gbps": "H200 datasheet: NVLink 900 GB/s, i.e. 450 GB/s per direction",
        "pair_link_gbps": "NDR InfiniBand, 400 Gb/s = 50 GB/s per direction, one adapter per GPU",
        "gpus_per_node": "HGX H200 baseboard: 8 GPUs per node",
        "matmul_efficiency": "no published H200 training throughput found: the H100's figure (same compute die and "
                             "clocks; the faster HBM only helps memory-bound kernels, which the roofline times by "
                             "bytes). " + _H100_ACHIEVED,
    },
)

HARDWARE_PROFILES: dict[str, HardwareProfile] = {"a100-80gb": A100_80GB, "h100-sxm": H100_SXM, "h200": H200_SXM}


def load_hardware(name_or_path: str) -> HardwareProfile:
    """A built-in profile by name (`HARDWARE_PROFILES`) or one read from a JSON file of the same fields."""
    if name_or_path in HARDWARE_PROFILES:
        return HARDWARE_PROFILES[name_or_path]
    if not name_or_path.endswith(".json"):
        raise ValueError(f"unknown hardware {name_or_path!r}: use one of {', '.join(HARDWARE_PROFILES)} "
                         "or a .json file")
    with open(name_or_path) as f:
        data = json.load(f)
    known = {f.name for f in fields(HardwareProfile)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{name_or_path}: unknown hardware fields {unknown}; known: {sorted(known)}")
    try:
        return HardwareProfile(**data)
    except TypeError as err:
        raise ValueError(f"{name_or_path}: {err}") from None


def hardware_for_device(device_name: str) -> Optional[HardwareProfile]:
    """The built-in profile whose GPU model appears in a CUDA device name, or None (CPU, unknown GPUs)."""
    lowered = device_name.lower()
    for needle, profile in (("h200", H200_SXM), ("h100", H100_SXM), ("a100", A100_80GB)):
        if needle in lowered:
            # PCIe and NVL variants have other peaks; only the SXM parts are described here.
            return None if ("pcie" in lowered or "nvl" in lowered) else profile
    return None


# Layer shape and FLOPs --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerShape:
    """One GPU's shard of a transformer layer: what `tools/bench_layer.py` runs and the roofline times."""

    hidden_size: int
    num_heads: int
    """Query heads on this GPU (a / t)."""
    num_query_groups: int
    """Key/value groups on this GPU (g / t)."""
    head_dim: int
    ffn_hidden_size: int
    """MLP width on this GPU (f / t)."""
    seq_length: int
    swiglu: bool
    rmsnorm: bool
    rope: bool
    bias: bool
    hidden_dropout: float
    attention_dropout: float
    tp: int = 1
    """Tensor-parallel size the shard comes from (for the communication the benchmark cannot see)."""
    sequence_parallel: bool = False
    activation_bytes: int = 2
    """Bytes per activation element the tensor-parallel collectives move (2: bf16/fp16; 4: fp32)."""

    @classmethod
    def from_config(cls, config: TransformerConfig, tp: int = 1, sequence_parallel: bool = False,
                    activation_bytes: int = 2) -> "LayerShape":
        config.validate(tp)
        return cls(
            hidden_size=config.hidden_size, num_heads=config.num_attention_heads // tp,
            num_query_groups=config.query_groups // tp, head_dim=config.head_dim,
            ffn_hidden_size=config.ffn_size // tp, seq_length=config.seq_length,
            swiglu=config.activation == "swiglu", rmsnorm=config.normalization == "RMSNorm",
            rope=config.position_embedding_type == "rope", bias=config.add_bias_linear,
            hidden_dropout=config.hidden_dropout, attention_dropout=config.attention_dropout,
            tp=tp, sequence_parallel=sequence_parallel and tp > 1, activation_bytes=activation_bytes,
        )

    def compute_key(self) -> tuple:
        """What decides the single-device compute (not the tp/SP it came from)."""
        d = asdict(self)
        d.pop("tp")
        d.pop("sequence_parallel")
        d.pop("activation_bytes")
        return tuple(sorted(d.items()))

    def forward_model_flops(self, micro_batch_size: int) -> float:
        """Matrix-product FLOPs of one forward (Megatron's convention: full s×s attention square)."""
        T = self.seq_length * micro_batch_size
        h, a, g, d, f = self.hidden_size, self.num_heads, self.num_query_groups, self.head_dim, self.ffn_hidden_size
        qkv = 2 * T * h * (a + 2 * g) * d
        core = 4 * T * self.seq_length * a * d
        projection = 2 * T * a * d * h
        mlp = 2 * T * h * f * (3 if self.swiglu else 2)
        return float(qkv + core + projection + mlp)

    def core_forward_model_flops(self, micro_batch_size: int) -> float:
        return float(4 * self.seq_length * micro_batch_size * self.seq_length * self.num_heads * self.head_dim)


@dataclass(frozen=True)
class LayerTimes:
    """Seconds of one layer shard for one microbatch on one GPU (communication included)."""

    forward_s: float
    backward_s: float
    core_forward_s: float
    """Forward of the attention core alone: what selective recomputation runs again."""
    model_flops: float
    """3 × forward model FLOPs (what MFU counts)."""
    weight_grad_s: float = 0.0
    """The share of `backward_s` that is the linear layers' weight-gradient GEMMs: what a split backward
    defers from BI to BW (`core.tensor_parallel.layers`); the rest, with the collectives, stays in BI."""

    def compute_s(self, recompute: str) -> float:
        """Forward + backward, plus what `recompute` re-runs before the backward."""
        extra = {"none": 0.0, "selective": self.core_forward_s, "full": self.forward_s}[recompute]
        return self.forward_s + self.backward_s + extra

    def mfu(self, peak_tflops: float, recompute: str = "none") -> float:
        return self.model_flops / (self.compute_s(recompute) * peak_tflops * 1e12)


class EfficiencyModel(Protocol):
    """Where layer times come from (`Roofline` or `MeasuredCurve`)."""

    def layer_times(self, micro_batch_size: int) -> LayerTimes: ...

    def describe(self) -> str: ...


# Roofline ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kernel:
    """One kernel of a layer: its FLOPs and the device-memory bytes it reads and writes."""

    name: str
    flops: float
    bytes: float

    def seconds(self, hw: HardwareProfile) -> float:
        return max(self.flops / (hw.peak_tflops * 1e12 * hw.matmul_efficiency), self.bytes / (hw.hbm_gbps * 1e9))


def _matmul(name: str, m: int, k: int, n: int) -> tuple[Kernel, list[Kernel]]:
    """Forward `[m, k] x [k, n]` and its two backward products. The weight gradient accumulates into an
    fp32 main-gradient buffer (read and written, 8 bytes per weight element), as Megatron-LM does."""
    A = BF16_BYTES
    flops = 2.0 * m * k * n
    forward = Kernel(name, flops, A * (m * k + k * n + m * n))
    return forward, [Kernel(name + " dgrad", flops, A * (m * n + k * n + m * k)),
                     Kernel(name + " wgrad", flops, A * (m * n + m * k) + 2 * FP32_BYTES * k * n)]


def _elementwise(name: str, read: float, write: float) -> tuple[Kernel, Kernel]:
    """A memory-bound kernel; its backward reads the output gradient and the saved input and writes the
    input gradient, taken as twice the forward's traffic."""
    return Kernel(name, 0.0, read + write), Kernel(name + " backward", 0.0, 2 * (read + write))


LINEAR_GEMMS = ("qkv", "projection", "fc1", "fc2")
"""The products of a layer with a weight: the ones whose weight gradient a split backward defers to BW."""


def kernels(shape: LayerShape, micro_batch_size: int,
            attention: str) -> tuple[list[Kernel], list[Kernel], list[Kernel]]:
    """(forward, backward, attention-core forward) kernels of one layer shard for one microbatch."""
    if attention not in ("unfused", "flash"):
        raise ValueError(f"attention {attention!r} is not one of unfused, flash")
    A, P, M = BF16_BYTES, BF16_BYTES, BOOL_BYTES
    s, b = shape.seq_length, micro_batch_size
    T = s * b
    rows = T // shape.tp if shape.sequence_parallel else T
    h, a, g, d, f = shape.hidden_size, shape.num_heads, shape.num_query_groups, shape.head_dim, shape.ffn_hidden_size
    fwd: list[Kernel] = []
    bwd: list[Kernel] = []

    def add_matmul(name: str, m: int, k: int, n: int) -> None:
        forward, backward = _matmul(name, m, k, n)
        fwd.append(forward)
        bwd.extend(backward)

    def add_elementwise(name: str, read: float, write: float) -> None:
        forward, backward = _elementwise(name, read, write)
        fwd.append(forward)
        bwd.append(backward)

    mask = M * rows * h if shape.hidden_dropout > 0 else 0
    add_elementwise("input norm", A * rows * h, A * rows * h)
    add_matmul("qkv", T, h, (a + 2 * g) * d)
    if shape.rope:
        add_elementwise("rope", A * T * (a + g) * d, A * T * (a + g) * d)

    core: list[Kernel] = []
    core_bwd: list[Kernel] = []
    square = b * a * s * s
    if attention == "unfused":
        if a > g:  # grouped-query attention: k and v repeated to every query head
            core.append(Kernel("expand kv", 0.0, 2 * A * T * (g + a) * d))
            core_bwd.append(Kernel("expand kv backward", 0.0, 2 * A * T * (g + a) * d))
        product = 2.0 * square * d
        core.append(Kernel("scores", product, 2 * A * T * a * d + P * square))
        core.append(Kernel("scale-mask-softmax", 0.0, 2 * P * square))
        if shape.attention_dropout > 0:
            core.append(Kernel("attention dropout", 0.0, 2 * P * square + M * square))
        core.append(Kernel("context", product, P * square + 2 * A * T * a * d))
        core_bwd += [Kernel("context dgrad", product, 2 * A * T * a * d + P * square),
                     Kernel("context wgrad", product, P * square + 2 * A * T * a * d)]
        if shape.attention_dropout > 0:
            core_bwd.append(Kernel("attention dropout backward", 0.0, 2 * P * square + M * square))
        core_bwd += [Kernel("softmax backward", 0.0, 3 * P * square),
                     Kernel("scores dgrad", product, P * square + 2 * A * T * a * d),
                     Kernel("scores wgrad", product, P * square + 2 * A * T * a * d)]
    else:
        causal = 0.5  # blocks above the diagonal are skipped
        qkv_out = A * T * (a + 2 * g) * d + A * T * a * d + FP32_BYTES * b * a * s
        core.append(Kernel("flash attention", causal * 4.0 * square * d, qkv_out))
        core_bwd.append(Kernel("flash attention backward", causal * 2.5 * 4.0 * square * d, 2 * qkv_out))
    fwd += core
    bwd += core_bwd

    add_matmul("projection", T, a * d, h)
    add_elementwise("bias-dropout-add", 2 * A * rows * h, A * rows * h + mask)
    add_elementwise("pre-mlp norm", A * rows * h, A * rows * h)
    add_matmul("fc1", T, h, f * (2 if shape.swiglu else 1))
    if shape.swiglu:
        add_elementwise("swiglu", 2 * A * T * f, A * T * f)
    else:
        add_elementwise("bias-gelu", A * T * f, A * T * f)
    add_matmul("fc2", T, f, h)
    add_elementwise("bias-dropout-add", 2 * A * rows * h, A * rows * h + mask)
    return fwd, bwd, core


def tp_communication_s(shape: LayerShape, micro_batch_size: int, hw: HardwareProfile) -> float:
    """Seconds of one layer's tensor-parallel collectives in one direction of the pass (forward or
    backward): two ring all-reduces of `s·b·h` activations (or the same volume as all-gather +
    reduce-scatter), each `collective_latency_s` plus its bytes over the link."""
    if shape.tp == 1:
        return 0.0
    volume = shape.activation_bytes * shape.seq_length * micro_batch_size * shape.hidden_size
    return 2 * (hw.collective_latency_s + 2 * (shape.tp - 1) / shape.tp * volume / (hw.tp_link_gbps * 1e9))


class Roofline:
    """Layer times from `kernels` on a `HardwareProfile` (see the module docstring)."""

    def __init__(self, shape: LayerShape, hardware: HardwareProfile, attention: str) -> None:
        self.shape, self.hardware, self.attention = shape, hardware, attention

    def layer_times(self, micro_batch_size: int) -> LayerTimes:
        fwd, bwd, core = kernels(self.shape, micro_batch_size, self.attention)
        comm = tp_communication_s(self.shape, micro_batch_size, self.hardware)
        weight_grads = {name + " wgrad" for name in LINEAR_GEMMS}
        return LayerTimes(
            forward_s=sum(k.seconds(self.hardware) for k in fwd) + comm,
            backward_s=sum(k.seconds(self.hardware) for k in bwd) + comm,
            core_forward_s=sum(k.seconds(self.hardware) for k in core),
            model_flops=3 * self.shape.forward_model_flops(micro_batch_size),
            weight_grad_s=sum(k.seconds(self.hardware) for k in bwd if k.name in weight_grads),
        )

    def describe(self) -> str:
        return (f"roofline on {self.hardware.name} ({self.hardware.peak_tflops:g} TFLOP/s, "
                f"{self.hardware.hbm_gbps:g} GB/s, matmul efficiency {self.hardware.matmul_efficiency:g}), "
                f"{self.attention} attention")


def head_times(config: TransformerConfig, micro_batch_size: int, tp: int, sequence_parallel: bool,
               hw: HardwareProfile) -> tuple[float, float]:
    """(forward, backward) seconds of the last stage's final norm, output layer and cross-entropy, by
    roofline whatever the layer source (the benchmark does not time the head). The cross-entropy's
    traffic follows `vocab_parallel_cross_entropy`: read the logits, write an fp32 copy, then max, subtract,
    exp, sum, divide passes over it (A + 36 bytes per logit); its backward updates it in place and casts
    it back (12 + A bytes per logit)."""
    A = BF16_BYTES
    T = config.seq_length * micro_batch_size
    rows = T // tp if sequence_parallel and tp > 1 else T
    h, vocab = config.hidden_size, config.padded_vocab_size(tp) // tp
    norm_fwd, norm_bwd = _elementwise("final norm", A * rows * h, A * rows * h)
    logits_fwd, logits_bwd = _matmul("logits", T, h, vocab)
    forward = [norm_fwd, logits_fwd, Kernel("cross-entropy", 0.0, (A + 36) * T * vocab)]
    backward = [norm_bwd, *logits_bwd, Kernel("cross-entropy backward", 0.0, (12 + A) * T * vocab)]
    return sum(k.seconds(hw) for k in forward), sum(k.seconds(hw) for k in backward)


def head_weight_grad_s(config: TransformerConfig, micro_batch_size: int, tp: int, hw: HardwareProfile) -> float:
    """Seconds of the output layer's weight-gradient GEMM (part of `head_times`' backward): what a split
    backward defers to BW when the output layer owns its weight (untied; a tied one stays in BI)."""
    vocab = config.padded_vocab_size(tp) // tp
    return _matmul("logits", config.seq_length * micro_batch_size, config.hidden_size, vocab)[1][1].seconds(hw)


# Measured curves ----------------------------------------------------------------------------------------


BACKEND_FOR_ATTENTION = {"unfused": ("reference",), "flash": ("flash", "sdpa")}


class MeasuredCurve:
    """Layer times from a `tools/bench_layer.py` JSON file (see the module docstring)."""

    def __init__(self, report: Mapping, shape: LayerShape, attention: str, hardware: HardwareProfile,
                 source: str = "<report>") -> None:
        if report.get("format") != BENCH_FORMAT:
            raise ValueError(f"{source}: not a bench_layer report (format {report.get('format')!r}, "
                             f"expected {BENCH_FORMAT!r})")
        self.source, self.shape, self.attention, self.hardware = source, shape, attention, hardware
        self.warnings: list[str] = []
        rows = report["results"]
        measured_backends = {r["backend"] for r in rows}
        backend = next((name for name in BACKEND_FOR_ATTENTION[attention] if name in measured_backends), None)
        if backend is None:
            raise ValueError(f"{source}: no measurement for {attention} attention (backends "
                             f"{'/'.join(BACKEND_FOR_ATTENTION[attention])}); rerun tools/bench_layer.py with them")
        self.backend = backend
        self.points = sorted(((r["micro_batch_size"], r) for r in rows if r["backend"] == backend),
                             key=lambda point: point[0])
        if LayerShape(**report["layer"]).compute_key() != shape.compute_key():
            self.warnings.append(f"{source} measured another layer shape; times scaled by FLOPs at equal MFU")
        device = report.get("device", {})
        if device.get("type") != "cuda":
            self.warnings.append(f"{source} was measured on {device.get('type', 'an unknown device')} "
                                 f"({device.get('name', '?')}): its MFU(b) says little about a GPU's")

    def _rate_at(self, micro_batch_size: int, key: str, flops_key: str) -> float:
        """Achieved FLOP/s of `key` ('forward_ms', ...), interpolated linearly in b, clamped at the ends."""
        rates = [(b, r[flops_key] / (r[key] / 1e3)) for b, r in self.points]
        if micro_batch_size <= rates[0][0]:
            return rates[0][1]
        if micro_batch_size >= rates[-1][0]:
            return rates[-1][1]
        for (b0, r0), (b1, r1) in zip(rates, rates[1:]):
            if b0 <= micro_batch_size <= b1:
                return r0 + (r1 - r0) * (micro_batch_size - b0) / (b1 - b0)
        raise AssertionError("unreachable: points are sorted")

    def layer_times(self, micro_batch_size: int) -> LayerTimes:
        flops = self.shape.forward_model_flops(micro_batch_size)
        core = self.shape.core_forward_model_flops(micro_batch_size)
        comm = tp_communication_s(self.shape, micro_batch_size, self.hardware)
        backward = 2 * flops / self._rate_at(micro_batch_size, "backward_ms", "backward_flops")
        return LayerTimes(
            forward_s=flops / self._rate_at(micro_batch_size, "forward_ms", "forward_flops") + comm,
            backward_s=backward + comm,
            core_forward_s=core / self._rate_at(micro_batch_size, "core_forward_ms", "core_forward_flops"),
            model_flops=3 * flops,
            # The weight GEMMs do the linear layers' forward FLOPs again, at the backward's measured rate.
            weight_grad_s=backward * (flops - core) / (2 * flops),
        )

    def describe(self) -> str:
        sizes = ", ".join(str(b) for b, _ in self.points)
        return f"measured {self.backend} layer times from {self.source} (b = {sizes})"

    @classmethod
    def from_file(cls, path: str, shape: LayerShape, attention: str, hardware: HardwareProfile) -> "MeasuredCurve":
        try:
            with open(path) as f:
                report = json.load(f)
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"--efficiency-file {path}: {err}") from None
        try:
            return cls(report, shape, attention, hardware, source=path)
        except (KeyError, TypeError) as err:
            raise ValueError(f"--efficiency-file {path}: malformed bench_layer report ({err})") from None


def mfu_curve(model: EfficiencyModel, sizes: Sequence[int], peak_tflops: float) -> list[tuple[int, float]]:
    """(b, MFU without recomputation) for each microbatch size: the curve the estimator works from."""
    return [(b, model.layer_times(b).mfu(peak_tflops)) for b in sizes]

