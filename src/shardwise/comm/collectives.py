"""Collectives over one mesh dim on a list of local components (one per local device).

Every function takes ``components`` (or ``pieces``) ordered like ``mesh.local_device_ids`` and
returns results in the same order. Each is the same three steps: the groups along the mesh dim
that hold a local device, split by kind, each kind run on the transport this thread's execution
context has for it (``transport.routes``: in process, the backend's collectives, or point to
point), and the record: the bytes its devices receive under the ring model (the planner's
prices, the same whatever the transport) and the bytes that really crossed processes, to the
active ``CommCounter``s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import runtime
from ..mesh import DeviceMesh
from . import accounting, background, distributed, native, transport
from .call import Group, Traffic
from .reduction import norm_terms
from .safety import one_thread


def _run(
    out: list, mesh: DeviceMesh, mesh_dim: int,
    run: Callable[[transport.GroupTransport, tuple[Group, ...]], transport.Result],
) -> tuple[tuple[Group, ...], Traffic]:
    """``run`` each kind of group of ``mesh_dim`` on the transport this thread's execution
    context has for it (``transport.routes``); store the results in ``out``. Returns every
    group that holds a local device and the traffic received from other processes."""
    groups: tuple[Group, ...] = ()
    traffic = Traffic()
    for carrier, carried in transport.routes(mesh, mesh_dim):
        results, received = run(carrier, carried)
        for i, result in results.items():
            out[i] = result
        groups += carried
        traffic.payload += received.payload
        traffic.meta += received.meta
    return groups, traffic


def _record(
    kind: str, mesh_dim: int | tuple[int, ...], received: int, traffic: Traffic,
    mesh: DeviceMesh,
) -> None:
    """Count the collective (``mesh_dim`` -1: over the whole mesh), unless its groups have one
    member: nothing moves, and PyTorch issues none there (FSDP2 on a world of one)."""
    dims = tuple(range(mesh.ndim)) if mesh_dim == -1 else (
        mesh_dim if isinstance(mesh_dim, tuple) else (mesh_dim,))
    if all(mesh.shape[d] == 1 for d in dims):
        return
    accounting.record(
        kind, mesh_dim, received, cross_process_bytes=traffic.payload, meta_bytes=traffic.meta,
        mesh=mesh,
    )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _per_piece_received(
    groups: Sequence, pieces: Sequence[Sequence[torch.Tensor]], formula: Callable
) -> int:
    """Bytes this process's members receive when ``formula(piece sizes, k)`` prices member k
    and every member's list of per-member pieces has the same sizes (``pieces[i]``: local
    device i's list)."""
    received = 0
    for _, indices in groups:
        sizes = [_nbytes(p) for p in pieces[next(i for i in indices if i is not None)]]
        received += sum(formula(sizes, k) for k, i in enumerate(indices) if i is not None)
    return received


def all_reduce(
    mesh: DeviceMesh, mesh_dim: int, components: Sequence[torch.Tensor], op: str = "sum"
) -> list[torch.Tensor]:
    """Every device gets the reduction (sum, avg, max, min, or a p-norm ``"norm<p>"``: a sum
    of powers between two transforms) of its group's components."""
    norm = norm_terms(op)
    if norm is not None:
        base, before, after = norm
        reduced = all_reduce(mesh, mesh_dim, [before(c) for c in components], base)
        return [after(r, c.dtype) for r, c in zip(reduced, components, strict=True)]
    out: list[torch.Tensor] = list(components)
    groups, traffic = _run(out, mesh, mesh_dim, lambda t, carried: t.all_reduce(
        mesh, mesh_dim, carried, components, op))
    received = sum(
        accounting.all_reduce_received(
            components[i].numel(), components[i].element_size(), len(members), k
        )
        for members, indices in groups
        for k, i in enumerate(indices)
        if i is not None
    )
    _record("all_reduce", mesh_dim, received, traffic, mesh)
    return out


def all_reduce_flat(
    mesh: DeviceMesh, mesh_dims: Sequence[int], values: Sequence[Sequence[torch.Tensor]],
    op: str = "sum",
) -> list[list[torch.Tensor]]:
    """``values[j][i]``: tensor j on local device i, all of one dtype. Each device's tensors
    copied into one fresh buffer, one ``all_reduce`` per mesh dim of ``mesh_dims``, and cut
    back: ``out[j][i]`` is a view of device i's reduced buffer shaped as ``values[j][i]`` (a
    gradient bucket: one collective for many tensors; nothing aliases ``values``)."""
    n_local = len(values[0])
    flats = [torch.cat([v[i].reshape(-1) for v in values]) for i in range(n_local)]
    for d in mesh_dims:
        flats = all_reduce(mesh, d, flats, op)
    out: list[list[torch.Tensor]] = [[] for _ in values]
    for i, flat in enumerate(flats):
        at = 0
        for j, v in enumerate(values):
            piece = v[i]
            out[j].append(flat[at : at + piece.numel()].view(piece.shape))
            at += piece.numel()
    return out


