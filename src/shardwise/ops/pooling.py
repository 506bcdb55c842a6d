"""Sharding strategies of spatial ops: pooling (max, avg, adaptive, fractional, max_unpool),
interpolation (``upsample_*``), ``grid_sampler``, ``pixel_shuffle``/``pixel_unshuffle`` and
``channel_shuffle``, forward and backward.

These ops work on the last k (spatial) dims, each (batch, channel) plane on its own: the
leading dims may be sharded alike on every tensor argument and output, the spatial dims stay
whole (a window would need a halo). Indices that pooling returns are positions within a plane,
so they stay valid on a shard. Average pooling, interpolation and shuffles are linear in their
input, and every backward here is linear in the incoming gradient: a Partial("sum") there
gives Partial outputs. A global size argument (the ``input_size`` of an interpolation's
backward) is rewritten to the device's local size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..dtensor import DTensor
from ..mesh import DeviceMesh
from ..placements import Partial, Replicate, Shard
from ..spec import DTensorSpec
from .common import (
    DimOption,
    axis_options,
    input_strategies,
    leading_axes,
    linear_option,
    nonempty_shards,
    product_strategy,
    replicate_plain,
)
from .registry import (
    OpSchema,
    OpStrategy,
    RuntimeSchemaInfo,
    register_local_args,
    register_op_strategy,
    register_pre_patch,
)

aten = torch.ops.aten
R = Replicate()
P = Partial("sum")


def spatial_strategy(
    mesh: DeviceMesh,
    schema: OpSchema,
    core: Sequence[int],
    n_out: int,
    linear_in: Sequence[int] = (),
) -> OpStrategy:
    """Inputs independent along their leading dims (all but their last ``core[i]``), every
    output sharded on the same leading dims; ``linear_in``: inputs the op is jointly linear
    in (Partial("sum") options)."""
    inputs = input_strategies(schema)
    core = list(core) + [core[-1]] * (len(inputs) - len(core))
    in_dims = leading_axes([s.shape for s in inputs], core)
    n_axes = len(in_dims[0])
    out_dims = [list(range(n_axes))] * n_out
    in_dims_t = [d[:n_axes] for d in in_dims]
    options = axis_options(in_dims_t, out_dims)
    if linear_in:
        options.append(linear_option(len(inputs), n_out, linear_in))
    valid = nonempty_shards(mesh, [s.shape for s in inputs])
    return product_strategy(mesh, options, multi=n_out > 1, valid=valid)


def _ops(*names: str) -> list:
    """The overloads of ``aten.<name>`` that exist in this torch (``default`` and ``vec``)."""
    found = []
    for name in names:
        packet = getattr(aten, name, None)
        if packet is None:
            continue
        found += [getattr(packet, o) for o in packet.overloads() if o in ("default", "vec")]
    return found


def _register(
    ops: list,
    core: Sequence[int],
    n_out: int,
    linear_in: Sequence[int] = (),
    meta_of: int | None = None,
) -> None:
    """Register ``spatial_strategy``; ``meta_of``: the output's metadata is that input's (for
    ops without a meta kernel, e.g. ``fractional_max_pool3d_backward``)."""

    def strategy_fn(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
        found = spatial_strategy(mesh, schema, core, n_out, linear_in)
        if meta_of is not None:
            meta = input_strategies(schema)[meta_of].output_spec.tensor_meta
            for s in found.strategies:
                s.output_specs = DTensorSpec(mesh, s.output_spec.placements, meta)
        return found

    strategy_fn.__doc__ = (
        f"Leading dims sharded alike, the last {list(core)} dims of each input whole"
        + (f"; linear in inputs {list(linear_in)}" if linear_in else "")
        + "."
    )
    register_op_strategy(ops, schema_info=RuntimeSchemaInfo(1))(strategy_fn)


# ----- pooling ---------------------------------------------------------------------------------

for _k in (2, 3):
    _register(_ops(f"max_pool{_k}d_with_indices"), [_k], 2)
    _register(_ops(f"max_pool{_k}d_with_indices_backward"), [_k], 1, linear_in=[0])
    _register(_ops(f"avg_pool{_k}d"), [_k], 1, linear_in=[0])
    _register(_ops(f"avg_pool{_k}d_backward"), [_k], 1, linear_in=[0])
    _register(_ops(f"_adaptive_avg_pool{_k}d"), [_k], 1, linear_in=[0])
    _register(_ops(f"_adaptive_avg_pool{_k}d_backward"), [_k], 1, linear_in=[0])
    _register(_ops(f"adaptive_max_pool{_k}d"), [_k], 2)
    _register(_ops(f"adaptive_max_pool{_k}d_backward"), [_k], 1, linear_in=[0])
    # random_samples: (N, C, 2)
    _register(_ops(f"fractional_max_pool{_k}d"), [_k, 1], 2)
    _register(_ops(f"fractional_max_pool{_k}d_backward"), [_k], 1, linear_in=[0], meta_of=1)
    _register(_ops(f"max_unpool{_k}d"), [_k], 1, linear_in=[0])


# ----- interpolation -----------------------------------------------------------------------------

_UPSAMPLE = {
    "upsample_nearest1d": 1, "upsample_nearest2d": 2, "upsample_nearest3d": 3,
    "_upsample_nearest_exact1d": 1, "_upsample_nearest_exact2d": 2,
    "_upsample_nearest_exact3d": 3, "upsample_linear1d": 1, "upsample_bilinear2d": 2,
    "upsample_bicubic2d": 2, "upsample_trilinear3d": 3, "_upsample_bilinear2d_aa": 2,
    "_upsample_bicubic2d_aa": 2,
}


def _local_input_size(k: int):
    """An interpolation backward's ``input_size`` (global) becomes this device's: the leading
    dims take the local gradient's sizes, the last ``k`` (spatial) stay."""

    def hook(args: tuple, kwargs: dict, in_specs: list[DTensorSpec], out_spec, device: int):
        size = list(args[2])
        lead = len(size) - k
        size[:lead] = args[0].shape[:lead]
        return (args[0], args[1], size, *args[3:]), kwargs

    return hook


