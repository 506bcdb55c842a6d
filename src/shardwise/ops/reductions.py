"""Reductions and scans: sum, mean, prod, max/min, amax/amin, argmax/argmin, var/std,
vector norms and their power sums (``linalg__powsum``), any/all, logsumexp, cumsum/cumprod,
and Python values (``.item()``).

Over a dim that is not sharded a reduction keeps the placements (shard dims shift down when
``keepdim=False``). Over a sharded dim the local reductions are combined by a pending
reduction where one exists: ``sum`` gives Partial("sum"), ``amax``/``max`` and ``any``
Partial("max"), ``amin``/``min`` and ``all`` Partial("min"), p-norms Partial("norm<p>")
(PyTorch's ``_NormPartial``, with p = inf as "norminf"). ``mean`` gives Partial("avg") of the
local means, as PyTorch's DTensor does, where every device holds as many of the reduced
elements, and Partial("sum") of local sums over the global count on uneven shards (exact, no
communication). Everything else (prod, var, std, negative-order norms, argmax, max/min with
indices, logsumexp, scans along the scanned dim) needs the reduced dims whole: its strategies
only list Replicate there, so dispatch gathers them. Partial inputs pass through only the
reductions that are linear (sum and mean of Partial("sum"/"avg")) or of the same kind (amax of
Partial("max"), a p-norm of Partial("norm<p>")).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..comm.reduction import cast_keeps_partial
from ..dtensor import DTensor, local_of
from ..mesh import DeviceMesh
from ..placements import (
    Partial,
    Placement,
    Replicate,
    Shard,
    is_special_shard,
    norm_order,
    norm_partial,
    with_dim,
)
from ..redistribute import execute_plan, plan_redistribute
from ..spec import DTensorSpec
from .common import DimOption, bind_schema, product_strategy
from .registry import (
    OpSchema,
    OpStrategy,
    RuntimeSchemaInfo,
    bypass_dispatch,
    register_local_args,
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
    # the Partial reduce op instead of ``over_shard`` when devices hold different numbers of
    # the reduced elements (the average of local means is then not the mean)
    uneven: str | None = None


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
    return with_dim(p, dim_map[p.dim])


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
    shards += [p for p in current if is_special_shard(p) and p not in shards]
    for p in shards:
        if p.dim in dim_map:
            pairs.append((p, _moved(p, dim_map)))
        elif kind.over_shard is not None:
            pairs.append((p, Partial(kind.over_shard)))
            if kind.uneven is not None:
                pairs.append((p, Partial(kind.uneven)))
    pairs += [(Partial(op), Partial(op)) for op in kind.keeps]
    if kind.outputs > 1:  # values and indices: an index is not a partial value
        pairs = [(p, q) for p, q in pairs if not isinstance(q, Partial)]
    options: list[DimOption] = [((p,), (q,) * kind.outputs) for p, q in pairs]

    spec = input_strategy.output_spec

    def valid(combo: Sequence[DimOption]) -> bool:
        ins = tuple(c[0][0] for c in combo)
        if needs_rows and _some_shard_empty(spec, ins, dims):
            return False
        if kind.uneven is None:
            return True
        made = {q.reduce_op for c in combo for p, q in [(c[0][0], c[1][0])]
                if isinstance(p, Shard) and isinstance(q, Partial)}
        if not made:
            return True
        return made == {kind.over_shard if _evenly_reduced(spec, ins, dims) else kind.uneven}

    needs_rows = kind.over_shard in ("max", "min", "norminf")  # no identity for empty pieces
    checked = needs_rows or kind.uneven is not None
    return product_strategy(
        mesh, options, multi=kind.outputs > 1, valid=valid if checked else None,
        shapes=[spec.shape],
    )


def _evenly_reduced(
    spec: DTensorSpec, placements: tuple[Placement, ...], dims: Sequence[int]
) -> bool:
    """True if every device holds the same number of the reduced elements under
    ``placements`` (then the average of the local means over any mesh dims is the mean)."""
    moved = spec.with_placements(placements)
    counts = {
        math.prod(moved.local_shape(device)[d] for d in dims) for device in spec.mesh.device_ids
    }
    return len(counts) == 1


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
    """``linalg_vector_norm`` of order p over a sharded dim is its pending norm, PyTorch's
    ``_NormPartial``: local p-norms make ``Partial("norm<p>")`` for finite p > 0 (reduced as
    (sum x^p)^(1/p)), ``Partial("max")`` for inf, ``Partial("min")`` for -inf, ``Partial("sum")``
    for 0 (counts); negative orders need the reduced dims whole. A pending p-norm input stays
    pending under a norm of the same order (the norm of pending norms is the pending norm of
    the local norms): ``clip_grad_norm_`` stacks the per-tensor norms and reduces once."""
    args = bind_schema(schema)
    source = schema.args_schema[0]
    pending = norm_partial(float(args.get("ord", 2)))
    dims = reduced_dims(args.get("dim"), source.ndim)
    op = None if pending is None else pending.reduce_op
    keeps = (op,) if op is not None and norm_order(op) is not None else ()
    kind = ReductionKind(over_shard=op, keeps=keeps)
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
    kept += [p for p in current if is_special_shard(p) and p.dim != dim]
    linear = schema.op in (aten.cumsum.default, aten.cumsum_.default)
    if linear:
        dtype = schema.kwargs_schema.get("dtype") or (
            schema.args_schema[2] if len(schema.args_schema) > 2 else None)
        keeps = _keeps_for_dtype(ReductionKind(keeps=("sum", "avg")), source, dtype).keeps
        kept += [Partial(op) for op in keeps]
    outputs = len(schema.op._schema.returns)
    options: list[DimOption] = [((p,), (p,) * outputs) for p in kept]
    return product_strategy(mesh, options, multi=outputs > 1, shapes=[source.output_spec.shape])


# ----- mean: Partial("avg") of local means ----------------------------------------------------

MEAN = ReductionKind(over_shard="avg", keeps=("sum", "avg"), uneven="sum")


def _mean_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``mean`` over a sharded dim is ``Partial("avg")`` of the local means, as in PyTorch's
    DTensor, when every device holds the same number of the reduced elements (the average of
    the local means is then the mean). On uneven shards it is not: PyTorch then gathers the
    reduced dims (a Replicate result, the whole tensor moved); shardwise instead keeps the
    global value exact without communication as ``Partial("sum")`` of each device's local sum
    divided by the global count (``_mean_local_args``). Mean is linear, so a Partial("sum") or
    Partial("avg") input stays so (dtype permitting)."""
    args = bind_schema(schema)
    source = schema.args_schema[0]
    dims = reduced_dims(args.get("dim"), source.ndim)
    kind = _keeps_for_dtype(MEAN, source, args.get("dtype"))
    return reduction_strategy(mesh, source, dims, bool(args.get("keepdim", False)), kind)


