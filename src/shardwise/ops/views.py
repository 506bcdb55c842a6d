"""Sharding of view and shape ops: transpose/permute, squeeze/unsqueeze, expand, slice/select,
split/unbind, cat/stack, repeat, diagonal, and the backward ops they emit (view/reshape:
``reshape.py``), and the local sizes of the ops that take a global size.

Every op here moves data without arithmetic, so Partial passes through unchanged. A Shard stays
a Shard when the op maps its tensor dim onto an output dim whose per-device pieces are exactly
the local results (same size, or for views the same global elements in the same order); else
that mesh dim must be Replicate. Strategies list every such per-mesh-dim choice, ordered so that
among equally cheap ones dispatch keeps the inputs as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from math import prod

import torch

from ..caches import PER_LAYOUT, cached
from ..dtensor import local_of, set_local
from ..geometry import shard_segments
from ..mesh import DeviceMesh
from ..op_inputs import register_value_reading_decomposition
from ..placements import (
    InterleavedShard,
    Partial,
    Placement,
    Replicate,
    Shard,
)
from ..spec import DTensorSpec
from ..torch_compat import DisableTorchDispatch
from .common import (
    DimOption,
    bind,
    input_strategies,
    mapped_options,
    product_strategy,
    same_kind,
)
from .registry import (
    OpSchema,
    OpStrategy,
    RuntimeSchemaInfo,
    bypass_dispatch,
    register_local_args,
    register_op_strategy,
)
from .reshape import infer_size

aten = torch.ops.aten

DimMap = dict[int, int]


def _norm(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


def _mapped(mesh: DeviceMesh, schema: OpSchema, dim_map: DimMap) -> OpStrategy:
    current = input_strategies(schema)[0].output_spec.placements
    return product_strategy(mesh, lambda m: mapped_options(current[m], dim_map))


def _arg(schema: OpSchema, pos: int, name: str, default: object) -> object:
    args = schema.args_schema
    if len(args) > pos:
        return args[pos]
    return schema.kwargs_schema.get(name, default)


def _input(schema: OpSchema) -> DTensorSpec:
    return input_strategies(schema)[0].output_spec


def _local_shape(
    mesh: DeviceMesh, placements: tuple[Placement, ...], shape: Sequence[int], device: int
) -> list[int]:
    segments = shard_segments(tuple(shape), mesh.shape, placements, mesh.coordinate_of(device))
    return [sum(b - a for a, b in runs) for runs in segments]


# ----- local sizes for ops that take a global size ----------------------------------------


def _view_global(args: tuple, spec: DTensorSpec) -> list[int]:
    return infer_size(args[1], prod(spec.shape), "view")


def _expand_global(args: tuple, spec: DTensorSpec) -> list[int]:
    size = [int(s) for s in args[1]]
    offset = len(size) - spec.ndim
    return [spec.shape[i - offset] if s == -1 else s for i, s in enumerate(size)]


def _literal_global(args: tuple, spec: DTensorSpec) -> list[int]:
    return [int(s) for s in args[1]]


@cached(PER_LAYOUT)
def _cached_local_size(
    global_size: Callable[[tuple, DTensorSpec], list[int]], size: tuple, spec: DTensorSpec,
    out_spec: DTensorSpec, device: int,
) -> tuple[int, ...]:
    shape = global_size((None, size), spec)
    return tuple(_local_shape(spec.mesh, out_spec.placements, shape, device))


def _local_size(
    global_size: Callable[[tuple, DTensorSpec], list[int]], args: tuple, spec: DTensorSpec,
    out_spec: DTensorSpec, device: int,
) -> Sequence[int]:
    """The device's output shape for the global size argument ``args[1]`` (cached by specs,
    whose hashes are cached: a size hook runs once per device and call)."""
    try:
        return _cached_local_size(global_size, tuple(args[1]), spec, out_spec, device)
    except TypeError:  # symbolic sizes do not hash
        return _local_shape(spec.mesh, out_spec.placements, global_size(args, spec), device)


def _size_hook(global_size: Callable[[tuple, DTensorSpec], list[int]]):
    """A local-args hook replacing the global size (argument 1) by the device's output shape."""

    def hook(args: tuple, kwargs: dict, in_specs: list[DTensorSpec], out_spec, device: int):
        local = _local_size(global_size, args, in_specs[0], out_spec, device)
        return (args[0], local, *args[2:]), kwargs

    return hook


