"""The dry run's fake dispatch, made cheaper without changing what it returns (issue 33 item 8).

`FakeTensorMode` answers most operators from its dispatch cache. Before this module, most of a cache hit's
time was the key (`_prep_args_for_hash` turns every tensor argument into a seventeen-field `TensorMetadata`,
with sparse checks and a memory-format guess, and flattens it field by field: 54% of the cached dispatch's
cProfile time on a LLaMA-3-70B rank) and the output (`FakeTensor.__new__`'s argument handling). Nothing in
torch is patched; `FastFakeDispatch`, the base of the dry run's fake mode (`training.dry_run.TrackingFakeMode`),
changes four things:

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
- **output**: a cache hit's tensor is built as torch's constructor builds it, without the constructor's
  argument handling (`wrap_fake`; `tests/training/test_dry_run_speed.py` holds it to torch's own).
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
`_get_output_tensor_from_cache_entry`, `_validate_cache_key`, `_dispatch_impl`, `dispatch`, the cache
entry's fields and `FakeTensor`'s attributes)."""

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


def _fresh_state_of(template: FakeTensor, mode: FakeTensorMode) -> dict[str, Any]:
    """The attributes torch's constructor gave `template`, which must be None but for the mode and device."""
    state = dict(vars(template))
    odd = {k for k, v in state.items() if v is not None and not (k == "fake_mode" and v is mode)
           and not (k == "_fake_device" and v == template.fake_device)}
    if odd:
        raise RuntimeError(f"dry run: torch's FakeTensor carries {sorted(odd)}; the fast fake dispatch cannot copy them")
    return state


class FastFakeDispatch(FakeTensorMode):
    """A `FakeTensorMode` with the cheaper key and the bypass above; `fast=False` (or another torch) runs
    torch's own dispatch unchanged, which the tests hold it to."""

    def __init__(self, *, fast: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fast = fast and supported()
        if fast and not self.fast:
            _warn_unsupported()
        self._never_cached: dict[Any, bool] = {}
        self._fresh_state: dict[torch.device, dict[str, Any]] = {}

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

    def _get_output_tensor_from_cache_entry(self, state, entry, key, func, args):
        """A cache hit's output: a fresh meta tensor of the entry's metadata (on the input's storage for a
        view), wrapped as torch's constructor wraps it. Torch's own code for everything but the plain case
        (in-place, constant, conjugate/negative bits, symbolic shapes, debug tracing, export)."""
        meta = entry.metadata
        if (not self.fast or meta is None or entry.inplace_idx is not None or self.shape_env is not None
                or meta.layout is not _STRIDED or meta.is_conj or meta.is_neg or _ft.FakeTensorConfig.debug
                or torch.compiler.is_exporting()):
            return super()._get_output_tensor_from_cache_entry(state, entry, key, func, args)
        with _ft.in_kernel_invocation_manager(self):
            elem = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, layout=meta.layout, device="meta",
                                       requires_grad=meta.requires_grad)
            if isinstance(func, torch._ops.OpOverload) and func.is_view:
                elem.set_(args[entry.view_idx].untyped_storage(), meta.storage_offset, meta.shape, meta.stride)
        return self.wrap_fake(elem, meta.device)

    def wrap_fake(self, elem: torch.Tensor, device: torch.device) -> FakeTensor:
        """`FakeTensor(self, elem, device)` without its argument handling: the subclass made as torch makes
        it, then the attributes of a fake tensor torch built for this mode and device (all fresh: None, the
        mode, the device), copied. The template is checked to hold nothing else."""
        state = self._fresh_state.get(device)
        if state is None:
            with _ft.in_kernel_invocation_manager(self):
                blank = torch.empty(0, device="meta")
            state = self._fresh_state[device] = _fresh_state_of(FakeTensor(self, blank, device), self)
        out = torch.Tensor._make_subclass(FakeTensor, elem, elem.requires_grad, dispatch_device=True,
                                          device_for_backend_keys=state["_fake_device"])
        if self._allow_unsafe_data_ptr_access:
            torch._C._set_warn_deprecated_on_mutable_data_ptr(out)
        else:
            torch._C._set_throw_on_mutable_data_ptr(out)
        out.__dict__.update(state)
        return out

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
