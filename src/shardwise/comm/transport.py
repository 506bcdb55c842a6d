"""How the groups of one collective move their bytes: one interface, ``GroupTransport``, three
implementations, and ``Transports``, the table of an execution context that says which carries
each group of a mesh dim.

- ``IN_PROCESS``: the groups whose devices this process holds together (every group in
  embedded mode), combined in memory, in coordinate order.
- ``BACKEND``: the process group's own collectives (``native.py``), for a mesh dim whose
  groups have one device per process (classic SPMD, rank threads included: their groups are
  gloo groups between the threads).
- ``POINT_TO_POINT``: shardwise's point-to-point collectives (``distributed.py``), for groups
  with several devices in a process; their messages go through the execution context's
  transport (``execution.Transport``: the backend's ``isend``/``irecv``, or the rank threads'
  mailbox).

The context holds its ``Transports`` (``ExecutionContext.group_transports``; ``STANDARD`` for
one that declares none), chosen once when the context is made; ``routes(mesh, mesh_dim)``
asks it. Which kind each group is comes from the mesh's geometry alone, once per (mesh, mesh
dim), so every process picks the same cross-process transport. Each method returns the
results by local index and the ``Traffic`` received from other processes.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from .. import execution
from ..caches import PER_GROUP, cached
from ..geometry import chunk_sizes
from ..mesh import DeviceMesh
from . import background, distributed, native
from .call import Group, Traffic
from .reduction import reduce_terms
from .safety import one_thread

Result = tuple[dict[int, Any], Traffic]
ReceiveShapes = Callable[[int], Sequence[Sequence[int]]] | None


class GroupTransport(Protocol):
    """One collective over ``groups`` of one mesh dim (each a group holding a device of this
    process). ``shapes`` / ``receive_shapes``: the pieces' shapes from the spec, where a
    transport needs them; ``wait=False``: results may be ``native.Pending``."""

    name: str

    def all_reduce(self, mesh: DeviceMesh, mesh_dim: int, groups: Sequence[Group],
                   components: Sequence[torch.Tensor], op: str) -> Result: ...

    def all_gather(self, mesh: DeviceMesh, mesh_dim: int, groups: Sequence[Group],
                   components: Sequence[torch.Tensor], shapes: native.Shapes) -> Result: ...

    def all_gather_tensor(self, mesh: DeviceMesh, mesh_dim: int, groups: Sequence[Group],
                          components: Sequence[torch.Tensor], gather_dim: int,
                          shapes: native.Shapes, wait: bool) -> Result: ...

    def reduce_scatter(self, mesh: DeviceMesh, mesh_dim: int, groups: Sequence[Group],
                       pieces: Sequence[Sequence[torch.Tensor]], op: str,
                       wait: bool) -> Result: ...

    def all_to_all(self, mesh: DeviceMesh, mesh_dim: int, groups: Sequence[Group],
                   pieces: Sequence[Sequence[torch.Tensor]],
                   receive_shapes: ReceiveShapes) -> Result: ...

    def all_to_all_tensor(self, mesh: DeviceMesh, mesh_dim: int, groups: Sequence[Group],
                          components: Sequence[torch.Tensor], split_dim: int, concat_dim: int,
                          shapes: native.Shapes) -> Result: ...

    def broadcast(self, mesh: DeviceMesh, mesh_dim: int, groups: Sequence[Group],
                  components: Sequence[torch.Tensor], src: int) -> Result: ...


def on_device(t: torch.Tensor, mesh: DeviceMesh, device_id: int) -> torch.Tensor:
    """``t`` on the torch device that holds ``device_id``'s component."""
    return t.to(mesh.device_of(device_id))


def chunks(t: torch.Tensor, dim: int, n: int) -> tuple[torch.Tensor, ...]:
    """``t``'s ``n`` pieces along ``dim`` under ``torch.chunk`` geometry (views)."""
    return t.split_with_sizes(chunk_sizes(t.shape[dim], n), dim)


