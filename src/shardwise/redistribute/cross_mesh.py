"""Cross-mesh redistribution: a tensor on one mesh to other placements on another mesh (another
device set, shape or size), by point to point messages through ``comm.exchange``.

A device is the same in both meshes when it is the same process's same local device
(``slot``), so a device of both receives only what its source piece lacked. Both meshes' devices
become one 1-D ``union`` mesh over their slots, the transport's ordinary exchange moves the
blocks, and every byte is counted as any exchange's. Blocks are ``geometry``'s, cut on both
layouts' run boundaries: with one Partial term a block goes straight from a holder to every
needer that lacks it; with several, one needer (the root, a term holder where one is) reduces
them in coordinate order and forwards the value in a second round. A target Partial that may
hold zeros elsewhere (sum, p-norms) needs the value on one member of each group only. That is
``cross_mesh_lower_bound_bytes`` per block, the fewest bytes any schedule can move.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache
from math import prod

import torch

from .. import comm
from ..errors import InvalidPlacementError, MeshError
from ..geometry import Placements, Segments, block_transfers, covers, pieces, spans
from ..mesh import DeviceMesh
from ..placements import Partial
from .exchange import _local_slice

Slot = tuple[int, int]  # (owning process, local device index): one physical device

# one block a target device fills: where it goes in its new piece, its shape, and where it
# comes from: (source device, where in its piece) per Partial term in term order (reduced
# there) in round one, or (root target device, where in its new piece) in round two
Fill = tuple[tuple[slice, ...], tuple[int, ...], tuple[tuple[int, tuple[slice, ...]], ...]]


def slot(mesh: DeviceMesh, device: int) -> Slot:
    """The physical device behind ``device`` of ``mesh``: its process and local index."""
    return mesh.owner_of(device), device % mesh._devices_per_process


def describe(mesh: DeviceMesh, placements: Placements) -> str:
    return f"{mesh} with placements {list(placements)}"


def check_meshes(
    shape: tuple[int, ...], source: DeviceMesh, before: Placements, target: DeviceMesh,
    after: Placements,
) -> None:
    """Raise a clear error for a cross-mesh move shardwise cannot make."""
    what = (f"moving a tensor of shape {list(shape)} from {describe(source, before)} to "
            f"{describe(target, after)}")
    if source.device_type != target.device_type:
        raise MeshError(
            f"{what}: the meshes have different device types ({source.device_type!r} and "
            f"{target.device_type!r}); move between meshes of one device type"
        )
    ops = {p.reduce_op for m, p in enumerate(before)
           if isinstance(p, Partial) and source.shape[m] > 1}
    if len(ops) > 1:
        raise InvalidPlacementError(
            f"{what}: the source's Partial placements reduce differently ({sorted(ops)}); "
            f"redistribute on the source mesh to one reduce op (or Replicate) first"
        )


def _terms(mesh: DeviceMesh, before: Placements) -> tuple[int, ...]:
    return tuple(m for m, p in enumerate(before) if p.is_partial() and mesh.shape[m] > 1)


def _sum_dims(mesh: DeviceMesh, after: Placements) -> tuple[int, ...]:
    return tuple(m for m, p in enumerate(after)
                 if isinstance(p, Partial) and p.zeros_elsewhere and mesh.shape[m] > 1)


def _blocks(
    shape: tuple[int, ...], old: tuple[tuple[Segments, ...], ...],
    new: tuple[tuple[Segments, ...], ...],
) -> list[tuple[tuple[int, ...], tuple[tuple[int, int], ...], int]]:
    """The non-empty blocks cut on every run boundary of both layouts: (index, box, size)."""
    intervals = spans(shape, [*old, *new])
    out = []
    for index in itertools.product(*(range(len(s)) for s in intervals)):
        box = tuple(s[k] for s, k in zip(intervals, index, strict=True))
        size = prod(b - a for a, b in box)
        if size:
            out.append((index, box, size))
    return out


def _needers(
    target: DeviceMesh, after: Placements, new: tuple, box: tuple, holding: set[Slot],
    index: tuple[int, ...],
) -> tuple[list[int], list[int]]:
    """The target positions that need ``box``'s value, and those that get zeros: one member of
    each target sum group (one physically holding a term where one does, spread over the
    blocks), every needer elsewhere."""
    devices = target.device_ids
    need = [j for j, s in enumerate(new) if covers(s, box)]
    summed = _sum_dims(target, after)
    if not summed:
        return need, []
    groups: dict[tuple[int, ...], list[int]] = {}
    for j in need:
        coord = target.coordinate_of(devices[j])
        groups.setdefault(tuple(c for m, c in enumerate(coord) if m not in summed), []).append(j)
    chosen = []
    for members in groups.values():
        holders = [j for j in members if slot(target, devices[j]) in holding] or members
        chosen.append(holders[sum(index) % len(holders)])
    return chosen, [j for j in need if j not in chosen]


def _holders_by_term(
    source: DeviceMesh, before: Placements, old: tuple, box: tuple
) -> list[list[int]]:
    """Per Partial term in coordinate order, the source positions holding ``box``."""
    partial = _terms(source, before)
    terms: dict[tuple[int, ...], list[int]] = {}
    for i, d in enumerate(source.device_ids):
        if covers(old[i], box):
            coord = source.coordinate_of(d)
            terms.setdefault(tuple(coord[m] for m in partial), []).append(i)
    return [terms[t] for t in sorted(terms)]


def cross_mesh_lower_bound_bytes(
    shape: tuple[int, ...], itemsize: int, source: DeviceMesh, before: Placements,
    target: DeviceMesh, after: Placements,
) -> int:
    """The fewest bytes all devices together must receive to move a tensor of ``shape`` from
    ``before`` on ``source`` to ``after`` on ``target``: per block ``block_transfers``, where a
    target device holds what the same physical device held in the source."""
    old = pieces(source, shape, before).segments
    new = pieces(target, shape, after).segments
    total = 0
    for index, box, size in _blocks(shape, old, new):
        terms = _holders_by_term(source, before, old, box)
        holding = {slot(source, source.device_ids[i]) for t in terms for i in t}
        needers, _ = _needers(target, after, new, box, holding, index)
        if not needers:
            continue
        held = [slot(target, target.device_ids[j]) in holding for j in needers]
        total += block_transfers(
            len(terms), len(needers), size, held.count(False) * size, size if any(held) else 0
        ) * itemsize
    return total


@dataclass(frozen=True)
class CrossMeshPlan:
    """A move between meshes: per target device its blocks (round one from the source
    devices, round two from a root), and what it costs. ``bytes`` is what this process's
    devices receive (what ``CommCounter`` counts), ``global_bytes`` what all devices receive,
    ``lower_bound`` the fewest bytes any plan can move (filled by ``explain_redistribute``)."""

    source_mesh: DeviceMesh
    source: Placements
    target_mesh: DeviceMesh
    target: Placements
    shape: tuple[int, ...]
    first: dict[int, tuple[Fill, ...]]
    second: dict[int, tuple[Fill, ...]]
    zeros: bool  # some target devices hold zeros for some blocks
    received: dict[int, int]  # elements each target device receives
    lower_bound: int | None = None
    itemsize: int = 1

    @property
    def collective(self) -> str:
        return "send/recv"

    @property
    def rounds(self) -> int:
        return 2 if any(self.second.values()) else 1

    @property
    def global_bytes(self) -> int:
        return sum(self.received.values()) * self.itemsize

    @property
    def bytes(self) -> int:
        local = set(self.target_mesh.local_device_ids)
        return sum(n for d, n in self.received.items() if d in local) * self.itemsize

    def __repr__(self) -> str:
        bound = "" if self.lower_bound is None else f", lower_bound={self.lower_bound}"
        return (
            f"CrossMeshPlan({describe(self.source_mesh, self.source)} -> "
            f"{describe(self.target_mesh, self.target)}, shape {list(self.shape)}: "
            f"{self.collective} in {self.rounds} round(s), bytes={self.bytes}, "
            f"global_bytes={self.global_bytes}{bound})"
        )


def _pick(source: DeviceMesh, holders: list[int], near: Slot, spread: int) -> int:
    """The source device a term comes from for the target device at slot ``near``: itself
    when it holds the term, else one in its process, spread over the blocks."""
    devices = [source.device_ids[i] for i in holders]
    for d in devices:
        if slot(source, d) == near:
            return d
    same = [d for d in devices if source.owner_of(d) == near[0]] or devices
    return same[spread % len(same)]


@lru_cache(maxsize=1024)
def plan_cross_mesh(
    shape: tuple[int, ...], itemsize: int, source: DeviceMesh, before: Placements,
    target: DeviceMesh, after: Placements,
) -> CrossMeshPlan:
    """The blocks every target device fills and where each comes from (see the module)."""
    old = pieces(source, shape, before).segments
    new = pieces(target, shape, after).segments
    where_old = dict(zip(source.device_ids, old, strict=True))
    where_new = dict(zip(target.device_ids, new, strict=True))
    tdev = target.device_ids
    first: dict[int, list[Fill]] = {d: [] for d in tdev}
    second: dict[int, list[Fill]] = {d: [] for d in tdev}
    received = dict.fromkeys(tdev, 0)
    zeros = False

    def at(runs: tuple[Segments, ...], box: tuple) -> tuple[slice, ...]:
        return tuple(_local_slice(r, a, b) for r, (a, b) in zip(runs, box, strict=True))

    for index, box, size in _blocks(shape, old, new):
        terms = _holders_by_term(source, before, old, box)
        holding = {slot(source, source.device_ids[i]) for t in terms for i in t}
        needers, zeroed = _needers(target, after, new, box, holding, index)
        zeros = zeros or bool(zeroed)
        box_shape = tuple(b - a for a, b in box)
        spread = sum(index)
        if len(terms) == 1:
            for j in needers:
                d = tdev[j]
                src = _pick(source, terms[0], slot(target, d), spread + j)
                received[d] += 0 if slot(source, src) == slot(target, d) else size
                first[d].append((at(where_new[d], box), box_shape,
                                 ((src, at(where_old[src], box)),)))
            continue
        candidates = [j for j in needers if slot(target, tdev[j]) in holding] or needers
        root = tdev[candidates[spread % len(candidates)]]
        sources = []
        for holders in terms:
            src = _pick(source, holders, slot(target, root), spread)
            received[root] += 0 if slot(source, src) == slot(target, root) else size
            sources.append((src, at(where_old[src], box)))
        first[root].append((at(where_new[root], box), box_shape, tuple(sources)))
        for j in needers:
            d = tdev[j]
            if d != root:
                received[d] += size
                second[d].append((at(where_new[d], box), box_shape,
                                  ((root, at(where_new[root], box)),)))
    return CrossMeshPlan(
        source, before, target, after, shape,
        {d: tuple(f) for d, f in first.items()}, {d: tuple(f) for d, f in second.items()},
        zeros, received, itemsize=itemsize,
    )


@lru_cache(maxsize=256)
def union_mesh(source: DeviceMesh, target: DeviceMesh) -> tuple[DeviceMesh, dict, dict]:
    """One 1-D mesh over the physical devices of both meshes (ids: process * P + local index,
    P the most devices per process of either), and each mesh's device id to its union id."""
    per = max(source._devices_per_process, target._devices_per_process)

    def ids(mesh: DeviceMesh) -> dict[int, int]:
        return {d: o * per + k for d in mesh.device_ids for o, k in [slot(mesh, d)]}

    src, dst = ids(source), ids(target)
    union = DeviceMesh(
        source.device_type, sorted(set(src.values()) | set(dst.values())),
        _devices_per_process=per, _rank=source.get_rank(),
    )
    return union, src, dst


