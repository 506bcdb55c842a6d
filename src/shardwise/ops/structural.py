"""Ops that keep the spec of their first input and act per component (detach, alias, clone...)."""

from __future__ import annotations

import torch

from ..mesh import DeviceMesh
from ..placements import Replicate
from .common import input_strategies, strategy
from .registry import OpSchema, OpStrategy, RuntimeSchemaInfo, register_op_strategy

aten = torch.ops.aten

SAME_SPEC_OPS = [
    aten.detach.default,
    aten.alias.default,
    aten.clone.default,
    aten.contiguous.default,
    aten.zero_.default,
    aten.zeros_like.default,
    aten.empty_like.default,
    aten.ones_like.default,
    aten.full_like.default,
    aten._to_copy.default,
]


@register_op_strategy(SAME_SPEC_OPS, schema_info=RuntimeSchemaInfo(1))
def same_spec_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """The output keeps the input's placements; ``ones_like``/``full_like`` ignore the input's
    values, so a Partial input gives a Replicate output on that mesh dim."""
    placements = input_strategies(schema)[0].output_spec.placements
    out = placements
    if schema.op in (aten.ones_like.default, aten.full_like.default):
        out = tuple(Replicate() if p.is_partial() else p for p in placements)
    return OpStrategy([strategy(mesh, [placements], out)])
