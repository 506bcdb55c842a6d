"""Ops whose output shape or placement depends on the values (and the scatter/bag ops around
them), which PyTorch 2.13's DTensor has no rule for.

Op table notes (one line per op):

- ``aten.unique_consecutive``, ``aten.unique_dim``, ``aten.unique_dim_consecutive``: gather the
  input; Replicate result (its shape depends on the data).
- ``aten.nonzero`` (also ``torch.where(cond)``, ``argwhere``): gathers the input; Replicate result.
- ``aten.masked_select``: gathers input and mask; Replicate result.
- ``aten.index.Tensor`` / ``aten.index_put`` with a bool mask index (``x[mask]``): the mask is
  gathered and replaced by its ``nonzero`` coordinates (Replicate), then indexing proceeds.
- ``aten.masked_scatter``: mask and source gathered; ``self`` keeps its Shard placements.
- ``aten.masked_scatter_backward``: gathers; Replicate result.
- ``aten.repeat_interleave.Tensor``: gathers the repeats; Replicate result.
- ``aten._histogramdd_*`` (``torch.histogramdd``), ``aten.hash_tensor``: gather; Replicate
  result.
- ``aten.scatter_reduce.two``: shards on dims other than ``dim`` stay; index/src sharded on
  ``dim`` give Partial (sum with include_self, amax/amin) from a replicated ``self``.
- ``aten.put``/``aten.put_``: ``self`` keeps its Shard placements (each device writes the
  indices that fall in its shard); index and source gathered.
- ``aten.take``: a sharded ``self`` gives Partial("sum") (each device takes what it holds);
  ``index`` placements pass through to the output.
- ``aten.bincount``, ``aten.histc``, ``aten.histogram``: local counts over a sharded input are
  Partial("sum") after agreeing on the bin range (one scalar all-reduce when the range comes from
  the data); ``histogram(density=True)`` gathers.
- ``aten.searchsorted``: boundaries Replicate, the values' placements pass through.
- ``aten._cdist_forward``, ``aten._euclidean_dist``, ``aten._cdist_backward``: rows of x1 or x2,
  or batch dims, stay sharded; the backward of x2-row sharding is Partial("sum").
- ``aten._embedding_bag`` (and backward): weight sharded on the embedding dim gives output
  sharded on it; Partial weights pass through for sum/mean bags.
- ``aten.embedding_renorm_`` (``embedding(max_norm=)``): in place, placements kept; a
  vocab-sharded weight renorms its own rows locally; the referenced rows' norm pieces are
  all-reduced over mesh dims splitting the embedding dim, their values over Partial mesh dims.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..dtensor import DTensor, local_of
from ..errors import ImplicitRedistributeError, InvalidArgumentError
from ..geometry import extract_local
from ..mesh import DeviceMesh
from ..placements import Partial, Placement, Replicate, Shard, with_dim
from ..redistribute import move
from ..spec import DTensorSpec, contiguous_meta, make_tensor_meta
from .common import (
    DimOption,
    as_dtensors,
    dtensor_args,
    input_strategies,
    move_components,
    no_empty_shard,
    product_strategy,
    replicate,
    replicate_plain,
    run_replicated,
    shard_like,
)
from .registry import (
    OpSchema,
    OpStrategy,
    RuntimeSchemaInfo,
    bypass_dispatch,
    register_op_strategy,
    register_pre_patch,
)

aten = torch.ops.aten


def _global_reduce(mesh: DeviceMesh, values: list[torch.Tensor], op: str) -> torch.Tensor:
    """One scalar per local device reduced (max/min/sum) over the whole mesh."""
    for m in range(mesh.ndim):
        values = move.all_reduce("a data-dependent op's global reduction", mesh, m, values, op)
    return values[0]


def _no_partial(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    return tuple(Replicate() if p.is_partial() else p for p in placements)


REPLICATED_OPS = [
    aten.unique_consecutive.default,
    aten.unique_dim.default,
    aten.unique_dim_consecutive.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.masked_scatter_backward.default,
    aten.repeat_interleave.Tensor,
    aten._histogramdd_bin_edges.default,
    aten._histogramdd_from_bin_cts.default,
    aten._histogramdd_from_bin_tensors.default,
    aten.hash_tensor.default,
]
bypass_dispatch(REPLICATED_OPS, run_replicated)


# ----- boolean-mask indexing ---------------------------------------------------------------------


def _mask_to_indices(op: Any, mask: DTensor) -> list[DTensor]:
    """The long index DTensors (Replicate) that select what the bool ``mask`` selects."""
    mesh = mask.device_mesh
    [comps] = move_components(op, [mask], [replicate(mesh)])
    coords = [torch.nonzero(c) for c in comps]
    out = []
    for j in range(mask.ndim):
        cols = [c[:, j].contiguous() for c in coords]
        out.append(DTensor(cols, DTensorSpec(mesh, replicate(mesh), make_tensor_meta(cols[0]))))
    return out


def _bool_index_patch(op: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``x[mask]``: replace each bool DTensor index by its nonzero coordinates, so the indexing
    rule only ever sees integer indices (the result shape depends on the mask's values)."""
    indices = args[1]
    if not any(
        isinstance(i, DTensor) and i.dtype in (torch.bool, torch.uint8) and i.ndim > 0
        for i in indices
    ):
        return args, kwargs
    new: list[Any] = []
    for i in indices:
        if isinstance(i, DTensor) and i.dtype in (torch.bool, torch.uint8) and i.ndim > 0:
            new.extend(_mask_to_indices(op, i))
        else:
            new.append(i)
    return (args[0], new, *args[2:]), kwargs