for _name, _k in _UPSAMPLE.items():
    _register(_ops(_name), [_k], 1, linear_in=[0])
    _backward = _ops(_name + "_backward")
    _register(_backward, [_k], 1, linear_in=[0])
    register_local_args(_backward, _local_input_size(_k))


# ----- grid_sampler ----------------------------------------------------------------------------

GRID_SAMPLERS = [aten.grid_sampler_2d.default, aten.grid_sampler_3d.default]
GRID_SAMPLER_BACKWARDS = [
    aten.grid_sampler_2d_backward.default,
    aten.grid_sampler_3d_backward.default,
]


@register_op_strategy(GRID_SAMPLERS, schema_info=RuntimeSchemaInfo(2))
def grid_sampler_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``grid_sampler_2d(input (N, C, H, W), grid (N, Ho, Wo, 2), ...)``: batch-sharded input
    and grid, or channel-sharded input with a replicated grid; linear in input."""
    options: list[DimOption] = [
        ((R, R), (R,)),
        ((Shard(0), Shard(0)), (Shard(0),)),
        ((Shard(1), R), (Shard(1),)),
        ((P, R), (P,)),
    ]
    return product_strategy(mesh, options)


@register_op_strategy(GRID_SAMPLER_BACKWARDS, schema_info=RuntimeSchemaInfo(3))
def grid_sampler_backward_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``grid_sampler_2d_backward(grad, input, grid, ...) -> (grad_input, grad_grid)``: batch
    sharded alike; channel-sharded grad and input give a channel-sharded grad_input and a
    Partial grad_grid (a sum over channels); linear in grad."""
    options: list[DimOption] = [
        ((R, R, R), (R, R)),
        ((Shard(0), Shard(0), Shard(0)), (Shard(0), Shard(0))),
        ((Shard(1), Shard(1), R), (Shard(1), P)),
        ((P, R, R), (P, P)),
    ]
    return product_strategy(mesh, options, multi=True)


# ----- shuffles ----------------------------------------------------------------------------------

_register(_ops("pixel_shuffle", "pixel_unshuffle"), [3], 1, linear_in=[0])


def _replicate_samples(op: object, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``F.fractional_max_pool*d`` draws its ``random_samples`` itself (a plain tensor the
    user never sees): taken as replicated, like every device drawing the same ones."""
    if isinstance(args[0], DTensor) and not isinstance(args[3], DTensor):
        args = (*args[:3], replicate_plain(args[0].device_mesh, args[3]), *args[4:])
    return args, kwargs


register_pre_patch(_ops("fractional_max_pool2d", "fractional_max_pool3d"), _replicate_samples)


@register_op_strategy(_ops("channel_shuffle", "native_channel_shuffle"), RuntimeSchemaInfo(1))
def channel_shuffle_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``channel_shuffle(x (N, C, *), groups)``: any dim but the channels may be sharded."""
    (x,) = input_strategies(schema)
    dims = [[d for d in range(x.ndim) if d != 1]]
    return product_strategy(mesh, axis_options(dims, dims) + [linear_option(1, 1, [0])])
