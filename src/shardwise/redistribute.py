"""Redistribution: plan the cheapest per-mesh-dim steps from one spec to another, and run them.

A step changes the placement of one mesh dim. The planner searches the (small) space of
placement tuples with Dijkstra, pricing each step by the bytes every device of the mesh
receives (the cost model of DESIGN.md, exact for uneven shards), and caches the plan per
(source spec, target placements). Plans are the same in every process, so SPMD stays in step.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from math import prod

import torch

from . import comm
from .comm import accounting
from .errors import InvalidPlacementError
from .mesh import DeviceMesh
from .placements import InterleavedShard, Partial, Placement, Replicate, Shard
from .spec import DTensorSpec, extract_local, shard_segments, split_segments

State = tuple[Placement, ...]


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


def _blocked(state: State, mesh_dim: int, p: Placement) -> bool:
    """True if a later mesh dim also shards ``p``'s tensor dim: the nested split then forbids
    changing this mesh dim directly (the lower mesh dim splits first)."""
    dim = _shard_dim(p)
    return dim is not None and any(_shard_dim(q) == dim for q in state[mesh_dim + 1 :])


def _out_of_order(state: State, mesh_dim: int, a: Placement, mesh_shape: tuple[int, ...]) -> bool:
    """True if resolving Partial ``a`` on ``mesh_dim`` would precede a lower mesh dim still
    Partial with another reduce op: mixed Partials reduce the lowest mesh dim first (PyTorch's
    order), since another order could change the value (or, for sum and avg, its rounding)."""
    return isinstance(a, Partial) and any(
        isinstance(q, Partial) and q.reduce_op != a.reduce_op and mesh_shape[k] > 1
        for k, q in enumerate(state[:mesh_dim])
    )


class _Pricer:
    """Bytes received per device for a step, from shard geometry alone."""

    def __init__(self, mesh: DeviceMesh, shape: tuple[int, ...], itemsize: int) -> None:
        self.mesh, self.shape, self.itemsize = mesh, shape, itemsize
        self.local = set(mesh.local_device_ids)
        self._shapes: dict[tuple[State, tuple[int, ...]], tuple[int, ...]] = {}

    def local_shape(self, state: State, coord: tuple[int, ...]) -> list[int]:
        key = (state, coord)
        shape = self._shapes.get(key)
        if shape is None:
            runs = shard_segments(self.shape, self.mesh.shape, state, coord)
            shape = self._shapes[key] = tuple(sum(b - a for a, b in r) for r in runs)
        return list(shape)

    def numel(self, state: State, coord: tuple[int, ...]) -> int:
        return prod(self.local_shape(state, coord))

    def price(self, kind: str, before: State, after: State, mesh_dim: int) -> tuple[int, int]:
        """(bytes for this process's devices, bytes for all devices)."""
        if kind == "local":
            return 0, 0
        mesh = self.mesh
        local_total = global_total = 0
        for group in mesh.groups(mesh_dim):
            coords = [mesh.coordinate_of(d) for d in group]
            n = len(group)
            for k, device in enumerate(group):
                got = self._received(kind, before, after, mesh_dim, coords, k, n)
                global_total += got
                if device in self.local:
                    local_total += got
        return local_total, global_total

    def exchange_price(self, before: State, after: State) -> tuple[int, int, int]:
        """(bytes for this process's devices, bytes for all devices, rounds) of an exchange
        (see ``_exchange_flows``)."""
        _, received, rounds = _exchange_flows(self.mesh, self.shape, before, after)
        local_total = sum(n for d, n in received.items() if d in self.local) * self.itemsize
        return local_total, sum(received.values()) * self.itemsize, rounds

    def _received(self, kind, before, after, mesh_dim, coords, k, n) -> int:
        size = self.itemsize
        if kind == "all_gather":
            pieces = [self.numel(before, c) * size for c in coords]
            return accounting.all_gather_received(pieces, k)
        if kind == "reduce_scatter":
            pieces = [self.numel(after, c) * size for c in coords]
            return accounting.reduce_scatter_received(pieces, k)
        if kind == "all_reduce":
            return accounting.all_reduce_received(self.numel(before, coords[k]), size, n, k)
        # all_to_all: member j sends k the block of j's old piece inside k's new piece
        e = after[mesh_dim].dim
        wanted = self.local_shape(after, coords[k])[e]
        incoming = []
        for c in coords:
            block = self.local_shape(before, c)
            block[e] = wanted
            incoming.append(prod(block) * size)
        return accounting.all_to_all_received(incoming, k)


def _candidates(
    source: State, target: State, mesh_dim: int, shape: tuple[int, ...]
) -> list[Placement]:
    """Placements worth visiting on ``mesh_dim``: the two ends, Replicate, the tensor dims
    either end shards, and, when a Partial must be resolved, the largest tensor dim (reducing
    by reduce_scatter then all_gather halves what successive all_reduces move)."""
    shard_dims = {p.dim for p in source + target if isinstance(p, Shard)}
    if any(p.is_partial() for p in source) and shape:
        shard_dims.add(max(range(len(shape)), key=lambda d: (shape[d], -d)))
    shard_dims = sorted(shard_dims)
    options = [source[mesh_dim], target[mesh_dim], Replicate(), *(Shard(d) for d in shard_dims)]
    return list(dict.fromkeys(options))


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
    mesh: DeviceMesh, shape: tuple[int, ...], itemsize: int, source: State, target: State
) -> RedistributePlan:
    pricer = _Pricer(mesh, shape, itemsize)
    options = [_candidates(source, target, m, shape) for m in range(mesh.ndim)]
    settled = tuple(Replicate() if p.is_partial() else p for p in target)
    # Dijkstra on (global bytes, exchanges, collectives, steps): an exchange is taken only
    # when it moves fewer bytes than the named collectives; ties keep the first found. An
    # exchange straight from the source already moves the fewest bytes any schedule can (see
    # ``_exchange_flows``), so it bounds the search: dearer states are never queued, and no
    # later exchange can do better. Only mixed reduce ops, which it cannot resolve, need
    # exchanges from states past the source.
    best: dict[State, tuple[int, int, int, int]] = {source: (0, 0, 0, 0)}
    back: dict[State, tuple[State, Step]] = {}
    heap: list[tuple[tuple[int, int, int, int], int, State]] = [((0, 0, 0, 0), 0, source)]
    direct = _exchange_step(pricer, source, settled)
    limit = None if direct is None else direct.global_bytes
    if direct is not None:
        best[settled] = (direct.global_bytes, 1, 1, 1)
        back[settled] = (source, direct)
        heap.append((best[settled], 1, settled))
    counter = 1
    while heap:
        cost, _, state = heapq.heappop(heap)
        if state == target:
            break
        if cost > best[state]:
            continue
        for m in range(mesh.ndim):
            a = state[m]
            for b in options[m]:
                kind = None if a == b else _step_kind(a, b, mesh.shape[m])
                if kind is None or (
                    mesh.shape[m] > 1
                    and (
                        _blocked(state, m, a)
                        or _blocked(state, m, b)
                        or _out_of_order(state, m, a, mesh.shape)
                    )
                ):
                    continue
                nxt = state[:m] + (b,) + state[m + 1 :]
                try:
                    local_bytes, global_bytes = pricer.price(kind, state, nxt, m)
                except InvalidPlacementError:
                    continue  # an interleave that does not divide at this nesting level
                new_cost = (
                    cost[0] + global_bytes,
                    cost[1],
                    cost[2] + (kind != "local"),
                    cost[3] + 1,
                )
                if limit is not None and new_cost[0] > limit:
                    continue
                if nxt not in best or new_cost < best[nxt]:
                    best[nxt] = new_cost
                    back[nxt] = (state, Step(m, a, b, kind, local_bytes, global_bytes))
                    counter += 1
                    heapq.heappush(heap, (new_cost, counter, nxt))
        later = None if limit is not None else _exchange_step(pricer, state, settled)
        if later is not None:
            new_cost = (cost[0] + later.global_bytes, cost[1] + 1, cost[2] + 1, cost[3] + 1)
            if settled not in best or new_cost < best[settled]:
                best[settled] = new_cost
                back[settled] = (state, later)
                counter += 1
                heapq.heappush(heap, (new_cost, counter, settled))
    if target not in best:
        raise InvalidPlacementError(
            f"no redistribution from {list(source)} to {list(target)} for shape {list(shape)} "
            f"on {mesh}"
        )
    steps: list[Step] = []
    state = target
    while state != source:
        state, step = back[state]
        steps.append(step)
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
        plan = _plan(spec.mesh, tuple(meta.shape), meta.dtype.itemsize, spec.placements, key[1])
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