register_pre_patch(
    [aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_],
    _bool_index_patch,
)


# ----- masked_scatter ----------------------------------------------------------------------------


def _masked_scatter(op: Any, args: tuple, kwargs: dict) -> DTensor:
    """``self`` keeps its Shard placements: with the gathered mask, every device knows which
    source element lands on each of its positions."""
    self, mask, source = as_dtensors(op, args)
    mesh, _ = dtensor_args(op, [self, mask, source])
    if torch.broadcast_shapes(self.shape, mask.shape) != self.shape:
        return run_replicated(op, args, kwargs)  # the output takes the larger, broadcast shape
    target = _no_partial(self.placements)
    rep = replicate(mesh)
    selfc, maskc, sourcec = move_components(op, [self, mask, source], [target, rep, rep])
    spec = DTensorSpec(mesh, target, contiguous_meta(self.shape, self.dtype))
    out = []
    for k, device in enumerate(mesh.local_device_ids):
        full_mask = maskc[k].expand(self.shape)
        if int(full_mask.sum()) > sourcec[k].numel():
            raise InvalidArgumentError(
                f"{op}: the mask selects {int(full_mask.sum())} elements but source has only "
                f"{sourcec[k].numel()} (self shape {list(self.shape)})"
            )
        order = (full_mask.reshape(-1).cumsum(0) - 1).clamp(min=0).reshape(self.shape)
        segments = spec.local_segments(device)
        local_mask = extract_local(full_mask, segments)
        local_order = extract_local(order, segments)
        result = selfc[k].clone()
        result[local_mask] = sourcec[k].reshape(-1)[local_order[local_mask]].to(self.dtype)
        out.append(result)
    return DTensor(out, spec)


bypass_dispatch(aten.masked_scatter.default, _masked_scatter)


# ----- put / take --------------------------------------------------------------------------------


