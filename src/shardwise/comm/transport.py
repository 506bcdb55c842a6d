"""How the groups of one collective that span processes move their bytes: one interface,
``GroupTransport``, two implementations, and the one function that picks between them.

- ``BACKEND``: the process group's own collectives (``native.py``), for a mesh dim whose
  groups have one device per process (classic SPMD, rank threads included: their groups are
  gloo groups between the threads).
- ``POINT_TO_POINT``: shardwise's point-to-point collectives (``distributed.py``), for groups
  with several devices in a process; their messages go through the execution context's
  transport (``execution.Transport``: the backend's ``isend``/``irecv``, or the rank threads'
  mailbox), chosen once when the context is made.

``for_dim(mesh, mesh_dim)`` picks by the mesh's geometry alone, so every process picks the same.
Each method returns the results by local index and the ``Traffic`` received.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from ..mesh import DeviceMesh
from . import distributed, native
from .call import Group, Traffic

Result = tuple[dict[int, Any], Traffic]
ReceiveShapes = Callable[[int], Sequence[Sequence[int]]] | None


class GroupTransport(Protocol):
    """The cross-process half of each collective over one mesh dim (``collectives.py`` does
    the groups held in this process). ``shapes`` / ``receive_shapes``: the pieces' shapes
    from the spec, where a transport needs them; ``wait=False``: results may be
    ``native.Pending``."""

    name: str

    def all_reduce(self, mesh: DeviceMesh, mesh_dim: int, groups: Sequence[Group],
                   components: Sequence[torch.Tensor], op: str) -> Result: ...

    def all_gather(self, mesh: DeviceMesh, mesh_dim: int, groups: Sequence[Group],
                   components: Sequence[torch.Tensor], shapes: native.Shapes) -> Result: ...

    def all_gather_tensor(self, mesh: DeviceMesh, mesh_dim: int, groups: Sequence[Group],
                          components: Sequence[torch.Tensor], gather_dim: int,
                          shapes: native.Shapes, wait: bool) -> Result: ...

    def reduce_scatter(self, mesh: DeviceMesh, mesh_dim: int, groups: Sequence[Group],
                       pieces: Sequence[Sequence[torch.Tensor]], op: str) -> Result: ...

    def all_to_all(self, mesh: DeviceMesh, mesh_dim: int, groups: Sequence[Group],
                   pieces: Sequence[Sequence[torch.Tensor]],
                   receive_shapes: ReceiveShapes) -> Result: ...

    def broadcast(self, mesh: DeviceMesh, mesh_dim: int, groups: Sequence[Group],
                  components: Sequence[torch.Tensor], src: int) -> Result: ...


class _Backend:
    """``native.py``: one functional collective of the process group per group."""

    name = "backend"

    def all_reduce(self, mesh, mesh_dim, groups, components, op) -> Result:
        return native.all_reduce(mesh, mesh_dim, groups, components, op)

    def all_gather(self, mesh, mesh_dim, groups, components, shapes) -> Result:
        return native.all_gather(mesh, mesh_dim, groups, components, shapes)

    def all_gather_tensor(self, mesh, mesh_dim, groups, components, gather_dim, shapes,
                          wait) -> Result:
        return native.all_gather_tensor(mesh, mesh_dim, groups, components, gather_dim, shapes,
                                        wait)

    def reduce_scatter(self, mesh, mesh_dim, groups, pieces, op) -> Result:
        return native.reduce_scatter(mesh, mesh_dim, groups, pieces, op)

    def all_to_all(self, mesh, mesh_dim, groups, pieces, receive_shapes) -> Result:
        return native.all_to_all(mesh, mesh_dim, groups, pieces, receive_shapes)

    def broadcast(self, mesh, mesh_dim, groups, components, src) -> Result:
        return native.broadcast(mesh, mesh_dim, groups, components, src)


class _PointToPoint:
    """``distributed.py``: messages between processes, whose headers carry the shapes (so the
    spec's are not needed); done when it returns."""

    name = "point to point"

    def all_reduce(self, mesh, mesh_dim, groups, components, op) -> Result:
        return distributed.all_reduce(mesh, mesh_dim, groups, components, op)

    def all_gather(self, mesh, mesh_dim, groups, components, shapes) -> Result:
        return distributed.all_gather(mesh, mesh_dim, groups, components)

    def all_gather_tensor(self, mesh, mesh_dim, groups, components, gather_dim, shapes,
                          wait) -> Result:
        return distributed.all_gather_tensor(mesh, mesh_dim, groups, components, gather_dim)

    def reduce_scatter(self, mesh, mesh_dim, groups, pieces, op) -> Result:
        return distributed.reduce_scatter(mesh, mesh_dim, groups, pieces, op)

    def all_to_all(self, mesh, mesh_dim, groups, pieces, receive_shapes) -> Result:
        return distributed.all_to_all(mesh, mesh_dim, groups, pieces)

    def broadcast(self, mesh, mesh_dim, groups, components, src) -> Result:
        return distributed.broadcast(mesh, mesh_dim, groups, components, src)


BACKEND: GroupTransport = _Backend()
POINT_TO_POINT: GroupTransport = _PointToPoint()


def for_dim(mesh: DeviceMesh, mesh_dim: int) -> GroupTransport:
    """The transport of ``mesh_dim``'s cross-process groups: the backend's collectives where
    every group has one device per process (``native.applies``), else point to point."""
    return BACKEND if native.applies(mesh, mesh_dim) else POINT_TO_POINT
