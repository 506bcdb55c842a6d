"""Running a plan eagerly: each step on this process's components, one after the other."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch

from .. import comm
from ..caches import PER_LAYOUT, PER_SEGMENT, cached
from ..geometry import (
    Segments,
    chunk_sizes,
    segments_size,
    shard_segments,
    split_segments,
)
from ..mesh import DeviceMesh
from ..placements import InterleavedShard, Partial, Replicate, Shard
from ..spec import DTensorSpec, pending_sum
from .cross_mesh import plan_cross_mesh, run_cross_mesh
from .exchange import run_exchange
from .plan import RedistributePlan, Step, after_step


@cached(PER_LAYOUT)
def _split_runs(length: int, placement: Shard, n: int) -> tuple[Segments, ...]:
    """Per coordinate of a mesh dim of size ``n``, the index runs of a tensor dim of
    ``length`` that it keeps under ``placement`` (geometry cached: splits repeat)."""
    return tuple(split_segments(((0, length),), placement, n, k) for k in range(n))


def _piece(t: torch.Tensor, dim: int, runs: Segments) -> torch.Tensor:
    """The part of ``t`` at the index runs ``runs`` of ``dim`` (a view unless several runs)."""
    if len(runs) == 1:
        start, stop = runs[0]
        return t if start == 0 and stop == t.shape[dim] else t.narrow(dim, start, stop - start)
    return torch.cat([t.narrow(dim, a, b - a) for a, b in runs], dim=dim)


def _split(t: torch.Tensor, placement: Shard, n: int) -> list[torch.Tensor]:
    """The ``n`` pieces of ``t`` that the coordinates of a mesh dim keep under ``placement``
    (``torch.chunk`` geometry as one ``split_with_sizes``, a third of a narrow per piece)."""
    dim = placement.dim
    length = t.shape[dim]
    if type(placement) is Shard:
        return list(t.split_with_sizes(chunk_sizes(length, n), dim))
    return [_piece(t, dim, runs) for runs in _split_runs(length, placement, n)]


def _merge_interleaved(pieces: Sequence[torch.Tensor], placement: InterleavedShard) -> torch.Tensor:
    """Inverse of ``_split`` for ``InterleavedShard``: the whole tensor from every coordinate's
    piece, each run of each piece put back at its place (uneven blocks and pieces included; for
    ``Shard`` it is a concatenation, which ``comm.all_gather_tensor`` does)."""
    dim = placement.dim
    length = sum(p.shape[dim] for p in pieces)
    placed = []
    for piece, runs in zip(pieces, _split_runs(length, placement, len(pieces)), strict=True):
        taken = 0
        for start, stop in runs:
            if stop > start:
                placed.append((start, piece.narrow(dim, taken, stop - start)))
                taken += stop - start
    if not placed:  # an empty dim
        return pieces[0]
    return torch.cat([part for _, part in sorted(placed, key=lambda item: item[0])], dim)


def _partition(t: torch.Tensor, placement: Partial, coordinate: int) -> torch.Tensor:
    """Replicate -> Partial without moving data: for sum and p-norms the first device keeps the
    value and the others hold zeros (exact for every dtype); avg, max and min keep the value
    everywhere."""
    if placement.zeros_elsewhere and coordinate != 0:
        return torch.zeros_like(t)
    return t


def _spread(t: torch.Tensor, dim: int, length: int, runs: Segments) -> torch.Tensor:
    """Shard -> Partial("sum") (or a p-norm) without moving data: the piece ``t`` at its index
    runs ``runs`` of a dim of ``length``, zeros around it (the sum over the mesh dim is the
    whole value, exact for every dtype: each element has one nonzero term)."""
    parts, pos, taken = [], 0, 0
    for start, stop in runs:
        if start > pos:
            parts.append(_zeros(t, dim, start - pos))
        parts.append(t.narrow(dim, taken, stop - start))
        taken, pos = taken + stop - start, max(pos, stop)
    if length > pos:
        parts.append(_zeros(t, dim, length - pos))
    return torch.cat(parts, dim) if len(parts) > 1 else parts[0]


def _zeros(t: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] = length
    return t.new_zeros(shape)


def _run_spread(
    step: Step, mesh: DeviceMesh, shape: tuple[int, ...], state: tuple,
    components: list[torch.Tensor],
) -> list[torch.Tensor]:
    """A local Shard -> Partial step: each device spreads its piece over the length of the
    tensor dim its mesh dim split (geometry of ``state`` with that mesh dim replicated)."""
    m, a = step.mesh_dim, step.source
    n = mesh.shape[m]
    whole = state[:m] + (Replicate(),) + state[m + 1 :]
    out = []
    for t, device in zip(components, mesh.local_device_ids, strict=True):
        coord = mesh.coordinate_of(device)
        length = segments_size(shard_segments(shape, mesh.shape, whole, coord)[a.dim])
        out.append(_spread(t, a.dim, length, _split_runs(length, a, n)[coord[m]]))
    return out


def _run_local(step: Step, mesh: DeviceMesh, components: list[torch.Tensor]) -> list[torch.Tensor]:
    """A step that moves no data: each device cuts its piece, or partitions a value."""
    m, b = step.mesh_dim, step.target
    n = mesh.shape[m]
    if n == 1:
        return components
    coords = [mesh.coordinate_of(d)[m] for d in mesh.local_device_ids]
    if isinstance(b, Partial):
        return [_partition(t, b, c) for t, c in zip(components, coords, strict=True)]
    return [
        _piece(t, b.dim, _split_runs(t.shape[b.dim], b, n)[c])
        for t, c in zip(components, coords, strict=True)
    ]


@cached(PER_SEGMENT)
def _component_shape(mesh: DeviceMesh, shape: tuple[int, ...], state: tuple, device: int
                     ) -> tuple[int, ...]:
    """The shape of ``device``'s component of a tensor of ``shape`` placed ``state``: what
    every process knows of every other's pieces without asking (the backend collectives'
    sizes)."""
    runs = shard_segments(shape, mesh.shape, state, mesh.coordinate_of(device))
    return tuple(segments_size(r) for r in runs)


def _run_step(step: Step, mesh: DeviceMesh, shape: tuple[int, ...], state: tuple,
              components: list[torch.Tensor]) -> list[torch.Tensor]:
    """One step on one mesh dim, by its collective."""
    m, a, b = step.mesh_dim, step.source, step.target
    kind = step.collective
    if kind == "local":
        return _run_local(step, mesh, components)
    shapes = partial(_component_shape, mesh, shape, state)
    if kind == "all_gather":
        if isinstance(a, InterleavedShard):
            return [_merge_interleaved(p, a) for p in comm.all_gather(mesh, m, components,
                                                                      shapes)]
        return comm.all_gather_tensor(mesh, m, components, a.dim, shapes)
    if kind == "all_reduce":
        return comm.all_reduce(mesh, m, components, a.reduce_op)
    n = mesh.shape[m]
    if kind == "reduce_scatter":
        return comm.reduce_scatter(mesh, m, [_split(t, b, n) for t in components], a.reduce_op)
    # all_to_all: Shard(d) -> Shard(e)
    return comm.all_to_all_tensor(mesh, m, components, b.dim, a.dim, shapes)


def _run_point_to_point(
    mesh: DeviceMesh, shape: tuple[int, ...], state: tuple, after: tuple,
    components: list[torch.Tensor],
) -> list[torch.Tensor]:
    """A "send/recv" step: the cross-mesh plan with ``mesh`` as its own target (its routes do
    not depend on the item size; the components' dtype is what travels)."""
    if not components:
        return components
    route = plan_cross_mesh(shape, components[0].element_size(), mesh, state, mesh, after)
    return run_cross_mesh(route, components, components[0].dtype)


def run_plan(
    plan: RedistributePlan, mesh: DeviceMesh, components: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """The plan's steps on this process's components (ordered like ``mesh.local_device_ids``),
    one after the other (``execute_plan``'s eager body)."""
    out = list(components)
    state = plan.source
    pending = plan.cast is not None and pending_sum(state)
    for step in plan.steps:
        after = after_step(state, step)
        if step.collective == "exchange":
            out = run_exchange(mesh, plan.shape, state, after, step.mesh_dim, out)
        elif step.collective == "send/recv":
            out = _run_point_to_point(mesh, plan.shape, state, after, out)
        elif (step.collective == "local" and isinstance(step.source, Shard)
              and isinstance(step.target, Partial) and mesh.shape[step.mesh_dim] > 1):
            out = _run_spread(step, mesh, plan.shape, state, out)
        else:
            out = _run_step(step, mesh, plan.shape, state, out)
        state = after
        if plan.cast is not None and pending_sum(state) != pending:
            # the half-precision sum got reduced (round once, move half the bytes from here
            # on) or started pending (hold float32 pieces): as the planner priced it
            out = [c.to(plan.cast) for c in out]
            pending = not pending
    return out


def local_splits(
    plan: RedistributePlan, spec: DTensorSpec
) -> Callable[[Sequence[torch.Tensor]], list[torch.Tensor]] | None:
    """``run_plan`` as a function of the components of a tensor of ``spec``, each device's cuts
    worked out once, when the plan only splits locally (Replicate -> Shard); else None."""
    mesh = spec.mesh
    if plan.cast is not None or not plan.steps or any(
        s.collective != "local" or not isinstance(s.target, Shard) for s in plan.steps
    ):
        return None
    shape = tuple(spec.shape)
    cuts = []
    for device in mesh.local_device_ids:
        coord = mesh.coordinate_of(device)
        sizes = [sum(b - a for a, b in runs) for runs in shard_segments(
            shape, mesh.shape, plan.source, coord
        )]
        device_cuts = []
        for step in plan.steps:  # as _run_local: split the component's current length
            n, dim = mesh.shape[step.mesh_dim], step.target.dim
            if n > 1:
                runs = _split_runs(sizes[dim], step.target, n)[coord[step.mesh_dim]]
                sizes[dim] = sum(b - a for a, b in runs)
                device_cuts.append((dim, runs))
        cuts.append(tuple(device_cuts))

    def run(components: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for t, device_cuts in zip(components, cuts, strict=True):
            for dim, runs in device_cuts:
                t = _piece(t, dim, runs)
            out.append(t)
        return out

    return run