def _view_hook(args: tuple, kwargs: dict, in_specs: list[DTensorSpec], out_spec, device: int):
    """The local view size; a component whose strides cannot take the view (a shard cut out of
    a larger tensor, say) is made contiguous first, as the global tensor's layout allows it
    (a contiguous component takes every view: no trial view)."""
    component = args[0]
    local = _local_size(_view_global, args, in_specs[0], out_spec, device)
    if not component.is_contiguous():
        try:
            component.view(local)
        except RuntimeError:
            component = component.contiguous()
    return (component, local, *args[2:]), kwargs


register_local_args([aten.view.default, aten._unsafe_view.default], _view_hook)
register_local_args(aten.expand.default, _size_hook(_expand_global))
register_local_args(
    [aten.slice_backward.default, aten.select_backward.default, aten.diagonal_backward.default],
    _size_hook(_literal_global),
)

# ----- dim permutations ---------------------------------------------------------------------


@register_op_strategy(
    [aten.transpose.int, aten.t.default, aten.permute.default], schema_info=RuntimeSchemaInfo(1)
)
def permute_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """A shard follows its dim to wherever the permutation puts it."""
    ndim = _input(schema).ndim
    if schema.op == aten.permute.default:
        order = [_norm(d, ndim) for d in schema.args_schema[1]]
    else:
        order = list(range(ndim))
        if schema.op == aten.transpose.int:
            d0, d1 = (_norm(d, ndim) for d in schema.args_schema[1:3])
        else:
            d0, d1 = 0, ndim - 1
        if ndim:
            order[d0], order[d1] = order[d1], order[d0]
    return _mapped(mesh, schema, {d: i for i, d in enumerate(order)})


# ----- squeeze / unsqueeze ---------------------------------------------------------------


@register_op_strategy(aten.squeeze.dims, schema_info=RuntimeSchemaInfo(1))
def squeeze_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """Removed size-1 dims must be Replicate (a shard of one element sits on one device)."""
    shape = _input(schema).shape
    ndim = len(shape)
    dims = {_norm(d, ndim) for d in schema.args_schema[1] if ndim and shape[_norm(d, ndim)] == 1}
    kept = [d for d in range(ndim) if d not in dims]
    return _mapped(mesh, schema, {d: i for i, d in enumerate(kept)})


def _squeeze_as_dims(op: object, args: tuple, kwargs: dict) -> object:
    """squeeze() and squeeze(dim) act on local sizes; squeeze only the globally size-1 dims."""
    x = args[0]
    ndim = x.ndim
    if op in (aten.squeeze.default, aten.squeeze_.default):
        wanted = range(ndim)
    else:
        dim = args[1] if len(args) > 1 else kwargs["dim"]
        wanted = dim if isinstance(dim, (list, tuple)) else [dim]
    dims = [_norm(d, ndim) for d in wanted if ndim and x.shape[_norm(d, ndim)] == 1]
    return aten.squeeze.dims(x, dims)


def _squeeze_dims_hook(args: tuple, kwargs: dict, in_specs: list[DTensorSpec], out_spec, device):
    """Squeeze only dims of global size 1 (a shard may have local size 1 where the global
    size is not)."""
    shape = in_specs[0].shape
    dims = [_norm(d, len(shape)) for d in args[1]]
    return (args[0], [d for d in dims if not shape or shape[d] == 1], *args[2:]), kwargs


register_local_args(aten.squeeze.dims, _squeeze_dims_hook)


@register_op_strategy(aten.unsqueeze.default, schema_info=RuntimeSchemaInfo(1))
def unsqueeze_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    ndim = _input(schema).ndim
    new = _norm(schema.args_schema[1], ndim + 1)
    return _mapped(mesh, schema, {d: d + (d >= new) for d in range(ndim)})


_INPLACE_VIEWS = {
    aten.squeeze_.default: _squeeze_as_dims,
    aten.squeeze_.dim: _squeeze_as_dims,
    aten.squeeze_.dims: _squeeze_as_dims,
    aten.unsqueeze_.default: lambda op, a, k: aten.unsqueeze.default(*a, **k),
    aten.t_.default: lambda op, a, k: aten.t.default(*a, **k),
    aten.transpose_.default: lambda op, a, k: aten.transpose.int(*a, **k),
}


def _inplace_view(op: object, args: tuple, kwargs: dict) -> object:
    """In-place view ops change the DTensor's own shape: compute the out-of-place view, then
    give its spec and components to the input and correct the wrapper's sizes and strides."""
    out = _INPLACE_VIEWS[op](op, args, kwargs)
    self = args[0]
    with DisableTorchDispatch():
        op(self, *args[1:], **kwargs)
    set_local(self, local_of(out))
    return self


