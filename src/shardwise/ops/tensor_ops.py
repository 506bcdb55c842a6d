"""Tensor ops: casts and copies, the ``*_like`` and ``new_*`` factories, ``fill_``/``zero_``
and ``tril``/``triu``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..comm.reduction import cast_keeps_partial
from ..errors import InvalidArgumentError
from ..factories import keeps_value
from ..mesh import DeviceMesh
from ..op_inputs import register_plain_making_decomposition
from ..placements import Partial, Placement, Replicate, Shard, with_dim
from ..spec import DTensorSpec, TensorMeta, contiguous_meta
from .common import (
    bind,
    bind_schema,
    input_strategies,
    product_strategy,
    strategy,
    unary_options,
    with_output_meta,
)
from .registry import (
    OpSchema,
    OpStrategy,
    RuntimeSchemaInfo,
    bypass_dispatch,
    register_local_args,
    register_op_strategy,
)

aten = torch.ops.aten

# Keyword arguments that change the output's metadata, so they key the sharding cache.
META_KWARGS = RuntimeSchemaInfo(1, ("dtype", "layout", "device", "memory_format"))

# ----- *_like, zero_, casts ------------------------------------------------------------------

KEEP_PARTIAL_LIKE = [aten.zero_.default, aten.zeros_like.default]
VALUE_LIKE = [aten.ones_like.default, aten.full_like.default, aten.empty_like.default]


@register_op_strategy(KEEP_PARTIAL_LIKE, schema_info=META_KWARGS)
def zeros_like_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """Zeros are a valid value for every placement, Partial included: the output keeps the
    input's placements and nothing moves."""
    placements = input_strategies(schema)[0].output_spec.placements
    return OpStrategy([strategy(mesh, [placements], placements)])


