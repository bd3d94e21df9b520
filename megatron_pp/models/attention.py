"""Scaled dot-product attention behind one function, with three interchangeable backends.

`attention(q, k, v)` takes `[b, s, heads, d]` tensors (flash-attn's layout), supports grouped-query
attention (fewer key/value heads than query heads; query head i reads key/value head i // (nq / nkv)),
causal masking, and packed documents described by `cu_seqlens` (no token attends across a document
boundary). Backends:

- `flash`: the flash-attn package (`flash_attn_func`, or `flash_attn_varlen_func` for packed documents).
- `sdpa`: `torch.nn.functional.scaled_dot_product_attention`, which picks its own fused kernel (flash,
  cuDNN, memory-efficient) on GPUs without flash-attn and a math kernel on CPU.
- `reference`: plain matmul-softmax in fp32, the yardstick for tests.

`auto` picks flash when the package imports and the tensors are CUDA fp16/bf16 (the only case its kernels
accept), else sdpa. flash-attn is looked up lazily through `_flash_attn_module()`, so a machine without
it never imports it, and a test can substitute a stand-in module with the same interface.

Packed documents: `cu_seqlens` (int32, `[num_docs + 1]`) are cumulative document boundaries over the
batch flattened to `b * s` tokens, flash-attn's varlen convention. Every sample start (0, s, 2s, ...)
must be one of the boundaries, i.e. no document runs from one sample into the next; the sdpa and
reference backends mask per sample and would otherwise disagree with flash.
"""
from __future__ import annotations

import functools
import importlib
import math
from types import ModuleType
from typing import Optional

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "flash", "sdpa", "reference")


@functools.cache
def _flash_attn_module() -> Optional[ModuleType]:
    """The flash_attn package if it imports, else None (imported once, on first use)."""
    try:
        return importlib.import_module("flash_attn")
    except ImportError:
        return None


