"""``register_sharding``: say how a custom op (or an aten op, overriding the built-in strategy)
shards, by listing acceptable placements for one mesh dim (PyTorch's API of the same name).

The decorated function receives the op's arguments with DTensors replaced by their
``DTensorSpec`` (which has ``shape`` and ``ndim``) and returns ``(output placements, input
placements)`` pairs for one mesh dim: one placement (or ``None`` for a non-tensor) per op output
and one per op argument. Every combination over the mesh dims becomes a strategy; dispatch picks
the cheapest one to reach from the actual inputs, then runs the op on each local component.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .errors import InvalidArgumentError
from .mesh import DeviceMesh
from .ops.common import product_strategy
from .ops.registry import (
    OpSchema,
    OpStrategy,
    RuntimeSchemaInfo,
    _overloads,
    register_op_strategy,
)
from .placements import Placement

ShardingFn = Callable[..., Sequence[tuple[Sequence[Placement | None], Sequence[Placement | None]]]]


def register_sharding(op: Any) -> Callable[[ShardingFn], ShardingFn]:
    """Decorator: ``fn`` lists the acceptable shardings of ``op`` (an overload, a packet or a
    list of them); it replaces any strategy registered for ``op``."""

    def wrap(fn: ShardingFn) -> ShardingFn:
        for overload in _overloads(op):
            register_op_strategy(overload, _schema_info(overload))(
                _strategy_from(fn, overload)
            )
        return fn

    return wrap


def _schema_info(op: Any) -> RuntimeSchemaInfo:
    """Integer arguments (dims, sizes) change the acceptable shardings: key the cache on them."""
    first, kwonly = 100, []
    for i, arg in enumerate(op._schema.arguments):
        kind = arg.type
        if isinstance(kind, torch.OptionalType):
            kind = kind.getElementType()
        if isinstance(kind, torch.IntType):
            first = min(first, i)
            if arg.kwarg_only:
                kwonly.append(arg.name)
    return RuntimeSchemaInfo(first, tuple(kwonly) or None)


def _strategy_from(fn: ShardingFn, op: Any) -> Callable[[DeviceMesh, OpSchema], OpStrategy]:
    n_out = len(op._schema.returns)

    def strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
        def spec(a: Any) -> Any:
            return a.output_spec if isinstance(a, OpStrategy) else a

        args = [spec(a) for a in schema.args_schema]
        kwargs = {k: spec(v) for k, v in schema.kwargs_schema.items()}
        tensor_at = [i for i, a in enumerate(schema.args_schema) if isinstance(a, OpStrategy)]
        options = []
        for outs, ins in fn(*args, **kwargs):
            outs, ins = list(outs), list(ins)
            if len(outs) != n_out or len(ins) < len(schema.args_schema):  # one per passed arg
                raise InvalidArgumentError(
                    f"register_sharding({op}): a sharding must give {n_out} output placements "
                    f"and one placement per argument ({len(schema.args_schema)}), got "
                    f"outputs {outs} and inputs {ins}"
                )
            options.append(([ins[i] for i in tensor_at], outs))
        if not options:
            raise InvalidArgumentError(f"register_sharding({op}) returned no sharding")
        return product_strategy(mesh, options, multi=n_out > 1)

    strategy.__module__, strategy.__doc__ = fn.__module__, fn.__doc__  # the user's registration
    return strategy
