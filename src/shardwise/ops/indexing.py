"""Indexing ops: ``index_select``, ``gather``, ``scatter``/``scatter_add``, ``index_add``,
advanced indexing (``index.Tensor``, ``index_put``).

Index tensors hold *global* positions along the indexed dim, so that dim of the indexed tensor
must be whole on every device (Replicate or Partial there), while the index tensor itself may
be sharded: each device then handles its share of the positions. ``gather`` also reads a
``self`` sharded on ``dim`` through a replicated index: each device reads the positions it
holds, zeros elsewhere, a Partial("sum") result. Scatters into a Partial("sum")
output let every device add its share (``scatter_add``, ``index_add``, ``index_put`` with
``accumulate``): the gradients of gather, index_select and indexing stay sharded this way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..dtensor import DTensor
from ..factories import keeps_value, place_tensor
from ..mesh import DeviceMesh
from ..placements import Partial, Placement, Shard
from ..spec import DTensorSpec
from . import registry
from .common import (
    DimOption,
    R,
    aligned,
    bind,
    bind_schema,
    input_strategies,
    keep_self_inplace,
    partial_ops,
    per_tensor,
    product_strategy,
)
from .registry import (
    OpSchema,
    OpStrategy,
    RuntimeSchemaInfo,
    register_local_args,
    register_local_call,
    register_op_strategy,
    register_pre_patch,
)

aten = torch.ops.aten
SUM = Partial("sum")


def _linear_partials(placements: Sequence[Placement], additive: bool) -> list[Partial]:
    """Partial placements an op linear in its data inputs may pass through; ops that add into
    ``self`` (scatter_add, accumulate) pass sum and avg only (max(a + b) != max a + max b)."""
    found = partial_ops(placements)
    return [p for p in found if not additive or p.reduce_op in ("sum", "avg")]


def _dim(schema: OpSchema, ndim: int) -> int:
    return bind_schema(schema)["dim"] % max(ndim, 1)


# ----- index_select ---------------------------------------------------------------------------


@register_op_strategy(aten.index_select.default, schema_info=RuntimeSchemaInfo(1))
def index_select_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """Per mesh dim: ``self`` sharded on another dim (output sharded alike), the index sharded
    (output sharded on ``dim``), ``self`` Partial (selection is linear), or all replicated."""
    src, index = input_strategies(schema)
    dim = _dim(schema, src.ndim)
    options: list[DimOption] = [((R, R), (R,))]
    if src.ndim and index.ndim:  # a 0-d self takes exactly one index: never split it
        options.append(((R, Shard(0)), (Shard(dim),)))
    options += [((Shard(d), R), (Shard(d),)) for d in range(src.ndim) if d != dim]
    options += [((p, R), (p,)) for p in _linear_partials(src.output_spec.placements, False)]
    return product_strategy(mesh, options)


# ----- gather / scatter -----------------------------------------------------------------------


def _same_size_dims(shapes: Sequence[Sequence[int]], skip: int) -> list[int]:
    """Dims other than ``skip`` where all ``shapes`` agree: where the tensors of a gather or
    scatter can be sharded together."""
    ndim = len(shapes[0])
    return [d for d in range(ndim) if d != skip and len({tuple(s)[d] for s in shapes}) == 1]


def _self_aligned(combo: Sequence[DimOption], others: Sequence[int], skip: int = -1) -> bool:
    """Dims sharded on ``self`` (input 0), ``skip`` aside, are sharded over the same mesh dims
    on the others."""
    tensors = per_tensor(combo)
    dims = {p.dim for p in tensors[0] if isinstance(p, Shard) and p.dim != skip}
    return all(aligned(tensors[0], tensors[i], sorted(dims)) for i in others)


@register_op_strategy(aten.gather.default, schema_info=RuntimeSchemaInfo(1))
def gather_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """The output has the index's shape. Per mesh dim: index sharded on ``dim`` with ``self``
    replicated (positions along ``dim`` are global); ``self`` and index sharded together on
    another dim where their sizes agree (elsewhere ``index[i]`` reads row ``i`` of ``self``, so
    the rows must match); ``self`` Partial with the index replicated; ``self`` sharded on
    ``dim`` with the index replicated, a Partial("sum") output (each device reads the positions
    it holds and writes zeros elsewhere: a masked gather, see ``_masked_gather``); or all
    replicated."""
    src, index = input_strategies(schema)
    dim = _dim(schema, src.ndim)
    options: list[DimOption] = [((R, R), (R,))]
    if index.ndim:
        options.append(((R, Shard(dim)), (Shard(dim),)))
    together = _same_size_dims([src.shape, index.shape], dim)
    options += [((Shard(d), Shard(d)), (Shard(d),)) for d in together]
    options += [((p, R), (p,)) for p in _linear_partials(src.output_spec.placements, False)]
    if src.ndim:
        options.append(((Shard(dim), R), (SUM,)))
    return product_strategy(mesh, options, valid=lambda c: _self_aligned(c, [1], skip=dim))


def _masked_gather(
    kernel: Any, args: tuple, kwargs: dict, specs: list[DTensorSpec], _out: Any, device: int
) -> torch.Tensor:
    """``self`` sharded on ``dim``: the index's global positions that this device holds read
    its piece (shifted to local positions), the others give zeros, so the pending sum over the
    devices splitting ``dim`` is the gathered value."""
    piece, dim, index = args[0], args[1] % max(args[0].ndim, 1), args[2]
    spec = specs[0]
    if not any(isinstance(p, Shard) and p.dim == dim for p in spec.placements):
        return kernel(*args, **kwargs)
    size = spec.shape[dim]
    local = torch.full((size,), -1, dtype=torch.long, device=index.device)
    held = 0
    for begin, end in spec.local_segments(device)[dim]:
        local[begin:end] = torch.arange(held, held + end - begin, device=index.device)
        held += end - begin
    if held == 0:
        return piece.new_zeros(index.shape)
    positions = local[index]
    found = positions >= 0
    out = kernel(piece, dim, positions.clamp(min=0), *args[3:], **kwargs)
    return out.masked_fill_(~found, 0)


register_local_call(aten.gather.default, _masked_gather)


SCATTER_SRC = [aten.scatter.src, aten.scatter_.src]
SCATTER_VALUE = [aten.scatter.value, aten.scatter_.value]
SCATTER_ADD = [aten.scatter_add.default, aten.scatter_add_.default]


@register_op_strategy(SCATTER_SRC + SCATTER_ADD, schema_info=RuntimeSchemaInfo(1))
def scatter_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """Per mesh dim: ``self``, index and ``src`` sharded together on a dim other than ``dim``
    where their sizes agree; ``self`` and ``src`` Partial with the index replicated (writing or
    adding partial values gives partial results); or all replicated. ``scatter_add`` also
    takes a sharded index (and ``src`` alike) into a Partial("sum") ``self``: each device adds
    its share of the updates, and the pending sum adds them all."""
    dst, index, src = input_strategies(schema)
    dim = _dim(schema, dst.ndim)
    additive = schema.op in SCATTER_ADD
    partials = _linear_partials(dst.output_spec.placements + src.output_spec.placements, additive)
    options: list[DimOption] = [((R, R, R), (R,))]
    same = _same_size_dims([dst.shape, index.shape, src.shape], dim)
    options += [((Shard(d), Shard(d), Shard(d)), (Shard(d),)) for d in same]
    options += [((p, R, p), (p,)) for p in partials]
    if additive and index.ndim and index.shape[dim] == src.shape[dim]:
        options.append(((SUM, Shard(dim), Shard(dim)), (SUM,)))

    def valid(combo: Sequence[DimOption]) -> bool:
        tensors = per_tensor(combo)
        index_dims = {p.dim for p in tensors[1] if isinstance(p, Shard)}
        return _self_aligned(combo, [1, 2]) and aligned(tensors[1], tensors[2], sorted(index_dims))

    return keep_self_inplace(schema, product_strategy(mesh, options, valid=valid))


@register_op_strategy(SCATTER_VALUE, schema_info=RuntimeSchemaInfo(1))
def scatter_value_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """Like ``scatter.src`` with a scalar: on a Partial ``self`` the devices holding zeros of a
    Partial("sum") write 0 instead of the value (``_scatter_value_local``)."""
    dst, index = input_strategies(schema)
    dim = _dim(schema, dst.ndim)
    options: list[DimOption] = [((R, R), (R,))]
    together = _same_size_dims([dst.shape, index.shape], dim)
    options += [((Shard(d), Shard(d)), (Shard(d),)) for d in together]
    options += [((p, R), (p,)) for p in _linear_partials(dst.output_spec.placements, False)]
    found = product_strategy(mesh, options, valid=lambda c: _self_aligned(c, [1]))
    return keep_self_inplace(schema, found)


def _scatter_value_local(
    args: tuple, kwargs: dict, inputs: list[DTensorSpec], _output: Any, device: int
) -> tuple[tuple, dict]:
    if keeps_value(inputs[0], device):
        return args, kwargs
    bound = bind(aten.scatter.value, args, kwargs)
    return (args[0], bound["dim"], args[2], 0), {}


register_local_args(SCATTER_VALUE, _scatter_value_local)


# ----- index_add --------------------------------------------------------------------------------


@register_op_strategy(
    [aten.index_add.default, aten.index_add_.default], schema_info=RuntimeSchemaInfo(1)
)
def index_add_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """Per mesh dim: ``self`` and ``source`` sharded together off ``dim``; both Partial (sum or
    avg) with the index replicated; the index and ``source`` (on ``dim``) sharded into a
    Partial("sum") ``self`` (each device adds its share); or all replicated."""
    dst, index, src = input_strategies(schema)
    dim = _dim(schema, dst.ndim)
    partials = _linear_partials(dst.output_spec.placements + src.output_spec.placements, True)
    options: list[DimOption] = [((R, R, R), (R,))]
    options += [((Shard(d), R, Shard(d)), (Shard(d),)) for d in range(dst.ndim) if d != dim]
    options += [((p, R, p), (p,)) for p in partials]
    if index.ndim and src.ndim:  # a 0-d index or source cannot be split
        options.append(((SUM, Shard(0), Shard(dim)), (SUM,)))
    return keep_self_inplace(schema, product_strategy(mesh, options))


# ----- advanced indexing ----------------------------------------------------------------------


class _IndexLayout:
    """Where ``self[indices]``'s dims come from (PyTorch's advanced indexing rules): the
    broadcast index dims replace the indexed dims in place when those are adjacent, else they
    go first; the other dims of ``self`` follow in order."""

    def __init__(self, self_ndim: int, indices: Sequence[Any]) -> None:
        self.positions = [i for i, t in enumerate(indices) if t is not None]
        shapes = [tuple(t.shape) for t in indices if t is not None]
        self.index_shapes = shapes
        self.broadcast = tuple(torch.broadcast_shapes(*shapes)) if shapes else ()
        first, last = self.positions[0], self.positions[-1]
        adjacent = self.positions == list(range(first, last + 1))
        self.offset = first if adjacent else 0
        rest = [d for d in range(self_ndim) if d not in self.positions]
        index_dims: list[int | None] = [None] * len(self.broadcast)
        if adjacent:
            order = [d for d in rest if d < first] + index_dims + [d for d in rest if d > last]
        else:
            order = index_dims + rest
        self.out_ndim = len(order)
        self.self_to_out = {d: o for o, d in enumerate(order) if d is not None}

    def index_option(self, j: int) -> list[Placement]:
        """Placements of the index tensors sharding broadcast dim ``j`` (size-1 dims and
        missing leading dims broadcast, so those tensors stay replicated)."""
        out: list[Placement] = []
        for shape in self.index_shapes:
            d = j - (len(self.broadcast) - len(shape))
            out.append(Shard(d) if d >= 0 and shape[d] != 1 else R)
        return out


def _values_placement(out_dim: int, out_ndim: int, values_shape: Sequence[int]) -> Placement:
    """How ``values`` (broadcast to the indexed shape) is sharded when the output of indexing
    is sharded on ``out_dim``."""
    d = out_dim - (out_ndim - len(values_shape))
    return Shard(d) if d >= 0 and values_shape[d] != 1 else R


def _plain_ints(indices: Sequence[Any]) -> bool:
    return all(
        t is None or t.output_spec.tensor_meta.dtype not in (torch.bool, torch.uint8)
        for t in indices
    )


@register_op_strategy(aten.index.Tensor, schema_info=RuntimeSchemaInfo(1))
def index_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``self[indices]`` with integer index tensors (boolean masks become integer indices in
    the pre-patch). Per mesh dim: ``self`` sharded on a dim that is not indexed; every index
    tensor sharded on one broadcast dim (output sharded on the matching dim); ``self`` Partial;
    or all replicated."""
    src = input_strategies(schema)[0]
    indices = list(bind_schema(schema)["indices"])
    present = [t for t in indices if t is not None]
    n = 1 + len(present)
    options: list[DimOption] = [((R,) * n, (R,))]
    if present and _plain_ints(indices):
        layout = _IndexLayout(src.ndim, indices)
        for d, o in layout.self_to_out.items():
            options.append(((Shard(d), *[R] * len(present)), (Shard(o),)))
        for j in range(len(layout.broadcast)):
            placed = layout.index_option(j)
            if any(p != R for p in placed):  # a size-1 broadcast dim of every index: no split
                options.append(((R, *placed), (Shard(layout.offset + j),)))
        options += [
            ((p, *[R] * len(present)), (p,)) for p in partial_ops(src.output_spec.placements)
        ]
    return product_strategy(mesh, options)


