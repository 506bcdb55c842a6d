"""The exchange: several mesh dims change at once by point to point messages (``comm.exchange``,
an all_to_all of blocks), every device receiving exactly the blocks it lacks.

Each block of ``geometry.block_holders`` with one Partial term goes straight to the needers that
lack it. With several terms one needer (the root) reduces them in term order, the same in every
process, so the bits do not depend on the mode, and forwards the result to the other needers
in a second round. That is ``geometry.block_transfers`` per block: the exchange moves the fewest
bytes any schedule can.
"""

from __future__ import annotations

from types import MappingProxyType

import torch

from .. import comm
from ..caches import PER_GROUP, PER_LAYOUT, cached
from ..geometry import Placements, bits, block_holders, block_transfers, shard_segments
from ..mesh import DeviceMesh
from ..placements import Partial

# per device, the blocks of its new piece it fills in one round: where the block goes in the
# new piece, its shape, and the (device, where it is in that device's piece) it comes from: one
# per Partial term in term order in round one (reduced there), the root in round two
Route = tuple[tuple[tuple[slice, ...], tuple[int, ...], tuple[tuple[int, tuple[slice, ...]], ...]],
              ...]


def _root(index: tuple[int, ...], need: int, holds: list[int]) -> int | None:
    """The position of the needer that reduces a block's Partial terms (one holding a term
    where one does, spread over the blocks), None with one term."""
    if len(holds) == 1:
        return None
    held = 0
    for h in holds:
        held |= h
    candidates = bits(need & held) or bits(need)
    return candidates[sum(index) % len(candidates)]


@cached(PER_LAYOUT)
def exchange_cost(
    mesh: DeviceMesh, shape: tuple[int, ...], before: Placements, after: Placements
) -> tuple[tuple[int, ...], int]:
    """The elements each device (in ``mesh.device_ids`` order) receives in an exchange from
    ``before`` to the Partial-free ``after``, and the rounds it takes: per block with one term
    every needer lacking it receives it in round one; with several, the root receives what
    ``block_transfers`` leaves after the other needers' one copy each in round two."""
    received = [0] * mesh.size()
    rounds = 1
    for index, _, size, need, holds in block_holders(mesh, shape, before, after):
        root = _root(index, need, holds)
        if root is None:
            for i in bits(need & ~holds[0]):
                received[i] += size
            continue
        others = bits(need & ~(1 << root))
        held = size if any(h >> root & 1 for h in holds) else 0
        total = block_transfers(len(holds), len(others) + 1, size, 0, held)
        received[root] += total - len(others) * size
        for i in others:
            received[i] += size
            rounds = 2
    return tuple(received), rounds


def _local_slice(runs: tuple[tuple[int, int], ...], lo: int, hi: int) -> slice:
    """Where the global interval [lo, hi), inside one run of ``runs``, sits in the piece."""
    offset = 0
    for a, b in runs:
        if a <= lo and hi <= b:
            return slice(offset + lo - a, offset + hi - a)
        offset += b - a
    raise AssertionError(f"[{lo}, {hi}) is not inside one run of {runs}")


def _holder(mesh: DeviceMesh, coords: dict, hold: int, d: int) -> int:
    """The device a term held by the positions ``hold`` comes from for device ``d``: itself
    when it holds it, else a holder in its own process, else the nearest by mesh coordinate,
    then the lowest id."""
    devices = mesh.device_ids
    return min((devices[j] for j in bits(hold)), key=lambda h: (
        h != d,
        mesh.owner_of(h) != mesh.owner_of(d),
        sum(x != y for x, y in zip(coords[h], coords[d], strict=True)),
        h,
    ))


