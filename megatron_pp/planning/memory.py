"""Bytes one pipeline stage holds: saved activations per microbatch, weights, gradients, optimizer state.

The activation formulas count, tensor by tensor, what autograd keeps for the backward of one transformer
layer of `megatron_pp.models.transformer` (deduplicated by storage, as `ActivationStore` counts it), for
one microbatch of `b` sequences of `s` tokens on one GPU of a `tp`-way tensor-parallel group. They follow
the derivation of Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
(2022, §4), and reproduce its `s·b·h·(34 + 5·a·s/h)` bytes for a GPT layer in half precision with dropout
(see `layer_activation_terms`). Symbols: `s` sequence, `b` microbatch, `h` hidden, `a` query heads, `g`
key/value groups, `d` head size, `f` MLP width, `t` tensor-parallel size, `A` bytes per activation
element, `P` bytes per element of the s×s attention tensors, `M` bytes per dropout-mask element.

Per layer, no recomputation (rows = `s·b`, or `s·b/t` for tensors in the sequence-parallel region):

    norm inputs          2 · rows · h · A          the residual stream entering each norm
    norm statistics      2 · rows · (2|1) · 4      fp32 mean and 1/std (LayerNorm) or 1/rms (RMSNorm)
    linear inputs        2 · rows · h · A          norm outputs read by QKV and fc1
    q, k, v              distinct storages · A     q and k of the score product, v of the context product;
                                                   views of the fused QKV output count its whole storage
                                                   (`(a + 2g)·d/t` per token), RoPE outputs and GQA
                                                   expansions count `a·d/t` or `g·d/t` each
    projection input     s·b · a·d/t · A           attention output, read by the output projection
    MLP                  s·b · 2f/t · A            GELU: fc1 output and GELU output
                         s·b · 4f/t · A            SwiGLU: fc1 output (2f), silu(gate), silu(gate)·up
    residual dropout     2 · rows · h · M          masks, only when hidden dropout > 0
    core, unfused        s·b · a·s/t · P           softmax output (`5·a·s²·b` in Korthikanti et al. =
                       + s·b · a·s/t · (M + P)     2 + 1 + 2 bytes: probabilities, dropout mask,
                                                   dropped probabilities; the last two only with
                                                   attention dropout)
    core, flash          s·b · a/t · 4             fp32 log-sum-exp per query row; the kernel recomputes
                                                   the s×s block tensors in its backward (Dao et al.
                                                   2022), so nothing quadratic in s is kept

GPT-3 in bf16 with dropout, MHA (g = a), t = 1: 2h·2 + 2h·2 + 3h·2 + h·2 + 8h·2 + 2h·1 = 34·h bytes per
token, plus 5·a·s bytes per token for the unfused attention: Korthikanti's `s·b·h·(34 + 5·a·s/h)`. The
statistics of the two norms (16 bytes per token) are the only addition; the paper leaves them out.

Tensor parallelism divides everything inside attention and the MLP by `t`; the norm inputs and outputs
and the residual dropout masks are replicated on every tensor-parallel rank unless sequence parallelism
splits them along the sequence (`rows = s·b/t`): Korthikanti's `s·b·h·(10 + 24/t + 5·a·s/(h·t))`
without, `s·b·h·(34 + 5·a·s/h)/t` with sequence parallelism.

Recomputation: **full** keeps only each layer's input (`rows · h · A`) and re-runs the layer in the
backward, so one layer's complete set is rebuilt transiently (`transient_activation_bytes`);
**selective** (Korthikanti §5) checkpoints the attention core: it keeps the core's inputs q, k, v
(unexpanded under grouped-query attention) and re-runs the core in the backward, dropping the s×s
tensors of the unfused path, or only the log-sum-exp of a flash kernel (then it saves little and costs a
second flash forward).

Per stash, once per stage (not per layer): RoPE's fp32 cos and sin (`2·s·b·d/2·4`, shared by the
stage's layers), the token ids (int64) and position ids on the embedding stage, and on the head stage the
final norm, the output layer's input, the cross-entropy's fp32 softmax over this rank's vocabulary shard
(`s·b·V/t·4`, the largest single tensor of a small model), its target ids and the loss mask.

Implementation-dependent dtypes are gathered in `Numerics`. Which profile matches what:

- `CPU_FP32`: this repository's model on CPU in fp32, validated against `ActivationStore`
  (tests/planning/test_memory.py). Backend `reference` is the **unfused** formula: it materialises the
  s×s probabilities (fp32) and keeps a `[s, s]` bool causal mask per layer. Backend `sdpa` on CPU runs
  PyTorch's flash kernel for CPU (`_scaled_dot_product_flash_attention_for_cpu`) and is the **flash**
  formula, but only without attention dropout: with dropout SDPA's CPU path falls back to its math
  kernel, which keeps scaled copies of q and k besides the s×s tensors; that case is not modelled.
  On CPU, dropout masks are stored in the activation dtype (PyTorch's fused bool-mask dropout is a
  CUDA kernel), hence `M = 4`.
- `MEGATRON_BF16`: Megatron-LM-style bf16 training on GPU, used for the paper predictions: bool dropout
  masks (`M = 1`, `native_dropout`), bf16 softmax output of the fused scale-mask-softmax kernel
  (`P = 2`), fused norms that keep only their input and fp32 statistics, no stored causal mask. This
  repository's own bf16 GPU path differs in small ways (its norms keep their bf16 input but no fp32
  statistics, recomputing them in the backward; its `reference` attention computes in fp32) and is not
  what the papers ran.

Weights, gradients and optimizer state follow Megatron-LM's table ("Distributed Optimizer", Megatron
Core developer guide): bf16 parameters with fp32 gradients and fp32 Adam (master copy, two moments) take
18 bytes per parameter, or `6 + 12/dp` with the distributed optimizer (ZeRO-1); fp32 parameters with fp32
gradients take 16, or `8 + 12/dp` here (Megatron-LM's table says `8 + 8/dp`; our distributed optimizer
keeps an fp32 copy of its shard even when the parameters are fp32).
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_pp.models.config import TransformerConfig
from megatron_pp.models.layout import StageSpec

ATTENTION_KINDS = ("unfused", "flash")
RECOMPUTE_OPTIONS = ("none", "selective", "full")
DEFAULT_RESERVED_FRACTION = 0.10
"""Share of device memory kept out of the activation budget for the CUDA context, NCCL buffers, kernel
workspaces and allocator fragmentation. An assumption, not a measurement: docs/bpipe.md shows how the
answers move with it."""


@dataclass(frozen=True)
class Numerics:
    """Dtypes and kernel choices that decide the byte size of saved tensors (see the module docstring)."""

    name: str
    activation_bytes: int
    """A: bytes per element of ordinary activations (2 for bf16/fp16, 4 for fp32)."""
    attention_probs_bytes: int
    """P: bytes per element of the unfused path's s×s probabilities (and their dropped copy)."""
    dropout_mask_bytes: int
    """M: bytes per dropout-mask element (1: CUDA's bool mask; the activation dtype on CPU)."""
    rmsnorm_saves_normalized: bool
    """Whether RMSNorm keeps its fp32 normalised input besides the input (PyTorch's composite rms_norm)."""
    saves_causal_mask: bool
    """Whether the unfused path keeps a [s, s] bool mask per layer (this repo's `reference` backend)."""


