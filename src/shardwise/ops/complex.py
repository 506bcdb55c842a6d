"""Sharding strategies of the complex views (``view_as_real``, ``view_as_complex``) and of the
elementwise ops with two outputs (``frexp``, ``log_sigmoid_forward``), and the lazy
conjugation and negation views (``_conj``, ``_neg_view``).

``view_as_real`` adds a last dim of 2 (real, imaginary) and ``view_as_complex`` removes it:
every other dim keeps its shard, and both are linear over the reals (Partial("sum") passes).
A lazy conjugate or negative view sets a bit on the tensor that reads it; a DTensor's wrapper
would not carry its components' bit (``resolve_conj`` on it would do nothing), so on DTensors
these views are computed physically (same values, not aliasing the input).
"""

from __future__ import annotations

import torch

from ..mesh import DeviceMesh
from .common import axis_options, input_strategies, linear_option, product_strategy
from .registry import (
    OpSchema,
    OpStrategy,
    RuntimeSchemaInfo,
    bypass_dispatch,
    register_op_strategy,
)

aten = torch.ops.aten


@register_op_strategy(aten.view_as_real.default, schema_info=RuntimeSchemaInfo(1))
def view_as_real_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """Any dim sharded alike on input and output; linear."""
    (x,) = input_strategies(schema)
    dims = [list(range(x.ndim))]
    return product_strategy(mesh, axis_options(dims, dims) + [linear_option(1, 1, [0])])


@register_op_strategy(aten.view_as_complex.default, schema_info=RuntimeSchemaInfo(1))
def view_as_complex_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """Any dim but the last (real, imaginary) sharded alike; linear."""
    (x,) = input_strategies(schema)
    dims = [list(range(x.ndim - 1))]
    return product_strategy(mesh, axis_options(dims, dims) + [linear_option(1, 1, [0])])


@register_op_strategy(
    [aten.frexp.Tensor, aten.log_sigmoid_forward.default], schema_info=RuntimeSchemaInfo(1)
)
def two_output_elementwise_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """Elementwise with two outputs shaped like the input: any dim sharded alike."""
    (x,) = input_strategies(schema)
    dims = [list(range(x.ndim))]
    return product_strategy(mesh, axis_options(dims, [dims[0], dims[0]]), multi=True)


def _conj(op: object, args: tuple, kwargs: dict) -> object:
    """Conjugated physically (``conj_physical``): the same values, no lazy bit."""
    return aten.conj_physical.default(*args)


def _neg_view(op: object, args: tuple, kwargs: dict) -> object:
    """Negated physically (``neg``): the same values, no lazy bit."""
    return aten.neg.default(*args)


bypass_dispatch(aten._conj.default, _conj)
bypass_dispatch(aten._neg_view.default, _neg_view)
