"""A redistribution plan across processes as one ``torch.library`` custom op, so torch.compile
can trace it: ``shardwise::execute_plan(components, key)`` runs the plan registered under
``key`` (``execute_plan`` itself, so results are bit-identical to eager), and its fake
implementation gives the target local shapes without communicating.

``execute_plan`` takes this route only while a tracer runs (fake or functional components
under a dispatch mode) on a mesh that spans processes; in one process the plan's local ops and
in-process collectives are traced as they are, where the compiler can fuse them.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from .comm.distributed import spans_processes
from .mesh import DeviceMesh
from .redistribute import RedistributePlan, run_plan
from .spec import DTensorSpec, contiguous_meta

# (plan, mesh, dtype) -> key, and key -> (plan, mesh, local output shapes)
_keys: dict[tuple[RedistributePlan, DeviceMesh, torch.dtype], int] = {}
_entries: list[tuple[RedistributePlan, DeviceMesh, list[torch.Size]]] = []
_lock = threading.Lock()


def tracing(mesh: DeviceMesh, components: Sequence[torch.Tensor]) -> bool:
    """True while a tracer runs on a mesh whose devices span processes."""
    return torch._C._len_torch_dispatch_stack() > 0 and spans_processes(mesh) and bool(components)


def _register(plan: RedistributePlan, mesh: DeviceMesh, dtype: torch.dtype) -> int:
    with _lock:
        key = _keys.get((plan, mesh, dtype))
        if key is None:
            spec = DTensorSpec(mesh, plan.target, contiguous_meta(plan.shape, dtype))
            _entries.append((plan, mesh, [spec.local_shape(d) for d in mesh.local_device_ids]))
            key = _keys[(plan, mesh, dtype)] = len(_entries) - 1
    return key


def traced_plan(
    plan: RedistributePlan, mesh: DeviceMesh, components: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """``plan`` on ``components`` through the custom op (what a compiled graph records)."""
    key = _register(plan, mesh, components[0].dtype)
    return list(torch.ops.shardwise.execute_plan(list(components), key))


@torch.library.custom_op("shardwise::execute_plan", mutates_args=())
def _execute_plan_op(components: list[torch.Tensor], key: int) -> list[torch.Tensor]:
    plan, mesh, _ = _entries[key]
    inputs = {c.untyped_storage().data_ptr() for c in components}
    # a custom op's outputs are fresh, dense tensors (no aliasing of its inputs)
    return [
        c.clone(memory_format=torch.contiguous_format)
        if c.untyped_storage().data_ptr() in inputs or not c.is_contiguous()
        else c
        for c in run_plan(plan, mesh, components)
    ]


@_execute_plan_op.register_fake
def _(components: list[torch.Tensor], key: int) -> list[torch.Tensor]:
    shapes = _entries[key][2]
    return [c.new_empty(shape) for c, shape in zip(components, shapes, strict=True)]