CPU_FP32 = Numerics("this repository's model, fp32 on CPU", activation_bytes=4, attention_probs_bytes=4,
                    dropout_mask_bytes=4, rmsnorm_saves_normalized=True, saves_causal_mask=True)
MEGATRON_BF16 = Numerics("Megatron-LM-style bf16 on GPU", activation_bytes=2, attention_probs_bytes=2,
                         dropout_mask_bytes=1, rmsnorm_saves_normalized=False, saves_causal_mask=False)

FP32_STAT_BYTES = 4
INDEX_BYTES = 8  # int64 token ids / targets
BOOL_BYTES = 1


def attention_kind(backend: str, device_type: str = "cuda", attention_dropout: float = 0.0) -> str:
    """Which activation formula an attention backend follows: 'unfused' or 'flash'.

    `reference` materialises the s×s tensors everywhere. `flash` (flash-attn) and `sdpa` on CUDA (its fused
    flash / memory-efficient kernels) keep O(s) per head. `sdpa` on CPU runs a flash kernel only without
    attention dropout; its math fallback with dropout is not modelled and raises.
    """
    if backend == "reference":
        return "unfused"
    if backend == "flash":
        return "flash"
    if backend in ("sdpa", "auto"):
        if device_type == "cpu" and attention_dropout > 0.0:
            raise ValueError("SDPA on CPU with attention dropout runs its math fallback, whose saved tensors are "
                             "not modelled; use --attention-backend reference or attention dropout 0")
        return "flash"
    raise ValueError(f"--attention-backend {backend!r} is not one of reference, sdpa, flash, auto")