# ----- execution ---------------------------------------------------------------------------


def _split(t: torch.Tensor, placement: Shard, n: int) -> list[torch.Tensor]:
    """The ``n`` pieces of ``t`` that the coordinates of a mesh dim keep under ``placement``."""
    whole = ((0, t.shape[placement.dim]),)
    pieces = []
    for k in range(n):
        runs = split_segments(whole, placement, n, k)
        segments = tuple(runs if d == placement.dim else ((0, s),) for d, s in enumerate(t.shape))
        pieces.append(extract_local(t, segments))
    return pieces


def _merge(pieces: Sequence[torch.Tensor], placement: Shard) -> torch.Tensor:
    """Inverse of ``_split``: the whole tensor from every coordinate's piece."""
    dim = placement.dim
    if isinstance(placement, InterleavedShard):
        k = placement.interleaved_size
        blocks = [p.chunk(k, dim) if p.shape[dim] else [p] * k for p in pieces]
        return torch.cat([blocks[j][b] for b in range(k) for j in range(len(pieces))], dim)
    return torch.cat(list(pieces), dim)


def _partition(t: torch.Tensor, placement: Partial, coordinate: int) -> torch.Tensor:
    """Replicate -> Partial without moving data: for sum the first device keeps the value and
    the others hold zeros (exact for every dtype); avg, max and min keep the value everywhere."""
    if placement.reduce_op == "sum" and coordinate != 0:
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
        return [_split(t, b, n)[c] for t, c in zip(components, coords, strict=True)]
    if step.collective == "all_gather":
        return [_merge(p, a) for p in comm.all_gather(mesh, m, components)]
    if step.collective == "all_reduce":
        return comm.all_reduce(mesh, m, components, a.reduce_op)
    if step.collective == "reduce_scatter":
        pieces = [_split(t, b, n) for t in components]
        return comm.reduce_scatter(mesh, m, pieces, a.reduce_op)
    # all_to_all: Shard(d) -> Shard(e)
    pieces = [_split(t, b, n) for t in components]
    return [torch.cat(p, a.dim) for p in comm.all_to_all(mesh, m, pieces)]