def all_gather(
    mesh: DeviceMesh, mesh_dim: int, components: Sequence[torch.Tensor],
    shapes: native.Shapes = None,
) -> list[list[torch.Tensor]]:
    """Every device gets the list of its group's components, in coordinate order
    (``shapes``: device id -> its component's shape, from the spec, where they differ)."""
    out: list[list[torch.Tensor]] = [[] for _ in components]
    groups, traffic = _run(out, mesh, mesh_dim, lambda t, carried: t.all_gather(
        mesh, mesh_dim, carried, components, shapes))
    received = _per_piece_received(groups, out, accounting.all_gather_received)
    _record("all_gather", mesh_dim, received, traffic, mesh)
    return out


def all_gather_tensor(
    mesh: DeviceMesh, mesh_dim: int, components: Sequence[torch.Tensor], gather_dim: int,
    shapes: native.Shapes = None, async_op: bool = False,
) -> list[torch.Tensor] | native.Pending[list[torch.Tensor]]:
    """Every device gets its group's components concatenated along ``gather_dim``, in
    coordinate order (``all_gather`` then ``torch.cat``, but pieces from other processes land
    in the result as they arrive: one copy fewer; ``shapes`` as in ``all_gather``).
    ``async_op``: a ``native.Pending`` whose ``finish()`` waits for the backend collectives
    issued here (in-process groups and the point-to-point transport are done at once); the
    collective is counted when finished."""
    out: list = [torch.empty(0)] * len(components)
    groups, traffic = _run(out, mesh, mesh_dim, lambda t, carried: t.all_gather_tensor(
        mesh, mesh_dim, carried, components, gather_dim, shapes, not async_op))

    def finish() -> list[torch.Tensor]:
        done = [o.finish() if isinstance(o, native.Pending) else o for o in out]
        received = sum(
            _nbytes(done[i]) - _nbytes(components[i])  # accounting.all_gather_received
            for _, indices in groups
            for i in indices
            if i is not None
        )
        _record("all_gather", mesh_dim, received, traffic, mesh)
        return done

    return native.Pending(finish) if async_op else finish()


def reduce_scatter(
    mesh: DeviceMesh, mesh_dim: int, pieces: Sequence[Sequence[torch.Tensor]], op: str = "sum",
    async_op: bool = False,
) -> list[torch.Tensor] | native.Pending[list[torch.Tensor]]:
    """``pieces[i][k]`` is local device i's contribution to group member k; member k gets the
    reduction of what every member addressed to it (a p-norm as in ``all_reduce``).
    ``async_op``: a ``native.Pending`` whose ``finish()`` waits for the backend collectives
    issued here (the other transports are done at once); counted when issued."""
    norm = norm_terms(op)
    if norm is not None:
        base, before, after = norm
        reduced = reduce_scatter(mesh, mesh_dim, [[before(t) for t in p] for p in pieces], base)
        done = [after(r, p[0].dtype) for r, p in zip(reduced, pieces, strict=True)]
        return native.Pending(lambda: done) if async_op else done
    out: list = [torch.empty(0)] * len(pieces)
    groups, traffic = _run(out, mesh, mesh_dim, lambda t, carried: t.reduce_scatter(
        mesh, mesh_dim, carried, pieces, op, not async_op))
    received = _per_piece_received(groups, pieces, accounting.reduce_scatter_received)
    _record("reduce_scatter", mesh_dim, received, traffic, mesh)
    if not async_op:
        return out
    return native.Pending(lambda: [o.finish() if isinstance(o, native.Pending) else o
                                   for o in out])


def all_to_all(
    mesh: DeviceMesh, mesh_dim: int, pieces: Sequence[Sequence[torch.Tensor]]
) -> list[list[torch.Tensor]]:
    """``pieces[i][k]`` goes from local device i to group member k; the result ``out[i][j]`` is
    what member j sent to device i."""
    out: list[list[torch.Tensor]] = [[] for _ in pieces]
    groups, traffic = _run(out, mesh, mesh_dim, lambda t, carried: t.all_to_all(
        mesh, mesh_dim, carried, pieces, None))
    received = sum(
        accounting.all_to_all_received([_nbytes(p) for p in out[i]], k)
        for _, indices in groups
        for k, i in enumerate(indices)
        if i is not None
    )
    _record("all_to_all", mesh_dim, received, traffic, mesh)
    return out


