"""Collectives over one mesh dim on a list of local components (one per local device).

Every function takes ``components`` (or ``pieces``) ordered like ``mesh.local_device_ids`` and
returns results in the same order. A group whose devices are all in this process runs in-process,
one that spans processes goes through ``torch.distributed`` (``distributed.py``). Every
collective reports the bytes its devices receive under the ring model (the planner's prices, the
same whatever the transport) and the bytes that really crossed processes to the active
``CommCounter``s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import runtime
from ..caches import PER_LAYOUT, cached
from ..geometry import chunk_sizes
from ..mesh import DeviceMesh
from . import accounting, background, distributed, native, transport
from .call import Traffic
from .reduction import norm_terms, reduce_terms
from .safety import one_thread


@cached(PER_LAYOUT)
def local_groups(mesh: DeviceMesh, mesh_dim: int) -> tuple[tuple[tuple[int, ...], tuple], ...]:
    """Groups along ``mesh_dim`` that hold a local device: (member ids, local index or None)."""
    local_index = {d: i for i, d in enumerate(mesh.local_device_ids)}
    groups: dict[tuple[int, ...], tuple] = {}
    for device in mesh.local_device_ids:
        group = mesh.group_of(device, mesh_dim)
        groups.setdefault(group, tuple(local_index.get(m) for m in group))
    return tuple(groups.items())


@cached(PER_LAYOUT)
def _split_groups(mesh: DeviceMesh, mesh_dim: int) -> tuple[tuple, tuple]:
    """(groups all in this process, groups that span processes) along ``mesh_dim``."""
    inside, across = [], []
    for members, indices in local_groups(mesh, mesh_dim):
        (across if any(i is None for i in indices) else inside).append((members, indices))
    return tuple(inside), tuple(across)


def _to(t: torch.Tensor, mesh: DeviceMesh, device_id: int) -> torch.Tensor:
    return t.to(mesh.device_of(device_id))


def _across(
    out: list,
    collective: str,
    mesh: DeviceMesh,
    mesh_dim: int,
    groups: list,
    run: Callable[[transport.GroupTransport], transport.Result],
) -> Traffic:
    """``run`` the cross-process ``groups`` of ``collective`` on the transport of the mesh
    dim (``transport.for_dim``: the backend's own collectives where the groups have one
    device per process, else point to point); store its results."""
    if not groups:
        return Traffic()
    background.drain()  # background collectives first: every process keeps the same order
    with one_thread(lambda: f"{collective} over mesh dim {mesh_dim} of {mesh}"):
        results, traffic = run(transport.for_dim(mesh, mesh_dim))
    for i, result in results.items():
        out[i] = result
    return traffic


def _record(
    kind: str, mesh_dim: int, received: int, traffic: Traffic, mesh: DeviceMesh
) -> None:
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
    inside, across = _split_groups(mesh, mesh_dim)
    for members, indices in inside:
        result = reduce_terms([components[i] for i in indices], op)
        for k, i in enumerate(indices):
            out[i] = _to(result if k == 0 else result.clone(), mesh, members[k])
    traffic = _across(out, "all_reduce", mesh, mesh_dim, across, lambda t: t.all_reduce(
        mesh, mesh_dim, across, components, op))
    received = sum(
        accounting.all_reduce_received(
            components[i].numel(), components[i].element_size(), len(members), k
        )
        for members, indices in inside + across
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
    inside, across = _split_groups(mesh, mesh_dim)
    for members, indices in inside:
        pieces = [components[i] for i in indices]
        for k, i in enumerate(indices):
            out[i] = [_to(p, mesh, members[k]) for p in pieces]
    traffic = _across(out, "all_gather", mesh, mesh_dim, across, lambda t: t.all_gather(
        mesh, mesh_dim, across, components, shapes))
    received = _per_piece_received(inside + across, out, accounting.all_gather_received)
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
    inside, across = _split_groups(mesh, mesh_dim)
    for members, indices in inside:
        for k, i in enumerate(indices):
            out[i] = torch.cat([_to(components[j], mesh, members[k]) for j in indices],
                               gather_dim)
    traffic = _across(out, "all_gather_tensor", mesh, mesh_dim, across, lambda t: (
        t.all_gather_tensor(mesh, mesh_dim, across, components, gather_dim, shapes,
                            not async_op)))

    def finish() -> list[torch.Tensor]:
        done = [o.finish() if isinstance(o, native.Pending) else o for o in out]
        received = sum(
            _nbytes(done[i]) - _nbytes(components[i])  # accounting.all_gather_received
            for _, indices in inside + across
            for i in indices
            if i is not None
        )
        _record("all_gather", mesh_dim, received, traffic, mesh)
        return done

    return native.Pending(finish) if async_op else finish()


def reduce_scatter(
    mesh: DeviceMesh, mesh_dim: int, pieces: Sequence[Sequence[torch.Tensor]], op: str = "sum"
) -> list[torch.Tensor]:
    """``pieces[i][k]`` is local device i's contribution to group member k; member k gets the
    reduction of what every member addressed to it (a p-norm as in ``all_reduce``)."""
    norm = norm_terms(op)
    if norm is not None:
        base, before, after = norm
        reduced = reduce_scatter(mesh, mesh_dim, [[before(t) for t in p] for p in pieces], base)
        return [after(r, p[0].dtype) for r, p in zip(reduced, pieces, strict=True)]
    out: list[torch.Tensor] = [torch.empty(0)] * len(pieces)
    inside, across = _split_groups(mesh, mesh_dim)
    for members, indices in inside:
        for k, i in enumerate(indices):
            out[i] = _to(reduce_terms([pieces[j][k] for j in indices], op), mesh, members[k])
    traffic = _across(out, "reduce_scatter", mesh, mesh_dim, across, lambda t: t.reduce_scatter(
        mesh, mesh_dim, across, pieces, op))
    received = _per_piece_received(inside + across, pieces, accounting.reduce_scatter_received)
    _record("reduce_scatter", mesh_dim, received, traffic, mesh)
    return out


def all_to_all(
    mesh: DeviceMesh, mesh_dim: int, pieces: Sequence[Sequence[torch.Tensor]]
) -> list[list[torch.Tensor]]:
    """``pieces[i][k]`` goes from local device i to group member k; the result ``out[i][j]`` is
    what member j sent to device i."""
    out: list[list[torch.Tensor]] = [[] for _ in pieces]
    inside, across = _split_groups(mesh, mesh_dim)
    for members, indices in inside:
        for k, i in enumerate(indices):
            out[i] = [_to(pieces[j][k], mesh, members[k]) for j in indices]
    traffic = _across(out, "all_to_all", mesh, mesh_dim, across, lambda t: t.all_to_all(
        mesh, mesh_dim, across, pieces, None))
    received = sum(
        accounting.all_to_all_received([_nbytes(p) for p in out[i]], k)
        for _, indices in inside + across
        for k, i in enumerate(indices)
        if i is not None
    )
    _record("all_to_all", mesh_dim, received, traffic, mesh)
    return out


@cached(PER_LAYOUT)
def _joinable_groups(mesh: DeviceMesh, mesh_dim: int) -> tuple[tuple, tuple]:
    """``_split_groups``, each group all in this process with the ``torch.device`` its
    members keep their components on, or None when they use several."""
    inside, across = _split_groups(mesh, mesh_dim)
    groups = []
    for members, indices in inside:
        devices = {mesh.device_of(d) for d in members}
        groups.append((members, indices, devices.pop() if len(devices) == 1 else None))
    return tuple(groups), across


_NO_TRAFFIC = Traffic()


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
    ``all_to_all`` of the chunks. A group held in this process on one torch device moves no
    pieces: its components are joined once and every member's piece cut out of that, dense
    (one copy for even chunks), instead of the n² pieces. The values, layouts and the bytes
    counted are those of the pieces' all_to_all. ``shapes`` (device id -> its component's
    shape, from the spec) sizes what other processes send where components differ along
    ``concat_dim``."""
    out: list = [None] * len(components)
    received = 0
    inside, across = _joinable_groups(mesh, mesh_dim)
    n = mesh.shape[mesh_dim]
    for members, indices, device in inside:
        if device is None:  # the pieces go to their devices
            pieces = [_chunks(components[j], split_dim, n) for j in indices]
            for k, i in enumerate(indices):
                out[i] = torch.cat([_to(p[k], mesh, members[k]) for p in pieces], concat_dim)
                received += accounting.all_to_all_received([_nbytes(p[k]) for p in pieces], k)
            continue
        whole = torch.cat([components[i] for i in indices], concat_dim).to(device)
        pieces = _dense_chunks(whole, split_dim, n)
        for i, piece in zip(indices, pieces, strict=True):
            out[i] = piece
        # each member receives its chunk of every other member's component
        # (all_to_all_received): with equal chunks, n - 1 chunks' worth in all
        total = whole.shape[concat_dim]
        if whole.shape[split_dim] % n == 0:
            received += pieces[0].nbytes * (n - 1)
        elif total:
            received += sum(p.nbytes // total * (total - components[i].shape[concat_dim])
                            for i, p in zip(indices, pieces, strict=True))
    traffic = _NO_TRAFFIC
    if across:
        lists: list = [[] for _ in components]
        local = mesh.local_device_ids

        def arriving(i: int) -> list[tuple[int, ...]]:
            """What every member of local device i's group sends it: its chunk along
            ``split_dim`` of that member's component."""
            mine = components[i]
            k = mesh.coordinate_of(local[i])[mesh_dim]
            size = chunk_sizes(mine.shape[split_dim], n)[k]
            out = []
            for member in mesh.group_of(local[i], mesh_dim):
                shape = list(mine.shape if shapes is None else shapes(member))
                shape[split_dim] = size
                out.append(tuple(shape))
            return out

        # dense chunks: even ones lie in order in one buffer, which the backend sends as it is
        chunks = [_dense_chunks(c, split_dim, n) for c in components]
        traffic = _across(lists, "all_to_all", mesh, mesh_dim, across, lambda t: t.all_to_all(
            mesh, mesh_dim, across, chunks, arriving))
        for _, indices in across:
            for k, i in enumerate(indices):
                if i is not None:
                    out[i] = native.join(lists[i], concat_dim)
                    received += accounting.all_to_all_received([_nbytes(p) for p in lists[i]], k)
    _record("all_to_all", mesh_dim, received, traffic, mesh)
    return out


