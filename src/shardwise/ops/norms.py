"""Sharding strategies of normalisations: layer_norm and softmax/log_softmax, forward and backward.

A normalisation reduces over some dims (the normalised dims, or the softmax dim) and is
independent along the others. So the normalised dims must be whole on every device, the other
(batch) dims may be sharded freely, and weight/bias are replicated. The backward passes are linear
in the incoming gradient, so a Partial gradient gives Partial input gradients without
communication. ``F.rms_norm`` on CPU in torch 2.13 is CompositeImplicitAutograd (so is
``aten._fused_rms_norm``): DTensors only see its pointwise and mean ops, which the pointwise and
reduction families shard.

Strategies are built with ``common.product_strategy``: one list of per-mesh-dim options, every
combination over the mesh dims.
"""

from __future__ import annotations

import torch

from ..mesh import DeviceMesh
from ..placements import Shard
from .common import DimOption, P, R, input_strategies, product_strategy
from .registry import (
    OpSchema,
    OpStrategy,
    RuntimeSchemaInfo,
    register_op_strategy,
)

aten = torch.ops.aten


def _norm_dim(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


# ----- layer_norm ------------------------------------------------------------------------------


@register_op_strategy(aten.native_layer_norm.default, schema_info=RuntimeSchemaInfo(1))
def layer_norm_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``native_layer_norm(input, normalized_shape, weight?, bias?, eps) -> (out, mean, rstd)``:
    batch dims (those before the normalised ones) sharded or replicated; weight/bias replicated.
    ``mean``/``rstd`` keep the batch dims, so they take the input's sharding."""
    inputs = input_strategies(schema)
    ndim = inputs[0].ndim
    axis = ndim - len(schema.args_schema[1])
    n_params = len(inputs) - 1
    options: list[DimOption] = [((R,) * len(inputs), (R, R, R))]
    for d in range(axis):
        options.append(((Shard(d),) + (R,) * n_params, (Shard(d),) * 3))
    return product_strategy(mesh, options, multi=True)


@register_op_strategy(aten.native_layer_norm_backward.default, schema_info=RuntimeSchemaInfo(2))
def layer_norm_backward_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``native_layer_norm_backward(grad, input, normalized_shape, mean, rstd, weight?, bias?,
    output_mask)``: batch-sharded grad/input/mean/rstd give a sharded grad_input and Partial
    grad_weight/grad_bias (sums over the local batch); a Partial grad gives Partial everything
    (the backward is linear in grad)."""
    inputs = input_strategies(schema)
    ndim = inputs[1].ndim
    axis = ndim - len(schema.args_schema[2])
    n_params = len(inputs) - 4
    options: list[DimOption] = [((R,) * len(inputs), (R, R, R))]
    for d in range(axis):
        options.append(((Shard(d),) * 4 + (R,) * n_params, (Shard(d), P, P)))
    options.append(((P,) + (R,) * (len(inputs) - 1), (P, P, P)))
    return product_strategy(mesh, options, multi=True)


# ----- softmax ---------------------------------------------------------------------------------

SOFTMAX_OPS = [aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default]
SOFTMAX_BACKWARD_OPS = [
    aten._softmax_backward_data.default,
    aten._log_softmax_backward_data.default,
]


@register_op_strategy(SOFTMAX_OPS, schema_info=RuntimeSchemaInfo(1))
def softmax_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``_softmax(x, dim, half_to_float)`` and friends: any dim but ``dim`` may be sharded."""
    (x,) = input_strategies(schema)
    dim = _norm_dim(schema.args_schema[1], x.ndim)
    options: list[DimOption] = [((R,), (R,))]
    options += [((Shard(d),), (Shard(d),)) for d in range(x.ndim) if d != dim]
    return product_strategy(mesh, options)


@register_op_strategy(SOFTMAX_BACKWARD_OPS, schema_info=RuntimeSchemaInfo(2))
def softmax_backward_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``_softmax_backward_data(grad, output, dim, input_dtype)``: grad and output sharded alike
    on any dim but ``dim``; linear in grad, so a Partial grad with a replicated output gives a
    Partial result."""
    grad, _ = input_strategies(schema)
    dim = _norm_dim(schema.args_schema[2], grad.ndim)
    options: list[DimOption] = [((R, R), (R,)), ((P, R), (P,))]
    options += [((Shard(d), Shard(d)), (Shard(d),)) for d in range(grad.ndim) if d != dim]
    return product_strategy(mesh, options)