def _from_uneven_shards(specs: list[DTensorSpec], output: Any) -> bool:
    """The decision turns a shard of reduced elements into ``Partial("sum")`` (uneven shards)."""
    return any(
        isinstance(p, Shard) and isinstance(q, Partial) and q.reduce_op == "sum"
        for p, q in zip(specs[0].placements, output.placements, strict=True)
    )


def _mean_local_args(
    args: tuple, kwargs: dict, specs: list[DTensorSpec], _out: Any, _device: int
) -> tuple[tuple, dict]:
    """Uneven shards: each device's mean must be its local sum over the global count, so its
    piece is scaled by (local count / global count) before the local mean; an empty piece
    becomes one zero per output element (its share is 0, where its mean would be NaN)."""
    x = args[0]
    spec = specs[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    dims = reduced_dims(dim, spec.ndim)
    local = math.prod(x.shape[d] for d in dims)
    total = math.prod(spec.shape[d] for d in dims)
    dtype = kwargs.get("dtype") or x.dtype
    if local == 0:
        shape = [1 if d in dims else n for d, n in enumerate(x.shape)]
        x = torch.zeros(shape, dtype=dtype, device=x.device)
    else:
        x = x.to(dtype) * (local / total)
    return (x, *args[1:]), kwargs


# ----- Python values ---------------------------------------------------------------------------


def _local_scalar_dense(op: Any, args: tuple, kwargs: dict) -> Any:
    """``.item()``, ``float()``, ``bool()``, ``int()``: the global value, never one device's
    piece -- a Partial or Shard DTensor is reduced/gathered to Replicate first (torch has
    already checked that the global tensor has one element)."""
    x: DTensor = args[0]
    target = (Replicate(),) * x.device_mesh.ndim
    held = local_of(x)
    components = held.pieces
    if x.placements != target:
        components = execute_plan(plan_redistribute(held.spec, target), x.device_mesh, components)
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
    # sum(|x|^ord), the vector norm without its root: a sum of every order (the 0th power
    # counts, negative ones sum reciprocals); no Partial input passes, |a + b|^p not being
    # |a|^p + |b|^p (PyTorch's DTensor keeps a pending sum there, and the wrong value)
    register_reduction([aten.linalg__powsum.default], ReductionKind(over_shard="sum"))
    register_op_strategy(
        [
            aten.cumsum.default, aten.cumsum_.default, aten.cumprod.default,
            aten.cumprod_.default, aten.cummax.default, aten.cummin.default,
            aten.logcumsumexp.default,
        ],
        schema_info=RuntimeSchemaInfo(1),
    )(_scan_strategy)
    register_op_strategy([aten.mean.default, aten.mean.dim], schema_info=REDUCTION_INFO)(
        _mean_strategy
    )
    register_local_args(
        [aten.mean.default, aten.mean.dim], _mean_local_args, applies=_from_uneven_shards
    )
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