bypass_dispatch([aten.squeeze.default, aten.squeeze.dim], _squeeze_as_dims)
bypass_dispatch(list(_INPLACE_VIEWS), _inplace_view)

# ----- expand / repeat ----------------------------------------------------------------------


@register_op_strategy(aten.expand.default, schema_info=RuntimeSchemaInfo(1))
def expand_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """Dims that keep their size keep their shard; broadcast and new dims are Replicate."""
    shape = _input(schema).shape
    size = list(schema.args_schema[1])
    offset = len(size) - len(shape)
    dim_map = {d: d + offset for d in range(len(shape)) if size[d + offset] in (-1, shape[d])}
    return _mapped(mesh, schema, dim_map)


@register_op_strategy(aten.repeat.default, schema_info=RuntimeSchemaInfo(1))
def repeat_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """Only dims repeated once keep their shard (a repeated shard is not a chunk)."""
    ndim = _input(schema).ndim
    repeats = list(schema.args_schema[1])
    offset = len(repeats) - ndim
    return _mapped(mesh, schema, {d: d + offset for d in range(ndim) if repeats[d + offset] == 1})


# ----- slice / select and their backward ----------------------------------------------------


def _slice_bounds(schema: OpSchema, size: int, first: int) -> tuple[int, int, int]:
    """(start, end, step) of a slice normalized like Python's, for a dim of ``size``."""
    start = _arg(schema, first, "start", None)
    end = _arg(schema, first + 1, "end", None)
    step = _arg(schema, first + 2, "step", 1)
    return slice(start, end, step).indices(size)


def _is_full(bounds: tuple[int, int, int], size: int) -> bool:
    return bounds[0] == 0 and bounds[1] >= size and bounds[2] == 1


@register_op_strategy(aten.slice.Tensor, schema_info=RuntimeSchemaInfo(1))
def slice_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """A slice along a sharded dim needs that dim whole, unless it takes the full range."""
    shape = _input(schema).shape
    ndim = len(shape)
    dim = _norm(_arg(schema, 1, "dim", 0), ndim)
    full = _is_full(_slice_bounds(schema, shape[dim], 2), shape[dim]) if ndim else True
    return _mapped(mesh, schema, {d: d for d in range(ndim) if d != dim or full})


@register_op_strategy(aten.slice_backward.default, schema_info=RuntimeSchemaInfo(1))
def slice_backward_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """Zero-padding the gradient back to the input shape: as the forward slice."""
    sizes = list(schema.args_schema[1])
    dim = _norm(schema.args_schema[2], len(sizes))
    bounds = slice(*schema.args_schema[3:6]).indices(sizes[dim])
    full = _is_full(bounds, sizes[dim])
    return _mapped(mesh, schema, {d: d for d in range(len(sizes)) if d != dim or full})


@register_op_strategy(aten.select.int, schema_info=RuntimeSchemaInfo(1))
def select_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    ndim = _input(schema).ndim
    dim = _norm(schema.args_schema[1], ndim)
    return _mapped(mesh, schema, {d: d - (d > dim) for d in range(ndim) if d != dim})


@register_op_strategy(aten.select_backward.default, schema_info=RuntimeSchemaInfo(1))
def select_backward_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    ndim = len(schema.args_schema[1])
    dim = _norm(schema.args_schema[2], ndim)
    return _mapped(mesh, schema, {g: g + (g >= dim) for g in range(ndim - 1)})


# ----- diagonal ----------------------------------------------------------------------------


def _diag_dims(ndim: int, schema: OpSchema, first: int) -> tuple[int, int]:
    d1 = _norm(_arg(schema, first, "dim1", 0), ndim)
    d2 = _norm(_arg(schema, first + 1, "dim2", 1), ndim)
    return d1, d2