def _send(
    union: DeviceMesh, held: dict[int, torch.Tensor], route: dict[int, tuple[Fill, ...]],
    src_ids: dict[int, int], dst_ids: dict[int, int], dtype: torch.dtype,
) -> dict[int, list[torch.Tensor]]:
    """One round: every block ``route`` asks for from another physical device travels through
    ``comm.exchange`` over the union mesh; returns, per local target device, what it received
    in route order. ``held`` maps a sender (by its id in the sending mesh) to its piece."""
    local = union.local_device_ids
    index = {u: i for i, u in enumerate(local)}
    sends: list[list] = [[] for _ in local]
    receives: list[list] = [[] for _ in local]
    for d, fills in route.items():
        for _, block_shape, sources in fills:
            for sender, where in sources:
                u, v = src_ids[sender], dst_ids[d]
                if u == v:
                    continue
                if u in index:
                    sends[index[u]].append((v, held[sender][where]))
                if v in index:
                    receives[index[v]].append((u, block_shape))
    got = comm.exchange(union, (0,), sends, receives, dtype)
    return {d: got[index[v]] for d, v in dst_ids.items() if v in index}


def run_cross_mesh(plan: CrossMeshPlan, components: list[torch.Tensor], dtype: torch.dtype
                   ) -> list[torch.Tensor]:
    """This process's target pieces (ascending device id) from its source ``components``
    (ascending device id): the plan's blocks sent point to point, Partial terms reduced in
    coordinate order at each block's root."""
    source, target = plan.source_mesh, plan.target_mesh
    union, src_ids, dst_ids = union_mesh(source, target)
    if not union.local_device_ids:
        return []
    by_slot = {src_ids[d]: c for d, c in zip(source.local_device_ids, components, strict=True)}
    held = {d: by_slot[src_ids[d]] for d in source.local_device_ids}
    ops = {p.reduce_op for m, p in enumerate(plan.source)
           if isinstance(p, Partial) and source.shape[m] > 1}
    op = ops.pop() if ops else None
    received = _send(union, held, plan.first, src_ids, dst_ids, dtype)
    out: dict[int, torch.Tensor] = {}
    for d in target.local_device_ids:
        runs = pieces(target, plan.shape, plan.target).segments[target.device_ids.index(d)]
        piece_shape = tuple(sum(b - a for a, b in r) for r in runs)
        make = torch.zeros if plan.zeros else torch.empty
        piece = make(piece_shape, dtype=dtype, device=target.device_of(d))
        incoming = iter(received[d])
        for dst, _, sources in plan.first[d]:
            terms = [
                held[s][where] if src_ids[s] == dst_ids[d] else next(incoming)
                for s, where in sources
            ]
            piece[dst] = terms[0] if len(terms) == 1 else comm.reduce_terms(terms, op)
        out[d] = piece
    if any(plan.second.values()):
        received = _send(union, out, plan.second, dst_ids, dst_ids, dtype)
        for d in target.local_device_ids:
            for (dst, _, _), block in zip(plan.second[d], received[d], strict=True):
                out[d][dst] = block
    return [out[d] for d in target.local_device_ids]
