"""Padding (reflect, replicate, constant) and ``F.unfold``/``F.fold`` (im2col/col2im).

Op table notes (one line per op):

- ``aten.reflection_pad{1,2,3}d``, ``aten.replication_pad{1,2,3}d``: shards on the dims that are
  not padded stay; values are only copied, so every Partial passes through.
- their ``*_backward``: shards on unpadded dims stay; linear, so Partial sum/avg pass through.
- ``aten.constant_pad_nd``: shards on unpadded dims stay; Partial passes when the pad value
  keeps it (sum needs 0).
- ``aten.im2col`` / ``aten.col2im``: batch shard stays; a channel shard stays when its chunks
  line up with the chunks of channels x kernel positions; Partial passes (sum/avg for col2im,
  which adds overlapping blocks).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..mesh import DeviceMesh
from ..placements import Partial, Replicate, Shard
from .common import DimOption, input_strategies, no_empty_shard, product_strategy, shard_like
from .registry import OpSchema, OpStrategy, RuntimeSchemaInfo, register_op_strategy

aten = torch.ops.aten

PADDED_DIMS = {
    aten.reflection_pad1d.default: 1,
    aten.reflection_pad2d.default: 2,
    aten.reflection_pad3d.default: 3,
    aten.replication_pad1d.default: 1,
    aten.replication_pad2d.default: 2,
    aten.replication_pad3d.default: 3,
}
BACKWARD_PADDED_DIMS = {
    aten.reflection_pad1d_backward.default: 1,
    aten.reflection_pad2d_backward.default: 2,
    aten.reflection_pad3d_backward.default: 3,
    aten.replication_pad1d_backward.default: 1,
    aten.replication_pad2d_backward.default: 2,
    aten.replication_pad3d_backward.default: 3,
}
ALL_REDUCE_OPS = ("sum", "avg", "max", "min")


def _pad_options(
    schema: OpSchema, n_padded: int, partial_ops: tuple[str, ...], n_inputs: int
) -> list[DimOption]:
    """Per mesh dim: Replicate; a shard of any unpadded dim (every input alike); Partial for
    ``partial_ops`` (first input Partial, the others replicated)."""
    first = input_strategies(schema)[0]
    rep = Replicate()
    options: list[DimOption] = [((rep,) * n_inputs, (rep,))]
    for d in range(first.ndim - n_padded):
        shard = shard_like(first.output_spec.placements, d)
        options.append(((shard,) * n_inputs, (shard,)))
    for op in partial_ops:
        options.append(((Partial(op),) + (rep,) * (n_inputs - 1), (Partial(op),)))
    return options


def _shapes(schema: OpSchema) -> list:
    """The DTensor inputs' shapes: an input's interleaved or ragged shard offered on every
    mesh dim fits only some of them (``product_strategy`` drops the others)."""
    return [s.shape for s in input_strategies(schema)]


def _kernel_accepts(
    mesh: DeviceMesh, schema: OpSchema, n_padded: int
) -> Callable[[tuple[DimOption, ...]], bool]:
    """The reflect/replicate kernels refuse zero-size dims other than a batch dim: reject
    combinations that would leave a device an empty piece of such a dim."""
    first = input_strategies(schema)[0]
    ndim = first.ndim
    dims = range(1 if ndim == n_padded + 2 else 0, ndim)

    def valid(combo: tuple[DimOption, ...]) -> bool:
        return no_empty_shard(mesh, first.shape, [c[0][0] for c in combo], dims)

    return valid


@register_op_strategy(list(PADDED_DIMS), schema_info=RuntimeSchemaInfo(1))
def pad_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """Reflect/replicate padding copies values within the padded dims."""
    n = PADDED_DIMS[schema.op]
    options = _pad_options(schema, n, ALL_REDUCE_OPS, 1)
    return product_strategy(
        mesh, options, valid=_kernel_accepts(mesh, schema, n), shapes=_shapes(schema)
    )


@register_op_strategy(list(BACKWARD_PADDED_DIMS), schema_info=RuntimeSchemaInfo(2))
def pad_backward_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """Gradient of padding: adds the gradient of copies back, within the padded dims
    (``self`` only gives the shape, so it follows grad's shards)."""
    n = BACKWARD_PADDED_DIMS[schema.op]
    options = _pad_options(schema, n, ("sum", "avg"), 2)
    return product_strategy(
        mesh, options, valid=_kernel_accepts(mesh, schema, n), shapes=_shapes(schema)
    )


@register_op_strategy(aten.constant_pad_nd.default, schema_info=RuntimeSchemaInfo(1))
def constant_pad_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """Constant padding of the last len(pad)/2 dims (negative pads crop)."""
    pad = schema.args_schema[1]
    value = schema.args_schema[2] if len(schema.args_schema) > 2 else 0
    value = schema.kwargs_schema.get("value", value)
    ops = ALL_REDUCE_OPS if value == 0 else ("avg", "max", "min")
    return product_strategy(
        mesh, _pad_options(schema, len(pad) // 2, ops, 1), shapes=_shapes(schema)
    )


def _channel_split_aligns(channels: int, block: int, n: int) -> bool:
    """Chunking ``channels`` over ``n`` devices keeps whole blocks of ``block`` rows exactly
    where chunking ``channels * block`` rows would put them."""
    return math.ceil(channels * block / n) == block * math.ceil(channels / n)


def _fold_options(
    mesh: DeviceMesh,
    schema: OpSchema,
    channel_in: int,
    channel_out: int,
    channels: int,
    block: int,
    partial_ops: tuple[str, ...],
) -> OpStrategy:
    """im2col/col2im: batch shard stays, a channel shard stays where its chunks line up (on a
    single mesh dim), Partial passes for ``partial_ops``."""
    rep = Replicate()
    options: list[DimOption] = [((rep,), (rep,))]
    if channel_in == 1:  # batched
        options.append(((Shard(0),), (Shard(0),)))
    options.append(((Shard(channel_in),), (Shard(channel_out),)))
    options += [((Partial(op),), (Partial(op),)) for op in partial_ops]

    def valid(combo: tuple[DimOption, ...]) -> bool:
        split = [m for m, c in enumerate(combo) if c[0][0] == Shard(channel_in)]
        return not split or (
            len(split) == 1 and _channel_split_aligns(channels, block, mesh.shape[split[0]])
        )

    return product_strategy(mesh, options, valid=valid)


@register_op_strategy(aten.im2col.default, schema_info=RuntimeSchemaInfo(1))
def im2col_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """(N, C, H, W) -> (N, C*kh*kw, L): every output row belongs to one input channel."""
    x = input_strategies(schema)[0]
    kernel = schema.args_schema[1]
    c = x.ndim - 3
    return _fold_options(mesh, schema, c, c, x.shape[c], math.prod(kernel), ALL_REDUCE_OPS)


@register_op_strategy(aten.col2im.default, schema_info=RuntimeSchemaInfo(1))
def col2im_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """(N, C*kh*kw, L) -> (N, C, H, W): sums overlapping blocks, per channel."""
    x = input_strategies(schema)[0]
    kernel = schema.args_schema[2]
    c = x.ndim - 2
    block = math.prod(kernel)
    return _fold_options(mesh, schema, c, c, x.shape[c] // block, block, ("sum", "avg"))
