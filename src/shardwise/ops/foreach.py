"""``aten._foreach_*`` ops (what foreach optimizers run) and the fused optimizer steps
(``aten._fused_adamw_``...): element i of every tensor list takes
the placements of element i of the first list; Partial elements are reduced first, except that
scaling by Python scalars or by one replicated scalar tensor (``clip_grad_norm_``'s
``_foreach_mul_(grads, coef)``) keeps a pending sum or average, which it scales linearly.
The foreach reductions over each whole tensor (``_foreach_norm``, ``_foreach_powsum``,
``_foreach_max``) leave a sharded tensor's result pending."""

from __future__ import annotations

import math

import torch

from ..caches import PER_GROUP, PER_LAYOUT, cached
from ..dtensor import DTensor, local_of
from ..mesh import DeviceMesh
from ..placements import (
    InterleavedShard,
    Partial,
    Placement,
    Replicate,
    Shard,
    is_any_shard,
    norm_partial,
)
from ..spec import DTensorSpec, TensorMeta
from ..torch_compat import foreach_norm as _foreach_norm_kernel
from ..torch_compat import jit_get_all_schemas
from .common import no_empty_shard, spec_of
from .registry import (
    OpSchema,
    OpStrategy,
    PlacementStrategy,
    RuntimeSchemaInfo,
    StrategyFunc,
    bypass_dispatch,
    register_op_strategy,
)

aten = torch.ops.aten

_NOT_ELEMENTWISE = {"_foreach_max", "_foreach_mm", "_foreach_norm", "_foreach_powsum"}
FOREACH_OPS = [
    getattr(getattr(aten, s.name[6:]), s.overload_name or "default")
    for s in jit_get_all_schemas()
    if s.name.startswith("aten::_foreach_")
    and s.name[6:] not in _NOT_ELEMENTWISE
    and "out" not in s.overload_name
]
# fused optimizer steps (``fused=True``): elementwise over their tensor lists, in place
FUSED_OPTIMIZER_OPS = [
    getattr(getattr(aten, name), overload)
    for name in ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_")
    if hasattr(aten, name)
    for overload in getattr(aten, name).overloads()
]
_LINEAR_SCALAR = ("_foreach_mul", "_foreach_div", "_foreach_neg", "_foreach_zero")


def _is_linear(op) -> bool:
    name = op._schema.name.split("::")[-1].rstrip("_")
    overload = op._overloadname
    return name in _LINEAR_SCALAR and overload in ("Scalar", "ScalarList", "Tensor", "default", "")


def _settled(placements: tuple[Placement, ...], keep_linear: bool) -> tuple[Placement, ...]:
    """``placements`` with each Partial replaced by Replicate, except pending sums and
    averages under a linear op (a scaled max, min or norm is not the scaled reduction when
    the factor is negative)."""
    return tuple(
        Replicate() if p.is_partial() and not (keep_linear and p.reduce_op in ("sum", "avg"))
        else p for p in placements
    )


@register_op_strategy(FOREACH_OPS + FUSED_OPTIMIZER_OPS)
def foreach_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """One strategy: every list aligned with the first list's placements, element by element."""
    lists = [a for a in schema.args_schema if isinstance(a, (list, tuple))]
    first = [s for s in lists[0] if isinstance(s, OpStrategy)]
    linear = _is_linear(schema.op)
    targets: list[tuple[Placement, ...]] = []
    for i, element in enumerate(first):
        placements = element.output_spec.placements
        # an empty list (a fused step's max_exp_avg_sqs without amsgrad) aligns with none
        column = [lst[i] for lst in lists if i < len(lst) and isinstance(lst[i], OpStrategy)]
        if any(p.is_partial() for s in column for p in s.output_spec.placements):
            placements = _settled(placements, linear and len(column) == 1)
        targets.append(placements)
    input_specs = []
    for arg in schema.args_schema:
        if isinstance(arg, (list, tuple)):
            input_specs += [
                spec_of(mesh, targets[i]) for i, s in enumerate(arg) if isinstance(s, OpStrategy)
            ]
        elif isinstance(arg, OpStrategy):  # a scalar tensor: its reduced value scales
            input_specs.append(spec_of(mesh, _settled(arg.output_spec.placements, False)))
    outputs = tuple(spec_of(mesh, t) for t in targets)
    return OpStrategy([PlacementStrategy(outputs, input_specs)])


def foreach_norm(op, args: tuple, kwargs: dict) -> list:
    """``_foreach_norm`` (what ``clip_grad_norm_`` runs): the global norm of each tensor. Where
    every tensor is a DTensor of one mesh, sharded or replicated, and the order is positive,
    one ``_foreach_norm`` per device on the components gives the pending norms at once;
    otherwise the reductions family's ``linalg_vector_norm`` on every DTensor."""
    tensors = args[0]
    order = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    if dtype is None:
        at_once = _norms_at_once(tensors, order)
        if at_once is not None:
            return at_once
    return [aten.linalg_vector_norm.default(t, order, dtype=dtype) for t in tensors]