INDEX_PUT = [aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default]


@register_op_strategy(INDEX_PUT, schema_info=RuntimeSchemaInfo(3))
def index_put_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``self[indices] = values`` (``+=`` with ``accumulate``). Per mesh dim: ``self`` sharded
    on a dim that is not indexed, ``values`` sharded on the matching dim (or replicated where
    it broadcasts); ``self`` and ``values`` Partial (sum or avg with ``accumulate``); with
    ``accumulate``, the index tensors sharded on a broadcast dim into a Partial("sum") ``self``;
    or all replicated."""
    strategies = input_strategies(schema)
    src, values = strategies[0], strategies[-1]
    bound = bind_schema(schema)
    indices, accumulate = list(bound["indices"]), bool(bound["accumulate"])
    k = len([t for t in indices if t is not None])
    options: list[DimOption] = [((R,) * (k + 2), (R,))]
    if k and _plain_ints(indices):
        layout = _IndexLayout(src.ndim, indices)
        vshape = values.shape
        for d, o in layout.self_to_out.items():
            v = _values_placement(o, layout.out_ndim, vshape)
            options.append(((Shard(d), *[R] * k, v), (Shard(d),)))
        if accumulate:
            for j in range(len(layout.broadcast)):
                v = _values_placement(layout.offset + j, layout.out_ndim, vshape)
                options.append(((SUM, *layout.index_option(j), v), (SUM,)))
    placements = src.output_spec.placements + values.output_spec.placements
    options += [((p, *[R] * k, p), (p,)) for p in _linear_partials(placements, accumulate)]
    return keep_self_inplace(schema, product_strategy(mesh, options))


def _mesh_of(args: Sequence[Any]) -> DeviceMesh | None:
    for a in args:
        if isinstance(a, DTensor):
            return a.device_mesh
        if isinstance(a, (list, tuple)):
            found = _mesh_of(a)
            if found is not None:
                return found
    return None


def _replicated(t: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    if isinstance(t, DTensor):
        return t
    return place_tensor(t, mesh, [R] * mesh.ndim, src_data_rank=None)


def _plain_to_replicate(op: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Plain tensors among the indices and ``values`` become replicated DTensors: autograd's
    formula for ``index_put`` passes plain zeros as ``values``. (Boolean masks are turned into
    integer indices by the data-dependent family's patch, which this one runs after.)"""
    mesh = _mesh_of(args)
    bound = bind(op, args, kwargs)
    indices = [None if t is None else _replicated(t, mesh) for t in bound["indices"]]
    new_args = [args[0], indices, *args[2:]]
    if op in INDEX_PUT and isinstance(bound["values"], torch.Tensor):
        values = _replicated(bound["values"], mesh)
        if len(args) > 2:
            new_args[2] = values
        else:
            kwargs = {**kwargs, "values": values}
    return tuple(new_args), kwargs