@register_op_strategy(
    [aten.diagonal.default, aten.diagonal_copy.default], schema_info=RuntimeSchemaInfo(1)
)
def diagonal_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """The other dims keep their shards. The two diagonal dims are Replicate, except that
    with offset 0 the shorter one may be sharded (plain Shard) while the other stays whole:
    each device takes the diagonal of its rows (``_diagonal_local`` shifts the offset by the
    shard's start), a shard of the diagonal alike, and a local view (in-place writes through
    it reach the input, as autograd's formulas expect)."""
    spec = _input(schema)
    ndim = spec.ndim
    d1, d2 = _diag_dims(ndim, schema, 2)
    rest = [d for d in range(ndim) if d not in (d1, d2)]
    dim_map = {d: i for i, d in enumerate(rest)}
    current = spec.placements
    extra: list[DimOption] = []
    if _arg(schema, 1, "offset", 0) == 0:
        shorter = d1 if spec.shape[d1] <= spec.shape[d2] else d2
        extra.append(((Shard(shorter),), (Shard(len(rest)),)))
    return product_strategy(mesh, lambda m: mapped_options(current[m], dim_map) + extra)


def _diagonal_local(
    args: tuple, kwargs: dict, in_specs: list[DTensorSpec], _output: object, device: int
) -> tuple[tuple, dict]:
    """Local element (i, j) is global (i + r0, j + c0): the local diagonal is offset by
    r0 - c0 (both 0 unless a diagonal dim is sharded)."""
    spec = in_specs[0]
    bound = bind(aten.diagonal.default, args, kwargs)
    d1, d2 = _norm(bound["dim1"], spec.ndim), _norm(bound["dim2"], spec.ndim)
    segments = spec.local_segments(device)
    starts = [segments[d][0][0] if segments[d] else 0 for d in (d1, d2)]
    if starts[0] == starts[1]:
        return args, kwargs
    return (args[0], bound["offset"] + starts[0] - starts[1], bound["dim1"], bound["dim2"]), {}


register_local_args([aten.diagonal.default, aten.diagonal_copy.default], _diagonal_local)


@register_op_strategy(aten.diagonal_backward.default, schema_info=RuntimeSchemaInfo(1))
def diagonal_backward_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    ndim = len(schema.args_schema[1])
    d1, d2 = _diag_dims(ndim, schema, 3)
    rest = [d for d in range(ndim) if d not in (d1, d2)]
    return _mapped(mesh, schema, dict(enumerate(rest)))


# ----- split / unbind --------------------------------------------------------------------