def _check(config: TransformerConfig, micro_batch_size: int, tp: int, attention: str, recompute: str) -> None:
    if micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size must be >= 1, got {micro_batch_size}")
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"attention kind {attention!r} is not one of {', '.join(ATTENTION_KINDS)}")
    if recompute not in RECOMPUTE_OPTIONS:
        raise ValueError(f"recompute {recompute!r} is not one of {', '.join(RECOMPUTE_OPTIONS)}")
    config.validate(tp)


def _rows(config: TransformerConfig, micro_batch_size: int, tp: int, sequence_parallel: bool) -> int:
    """Token rows per GPU of tensors in the replicated region (norms, residual): split only by SP."""
    tokens = config.seq_length * micro_batch_size
    if sequence_parallel and tp > 1:
        if config.seq_length % tp:
            raise ValueError(f"--seq-length {config.seq_length} is not divisible by --tensor-model-parallel-size "
                             f"{tp} (required by --sequence-parallel)")
        return tokens // tp
    return tokens


def layer_activation_terms(
    config: TransformerConfig,
    micro_batch_size: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    attention: str = "flash",
    numerics: Numerics = MEGATRON_BF16,
    selective: bool = False,
) -> dict[str, int]:
    """Bytes saved for backward by one transformer layer for one microbatch on one GPU, by term.

    Terms are named as in the module docstring; those kept inside the attention core (s×s tensors, or
    flash's log-sum-exp) start with 'core'. `selective=True` checkpoints the core: it keeps only its
    inputs q, k, v (unexpanded) and none of the 'core' terms.
    """
    _check(config, micro_batch_size, tp, attention, "selective" if selective else "none")
    s, b, h, d = config.seq_length, micro_batch_size, config.hidden_size, config.head_dim
    A, P, M = numerics.activation_bytes, numerics.attention_probs_bytes, numerics.dropout_mask_bytes
    tokens = s * b
    rows = _rows(config, micro_batch_size, tp, sequence_parallel)
    heads, groups = config.num_attention_heads // tp, config.query_groups // tp
    heads_per_group = config.num_attention_heads // config.query_groups
    f = config.ffn_size // tp
    rms = config.normalization == "RMSNorm"

    terms: dict[str, int] = {
        "norm inputs": 2 * rows * h * A,
        "norm statistics": 2 * rows * (1 if rms else 2) * FP32_STAT_BYTES,
        "linear inputs": 2 * rows * h * A,
    }
    if rms and numerics.rmsnorm_saves_normalized:
        # The composite rms_norm multiplies the fp32 normalised input by the weight, so it keeps that too.
        terms["rmsnorm normalized"] = 2 * rows * h * FP32_STAT_BYTES

    # q, k and v: which storages stay alive. The fused QKV output is [.., groups, heads_per_group + 2, d];
    # q is a view of it only if the per-group slice can be merged without a copy (one head per group, or
    # a single local group), k and v always are. RoPE writes new q and k; the unfused path repeats k and v
    # to every query head (grouped-query attention), flash kernels read them unexpanded. A checkpointed
    # core keeps its own inputs, i.e. the unexpanded k and v.
    rope = config.position_embedding_type == "rope"
    expand = attention == "unfused" and heads_per_group > 1 and not selective
    q_is_view = heads_per_group == 1 or groups == 1
    widths = {"qkv": (heads + 2 * groups) * d, "q copy": heads * d, "q rotated": heads * d,
              "k rotated": groups * d, "k expanded": heads * d, "v expanded": heads * d}
    q_src = "q rotated" if rope else ("qkv" if q_is_view else "q copy")
    k_src = "k expanded" if expand else ("k rotated" if rope else "qkv")
    v_src = "v expanded" if expand else "qkv"
    for name in dict.fromkeys((q_src, k_src, v_src)):
        terms[f"attention {name}"] = tokens * widths[name] * A
    terms["projection input"] = tokens * heads * d * A

    if config.activation == "swiglu":
        terms["mlp"] = tokens * 4 * f * A
    else:
        terms["mlp"] = tokens * 2 * f * A
    if config.hidden_dropout > 0.0:
        terms["residual dropout masks"] = 2 * rows * h * M

    if selective:
        return terms
    if attention == "unfused":
        square = tokens * heads * s  # b · a/t · s²
        terms["core probabilities"] = square * P
        if config.attention_dropout > 0.0:
            terms["core dropout mask"] = square * M
            terms["core dropped probabilities"] = square * P
        if numerics.saves_causal_mask:
            terms["core causal mask"] = s * s * BOOL_BYTES
    else:
        terms["core log-sum-exp"] = tokens * heads * FP32_STAT_BYTES
    return terms