def _chunks(t: torch.Tensor, dim: int, n: int) -> tuple[torch.Tensor, ...]:
    """``t``'s ``n`` pieces along ``dim`` under ``torch.chunk`` geometry (views)."""
    return t.split_with_sizes(chunk_sizes(t.shape[dim], n), dim)


def _dense_chunks(t: torch.Tensor, dim: int, n: int) -> Sequence[torch.Tensor]:
    """``_chunks``, each contiguous as a joined piece would be (kernels such as oneDNN's read
    their inputs as dense, and LU factorizations follow the layout): even chunks in one copy
    into one buffer, uneven ones one copy each."""
    length = t.shape[dim]
    if length % n:
        return [p.contiguous() for p in _chunks(t, dim, n)]
    return t.unflatten(dim, (n, length // n)).movedim(dim, 0).contiguous().unbind(0)


def broadcast(
    mesh: DeviceMesh, mesh_dim: int, components: Sequence[torch.Tensor], src: int = 0
) -> list[torch.Tensor]:
    """Every device gets a copy of the component of the group member at coordinate ``src``."""
    out: list[torch.Tensor] = list(components)
    inside, across = _split_groups(mesh, mesh_dim)
    for members, indices in inside:
        source = components[indices[src]]
        for k, i in enumerate(indices):
            out[i] = source if k == src else _to(source.clone(), mesh, members[k])
    traffic = _across(out, "broadcast", mesh, mesh_dim, across, lambda t: t.broadcast(
        mesh, mesh_dim, across, components, src))
    received = sum(
        accounting.broadcast_received(_nbytes(out[i]), k, src)
        for _, indices in inside + across
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
        return [_to(piece(d), mesh, d) for d in local]
    with one_thread(f"scatter from process {src} over {mesh}"):
        pieces, traffic = distributed.scatter(mesh, src, piece, local_shapes, sample)
    received = 0 if runtime.rank_and_world()[0] == src else sum(_nbytes(p) for p in pieces)
    _record("scatter", -1, received, traffic, mesh)
    return [_to(p, mesh, d) for p, d in zip(pieces, local, strict=True)]


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
                row.append(_to(queues[(src, d)].pop(0), mesh, d))
            else:
                row.append(remote[(i, n)])
            received += _nbytes(row[-1])
        out.append(row)
    _record(kind, mesh_dims, received, traffic, mesh)
    return out