def flash_attn_available() -> bool:
    """Whether the flash-attn package imports here (argument validation refuses `flash` up front without it)."""
    return _flash_attn_module() is not None


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    """The concrete backend `attention` would use for `q` ('auto' resolved)."""
    if backend not in BACKENDS:
        raise ValueError(f"--attention-backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    flash_ok = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and _flash_attn_module() is not None
    return "flash" if flash_ok else "sdpa"


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    max_seqlen: Optional[int] = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of q `[b, s, nq, d]` over k, v `[b, s, nkv, d]` (nkv divides nq); returns `[b, s, nq, d]`.

    `dropout_p` applies to the attention probabilities (callers pass 0 in eval). `max_seqlen` is the
    longest packed document; computed from `cu_seqlens` when omitted (a host sync on GPU).
    """
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"{q.shape[2]} query heads are not divisible by {k.shape[2]} key/value heads")
    chosen = resolve_backend(backend, q)
    if chosen == "flash":
        return _flash(q, k, v, causal, dropout_p, softmax_scale, cu_seqlens, max_seqlen)
    if chosen == "sdpa":
        return _sdpa(q, k, v, causal, dropout_p, softmax_scale, cu_seqlens)
    return _reference(q, k, v, causal, dropout_p, softmax_scale, cu_seqlens)


def _flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    dropout_p: float,
    softmax_scale: Optional[float],
    cu_seqlens: Optional[torch.Tensor],
    max_seqlen: Optional[int],
) -> torch.Tensor:
    flash = _flash_attn_module()
    if flash is None:
        raise RuntimeError("--attention-backend flash needs the flash-attn package (pip install flash-attn)")
    # flash-attn handles GQA natively (fewer k/v heads than q heads), so k and v pass through unexpanded.
    if cu_seqlens is None:
        return flash.flash_attn_func(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal)
    b, s = q.shape[:2]
    cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    out = flash.flash_attn_varlen_func(
        q.reshape(b * s, *q.shape[2:]),
        k.reshape(b * s, *k.shape[2:]),
        v.reshape(b * s, *v.shape[2:]),
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        dropout_p=dropout_p,
        softmax_scale=softmax_scale,
        causal=causal,
    )
    return out.reshape(q.shape)


def document_mask(cu_seqlens: torch.Tensor, batch: int, seq: int, causal: bool) -> torch.Tensor:
    """Boolean `[b, 1, s, s]` mask, True where a query may attend a key: same document (and not later)."""
    positions = torch.arange(batch * seq, device=cu_seqlens.device)
    doc = torch.searchsorted(cu_seqlens.to(torch.int64), positions, right=True).view(batch, seq)
    mask = doc[:, :, None] == doc[:, None, :]
    if causal:
        mask = mask & torch.ones(seq, seq, dtype=torch.bool, device=mask.device).tril()
    return mask.unsqueeze(1)


def _expand_kv(x: torch.Tensor, groups_per_kv: int) -> torch.Tensor:
    """`[b, nkv, s, d]` -> `[b, nq, s, d]`, each key/value head repeated for the query heads of its group."""
    return x if groups_per_kv == 1 else x.repeat_interleave(groups_per_kv, dim=1)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    dropout_p: float,
    softmax_scale: Optional[float],
    cu_seqlens: Optional[torch.Tensor],
) -> torch.Tensor:
    b, s, nq, _ = q.shape
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # SDPA wants [b, heads, s, d]
    rep = nq // k.shape[1]
    if q.device.type == "meta" and dropout_p == 0.0:
        mask = None if cu_seqlens is None else document_mask(cu_seqlens.to(q.device), b, s, causal)
        kv = (k, v) if mask is None else (_expand_kv(k, rep), _expand_kv(v, rep))
        return _cpu_flash_kernel(q, *kv, causal and mask is None, softmax_scale, mask).transpose(1, 2)
    if cu_seqlens is None:
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=causal, scale=softmax_scale, enable_gqa=rep > 1
        )
    else:
        # With an explicit mask SDPA's fused kernels take no GQA, and its math fallback would hold a full
        # [b, nq, s, s] score tensor per call; repeating k/v costs far less.
        mask = document_mask(cu_seqlens.to(q.device), b, s, causal)
        out = F.scaled_dot_product_attention(
            q, _expand_kv(k, rep), _expand_kv(v, rep), attn_mask=mask, dropout_p=dropout_p, scale=softmax_scale
        )
    return out.transpose(1, 2)


def _cpu_flash_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: Optional[float],
    mask: Optional[torch.Tensor],
) -> torch.Tensor:
    """The kernel SDPA picks for CPU tensors without dropout, called by name, for meta tensors (the dry run's
    `--dry-run-device meta`). On meta, SDPA's selector finds no fused kernel and runs its math decomposition,
    which saves an fp32 upcast of q, k, v and the `[b, nq, s, s]` probabilities for backward; this op has meta
    kernels for its forward and backward and saves what it saves on the CPU (q, k, v as given, the output, an
    fp32 log-sum-exp of `[b, nq, s]`), so a meta dry run counts the CPU dry run's bytes. A boolean mask becomes
    an additive one of q's dtype first, as SDPA does before calling this kernel. CPU and CUDA never come here."""
    if mask is not None and mask.dtype == torch.bool:
        additive = torch.zeros_like(mask, dtype=q.dtype)
        mask = additive.masked_fill_(mask.logical_not(), float("-inf"))
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=mask, scale=softmax_scale
    )
    return out[0]


def _reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    dropout_p: float,
    softmax_scale: Optional[float],
    cu_seqlens: Optional[torch.Tensor],
) -> torch.Tensor:
    b, s, nq, d = q.shape
    rep = nq // k.shape[2]
    qf, kf, vf = (t.transpose(1, 2).float() for t in (q, k, v))
    kf, vf = _expand_kv(kf, rep), _expand_kv(vf, rep)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if cu_seqlens is not None:
        allowed = document_mask(cu_seqlens.to(q.device), b, s, causal)
    elif causal:
        allowed = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    else:
        allowed = None
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        probs = F.dropout(probs, dropout_p)
    return torch.matmul(probs, vf).transpose(1, 2).to(q.dtype)
