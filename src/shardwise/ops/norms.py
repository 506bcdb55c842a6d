"""Sharding strategies of normalisations: layer_norm and softmax/log_softmax, forward and backward.

A normalisation reduces over some dims (the normalised dims, or the softmax dim) and is
independent along the others. So the normalised dims must be whole on every device, the other
(batch) dims may be sharded freely, and weight/bias are replicated. The backward passes are linear
in the incoming gradient, so a Partial gradient gives Partial input gradients without
communication. ``F.rms_norm`` on CPU in torch 2.13 is CompositeImplicitAutograd (so is
``aten._fused_rms_norm``): DTensors only see its pointwise and mean ops, which the pointwise and
reduction families shard.

``mesh_strategies`` is the helper the nn families share: one list of per-mesh-dim options, every
combination over the mesh dims.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch

from ..mesh import DeviceMesh
from ..placements import Partial, Placement, Replicate, Shard
from .common import input_strategies, spec_of
from .registry import (
    OpSchema,
    OpStrategy,
    PlacementStrategy,
    RuntimeSchemaInfo,
    register_op_strategy,
)

aten = torch.ops.aten

# One mesh dim's choice: a placement for every DTensor input (flattened order), one per output.
Option = tuple[Sequence[Placement], Sequence[Placement]]

R = Replicate()
P = Partial("sum")


def mesh_strategies(
    mesh: DeviceMesh,
    schema: OpSchema,
    options: Sequence[Option] | Callable[[int], Sequence[Option]],
    multi: bool = True,
) -> OpStrategy:
    """Every way to pick one of ``options`` on each mesh dim, as an ``OpStrategy``
    (``options`` may be a function of the mesh dim, for placements that stay as they are).

    Candidates that keep the inputs where they are come first: dispatch breaks cost ties by
    order, and moving Replicate to Shard costs nothing, so without this a replicated input could
    come out sharded for no reason.
    """
    current = [s.output_spec.placements for s in input_strategies(schema)]
    candidates = []
    per_dim = [options(m) if callable(options) else options for m in range(mesh.ndim)]
    for combo in itertools.product(*per_dim):
        ins = [tuple(opt[0][i] for opt in combo) for i in range(len(combo[0][0]))]
        outs = [tuple(opt[1][j] for opt in combo) for j in range(len(combo[0][1]))]
        moved = sum(a != b for a, b in zip(ins, current, strict=True))
        candidates.append((moved, ins, outs))
    candidates.sort(key=lambda c: c[0])
    strategies = []
    for _, ins, outs in candidates:
        in_specs = [spec_of(mesh, p) for p in ins]
        if multi:
            strategies.append(PlacementStrategy(tuple(spec_of(mesh, p) for p in outs), in_specs))
        else:
            strategies.append(PlacementStrategy(spec_of(mesh, outs[0]), in_specs))
    return OpStrategy(strategies)


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
    options: list[Option] = [((R,) * len(inputs), (R, R, R))]
    for d in range(axis):
        options.append(((Shard(d),) + (R,) * n_params, (Shard(d),) * 3))
    return mesh_strategies(mesh, schema, options)


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
    options: list[Option] = [((R,) * len(inputs), (R, R, R))]
    for d in range(axis):
        options.append(((Shard(d),) * 4 + (R,) * n_params, (Shard(d), P, P)))
    options.append(((P,) + (R,) * (len(inputs) - 1), (P, P, P)))
    return mesh_strategies(mesh, schema, options)


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
    options: list[Option] = [((R,), (R,))]
    options += [((Shard(d),), (Shard(d),)) for d in range(x.ndim) if d != dim]
    return mesh_strategies(mesh, schema, options, multi=False)


@register_op_strategy(SOFTMAX_BACKWARD_OPS, schema_info=RuntimeSchemaInfo(2))
def softmax_backward_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``_softmax_backward_data(grad, output, dim, input_dtype)``: grad and output sharded alike
    on any dim but ``dim``; linear in grad, so a Partial grad with a replicated output gives a
    Partial result."""
    grad, _ = input_strategies(schema)
    dim = _norm_dim(schema.args_schema[2], grad.ndim)
    options: list[Option] = [((R, R), (R,)), ((P, R), (P,))]
    options += [((Shard(d), Shard(d)), (Shard(d),)) for d in range(grad.ndim) if d != dim]
    return mesh_strategies(mesh, schema, options, multi=False)
