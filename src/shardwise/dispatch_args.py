"""An op call's arguments as dispatch reads them: one flat scan for the cache key and the
DTensors in order, where each DTensor sits (a position, or a list element), pieces put back in
those places, and plain tensors that must be replicated first.

Types are tested with ``type(x) is`` before ``isinstance`` (slow on ``torch.Tensor`` for numbers):
the scan runs on every op call.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from .dtensor import DTensor
from .mesh import DeviceMesh
from .op_inputs import implicitly_replicated

# argument types keyed by value as they are; floats and bools also by type (1, 1.0 and True
# are equal keys but give different output dtypes)
_ATOMS = frozenset({int, str, type(None), torch.dtype, torch.device})
_TYPED_ATOMS = frozenset({float, bool})


def _key_part(value: Any) -> Any:
    t = type(value)
    if t in _ATOMS:
        return value
    if t in _TYPED_ATOMS:
        return t, value
    if t is list or t is tuple:
        return tuple(_key_part(v) for v in value)
    if isinstance(value, DTensor):
        return value._spec
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, (int, float, str, torch.dtype, torch.device)):
        return t, value
    if isinstance(value, (list, tuple)):
        return tuple(_key_part(v) for v in value)
    if isinstance(value, (torch.memory_format, torch.layout)):
        return str(value)
    return ("obj", t.__name__, id(value))


def _loose_part(value: Any) -> Any:
    """Key of an argument before ``static_argnum``: DTensors by spec, others by type (a
    plain scalar tensor by dtype, which type promotion reads)."""
    if isinstance(value, DTensor):
        return value._spec
    if isinstance(value, torch.Tensor):
        return value.dtype
    return type(value)


SEQUENCES = (list, tuple)


def scan(
    args: tuple, kwargs: dict, static_argnum: int, static_kwargs: frozenset | None = None
) -> tuple[tuple, list, bool]:
    """One flat pass over the arguments: the cache key (DTensors by spec, arguments from
    ``static_argnum`` on and keyword arguments in ``static_kwargs`` (all when None) by value,
    the others by type), the DTensors in
    argument order (list elements, then keyword arguments), and whether a plain tensor that
    is not a scalar is among them (it must be replicated first). Types are tested before
    ``isinstance`` (slow on torch.Tensor for numbers)."""
    parts: list = []
    dtensors: list = []
    plain = False
    for i, a in enumerate(args):
        t = type(a)
        if t is DTensor:
            dtensors.append(a)
            parts.append(a._spec)
        elif t in _ATOMS:
            parts.append(a if i >= static_argnum else t)
        elif t in _TYPED_ATOMS:
            parts.append((t, a) if i >= static_argnum else t)
        elif t is list or t is tuple:
            specs = []
            for x in a:  # DTensors only (``cat``, ``stack``): keyed by spec at any position
                if type(x) is not DTensor:
                    break
                specs.append(x._spec)
            else:
                if specs:
                    dtensors.extend(a)
                    parts.append(tuple(specs))
                    continue
            if _ATOMS.issuperset(map(type, a)):  # sizes, dims: no tensors
                parts.append(tuple(a) if i >= static_argnum else tuple(map(type, a)))
                continue
            plain = _collect(a, dtensors) or plain
            parts.append(_key_part(a) if i >= static_argnum else tuple(map(_loose_part, a)))
        elif isinstance(a, DTensor):
            dtensors.append(a)
            parts.append(a._spec)
        elif isinstance(a, torch.Tensor):
            plain = plain or a.ndim > 0
            parts.append(_key_part(a) if i >= static_argnum else a.dtype)
        else:
            parts.append(_key_part(a) if i >= static_argnum else t)
    if kwargs:
        for k, v in kwargs.items():
            if isinstance(v, DTensor):
                dtensors.append(v)
            elif isinstance(v, torch.Tensor):
                plain = plain or v.ndim > 0
            elif type(v) in SEQUENCES:
                plain = _collect(v, dtensors) or plain
            static = static_kwargs is None or k in static_kwargs
            parts.append((k, _key_part(v) if static else _loose_part(v)))
    return tuple(parts), dtensors, plain


def _collect(values: Sequence[Any], dtensors: list) -> bool:
    """Append the DTensors among ``values`` to ``dtensors``; True if a plain tensor that is
    not a scalar is among them."""
    plain = False
    for x in values:
        if isinstance(x, DTensor):
            dtensors.append(x)
        elif isinstance(x, torch.Tensor):
            plain = plain or x.ndim > 0
    return plain


def dtensor_positions(args: tuple, kwargs: dict) -> tuple:
    """Where each DTensor argument sits, in ``scan``'s order: (argument index or keyword,
    index in its list or -1)."""
    where = []
    for i, a in itertools.chain(enumerate(args), kwargs.items()):
        if isinstance(a, DTensor):
            where.append((i, -1))
        elif type(a) in SEQUENCES:
            where.extend((i, j) for j, x in enumerate(a) if isinstance(x, DTensor))
    return tuple(where)


def whole_lists(where: tuple, args: tuple) -> tuple[tuple[int, int, int], ...] | None:
    """(position, first, stop) per list or tuple argument when the DTensors at ``where``
    fill such positional arguments and nothing else sits in them (``first:stop``: their
    DTensors in ``scan``'s order); else None."""
    spans: list[list[int]] = []
    for n, (i, j) in enumerate(where):
        if not isinstance(i, int) or j < 0:
            return None
        if j == 0 and not any(span[0] == i for span in spans):
            spans.append([i, n, n + 1])
        elif spans and spans[-1][0] == i and j == n - spans[-1][1]:
            spans[-1][2] = n + 1
        else:
            return None
    if not spans or any(len(args[i]) != stop - first for i, first, stop in spans):
        return None
    return tuple((i, first, stop) for i, first, stop in spans)


def place(args: tuple, kwargs: dict, where: tuple, pieces: Sequence[Any]) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with the DTensor at each position of ``where`` replaced by the
    matching piece (lists and tuples are copied, never changed)."""
    a = list(args)
    kw = dict(kwargs) if kwargs else kwargs
    copied: dict = {}
    for (i, j), piece in zip(where, pieces, strict=True):
        into = a if isinstance(i, int) else kw
        if j < 0:
            into[i] = piece
            continue
        seq = copied.get(i)
        if seq is None:
            seq = copied[i] = list(into[i])
        seq[j] = piece
    for i, seq in copied.items():
        into = a if isinstance(i, int) else kw
        into[i] = type(into[i])(seq)
    return tuple(a), kw


def replicate_plain(
    func: Any, args: tuple, kwargs: dict, mesh: DeviceMesh
) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with every plain tensor that is not a scalar replaced by its
    replicated DTensor (``implicitly_replicated``)."""
    where, pieces = [], []
    for i, a in itertools.chain(enumerate(args), kwargs.items()):
        for j, x in enumerate(a) if type(a) in SEQUENCES else [(-1, a)]:
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.ndim > 0:
                where.append((i, j))
                pieces.append(implicitly_replicated(func, x, mesh))
    return place(args, kwargs, tuple(where), pieces)