def layer_activation_bytes(
    config: TransformerConfig,
    micro_batch_size: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    attention: str = "flash",
    recompute: str = "none",
    numerics: Numerics = MEGATRON_BF16,
) -> int:
    """Bytes one layer keeps per microbatch between its forward and its backward under `recompute`."""
    _check(config, micro_batch_size, tp, attention, recompute)
    if recompute == "full":
        return _rows(config, micro_batch_size, tp, sequence_parallel) * config.hidden_size * numerics.activation_bytes
    terms = layer_activation_terms(config, micro_batch_size, tp=tp, sequence_parallel=sequence_parallel,
                                   attention=attention, numerics=numerics, selective=recompute == "selective")
    return sum(terms.values())


def stash_extra_terms(
    config: TransformerConfig,
    spec: StageSpec,
    micro_batch_size: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    numerics: Numerics = MEGATRON_BF16,
) -> dict[str, int]:
    """Bytes per microbatch that a stage keeps once, outside its layers (see the module docstring)."""
    s, b, h = config.seq_length, micro_batch_size, config.hidden_size
    A = numerics.activation_bytes
    tokens = s * b
    rows = _rows(config, micro_batch_size, tp, sequence_parallel)
    terms: dict[str, int] = {}
    if spec.num_layers and config.position_embedding_type == "rope":
        terms["rope cos and sin"] = 2 * tokens * (config.head_dim // 2) * FP32_STAT_BYTES
    if spec.has_embedding:
        # tp = 1 looks the ids up directly; tp > 1 keeps shifted local ids and the foreign-id mask.
        terms["token ids"] = tokens * INDEX_BYTES + (tokens * BOOL_BYTES if tp > 1 else 0)
        if config.position_embedding_type == "learned_absolute":
            # The data loaders (mock, GPT dataset, training loop) hand over materialised [b, s] int64 ids.
            terms["position ids"] = tokens * INDEX_BYTES
        if config.hidden_dropout > 0.0:
            terms["embedding dropout mask"] = rows * h * numerics.dropout_mask_bytes
    if spec.has_head:
        rms = config.normalization == "RMSNorm"
        terms["final norm"] = rows * h * A + rows * (1 if rms else 2) * FP32_STAT_BYTES
        if rms and numerics.rmsnorm_saves_normalized:
            terms["final norm"] += rows * h * FP32_STAT_BYTES
        terms["output layer input"] = rows * h * A
        vocab = config.padded_vocab_size(tp) // tp
        terms["cross-entropy softmax"] = tokens * vocab * FP32_STAT_BYTES
        terms["cross-entropy targets"] = tokens * (INDEX_BYTES + BOOL_BYTES)
        terms["loss mask"] = tokens * FP32_STAT_BYTES
    return terms


def stash_bytes(
    config: TransformerConfig,
    spec: StageSpec,
    micro_batch_size: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    attention: str = "flash",
    recompute: str = "none",
    numerics: Numerics = MEGATRON_BF16,
) -> int:
    """Bytes of one (microbatch, stage) stash: what a stage holds per in-flight microbatch on one GPU."""
    per_layer = layer_activation_bytes(config, micro_batch_size, tp=tp, sequence_parallel=sequence_parallel,
                                       attention=attention, recompute=recompute, numerics=numerics)
    extras = stash_extra_terms(config, spec, micro_batch_size, tp=tp, sequence_parallel=sequence_parallel,
                               numerics=numerics)
    return spec.num_layers * per_layer + sum(extras.values())


def transient_activation_bytes(
    config: TransformerConfig,
    micro_batch_size: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    attention: str = "flash",
    recompute: str = "none",
    numerics: Numerics = MEGATRON_BF16,
) -> int:
    """Activations rebuilt during one backward under recomputation, held once per stage, not per stash:
    one whole layer under full recompute; under selective, one layer's attention-core tensors (and the
    k, v expanded for grouped-query attention), nothing otherwise."""
    if recompute == "none":
        return 0
    terms = layer_activation_terms(config, micro_batch_size, tp=tp, sequence_parallel=sequence_parallel,
                                   attention=attention, numerics=numerics)
    if recompute == "selective":
        return sum(v for k, v in terms.items() if k.startswith("core") or k.endswith("expanded"))
    return sum(terms.values())


# The backward's working set --------------------------------------------------------------------------------

WEIGHT_GRAD_FOLDS = ("fp32-output", "upcast")
"""How a bf16/fp16 linear layer adds its weight gradient into its fp32 main gradient
(`core.tensor_parallel.layers.add_to_main_grad`): `fp32-output` where low-precision GEMMs with an fp32 result
exist (CUDA: one fp32 product the size of the weight shard, then added), `upcast` on the CPU (fp32 copies of
both GEMM operands, then an fp32 addmm into the main gradient). The dry run's fake tensors are CPU tensors,
so it runs `upcast`."""


def _fold_bytes(tokens: int, out: int, inp: int, fold: str) -> int:
    """Temporaries of adding `grad_out^T x` ([out, inp]) into the fp32 main gradient of one weight shard."""
    return FP32_STAT_BYTES * (out * inp if fold == "fp32-output" else tokens * (out + inp))


def backward_transient_bytes(
    config: TransformerConfig,
    spec: StageSpec,
    micro_batch_size: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    numerics: Numerics = MEGATRON_BF16,
    weight_grad_fold: str = "fp32-output",
    rebuilt: int = 0,
    freed: bool = True,
) -> int:
    """Bytes a stage's backward holds at once beyond the state and its stashes as counted whole (ours, from
    `core.tensor_parallel.layers._LinearFunction.backward` and autograd's freeing order; held to the dry run
    in docs/planner.md "Against the dry run"): the residual stream's gradient (`rows·h`) plus the largest
    linear layer's backward while it adds its weight gradient, less what autograd has freed of the same
    microbatch's stash by then (the layer's backward runs fc2, fc1, projection, QKV):

        column-parallel (QKV, fc1, output layer; output width o = its shard)
            grad_out s·b·o + grad_input s·b·h (before its reduction) + with sequence parallelism the
            re-gathered input s·b·h and the reduce-scatter's output rows·h, + the fold
        row-parallel (projection, fc2; input width i = its shard)
            with sequence parallelism the gathered grad_out s·b·h, + grad_input s·b·i + the fold
        fold (weight gradient into the fp32 main gradient)
            `fp32-output`: 4·o·i (one fp32 product of the weight's size); `upcast`: 4·s·b·(o + i) (fp32
            copies of grad_out and the input); fp32 models: 4·o·i (autograd's weight gradient)
        freed before   fc2: nothing; fc1: the MLP's saved tensors (`layer_activation_terms`' "mlp");
                       projection and QKV: that and at least the MLP half's norm input and linear input

    all in the activation dtype but the fold. On the head stage the output layer's backward runs first,
    after the cross-entropy's, which has freed its fp32 softmax (`stash_extra_terms`' "cross-entropy
    softmax"). `rebuilt` is the layer a recomputing backward rebuilds (`transient_activation_bytes`), which
    the planner adds apart: alive during a layer's backward, not yet during the output layer's, so the head's
    candidate is charged net of it. `freed=False`: nothing of the stash is freed before the backward's end, as
    for a stash reloaded from the host (PipeOffload: the offload store holds the reloaded tensors, so autograd
    releasing its saved tensors frees no storage; our reading of the dry run's PO-H rank 0, whose peak held the
    MLP's saved tensors at fc1's fold). Not counted: the norms' and the attention core's backward, the
    embedding's. Derived for low-precision models (bf16/fp16 parameters with fp32 main gradients) only: an
    fp32 model (this repository's CPU path) adds autograd's weight gradient into `.grad` and its
    cross-entropy hands its softmax buffer back as the output layer's gradient; 0 there, not modelled."""
    if weight_grad_fold not in WEIGHT_GRAD_FOLDS:
        raise ValueError(f"weight-gradient fold {weight_grad_fold!r} is not one of {', '.join(WEIGHT_GRAD_FOLDS)}")
    s, b, h = config.seq_length, micro_batch_size, config.hidden_size
    A = numerics.activation_bytes
    if A >= FP32_STAT_BYTES:
        return 0
    tokens = s * b
    rows = _rows(config, micro_batch_size, tp, sequence_parallel)
    sp = sequence_parallel and tp > 1
    f = config.ffn_size // tp
    fc1 = 2 * f if config.activation == "swiglu" else f
    mlp = tokens * (2 * fc1 if config.activation == "swiglu" else 2 * f) * A if freed else 0  # the "mlp" term

    def column(out: int) -> int:
        return tokens * out * A + tokens * h * A + (tokens * h * A + rows * h * A if sp else 0) + \
            _fold_bytes(tokens, out, h, weight_grad_fold)

    def row(inp: int) -> int:
        return (tokens * h * A if sp else 0) + tokens * inp * A + _fold_bytes(tokens, h, inp, weight_grad_fold)

    candidates = [0]
    if spec.num_layers:
        attention_half = mlp + (2 * rows * h * A if freed else 0)
        projection = config.num_attention_heads * config.head_dim // tp
        candidates += [row(f), column(fc1) - mlp, row(projection) - attention_half,
                       column(config.qkv_size // tp) - attention_half]
    if spec.has_head:
        vocab = config.padded_vocab_size(tp) // tp
        candidates.append(column(vocab) - (tokens * vocab * FP32_STAT_BYTES if freed else 0) - rebuilt)
    return rows * h * A + max(candidates)


def deferred_weight_grad_bytes(
    config: TransformerConfig,
    spec: StageSpec,
    micro_batch_size: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    attention: str = "flash",
    recompute: str = "none",
    numerics: Numerics = MEGATRON_BF16,
) -> int:
    """How a stage's stash changes at a split backward's BI whose BW does not follow right after, as the
    executor's store counts it (a storage counts until it dies): + what BW holds, − what BI frees. Either
    sign: at tp 1 BI frees more than it adds; with sequence parallelism at large tp the projection's and
    fc2's output gradients (`s·b·h`, the whole sequence, gathered for their input gradient) outweigh the
    sharded tensors BI frees (LLaMA-3-70B at tp 8, s 4096, b 1: +75 MiB a layer, 44% of its stash).

    BW holds (`core.tensor_parallel.layers.WeightGradStore`) every deferred linear layer's output gradient
    (QKV `s·b·(a+2g)d/t`, projection and fc2 `s·b·h`, fc1 `s·b·f/t`, twice f for SwiGLU; an untied output
    layer's `s·b·V/t`) and its input: the norm outputs read by QKV and fc1 (`rows·h` each), the attention
    output (`s·b·a·d/t`) and the MLP activation's output (`s·b·f/t`) per layer, the final norm's output
    for an untied output layer — the forward's saved tensors, or under full recomputation the ones BI
    rebuilt. Batch tensors the forward saved stay too (the executor keeps the microbatch to the step's end):
    the token ids at tp = 1 (tp > 1 saves shifted local ids, which die), materialised position ids and the
    loss mask. Everything else the stash counted dies in BI (norm inputs and statistics, q/k/v, the
    attention core's tensors, the MLP's other tensors, dropout masks, RoPE tables, the cross-entropy's fp32
    softmax, the chunk input). Where activations are fp32 the cross-entropy hands its softmax buffer back as
    the output layer's gradient: one storage, the same bytes either way. Ours, from the model's code;
    tests/planning/test_zero_bubble_memory.py holds it to the store on CPU."""
    s, b, h, d = config.seq_length, micro_batch_size, config.hidden_size, config.head_dim
    A = numerics.activation_bytes
    tokens = s * b
    rows = _rows(config, micro_batch_size, tp, sequence_parallel)
    heads, groups, f = config.num_attention_heads // tp, config.query_groups // tp, config.ffn_size // tp
    fc1 = 2 * f if config.activation == "swiglu" else f
    gradients = tokens * ((heads + 2 * groups) * d + h + fc1 + h) * A
    inputs = (2 * rows * h + tokens * (heads * d + f)) * A
    held = spec.num_layers * (gradients + inputs)
    untied_head = spec.has_head and config.untie_embeddings_and_output_weights
    if untied_head:
        held += tokens * (config.padded_vocab_size(tp) // tp) * A + rows * h * A
    extras = stash_extra_terms(config, spec, micro_batch_size, tp=tp, sequence_parallel=sequence_parallel,
                               numerics=numerics)
    if tp == 1:
        held += extras.get("token ids", 0)
    held += extras.get("position ids", 0) + extras.get("loss mask", 0)
    return held - stash_bytes(config, spec, micro_batch_size, tp=tp, sequence_parallel=sequence_parallel,
                              attention=attention, recompute=recompute, numerics=numerics)


# Weights, gradients, optimizer state ----------------------------------------------------------------------


def layer_parameters_per_gpu(config: TransformerConfig, tp: int = 1) -> int:
    """Parameters of one transformer layer held by one tensor-parallel rank."""
    h, f = config.hidden_size, config.ffn_size
    fc1 = 2 * f if config.activation == "swiglu" else f
    split = h * config.qkv_size + config.num_attention_heads * config.head_dim * h + h * fc1 + f * h
    replicated = (4 * h if config.normalization == "LayerNorm" else 2 * h)
    if config.add_bias_linear:
        split += config.qkv_size + fc1  # column-parallel biases are split
        replicated += 2 * h  # row-parallel biases are added after the reduction, on every rank
    return split // tp + replicated


def stage_parameters_per_gpu(config: TransformerConfig, spec: StageSpec, tp: int = 1) -> int:
    """Parameters one GPU of a stage holds: its layers' shards, plus embedding and/or head."""
    h = config.hidden_size
    vocab = config.padded_vocab_size(tp) // tp
    count = spec.num_layers * layer_parameters_per_gpu(config, tp)
    tied = not config.untie_embeddings_and_output_weights
    if spec.has_embedding:
        count += vocab * h
        if config.position_embedding_type == "learned_absolute":
            count += config.num_positions * h
    if spec.has_head:
        count += 2 * h if config.normalization == "LayerNorm" else h
        # Untied: its own output layer. Tied on a separate stage: a copy of the word embedding.
        if not tied or not spec.has_embedding:
            count += vocab * h
    return count


def state_bytes_per_parameter(*, dp: int = 1, distributed_optimizer: bool = False, bf16: bool = True) -> float:
    """Parameter + gradient + Adam bytes per parameter (Megatron-LM's distributed-optimizer table)."""
    if dp < 1:
        raise ValueError(f"data-parallel size must be >= 1, got {dp}")
    if bf16:  # bf16 param 2 + fp32 grad 4 + fp32 master 4 + two fp32 moments 8
        return 6 + 12 / dp if distributed_optimizer else 18.0
    # fp32 param 4 + fp32 grad 4 + two fp32 moments 8 (the parameter is its own master); the distributed
    # optimizer also copies its shard of them (`core.distributed_optimizer.ShardedMainParams`): 4/dp more
    # than Megatron-LM's 8 + 8/dp (measured: tests/planning/test_optimizer_step.py)
    return 8 + 12 / dp if distributed_optimizer else 16.0


def stage_state_bytes(config: TransformerConfig, spec: StageSpec, *, tp: int = 1, dp: int = 1,
                      distributed_optimizer: bool = False, bf16: bool = True) -> float:
    """Weights, gradients and optimizer state of one GPU of a stage, in bytes."""
    return stage_parameters_per_gpu(config, spec, tp) * state_bytes_per_parameter(
        dp=dp, distributed_optimizer=distributed_optimizer, bf16=bf16)


# The optimizer step's transient ---------------------------------------------------------------------------

OPTIMIZER_IMPLEMENTATIONS = ("fused", "foreach")
"""How the inner AdamW runs (`training.optimizer._make_inner_optimizer`): `fused` on CUDA (apex FusedAdam,
else torch's fused AdamW: one in-place kernel), `foreach` elsewhere (torch's multi-tensor AdamW on CPU). The dry
run builds `fused` on its fake CPU tensors unless `--dry-run-optimizer foreach` (and `foreach` on meta)."""


def stage_vector_parameters_per_gpu(config: TransformerConfig, spec: StageSpec, tp: int = 1) -> int:
    """1-D parameters (norm weights and biases) of one GPU of a stage: AdamW's group without weight decay
    (`training.optimizer`), the rest being matrices (linear weights, embeddings)."""
    h, f = config.hidden_size, config.ffn_size
    fc1 = 2 * f if config.activation == "swiglu" else f
    norms = 4 * h if config.normalization == "LayerNorm" else 2 * h
    biases = (config.qkv_size + fc1) // tp + 2 * h if config.add_bias_linear else 0
    count = spec.num_layers * (norms + biases)
    if spec.has_head:
        count += 2 * h if config.normalization == "LayerNorm" else h
    return count


def optimizer_step_transient_bytes(params: int, vector_params: int, *, dp: int = 1,
                                   distributed_optimizer: bool = False, param_bytes: int = 2,
                                   implementation: str = "fused", held_into_next_step: float = 0.0) -> float:
    """Bytes `TrainingOptimizer.step` allocates above the state at its peak, on a GPU holding `params`
    parameters of which `vector_params` are 1-D (ours, from the code, and measured to the byte on tiny
    real runs: tests/planning/test_optimizer_step.py). The step runs, one after another, so the term is the
    larger of:

        AdamW, foreach    4 · max(params − vector_params, vector_params) / shards: torch's multi-tensor
                          AdamW (`_multi_tensor_adam`) builds sqrt(v) for every fp32 main weight of a
                          parameter group at once (`_foreach_sqrt`) and the groups run one after the other
                          (weight decay on matrices, none on 1-D parameters); shards = dp with the
                          distributed optimizer, else 1
        AdamW, fused      0: one in-place kernel per tensor list
        parameter gather  param_bytes · params · (1 + 1/dp) with the distributed optimizer and dp > 1
                          (`core.distributed_optimizer.ShardedMainParams.copy_to_model` starts every
                          bucket's all-gather before waiting on the first: each bucket's shard cast to the
                          parameter dtype and its gathered copy are all alive at once, besides the model's
                          own parameters); param_bytes · params at dp = 1 (the shards alone); with
                          --overlap-param-gather those buffers outlive the step until the chunk's first
                          forward, beside what the next step allocates before it (`held_into_next_step`,
                          `overlapped_gather_companions_bytes`)

    The gradient norm's outputs (one fp64 scalar per 4M-element piece), the step counters and the
    loss scaler are a few KiB. Bucket padding (a few elements per bucket) is not counted."""
    if implementation not in OPTIMIZER_IMPLEMENTATIONS:
        raise ValueError(f"optimizer implementation {implementation!r} is not one of "
                         f"{', '.join(OPTIMIZER_IMPLEMENTATIONS)}")
    shards = dp if distributed_optimizer else 1
    adam = 0.0 if implementation == "fused" else 4 * max(params - vector_params, vector_params) / shards
    gather = param_bytes * params * (1 + 1 / dp if dp > 1 else 1) if distributed_optimizer else 0.0
    return max(adam, gather + held_into_next_step if gather else 0.0)


TOKEN_COUNT_BYTES = 8
"""The step's global token count, an fp64 scalar made before the first forward (`training.step.global_token_count`)."""


def overlapped_gather_companions_bytes(config: TransformerConfig, micro_batch_size: int, *, tp: int = 1,
                                       sequence_parallel: bool = False, receives_input: bool = True,
                                       param_bytes: int = 2) -> int:
    """What the next step allocates while --overlap-param-gather still holds a one-chunk rank's gathered
    parameters (ours, from the code; the dry run's last pipeline rank of LLaMA-3-70B tp 8 x pp 8 dp 2 measured
    8 MiB + 8 B more than without the overlap, in its optimizer phase): the token count, and, on a rank whose
    first forward receives its input, that input's buffer (`s·b·h`, over t with sequence parallelism, in the
    parameter dtype), posted before the forward's pre-hook finishes the gathers. Ranks with later chunks hold
    those chunks' gathers past the first forward, beside the stashes made until then
    (`cost.Evaluator.rank_early_gather_bytes`)."""
    rows = _rows(config, micro_batch_size, tp, sequence_parallel)
    received = rows * config.hidden_size * param_bytes if receives_input else 0
    return TOKEN_COUNT_BYTES + received
