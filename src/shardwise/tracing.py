"""torch.compile over DTensors: the entry points that build DTensors from plain tensors or move
data between devices (``from_local``, ``distribute_tensor``, ``redistribute``, ``to_local``,
``full_tensor``) are one opaque call each for dynamo (``torch._dynamo.nonstrict_trace``), and AOT
autograd traces through them with fake components. Dynamo then never steps into shardwise's
Python (plans, transports, caches), and a parallelized module's hooks compile without graph
breaks.

Dynamo passes only tensors, Python constants and registered pytree constants into such a call:
meshes are registered constants (made before the compiled region, compared with ``==``), and
placements, often made inside the region, cross the boundary as tuples of plain values (None,
which it refuses too, as a marker tuple).

Shardwise's eager machinery (``DTensor.__new__``, ``__torch_dispatch__``, the subclass's
flatten and unflatten, gradient and data-parallel hooks) also runs for real inside a compiled
region: in the eager stretches
between graphs (``loss.backward()`` after a graph break, a frame dynamo gave up on) and when AOT
autograd's runtime rebuilds DTensors from a graph's outputs. ``eager_under_dynamo`` marks such
code so that dynamo runs it, and everything it calls, as it is, instead of tracing it frame by
frame (which fails on the wrapper-subclass constructor). Eager programs pay nothing for it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .mesh import DeviceMesh
from .placements import InterleavedShard, Partial, Placement, RaggedShard, Replicate, Shard
from .torch_compat import (
    FrameAction,
    FrameExecStrategy,
    nonstrict_trace,
    pytree,
    set_code_exec_strategy,
)

F = TypeVar("F", bound=Callable[..., Any])

_MARK = "shardwise.placement"

pytree.register_constant(DeviceMesh)


def encode_placement(p: Placement) -> tuple:
    """``p`` as a tuple of plain values (``decode_placement`` inverts it)."""
    if isinstance(p, InterleavedShard):
        return (_MARK, "I", p.dim, p.interleaved_size)
    if isinstance(p, RaggedShard):
        return (_MARK, "G", p.dim, tuple(p.sizes))
    if isinstance(p, Shard):
        return (_MARK, "S", p.dim)
    if isinstance(p, Partial):
        return (_MARK, "P", p.reduce_op)
    return (_MARK, "R")


_NONE = (_MARK, "None")  # dynamo refuses None as an input of a nonstrict_trace call


def _encode(value: Any) -> Any:
    """A placement, or a non-empty sequence of placements, as a tuple of plain values (None
    as a marker tuple too)."""
    if value is None:
        return _NONE
    if isinstance(value, Placement):
        return encode_placement(value)
    if (
        isinstance(value, (list, tuple))
        and value
        and all(isinstance(p, Placement) for p in value)
    ):
        return tuple(encode_placement(p) for p in value)
    return value


def _is_code(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) > 1 and value[0] == _MARK


def decode_placement(code: tuple | list) -> Placement:
    """The placement ``encode_placement`` gave ``code`` for (a list after JSON)."""
    kind = code[1]
    if kind == "I":
        return InterleavedShard(code[2], code[3])
    if kind == "G":
        return RaggedShard(code[2], tuple(code[3]))
    if kind == "S":
        return Shard(code[2])
    if kind == "P":
        return Partial(code[2])
    return Replicate()


def _decode(value: Any) -> Any:
    if type(value) is tuple and value == _NONE:
        return None
    if _is_code(value):
        return decode_placement(value)
    if isinstance(value, tuple) and value and all(_is_code(c) for c in value):
        return tuple(decode_placement(c) for c in value)
    return value


def dynamo_opaque(fn: F) -> F:
    """``fn`` unchanged in eager mode; under dynamo, one ``nonstrict_trace`` call that AOT
    autograd traces through (placement arguments travel encoded)."""

    @nonstrict_trace
    def traced(*args: Any, **kwargs: Any) -> Any:
        return fn(*[_decode(a) for a in args], **{k: _decode(v) for k, v in kwargs.items()})

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():
            return traced(*[_encode(a) for a in args], **{k: _encode(v) for k, v in kwargs.items()})
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]


def eager_under_dynamo(fn: F) -> F:
    """``fn`` itself, its code marked so that dynamo skips it and every frame it calls when it
    runs inside a compiled region (it is never traced; inlining by dynamo is unaffected)."""
    code = getattr(fn, "__func__", fn).__code__
    set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    return fn
