"""Sharding strategies of convolutions (``aten.convolution``: every conv and transposed conv,
1-d to 3-d) and of ``aten.convolution_backward``.

A convolution is independent along the batch dim, so a batch-sharded input with a replicated
weight gives a batch-sharded output. Spatial dims need halos and stay whole. With ``groups=1``
the output channels are independent (weight and bias sharded on the output channels give a
channel-sharded output) and the input channels are summed over (input and weight sharded on
the input channels give a Partial("sum") output, the bias added on one device only, which a
Partial bias does). The op is linear in its input and in its weight, so a Partial input with a
replicated weight (or the other way round) gives a Partial output. The weight of a transposed
convolution is ``(in, out / groups, *kernel)``; of a plain one ``(out, in / groups, *kernel)``.
"""

from __future__ import annotations

import torch

from ..mesh import DeviceMesh
from ..placements import Partial, Replicate, Shard
from .common import DimOption, input_strategies, nonempty_shards, product_strategy
from .registry import OpSchema, OpStrategy, RuntimeSchemaInfo, register_op_strategy

aten = torch.ops.aten

R = Replicate()
P = Partial("sum")


def _weight_dims(transposed: bool) -> tuple[int, int]:
    """(output-channel dim, input-channel dim) of the weight."""
    return (1, 0) if transposed else (0, 1)


@register_op_strategy(aten.convolution.default, schema_info=RuntimeSchemaInfo(3))
def convolution_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``convolution(input, weight, bias?, stride, padding, dilation, transposed,
    output_padding, groups)``: batch, output-channel, input-channel (Partial) and linear
    options; channel options only without groups."""
    inputs = input_strategies(schema)
    has_bias = len(inputs) == 3
    transposed, groups = schema.args_schema[6], schema.args_schema[8]
    w_out, w_in = _weight_dims(transposed)

    def opt(x, w, b, out) -> DimOption:
        return ((x, w, b) if has_bias else (x, w)), (out,)

    options = [opt(R, R, R, R), opt(Shard(0), R, R, Shard(0))]
    options += [opt(P, R, P, P), opt(R, P, P, P)]
    if groups == 1:
        options.append(opt(R, Shard(w_out), Shard(0), Shard(1)))
        options.append(opt(Shard(1), Shard(w_in), P, P))
    return product_strategy(mesh, options, valid=nonempty_shards(mesh, [s.shape for s in inputs]))


@register_op_strategy(aten.convolution_backward.default, schema_info=RuntimeSchemaInfo(3))
def convolution_backward_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``convolution_backward(grad_output, input, weight, bias_sizes, stride, padding,
    dilation, transposed, output_padding, groups, output_mask) -> (grad_input, grad_weight,
    grad_bias)``: a batch-sharded pass gives a sharded grad_input and Partial weight and bias
    gradients; channel-sharded passes mirror the forward's; linear in grad_output, and
    grad_weight is linear in input and grad_input in weight."""
    transposed, groups = schema.args_schema[7], schema.args_schema[9]
    w_out, w_in = _weight_dims(transposed)
    options: list[DimOption] = [
        ((R, R, R), (R, R, R)),
        ((Shard(0), Shard(0), R), (Shard(0), P, P)),
        ((P, R, R), (P, P, P)),
        ((R, P, R), (R, P, R)),
        ((R, R, P), (P, R, R)),
    ]
    if groups == 1:
        options.append(((Shard(1), R, Shard(w_out)), (P, Shard(w_out), Shard(0))))
        options.append(((R, Shard(1), Shard(w_in)), (Shard(1), Shard(w_in), R)))
    shapes = [s.shape for s in input_strategies(schema)]
    return product_strategy(mesh, options, multi=True, valid=nonempty_shards(mesh, shapes))
