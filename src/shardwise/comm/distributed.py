"""The ``torch.distributed`` transport for mesh groups whose devices span processes, point to
point: the groups where a process owns several devices of one group, the exchanges and
scatters. Groups with one device per process use the backend's own collectives instead
(``native.py``; both run a collective as a ``call.Call``: its process groups, rounds and
error handling). Every collective of either starts with the agreement (``agreement.py``), so a
process here and its peer in a backend collective meet in one message; this transport's first
round is then its header (``protocol.py``), with the sizes each process sends.

Each collective here is built from point-to-point messages, at most one message per peer
process and round, so a process receives only what its devices need: the pieces of other
processes' devices for all_gather and all_to_all, the source once for broadcast. Reductions run
in coordinate order on the process that owns the result (the first process of a group
pre-reduces its leading members), so every mode gives the same bits as the embedded one, and
all_reduce is that reduce_scatter of the ring chunks followed by an all_gather of the reduced
chunks. Process groups are made per set of processes that share a device group, once, in mesh
order."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..errors import CollectiveMismatchError
from ..mesh import DeviceMesh
from ..runtime import group_for_ranks
from . import protocol
from .call import Call, Group, Traffic, first_local
from .reduction import accumulation_dtype, combine, finish


def _local_members(group: Group) -> list[tuple[int, int]]:
    """(coordinate, local index) of the group members this process owns."""
    return [(k, i) for k, i in enumerate(group[1]) if i is not None]


def _members_of(call: Call, members: tuple[int, ...], rank: int) -> list[int]:
    return [k for k, d in enumerate(members) if call.owner(d) == rank]


def _gather_shapes(
    call: Call, groups: Sequence[Group], components: Sequence[torch.Tensor]
) -> dict[tuple[tuple[int, ...], int], list[list[int]]]:
    """The first round of an all_gather: the shapes of every peer's pieces, per (group, peer)."""
    call.check(lambda group: {"ndim": components[0].ndim})
    headers = call.round(meta=True)
    keys = []
    for members, indices in groups:
        mine = [list(components[i].shape) for _, i in _local_members((members, indices))]
        for peer in call.peers(members):
            headers.send(call.ranks[members], peer, torch.tensor(mine, dtype=torch.int64))
            count = len(_members_of(call, members, peer))
            headers.expect(call.ranks[members], peer, (count, components[0].ndim), torch.int64)
            keys.append((members, peer))
    return {key: shapes.tolist() for key, shapes in zip(keys, headers.run(), strict=True)}


def all_gather(
    mesh: DeviceMesh, mesh_dim: int, groups: Sequence[Group], components: Sequence[torch.Tensor]
) -> tuple[dict[int, list[torch.Tensor]], Traffic]:
    """Every member's piece for every local device: other processes send their pieces once."""
    sample = components[0]
    call = Call("all_gather", mesh, mesh_dim, groups, sample)
    shapes = _gather_shapes(call, groups, components)
    data = call.round()
    for members, indices in groups:
        for peer in call.peers(members):
            for _, i in _local_members((members, indices)):
                data.send(call.ranks[members], peer, components[i])
            for shape in shapes[(members, peer)]:
                data.expect(call.ranks[members], peer, shape, sample.dtype)
    received = iter(data.run())
    out: dict[int, list[torch.Tensor]] = {}
    for members, indices in groups:
        from_peer = {
            peer: {k: next(received) for k in _members_of(call, members, peer)}
            for peer in call.peers(members)
        }
        pieces = [
            components[i] if i is not None else from_peer[call.owner(d)][k]
            for k, (d, i) in enumerate(zip(members, indices, strict=True))
        ]
        for k, i in _local_members((members, indices)):
            out[i] = [p.to(mesh.device_of(members[k])) for p in pieces]
    return out, call.traffic


