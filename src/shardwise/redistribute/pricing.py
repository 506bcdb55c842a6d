"""Pricing a redistribution's steps: the bytes every device receives, from shard geometry
alone (the cost model of DESIGN.md, exact for uneven shards), and the lower bound on what the
rest of a plan moves (``geometry.block_transfers``), A*'s guess."""

from __future__ import annotations

from collections import Counter
from math import prod
from types import MappingProxyType
from typing import Literal

from ..caches import PER_SEARCH, cached
from ..comm import accounting
from ..geometry import Pieces, Placements, block_transfers, box_overlap, pieces, runs_overlap
from ..mesh import DeviceMesh
from ..placements import Placement, Shard
from ..spec import pending_sum
from .exchange import exchange_cost

State = Placements
Collective = Literal[
    "local", "all_gather", "all_reduce", "reduce_scatter", "all_to_all", "exchange", "send/recv"
]


def shard_dim(p: Placement) -> int | None:
    """The tensor dim ``p`` shards, None for any other placement."""
    return p.dim if isinstance(p, Shard) else None


@cached(PER_SEARCH)
def _group_positions(
    mesh: DeviceMesh,
) -> tuple[tuple[tuple[tuple[int, ...], ...], ...],
           tuple[MappingProxyType[int, tuple[tuple[int, ...], int]], ...]]:
    """Per mesh dim, its groups as positions in ``mesh.device_ids``, and per position its
    group and its index there (geometry of the mesh)."""
    position = {d: i for i, d in enumerate(mesh.device_ids)}
    groups = tuple(tuple(tuple(position[d] for d in g) for g in mesh.groups(m))
                   for m in range(mesh.ndim))
    return groups, tuple(MappingProxyType({i: (g, k) for g in dim for k, i in enumerate(g)})
                         for dim in groups)


