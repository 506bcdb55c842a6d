"""Redistribution: plan the cheapest per-mesh-dim steps from one spec to another, and run them.

A step changes the placement of one mesh dim, or of several at once (an exchange: point to
point messages that may also reduce pending Partials). The planner searches the (small) space
of placement tuples with A*, pricing each step by the bytes every device of the mesh receives
(the cost model of DESIGN.md, exact for uneven shards), and caches the plan per (source spec,
target placements). Plans are the same in every process, so SPMD stays in step.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from math import prod

import torch

from . import comm
from .comm import accounting
from .errors import InvalidPlacementError
from .mesh import DeviceMesh
from .placements import InterleavedShard, Partial, Placement, Replicate, Shard
from .spec import (
    LOW_PRECISION,
    DTensorSpec,
    Segments,
    chunk_bounds,
    pending_sum,
    shard_segments,
    split_segments,
)

State = tuple[Placement, ...]
Cost = tuple[int, int, int, int]  # bytes all devices receive, exchanges, collectives, steps


@dataclass(frozen=True)
class Step:
    """One change of placement on one mesh dim, with the collective it needs."""

    mesh_dim: int | tuple[int, ...]  # an exchange changes several mesh dims at once
    source: Placement | tuple[Placement, ...]
    target: Placement | tuple[Placement, ...]
    collective: str  # a comm kind, or "local" when no data moves between devices
    bytes: int  # received by this process's devices (what CommCounter counts)
    global_bytes: int  # received by all devices of the mesh (the planner's cost)
    rounds: int = 1  # communication rounds (a reducing exchange may take two)

    def __repr__(self) -> str:
        return (
            f"Step(mesh_dim={self.mesh_dim}, {self.source!r} -> {self.target!r}, "
            f"{self.collective}, bytes={self.bytes})"
        )


@dataclass(frozen=True)
class RedistributePlan:
    """The steps from ``source`` placements to ``target`` placements, in order."""

    source: State
    target: State
    steps: tuple[Step, ...]
    shape: tuple[int, ...] = ()  # the global shape it was planned for
    # the dtype the components end in when it is not the one they start in: a float16/bfloat16
    # sum held in float32 while pending (``DTensorSpec.component_dtype``) rounds once, at the end
    cast: torch.dtype | None = None
    # the fewest bytes all devices must receive (``lower_bound_bytes``); filled in by
    # ``explain_redistribute``, not on the hot path
    lower_bound: int | None = None

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.steps)

    @property
    def global_bytes(self) -> int:
        return sum(s.global_bytes for s in self.steps)


def _shard_dim(p: Placement) -> int | None:
    return p.dim if isinstance(p, Shard) else None


def _step_kind(a: Placement, b: Placement, mesh_size: int) -> str | None:
    """The collective that turns placement ``a`` into ``b`` on one mesh dim, None if no direct
    step exists (such moves go through Replicate)."""
    if mesh_size == 1:
        return "local"
    if isinstance(a, Replicate):
        return "local"  # Replicate -> Shard takes a chunk; Replicate -> Partial partitions
    if isinstance(b, Replicate):
        return "all_reduce" if isinstance(a, Partial) else "all_gather"
    if isinstance(a, Partial):
        return "reduce_scatter" if isinstance(b, Shard) else None
    if type(a) is Shard and type(b) is Shard and a.dim != b.dim:
        return "all_to_all"
    return None


# every device's segments, local shape, element count, per tensor dim the elements of its
# piece per index along that dim, and, where every piece is one box (at most one run per tensor
# dim), each device's piece as an id (equal ids, equal boxes: ``_box_ids``) and as its (start,
# stop) per tensor dim
Boxes = tuple[tuple[int, ...], tuple[tuple[tuple[int, int], ...], ...]]
Geometry = tuple[
    tuple[tuple, ...],
    tuple[tuple[int, ...], ...],
    tuple[int, ...],
    tuple[tuple[int, ...], ...],
    Boxes | None,
]


@lru_cache(maxsize=256)
def _box_ids(shape: tuple[int, ...]) -> tuple[dict[tuple, int], Iterator[int]]:
    """The ids given to the boxes of a tensor of ``shape`` so far, and the next ids."""
    return {}, itertools.count()


@lru_cache(maxsize=65536)
def _layout(mesh: DeviceMesh, shape: tuple[int, ...], state: State) -> Geometry:
    """Every device's segments, local shape, element count, slice sizes and box (if any)
    under ``state``, in ``mesh.device_ids`` order (geometry, shared by every plan on that mesh
    and shape)."""
    segments = tuple(
        shard_segments(shape, mesh.shape, state, mesh.coordinate_of(d)) for d in mesh.device_ids
    )
    shapes = tuple(tuple(sum(b - a for a, b in runs) for runs in s) for s in segments)
    slices = tuple(tuple(prod(s[:d] + s[d + 1:]) for s in shapes) for d in range(len(shape)))
    boxes = None
    if all(len(runs) <= 1 for s in segments for runs in s):
        ids, fresh = _box_ids(shape)
        corners = tuple(tuple(runs[0] if runs else (0, 0) for runs in s) for s in segments)
        boxes = (
            tuple(ids.get(c) if c in ids else ids.setdefault(c, next(fresh)) for c in corners),
            corners,
        )
    return segments, shapes, tuple(prod(s) for s in shapes), slices, boxes


def _box_overlap(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> int:
    """How many elements two boxes share."""
    common = 1
    for (a0, a1), (b0, b1) in zip(a, b, strict=True):
        span = (a1 if a1 < b1 else b1) - (a0 if a0 > b0 else b0)
        if span <= 0:
            return 0
        common *= span
    return common


@lru_cache(maxsize=256)
def _group_positions(
    mesh: DeviceMesh,
) -> tuple[tuple[tuple[int, ...], ...], tuple[dict[int, tuple[tuple[int, ...], int]], ...]]:
    """Per mesh dim, its groups as positions in ``mesh.device_ids``, and per position its
    group and its index there (geometry of the mesh)."""
    position = {d: i for i, d in enumerate(mesh.device_ids)}
    groups = tuple(tuple(tuple(position[d] for d in g) for g in mesh.groups(m))
                   for m in range(mesh.ndim))
    return groups, tuple({i: (g, k) for g in dim for k, i in enumerate(g)} for dim in groups)


class _Pricer:
    """Bytes received per device for a step, from shard geometry alone. A half-precision sum
    moves its float32 pieces while it is pending (``pending_itemsize``)."""

    def __init__(
        self,
        mesh: DeviceMesh,
        shape: tuple[int, ...],
        itemsize: int,
        pending_itemsize: int | None = None,
    ) -> None:
        self.mesh, self.shape, self.itemsize = mesh, shape, itemsize
        self.pending_itemsize = pending_itemsize or itemsize
        local = set(mesh.local_device_ids)
        self.is_local = [d in local for d in mesh.device_ids]
        self.local_positions = [i for i, here in enumerate(self.is_local) if here]
        self.all_local = len(self.local_positions) == len(self.is_local)
        self.groups, self.member = _group_positions(mesh)
        self._layouts: dict[State, Geometry] = {}
        self._overlaps: dict[tuple[int, int], int] = {}  # per pair of box ids

    def layout(self, state: State) -> Geometry:
        """``_layout`` of ``state``, remembered for this search."""
        layout = self._layouts.get(state)
        if layout is None:
            layout = self._layouts[state] = _layout(self.mesh, self.shape, state)
        return layout

    def lacking(self, state: State, target: State) -> int:
        """Bytes the rest of any plan from ``state`` to the Partial-free ``target`` moves at
        least (A*'s heuristic): ``lower_bound_bytes`` (see ``lacking_from``)."""
        shape = self.mesh.shape
        terms = prod(n for n, p in zip(shape, state, strict=True) if p.is_partial())
        needers = prod(n for n, p in zip(shape, target, strict=True) if not isinstance(p, Shard))
        return self.lacking_from(self.layout(state), self.layout(target), terms, needers)

    def lacking_from(self, held: Geometry, wanted: Geometry, terms: int, needers: int) -> int:
        """``lacking`` from the geometry of both ends, counted per distinct pair of pieces a
        device holds and needs. With ``terms`` Partial terms and ``needers`` devices that need
        an element (the product of the mesh dims the target replicates) it takes
        ``terms + needers - 2`` transfers where a needer holds a term, else one more;
        distinct pieces of a layout never overlap, so the elements some needer holds are the
        sum of the distinct pairs' overlaps. Priced at the declared itemsize: float32 pieces
        of a pending half sum cost more, so the guess stays below the true cost, as A*
        needs."""
        if held[4] is not None and wanted[4] is not None:  # boxes: overlaps kept per id pair
            (held_ids, held_boxes), (wanted_ids, wanted_boxes) = held[4], wanted[4]
            overlaps = self._overlaps
            if terms == 1:
                kept = 0
                for i, pair in enumerate(zip(held_ids, wanted_ids, strict=True)):
                    common = overlaps.get(pair)
                    if common is None:
                        common = overlaps[pair] = _box_overlap(held_boxes[i], wanted_boxes[i])
                    kept += common
                return (sum(wanted[2]) - kept) * self.itemsize
            covered = 0
            pairs = zip(held_ids, wanted_ids, strict=True)
            for pair, i in dict(zip(pairs, range(len(held_ids)), strict=False)).items():
                common = overlaps.get(pair)
                if common is None:
                    common = overlaps[pair] = _box_overlap(held_boxes[i], wanted_boxes[i])
                covered += common
            return ((terms + needers - 1) * prod(self.shape) - covered) * self.itemsize
        pairs = Counter(zip(held[0], wanted[0], strict=True))
        kept = covered = 0
        for (old, new), count in pairs.items():
            common = 1
            for a, b in zip(old, new, strict=True):
                common *= _overlap(a, b)
            kept += count * common
            covered += common
        if terms == 1:
            return (sum(wanted[2]) - kept) * self.itemsize
        return ((terms + needers - 1) * prod(self.shape) - covered) * self.itemsize

    def size_of(self, state: State) -> int:
        """Bytes per element of the components held in ``state``."""
        return self.pending_itemsize if pending_sum(state) else self.itemsize

    def price(self, kind: str, before: State, after: State, mesh_dim: int) -> tuple[int, int]:
        """(bytes for this process's devices, bytes for all devices)."""
        return self.price_from(kind, self.layout(before), self.layout(after), mesh_dim,
                               self.size_of(before), _shard_dim(after[mesh_dim]))

    def price_from(
        self, kind: str, old: Geometry, new: Geometry, mesh_dim: int, size: int, dim: int | None
    ) -> tuple[int, int]:
        """``price`` from the geometry of both ends (an all_gather or all_reduce reads only
        ``old``), the element size and the tensor dim the step shards. Summed in closed form
        over the members of a group: an all_gather or a reduce_scatter member receives the
        group's pieces but its own, all_reduce members hold equal pieces whose ring chunks add
        up to the piece, and an all_to_all member receives, from every other member, that
        member's piece cut to its own span of ``dim``."""
        if kind == "local":
            return 0, 0
        groups = self.groups[mesh_dim]
        n = len(groups[0])
        if kind == "all_to_all":
            rest, spans = old[3][dim], new[1]
            received = {}
            for group in groups:
                total = sum(map(rest.__getitem__, group))
                for i in group:
                    received[i] = spans[i][dim] * (total - rest[i])
            everyone = sum(received.values()) * size
            if self.all_local:
                return everyone, everyone
            return sum(map(received.__getitem__, self.local_positions)) * size, everyone
        numels = new[2] if kind == "reduce_scatter" else old[2]
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

    def exchange_price(self, before: State, after: State) -> tuple[int, int, int]:
        """(bytes for this process's devices, bytes for all devices, rounds) of an exchange
        (see ``_exchange_cost``)."""
        received, rounds = _exchange_cost(self.mesh, self.shape, before, after)
        local_total = sum(n for n, here in zip(received, self.is_local, strict=True) if here)
        size = self.size_of(before)
        return local_total * size, sum(received) * size, rounds


# the collectives priced from the pieces they make as well as those they start from
_RESHAPING = frozenset(("reduce_scatter", "all_to_all"))


def _candidates(source: State, target: State, shape: tuple[int, ...]) -> list[list[Placement]]:
    """Per mesh dim, the placements worth visiting: the two ends, Replicate, the tensor dims
    either end shards, and, when a Partial must be resolved, the largest tensor dim (reducing
    by reduce_scatter then all_gather halves what successive all_reduces move)."""
    shard_dims = {p.dim for p in source + target if isinstance(p, Shard)}
    if any(p.is_partial() for p in source) and shape:
        shard_dims.add(max(range(len(shape)), key=lambda d: (shape[d], -d)))
    shards = [Shard(d) for d in sorted(shard_dims)]
    return [list(dict.fromkeys([a, b, Replicate(), *shards]))
            for a, b in zip(source, target, strict=True)]


@lru_cache(maxsize=1024)
def _moves(
    options: tuple[Placement, ...], mesh_size: int
) -> tuple[tuple[tuple[int, str], ...], ...]:
    """Per placement of ``options`` (distinct), the (index in ``options``, collective) of every
    other one a single step on a mesh dim of ``mesh_size`` reaches (a table of ``_step_kind``)."""
    return tuple(
        tuple((j, kind) for j, b in enumerate(options)
              if i != j and (kind := _step_kind(a, b, mesh_size)) is not None)
        for i, a in enumerate(options)
    )


def _overlap(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> int:
    """How many indices two run lists share."""
    return sum(max(0, min(y1, y2) - max(x1, x2)) for x1, y1 in a for x2, y2 in b)


def _exchange_step(pricer: _Pricer, state: State, settled: State) -> Step | None:
    """The exchange straight from ``state`` to the Partial-free ``settled``, or None. Pending
    Partials are resolved on the way when they all reduce alike (mixed reduce ops must go
    lowest mesh dim first, one dim at a time)."""
    mesh = pricer.mesh
    ops = {p.reduce_op for m, p in enumerate(state) if isinstance(p, Partial) and mesh.shape[m] > 1}
    if state == settled or len(ops) > 1:
        return None
    dims = tuple(m for m in range(mesh.ndim) if state[m] != settled[m])
    try:
        local_bytes, global_bytes, rounds = pricer.exchange_price(state, settled)
    except InvalidPlacementError:
        return None  # an interleave that does not divide at this nesting level
    return Step(
        dims,
        tuple(state[m] for m in dims),
        tuple(settled[m] for m in dims),
        "exchange",
        local_bytes,
        global_bytes,
        rounds,
    )


def _direct_exchange(pricer: _Pricer, source: State, settled: State, moved: int) -> Step:
    """``_exchange_step`` from ``source`` (plain placements, one reduce op) when it is known to
    move ``moved`` bytes over all devices, the lower bound: with every device in this process
    that is what they receive, in two rounds when several Partial terms reach several needers
    (see ``_exchange_cost``); otherwise each device's share is worked out."""
    step = None if pricer.all_local else _exchange_step(pricer, source, settled)
    if step is not None:
        return step
    sizes = pricer.mesh.shape
    dims = tuple(m for m, (p, q) in enumerate(zip(source, settled, strict=True)) if p != q)
    terms = prod(n for n, p in zip(sizes, source, strict=True) if p.is_partial())
    needers = prod(n for n, p in zip(sizes, settled, strict=True) if not isinstance(p, Shard))
    rounds = 2 if terms > 1 and needers > 1 and prod(pricer.shape) else 1
    return Step(dims, tuple(source[m] for m in dims), tuple(settled[m] for m in dims), "exchange",
                moved, moved, rounds)


def _apply(state: State, step: Step) -> State:
    """The placements after ``step``."""
    if step.collective == "exchange":
        after = list(state)
        for m, p in zip(step.mesh_dim, step.target, strict=True):
            after[m] = p
        return tuple(after)
    return state[: step.mesh_dim] + (step.target,) + state[step.mesh_dim + 1 :]


@lru_cache(maxsize=4096)
def _plan(
    mesh: DeviceMesh,
    shape: tuple[int, ...],
    itemsize: int,
    source: State,
    target: State,
    pending_itemsize: int | None = None,
) -> RedistributePlan:
    pricer = _Pricer(mesh, shape, itemsize, pending_itemsize)
    sizes = mesh.shape
    ndim = len(sizes)
    # a state is searched as the indices of its placements in ``options`` (ints hash and
    # compare in C, placements in Python); the source is all zeros
    options = _candidates(source, target, shape)
    settled_placements = tuple(Replicate() if p.is_partial() else p for p in target)
    start = (0,) * ndim
    goal = tuple(o.index(p) for o, p in zip(options, target, strict=True))
    settled = tuple(o.index(p) for o, p in zip(options, settled_placements, strict=True))
    shard = [[_shard_dim(p) for p in o] for o in options]
    # the reduce op of a Partial that needs reducing (mesh dim size > 1), else None
    op = [[p.reduce_op if isinstance(p, Partial) and n > 1 else None for p in o]
          for o, n in zip(options, sizes, strict=True)]
    moves = [_moves(tuple(o), n) for o, n in zip(options, sizes, strict=True)]
    placements: dict[tuple[int, ...], State] = {}
    geometry: dict[tuple[int, ...], Geometry] = {}

    def decode(state: tuple[int, ...]) -> State:
        found = placements.get(state)
        if found is None:
            found = placements[state] = tuple(o[i] for o, i in zip(options, state, strict=True))
        return found

    def layout(state: tuple[int, ...]) -> Geometry:
        found = geometry.get(state)
        if found is None:
            found = geometry[state] = _layout(mesh, shape, decode(state))
        return found

    def out_of_order(state: tuple[int, ...], m: int) -> bool:
        """True if resolving a Partial on mesh dim ``m`` would precede a lower mesh dim still
        Partial with another reduce op: mixed Partials reduce the lowest mesh dim first
        (PyTorch's order), since another order could change the value (or, for sum and avg,
        its rounding)."""
        mine = op[m][state[m]]
        return mine is not None and any(
            op[k][state[k]] not in (None, mine) for k in range(m)
        )

    # A* on (global bytes, exchanges, collectives, steps): an exchange is taken only when it
    # moves fewer bytes than the named collectives; equal guesses pop the furthest along
    # first (it stops at the first of many equally cheap orders), then the first queued. The
    # bytes any plan from a state still moves (``_Pricer.lacking``, the lower bound) guide
    # the search (not towards a Partial target: zeros or the identity of max and min would
    # do there); so do the collectives and steps still needed without an exchange (a mesh
    # dim leaves a placement other than Replicate only by a collective on it). An exchange
    # straight from the source already moves the fewest bytes any schedule can (see
    # ``_exchange_cost``), so it bounds the search: states that cannot beat it are never
    # expanded, and no later exchange can do better. Only mixed reduce ops, which it cannot
    # resolve, need exchanges from states past the source.
    guided = not any(p.is_partial() and n > 1 for p, n in zip(target, sizes, strict=True))
    try:
        wanted = pricer.layout(target)
    except InvalidPlacementError:
        guided = False  # an interleave the target cannot hold: planned as before, unguided
    needers = prod(n for n, p in zip(sizes, target, strict=True) if not isinstance(p, Shard))
    replicate = [[p.is_replicate() for p in o] for o in options]
    partial = [[p.is_partial() for p in o] for o in options]
    pending = [[p.is_partial() and p.reduce_op in ("sum", "avg") for p in o] for o in options]
    guesses: dict[tuple[int, ...], Cost] = {}
    remaining: dict[tuple[int, ...], tuple[int, int]] = {}

    def steps_left(state: tuple[int, ...]) -> tuple[int, int]:
        """The collectives and steps still needed without an exchange."""
        left = remaining.get(state)
        if left is None:
            changed = [m for m in range(ndim) if state[m] != goal[m]]
            collectives = sum(sizes[m] > 1 and not replicate[m][state[m]] for m in changed)
            left = remaining[state] = (collectives, len(changed))
        return left

    def heuristic(state: tuple[int, ...]) -> Cost:
        h = guesses.get(state)
        if h is None:
            moved = 0
            if guided:
                terms = prod(n for n, o, i in zip(sizes, partial, state, strict=True) if o[i])
                moved = pricer.lacking_from(layout(state), wanted, terms, needers)
            h = guesses[state] = (moved, 0, *steps_left(state))
        return h

    best: dict[tuple[int, ...], Cost] = {start: (0, 0, 0, 0)}
    # how each state was reached: (previous state, mesh dim, collective, bytes here, bytes
    # everywhere), or (previous state, exchange or None for the direct one built last)
    back: dict[tuple[int, ...], tuple] = {}
    # (guess, minus the cost so far, queue number, cost so far, state, whether the guess is
    # the heuristic's or only a bound below it)
    heap: list[tuple[Cost, Cost, int, Cost, tuple[int, ...], bool]] = []
    order = itertools.count(1)

    def push(state: tuple[int, ...], cost: Cost, how: tuple) -> None:
        if state not in best or cost < best[state]:
            best[state] = cost
            back[state] = how
            h = heuristic(state)
            heapq.heappush(heap, ((cost[0] + h[0], cost[1], cost[2] + h[2], cost[3] + h[3]),
                                  (-cost[0], -cost[1], -cost[2], -cost[3]), next(order), cost,
                                  state, True))

    h = heuristic(start)
    heapq.heappush(heap, (h, (0, 0, 0, 0), 0, (0, 0, 0, 0), start, True))
    ops = {p.reduce_op for p, n in zip(source, sizes, strict=True)
           if isinstance(p, Partial) and n > 1}
    direct: Step | None = None
    plain = all(type(p) in (Shard, Replicate, Partial) for p in source + target)
    if guided and plain and len(ops) <= 1 and source != settled_placements:
        # the exchange moves exactly the lower bound, the guess at the start (see
        # ``_exchange_cost``): its step is built only if the plan takes it
        limit = h[0] // itemsize * pricer.size_of(source)
    else:
        direct = _exchange_step(pricer, source, settled_placements)
        limit = None if direct is None else direct.global_bytes
    if limit is not None:
        push(settled, (limit, 1, 1, 1), (start, direct))
    while heap:
        guessed, ahead, number, cost, state, exact = heapq.heappop(heap)
        if not exact:
            # queued with a bound below its guess: the guess is worked out now, and the state
            # queued again in the place the guess gives it (most never get here)
            if cost != best[state]:
                continue
            try:
                h = heuristic(state)
            except InvalidPlacementError:
                continue  # an interleave that does not divide at this nesting level
            if limit is not None and cost[0] + h[0] > limit:
                continue
            heapq.heappush(heap, ((cost[0] + h[0], *guessed[1:]), ahead, number, cost, state,
                                  True))
            continue
        if state == goal:
            break
        if cost != best[state]:
            continue  # a cheaper way here was queued later
        here = None  # the state's geometry, measured for the first step that moves data
        size = pricer.pending_itemsize if any(
            o[i] for o, i in zip(pending, state, strict=True)
        ) else itemsize
        # a step never lowers the bytes guessed (the lower bound is consistent): its guess is
        # at least this one's
        floor = guessed[0]
        # a mesh dim whose tensor dim a later mesh dim also shards cannot change directly:
        # the nested split forbids it (the lower mesh dim splits first)
        sharding = [shard[m][i] for m, i in enumerate(state)]
        for m in range(ndim):
            a = state[m]
            nested = sharding[m + 1:] if sizes[m] > 1 else ()
            if (sharding[m] is not None and sharding[m] in nested) or out_of_order(state, m):
                continue
            for b, kind in moves[m][a]:
                dim = shard[m][b]
                if dim is not None and dim in nested:
                    continue
                nxt = state[:m] + (b,) + state[m + 1 :]
                collective = kind != "local"
                known = best.get(nxt)
                if known is not None and known <= (cost[0], cost[1], cost[2] + collective,
                                                   cost[3] + 1):
                    continue  # reached as cheaply already, whatever this step moves
                if collective:
                    try:
                        here = here or layout(state)
                        local_bytes, global_bytes = pricer.price_from(
                            kind, here, layout(nxt) if kind in _RESHAPING else here, m, size, dim
                        )
                    except InvalidPlacementError:
                        continue  # an interleave that does not divide at this nesting level
                else:
                    local_bytes = global_bytes = 0
                moved = cost[0] + global_bytes
                new = (moved, cost[1], cost[2] + collective, cost[3] + 1)
                h = guesses.get(nxt)
                if h is None:  # queued on a bound, its guess worked out if it comes first
                    left = steps_left(nxt)
                    key = (max(moved, floor), new[1], new[2] + left[0], new[3] + left[1])
                elif limit is not None and moved + h[0] > limit:
                    continue
                else:
                    key = (moved + h[0], new[1], new[2] + h[2], new[3] + h[3])
                if known is None or new < known:
                    best[nxt] = new
                    back[nxt] = (state, m, kind, local_bytes, global_bytes)
                    heapq.heappush(heap, (key, (-moved, -new[1], -new[2], -new[3]),
                                          next(order), new, nxt, h is not None))
        later = None if limit is not None else _exchange_step(
            pricer, decode(state), settled_placements
        )
        if later is not None:
            new_cost = (cost[0] + later.global_bytes, cost[1] + 1, cost[2] + 1, cost[3] + 1)
            push(settled, new_cost, (state, later))
    if goal not in best:
        raise InvalidPlacementError(
            f"no redistribution from {list(source)} to {list(target)} for shape {list(shape)} "
            f"on {mesh}"
        )
    steps: list[Step] = []
    state = goal
    while state != start:
        previous, *how = back[state]
        if len(how) == 1:
            steps.append(how[0] or _direct_exchange(pricer, source, settled_placements, limit))
        else:
            m, kind, local_bytes, global_bytes = how
            steps.append(Step(m, options[m][previous[m]], options[m][state[m]], kind,
                              local_bytes, global_bytes))
        state = previous
    return RedistributePlan(source, target, tuple(reversed(steps)), shape)


_PLANS: dict[tuple[DTensorSpec, State], RedistributePlan] = {}
_MAX_PLANS = 65536


def plan_redistribute(spec: DTensorSpec, placements: Sequence[Placement]) -> RedistributePlan:
    """The cheapest plan from ``spec`` to ``placements`` on the same mesh, cached per (spec,
    target) so a repeated redistribution costs one dictionary lookup (specs cache their hash);
    ``_plan`` shares the planning itself between specs that differ only in strides."""
    key = (spec, tuple(placements))
    plan = _PLANS.get(key)
    if plan is None:
        meta = spec.tensor_meta
        if meta.dtype in LOW_PRECISION:
            plan = _plan(spec.mesh, tuple(meta.shape), meta.dtype.itemsize, spec.placements,
                         key[1], torch.float32.itemsize)
            start, end = spec.component_dtype, spec.with_placements(key[1]).component_dtype
            if start != end:
                plan = dataclasses.replace(plan, cast=end)
        else:
            plan = _plan(spec.mesh, tuple(meta.shape), meta.dtype.itemsize, spec.placements,
                         key[1])
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


# ----- execution ---------------------------------------------------------------------------


@lru_cache(maxsize=4096)
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
    (``torch.chunk`` geometry as one ``tensor_split``, half the cost of a narrow per piece)."""
    dim = placement.dim
    length = t.shape[dim]
    if not isinstance(placement, InterleavedShard):
        return list(t.tensor_split([chunk_bounds(length, n, k)[1] for k in range(n - 1)], dim))
    return [_piece(t, dim, runs) for runs in _split_runs(length, placement, n)]


def _merge_interleaved(pieces: Sequence[torch.Tensor], placement: InterleavedShard) -> torch.Tensor:
    """Inverse of ``_split`` for ``InterleavedShard``: the whole tensor from every coordinate's
    piece (for ``Shard`` it is a concatenation, which ``comm.all_gather_tensor`` does)."""
    dim, k = placement.dim, placement.interleaved_size
    blocks = [p.chunk(k, dim) if p.shape[dim] else [p] * k for p in pieces]
    return torch.cat([blocks[j][b] for b in range(k) for j in range(len(pieces))], dim)


def _partition(t: torch.Tensor, placement: Partial, coordinate: int) -> torch.Tensor:
    """Replicate -> Partial without moving data: for sum and p-norms the first device keeps the
    value and the others hold zeros (exact for every dtype); avg, max and min keep the value
    everywhere."""
    if placement.zeros_elsewhere and coordinate != 0:
        return torch.zeros_like(t)
    return t


def _run_step(
    step: Step, mesh: DeviceMesh, components: list[torch.Tensor]
) -> list[torch.Tensor]:
    m, a, b = step.mesh_dim, step.source, step.target
    n = mesh.shape[m]
    if step.collective == "local":
        if n == 1:
            return components
        coords = [mesh.coordinate_of(d)[m] for d in mesh.local_device_ids]
        if isinstance(b, Partial):
            return [_partition(t, b, c) for t, c in zip(components, coords, strict=True)]
        return [
            _piece(t, b.dim, _split_runs(t.shape[b.dim], b, n)[c])
            for t, c in zip(components, coords, strict=True)
        ]
    if step.collective == "all_gather":
        if isinstance(a, InterleavedShard):
            return [_merge_interleaved(p, a) for p in comm.all_gather(mesh, m, components)]
        return comm.all_gather_tensor(mesh, m, components, a.dim)
    if step.collective == "all_reduce":
        return comm.all_reduce(mesh, m, components, a.reduce_op)
    if step.collective == "reduce_scatter":
        pieces = [_split(t, b, n) for t in components]
        return comm.reduce_scatter(mesh, m, pieces, a.reduce_op)
    # all_to_all: Shard(d) -> Shard(e)
    pieces = [_split(t, b, n) for t in components]
    return [comm.join(p, a.dim) for p in comm.all_to_all(mesh, m, pieces)]


def execute_plan(
    plan: RedistributePlan, mesh: DeviceMesh, components: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Run ``plan`` on this process's components (ordered like ``mesh.local_device_ids``)."""
    if torch._C._len_torch_dispatch_stack():  # a tracer may be running
        from . import plan_op  # (plan_op imports this module)

        if plan_op.tracing(mesh, components):
            return plan_op.traced_plan(plan, mesh, components)
    return run_plan(plan, mesh, components)


def run_plan(
    plan: RedistributePlan, mesh: DeviceMesh, components: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """``execute_plan``'s eager body: the plan's steps, one after the other."""
    out = list(components)
    state = plan.source
    pending = plan.cast is not None and pending_sum(state)
    for step in plan.steps:
        after = _apply(state, step)
        if step.collective == "exchange":
            out = _run_exchange(mesh, plan.shape, state, after, step.mesh_dim, out)
        else:
            out = _run_step(step, mesh, out)
        state = after
        if plan.cast is not None and pending_sum(state) != pending:
            # the half-precision sum got reduced (round once, move half the bytes from here
            # on) or started pending (hold float32 pieces): as the planner priced it
            out = [c.to(plan.cast) for c in out]
            pending = not pending
    return out


def compile_plan(
    plan: RedistributePlan, spec: DTensorSpec
) -> Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]:
    """``execute_plan(plan, spec.mesh, components)`` as a function of the components of a
    tensor of ``spec``; a plan of local splits only (Replicate -> Shard) gets each device's
    cuts worked out once, for callers that run the same plan again and again (dispatch)."""
    mesh = spec.mesh
    if plan.cast is not None or not plan.steps or any(
        s.collective != "local" or not isinstance(s.target, Shard) for s in plan.steps
    ):
        return lambda components: execute_plan(plan, mesh, components)
    shape = tuple(spec.shape)
    cuts = []
    for device in mesh.local_device_ids:
        coord = mesh.coordinate_of(device)
        sizes = [sum(b - a for a, b in runs) for runs in shard_segments(
            shape, mesh.shape, plan.source, coord
        )]
        device_cuts = []
        for step in plan.steps:  # as _run_step: split the component's current length
            n, dim = mesh.shape[step.mesh_dim], step.target.dim
            if n > 1:
                runs = _split_runs(sizes[dim], step.target, n)[coord[step.mesh_dim]]
                sizes[dim] = sum(b - a for a, b in runs)
                device_cuts.append((dim, runs))
        cuts.append(tuple(device_cuts))

    def run(components: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if torch._C._len_torch_dispatch_stack():  # a tracer may be running: its route
            return execute_plan(plan, mesh, components)
        out = []
        for t, device_cuts in zip(components, cuts, strict=True):
            for dim, runs in device_cuts:
                t = _piece(t, dim, runs)
            out.append(t)
        return out

    return run


Box = tuple[tuple[int, ...], tuple[tuple[int, int], ...], int, int, list[int]]


def _boxes(
    mesh: DeviceMesh, shape: tuple[int, ...], before: State, after: State
) -> Iterator[Box]:
    """The boxes of global indices an exchange from ``before`` to the Partial-free ``after``
    moves: (box index, box, size, needers, holders of each Partial term in term order), the
    devices as bit masks over their positions in ``mesh.device_ids``."""
    coords = [mesh.coordinate_of(d) for d in mesh.device_ids]
    partial = [m for m, p in enumerate(before) if p.is_partial() and mesh.shape[m] > 1]
    old, new = _layout(mesh, shape, before)[0], _layout(mesh, shape, after)[0]
    spans = _spans(shape, [*old, *new])
    old_masks = [_cover_masks(old, dim, s) for dim, s in enumerate(spans)]
    new_masks = [_cover_masks(new, dim, s) for dim, s in enumerate(spans)]
    term_masks: dict[tuple[int, ...], int] = {}
    for i, c in enumerate(coords):
        term = tuple(c[m] for m in partial)
        term_masks[term] = term_masks.get(term, 0) | 1 << i
    terms = [term_masks[t] for t in sorted(term_masks)]
    everyone = (1 << len(coords)) - 1
    for index in itertools.product(*(range(len(s)) for s in spans)):
        need, hold = everyone, everyone
        for dim, k in enumerate(index):
            need &= new_masks[dim][k]
            hold &= old_masks[dim][k]
        box = tuple(s[k] for s, k in zip(spans, index, strict=True))
        size = prod(b - a for a, b in box)
        if need and size:
            yield index, box, size, need, [hold & t for t in terms if hold & t]


def _root(index: tuple[int, ...], need: int, holds: list[int]) -> int | None:
    """The position of the needer that reduces a box's Partial terms (one holding a term
    where one does, spread over the boxes), None with one term."""
    if len(holds) == 1:
        return None
    held = 0
    for h in holds:
        held |= h
    candidates = _bits(need & held) or _bits(need)
    return candidates[sum(index) % len(candidates)]


@lru_cache(maxsize=4096)
def _exchange_cost(
    mesh: DeviceMesh, shape: tuple[int, ...], before: State, after: State
) -> tuple[tuple[int, ...], int]:
    """The elements each device (in ``mesh.device_ids`` order) receives in an exchange from
    ``before`` to the Partial-free ``after``, and the rounds it takes.

    Per box with ``k`` Partial terms and ``m`` needers, the root receives the ``k - 1`` (or
    ``k``) terms it lacks in round one and sends the result to the ``m - 1`` other needers
    in round two; with one term every needer that lacks the box receives it once in round
    one. That is the per-element minimum of ``lower_bound_bytes``, so an exchange moves the
    fewest bytes any schedule can."""
    received = [0] * mesh.size()
    rounds = 1
    for index, _, size, need, holds in _boxes(mesh, shape, before, after):
        root = _root(index, need, holds)
        if root is None:
            for i in _bits(need & ~holds[0]):
                received[i] += size
            continue
        received[root] += size * (len(holds) - any(h >> root & 1 for h in holds))
        for i in _bits(need & ~(1 << root)):
            received[i] += size
            rounds = 2
    return tuple(received), rounds


def _spans(shape: tuple[int, ...], pieces: list[tuple]) -> list[list[tuple[int, int]]]:
    """Per tensor dim, the intervals between every run boundary of ``pieces``."""
    cuts = [{0, size} for size in shape]
    for segments in pieces:
        for dim, runs in enumerate(segments):
            for a, b in runs:
                cuts[dim].update((a, b))
    edges = [sorted(c) for c in cuts]
    return [list(zip(e[:-1], e[1:], strict=False)) or [(0, 0)] for e in edges]


def _cover_masks(pieces: list[tuple], dim: int, spans: list[tuple[int, int]]) -> list[int]:
    """Per interval of ``dim``, the bit mask of the pieces whose runs cover it."""
    masks = []
    for lo, hi in spans:
        mask = 0
        for i, segments in enumerate(pieces):
            if any(a <= lo and hi <= b for a, b in segments[dim]):
                mask |= 1 << i
        masks.append(mask)
    return masks


def _bits(mask: int) -> list[int]:
    return [i for i in range(mask.bit_length()) if mask >> i & 1]


# per device, the blocks of its new piece it fills in one round: where the block goes in the
# new piece, its shape, and the (device, where it is in that device's piece) it comes from: one
# per Partial term in term order in round one (reduced there), the root in round two
Route = tuple[tuple[tuple[slice, ...], tuple[int, ...], tuple[tuple[int, tuple[slice, ...]], ...]],
              ...]


def _local_slice(runs: tuple[tuple[int, int], ...], lo: int, hi: int) -> slice:
    """Where the global interval [lo, hi), inside one run of ``runs``, sits in the piece."""
    offset = 0
    for a, b in runs:
        if a <= lo and hi <= b:
            return slice(offset + lo - a, offset + hi - a)
        offset += b - a
    raise AssertionError(f"[{lo}, {hi}) is not inside one run of {runs}")


@lru_cache(maxsize=1024)
def _routes(
    mesh: DeviceMesh, shape: tuple[int, ...], before: State, after: State
) -> tuple[dict[int, Route], dict[int, Route]]:
    """Rounds one and two of an exchange (see ``_exchange_cost``) for every device. A term
    comes from the device itself when it holds it, else a holder in its own process, else
    the nearest holder by mesh coordinate, then the lowest id."""
    devices = mesh.device_ids
    coords = {d: mesh.coordinate_of(d) for d in devices}
    old = {d: shard_segments(shape, mesh.shape, before, coords[d]) for d in devices}
    new = {d: shard_segments(shape, mesh.shape, after, coords[d]) for d in devices}
    first: dict[int, list] = {d: [] for d in devices}
    second: dict[int, list] = {d: [] for d in devices}

    def where(pieces: tuple, block: tuple) -> tuple[slice, ...]:
        return tuple(_local_slice(r, a, b) for r, (a, b) in zip(pieces, block, strict=True))

    for index, box, _, need, holds in _boxes(mesh, shape, before, after):
        box_shape = tuple(b - a for a, b in box)
        root = _root(index, need, holds)
        for i in _bits(need):
            d = devices[i]
            if root not in (None, i):
                second[d].append((where(new[d], box), box_shape,
                                  ((devices[root], where(new[devices[root]], box)),)))
                continue
            sources = []
            for hold in holds:
                holder = min((devices[j] for j in _bits(hold)), key=lambda h, d=d: (
                    h != d,
                    mesh.owner_of(h) != mesh.owner_of(d),
                    sum(x != y for x, y in zip(coords[h], coords[d], strict=True)),
                    h,
                ))
                sources.append((holder, where(old[holder], box)))
            first[d].append((where(new[d], box), box_shape, tuple(sources)))
    return ({d: tuple(r) for d, r in first.items()}, {d: tuple(r) for d, r in second.items()})


def _send_round(
    mesh: DeviceMesh,
    mesh_dims: tuple[int, ...],
    route: dict[int, Route],
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


def _run_exchange(
    mesh: DeviceMesh,
    shape: tuple[int, ...],
    before: State,
    after: State,
    mesh_dims: tuple[int, ...],
    components: list[torch.Tensor],
) -> list[torch.Tensor]:
    """Every device assembles its new piece from the blocks it holds and the blocks other
    devices send it, point to point (it receives exactly what it lacks); pending Partial
    terms are reduced in term order at one root per block, the same in every process, which
    forwards the result in a second round."""
    first, second = _routes(mesh, shape, before, after)
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


# ----- lower bound ---------------------------------------------------------------------------


def lower_bound_bytes(
    mesh: DeviceMesh, shape: tuple[int, ...], itemsize: int, source: State, target: State
) -> int:
    """The fewest bytes all devices together must receive to go from ``source`` to ``target``
    (the planner's ``global_bytes`` can never be lower).

    Per element: with ``k`` distinct Partial terms spread over the holders and ``m`` devices
    that need it, a reduction tree rooted at a needer takes ``k - 1`` transfers (``k`` when no
    needer holds a term) and handing the result to the other needers ``m - 1``; without
    Partial terms, every needer that does not hold the element receives it once. A target
    Partial("sum") group needs the value on one member only (the others may hold zeros); a
    Partial kept on a mesh dim needs no reduction there. The index space is cut into blocks
    on every segment boundary, so the count is per block."""
    coords = [mesh.coordinate_of(d) for d in mesh.device_ids]
    kept = {m for m, p in enumerate(source) if p.is_partial() and target[m] == p}
    partial_dims = [
        m for m, p in enumerate(source) if p.is_partial() and mesh.shape[m] > 1 and m not in kept
    ]
    summed = [
        m for m, p in enumerate(target)
        if isinstance(p, Partial) and p.zeros_elsewhere and m not in kept
    ]
    src = [shard_segments(shape, mesh.shape, source, c) for c in coords]
    dst = [shard_segments(shape, mesh.shape, target, c) for c in coords]
    total = 0
    for block in _blocks(shape, src + dst):
        size = prod(b - a for a, b in block)
        if size == 0:
            continue
        holders = [i for i, s in enumerate(src) if _covers(s, block)]
        needers = {i for i, s in enumerate(dst) if _covers(s, block)}
        if summed:  # one needer per target sum group, a holder where the group has one
            groups: dict[tuple[int, ...], int] = {}
            for i in sorted(needers, key=lambda i: i not in holders):
                groups.setdefault(tuple(c for m, c in enumerate(coords[i]) if m not in summed), i)
            needers = set(groups.values())
        terms = {tuple(coords[i][m] for m in partial_dims) for i in holders}
        if len(terms) <= 1:
            transfers = len(needers - set(holders))
        else:
            transfers = len(terms) + len(needers) - 1 - any(i in needers for i in holders)
        total += transfers * size * itemsize
    return total


def _blocks(shape: tuple[int, ...], pieces: list[tuple]) -> list[tuple[tuple[int, int], ...]]:
    """The boxes of global indices cut on every run boundary of ``pieces`` (segments per
    tensor dim): each piece is a union of whole boxes."""
    return list(itertools.product(*_spans(shape, pieces)))


def _covers(segments: tuple, block: tuple[tuple[int, int], ...]) -> bool:
    return all(
        any(a <= lo and hi <= b for a, b in runs)
        for runs, (lo, hi) in zip(segments, block, strict=True)
    )
