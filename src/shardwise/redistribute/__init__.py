"""Redistribution: plan the cheapest per-mesh-dim steps from one spec to another (``plan``), and
run them (``run``, with the point to point ``exchange``; ``traced`` while torch.compile traces).

Every module here imports only from the modules before it in this order, and from the layers
above (``geometry``, ``spec``, ``comm``): exchange, plan, run, traced.
"""

from ..geometry import lower_bound_bytes
from .plan import RedistributePlan, Step, plan_redistribute
from .run import run_plan
from .traced import compile_plan, execute_plan

__all__ = [
    "RedistributePlan",
    "Step",
    "compile_plan",
    "execute_plan",
    "lower_bound_bytes",
    "plan_redistribute",
    "run_plan",
]