def all_gather_tensor(
    mesh: DeviceMesh, mesh_dim: int, groups: Sequence[Group], components: Sequence[torch.Tensor],
    gather_dim: int,
) -> tuple[dict[int, torch.Tensor], Traffic]:
    """``all_gather`` whose pieces are concatenated along ``gather_dim``: the result is
    allocated first and the peers' pieces are received straight into it when their slices are
    contiguous (gathering along dim 0), so no piece is copied after it arrived."""
    sample = components[0]
    call = Call("all_gather", mesh, mesh_dim, groups, sample)
    shapes = _gather_shapes(call, groups, components)
    data = call.round()
    wholes = []
    for members, indices in groups:
        local = _local_members((members, indices))
        sizes: list[list[int]] = [[] for _ in members]
        for k, i in local:
            sizes[k] = list(components[i].shape)
        for peer in call.peers(members):
            for k, shape in zip(_members_of(call, members, peer), shapes[(members, peer)],
                                strict=True):
                sizes[k] = shape
        first = components[local[0][1]]
        shape = list(first.shape)
        for k, size in enumerate(sizes):
            if size[:gather_dim] + size[gather_dim + 1:] != shape[:gather_dim] + shape[
                    gather_dim + 1:]:
                raise CollectiveMismatchError(
                    f"{call.what()}: member {k} of device group {list(members)} holds a piece "
                    f"of shape {size}, which does not concatenate along dim {gather_dim} with "
                    f"the local piece of shape {shape}"
                )
        shape[gather_dim] = sum(size[gather_dim] for size in sizes)
        whole = torch.empty(shape, dtype=sample.dtype, device=first.device)
        parts, offset = [], 0
        for size in sizes:
            parts.append(whole.narrow(gather_dim, offset, size[gather_dim]))
            offset += size[gather_dim]
        for peer in call.peers(members):
            for _, i in local:
                data.send(call.ranks[members], peer, components[i])
            for k in _members_of(call, members, peer):
                data.expect(call.ranks[members], peer, sizes[k], sample.dtype, into=parts[k])
        for k, i in local:
            parts[k].copy_(components[i])
        wholes.append(whole)
    data.run()
    out: dict[int, torch.Tensor] = {}
    for (members, indices), whole in zip(groups, wholes, strict=True):
        for m, (k, i) in enumerate(_local_members((members, indices))):
            out[i] = (whole if m == 0 else whole.clone()).to(mesh.device_of(members[k]))
    return out, call.traffic


def all_to_all(
    mesh: DeviceMesh,
    mesh_dim: int,
    groups: Sequence[Group],
    pieces: Sequence[Sequence[torch.Tensor]],
) -> tuple[dict[int, list[torch.Tensor]], Traffic]:
    """``pieces[i][k]`` goes from local device i to member k; each process receives only the
    pieces addressed to its devices."""
    sample = pieces[0][0]
    call = Call("all_to_all", mesh, mesh_dim, groups, sample)
    call.check(lambda group: {"ndim": sample.ndim})
    headers = call.round(meta=True)
    for members, indices in groups:
        local = _local_members((members, indices))
        for peer in call.peers(members):
            theirs = _members_of(call, members, peer)
            shapes = [list(pieces[i][k].shape) for _, i in local for k in theirs]
            headers.send(call.ranks[members], peer, torch.tensor(shapes, dtype=torch.int64))
            count = len(theirs) * len(local)
            headers.expect(call.ranks[members], peer, (count, sample.ndim), torch.int64)
    shapes = iter(headers.run())
    data = call.round()
    for members, indices in groups:
        local = _local_members((members, indices))
        for peer in call.peers(members):
            for _, i in local:
                for k in _members_of(call, members, peer):
                    data.send(call.ranks[members], peer, pieces[i][k])
            for shape in next(shapes).tolist():
                data.expect(call.ranks[members], peer, shape, sample.dtype)
    received = iter(data.run())
    out: dict[int, list[torch.Tensor]] = {}
    for members, indices in groups:
        local = _local_members((members, indices))
        incoming: dict[tuple[int, int], torch.Tensor] = {}  # (from j, to k)
        for peer in call.peers(members):
            for j in _members_of(call, members, peer):
                for k, _ in local:
                    incoming[(j, k)] = next(received)
        for k, i in local:
            row = [
                pieces[indices[j]][k] if indices[j] is not None else incoming[(j, k)]
                for j in range(len(members))
            ]
            out[i] = [p.to(mesh.device_of(members[k])) for p in row]
    return out, call.traffic


def _reduce_to_owners(
    call: Call,
    contribution: Callable[[int, int], torch.Tensor],
    op: str,
) -> dict[tuple[tuple[int, ...], int], torch.Tensor]:
    """For every local member k, the reduction over members j, in coordinate order, of
    ``contribution(local index of j, k)``, unfinished (no avg division). The process owning
    the leading run of members sends their combined prefix; the others send each piece."""
    data = call.round()
    prefix_dtype = accumulation_dtype(call.sample.dtype, op)
    plans = []  # per group, what the loop below needs to read the tensors back in order
    for members, indices in call.groups:
        n = len(members)
        owners = [call.owner(d) for d in members]
        lead = owners[0]
        run = next((j for j in range(n) if owners[j] != lead), n)  # members 0..run-1: lead's
        lead_local = first_local((members, indices))
        for k in range(n):
            if owners[k] == call.me:
                continue
            ranks = call.ranks[members]
            if lead == call.me:
                data.send(ranks, owners[k], combine([contribution(indices[j], k)
                                                     for j in range(run)], op))
            for j in range(run, n):
                if owners[j] == call.me:
                    data.send(ranks, owners[k], contribution(indices[j], k))
        for k, _ in _local_members((members, indices)):
            shape = contribution(lead_local, k).shape
            for peer in call.peers(members):
                if peer == lead:  # a combined prefix, in the accumulation dtype
                    data.expect(call.ranks[members], peer, shape, prefix_dtype)
                for j in range(run, n):
                    if owners[j] == peer:
                        data.expect(call.ranks[members], peer, shape, call.sample.dtype)
        plans.append((members, indices, owners, lead, run))
    received = iter(data.run())
    results: dict[tuple[tuple[int, ...], int], torch.Tensor] = {}
    for members, indices, owners, lead, run in plans:
        for k, _ in _local_members((members, indices)):
            got: dict[int, torch.Tensor] = {}  # leading prefix under key -1
            for peer in call.peers(members):
                if peer == lead:
                    got[-1] = next(received)
                for j in range(run, len(members)):
                    if owners[j] == peer:
                        got[j] = next(received)
            if lead == call.me:
                prefix = combine([contribution(indices[j], k) for j in range(run)], op)
            else:
                prefix = got[-1]
            rest = [
                contribution(indices[j], k) if owners[j] == call.me else got[j]
                for j in range(run, len(members))
            ]
            results[(members, k)] = combine([prefix, *rest], op) if rest else prefix
    return results


