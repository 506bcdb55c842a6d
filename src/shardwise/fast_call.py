"""A faster way to call an aten op on local tensors: its generated Python binding
(``torch.sum``, ``Tensor.view``...) parses arguments unboxed and skips the boxed
``OpOverload`` call, about 0.5 to 1.5 us per call on CPU.

A binding is only a candidate: the same name may resolve to another overload or decompose.
``checked_call`` runs it once under a mode that sees the first op it dispatches and aborts,
before any kernel runs, unless that op is exactly the overload with exactly the same arguments;
dispatch then keeps the binding for calls with the same argument types (its cache key).
"""

from __future__ import annotations

from typing import Any

import torch

from .torch_compat import (
    OpOverload,
    TensorBase,
    TorchDispatchMode,
    VariableFunctions,
    is_torch_function_mode_enabled,
)

_HOLDERS = (VariableFunctions, TensorBase)


def binding(func: Any) -> Any:
    """The generated binding named like ``func``, if ``func`` is a pure (no argument written,
    not random) aten op returning one tensor; else None."""
    schema = getattr(func, "_schema", None)
    if type(func) is not OpOverload or schema is None:
        return None
    namespace, _, name = schema.name.partition("::")
    returns = schema.returns
    if (
        namespace != "aten"
        or len(returns) != 1
        or not isinstance(returns[0].type, torch.TensorType)
        or any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        or torch.Tag.nondeterministic_seeded in func.tags
    ):
        return None
    for holder in _HOLDERS:
        candidate = getattr(holder, name, None)
        if candidate is not None:
            return candidate
    return None


class _Mismatch(Exception):
    """The binding dispatched something other than the expected call."""


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if type(a) in (list, tuple) and type(b) in (list, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


class _FirstCall(TorchDispatchMode):
    """Runs the first op dispatched if it is ``func(*args, **kwargs)``; aborts otherwise."""

    def __init__(self, func: Any, args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.expected = (func, args, kwargs)
        self.seen = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        want, want_args, want_kwargs = self.expected
        kwargs = kwargs or {}
        if self.seen or func is not want or not (
            _same(list(args), list(want_args))
            and kwargs.keys() == want_kwargs.keys()
            and all(_same(kwargs[k], want_kwargs[k]) for k in kwargs)
        ):
            raise _Mismatch
        self.seen = True
        return func(*args, **kwargs)


def checked_call(func: Any, candidate: Any, args: tuple, kwargs: dict) -> tuple[Any, bool]:
    """``func(*args, **kwargs)``, through ``candidate`` when it is checked to make exactly
    that call: (result, whether ``candidate`` did)."""
    if candidate is not None and not is_torch_function_mode_enabled() and all(
        type(a) is torch.Tensor for a in args if isinstance(a, torch.Tensor)
    ):
        mode = _FirstCall(func, args, kwargs)
        try:
            with mode:
                result = candidate(*args, **kwargs)
        except Exception:
            if mode.seen:  # the op itself failed: its own error
                raise
        else:
            if mode.seen:
                return result, True
    return func(*args, **kwargs), False
