"""Reductions and scans: sum, mean, prod, max/min, amax/amin, argmax/argmin, var/std,
vector norms, any/all, logsumexp, cumsum/cumprod, and Python values (``.item()``).

Over a dim that is not sharded a reduction keeps the placements (shard dims shift down when
``keepdim=False``). Over a sharded dim the local reductions are combined by a pending
reduction where one exists: ``sum`` gives Partial("sum"), ``amax``/``max`` and ``any``
Partial("max"), ``amin``/``min`` and ``all`` Partial("min"), 1-norms Partial("sum"), inf-norms
Partial("max"). ``mean`` runs as a sum (Partial("sum") over sharded dims) divided by the
global count, which is exact for uneven shards. Everything else (prod, var, std, 2-norms,
argmax, max/min with indices, logsumexp, scans along the scanned dim) needs the reduced dims
whole: its strategies only list Replicate there, so dispatch gathers them. Partial inputs pass
through only the reductions that are linear (sum of Partial("sum"/"avg")) or of the same kind
(amax of Partial("max")).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..comm.reduction import LOW_PRECISION, cast_keeps_partial
from ..dtensor import DTensor
from ..mesh import DeviceMesh
from ..placements import InterleavedShard, Partial, Placement, Replicate, Shard
from ..redistribute import execute_plan, plan_redistribute
from ..spec import DTensorSpec
from .common import DimOption, bind_schema, product_strategy
from .low_precision import held_as
from .registry import (
    OpSchema,
    OpStrategy,
    RuntimeSchemaInfo,
    bypass_dispatch,
    register_op_strategy,
)

aten = torch.ops.aten

# dims, keepdim, correction, dtype and norm order all change the sharding decision
REDUCTION_INFO = RuntimeSchemaInfo(
    1, static_kwargkey=("dim", "keepdim", "correction", "dtype", "ord", "unbiased")
)


@dataclass(frozen=True)
class ReductionKind:
    """How a reduction combines over a sharded dim, and which Partial inputs it keeps.

    ``over_shard``: the Partial reduce op of local results over a sharded reduced dim, or None
    when the reduced dims must be whole. ``keeps``: Partial reduce ops of the input that
    pass through to the output unchanged. ``outputs``: how many tensors the op returns (the
    extra ones, like indices, share the value's placements but never a Partial).
    """

    over_shard: str | None = None
    keeps: tuple[str, ...] = ()
    outputs: int = 1


WHOLE = ReductionKind()


def reduced_dims(dim: Any, ndim: int) -> list[int]:
    """Normalized reduced dims; None or an empty list reduce every dim (aten's meaning)."""
    if dim is None:
        return list(range(ndim))
    dims = [dim] if isinstance(dim, int) else list(dim)
    if not dims:
        return list(range(ndim))
    return sorted({d % ndim for d in dims}) if ndim else []


def _moved(p: Placement, dim_map: dict[int, int]) -> Placement:
    """A Shard placement on an input dim, moved to the output dim ``dim_map`` gives."""
    if isinstance(p, InterleavedShard):
        return InterleavedShard(dim_map[p.dim], p.interleaved_size)
    return Shard(dim_map[p.dim])


def reduction_strategy(
    mesh: DeviceMesh,
    input_strategy: OpStrategy,
    dims: Sequence[int],
    keepdim: bool,
    kind: ReductionKind,
) -> OpStrategy:
    """Every valid sharding of a reduction of one input over ``dims``: per mesh dim,
    Replicate; Shard of a kept dim (moved down when ``keepdim`` is False); Shard of a reduced
    dim when ``kind.over_shard`` names its Partial; Partial inputs listed in ``kind.keeps``."""
    ndim = input_strategy.ndim
    current = input_strategy.output_spec.placements
    kept = [d for d in range(ndim) if d not in dims]
    dim_map = {d: d if keepdim else kept.index(d) for d in kept}
    pairs: list[tuple[Placement, Placement]] = [(Replicate(), Replicate())]
    shards: list[Shard] = [Shard(d) for d in range(ndim)]
    shards += [p for p in current if isinstance(p, InterleavedShard) and p not in shards]
    for p in shards:
        if p.dim in dim_map:
            pairs.append((p, _moved(p, dim_map)))
        elif kind.over_shard is not None:
            pairs.append((p, Partial(kind.over_shard)))
    pairs += [(Partial(op), Partial(op)) for op in kind.keeps]
    if kind.outputs > 1:  # values and indices: an index is not a partial value
        pairs = [(p, q) for p, q in pairs if not isinstance(q, Partial)]
    options: list[DimOption] = [((p,), (q,) * kind.outputs) for p, q in pairs]

    def valid(combo: Sequence[DimOption]) -> bool:
        ins = tuple(c[0][0] for c in combo)
        return not _some_shard_empty(input_strategy.output_spec, ins, dims)

    needs_rows = kind.over_shard in ("max", "min")
    return product_strategy(
        mesh, options, multi=kind.outputs > 1, valid=valid if needs_rows else None
    )


def _some_shard_empty(
    spec: DTensorSpec, placements: tuple[Placement, ...], dims: Sequence[int]
) -> bool:
    """True if some device of the mesh would hold no element of the reduced dims of a
    non-empty input: a max/min of nothing is an error, so such a split cannot give Partial."""
    shape = spec.shape
    if any(shape[d] == 0 for d in dims):
        return False
    moved = spec.with_placements(placements)
    return any(
        any(moved.local_shape(device)[d] == 0 for d in dims)
        for device in spec.mesh.device_ids
    )


def _keeps_for_dtype(kind: ReductionKind, source: OpStrategy, dtype: Any) -> ReductionKind:
    """A sum of a pending sum is still pending only if summing does not change the dtype in a
    way the pending sum does not survive (``cast_keeps_partial``: bool and int8 pieces sum to
    int64, where bool "or" and int8 wrapping no longer hold)."""
    if not kind.keeps:
        return kind
    src = source.output_spec.tensor_meta.dtype
    out = dtype or (src if src.is_floating_point or src.is_complex else torch.int64)
    keeps = tuple(op for op in kind.keeps if op not in ("sum", "avg")
                  or cast_keeps_partial(op, src, out))
    return kind if keeps == kind.keeps else dataclasses.replace(kind, keeps=keeps)


def register_reduction(
    ops: Sequence[Any], kind: ReductionKind, *, dim_arg: str = "dim"
) -> None:
    """Register ``reduction_strategy`` for ``ops`` (reduced dims read from ``dim_arg``)."""

    def strategy_fn(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
        args = bind_schema(schema)
        source = schema.args_schema[0]
        dims = reduced_dims(args.get(dim_arg), source.ndim)
        kept = _keeps_for_dtype(kind, source, args.get("dtype"))
        return reduction_strategy(mesh, source, dims, bool(args.get("keepdim", False)), kept)

    strategy_fn.__doc__ = f"Reduction sharding of {[str(op) for op in ops]}."
    register_op_strategy(list(ops), schema_info=REDUCTION_INFO)(strategy_fn)


def _norm_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``linalg_vector_norm``: local 1-norms and 0-"norms" (counts) add up, inf-norms take the
    max, -inf-norms the min; other orders need the reduced dims whole."""
    args = bind_schema(schema)
    source = schema.args_schema[0]
    order = float(args.get("ord", 2))
    over_shard = {1.0: "sum", 0.0: "sum", math.inf: "max", -math.inf: "min"}.get(order)
    dims = reduced_dims(args.get("dim"), source.ndim)
    kind = ReductionKind(over_shard=over_shard)
    return reduction_strategy(mesh, source, dims, bool(args.get("keepdim", False)), kind)


def _scan_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """Scans (cumsum, cumprod, cummax...) keep every placement except a shard of the scanned
    dim; cumsum is linear, so a Partial("sum"/"avg") input stays Partial."""
    source = schema.args_schema[0]
    ndim = source.ndim
    dim = schema.args_schema[1] % ndim if ndim else 0
    current = source.output_spec.placements
    kept: list[Placement] = [Replicate()]
    kept += [Shard(d) for d in range(ndim) if d != dim]
    kept += [p for p in current if isinstance(p, InterleavedShard) and p.dim != dim]
    linear = schema.op in (aten.cumsum.default, aten.cumsum_.default)
    if linear:
        dtype = schema.kwargs_schema.get("dtype") or (
            schema.args_schema[2] if len(schema.args_schema) > 2 else None)
        keeps = _keeps_for_dtype(ReductionKind(keeps=("sum", "avg")), source, dtype).keeps
        kept += [Partial(op) for op in keeps]
    outputs = len(schema.op._schema.returns)
    options: list[DimOption] = [((p,), (p,) * outputs) for p in kept]
    return product_strategy(mesh, options, multi=outputs > 1)


# ----- mean: a sum divided by the global count -------------------------------------------------


def _mean(op: Any, args: tuple, kwargs: dict) -> DTensor:
    """``mean`` as ``sum`` then division by the number of reduced elements: over a sharded dim
    the sum is Partial("sum") and the division is linear, so no data moves and the result is
    exact for uneven shards (the average of local means would not be)."""
    x = args[0]
    meta = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    rest = args[1:]
    op(meta, *rest, **kwargs)  # raises aten's own error for invalid dtypes or dims
    # float16/bfloat16 sum in float32 and divide before rounding, as torch.mean does
    low = kwargs.get("dtype") is None and x.dtype in LOW_PRECISION
    kwargs = {**kwargs, "dtype": torch.float32} if low else kwargs
    if op is aten.mean.default:
        total = aten.sum.default(x, **kwargs)
        count = x.numel()
    else:
        dims = reduced_dims(rest[0] if rest else kwargs.get("dim"), x.ndim)
        keepdim = rest[1] if len(rest) > 1 else kwargs.get("keepdim", False)
        total = aten.sum.dim_IntList(x, dims, keepdim, dtype=kwargs.get("dtype"))
        count = math.prod(x.shape[d] for d in dims)
    mean = aten.div.Scalar(total, count)
    return held_as(mean, x.dtype) if low else mean


# ----- Python values ---------------------------------------------------------------------------


def _local_scalar_dense(op: Any, args: tuple, kwargs: dict) -> Any:
    """``.item()``, ``float()``, ``bool()``, ``int()``: the global value, never one device's
    piece -- a Partial or Shard DTensor is reduced/gathered to Replicate first (torch has
    already checked that the global tensor has one element)."""
    x: DTensor = args[0]
    target = (Replicate(),) * x.device_mesh.ndim
    components = x._components
    if x.placements != target:
        components = execute_plan(plan_redistribute(x._spec, target), x.device_mesh, components)
    return op(components[0], **kwargs)


# ----- registration ----------------------------------------------------------------------------

SUM = ReductionKind(over_shard="sum", keeps=("sum", "avg"))


def _register_all() -> None:
    register_reduction(
        [aten.sum.default, aten.sum.dim_IntList, aten.nansum.default], SUM
    )
    register_reduction(
        [aten.count_nonzero.default, aten.count_nonzero.dim_IntList],
        ReductionKind(over_shard="sum"),
    )
    register_reduction(
        [aten.amax.default, aten.max.default], ReductionKind(over_shard="max", keeps=("max",))
    )
    register_reduction(
        [aten.amin.default, aten.min.default], ReductionKind(over_shard="min", keeps=("min",))
    )
    register_reduction(
        [aten.max.dim, aten.min.dim, aten.aminmax.default], ReductionKind(outputs=2)
    )
    register_reduction(
        [
            aten.var_mean.correction, aten.var_mean.dim, aten.var_mean.default,
            aten.std_mean.correction, aten.std_mean.dim, aten.std_mean.default,
        ],
        ReductionKind(outputs=2),
    )
    register_reduction(
        [
            aten.prod.default, aten.prod.dim_int, aten.argmax.default, aten.argmin.default,
            aten.var.correction, aten.var.dim, aten.var.default,
            aten.std.correction, aten.std.dim, aten.std.default,
            aten.logsumexp.default,
        ],
        WHOLE,
    )
    # over booleans "any" is a max and "all" a min (nn.init.trunc_normal_'s rejection loop
    # asks ``mask.any()`` of a sharded parameter's mask)
    register_reduction(
        [aten.any.default, aten.any.dim, aten.any.dims], ReductionKind(over_shard="max")
    )
    register_reduction(
        [aten.all.default, aten.all.dim, aten.all.dims], ReductionKind(over_shard="min")
    )
    register_op_strategy([aten.linalg_vector_norm.default], schema_info=REDUCTION_INFO)(
        _norm_strategy
    )
    register_op_strategy(
        [
            aten.cumsum.default, aten.cumsum_.default, aten.cumprod.default,
            aten.cumprod_.default, aten.cummax.default, aten.cummin.default,
            aten.logcumsumexp.default,
        ],
        schema_info=RuntimeSchemaInfo(1),
    )(_scan_strategy)
    bypass_dispatch([aten.mean.default, aten.mean.dim], _mean)
    bypass_dispatch([aten._local_scalar_dense.default], _local_scalar_dense)


_register_all()


def _norm_as_vector_norm(op: Any, args: tuple, kwargs: dict) -> Any:
    """``torch.norm``'s ``aten.norm`` overloads are vector norms: ``linalg_vector_norm``."""
    names = [a.name for a in op._schema.arguments]
    bound = dict(zip(names, args, strict=False)) | kwargs
    p = bound.get("p")
    return aten.linalg_vector_norm.default(
        bound["self"], 2 if p is None else p, bound.get("dim"), bound.get("keepdim", False),
        dtype=bound.get("dtype"),
    )


bypass_dispatch(
    [aten.norm.Scalar, aten.norm.ScalarOpt_dim, aten.norm.ScalarOpt_dim_dtype,
     aten.norm.ScalarOpt_dtype],
    _norm_as_vector_norm,
)
