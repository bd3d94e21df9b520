"""The dry run's fast fake dispatch (megatron_pp/training/dry_run_fast.py) changes its speed, never a figure.

Held here: a dry run with it and without it (fake CPU tensors and the meta device) gives every byte field and
every recorded call equal, with the same fake-cache hits and misses; its cache key tells two tensors apart
exactly when torch's key does; the key follows a tensor's metadata through in-place changes (resize_, set_,
as_strided_); the operators it sends past the cache are those torch never caches; another torch runs torch's own
dispatch, and says so.
"""
from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from torch._subclasses._fake_tensor_utils import _CacheKeyState
from torch._subclasses.fake_tensor import FakeTensorMode

from megatron_pp.core.tensor_parallel import layers
from megatron_pp.training import dry_run, dry_run_fast
from megatron_pp.training.arguments import parse_args

TINY = ["--model-preset", "llama-tiny", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", "2", "--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
        "--sequence-parallel", "--bf16", "--dry-run", "4", "--dry-run-ranks", "all", "--dry-run-jobs", "1"]
TIMES = ("seconds", "step_seconds")


def _dry_run(fast: bool, extra: tuple = ()):
    args = parse_args(TINY + list(extra))
    args.dry_run_fast_dispatch = fast
    FakeTensorMode.cache_clear()
    # A once-per-process probe of the device's fp32-output matmul runs two operators through the cache in
    # whichever run comes first; forgotten here, both runs make it.
    layers._has_fp32_output_matmul.cache_clear()
    reports, problems = dry_run.dry_run(args)
    return reports, problems, (FakeTensorMode.cache_hits, FakeTensorMode.cache_misses)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_fast_dispatch_changes_no_figure_and_no_recorded_call(device):
    """tp 2 x pp 2 with sequence parallelism, bf16, every rank, on fake CPU tensors and on the meta device
    (foreach AdamW there): all byte fields, the peak's place, the calls, the cache's hits and misses."""
    extra = ("--dry-run-device", device)
    fast, fast_problems, fast_cache = _dry_run(True, extra)
    slow, slow_problems, slow_cache = _dry_run(False, extra)
    drop = lambda row: {k: v for k, v in row.items() if k not in TIMES}  # noqa: E731
    assert [drop(r.row()) for r in fast] == [drop(r.row()) for r in slow]
    assert [r.comm for r in fast] == [r.comm for r in slow]
    assert fast_problems == slow_problems == []
    assert all(r.peak_bytes > 0 and r.stash_peak_bytes > 0 for r in fast)
    # The same cache entries are found and made: the key is finer or coarser than torch's nowhere.
    assert fast_cache == slow_cache and fast_cache[0] > 1000


def _fakes(mode):
    """Fake tensors whose metadata differ in one field each (and two that differ in none)."""
    with mode:
        base = torch.empty(4, 6)
        fakes = {
            "base": base, "same as base": torch.empty(4, 6), "bf16": torch.empty(4, 6, dtype=torch.bfloat16),
            "shape": torch.empty(6, 4), "transposed": torch.empty(6, 4).t(), "offset": torch.empty(25)[1:].view(4, 6),
            "offset 0": torch.empty(25)[:24].view(4, 6),
            "bigger storage": torch.empty(30)[:24].view(4, 6), "requires grad": torch.empty(4, 6, requires_grad=True),
            "neg bit": torch.empty(4, 6)._neg_view(), "complex": torch.empty(4, 6, dtype=torch.complex64),
            "conj bit": torch.empty(4, 6, dtype=torch.complex64).conj(), "4-d": torch.empty(1, 2, 3, 4),
            "channels last": torch.empty(1, 2, 3, 4).contiguous(memory_format=torch.channels_last),
        }
        with torch.inference_mode():
            fakes["inference"] = torch.empty(4, 6)
    return fakes


def _keys(mode, tensors, fast: bool):
    mode.fast = fast
    try:
        return {name: mode._cache_key(_CacheKeyState(None), torch.ops.aten.mul.Tensor, (t, 2.0), {})
                for name, t in tensors.items()}
    finally:
        mode.fast = True


def test_the_key_tells_tensors_apart_exactly_when_torchs_does():
    mode = dry_run.TrackingFakeMode()
    tensors = _fakes(mode)
    ours, torchs = _keys(mode, tensors, True), _keys(mode, tensors, False)
    assert ours != torchs  # the fast key is really in use
    for a, b in itertools.combinations(tensors, 2):
        assert (ours[a] == ours[b]) == (torchs[a] == torchs[b]), (a, b)
    assert ours["base"] == ours["same as base"] and ours["base"] != ours["requires grad"]
    # The tensors themselves came through the cache: a key too coarse would have handed one the other's
    # metadata (a view at offset 1 given offset 0). They are what torch's own dispatch makes.
    theirs = _fakes(dry_run.TrackingFakeMode(fast=False))
    assert {k: _metadata(t) for k, t in tensors.items()} == {k: _metadata(t) for k, t in theirs.items()}
    assert tensors["offset"].storage_offset() == 1


