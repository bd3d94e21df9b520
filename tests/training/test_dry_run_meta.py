"""`--dry-run-device meta` counts what the CPU device counts.

On meta tensors SDPA's kernel selector finds no fused kernel and runs its math decomposition, which saves an
fp32 upcast of q, k, v and the `[b, heads, s, s]` probabilities for backward; on CPU tensors it calls
`aten._scaled_dot_product_flash_attention_for_cpu`, which saves q, k, v, the output and an fp32 log-sum-exp.
`models.attention` calls that kernel by name for meta tensors, so both devices save the same tensors.

Two differences remain between the devices, both the job's own code choosing by device, and both pinned here:
- the linear layers' weight-gradient fold (`core.tensor_parallel.layers.add_to_main_grad`): on the CPU fp32
  copies of both GEMM operands; on meta, as on a GPU with fp32-output GEMMs (`mm(..., out_dtype=float32)` has
  a meta kernel), one fp32 product the weight's size (`planning.memory.WEIGHT_GRAD_FOLDS`);
- the global batch: the CPU job's is already on its device (`.to("cpu")` copies nothing; the tracker sees
  only what converting the real batch to fake tensors dispatches), the meta job copies it to its device, as a
  GPU job does, and counts the copies.
With both made the CPU's, every byte figure of the two devices is equal.
"""
import pytest
import torch
import torch.nn.functional as F

from megatron_pp.core.tensor_parallel import layers
from megatron_pp.models.attention import attention
from megatron_pp.training import dry_run
from megatron_pp.training.arguments import parse_args

BYTES = ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "stash_peak_bytes", "transient_peak_bytes",
         "peak_bytes", "host_bytes", "host_peak_bytes", "guest_peak_bytes", "peak_at")
STATE_AND_STASH = ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "stash_peak_bytes", "host_peak_bytes")
TINY = ["--model-preset", "llama-tiny", "--mock-data", "--bf16", "--micro-batch-size", "2", "--global-batch-size",
        "8", "--train-iters", "2", "--pipeline-model-parallel-size", "2",
        "--dry-run-optimizer", "foreach"]  # a meta job builds foreach AdamW (torch's fused one refuses meta)


def _saved(device: str, kv_heads: int, packed: bool, dropout: float) -> list[tuple]:
    """(shape, dtype, stride) of every tensor autograd saves for the backward of one attention call."""
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype, t.stride()))
        return t

    torch.manual_seed(0)
    q = torch.randn(2, 16, 8, 4, dtype=torch.bfloat16, device=device, requires_grad=True)
    k, v = (torch.randn(2, 16, kv_heads, 4, dtype=torch.bfloat16, device=device, requires_grad=True)
            for _ in range(2))
    cu = torch.tensor([0, 5, 16, 30, 32], dtype=torch.int32) if packed else None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = attention(q, k, v, dropout_p=dropout, cu_seqlens=cu, backend="sdpa")
    out.float().sum().backward()  # the meta backward runs too
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    return saved


@pytest.mark.parametrize("kv_heads", [2, 8])
@pytest.mark.parametrize("packed", [False, True])
def test_attention_saves_the_same_tensors_on_meta_as_on_cpu(kv_heads, packed):
    cpu, meta = _saved("cpu", kv_heads, packed, 0.0), _saved("meta", kv_heads, packed, 0.0)
    assert meta == cpu
    b, s, heads = 2, 16, 8
    assert (b, heads, s) in [shape for shape, _, _ in cpu]  # the flash kernel's log-sum-exp
    assert not [shape for shape, _, _ in cpu if shape == (b, heads, s, s)]  # no probabilities (a packed mask is [b, 1, s, s])


def test_with_dropout_both_devices_run_the_math_decomposition():
    """SDPA's CPU selector takes no fused kernel with dropout, so the meta path leaves SDPA to choose too: both
    save the `[b, heads, s, s]` probabilities (and the dropout mask)."""
    cpu, meta = _saved("cpu", 8, False, 0.1), _saved("meta", 8, False, 0.1)
    assert [(s, d) for s, d, _ in meta] == [(s, d) for s, d, _ in cpu]
    assert (2, 8, 16, 16) in [s for s, _, _ in cpu]


def test_the_meta_path_leaves_cpu_results_alone():
    """The CPU path still goes through SDPA itself: same output as the kernel called by name, bit for bit."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 12, n, 8, dtype=torch.float32) for n in (4, 2, 2))
    ours = attention(q, k, v, backend="sdpa")
    sdpa = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True,
                                          enable_gqa=True).transpose(1, 2)
    assert torch.equal(ours, sdpa)


def _upcast_fold(weight, grad_out, x):
    """`add_to_main_grad`'s CPU branch, whatever the device."""
    g, i = grad_out.reshape(-1, grad_out.size(-1)), x.reshape(-1, x.size(-1))
    weight.main_grad.addmm_(g.t().float(), i.float())
    weight.main_grad_added()


class _BatchAlreadyOnMeta(dry_run.TrackingFakeMode):
    """Hands the job its batch as fake meta tensors, as the CPU device's are already fake CPU ones: the job's
    `.to(device)` then copies nothing, as on the CPU."""

    def from_tensor(self, t, *args, **kwargs):
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            t = t.to("meta")
        return super().from_tensor(t, *args, **kwargs)


def _rows(device: str, layout: list[str]) -> list[dict]:
    args = parse_args(TINY + layout)
    return [dry_run.run_rank(args, rank, torch.device(device)).row() for rank in dry_run.chosen_ranks(args)]


# pp 2; and tp 2 with sequence parallelism, whose collectives on meta once took the list all-gather and the
# all-reduce + slice (the meta world's backend is named "cpu:fake,meta:fake", which the single-tensor check
# did not know): a gathered copy and a concatenation more than the CPU device (4 KiB here, 56 MiB at
# LLaMA-3-70B tp 8).
LAYOUTS = {"pp2": ["--dry-run", "2"], "tp2-sp-pp2": ["--dry-run", "4", "--tensor-model-parallel-size", "2",
                                                     "--sequence-parallel"]}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_meta_dry_run_counts_the_cpu_dry_runs_bytes(monkeypatch, layout):
    layout = LAYOUTS[layout]
    cpu, meta = _rows("cpu", layout), _rows("meta", layout)
    for c, m in zip(cpu, meta):
        assert {k: m[k] for k in STATE_AND_STASH} == {k: c[k] for k in STATE_AND_STASH}
        assert m["peak_at"] == c["peak_at"]
    # Before the kernel was called by name, meta's stash was 4.2x the CPU's at LLaMA-3-70B, and here:
    assert meta[0]["stash_peak_bytes"] == cpu[0]["stash_peak_bytes"] > 0
    # The transient differs by the fold and the batch; with both made the CPU's, nothing differs.
    assert [m["transient_peak_bytes"] for m in meta] != [c["transient_peak_bytes"] for c in cpu]
    monkeypatch.setattr(layers, "add_to_main_grad", _upcast_fold)
    folded = _rows("meta", layout)
    monkeypatch.setattr(dry_run, "TrackingFakeMode", _BatchAlreadyOnMeta)
    both = _rows("meta", layout)
    assert [{k: r[k] for k in BYTES} for r in both] == [{k: r[k] for k in BYTES} for r in cpu]
    # Each cause on its own moves the peak: the batch copy adds bytes, the GPU-style fold (one fp32 product
    # instead of two fp32 operand copies) takes some away at this size.
    assert all(f["peak_bytes"] > b["peak_bytes"] for f, b in zip(folded, both))
    assert all(m["peak_bytes"] != f["peak_bytes"] for m, f in zip(meta, folded))
