"""Sharding strategies of the scatters not in ``indexing``: ``scatter`` with a ``reduce``
argument, ``index_fill``/``index_copy``/``index_reduce``, the ``*_scatter`` ops that write a
slice, a selected index or a diagonal (``slice_scatter``, ``select_scatter``,
``diagonal_scatter``), ``diag_embed`` (which ``diag`` and ``diagflat`` become) and ``trace``
(the sum of the diagonal).

Positions along the written dim(s) are global, so those dims stay whole; every other dim may be
sharded alike on ``self``, the source and the output (the index stays replicated, or for
``scatter`` sharded alike when its size matches). Writing a slice, an index or a diagonal is
linear in (``self``, source) jointly, and ``diag_embed`` is linear: Partial("sum") passes.
``index_fill`` with a tensor index deduplicates it with ``_unique``, which runs replicated.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..mesh import DeviceMesh
from .common import (
    DimOption,
    axis_options,
    input_strategies,
    linear_option,
    nonempty_shards,
    product_strategy,
    run_replicated,
)
from .registry import (
    OpSchema,
    OpStrategy,
    RuntimeSchemaInfo,
    bypass_dispatch,
    register_op_strategy,
)

aten = torch.ops.aten


def _norm(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


def _strategy(
    mesh: DeviceMesh, schema: OpSchema, in_dims: list[list[int | None]], linear: Sequence[int]
) -> OpStrategy:
    """``axis_options`` with the output laid out like ``self`` (input 0)."""
    options: list[DimOption] = axis_options(in_dims, [in_dims[0]])
    if linear:
        options.append(linear_option(len(in_dims), 1, linear))
    shapes = [s.shape for s in input_strategies(schema)]
    return product_strategy(mesh, options, valid=nonempty_shards(mesh, shapes))


SCATTER_REDUCE = [
    aten.scatter.reduce, aten.scatter_.reduce, aten.scatter.value_reduce,
    aten.scatter_.value_reduce,
]


@register_op_strategy(SCATTER_REDUCE, schema_info=RuntimeSchemaInfo(1))
def scatter_reduce_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``scatter(self, dim, index, src|value, reduce)``: a dim other than ``dim`` where self,
    index and src have the same size sharded on all three."""
    inputs = input_strategies(schema)
    dim = _norm(schema.args_schema[1], inputs[0].ndim)
    shapes = [s.shape for s in inputs]
    dims = [
        d for d in range(inputs[0].ndim)
        if d != dim and all(len(s) > d and s[d] == shapes[0][d] for s in shapes)
    ]
    return _strategy(mesh, schema, [dims] * len(inputs), ())


INDEX_WRITES = [
    aten.index_fill.int_Scalar, aten.index_fill.int_Tensor, aten.index_fill_.int_Scalar,
    aten.index_fill_.int_Tensor, aten.index_copy.default, aten.index_copy_.default,
    aten.index_reduce.default, aten.index_reduce_.default,
]


@register_op_strategy(INDEX_WRITES, schema_info=RuntimeSchemaInfo(1))
def index_write_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``index_fill/index_copy/index_reduce(self, dim, index, source|value, ...)``: self and
    source sharded alike on a dim other than ``dim``, the index (and a 0-d value)
    replicated; ``index_copy`` is linear in (self, source)."""
    inputs = input_strategies(schema)
    ndim = inputs[0].ndim
    dim = _norm(schema.args_schema[1], ndim)
    dims = [d for d in range(ndim) if d != dim]
    in_dims: list[list[int | None]] = [dims, [None] * len(dims)]
    for extra in inputs[2:]:
        in_dims.append(dims if extra.ndim == ndim else [None] * len(dims))
    copy = schema.op in (aten.index_copy.default, aten.index_copy_.default)
    linear = [0, 2] if copy and len(inputs) == 3 else ()
    return _strategy(mesh, schema, in_dims, linear)


@register_op_strategy(aten.slice_scatter.default, schema_info=RuntimeSchemaInfo(2))
def slice_scatter_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``slice_scatter(self, src, dim, start, end, step)``: any other dim sharded alike."""
    x, _ = input_strategies(schema)
    dim = _norm(schema.args_schema[2] if len(schema.args_schema) > 2 else 0, x.ndim)
    dims = [d for d in range(x.ndim) if d != dim]
    return _strategy(mesh, schema, [dims, dims], (0, 1))


@register_op_strategy(aten.select_scatter.default, schema_info=RuntimeSchemaInfo(2))
def select_scatter_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``select_scatter(self, src, dim, index)``: src lacks ``dim``; other dims alike."""
    x, _ = input_strategies(schema)
    dim = _norm(schema.args_schema[2], x.ndim)
    dims = [d for d in range(x.ndim) if d != dim]
    return _strategy(mesh, schema, [dims, [d if d < dim else d - 1 for d in dims]], (0, 1))


@register_op_strategy(aten.diagonal_scatter.default, schema_info=RuntimeSchemaInfo(2))
def diagonal_scatter_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``diagonal_scatter(self, src, offset, dim1, dim2)``: src holds the other dims in order
    then the diagonal; those other dims sharded alike."""
    x, _ = input_strategies(schema)
    dim1, dim2 = _diag_dims_full(schema, x.ndim, 2, (0, 0, 1))
    dims = [d for d in range(x.ndim) if d not in (dim1, dim2)]
    return _strategy(mesh, schema, [dims, list(range(len(dims)))], (0, 1))


@register_op_strategy(aten.diag_embed.default, schema_info=RuntimeSchemaInfo(1))
def diag_embed_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``diag_embed(self, offset, dim1, dim2)``: every dim of self but the last (the
    diagonal) sharded, the output's matching dim alike; linear."""
    (x,) = input_strategies(schema)
    dim1, dim2 = _diag_dims_full(schema, x.ndim + 1, 1, (0, -2, -1))
    out = [d for d in range(x.ndim + 1) if d not in (dim1, dim2)]
    dims = [list(range(x.ndim - 1)), out]
    options = axis_options(dims[:1], dims[1:]) + [linear_option(1, 1, [0])]
    return product_strategy(mesh, options)


def _diag_dims_full(
    schema: OpSchema, ndim: int, first: int, defaults: tuple[int, int, int]
) -> tuple[int, int]:
    """(dim1, dim2) of an op whose (offset, dim1, dim2) start at argument ``first``."""
    given = list(schema.args_schema[first : first + 3])
    values = given + list(defaults[len(given) :])
    for i, name in enumerate(("offset", "dim1", "dim2")):
        if name in schema.kwargs_schema:
            values[i] = schema.kwargs_schema[name]
    return _norm(values[1], ndim), _norm(values[2], ndim)


def _trace(op: object, args: tuple, kwargs: dict) -> object:
    """The sum of the diagonal (a Partial sum where the diagonal is sharded)."""
    return aten.sum.default(aten.diagonal.default(args[0]))


bypass_dispatch(aten.trace.default, _trace)
bypass_dispatch(aten._unique.default, run_replicated)