def execute_plan(
    plan: RedistributePlan, mesh: DeviceMesh, components: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Run ``plan`` on this process's components (ordered like ``mesh.local_device_ids``)."""
    out = list(components)
    state = plan.source
    for step in plan.steps:
        after = _apply(state, step)
        if step.collective == "exchange":
            out = _run_exchange(mesh, plan.shape, state, after, step.mesh_dim, out)
        else:
            out = _run_step(step, mesh, out)
        state = after
    return out


@dataclass(frozen=True)
class _Flow:
    """One box of global indices in an exchange: the devices that need it, the holders of
    each Partial term (one term without Partial) in term order, and the ``root``, a needer
    that reduces the terms and forwards the result to the other needers (None with one
    term: every needer then takes it from a holder)."""

    block: tuple[tuple[int, int], ...]
    size: int
    needers: tuple[int, ...]
    holders: tuple[tuple[int, ...], ...]
    root: int | None


@lru_cache(maxsize=4096)
def _exchange_flows(
    mesh: DeviceMesh, shape: tuple[int, ...], before: State, after: State
) -> tuple[tuple[_Flow, ...], dict[int, int], int]:
    """How an exchange from ``before`` to the Partial-free ``after`` moves every box of
    indices, the elements each device receives, and the rounds it takes.

    Per box with ``k`` Partial terms and ``m`` needers, the root (a needer holding a term where
    one does) receives the ``k - 1`` (or ``k``) terms it lacks in round one and sends the result
    to the ``m - 1`` other needers in round two; with one term every needer that lacks the box
    receives it once in round one. That is the per-element minimum of ``lower_bound_bytes``,
    so an exchange moves the fewest bytes any schedule can."""
    devices = mesh.device_ids
    coords = [mesh.coordinate_of(d) for d in devices]
    partial = [m for m, p in enumerate(before) if p.is_partial() and mesh.shape[m] > 1]
    old = [shard_segments(shape, mesh.shape, before, c) for c in coords]
    new = [shard_segments(shape, mesh.shape, after, c) for c in coords]
    spans = _spans(shape, old + new)
    old_masks = [_cover_masks(old, dim, s) for dim, s in enumerate(spans)]
    new_masks = [_cover_masks(new, dim, s) for dim, s in enumerate(spans)]
    term_masks: dict[tuple[int, ...], int] = {}
    for i, c in enumerate(coords):
        term = tuple(c[m] for m in partial)
        term_masks[term] = term_masks.get(term, 0) | 1 << i
    terms = [term_masks[t] for t in sorted(term_masks)]
    everyone = (1 << len(devices)) - 1
    flows = []
    received = dict.fromkeys(devices, 0)
    rounds = 1
    for index in itertools.product(*(range(len(s)) for s in spans)):
        need, hold = everyone, everyone
        for dim, k in enumerate(index):
            need &= new_masks[dim][k]
            hold &= old_masks[dim][k]
        block = tuple(s[k] for s, k in zip(spans, index, strict=True))
        size = prod(b - a for a, b in block)
        if not need or not size:
            continue
        needers = tuple(devices[i] for i in _bits(need))
        holders = tuple(tuple(devices[i] for i in _bits(hold & t)) for t in terms if hold & t)
        root = None
        if len(holders) == 1:
            for i in _bits(need & ~hold):
                received[devices[i]] += size
        else:
            candidates = [devices[i] for i in _bits(need & hold)] or list(needers)
            root = candidates[sum(index) % len(candidates)]  # spread the reductions
            received[root] += size * (len(holders) - any(root in h for h in holders))
            for d in needers:
                if d != root:
                    received[d] += size
                    rounds = 2
        flows.append(_Flow(block, size, needers, holders, root))
    return tuple(flows), received, rounds


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
    """Rounds one and two of an exchange (see ``_exchange_flows``) for every device. A term
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

    for flow in _exchange_flows(mesh, shape, before, after)[0]:
        block_shape = tuple(b - a for a, b in flow.block)
        for d in flow.needers:
            if flow.root not in (None, d):
                second[d].append((where(new[d], flow.block), block_shape,
                                  ((flow.root, where(new[flow.root], flow.block)),)))
                continue
            sources = []
            for holders in flow.holders:
                holder = min(holders, key=lambda h, d=d: (
                    h != d,
                    mesh.owner_of(h) != mesh.owner_of(d),
                    sum(x != y for x, y in zip(coords[h], coords[d], strict=True)),
                    h,
                ))
                sources.append((holder, where(old[holder], flow.block)))
            first[d].append((where(new[d], flow.block), block_shape, tuple(sources)))
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
        if isinstance(p, Partial) and p.reduce_op == "sum" and m not in kept
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
