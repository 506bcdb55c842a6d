"""Cross-mesh redistribution: a tensor on one mesh to other placements on another mesh (another
device set, shape or size), by point to point messages through ``comm.exchange``.

A device is the same in both meshes when it is the same process's same local device
(``slot``), so a device of both receives only what its source piece lacked. Both meshes' devices
become one 1-D ``union`` mesh over their slots, the transport's ordinary exchange moves the
blocks, and every byte is counted as any exchange's. Blocks are ``geometry``'s, cut on both
layouts' run boundaries: with one Partial term a block goes straight from a holder to every
needer that lacks it; with several, one needer (the root, a term holder where one is) reduces
them in coordinate order and forwards the value in a second round. A target Partial that may
hold zeros elsewhere (sum, p-norms) needs the value on one member of each group only; from a
pending sum to a target sum a group may instead keep the terms spread over its members. Each
block takes the cheapest of these (``_options``): ``cross_mesh_lower_bound_bytes`` in all.

With the source mesh as its own target (an explicit redistribution's point to point plan, see
``plan.plan_redistribute``) the messages go through the exchange over that mesh itself, on the
mesh dims their senders' and receivers' coordinates differ in (``crossed_dims``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property
from math import prod

import torch

from .. import comm
from ..caches import PER_GROUP, PER_SEARCH, cached
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


def _keeps(source: DeviceMesh, before: Placements, target: DeviceMesh, after: Placements
           ) -> bool:
    """Whether pending terms may stay pending: the source's Partials and the target's are
    plain sums, so a target group may hold the terms spread over its members."""
    ops = {before[m].reduce_op for m in _terms(source, before)}
    summed = _sum_dims(target, after)
    return ops == {"sum"} and bool(summed) and all(after[m].reduce_op == "sum" for m in summed)


def _groups(target: DeviceMesh, after: Placements, new: tuple, box: tuple) -> list[list[int]]:
    """The target positions whose pieces cover ``box``, by the groups that need its value:
    one per target sum group (the value may sit on any member, zeros on the others), else
    every position alone."""
    devices = target.device_ids
    summed = _sum_dims(target, after)
    groups: dict[tuple[int, ...], list[int]] = {}
    for j, segments in enumerate(new):
        if covers(segments, box):
            coord = target.coordinate_of(devices[j])
            key = tuple(c for m, c in enumerate(coord) if m not in summed) if summed else (j,)
            groups.setdefault(key, []).append(j)
    return list(groups.values())


def _options(terms: int, held: list[set[int]], keeps: bool) -> tuple[int, int | None]:
    """The fewest transfers of one block (in block sizes), and the group whose member reduces
    the terms for the others (None when no group needs that). ``held[g]``: the terms members
    of group g physically hold. ``block_transfers``: a group lacking the one term receives it
    once; several terms are reduced at one root, which hands the value on. Where ``keeps``
    (sum to sum), a group holding every term may keep them pending, or every group may keep
    them pending, each receiving just the terms it lacks, when either is fewer."""
    held_any = [bool(h) for h in held]
    root = held_any.index(True) if any(held_any) else 0
    count = block_transfers(terms, len(held), 1, held_any.count(False), int(any(held_any)))
    if terms == 1 or not keeps:
        return count, None if terms == 1 else root
    lacking = [terms - len(h) for h in held]
    best = count
    for r, h in enumerate(held):  # other groups that hold every term keep them pending
        cost = terms - bool(h) + sum(min(1, n) for n in lacking) - min(1, lacking[r])
        if cost < best:
            best, root = cost, r
    if sum(lacking) <= best:
        return sum(lacking), None
    return best, root


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


def _held(source: DeviceMesh, target: DeviceMesh, terms: list[list[int]],
          groups: list[list[int]]) -> tuple[dict[Slot, int], list[set[int]]]:
    """Which term each physical source holder holds, and per group the terms its members
    physically hold."""
    term_at = {slot(source, source.device_ids[i]): t for t, hs in enumerate(terms) for i in hs}
    held = [{term_at[s] for j in g if (s := slot(target, target.device_ids[j])) in term_at}
            for g in groups]
    return term_at, held


def cross_mesh_lower_bound_bytes(
    shape: tuple[int, ...], itemsize: int, source: DeviceMesh, before: Placements,
    target: DeviceMesh, after: Placements,
) -> int:
    """The fewest bytes all devices together must receive to move a tensor of ``shape`` from
    ``before`` on ``source`` to ``after`` on ``target``, where a target device holds what the
    same physical device held in the source: per block, every group that needs the value and
    lacks it receives it once; Partial terms cost ``block_transfers`` (a reduction tree and
    the result handed on), or, from a sum to a target sum, each group just the terms its
    members lack when that is fewer. (Terms of avg, max or min are not kept pending across
    meshes: a target Partial of those ops receives the value.)"""
    old = pieces(source, shape, before).segments
    new = pieces(target, shape, after).segments
    keeps = _keeps(source, before, target, after)
    total = 0
    for _, box, size in _blocks(shape, old, new):
        terms = _holders_by_term(source, before, old, box)
        groups = _groups(target, after, new, box)
        _, held = _held(source, target, terms, groups)
        total += _options(len(terms), held, keeps)[0] * size * itemsize
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

    @cached_property
    def crossed_dims(self) -> tuple[int, ...]:
        """On one mesh (source and target the same): the mesh dims in which the coordinates of
        the sender and the receiver of some message differ (what a budget charges it to)."""
        mesh = self.target_mesh
        dims: set[int] = set()
        for d in mesh.device_ids:
            senders = [s for _, _, sources in self.first[d] for s, _ in sources]
            senders += [s for _, _, sources in self.second[d] for s, _ in sources]
            here = mesh.coordinate_of(d)
            for s in senders:
                dims.update(m for m, (a, b) in enumerate(
                    zip(mesh.coordinate_of(s), here, strict=True)) if a != b)
        return tuple(sorted(dims))

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


@cached(PER_GROUP)
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

    keeps = _keeps(source, before, target, after)
    for index, box, size in _blocks(shape, old, new):
        terms = _holders_by_term(source, before, old, box)
        groups = _groups(target, after, new, box)
        term_at, held = _held(source, target, terms, groups)
        _, root_group = _options(len(terms), held, keeps)
        box_shape = tuple(b - a for a, b in box)
        spread = sum(index)

        def fill(d: int, wanted: list[int], box=box, box_shape=box_shape, spread=spread,
                 terms=terms, size=size) -> None:
            """Device ``d`` reduces the terms ``wanted`` (coordinate order) into its block."""
            sources = []
            for t in wanted:
                src = _pick(source, terms[t], slot(target, d), spread)
                received[d] += 0 if slot(source, src) == slot(target, d) else size
                sources.append((src, at(where_old[src], box)))
            first[d].append((at(where_new[d], box), box_shape, tuple(sources)))

        def own(j: int, term_at=term_at) -> int | None:
            return term_at.get(slot(target, tdev[j]))

        def chosen(members: list[int], spread=spread) -> int:
            holders = [j for j in members if own(j) is not None] or members
            return tdev[holders[spread % len(holders)]]

        root = None if root_group is None else chosen(groups[root_group])
        if root is not None:
            fill(root, list(range(len(terms))))
        for g, members in enumerate(groups):
            zeros = zeros or len(members) > 1
            if g == root_group:
                continue
            if root is not None and not (keeps and len(held[g]) == len(terms)):
                d = chosen(members)
                received[d] += size
                second[d].append((at(where_new[d], box), box_shape,
                                  ((root, at(where_new[root], box)),)))
                continue
            # the group keeps the terms pending, each on one member: one that holds it, else
            # the chosen member receives it
            mine: dict[int, list[int]] = {}
            for t in range(len(terms)):
                d = chosen([j for j in members if own(j) == t] or members)
                mine.setdefault(d, []).append(t)
            for d, wanted in mine.items():
                fill(d, wanted)
    return CrossMeshPlan(
        source, before, target, after, shape,
        {d: tuple(f) for d, f in first.items()}, {d: tuple(f) for d, f in second.items()},
        zeros, received, itemsize=itemsize,
    )


@cached(PER_SEARCH)
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
    union: DeviceMesh, dims: tuple[int, ...], held: dict[int, torch.Tensor],
    route: dict[int, tuple[Fill, ...]], src_ids: dict[int, int], dst_ids: dict[int, int],
    dtype: torch.dtype,
) -> dict[int, list[torch.Tensor]]:
    """One round: every block ``route`` asks for from another physical device travels through
    ``comm.exchange`` over the union mesh (its mesh dims ``dims``), counted as "send/recv"
    (``CrossMeshPlan.collective``); returns, per local target
    device, what it received in route order. ``held`` maps a sender (by its id in the sending
    mesh) to its piece."""
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
    got = comm.exchange(union, dims, sends, receives, dtype, "send/recv")
    return {d: got[index[v]] for d, v in dst_ids.items() if v in index}


def run_cross_mesh(plan: CrossMeshPlan, components: list[torch.Tensor], dtype: torch.dtype
                   ) -> list[torch.Tensor]:
    """This process's target pieces (ascending device id) from its source ``components``
    (ascending device id): the plan's blocks sent point to point, Partial terms reduced in
    coordinate order at each block's root. On one mesh the messages cross the mesh itself, on
    its ``crossed_dims``; between two, a 1-D ``union_mesh``."""
    source, target = plan.source_mesh, plan.target_mesh
    if source == target:
        union, dims = source, plan.crossed_dims
        src_ids = dst_ids = {d: d for d in source.device_ids}
    else:
        (union, src_ids, dst_ids), dims = union_mesh(source, target), (0,)
    if not union.local_device_ids:
        return []
    held = dict(zip(source.local_device_ids, components, strict=True))
    ops = {p.reduce_op for m, p in enumerate(plan.source)
           if isinstance(p, Partial) and source.shape[m] > 1}
    op = ops.pop() if ops else None
    received = _send(union, dims, held, plan.first, src_ids, dst_ids, dtype)
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
        received = _send(union, dims, out, plan.second, dst_ids, dst_ids, dtype)
        for d in target.local_device_ids:
            for (dst, _, _), block in zip(plan.second[d], received[d], strict=True):
                out[d][dst] = block
    return [out[d] for d in target.local_device_ids]