class Pricer:
    """Bytes received per device for a step, from shard geometry alone. A half-precision sum
    moves its float32 pieces while it is pending (``pending_itemsize``). One pricer serves one
    search: the layouts and box overlaps it remembers are its own."""

    def __init__(
        self,
        mesh: DeviceMesh,
        shape: tuple[int, ...],
        itemsize: int,
        pending_itemsize: int | None = None,
    ) -> None:
        self.mesh, self.shape, self.itemsize = mesh, shape, itemsize
        self.size = prod(shape)  # elements
        self.pending_itemsize = pending_itemsize or itemsize
        local = set(mesh.local_device_ids)
        self.is_local = [d in local for d in mesh.device_ids]
        self.local_positions = [i for i, here in enumerate(self.is_local) if here]
        self.all_local = len(self.local_positions) == len(self.is_local)
        self.groups, self.member = _group_positions(mesh)
        self._layouts: dict[State, Pieces] = {}
        self._overlaps: dict[tuple[int, int], int] = {}  # per pair of box keys

    def layout(self, state: State) -> Pieces:
        """The pieces of ``state``, remembered for this search."""
        layout = self._layouts.get(state)
        if layout is None:
            layout = self._layouts[state] = pieces(self.mesh, self.shape, state)
        return layout

    def lacking(self, state: State, target: State) -> int:
        """Bytes the rest of any plan from ``state`` to the Partial-free ``target`` moves at
        least (A*'s heuristic): ``lower_bound_bytes`` (see ``lacking_from``)."""
        shape = self.mesh.shape
        terms = prod(n for n, p in zip(shape, state, strict=True) if p.is_partial())
        needers = prod(n for n, p in zip(shape, target, strict=True) if not isinstance(p, Shard))
        return self.lacking_from(self.layout(state), self.layout(target), terms, needers)

    def lacking_from(self, held: Pieces, wanted: Pieces, terms: int, needers: int) -> int:
        """``lacking`` from the layouts of both ends: ``block_transfers`` over the whole
        tensor, with ``terms`` Partial terms per element and ``needers`` devices needing it
        (the product of the mesh dims the target replicates). The elements some device lacks
        or some needer holds a term of are counted per distinct pair of pieces a device holds
        and needs: distinct pieces of a layout never overlap. Priced at the declared
        itemsize: float32 pieces of a pending half sum cost more, so the guess stays below
        the true cost, as A* needs."""
        if held.keys is not None and wanted.keys is not None:
            shared = self._box_overlaps(held, wanted, distinct=terms != 1)
        else:
            pairs = Counter(zip(held.segments, wanted.segments, strict=True))
            shared = sum(
                (count if terms == 1 else 1)
                * prod(runs_overlap(a, b) for a, b in zip(old, new, strict=True))
                for (old, new), count in pairs.items()
            )
        if terms == 1:
            lacking = sum(wanted.numels) - shared
            return block_transfers(1, needers, self.size, lacking, 0) * self.itemsize
        return block_transfers(terms, needers, self.size, 0, shared) * self.itemsize

    def _box_overlaps(self, held: Pieces, wanted: Pieces, distinct: bool) -> int:
        """The elements each device's held box shares with its wanted box, summed over the
        devices, or over the distinct (held, wanted) pairs (overlaps remembered per pair of
        box keys)."""
        overlaps, old, new = self._overlaps, held.boxes, wanted.boxes
        pairs = zip(zip(held.keys, wanted.keys, strict=True), range(len(old)), strict=True)
        if distinct:
            pairs = dict(pairs).items()
        shared = 0
        for pair, i in pairs:
            common = overlaps.get(pair)
            if common is None:
                common = overlaps[pair] = box_overlap(old[i], new[i])
            shared += common
        return shared

    def size_of(self, state: State) -> int:
        """Bytes per element of the components held in ``state``."""
        return self.pending_itemsize if pending_sum(state) else self.itemsize

    def price(
        self, kind: Collective, before: State, after: State, mesh_dim: int
    ) -> tuple[int, int]:
        """(bytes for this process's devices, bytes for all devices)."""
        return self.price_from(kind, self.layout(before), self.layout(after), mesh_dim,
                               self.size_of(before), shard_dim(after[mesh_dim]))

    def price_from(
        self, kind: Collective, old: Pieces, new: Pieces, mesh_dim: int, size: int,
        dim: int | None,
    ) -> tuple[int, int]:
        """``price`` from the layouts of both ends (an all_gather or all_reduce reads only
        ``old``), the element size and the tensor dim the step shards. Summed in closed form
        over the members of a group: an all_gather or a reduce_scatter member receives the
        group's pieces but its own, all_reduce members hold equal pieces whose ring chunks add
        up to the piece, and an all_to_all member receives, from every other member, that
        member's piece cut to its own span of ``dim``."""
        if kind == "local":
            return 0, 0
        if kind == "all_to_all":
            return self._all_to_all(old, new, mesh_dim, size, dim)
        groups = self.groups[mesh_dim]
        n = len(groups[0])
        numels = (new if kind == "reduce_scatter" else old).numels
        if kind == "all_reduce":
            everyone = 2 * (n - 1) * sum(numels[g[0]] for g in groups) * size
        else:
            everyone = (n - 1) * sum(numels) * size
        if self.all_local:
            return everyone, everyone
        here = 0
        for i in self.local_positions:
            group, k = self.member[mesh_dim][i]
            if kind == "all_reduce":
                here += accounting.all_reduce_received(numels[i], size, n, k)
            else:
                here += accounting.all_gather_received([numels[j] * size for j in group], k)
        return here, everyone

    def _all_to_all(
        self, old: Pieces, new: Pieces, mesh_dim: int, size: int, dim: int
    ) -> tuple[int, int]:
        rest, spans = old.slices[dim], new.shapes
        received = {}
        for group in self.groups[mesh_dim]:
            total = sum(map(rest.__getitem__, group))
            for i in group:
                received[i] = spans[i][dim] * (total - rest[i])
        everyone = sum(received.values()) * size
        if self.all_local:
            return everyone, everyone
        return sum(map(received.__getitem__, self.local_positions)) * size, everyone

    def exchange_price(self, before: State, after: State) -> tuple[int, int, int]:
        """(bytes for this process's devices, bytes for all devices, rounds) of an exchange
        (see ``exchange_cost``)."""
        received, rounds = exchange_cost(self.mesh, self.shape, before, after)
        local_total = sum(n for n, here in zip(received, self.is_local, strict=True) if here)
        size = self.size_of(before)
        return local_total * size, sum(received) * size, rounds
