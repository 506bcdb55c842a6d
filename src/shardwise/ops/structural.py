"""Ops that keep the spec of their first input and act per component (detach, alias, clone,
contiguous, ``prims.view_of``). Casts and the ``*_like`` factories live in ``tensor_ops``."""

from __future__ import annotations

import torch

from ..mesh import DeviceMesh
from .common import input_strategies, strategy
from .registry import OpSchema, OpStrategy, RuntimeSchemaInfo, register_op_strategy

aten = torch.ops.aten

SAME_SPEC_OPS = [
    aten.detach.default,
    aten.alias.default,
    aten.clone.default,
    aten.contiguous.default,
    torch.ops.prims.view_of.default,  # a view of the same layout (torch's references use it)
]


@register_op_strategy(SAME_SPEC_OPS, schema_info=RuntimeSchemaInfo(1, ("memory_format",)))
def same_spec_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """The output keeps the input's placements (Partial included: these ops are the identity
    on values)."""
    placements = input_strategies(schema)[0].output_spec.placements
    return OpStrategy([strategy(mesh, [placements], placements)])