@register_op_strategy(VALUE_LIKE, schema_info=META_KWARGS)
def value_like_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``ones_like``/``full_like``/``empty_like`` ignore the input's values: shards stay shards
    and a Partial mesh dim becomes Replicate (every device writes the whole constant), with no
    data moved. (``empty_like`` is usually filled next, e.g. by dropout's ``bernoulli_``: the
    filled values are not partial.)"""
    placements = input_strategies(schema)[0].output_spec.placements
    out = tuple(Replicate() if p.is_partial() else p for p in placements)
    return OpStrategy([strategy(mesh, [placements], out)])


def _like_on_mesh_devices(
    args: tuple, kwargs: dict, inputs: list[DTensorSpec], output: DTensorSpec, device: int
) -> tuple[tuple, dict]:
    """``empty_like(x, device=...)`` (``Module.to_empty``'s call): where the process holds
    several devices of the mesh, a device without an index ("cuda") means each piece's own
    mesh device; a device type other than the mesh's (or "meta") would leave pieces where the
    mesh's collectives cannot reach them, so it is refused."""
    requested = kwargs.get("device")
    if requested is None:
        return args, kwargs
    requested = torch.device(requested)
    mesh = output.mesh
    if requested.type == "meta":
        return args, kwargs
    if requested.type != mesh.device_type:
        raise InvalidArgumentError(
            f"empty_like(device={str(requested)!r}) of a DTensor of shape "
            f"{list(inputs[0].tensor_meta.shape)} with placements {list(output.placements)} on "
            f"{mesh}: its pieces live on the mesh's {mesh.device_type!r} devices; pass a "
            f"device of type {sorted({mesh.device_type, 'meta'})}"
        )
    if requested.index is None and mesh.num_local_devices() > 1:
        kwargs = {**kwargs, "device": mesh.device_of(device)}
    return args, kwargs


register_local_args(aten.empty_like.default, _like_on_mesh_devices)


@register_op_strategy(aten._to_copy.default, schema_info=META_KWARGS)
def to_copy_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """Casts and copies keep the layout. A Partial input passes only the casts that
    ``comm.reduction.cast_keeps_partial`` allows (widening float casts for sums); any other
    cast could overflow, round or wrap each piece, so the input is reduced first."""
    arg = input_strategies(schema)[0]
    bound = bind_schema(schema)
    source = arg.output_spec.tensor_meta
    dtype = bound.get("dtype") or source.dtype

    def allowed(p: Placement) -> bool:
        return not isinstance(p, Partial) or cast_keeps_partial(p.reduce_op, source.dtype, dtype)

    found = product_strategy(mesh, unary_options(arg.output_spec.placements, arg.ndim, allowed))
    if bound.get("memory_format") in (None, torch.preserve_format):
        return with_output_meta(found, TensorMeta(source.shape, source.stride, dtype))
    return with_output_meta(found, contiguous_meta(source.shape, dtype))


# ----- new_* factories -----------------------------------------------------------------------

NEW_ZEROS_LIKE = [aten.new_zeros.default, aten.new_empty.default, aten.new_empty_strided.default]
NEW_VALUE = [aten.new_ones.default, aten.new_full.default]


@register_op_strategy(NEW_ZEROS_LIKE + NEW_VALUE, schema_info=META_KWARGS)
def new_factory_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``self.new_zeros(size)`` and friends make a tensor of the *global* ``size``.

    When ``size`` is ``self``'s global shape the output takes ``self``'s placements (each device
    makes its own piece: what autograd's formulas want, e.g. a zero gradient shaped like its
    input); a Partial dim stays Partial for zeros/empty and becomes Replicate for ones/full.
    Any other size gives a Replicate output: every device makes the whole tensor.
    """
    arg = input_strategies(schema)[0]
    placements = arg.output_spec.placements
    size = tuple(bind_schema(schema)["size"])
    if size != tuple(arg.shape):
        out = (Replicate(),) * mesh.ndim
    elif schema.op in NEW_VALUE:
        out = tuple(Replicate() if p.is_partial() else p for p in placements)
    else:
        out = placements
    return OpStrategy([strategy(mesh, [placements], out)])


def _local_stride(global_stride: Sequence[int], local_shape: Sequence[int]) -> list[int]:
    """A dense stride for ``local_shape`` with the dim order of ``global_stride``."""
    order = sorted(range(len(local_shape)), key=lambda d: global_stride[d])
    stride, acc = [0] * len(local_shape), 1
    for d in order:
        stride[d] = acc
        acc *= max(local_shape[d], 1)
    return stride


def _new_factory_local(
    args: tuple, kwargs: dict, inputs: list[DTensorSpec], output: DTensorSpec, device: int
) -> tuple[tuple, dict]:
    """Sharded outputs (``size`` is ``self``'s shape): the global size (and stride) become
    this device's piece's."""
    if output.is_replicated():
        return args, kwargs
    local = list(
        DTensorSpec(output.mesh, output.placements, inputs[0].tensor_meta).local_shape(device)
    )
    new_args = (args[0], local, *args[2:])
    if len(args) > 2 and isinstance(args[2], (list, tuple)) and len(args[2]) == len(local):
        new_args = (args[0], local, _local_stride(args[2], local), *args[3:])
    return new_args, kwargs


register_local_args(NEW_ZEROS_LIKE + NEW_VALUE, _new_factory_local)


# ----- is_same_size ----------------------------------------------------------------------------


def _is_same_size(_op: Any, args: tuple, _kwargs: dict) -> bool:
    """``a.is_same_size(b)`` compares the global shapes (a DTensor's or a plain tensor's):
    a question about metadata every process already holds, so nothing moves."""
    return tuple(args[0].shape) == tuple(args[1].shape)


bypass_dispatch(aten.is_same_size.default, _is_same_size)


# ----- fill_ and copy_ -----------------------------------------------------------------------


@register_op_strategy([aten.fill_.Scalar, aten.fill_.Tensor], schema_info=RuntimeSchemaInfo(1))
def fill_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """In place, so ``self`` keeps its placements; a tensor fill value is replicated. On a
    Partial("sum") dim only the first device writes the value (see ``_fill_local``)."""
    strategies = input_strategies(schema)
    placements = strategies[0].output_spec.placements
    ins = [placements] + [(Replicate(),) * mesh.ndim] * (len(strategies) - 1)
    return OpStrategy([strategy(mesh, ins, placements)])


def _fill_local(
    args: tuple, kwargs: dict, inputs: list[DTensorSpec], _output: Any, device: int
) -> tuple[tuple, dict]:
    """Devices holding the zeros of a Partial("sum") ``self`` fill with 0, so the reduced value
    is the fill value (not n times it)."""
    if keeps_value(inputs[0], device):
        return args, kwargs
    value = args[1]
    zero = torch.zeros_like(value) if isinstance(value, torch.Tensor) else 0
    return (args[0], zero, *args[2:]), kwargs


register_local_args([aten.fill_.Scalar, aten.fill_.Tensor], _fill_local)


def _broadcast_placement(p: Placement, self_shape: Sequence[int], src_shape: Sequence[int]):
    """The placement ``src`` needs on one mesh dim so that, broadcast to ``self``'s shape, each
    device's piece lines up with ``self``'s piece there."""
    if not isinstance(p, Shard):
        return p
    d = p.dim - (len(self_shape) - len(src_shape))
    if d < 0 or src_shape[d] == 1:
        return Replicate()
    return with_dim(p, d)


@register_op_strategy(aten.copy_.default, schema_info=RuntimeSchemaInfo(2))
def copy_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``self.copy_(src)`` keeps ``self``'s placements; ``src`` is redistributed to match
    (broadcast dims replicated). For a Partial ``self`` the source may be Partial alike (linear
    casts only) or Replicate, in which case only the devices keeping the value write it
    (``_copy_local``), so the reduced value is ``src`` whatever the dtypes."""
    dst, src = input_strategies(schema)
    placements = dst.output_spec.placements
    target = tuple(_broadcast_placement(p, dst.shape, src.shape) for p in placements)
    replicated = tuple(Replicate() if p.is_partial() else p for p in target)
    candidates = [strategy(mesh, [placements, replicated], placements)]
    dtype = dst.output_spec.tensor_meta.dtype
    same_kind = dtype == src.output_spec.tensor_meta.dtype or dtype.is_floating_point
    if target != replicated and same_kind:
        candidates.append(strategy(mesh, [placements, target], placements))
    return OpStrategy(candidates)


def _copy_local(
    args: tuple, kwargs: dict, inputs: list[DTensorSpec], _output: Any, device: int
) -> tuple[tuple, dict]:
    """With a replicated source into a Partial("sum") ``self``, the devices holding zeros copy
    zeros (a Partial source carries its own zeros)."""
    dst, src = inputs
    coord = dst.mesh.coordinate_of(device)
    zero = any(
        isinstance(p, Partial) and p.zeros_elsewhere and coord[m] != 0 and q.is_replicate()
        for m, (p, q) in enumerate(zip(dst.placements, src.placements, strict=True))
    )
    if not zero:
        return args, kwargs
    return (args[0], torch.zeros_like(args[1]), *args[2:]), kwargs


register_local_args(aten.copy_.default, _copy_local)


# ----- tril / triu -----------------------------------------------------------------------------


@register_op_strategy([aten.tril.default, aten.triu.default], schema_info=RuntimeSchemaInfo(1))
def tril_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """Masking by position is linear, so Partial passes; any dim may be sharded. The last two
    dims may only be sharded contiguously (plain Shard): each device then shifts the diagonal
    by its global row and column offsets (``_tril_local``)."""
    arg = input_strategies(schema)[0]
    ndim = arg.ndim

    def allowed(p: Placement) -> bool:
        return not (isinstance(p, Shard) and type(p) is not Shard and p.dim >= ndim - 2)

    found = product_strategy(mesh, unary_options(arg.output_spec.placements, ndim, allowed))
    meta = arg.output_spec.tensor_meta
    return with_output_meta(found, contiguous_meta(meta.shape, meta.dtype))  # always contiguous


def _offset(spec: DTensorSpec, device: int, dim: int) -> int:
    return spec.local_segments(device)[dim][0][0]


def _tril_local(
    args: tuple, kwargs: dict, inputs: list[DTensorSpec], _output: Any, device: int
) -> tuple[tuple, dict]:
    """Local element (i, j) is global (i + r0, j + c0): keep it when j + c0 - (i + r0) <= k,
    i.e. the local diagonal is k + r0 - c0."""
    spec = inputs[0]
    ndim = spec.ndim
    diagonal = bind(aten.tril.default, args, kwargs)["diagonal"]
    shift = _offset(spec, device, ndim - 2) - _offset(spec, device, ndim - 1)
    if shift == 0:
        return args, kwargs
    return (args[0], diagonal + shift), {}


register_local_args([aten.tril.default, aten.triu.default], _tril_local)

# in place: the strategy keeps the input's placements among its options
register_op_strategy([aten.tril_.default, aten.triu_.default], RuntimeSchemaInfo(1))(tril_strategy)
register_local_args([aten.tril_.default, aten.triu_.default], _tril_local)


# F.one_hot has no rule of its own: torch's decomposition compares the labels with an
# ``arange(num_classes)`` it makes as a plain tensor
register_plain_making_decomposition(aten.one_hot.default, "arange(num_classes)")
