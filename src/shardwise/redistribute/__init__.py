"""Redistribution: plan the cheapest per-mesh-dim steps from one spec to another (``plan``), and
run them (``run``, with the point to point ``exchange``; ``traced`` while torch.compile traces).

Every module here imports only from the modules before it in this order, and from the layers
above (``geometry``, ``spec``, ``comm``): exchange, cross_mesh, plan, run, traced. ``cross_mesh``
(a move between two meshes, or an explicit redistribution's point to point plan on one) imports
``exchange`` only.
"""

from ..geometry import lower_bound_bytes
from .cross_mesh import CrossMeshPlan, cross_mesh_lower_bound_bytes, plan_cross_mesh
from .plan import RedistributePlan, Step, plan_redistribute
from .run import run_plan
from .traced import compile_plan, execute_plan, issues_async

__all__ = [
    "CrossMeshPlan",
    "RedistributePlan",
    "Step",
    "compile_plan",
    "cross_mesh_lower_bound_bytes",
    "execute_plan",
    "issues_async",
    "lower_bound_bytes",
    "plan_cross_mesh",
    "plan_redistribute",
    "run_plan",
]