def _dense_chunks(t: torch.Tensor, dim: int, n: int) -> Sequence[torch.Tensor]:
    """``chunks``, each contiguous as a joined piece would be (kernels such as oneDNN's read
    their inputs as dense, and LU factorizations follow the layout): even chunks in one copy
    into one buffer, uneven ones one copy each."""
    length = t.shape[dim]
    if length % n:
        return [p.contiguous() for p in chunks(t, dim, n)]
    return t.unflatten(dim, (n, length // n)).movedim(dim, 0).contiguous().unbind(0)


@cached(PER_GROUP)
def _one_device(mesh: DeviceMesh, members: tuple[int, ...]) -> torch.device | None:
    """The ``torch.device`` every member of an in-process group keeps its component on, or
    None when they use several."""
    devices = {mesh.device_of(d) for d in members}
    return devices.pop() if len(devices) == 1 else None


_NO_TRAFFIC = Traffic()


class _InProcess:
    """The groups this process holds together: their components combined in memory (reductions
    in coordinate order, ``reduce_terms``); nothing crosses a process, so no traffic."""

    name = "in process"

    def all_reduce(self, mesh, mesh_dim, groups, components, op) -> Result:
        out = {}
        for members, indices in groups:
            result = reduce_terms([components[i] for i in indices], op)
            for k, i in enumerate(indices):
                out[i] = on_device(result if k == 0 else result.clone(), mesh, members[k])
        return out, _NO_TRAFFIC

    def all_gather(self, mesh, mesh_dim, groups, components, shapes) -> Result:
        out = {}
        for members, indices in groups:
            pieces = [components[i] for i in indices]
            for k, i in enumerate(indices):
                out[i] = [on_device(p, mesh, members[k]) for p in pieces]
        return out, _NO_TRAFFIC

    def all_gather_tensor(self, mesh, mesh_dim, groups, components, gather_dim, shapes,
                          wait) -> Result:
        out = {}
        for members, indices in groups:
            for k, i in enumerate(indices):
                out[i] = torch.cat([on_device(components[j], mesh, members[k]) for j in indices],
                                   gather_dim)
        return out, _NO_TRAFFIC

    def reduce_scatter(self, mesh, mesh_dim, groups, pieces, op, wait) -> Result:
        out = {}
        for members, indices in groups:
            for k, i in enumerate(indices):
                out[i] = on_device(reduce_terms([pieces[j][k] for j in indices], op), mesh,
                             members[k])
        return out, _NO_TRAFFIC

    def all_to_all(self, mesh, mesh_dim, groups, pieces, receive_shapes) -> Result:
        out = {}
        for members, indices in groups:
            for k, i in enumerate(indices):
                out[i] = [on_device(pieces[j][k], mesh, members[k]) for j in indices]
        return out, _NO_TRAFFIC

    def all_to_all_tensor(self, mesh, mesh_dim, groups, components, split_dim, concat_dim,
                          shapes) -> Result:
        """A group on one torch device moves no pieces: its components are joined once and
        every member's piece cut out of that, dense (one copy for even chunks), instead of
        the n² pieces; elsewhere the pieces go to their devices."""
        out = {}
        n = mesh.shape[mesh_dim]
        for members, indices in groups:
            device = _one_device(mesh, members)
            if device is None:
                pieces = [chunks(components[j], split_dim, n) for j in indices]
                for k, i in enumerate(indices):
                    out[i] = torch.cat([on_device(p[k], mesh, members[k]) for p in pieces],
                                       concat_dim)
                continue
            whole = torch.cat([components[i] for i in indices], concat_dim).to(device)
            for i, piece in zip(indices, _dense_chunks(whole, split_dim, n), strict=True):
                out[i] = piece
        return out, _NO_TRAFFIC

    def broadcast(self, mesh, mesh_dim, groups, components, src) -> Result:
        out = {}
        for members, indices in groups:
            source = components[indices[src]]
            for k, i in enumerate(indices):
                out[i] = source if k == src else on_device(source.clone(), mesh, members[k])
        return out, _NO_TRAFFIC


@contextmanager
def _across(collective: str, mesh: DeviceMesh, mesh_dim: int) -> Iterator[None]:
    """A collective across processes: background collectives first (every process keeps the
    same order), one thread of this process at a time."""
    background.drain()
    with one_thread(lambda: f"{collective} over mesh dim {mesh_dim} of {mesh}"):
        yield


def _all_to_all_chunks(transport: GroupTransport, mesh, mesh_dim, groups, components,
                       split_dim, concat_dim, shapes) -> Result:
    """``all_to_all_tensor`` across processes: the all_to_all of every component's dense
    chunks along ``split_dim`` (even ones lie in order in one buffer, which the backend sends
    as it is), joined along ``concat_dim``; what each member sends is sized from ``shapes``."""
    n = mesh.shape[mesh_dim]
    local = mesh.local_device_ids

    def arriving(i: int) -> list[tuple[int, ...]]:
        """What every member of local device i's group sends it: its chunk along
        ``split_dim`` of that member's component."""
        mine = components[i]
        size = chunk_sizes(mine.shape[split_dim], n)[mesh.coordinate_of(local[i])[mesh_dim]]
        out = []
        for member in mesh.group_of(local[i], mesh_dim):
            shape = list(mine.shape if shapes is None else shapes(member))
            shape[split_dim] = size
            out.append(tuple(shape))
        return out

    pieces = [_dense_chunks(c, split_dim, n) for c in components]
    lists, traffic = transport.all_to_all(mesh, mesh_dim, groups, pieces, arriving)
    return {i: native.join(got, concat_dim) for i, got in lists.items()}, traffic


class _Backend:
    """``native.py``: one functional collective of the process group per group."""

    name = "backend"

    def all_reduce(self, mesh, mesh_dim, groups, components, op) -> Result:
        with _across("all_reduce", mesh, mesh_dim):
            return native.all_reduce(mesh, mesh_dim, groups, components, op)

    def all_gather(self, mesh, mesh_dim, groups, components, shapes) -> Result:
        with _across("all_gather", mesh, mesh_dim):
            return native.all_gather(mesh, mesh_dim, groups, components, shapes)

    def all_gather_tensor(self, mesh, mesh_dim, groups, components, gather_dim, shapes,
                          wait) -> Result:
        with _across("all_gather_tensor", mesh, mesh_dim):
            return native.all_gather_tensor(mesh, mesh_dim, groups, components, gather_dim,
                                            shapes, wait)

    def reduce_scatter(self, mesh, mesh_dim, groups, pieces, op, wait) -> Result:
        with _across("reduce_scatter", mesh, mesh_dim):
            return native.reduce_scatter(mesh, mesh_dim, groups, pieces, op, wait)

    def all_to_all(self, mesh, mesh_dim, groups, pieces, receive_shapes) -> Result:
        with _across("all_to_all", mesh, mesh_dim):
            return native.all_to_all(mesh, mesh_dim, groups, pieces, receive_shapes)

    def all_to_all_tensor(self, mesh, mesh_dim, groups, components, split_dim, concat_dim,
                          shapes) -> Result:
        return _all_to_all_chunks(self, mesh, mesh_dim, groups, components, split_dim,
                                  concat_dim, shapes)

    def broadcast(self, mesh, mesh_dim, groups, components, src) -> Result:
        with _across("broadcast", mesh, mesh_dim):
            return native.broadcast(mesh, mesh_dim, groups, components, src)


class _PointToPoint:
    """``distributed.py``: messages between processes, whose headers carry the shapes (so the
    spec's are not needed); done when it returns."""

    name = "point to point"

    def all_reduce(self, mesh, mesh_dim, groups, components, op) -> Result:
        with _across("all_reduce", mesh, mesh_dim):
            return distributed.all_reduce(mesh, mesh_dim, groups, components, op)

    def all_gather(self, mesh, mesh_dim, groups, components, shapes) -> Result:
        with _across("all_gather", mesh, mesh_dim):
            return distributed.all_gather(mesh, mesh_dim, groups, components)

    def all_gather_tensor(self, mesh, mesh_dim, groups, components, gather_dim, shapes,
                          wait) -> Result:
        with _across("all_gather_tensor", mesh, mesh_dim):
            return distributed.all_gather_tensor(mesh, mesh_dim, groups, components,
                                                 gather_dim)

    def reduce_scatter(self, mesh, mesh_dim, groups, pieces, op, wait) -> Result:
        with _across("reduce_scatter", mesh, mesh_dim):
            return distributed.reduce_scatter(mesh, mesh_dim, groups, pieces, op)

    def all_to_all(self, mesh, mesh_dim, groups, pieces, receive_shapes) -> Result:
        with _across("all_to_all", mesh, mesh_dim):
            return distributed.all_to_all(mesh, mesh_dim, groups, pieces)

    def all_to_all_tensor(self, mesh, mesh_dim, groups, components, split_dim, concat_dim,
                          shapes) -> Result:
        return _all_to_all_chunks(self, mesh, mesh_dim, groups, components, split_dim,
                                  concat_dim, shapes)

    def broadcast(self, mesh, mesh_dim, groups, components, src) -> Result:
        with _across("broadcast", mesh, mesh_dim):
            return distributed.broadcast(mesh, mesh_dim, groups, components, src)


IN_PROCESS: GroupTransport = _InProcess()
BACKEND: GroupTransport = _Backend()
POINT_TO_POINT: GroupTransport = _PointToPoint()


@cached(PER_GROUP)
def local_groups(mesh: DeviceMesh, mesh_dim: int) -> tuple[tuple[tuple[int, ...], tuple], ...]:
    """Groups along ``mesh_dim`` that hold a local device: (member ids, local index or None)."""
    local_index = {d: i for i, d in enumerate(mesh.local_device_ids)}
    groups: dict[tuple[int, ...], tuple] = {}
    for device in mesh.local_device_ids:
        group = mesh.group_of(device, mesh_dim)
        groups.setdefault(group, tuple(local_index.get(m) for m in group))
    return tuple(groups.items())


class Kind(enum.Enum):
    """The kinds of group along a mesh dim, by how their bytes move."""

    IN_PROCESS = "in process"  # every member held by this process
    BACKEND = "backend"  # across processes, every group of the dim one device per process
    POINT_TO_POINT = "point to point"  # across processes, elsewhere


@cached(PER_GROUP)
def _kinds(mesh: DeviceMesh, mesh_dim: int) -> tuple[tuple[Kind, tuple[Group, ...]], ...]:
    """This process's groups along ``mesh_dim`` by kind, in-process ones first; the
    cross-process ones are ``BACKEND`` where every group of the dim has one device per process
    (``native.applies``, alike in every process), else ``POINT_TO_POINT``. Kinds with no group
    are left out."""
    inside = tuple(g for g in local_groups(mesh, mesh_dim) if None not in g[1])
    across = tuple(g for g in local_groups(mesh, mesh_dim) if None in g[1])
    kinds = [(Kind.IN_PROCESS, inside)] if inside else []
    if across:
        kinds.append((Kind.BACKEND if native.applies(mesh, mesh_dim) else Kind.POINT_TO_POINT,
                      across))
    return tuple(kinds)


Route = tuple[GroupTransport, tuple[Group, ...]]  # a transport and the groups it carries


@dataclasses.dataclass(frozen=True)
class Transports:
    """An execution context's group transports: what carries each ``Kind`` of group."""

    in_process: GroupTransport = IN_PROCESS
    backend: GroupTransport = BACKEND
    point_to_point: GroupTransport = POINT_TO_POINT

    def routes(self, mesh: DeviceMesh, mesh_dim: int) -> tuple[Route, ...]:
        """The groups of ``mesh_dim`` that hold a device of this process, each kind with the
        transport that carries it (in-process groups first); chosen once per (transports,
        mesh, mesh dim)."""
        return _routes(self, mesh, mesh_dim)


@cached(PER_GROUP)
def _routes(transports: Transports, mesh: DeviceMesh, mesh_dim: int) -> tuple[Route, ...]:
    carriers = {Kind.IN_PROCESS: transports.in_process, Kind.BACKEND: transports.backend,
                Kind.POINT_TO_POINT: transports.point_to_point}
    return tuple((carriers[kind], groups) for kind, groups in _kinds(mesh, mesh_dim))


STANDARD = Transports()


def routes(mesh: DeviceMesh, mesh_dim: int) -> tuple[Route, ...]:
    """``Transports.routes`` of this thread's execution context (``STANDARD`` where it
    declares none)."""
    return (execution.current().group_transports or STANDARD).routes(mesh, mesh_dim)