def _norms_at_once(tensors: list, order: float) -> list[DTensor] | None:
    """The norms of ``tensors`` from one ``_foreach_norm`` per local device: a shard's norm
    is its part of the pending norm (``norm_partial``; an empty shard's 0 changes no finite
    norm of positive order), a replicated tensor's is whole. None where that does not hold (a
    pending input, a plain tensor, another mesh, an order that is not positive, an empty
    shard under the inf-norm)."""
    pending = norm_partial(float(order))
    if pending is None or not float(order) > 0 or not tensors:
        return None
    held = [local_of(t) if type(t) is DTensor else None for t in tensors]
    mesh = held[0].spec.mesh if held[0] is not None else None
    for h in held:
        if (h is None or (h.spec.mesh is not mesh and h.spec.mesh != mesh)
                or not h.pieces or not _whole_or_sharded(h.spec.placements)):
            return None
    if math.isinf(order) and any(c.numel() == 0 for h in held for c in h.pieces):
        return None  # the max of no elements has no value: torch refuses it
    n_local = len(held[0].pieces)
    per_device = [_foreach_norm_kernel([h.pieces[i] for h in held], order)
                  for i in range(n_local)]
    return [DTensor([norms[j] for norms in per_device],
                    _norm_spec(held[j].spec, pending, per_device[0][j].dtype))
            for j in range(len(tensors))]


@cached(PER_GROUP)
def _whole_or_sharded(placements: tuple[Placement, ...]) -> bool:
    return all(type(p) in (Shard, InterleavedShard) or p.is_replicate() for p in placements)


@cached(PER_LAYOUT)
def _norm_spec(spec: DTensorSpec, pending: Placement, dtype: torch.dtype) -> DTensorSpec:
    """The spec of the norm of a tensor of ``spec``: pending where it is sharded (one spec
    object per input spec, so its Partials are checked once)."""
    placements = tuple(pending if is_any_shard(p) else p for p in spec.placements)
    return DTensorSpec(spec.mesh, placements, TensorMeta(torch.Size(()), (), dtype))


bypass_dispatch([aten._foreach_norm.Scalar], foreach_norm)


def _reduced_whole(
    spec: DTensorSpec, over_shard: str, keeps: tuple[str, ...]
) -> tuple[tuple[Placement, ...], tuple[Placement, ...]]:
    """(input, output) placements of a reduction of every element of a tensor of ``spec``:
    per mesh dim a shard stays and its local results are pending (``Partial(over_shard)``), a
    Partial of a kind in ``keeps`` stays, any other Partial is reduced first. A max has no
    value over an empty piece: where a shard would leave a device none of a non-empty
    tensor, those shards are gathered."""
    ins: list[Placement] = []
    outs: list[Placement] = []
    for p in spec.placements:
        if is_any_shard(p):
            ins.append(p)
            outs.append(Partial(over_shard))
        elif p.is_partial() and p.reduce_op in keeps:
            ins.append(p)
            outs.append(p)
        else:
            ins.append(Replicate())
            outs.append(Replicate())
    shape = spec.shape
    if over_shard == "max" and not no_empty_shard(spec.mesh, shape, ins, range(len(shape))):
        gathered = [is_any_shard(p) for p in ins]
        ins = [Replicate() if g else p for p, g in zip(ins, gathered, strict=True)]
        outs = [Replicate() if g else p for p, g in zip(outs, gathered, strict=True)]
    return tuple(ins), tuple(outs)


def foreach_reduction(over_shard: str, keeps: tuple[str, ...] = ()) -> StrategyFunc:
    """The strategy of a foreach op that reduces each tensor of its list to one value."""

    def strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
        input_specs, outputs = [], []
        for element in schema.args_schema[0]:
            if not isinstance(element, OpStrategy):  # a 0-d plain tensor: the same everywhere
                outputs.append(spec_of(mesh, (Replicate(),) * mesh.ndim))
                continue
            ins, outs = _reduced_whole(element.output_spec, over_shard, keeps)
            input_specs.append(spec_of(mesh, ins))
            outputs.append(spec_of(mesh, outs))
        return OpStrategy([PlacementStrategy(tuple(outputs), input_specs)])

    strategy.__doc__ = (
        f"Each tensor reduced whole: a shard's result pending as Partial({over_shard!r})"
        + (f", a Partial({keeps[0]!r}) kept" if keeps else "") + "."
    )
    return strategy


# sum(|x|^ord) of each tensor (the foreach norm without its root): no Partial input passes
register_op_strategy([aten._foreach_powsum.Scalar], schema_info=RuntimeSchemaInfo(1))(
    foreach_reduction("sum")
)
register_op_strategy([aten._foreach_max.default], schema_info=RuntimeSchemaInfo(1))(
    foreach_reduction("max", keeps=("max",))
)
