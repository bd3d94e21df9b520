"""The dry run's fake dispatch, made cheaper without changing what it returns (issue 33 item 8).

`FakeTensorMode` answers most operators from its dispatch cache; on this torch a cache hit costs about
twice what the fake kernel saves, and most of that is the cache key: `_prep_args_for_hash` turns every
tensor argument into a `TensorMetadata` dataclass (seventeen fields, sparse checks, a memory-format guess)
and flattens it field by field into the key, about 60% of a cached `aten.mul` here
(benchmarks/dry_run_profile.py). `FastFakeDispatch` changes three things, all in the dry run's own fake
mode (`training.dry_run.TrackingFakeMode`), none in torch:

- **key**: a strided, non-symbolic fake tensor of this mode enters the key as one tuple of what torch's
  metadata holds for it (dtype, shape, strides, device, storage offset, storage bytes, requires_grad, and
  the quantized, conjugate, negative and inference bits). Torch's other fields are functions of these for
  such a tensor (its memory format is read off layout, shape and strides; the sparse fields are fixed), so
  two calls get equal keys exactly when torch's keys are equal: the same hits and misses, the same entries.
  Anything else (a symbolic, sparse, constant or other mode's tensor, an unusual argument) goes through
  torch's own code, argument by argument.
- **operators torch never caches** (the `c10d` collectives, "non-builtin"; `aten._unsafe_view`; in-place
  views): torch builds their key only to find a bypass entry under it. They go straight to the fake
  kernel, which is where torch's bypass sends them.
- **one layer fewer**: the mode's `__torch_dispatch__` calls the fake mode's `dispatch` itself, not through
  torch's wrappers around it (a dynamo-disable frame and a statistics counter).

The helpers touch torch's private methods, so they run only on the torch they were written against
(`SUPPORTED_TORCH`); on another one the dry run uses torch's fake dispatch unchanged, and says so once.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
from torch._subclasses import fake_tensor as _ft
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

SUPPORTED_TORCH = "2.13."
"""The torch minor the fast dispatch was written against (its private `_prep_args_for_hash`,
`_validate_cache_key`, `_dispatch_impl` and `dispatch`)."""

_STRIDED = torch.strided
_PLAIN = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                    torch.memory_format})
# Reasons torch gives for not caching an operator that depend on the operator alone, never on its
# arguments (its `_validate_cache_key`; aten.index's depends on the index dtype, so operators with a
# dynamic output shape are left to torch).
_OPERATOR_ONLY_REASONS = frozenset({"non-builtin", "unsafe view", "inplace view", "lift", "CompositeImplicitAutograd",
                                    "data dependent output"})


class _TensorKey:
    """Marks a fake tensor's entry in a key (never equal to anything torch itself appends)."""


def supported() -> bool:
    return torch.__version__.startswith(SUPPORTED_TORCH)


def _warn_unsupported() -> None:
    warnings.warn(f"dry run: torch {torch.__version__} is not {SUPPORTED_TORCH}x, the fast fake dispatch "
                  "is off (same figures, slower)", RuntimeWarning, stacklevel=3)


def tensor_key(t: FakeTensor) -> tuple:
    """What torch's cache key holds for a strided, non-symbolic fake tensor, as one tuple."""
    return (_TensorKey, t.dtype, t.shape, t.stride(), t.device, t.storage_offset(), t.untyped_storage().nbytes(),
            t.requires_grad, t.is_quantized, t.is_conj(), t.is_neg(), t.is_inference())


class FastFakeDispatch(FakeTensorMode):
    """A `FakeTensorMode` with the cheaper key and the bypass above; `fast=False` (or another torch) runs
    torch's own dispatch unchanged, which the tests hold it to."""

    def __init__(self, *, fast: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fast = fast and supported()
        if fast and not self.fast:
            _warn_unsupported()
        self._never_cached: dict[Any, bool] = {}

    def _prep_args_for_hash(self, result, args, state, id_hashed_objects) -> None:  # noqa: D401 - torch's name
        if not self.fast or type(args) is dict:
            return super()._prep_args_for_hash(result, args, state, id_hashed_objects)
        if type(args) is list or type(args) is tuple:
            result.append(type(args))
            result.append(len(args))
        for arg in args:
            kind = type(arg)
            if (kind is FakeTensor and arg.fake_mode is self and arg.constant is None and arg.layout is _STRIDED
                    and not arg._has_symbolic_sizes_strides):
                result.append(tensor_key(arg))
            elif kind in _PLAIN:
                result.append(kind)
                result.append(arg)
            elif kind is list or kind is tuple:
                self._prep_args_for_hash(result, arg, state, id_hashed_objects)
            else:  # torch's code for this one argument (it raises the bypass where torch would)
                super()._prep_args_for_hash(result, (arg,), state, id_hashed_objects)

    def never_cached(self, func, args, kwargs) -> bool:
        """True when torch would not cache `func` whatever its arguments (decided once per operator)."""
        known = self._never_cached.get(func)
        if known is None:
            known = False
            if (isinstance(func, torch._ops.OpOverload) and torch.Tag.dynamic_output_shape not in func.tags
                    and func not in _ft._DISPATCH_META_HANDLERS and func not in _ft._DISPATCH_HANDLE_DIRECTLY):
                try:
                    self._validate_cache_key(func, args, kwargs)
                except _ft._BypassDispatchCache as bypass:
                    known = bypass.reason in _OPERATOR_ONLY_REASONS
            self._never_cached[func] = known
        return known

    def fake_dispatch(self, func, types, args, kwargs):
        """The fake mode's dispatch of one operator the job called."""
        if not self.fast:
            return FakeTensorMode.__torch_dispatch__(self, func, types, args, kwargs)
        if self.cache_enabled and self.never_cached(func, args, kwargs):
            return self._dispatch_impl(func, types, args, kwargs)
        return self.dispatch(func, types, args, kwargs)