def _chain_pre_patch(ops: Sequence[Any], patch: Any) -> None:
    """Register ``patch`` to run before whatever pre-patch the op already has."""
    for op in ops:
        entry = registry.registration(op)
        previous = entry.pre if entry is not None else None
        if previous is None:
            register_pre_patch(op, patch)
            continue

        def both(o: Any, a: tuple, k: dict, first: Any = patch, then: Any = previous) -> Any:
            return then(o, *first(o, a, k))

        register_pre_patch(op, both)


_chain_pre_patch([aten.index.Tensor, *INDEX_PUT], _plain_to_replicate)


def _scalars_to_replicate(op: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """0-d plain tensors become replicated DTensors: here every tensor argument is an operand
    (dispatch passes 0-d ones on as scalars), e.g. the plain zeros autograd's formula for a 0-d
    ``cummax`` scatters its gradient into."""
    def scalar(a: Any) -> bool:
        return isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and a.ndim == 0

    values = (*args, *kwargs.values())
    if not any(scalar(a) for a in values):
        return args, kwargs
    mesh = _mesh_of(values)

    def fix(a: Any) -> Any:
        return _replicated(a, mesh) if scalar(a) else a

    return tuple(fix(a) for a in args), {k: fix(v) for k, v in kwargs.items()}


_chain_pre_patch(
    [aten.index_select.default, aten.gather.default, *SCATTER_SRC, *SCATTER_VALUE, *SCATTER_ADD,
     aten.index_add.default, aten.index_add_.default],
    _scalars_to_replicate,
)

