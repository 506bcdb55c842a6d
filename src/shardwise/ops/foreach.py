"""``aten._foreach_*`` ops (what foreach optimizers run) and the fused optimizer steps
(``aten._fused_adamw_``...): element i of every tensor list takes
the placements of element i of the first list; Partial elements are reduced first, except that
scaling by Python scalars or by one replicated scalar tensor (``clip_grad_norm_``'s
``_foreach_mul_(grads, coef)``) keeps a pending sum or average, which it scales linearly."""

from __future__ import annotations

import torch

from ..mesh import DeviceMesh
from ..placements import Placement, Replicate
from .common import spec_of
from .registry import (
    OpSchema,
    OpStrategy,
    PlacementStrategy,
    bypass_dispatch,
    register_op_strategy,
)

aten = torch.ops.aten

_NOT_ELEMENTWISE = {"_foreach_max", "_foreach_mm", "_foreach_norm", "_foreach_powsum"}
FOREACH_OPS = [
    getattr(getattr(aten, s.name[6:]), s.overload_name or "default")
    for s in torch._C._jit_get_all_schemas()
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
    """``_foreach_norm`` (what ``clip_grad_norm_`` runs): the global norm of each tensor, by the
    reductions family's ``linalg_vector_norm`` on every DTensor."""
    tensors = args[0]
    order = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    return [aten.linalg_vector_norm.default(t, order, dtype=dtype) for t in tensors]


bypass_dispatch([aten._foreach_norm.Scalar], foreach_norm)
