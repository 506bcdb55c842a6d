"""Executing a plan: eagerly (``run.run_plan``), or while a tracer runs.

In one process the plan's local ops and in-process collectives are traced as they are, where
the compiler can fuse them. Across processes a plan whose every collective runs on the
backend's own collectives (one device per process on its mesh dims, no exchange) is traced as
it is too: its steps become ``_c10d_functional`` collectives and ``wait_tensor``s in the graph,
which inductor schedules and overlaps (``lowers``). Any other plan is one ``torch.library``
custom op, ``shardwise::execute_plan(components, key)``, which runs the plan that ``key``
describes (``run_plan``, eager's executor, so results are bit-identical to eager), and whose
fake implementation gives the target local shapes without communicating. The key is a JSON
text of the mesh, the placements, the global shape, the dtype and whether the plan may spread
(an explicit redistribution's), so a graph loaded from torch's compile caches in another
process finds its plan again (planning is deterministic).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence

import torch

from ..caches import PER_LAYOUT, register
from ..comm import native
from ..comm.distributed import spans_processes
from ..mesh import DeviceMesh
from ..spec import DTensorSpec, contiguous_meta
from ..torch_compat import disable_current_modes, len_torch_dispatch_stack
from ..tracing import decode_placement, encode_placement
from .plan import RedistributePlan, plan_redistribute
from .run import local_splits, run_plan

# key -> (plan, mesh, local output shapes)
_entries: dict[str, tuple[RedistributePlan, DeviceMesh, list[torch.Size]]] = {}
TRACED_CACHE_SIZE = PER_LAYOUT
register("shardwise.redistribute.traced._entries", _entries.clear)
_lock = threading.Lock()


def tracing(mesh: DeviceMesh, components: Sequence[torch.Tensor]) -> bool:
    """True while a tracer runs on a mesh whose devices span processes."""
    return len_torch_dispatch_stack() > 0 and spans_processes(mesh) and bool(components)


def _key(plan: RedistributePlan, mesh: DeviceMesh, dtype: torch.dtype) -> str:
    return json.dumps({
        "mesh": [mesh.device_type, list(mesh.shape), list(mesh.device_ids),
                 list(mesh.mesh_dim_names or ())],
        "source": [encode_placement(p) for p in plan.source],
        "target": [encode_placement(p) for p in plan.target],
        "shape": list(plan.shape),
        "dtype": str(dtype).removeprefix("torch."),
        "spread": plan.spread,
    })


def _entry(key: str) -> tuple[RedistributePlan, DeviceMesh, list[torch.Size]]:
    """The plan, mesh and output shapes of ``key`` (planned again when this process has not
    traced it: a graph from torch's caches)."""
    entry = _entries.get(key)
    if entry is None:
        with disable_current_modes():  # a fake mode may be tracing: the mesh is real data
            _replan(key)
        entry = _entries[key]
    return entry


def _replan(key: str) -> None:
    d = json.loads(key)
    device_type, shape, ids, names = d["mesh"]
    mesh = DeviceMesh(device_type, torch.tensor(ids).reshape(shape),
                      mesh_dim_names=tuple(names) or None)
    meta = contiguous_meta(d["shape"], getattr(torch, d["dtype"]))
    source = DTensorSpec(mesh, tuple(decode_placement(c) for c in d["source"]), meta)
    plan = plan_redistribute(source, tuple(decode_placement(c) for c in d["target"]),
                             spread=d["spread"])
    _store(key, plan, mesh, meta.dtype)


def _store(key: str, plan: RedistributePlan, mesh: DeviceMesh, dtype: torch.dtype) -> None:
    with _lock:
        if key not in _entries:
            spec = DTensorSpec(mesh, plan.target, contiguous_meta(plan.shape, dtype))
            if len(_entries) >= TRACED_CACHE_SIZE:  # oldest out: it is planned again if used
                del _entries[next(iter(_entries))]
            _entries[key] = (plan, mesh, [spec.local_shape(d) for d in mesh.local_device_ids])


def traced_plan(
    plan: RedistributePlan, mesh: DeviceMesh, components: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """``plan`` on ``components`` through the custom op (what a compiled graph records)."""
    key = _key(plan, mesh, components[0].dtype)
    _store(key, plan, mesh, components[0].dtype)
    return list(torch.ops.shardwise.execute_plan(list(components), key))


@torch.library.custom_op("shardwise::execute_plan", mutates_args=())
def _execute_plan_op(components: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    plan, mesh, _ = _entry(key)
    inputs = {c.untyped_storage().data_ptr() for c in components}
    # a custom op's outputs are fresh, dense tensors (no aliasing of its inputs)
    return [
        c.clone(memory_format=torch.contiguous_format)
        if c.untyped_storage().data_ptr() in inputs or not c.is_contiguous()
        else c
        for c in run_plan(plan, mesh, components)
    ]


@_execute_plan_op.register_fake
def _(components: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    shapes = _entry(key)[2]
    return [c.new_empty(shape) for c, shape in zip(components, shapes, strict=True)]


_LOWERED = ("local", "all_gather", "all_reduce", "reduce_scatter", "all_to_all")


def lowers(plan: RedistributePlan, mesh: DeviceMesh) -> bool:
    """Whether every step of ``plan`` traces into the backend's functional collectives: each
    a collective on one mesh dim whose groups have one device per process."""
    return all(
        step.collective in _LOWERED
        and (step.collective == "local" or native.applies(mesh, step.mesh_dim))
        for step in plan.steps
    )


def issues_async(plan: RedistributePlan, mesh: DeviceMesh) -> bool:
    """Whether ``plan``, run across processes, is backend collectives only (it ``lowers``):
    an asynchronous run issues them at once and leaves the results to wait at first use
    (``comm.background.issue``), no worker thread."""
    return spans_processes(mesh) and lowers(plan, mesh)


def execute_plan(
    plan: RedistributePlan, mesh: DeviceMesh, components: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Run ``plan`` on this process's components (ordered like ``mesh.local_device_ids``):
    while a tracer runs on a mesh spanning processes, as functional collectives where the plan
    ``lowers``, else through the custom op; eagerly otherwise."""
    if tracing(mesh, components) and not lowers(plan, mesh):
        return traced_plan(plan, mesh, components)
    return run_plan(plan, mesh, components)


def compile_plan(
    plan: RedistributePlan, spec: DTensorSpec
) -> Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]:
    """``execute_plan(plan, spec.mesh, components)`` as a function of the components of a
    tensor of ``spec``; a plan of local splits only (Replicate -> Shard) gets each device's
    cuts worked out once, for callers that run the same plan again and again (dispatch), and
    is marked ``cuts`` (its results are views of its arguments)."""
    mesh = spec.mesh
    splits = local_splits(plan, spec)
    if splits is None:
        return lambda components: execute_plan(plan, mesh, components)

    def run(components: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if len_torch_dispatch_stack():  # a tracer may be running: its route
            return execute_plan(plan, mesh, components)
        return splits(components)

    run.cuts = True  # type: ignore[attr-defined]  # views of the components, nothing moved
    return run