def _local_flat_index(
    spec: DTensorSpec, device: int, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """For global flat ``index`` values into a tensor of ``spec``: which fall in ``device``'s
    shard, and their flat position in its component."""
    shape = list(spec.shape)
    numel = max(1, int(torch.Size(shape).numel()))
    flat = index.reshape(-1)
    if flat.numel() and (int(flat.min()) < -numel or int(flat.max()) >= numel):
        raise InvalidArgumentError(
            f"put/take index out of range for a tensor of shape {shape} "
            f"(indices must lie in [{-numel}, {numel}))"
        )
    flat = torch.where(flat < 0, flat + numel, flat)
    valid = torch.ones_like(flat, dtype=torch.bool)
    local = torch.zeros_like(flat)
    rest = flat
    coords = []
    for size in reversed(shape):
        coords.append(rest % size)
        rest = rest // size
    coords.reverse()
    for d, runs in enumerate(spec.local_segments(device)):
        ld, size = _runs_lookup(runs, shape[d], coords[d])
        valid &= ld >= 0
        local = local * size + ld.clamp(min=0)
    return valid, local


def _runs_lookup(
    runs: tuple[tuple[int, int], ...], size: int, coords: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Local positions of global ``coords`` along a dim held as ``runs`` (-1 where not held),
    and the local size."""
    lut = torch.full((size,), -1, dtype=torch.long)
    pos = 0
    for start, stop in runs:
        lut[start:stop] = torch.arange(pos, pos + stop - start)
        pos += stop - start
    return lut[coords], pos


def _put(op: Any, args: tuple, kwargs: dict) -> DTensor:
    """Each device writes the indices that fall in its shard of ``self``."""
    self = args[0]
    index, source = (replicate_plain(self.device_mesh, a) for a in args[1:3])
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    mesh, _ = dtensor_args(op, [self, index, source])
    inplace = op is aten.put_.default
    target = _no_partial(self.placements)
    if inplace and target != self.placements:
        raise ImplicitRedistributeError(
            f"in-place {op} cannot write into a Partial tensor of shape {list(self.shape)} with "
            f"placements {list(self.placements)}; redistribute it first (out of place)"
        )
    rep = replicate(mesh)
    selfc, indexc, sourcec = move_components(op, [self, index, source], [target, rep, rep])
    spec = DTensorSpec(mesh, target, local_of(self).spec.tensor_meta)
    out = []
    for k, device in enumerate(mesh.local_device_ids):
        valid, local = _local_flat_index(spec, device, indexc[k])
        values = sourcec[k].reshape(-1)[valid]
        out.append(selfc[k].put(local[valid], values, accumulate))
    if inplace:  # copied after every result is computed: safe if components share memory
        for comp, result in zip(local_of(self).pieces, out, strict=True):
            comp.copy_(result)
        return self
    return DTensor(out, DTensorSpec(mesh, target, contiguous_meta(self.shape, self.dtype)))


def _take(op: Any, args: tuple, kwargs: dict) -> DTensor:
    """Per mesh dim: a sharded ``self`` gives Partial("sum") (zeros where the value lives
    elsewhere), a Partial ``self`` stays Partial, a replicated one passes ``index``'s shard."""
    self, index = args[0], replicate_plain(args[0].device_mesh, args[1])
    mesh, _ = dtensor_args(op, [self, index])
    self_t, index_t, out_p = [], [], []
    for p, q in zip(self.placements, index.placements, strict=True):
        if isinstance(p, Shard):
            self_t.append(p), index_t.append(Replicate()), out_p.append(Partial("sum"))
        elif isinstance(p, Partial):
            self_t.append(p), index_t.append(Replicate()), out_p.append(p)
        else:
            q = Replicate() if q.is_partial() else q
            self_t.append(p), index_t.append(q), out_p.append(q)
    selfc, indexc = move_components(op, [self, index], [self_t, index_t])
    spec = DTensorSpec(mesh, tuple(self_t), local_of(self).spec.tensor_meta)
    out = []
    for k, device in enumerate(mesh.local_device_ids):
        valid, local = _local_flat_index(spec, device, indexc[k])
        flat = selfc[k].reshape(-1)
        taken = flat[local] if flat.numel() else torch.zeros(local.shape, dtype=self.dtype)
        taken = torch.where(valid, taken, torch.zeros((), dtype=self.dtype))
        out.append(taken.reshape(indexc[k].shape))
    return DTensor(out, DTensorSpec(mesh, tuple(out_p), contiguous_meta(index.shape, self.dtype)))


bypass_dispatch([aten.put.default, aten.put_.default], _put)
bypass_dispatch(aten.take.default, _take)


# ----- counting: bincount, histc, histogram --------------------------------------------------


def _count_targets(
    data: DTensor, weights: DTensor | None
) -> tuple[tuple[Placement, ...], tuple[Placement, ...] | None, tuple[Placement, ...]]:
    """Placements to count in: data keeps its shards, weights follow them (or stay
    Partial("sum") where data is replicated: counting is linear in the weights); the counts are
    Partial("sum") wherever either is split."""
    data_t, weight_t, out = [], [], []
    wp = weights.placements if weights is not None else (Replicate(),) * len(data.placements)
    for p, w in zip(data.placements, wp, strict=True):
        if isinstance(p, Shard):
            data_t.append(p), weight_t.append(p), out.append(Partial("sum"))
        elif isinstance(w, Partial) and w.reduce_op == "sum":
            data_t.append(Replicate()), weight_t.append(w), out.append(Partial("sum"))
        else:
            data_t.append(Replicate()), weight_t.append(Replicate()), out.append(Replicate())
    return tuple(data_t), tuple(weight_t) if weights is not None else None, tuple(out)


def _counted(mesh: DeviceMesh, results: list[torch.Tensor], out: tuple[Placement, ...]) -> DTensor:
    return DTensor(results, DTensorSpec(mesh, out, make_tensor_meta(results[0])))


def _bincount(op: Any, args: tuple, kwargs: dict) -> DTensor:
    """Local counts with a common length (the global max, one scalar all-reduce) summed."""
    data = args[0]
    weights = args[1] if len(args) > 1 else kwargs.get("weights")
    minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
    mesh, _ = dtensor_args(op, [data, weights])
    data_t, weight_t, out = _count_targets(data, weights)
    dts, targets = [data], [data_t]
    if weights is not None:
        dts.append(weights), targets.append(weight_t)
    moved = move_components(op, dts, targets)
    maxima = [torch.tensor(int(c.max()) if c.numel() else -1) for c in moved[0]]
    length = max(int(_global_reduce(mesh, maxima, "max")) + 1, minlength)
    results = [
        torch.bincount(c, moved[1][k] if weights is not None else None, minlength=length)
        for k, c in enumerate(moved[0])
    ]
    return _counted(mesh, results, out)


def _data_range(mesh: DeviceMesh, comps: list[torch.Tensor]) -> tuple[float, float] | None:
    """The global (min, max) of the components, or None when the tensor is empty."""
    lows = [c.min().double() if c.numel() else torch.tensor(float("inf"), dtype=torch.double)
            for c in comps]
    highs = [c.max().double() if c.numel() else torch.tensor(float("-inf"), dtype=torch.double)
             for c in comps]
    low, high = float(_global_reduce(mesh, lows, "min")), float(_global_reduce(mesh, highs, "max"))
    return None if low > high else (low, high)


def _histc(op: Any, args: tuple, kwargs: dict) -> DTensor:
    """Local histograms over one agreed range, summed (Partial) where the input is split."""
    data = args[0]
    bins = args[1] if len(args) > 1 else kwargs.get("bins", 100)
    low = args[2] if len(args) > 2 else kwargs.get("min", 0)
    high = args[3] if len(args) > 3 else kwargs.get("max", 0)
    mesh, _ = dtensor_args(op, [data])
    data_t, _, out = _count_targets(data, None)
    [comps] = move_components(op, [data], [data_t])
    if low == 0 and high == 0:
        found = _data_range(mesh, comps)
        if found is None:
            return run_replicated(op, args, kwargs)
        low, high = found
        if low == high:  # the kernel would widen a degenerate range the same way
            low, high = low - 1, high + 1
    return _counted(mesh, [torch.histc(c, bins, low, high) for c in comps], out)


def _histogram(op: Any, args: tuple, kwargs: dict) -> tuple[DTensor, DTensor]:
    """Local histograms over agreed bin edges, summed; ``density=True`` gathers."""
    data, bins = args[0], args[1]
    weight = kwargs.get("weight")
    if kwargs.get("density", False):
        return run_replicated(op, args, kwargs)
    mesh, _ = dtensor_args(op, [data, bins, weight])
    data_t, weight_t, out = _count_targets(data, weight)
    dts, targets = [data], [data_t]
    if weight is not None:
        dts.append(weight), targets.append(weight_t)
    if isinstance(bins, DTensor):
        dts.append(bins), targets.append(replicate(mesh))
    moved = move_components(op, dts, targets)
    extra: dict[str, Any] = {}
    if isinstance(bins, DTensor):
        local_bins = moved[-1]
    else:
        local_bins = [bins] * len(moved[0])
        extra["range"] = kwargs.get("range")
        if extra["range"] is None:
            found = _data_range(mesh, moved[0])
            if found is None:
                return run_replicated(op, args, kwargs)
            extra["range"] = found
    hists, edges = [], []
    for k, c in enumerate(moved[0]):
        w = moved[1][k] if weight is not None else None
        h, e = torch.histogram(c, local_bins[k], weight=w, **extra)
        hists.append(h), edges.append(e)
    rep = DTensorSpec(mesh, replicate(mesh), make_tensor_meta(edges[0]))
    return _counted(mesh, hists, out), DTensor(edges, rep)


bypass_dispatch(aten.bincount.default, _bincount)
bypass_dispatch(aten.histc.default, _histc)
bypass_dispatch([aten.histogram.bin_ct, aten.histogram.bins_tensor], _histogram)


# ----- scatter_reduce ----------------------------------------------------------------------------


@register_op_strategy(aten.scatter_reduce.two, schema_info=RuntimeSchemaInfo(1))
def scatter_reduce_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """Shards on dims other than ``dim`` (same size in self, index and src) pass through.
    Index and src split along ``dim`` scatter into every device's copy of ``self``: for
    amax/amin the maxima of those copies are the answer (Partial max/min of a replicated self);
    for sum with include_self, self is partitioned (Partial sum) and the sums add up."""
    self, index, src = input_strategies(schema)
    dim = schema.args_schema[1] % max(self.ndim, 1)
    reduce = schema.args_schema[4]
    include_self = schema.args_schema[5] if len(schema.args_schema) > 5 else True
    include_self = schema.kwargs_schema.get("include_self", include_self)
    rep = Replicate()
    options: list[DimOption] = [((rep, rep, rep), (rep,))]
    for d in range(self.ndim):
        if d != dim and self.shape[d] == index.shape[d] == src.shape[d]:
            options.append(((Shard(d),) * 3, (Shard(d),)))
    if self.ndim and index.shape[dim] == src.shape[dim] and include_self:
        if reduce in ("amax", "amin"):
            part = Partial("max" if reduce == "amax" else "min")
            options.append(((rep, Shard(dim), Shard(dim)), (part,)))
        if reduce == "sum":
            options.append(((Partial(), Shard(dim), Shard(dim)), (Partial(),)))
            options.append(((Partial(), rep, Partial()), (Partial(),)))
    return product_strategy(mesh, options)


# ----- searchsorted ------------------------------------------------------------------------------


@register_op_strategy(
    [aten.searchsorted.Tensor, aten.searchsorted.Scalar], schema_info=RuntimeSchemaInfo(2)
)
def searchsorted_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """Boundaries (and sorter) replicated, values in any Shard: each value is looked up on its
    own. With N-D boundaries, their leading dims may be split together with the values'."""
    ins = input_strategies(schema)
    seq = ins[0]
    values = ins[1] if schema.op is aten.searchsorted.Tensor else None
    n_in = len(ins)
    rep = Replicate()
    options: list[DimOption] = [((rep,) * n_in, (rep,))]
    if values is not None:
        current = values.output_spec.placements
        for d in range(values.ndim):
            if seq.ndim == 1 or d == values.ndim - 1:
                shard = shard_like(current, d)
                options.append(((rep, shard) + (rep,) * (n_in - 2), (shard,)))
            elif seq.shape[d] == values.shape[d]:
                options.append(((Shard(d),) * n_in, (Shard(d),)))
    return product_strategy(mesh, options, shapes=[s.shape for s in ins])


# ----- cdist -------------------------------------------------------------------------------------


def _batch_dims(a: OpStrategy, b: OpStrategy) -> list[int]:
    """Batch dims that two cdist operands share with equal sizes (so may split together)."""
    if a.ndim != b.ndim:
        return []
    return [d for d in range(a.ndim - 2) if a.shape[d] == b.shape[d]]


@register_op_strategy(
    [aten._cdist_forward.default, aten._euclidean_dist.default], schema_info=RuntimeSchemaInfo(2)
)
def cdist_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """x1 rows split give output rows split, x2 rows split give output columns split; equal
    batch dims may split in both. Distances are not linear: no Partial."""
    x1, x2 = input_strategies(schema)
    rep = Replicate()
    n = max(x1.ndim, x2.ndim)
    rows = shard_like(x1.output_spec.placements, x1.ndim - 2)  # interleaved/ragged kept
    options: list[DimOption] = [
        ((rep, rep), (rep,)),
        ((rows, rep), (with_dim(rows, n - 2),)),
        ((rep, Shard(x2.ndim - 2)), (Shard(n - 1),)),
    ]
    options += [((Shard(d), Shard(d)), (Shard(d),)) for d in _batch_dims(x1, x2)]
    return product_strategy(mesh, options, shapes=[x1.shape, x2.shape])


@register_op_strategy(aten._cdist_backward.default, schema_info=RuntimeSchemaInfo(3))
def cdist_backward_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """grad_x1 (rows of x1): rows split with grad/cdist rows; x2 rows split (grad/cdist
    columns) give Partial("sum") — it is a sum over x2's rows; linear in grad."""
    grad, x1, x2, _ = input_strategies(schema)
    rep = Replicate()
    r, c = grad.ndim - 2, grad.ndim - 1
    options: list[DimOption] = [
        ((rep,) * 4, (rep,)),
        ((Shard(r), Shard(x1.ndim - 2), rep, Shard(r)), (Shard(x1.ndim - 2),)),
        ((Shard(c), rep, Shard(x2.ndim - 2), Shard(c)), (Partial(),)),
        ((Partial(), rep, rep, rep), (Partial(),)),
    ]
    options += [((Shard(d),) * 4, (Shard(d),)) for d in _batch_dims(x1, x2)]
    return product_strategy(mesh, options)


# ----- embedding_bag -----------------------------------------------------------------------------


def _bag_mode(schema: OpSchema, position: int) -> int:
    args = schema.args_schema
    return args[position] if len(args) > position else schema.kwargs_schema.get("mode", 0)


@register_op_strategy(
    [aten._embedding_bag.default, aten._embedding_bag_forward_only.default],
    schema_info=RuntimeSchemaInfo(3),
)
def embedding_bag_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """Bags sum/mean/max each embedding column on its own: a weight split on the embedding
    dim gives output (and max indices) split on it; indices, offsets, per-sample weights
    replicated. Sum/mean bags are linear in the weight, so Partial weights pass through."""
    ins = input_strategies(schema)
    mode = _bag_mode(schema, 4)
    rep = Replicate()
    others = (rep,) * (len(ins) - 1)
    options: list[DimOption] = [((rep,) + others, (rep,) * 4)]
    split = shard_like(ins[0].output_spec.placements, 1)
    out = with_dim(split, 1)  # the output's embedding dim is laid out as the weight's
    options.append(((split,) + others, (out, rep, rep, out if mode == 2 else rep)))
    if mode in (0, 1):
        for op in ("sum", "avg"):
            options.append(((Partial(op),) + others, (Partial(op), rep, rep, rep)))

    def valid(combo: tuple[DimOption, ...]) -> bool:
        return no_empty_shard(mesh, ins[0].shape, [c[0][0] for c in combo], [1])

    return product_strategy(
        mesh, options, multi=True, valid=valid, shapes=[s.shape for s in ins]
    )


@register_op_strategy(aten._embedding_bag_backward.default, schema_info=RuntimeSchemaInfo(6))
def embedding_bag_backward_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """grad split on the embedding dim gives the weight gradient split on it (max indices
    split alike in max mode); linear in grad, so Partial grad gives a Partial gradient."""
    ins = input_strategies(schema)
    mode = _bag_mode(schema, 8)
    rep = Replicate()
    # grad, indices, offsets, offset2bag, bag_size, maximum_indices[, per_sample_weights]
    tail = (rep,) * (len(ins) - 6)
    options: list[DimOption] = [((rep,) * len(ins), (rep,))]
    split_max = Shard(1) if mode == 2 else rep
    options.append(((Shard(1), rep, rep, rep, rep, split_max) + tail, (Shard(1),)))
    if mode in (0, 1):
        for op in ("sum", "avg"):
            options.append(((Partial(op),) + (rep,) * (len(ins) - 1), (Partial(op),)))

    def valid(combo: tuple[DimOption, ...]) -> bool:
        return no_empty_shard(mesh, ins[0].shape, [c[0][0] for c in combo], [1])

    return product_strategy(mesh, options, valid=valid)


@register_op_strategy(
    aten._embedding_bag_per_sample_weights_backward.default, schema_info=RuntimeSchemaInfo(5)
)
def embedding_bag_psw_backward_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """The per-sample-weight gradient is a dot product over the embedding dim: grad and
    weight split on it give Partial("sum")."""
    ins = input_strategies(schema)
    rep = Replicate()
    tail = (rep,) * (len(ins) - 2)
    return product_strategy(
        mesh,
        [((rep,) * len(ins), (rep,)), ((Shard(1), Shard(1)) + tail, (Partial(),))],
    )


# ----- embedding_renorm_ -------------------------------------------------------------------------


def _row_norm_parts(values: torch.Tensor, norm_type: float) -> tuple[torch.Tensor, str]:
    """Per row, the piece of a p-norm that adds up (or maxes up) across column shards."""
    if values.shape[1] == 0:
        return values.new_zeros(values.shape[0]), "max" if norm_type == math.inf else "sum"
    if norm_type == math.inf:
        return values.abs().amax(1), "max"
    if norm_type == 0:
        return (values != 0).sum(1).to(values.dtype), "sum"
    return values.abs().pow(norm_type).sum(1), "sum"


def _embedding_renorm(op: Any, args: tuple, kwargs: dict) -> DTensor:
    """In place on the weight, keeping its placements: each device scales the referenced rows
    it holds. Row values are first reduced over Partial mesh dims, and the norm pieces
    all-reduced over mesh dims that split the embedding dim (the scale is positive, so it
    commutes with every Partial)."""
    weight, indices, max_norm, norm_type = args
    mesh, _ = dtensor_args(op, [weight, indices])
    if norm_type < 0 or math.isnan(norm_type):
        raise InvalidArgumentError(
            f"{op} on a DTensor weight of shape {list(weight.shape)} supports norm_type >= 0, "
            f"got {norm_type}"
        )
    [idx] = move_components(op, [indices], [replicate(mesh)])
    rows = torch.unique(idx[0].reshape(-1))
    values, picks = [], []
    weights = local_of(weight)
    for k, device in enumerate(mesh.local_device_ids):
        local, _ = _runs_lookup(weights.spec.local_segments(device)[0], weight.shape[0], rows)
        valid = local >= 0
        comp = weights.pieces[k]
        picks.append((valid, local[valid], comp[local[valid]]))
        held = comp.new_zeros((rows.numel(), comp.shape[1]))
        held[valid] = picks[-1][2]
        values.append(held)
    for m, p in enumerate(weight.placements):
        if isinstance(p, Partial):
            values = move.all_reduce("embedding renorm's pending rows", mesh, m, values,
                                     p.reduce_op)
    parts = [_row_norm_parts(v, norm_type) for v in values]
    pieces, how = [piece for piece, _ in parts], parts[0][1]
    for m, p in enumerate(weight.placements):
        if isinstance(p, Shard) and p.dim == 1:
            pieces = move.all_reduce("embedding renorm's row norms", mesh, m, pieces, how)
    for k, (valid, mine, before) in enumerate(picks):
        norm = pieces[k][valid]
        if how == "sum" and norm_type != 0:
            norm = norm.pow(1.0 / norm_type)
        scale = torch.where(norm > max_norm, max_norm / (norm + 1e-7), torch.ones_like(norm))
        # written from values read before any write: idempotent if components share memory
        weights.pieces[k][mine] = before * scale.unsqueeze(1)
    return weight


bypass_dispatch(aten.embedding_renorm_.default, _embedding_renorm)