def reduce_scatter(
    mesh: DeviceMesh,
    mesh_dim: int,
    groups: Sequence[Group],
    pieces: Sequence[Sequence[torch.Tensor]],
    op: str,
) -> tuple[dict[int, torch.Tensor], Traffic]:
    """Member k gets the reduction of ``pieces[.][k]`` over its group, in coordinate order."""
    sample = pieces[0][0]
    call = Call("reduce_scatter", mesh, mesh_dim, groups, sample, f"({op})",
                extra=protocol.OPS.index(op))
    call.check(lambda g: {"piece shapes": [list(p.shape) for p in pieces[first_local(g)]]})
    reduced = _reduce_to_owners(call, lambda i, k: pieces[i][k], op)
    out = {}
    for members, indices in groups:
        for k, i in _local_members((members, indices)):
            result = finish(reduced[(members, k)], op, len(members), sample.dtype)
            out[i] = result.to(mesh.device_of(members[k]))
    return out, call.traffic


def _chunk(flat: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Ring chunk ``k`` of ``n`` of a flat tensor (the accounting's all_reduce model)."""
    numel = flat.numel()
    size = -(-numel // n) if numel else 0
    return flat[min(k * size, numel) : min((k + 1) * size, numel)]


def all_reduce(
    mesh: DeviceMesh,
    mesh_dim: int,
    groups: Sequence[Group],
    components: Sequence[torch.Tensor],
    op: str,
) -> tuple[dict[int, torch.Tensor], Traffic]:
    """Reduce-scatter the ring chunks to their owners, then all-gather the reduced chunks."""
    sample = components[0]
    call = Call("all_reduce", mesh, mesh_dim, groups, sample, f"({op})",
                extra=protocol.OPS.index(op))
    call.check(lambda group: {"shape": list(components[first_local(group)].shape)})
    n = mesh.shape[mesh_dim]
    flat = [c.reshape(-1) for c in components]
    reduced = _reduce_to_owners(call, lambda i, k: _chunk(flat[i], n, k), op)
    reduced = {key: finish(acc, op, n, sample.dtype) for key, acc in reduced.items()}
    data = call.round()
    for members, indices in groups:
        mine = _local_members((members, indices))
        for peer in call.peers(members):
            for k, _ in mine:
                data.send(call.ranks[members], peer, reduced[(members, k)])
            for k in _members_of(call, members, peer):
                shape = _chunk(flat[first_local((members, indices))], n, k).shape
                data.expect(call.ranks[members], peer, shape, sample.dtype)
    received = iter(data.run())
    out = {}
    for members, indices in groups:
        chunks: dict[int, torch.Tensor] = {}
        for peer in call.peers(members):
            for k in _members_of(call, members, peer):
                chunks[k] = next(received)
        for k, _ in _local_members((members, indices)):
            chunks[k] = reduced[(members, k)]
        shape = components[first_local((members, indices))].shape
        whole = torch.cat([chunks[k] for k in range(n)]).reshape(shape)
        for m, (k, i) in enumerate(_local_members((members, indices))):
            result = whole if m == 0 else whole.clone()
            out[i] = result.to(mesh.device_of(members[k]))
    return out, call.traffic


def broadcast(
    mesh: DeviceMesh,
    mesh_dim: int,
    groups: Sequence[Group],
    components: Sequence[torch.Tensor],
    src: int,
) -> tuple[dict[int, torch.Tensor], Traffic]:
    """Every member gets member ``src``'s component; its process sends it once per process."""
    sample = components[0]
    call = Call("broadcast", mesh, mesh_dim, groups, sample, f"(src={src})", extra=src)
    call.check(lambda group: {"shape": list(components[first_local(group)].shape)})
    data = call.round()
    for members, indices in groups:
        source = call.owner(members[src])
        if source == call.me:
            for peer in call.peers(members):
                data.send(call.ranks[members], peer, components[indices[src]])
        else:
            shape = components[first_local((members, indices))].shape
            data.expect(call.ranks[members], source, shape, sample.dtype)
    received = iter(data.run())
    out = {}
    for members, indices in groups:
        if call.owner(members[src]) == call.me:
            value = components[indices[src]]
        else:
            value = next(received)
        for k, i in _local_members((members, indices)):
            out[i] = value if k == src else value.clone().to(mesh.device_of(members[k]))
    return out, call.traffic


def exchange(
    mesh: DeviceMesh,
    mesh_dims: tuple[int, ...],
    sends: Sequence[Sequence[tuple[int, torch.Tensor]]],
    receives: Sequence[Sequence[tuple[int, Sequence[int]]]],
    sample: torch.Tensor,
) -> tuple[dict[tuple[int, int], torch.Tensor], Traffic]:
    """The cross-process part of ``collectives.exchange``: one buffer per peer process with
    every tensor its devices send to that peer's devices, in (source, destination, order)
    order; returns {(local index, position in receives[i]): tensor}."""
    members = mesh.device_ids
    ranks = tuple(sorted({mesh.owner_of(d) for d in members}))
    groups, by_members = _whole_mesh(mesh)
    call = Call("exchange", mesh, mesh_dims, groups, sample, ranks=by_members)
    group_for_ranks(ranks)  # every process of the mesh takes part in creating its group
    local = mesh.local_device_ids
    data = call.round()
    outgoing = sorted(
        (d, dst, n, t)
        for i, d in enumerate(local)
        for n, (dst, t) in enumerate(sends[i])
        if call.owner(dst) != call.me
    )
    for _, dst, _, t in outgoing:
        data.send(ranks, call.owner(dst), t)
    incoming = sorted(
        (src, local[i], n, i, tuple(shape))
        for i in range(len(local))
        for n, (src, shape) in enumerate(receives[i])
        if call.owner(src) != call.me
    )
    for src, _, _, _, shape in incoming:
        data.expect(ranks, call.owner(src), shape, sample.dtype)
    received = data.run()
    out = {
        (i, n): t.to(mesh.device_of(local[i]))
        for (_, _, n, i, _), t in zip(incoming, received, strict=True)
    }
    return out, call.traffic


# ----- whole-mesh operations (distribute_tensor, random ops) ----------------------------------


def _whole_mesh(mesh: DeviceMesh) -> tuple[list[Group], dict[tuple[int, ...], tuple[int, ...]]]:
    """The whole mesh as one group over every process that owns a device of it."""
    members = mesh.device_ids
    local = {d: i for i, d in enumerate(mesh.local_device_ids)}
    ranks = tuple(sorted({mesh.owner_of(d) for d in members}))
    return [(members, tuple(local.get(d) for d in members))], {members: ranks}


def spans_processes(mesh: DeviceMesh) -> bool:
    """True if devices of ``mesh`` belong to other processes too."""
    return len(mesh.local_device_ids) < mesh.size()


def agree(mesh: DeviceMesh, what: str, fields: dict[str, object], sample: torch.Tensor) -> None:
    """Every process of ``mesh`` compares ``fields`` (JSON values) with the others' and raises
    ``CollectiveMismatchError`` on every rank, naming what differs per rank, if any does."""
    groups, ranks = _whole_mesh(mesh)
    call = Call("agree", mesh, None, groups, sample, f" ({what})", ranks=ranks)
    call.expect_same(lambda group: fields)
    call.round(meta=True).run()  # nothing but the headers, which carry the fingerprint


def scatter(
    mesh: DeviceMesh,
    src: int,
    pieces: Callable[[int], torch.Tensor] | None,
    local_shapes: Sequence[Sequence[int]],
    sample: torch.Tensor,
) -> tuple[list[torch.Tensor], Traffic]:
    """Process ``src`` sends every other process of ``mesh`` the pieces of its devices
    (``pieces(device id)``, called on ``src`` only); the others receive theirs, shaped
    ``local_shapes`` (one per local device, ascending id). Returns this process's pieces."""
    groups, ranks = _whole_mesh(mesh)
    call = Call("scatter", mesh, None, groups, sample, f"(src={src})", ranks=ranks)
    (members, _), = groups
    key = ranks[members]
    data = call.round()
    if call.me == src:
        for peer in call.peers(members):
            for d in sorted(members):
                if call.owner(d) == peer:
                    data.send(key, peer, pieces(d))
        data.run()
        return [pieces(d) for d in mesh.local_device_ids], call.traffic
    for shape in local_shapes:
        data.expect(key, src, shape, sample.dtype)
    return data.run(), call.traffic
