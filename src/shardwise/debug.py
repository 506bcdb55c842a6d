"""Debugging aids: explain a redistribution before running it."""

from __future__ import annotations

from collections.abc import Sequence

from .dtensor import DTensor
from .placements import Placement
from .redistribute import RedistributePlan, plan_redistribute
from .spec import validate_placements


def explain_redistribute(dtensor: DTensor, placements: Sequence[Placement]) -> RedistributePlan:
    """The plan ``dtensor.redistribute(placements=placements)`` would run: its steps, each with
    its collective, mesh dim and the bytes this process's devices would receive."""
    target = validate_placements(dtensor.shape, dtensor.device_mesh, placements)
    return plan_redistribute(dtensor._spec, target)
