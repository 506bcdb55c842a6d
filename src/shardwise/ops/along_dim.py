"""Sharding strategies of ops that work along some dims and are independent along the others:
``glu`` (the two halves of ``dim``), ``rot90`` (its two dims), ``linalg_cross`` (3-vectors
along ``dim``), ``_prelu_kernel`` (elementwise with a broadcast slope) and ``renorm`` (each
slice along ``dim`` rescaled by its own norm, so only ``dim`` may be sharded).

The dims an op works along stay whole; any other dim may be sharded alike on the output and on
every input that has it at full size (an input broadcast along it stays replicated).
``rot90`` only moves data, so it is linear: Partial("sum") passes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..mesh import DeviceMesh
from .common import axis_options, input_strategies, linear_option, product_strategy
from .registry import OpSchema, OpStrategy, RuntimeSchemaInfo, register_op_strategy

aten = torch.ops.aten


def independent_dims_strategy(
    mesh: DeviceMesh, schema: OpSchema, dims: Sequence[int], linear: bool = False
) -> OpStrategy:
    """Output dims ``dims`` (of the broadcast shape) sharded alike on the output and on the
    inputs that have them at full size (aligned from the right, as broadcasting does)."""
    inputs = input_strategies(schema)
    ndim = max(s.ndim for s in inputs)
    full = [max((s.shape[d - ndim + s.ndim] if d - ndim + s.ndim >= 0 else 1) for s in inputs)
            for d in range(ndim)]
    in_dims: list[list[int | None]] = []
    for s in inputs:
        row: list[int | None] = []
        for d in dims:
            mine = d - ndim + s.ndim
            row.append(mine if mine >= 0 and s.shape[mine] == full[d] else None)
        in_dims.append(row)
    options = axis_options(in_dims, [list(dims)])
    if linear:
        options.append(linear_option(len(inputs), 1, [0]))
    return product_strategy(mesh, options)


def _except(ndim: int, *excluded: int) -> list[int]:
    skip = {e % max(ndim, 1) for e in excluded}
    return [d for d in range(ndim) if d not in skip]


@register_op_strategy(aten.glu.default, schema_info=RuntimeSchemaInfo(1))
def glu_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``glu(self, dim)``: any dim but ``dim``."""
    (x,) = input_strategies(schema)
    dim = schema.args_schema[1] if len(schema.args_schema) > 1 else -1
    return independent_dims_strategy(mesh, schema, _except(x.ndim, dim))


@register_op_strategy(aten.glu_backward.default, schema_info=RuntimeSchemaInfo(2))
def glu_backward_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``glu_backward(grad, self, dim)``: any dim but ``dim``, alike on grad and self."""
    _, x = input_strategies(schema)
    dims = _except(x.ndim, schema.args_schema[2])
    return product_strategy(mesh, axis_options([dims, dims], [dims]))


@register_op_strategy(aten.rot90.default, schema_info=RuntimeSchemaInfo(1))
def rot90_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``rot90(self, k, dims)``: any dim but the two rotated ones; linear."""
    (x,) = input_strategies(schema)
    dims = schema.args_schema[2] if len(schema.args_schema) > 2 else [0, 1]
    return independent_dims_strategy(mesh, schema, _except(x.ndim, *dims), linear=True)


@register_op_strategy(aten.linalg_cross.default, schema_info=RuntimeSchemaInfo(2))
def cross_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``linalg_cross(self, other, dim)``: any dim but ``dim`` (of the broadcast shape)."""
    ndim = max(s.ndim for s in input_strategies(schema))
    dim = schema.kwargs_schema.get("dim", -1)
    return independent_dims_strategy(mesh, schema, _except(ndim, dim))


@register_op_strategy(aten._prelu_kernel.default, schema_info=RuntimeSchemaInfo(2))
def prelu_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``_prelu_kernel(self, weight)``: elementwise, the weight broadcast."""
    ndim = max(s.ndim for s in input_strategies(schema))
    return independent_dims_strategy(mesh, schema, list(range(ndim)))


@register_op_strategy(aten.renorm.default, schema_info=RuntimeSchemaInfo(1))
def renorm_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``renorm(self, p, dim, maxnorm)``: only ``dim`` (its slices are independent)."""
    (x,) = input_strategies(schema)
    return independent_dims_strategy(mesh, schema, [schema.args_schema[2] % max(x.ndim, 1)])