@cached(PER_GROUP)
def routes(
    mesh: DeviceMesh, shape: tuple[int, ...], before: Placements, after: Placements
) -> tuple[MappingProxyType[int, Route], MappingProxyType[int, Route]]:
    """Rounds one and two of an exchange (see ``exchange_cost``) for every device."""
    devices = mesh.device_ids
    coords = {d: mesh.coordinate_of(d) for d in devices}
    old = {d: shard_segments(shape, mesh.shape, before, coords[d]) for d in devices}
    new = {d: shard_segments(shape, mesh.shape, after, coords[d]) for d in devices}
    first: dict[int, list] = {d: [] for d in devices}
    second: dict[int, list] = {d: [] for d in devices}

    def where(held: tuple, block: tuple) -> tuple[slice, ...]:
        return tuple(_local_slice(r, a, b) for r, (a, b) in zip(held, block, strict=True))

    for index, box, _, need, holds in block_holders(mesh, shape, before, after):
        box_shape = tuple(b - a for a, b in box)
        root = _root(index, need, holds)
        for i in bits(need):
            d = devices[i]
            if root not in (None, i):
                second[d].append((where(new[d], box), box_shape,
                                  ((devices[root], where(new[devices[root]], box)),)))
                continue
            sources = []
            for hold in holds:
                holder = _holder(mesh, coords, hold, d)
                sources.append((holder, where(old[holder], box)))
            first[d].append((where(new[d], box), box_shape, tuple(sources)))
    return (MappingProxyType({d: tuple(r) for d, r in first.items()}),
            MappingProxyType({d: tuple(r) for d, r in second.items()}))


def _send_round(
    mesh: DeviceMesh,
    mesh_dims: tuple[int, ...],
    route: MappingProxyType[int, Route],
    held: list[torch.Tensor],
) -> list[list[torch.Tensor]]:
    """One round of an exchange: every source device sends its blocks of ``held`` (this
    process's pieces) that ``route`` asks for; returns what each local device receives, in
    route order."""
    local = mesh.local_device_ids
    index = {d: i for i, d in enumerate(local)}
    sends: list[list[tuple[int, torch.Tensor]]] = [[] for _ in local]
    receives: list[list[tuple[int, tuple[int, ...]]]] = [[] for _ in local]
    for d in mesh.device_ids:
        for _, block_shape, sources in route[d]:
            for holder, src in sources:
                if holder == d:
                    continue
                if holder in index:
                    sends[index[holder]].append((d, held[index[holder]][src]))
                if d in index:
                    receives[index[d]].append((holder, block_shape))
    return comm.exchange(mesh, mesh_dims, sends, receives, held[0].dtype)


def run_exchange(
    mesh: DeviceMesh,
    shape: tuple[int, ...],
    before: Placements,
    after: Placements,
    mesh_dims: tuple[int, ...],
    components: list[torch.Tensor],
) -> list[torch.Tensor]:
    """Every device assembles its new piece from the blocks it holds and the blocks other
    devices send it, point to point (it receives exactly what it lacks); pending Partial
    terms are reduced in term order at one root per block, which forwards the result in a
    second round."""
    first, second = routes(mesh, shape, before, after)
    ops = {
        p.reduce_op for m, p in enumerate(before) if isinstance(p, Partial) and mesh.shape[m] > 1
    }
    op = ops.pop() if ops else None  # the planner exchanges only Partials that reduce alike
    local = mesh.local_device_ids
    received = _send_round(mesh, mesh_dims, first, components)
    out = []
    for i, d in enumerate(local):
        runs = shard_segments(shape, mesh.shape, after, mesh.coordinate_of(d))
        piece = components[0].new_empty(tuple(sum(b - a for a, b in r) for r in runs))
        incoming = iter(received[i])
        for dst, _, sources in first[d]:
            terms = [components[i][src] if h == d else next(incoming) for h, src in sources]
            piece[dst] = terms[0] if len(terms) == 1 else comm.reduce_terms(terms, op)
        out.append(piece)
    if any(second[d] for d in mesh.device_ids):
        received = _send_round(mesh, mesh_dims, second, out)
        for i, d in enumerate(local):
            for (dst, _, _), block in zip(second[d], received[i], strict=True):
                out[i][dst] = block
    return out
