"""attention(): SDPA against the reference (causal, GQA, packed documents), the flash path's plumbing
through a CPU stand-in for the flash-attn module, backend selection, and real flash-attn on CUDA."""
import importlib.util
import math
import types

import pytest
import torch

from megatron_pp.models import attention as attention_module
from megatron_pp.models.attention import attention, document_mask, resolve_backend

HAS_FLASH = importlib.util.find_spec("flash_attn") is not None


def qkv(b=2, s=16, nq=4, nkv=4, d=8, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    make = lambda n: torch.randn(b, s, n, d, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    return make(nq), make(nkv), make(nkv)


# Two samples of 16 tokens: documents [0,5) [5,16) | [16,19) [19,27) [27,32).
CU_SEQLENS = torch.tensor([0, 5, 16, 19, 27, 32], dtype=torch.int32)


def naive_attention(q, k, v, causal, scale):
    """One sequence, q `[s, nq, d]`, k/v `[s, nkv, d]`: a loop over heads, written independently."""
    s, nq, d = q.shape
    rep = nq // k.shape[1]
    out = torch.empty_like(q)
    for h in range(nq):
        scores = (q[:, h] @ k[:, h // rep].T) * scale
        if causal:
            scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        out[:, h] = torch.softmax(scores, dim=-1) @ v[:, h // rep]
    return out


def make_flash_stand_in(calls):
    """A module with flash-attn's interface (names, argument order, varlen layout) and reference math."""

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
        assert q.dim() == 4 and dropout_p == 0.0
        calls.append("dense")
        scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(q.shape[-1])
        return torch.stack([naive_attention(q[i], k[i], v[i], causal, scale) for i in range(q.shape[0])])

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p=0.0, softmax_scale=None, causal=False):
        assert q.dim() == 3 and k.dim() == 3, "varlen takes [total_tokens, heads, d]"
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
        assert isinstance(max_seqlen_q, int) and max_seqlen_q == int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        calls.append("varlen")
        scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(q.shape[-1])
        out = torch.empty_like(q)
        bounds = cu_seqlens_q.tolist()
        for start, end in zip(bounds, bounds[1:]):
            out[start:end] = naive_attention(q[start:end], k[start:end], v[start:end], causal, scale)
        return out

    return types.SimpleNamespace(flash_attn_func=flash_attn_func, flash_attn_varlen_func=flash_attn_varlen_func)


@pytest.fixture
def flash_stand_in(monkeypatch):
    calls = []
    monkeypatch.setattr(attention_module, "_flash_attn_module", lambda: make_flash_stand_in(calls))
    return calls


CASES = [
    dict(nq=4, nkv=4, causal=True),
    dict(nq=4, nkv=4, causal=False),
    dict(nq=4, nkv=2, causal=True),  # grouped-query
    dict(nq=6, nkv=1, causal=True),  # multi-query
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("packed", [False, True])
def test_sdpa_matches_reference(case, packed):
    q, k, v = qkv(nq=case["nq"], nkv=case["nkv"])
    cu = CU_SEQLENS if packed else None
    ref = attention(q, k, v, causal=case["causal"], cu_seqlens=cu, backend="reference")
    out = attention(q, k, v, causal=case["causal"], cu_seqlens=cu, backend="sdpa")
    assert out.shape == q.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_reference_matches_independent_loop():
    q, k, v = qkv(nq=4, nkv=2)
    ref = attention(q, k, v, backend="reference", softmax_scale=0.3)
    for i in range(q.shape[0]):
        torch.testing.assert_close(ref[i], naive_attention(q[i], k[i], v[i], True, 0.3), rtol=1e-5, atol=1e-6)


def test_packed_documents_do_not_see_each_other():
    q, k, v = qkv(nq=4, nkv=2)
    out = attention(q, k, v, cu_seqlens=CU_SEQLENS, backend="sdpa")
    # Document [19, 27) is sample 1's tokens [3, 11): alone, it must give the same output.
    alone = attention(q[1:, 3:11], k[1:, 3:11], v[1:, 3:11], backend="reference")
    torch.testing.assert_close(out[1:, 3:11], alone, rtol=1e-5, atol=1e-6)


def test_document_mask_golden():
    mask = document_mask(torch.tensor([0, 2, 4], dtype=torch.int32), batch=1, seq=4, causal=True)
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask[0, 0], expected)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("packed", [False, True])
def test_flash_path_through_stand_in_matches_reference(flash_stand_in, case, packed):
    q, k, v = qkv(nq=case["nq"], nkv=case["nkv"])
    cu = CU_SEQLENS if packed else None
    ref = attention(q, k, v, causal=case["causal"], cu_seqlens=cu, softmax_scale=0.25, backend="reference")
    out = attention(q, k, v, causal=case["causal"], cu_seqlens=cu, softmax_scale=0.25, backend="flash")
    assert flash_stand_in == ["varlen" if packed else "dense"]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_flash_varlen_accepts_int64_cu_seqlens_and_given_max_seqlen(flash_stand_in):
    q, k, v = qkv()
    out = attention(q, k, v, cu_seqlens=CU_SEQLENS.long(), max_seqlen=11, backend="flash")
    ref = attention(q, k, v, cu_seqlens=CU_SEQLENS, backend="reference")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_auto_backend_selection(monkeypatch):
    q = torch.zeros(1, 2, 1, 8)
    monkeypatch.setattr(attention_module, "_flash_attn_module", lambda: None)
    assert resolve_backend("auto", q) == "sdpa"
    with pytest.raises(RuntimeError, match="flash-attn package"):
        attention(q, q, q, backend="flash")
    monkeypatch.setattr(attention_module, "_flash_attn_module", lambda: make_flash_stand_in([]))
    assert resolve_backend("auto", q) == "sdpa"  # flash kernels need CUDA fp16/bf16
    assert resolve_backend("auto", q.bfloat16()) == "sdpa"
    assert resolve_backend("reference", q) == "reference"
    with pytest.raises(ValueError, match="--attention-backend 'cudnn'"):
        resolve_backend("cudnn", q)


def test_heads_must_group():
    q, k, v = qkv(nq=4, nkv=3)
    with pytest.raises(ValueError, match="4 query heads are not divisible by 3 key/value heads"):
        attention(q, k, v, backend="sdpa")


@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_FLASH), reason="needs CUDA and the flash-attn package")
@pytest.mark.parametrize("packed", [False, True])
def test_real_flash_attn_matches_reference(packed):
    q, k, v = qkv(b=2, s=256, nq=8, nkv=2, d=64, dtype=torch.bfloat16, device="cuda")
    cu = torch.tensor([0, 100, 256, 300, 512], dtype=torch.int32, device="cuda") if packed else None
    assert resolve_backend("auto", q) == "flash"
    out = attention(q, k, v, cu_seqlens=cu, backend="auto")
    ref = attention(q.float(), k.float(), v.float(), cu_seqlens=cu, backend="reference")
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