def all_to_all_tensor(
    mesh: DeviceMesh,
    mesh_dim: int,
    components: Sequence[torch.Tensor],
    split_dim: int,
    concat_dim: int,
    shapes: native.Shapes = None,
) -> list[torch.Tensor]:
    """Every device gets its piece along ``split_dim`` (``torch.chunk`` geometry over its
    group) of every member's component, joined along ``concat_dim`` in coordinate order: an
    ``all_to_all`` of the chunks (a group held in this process on one torch device joins its
    components once and cuts every member's piece out of that instead). The values, layouts
    and the bytes counted are those of the pieces' all_to_all. ``shapes`` (device id -> its
    component's shape, from the spec) sizes what other processes send where components
    differ along ``concat_dim``."""
    out: list = [None] * len(components)
    groups, traffic = _run(out, mesh, mesh_dim, lambda t, carried: t.all_to_all_tensor(
        mesh, mesh_dim, carried, components, split_dim, concat_dim, shapes))
    n = mesh.shape[mesh_dim]
    # each member receives its chunk of every other member's component (all_to_all_received)
    received = sum(
        _nbytes(out[i]) - _nbytes(transport.chunks(components[i], split_dim, n)[k])
        for _, indices in groups
        for k, i in enumerate(indices)
        if i is not None
    )
    _record("all_to_all", mesh_dim, received, traffic, mesh)
    return out


def broadcast(
    mesh: DeviceMesh, mesh_dim: int, components: Sequence[torch.Tensor], src: int = 0
) -> list[torch.Tensor]:
    """Every device gets a copy of the component of the group member at coordinate ``src``."""
    out: list[torch.Tensor] = list(components)
    groups, traffic = _run(out, mesh, mesh_dim, lambda t, carried: t.broadcast(
        mesh, mesh_dim, carried, components, src))
    received = sum(
        accounting.broadcast_received(_nbytes(out[i]), k, src)
        for _, indices in groups
        for k, i in enumerate(indices)
        if i is not None
    )
    _record("broadcast", mesh_dim, received, traffic, mesh)
    return out


def scatter_from(
    mesh: DeviceMesh,
    src: int,
    piece: Callable[[int], torch.Tensor],
    local_shapes: Sequence[Sequence[int]],
    sample: torch.Tensor,
) -> list[torch.Tensor]:
    """Each local device's piece of a value that process ``src`` holds: ``piece(device id)``
    there, sent to the other processes (``piece`` runs on ``src`` only; elsewhere the pieces
    arrive shaped ``local_shapes``). In one process nothing moves."""
    local = mesh.local_device_ids
    if not distributed.spans_processes(mesh):
        return [transport.on_device(piece(d), mesh, d) for d in local]
    with one_thread(f"scatter from process {src} over {mesh}"):
        pieces, traffic = distributed.scatter(mesh, src, piece, local_shapes, sample)
    received = 0 if runtime.rank_and_world()[0] == src else sum(_nbytes(p) for p in pieces)
    _record("scatter", -1, received, traffic, mesh)
    return [transport.on_device(p, mesh, d) for p, d in zip(pieces, local, strict=True)]


def agree(mesh: DeviceMesh, what: str, fields: dict[str, Any], sample: torch.Tensor) -> None:
    """Raise ``CollectiveMismatchError`` on every process of ``mesh`` if their ``fields`` (JSON
    values) differ; nothing to do in one process."""
    if distributed.spans_processes(mesh):
        with one_thread(f"agree ({what}) over {mesh}"):
            distributed.agree(mesh, what, fields, sample)


def exchange(
    mesh: DeviceMesh,
    mesh_dims: tuple[int, ...],
    sends: Sequence[Sequence[tuple[int, torch.Tensor]]],
    receives: Sequence[Sequence[tuple[int, Sequence[int]]]],
    dtype: torch.dtype,
    kind: str = "exchange",
) -> list[list[torch.Tensor]]:
    """Point-to-point messages between any devices of the mesh (a collective permute over
    ``mesh_dims``), counted as ``kind`` (a cross-mesh plan's are "send/recv"). ``sends[i]``
    lists (destination device, tensor) from local device i, ``receives[i]`` the (source
    device, shape) that local device i expects; messages between one pair of devices arrive in
    the order they were listed. Returns, per local device, the tensors received in
    ``receives`` order (all of ``dtype``). Every device of the mesh must take part."""
    local = mesh.local_device_ids
    index = {d: i for i, d in enumerate(local)}
    queues: dict[tuple[int, int], list[torch.Tensor]] = {}
    for i, d in enumerate(local):
        for dst, t in sends[i]:
            if dst in index:
                queues.setdefault((d, dst), []).append(t)
    traffic = Traffic()
    remote: dict[tuple[int, int], torch.Tensor] = {}
    if len(local) < mesh.size():
        sample = torch.empty(0, dtype=dtype, device=mesh.device_of(local[0]))
        background.drain()  # as in _across: every process keeps the same order
        with one_thread(f"exchange over {mesh}"):
            remote, traffic = distributed.exchange(mesh, mesh_dims, sends, receives, sample)
    out: list[list[torch.Tensor]] = []
    received = 0
    for i, d in enumerate(local):
        row = []
        for n, (src, _) in enumerate(receives[i]):
            if src in index:
                row.append(transport.on_device(queues[(src, d)].pop(0), mesh, d))
            else:
                row.append(remote[(i, n)])
            received += _nbytes(row[-1])
        out.append(row)
    _record(kind, mesh_dims, received, traffic, mesh)
    return out