def _metadata(t) -> tuple:
    return (t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.untyped_storage().nbytes(), t.requires_grad,
            t.is_conj(), t.is_neg(), t.is_inference())


@pytest.mark.parametrize("change", ["resize_", "set_", "as_strided_"])
def test_the_key_follows_an_in_place_metadata_change(change):
    """Nothing is memoised per tensor: after an in-place change of shape, strides or storage the key (and the
    cached operator's output) is that of a fresh tensor with the new metadata, not the old one's."""
    mode = dry_run.TrackingFakeMode()
    with mode:
        t = torch.empty(4, 6)
        before = dry_run_fast.tensor_key(t)
        (t * 2).sum()  # the old metadata's entries are in the cache
        if change == "resize_":
            t.resize_(8, 6)
            fresh = torch.empty(8, 6)
        elif change == "set_":
            t.set_(torch.empty(30).untyped_storage(), 2, (3, 5), (5, 1))
            fresh = torch.empty(30)[2:17].view(3, 5)
        else:
            t.as_strided_((6, 4), (1, 6))
            fresh = torch.empty(4, 6).t()
        after = dry_run_fast.tensor_key(t)
        out = t * 2
    assert after != before and after == dry_run_fast.tensor_key(fresh)
    assert (out.shape, out.stride()) == (fresh.shape, (fresh * 2).stride())


def test_only_operators_torch_never_caches_skip_the_key():
    mode = dry_run.TrackingFakeMode()
    with mode:
        x = torch.empty(4, 6)
        idx = torch.zeros(2, dtype=torch.long)
    never = lambda func, *args: mode.never_cached(func, args, {})  # noqa: E731
    assert never(torch.ops.aten._unsafe_view.default, x, [24])
    assert never(torch.ops.aten.as_strided_.default, x, [6, 4], [1, 6])  # an in-place view
    assert not never(torch.ops.aten.mul.Tensor, x, 2.0)
    assert not never(torch.ops.aten.view.default, x, [24])
    assert not never(torch.ops.aten.index.Tensor, x, [idx])  # torch decides index's bypass by its arguments


def test_another_torch_runs_torchs_own_dispatch_and_says_so(monkeypatch):
    monkeypatch.setattr(dry_run_fast.torch, "__version__", "2.99.0")
    assert not dry_run_fast.supported()
    with pytest.warns(RuntimeWarning, match="fast fake dispatch is off"):
        mode = dry_run.TrackingFakeMode()
    assert not mode.fast
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not dry_run.TrackingFakeMode(fast=False).fast  # asked off: nothing to say


def _outputs(mode):
    """Each operator twice (the second answered from the cache), with what shows it was made right: the
    tensor's metadata, its Python attributes, its dispatch keys, and whether it shares its input's storage."""
    found = []
    mode._allow_unsafe_data_ptr_access = False
    with mode:
        x = torch.empty(4, 6, requires_grad=True)
        y = torch.empty(4, 6, dtype=torch.bfloat16)
        for _ in range(2):
            for out, source in ((x * 2, x), (x.view(24), x), (x.t(), x), (y.to(torch.float32), y),
                                (x.detach(), x), (y[1:], y), (y.add_(1), y)):
                state = {k: (v is mode if k == "fake_mode" else v) for k, v in vars(out).items()}
                found.append((_metadata(out), out.fake_device, state, torch._C._dispatch_key_set(out),
                              out.untyped_storage()._cdata == source.untyped_storage()._cdata, _data_ptr_raises(out)))
    return found


def _data_ptr_raises(t) -> bool:
    """Torch marks each fake tensor's storage to raise on a data-pointer read (or, where its config allows
    unsafe reads, to warn once per process, which a test cannot see twice)."""
    try:
        t.data_ptr()
    except RuntimeError:
        return True
    return False


def test_a_cache_hit_builds_the_tensor_torch_builds():
    ours, torchs = _outputs(dry_run.TrackingFakeMode()), _outputs(dry_run.TrackingFakeMode(fast=False))
    assert ours == torchs
    assert [aliases for *_, aliases, _ in ours[:7]] == [False, True, True, False, True, True, True]
    assert all(raises for *_, raises in ours)