@register_op_strategy(
    [aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int],
    schema_info=RuntimeSchemaInfo(1),
)
def split_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """The split dim must be whole on every device; the pieces share the other dims' shards."""
    shape = _input(schema).shape
    ndim = len(shape)
    if schema.op == aten.unbind.int:
        dim = _norm(_arg(schema, 1, "dim", 0), ndim)
        count = shape[dim]
        dim_map = {d: d - (d > dim) for d in range(ndim) if d != dim}
    else:
        dim = _norm(_arg(schema, 2, "dim", 0), ndim)
        sizes = schema.args_schema[1]
        if schema.op == aten.split.Tensor:
            count = max(1, -(-shape[dim] // sizes)) if sizes else 1
        else:
            count = len(sizes)
        dim_map = {d: d for d in range(ndim) if d != dim}
    current = _input(schema).placements

    def options(m: int) -> list[DimOption]:
        found = mapped_options(current[m], dim_map, count)
        p = current[m]
        if schema.op != aten.unbind.int and _splits_blocks(p, dim, shape, current, schema, count):
            found.append(((p,), (Shard(dim),) * count))
        return found

    return product_strategy(mesh, options, multi=True)


def _splits_blocks(
    p: Placement,
    dim: int,
    shape: Sequence[int],
    placements: Sequence[Placement],
    schema: OpSchema,
    count: int,
) -> bool:
    """A split of an ``InterleavedShard(dim, k)`` dim into its k equal blocks (a merged QKV
    output into q, k and v): every device holds its chunk of every block, so each block comes
    out ``Shard(dim)`` without communication (when no other mesh dim splits ``dim``)."""
    if not (isinstance(p, InterleavedShard) and p.dim == dim and count == p.interleaved_size):
        return False
    if sum(isinstance(q, Shard) and q.dim == dim for q in placements) != 1:
        return False
    block = shape[dim] // count
    sizes = schema.args_schema[1]
    return shape[dim] % count == 0 and (
        sizes == block if isinstance(sizes, int) else all(s == block for s in sizes)
    )


def _split_local_args(args, kwargs, input_specs, _output_specs, device):
    """A split of interleaved blocks splits each device's component into its local blocks."""
    spec = input_specs[0]
    dim = _norm(args[2] if len(args) > 2 else kwargs.get("dim", 0), spec.ndim)
    p = next((q for q in spec.placements if isinstance(q, Shard) and q.dim == dim), None)
    if not isinstance(p, InterleavedShard):
        return args, kwargs
    local = spec.local_shape(device)[dim] // p.interleaved_size
    sizes = local if isinstance(args[1], int) else [local] * p.interleaved_size
    return (args[0], sizes, *args[2:]), kwargs


register_local_args([aten.split.Tensor, aten.split_with_sizes.default], _split_local_args)
# tensor_split reads its tensor of indices (or sections) on the host before any op dispatches
register_value_reading_decomposition(
    aten.tensor_split.tensor_indices_or_sections, "tensor_indices_or_sections"
)


# ----- cat / stack -------------------------------------------------------------------------


def _joined(
    mesh: DeviceMesh,
    specs: list[DTensorSpec],
    skipped: list[bool],
    dim_map: DimMap,
    interleave: int | None = None,
) -> OpStrategy:
    """cat/stack: on each mesh dim all joined inputs are Replicate, share a shard of a mapped
    dim, or share a Partial (both ops are linear). Skipped inputs keep their placements.
    ``interleave``: the cat dim, when equal inputs sharded on it by one mesh dim may join into
    ``InterleavedShard(dim, n_inputs)`` (the blocks' local chunks, concatenated locally)."""
    joined = [s for s, skip in zip(specs, skipped, strict=True) if not skip]

    def options(m: int) -> list[DimOption]:
        here = [s.placements[m] for s in joined]
        pairs: list[tuple[Placement, Placement]] = [(Replicate(), Replicate())]
        pairs += [(Shard(d), Shard(e)) for d, e in dim_map.items()]
        for p in dict.fromkeys(here):
            if isinstance(p, Partial):
                pairs.append((p, p))
            elif isinstance(p, InterleavedShard) and p.dim in dim_map:
                pairs.append((p, same_kind(p, dim_map[p.dim])))
        if interleave is not None and here == [Shard(interleave)] * len(here):
            pairs.append((Shard(interleave), InterleavedShard(interleave, len(joined))))
        return [
            (tuple(s.placements[m] if skip else want
                   for s, skip in zip(specs, skipped, strict=True)), (out,))
            for want, out in pairs
        ]

    return product_strategy(mesh, options)


@register_op_strategy(aten.cat.default, schema_info=RuntimeSchemaInfo(1))
def cat_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """Concatenation along a dim needs it whole; other dims keep a common shard. 1-D empty
    inputs are skipped by cat (legacy rule) and keep their placements."""
    specs = [s.output_spec for s in input_strategies(schema)]
    ndims = {s.ndim for s in specs if not (s.ndim == 1 and s.shape[0] == 0)}
    ndim = max(ndims) if ndims else 1
    skipped = [ndim != 1 and s.ndim == 1 and s.shape[0] == 0 for s in specs]
    dim = _norm(_arg(schema, 1, "dim", 0), ndim)
    joined = [s for s, skip in zip(specs, skipped, strict=True) if not skip]
    blocks = len(joined) > 1 and len({s.shape[dim] for s in joined}) == 1 and all(
        sum(isinstance(p, Shard) and p.dim == dim for p in s.placements) == 1 for s in joined
    )
    dim_map = {d: d for d in range(ndim) if d != dim}
    return _joined(mesh, specs, skipped, dim_map, dim if blocks else None)


@register_op_strategy(aten.stack.default, schema_info=RuntimeSchemaInfo(1))
def stack_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """Stacking inserts a new dim; every input dim keeps a common shard."""
    specs = [s.output_spec for s in input_strategies(schema)]
    ndim = specs[0].ndim
    new = _norm(_arg(schema, 1, "dim", 0), ndim + 1)
    dim_map = {d: d + (d >= new) for d in range(ndim)}
    return _joined(mesh, specs, [False] * len(specs), dim_map)


# ----- flip / roll (cumsum's and cumprod's backward use flip) ------------------------------


@register_op_strategy([aten.flip.default, aten.roll.default], schema_info=RuntimeSchemaInfo(1))
def flip_roll_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """Reversed or rolled dims must be whole on every device (a mirrored or shifted chunk is
    not a chunk); the other dims keep their shards. roll without dims rolls the flat tensor."""
    ndim = _input(schema).ndim
    if schema.op == aten.flip.default:
        moved = schema.args_schema[1]
    else:
        moved = _arg(schema, 2, "dims", [])
        moved = moved if moved else range(ndim)
    moved = {_norm(d, ndim) for d in moved}
    return _mapped(mesh, schema, {d: d for d in range(ndim) if d not in moved})
