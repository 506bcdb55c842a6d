"""Redistribution: plan the cheapest per-mesh-dim steps from one spec to another, and run them.

A step changes the placement of one mesh dim. The planner searches the (small) space of
placement tuples with Dijkstra, pricing each step by the bytes every device of the mesh
receives (the cost model of DESIGN.md, exact for uneven shards), and caches the plan per
(source spec, target placements). Plans are the same in every process, so SPMD stays in step.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Sequence
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


@dataclass(frozen=True)
class Step:
    """One change of placement on one mesh dim, with the collective it needs."""

    mesh_dim: int | tuple[int, ...]  # an exchange changes several mesh dims at once
    source: Placement | tuple[Placement, ...]
    target: Placement | tuple[Placement, ...]
    collective: str  # a comm kind, or "local" when no data moves between devices
    bytes: int  # received by this process's devices (what CommCounter counts)
    global_bytes: int  # received by all devices of the mesh (the planner's cost)

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
    """Bytes received per device for a step, from shard geometry alone. A half-precision sum
    moves its float32 pieces while it is pending (``pending_itemsize``)."""

    def __init__(
        self, mesh: DeviceMesh, shape: tuple[int, ...], itemsize: int, pending_itemsize: int
    ) -> None:
        self.mesh, self.shape, self.itemsize = mesh, shape, itemsize
        self.pending_itemsize = pending_itemsize
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

    def size_of(self, state: State) -> int:
        """Bytes per element of the components held in ``state``."""
        return self.pending_itemsize if pending_sum(state) else self.itemsize

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

    def exchange_price(self, before: State, after: State) -> tuple[int, int]:
        """(bytes for this process's devices, bytes for all devices) of an exchange: every
        device receives, for its new piece, each of the ``k`` Partial terms (1 without
        Partial) it does not hold itself."""
        terms = prod(n for n, p in zip(self.mesh.shape, before, strict=True) if p.is_partial())
        local_total = global_total = 0
        for device in self.mesh.device_ids:
            coord = self.mesh.coordinate_of(device)
            old = shard_segments(self.shape, self.mesh.shape, before, coord)
            new = shard_segments(self.shape, self.mesh.shape, after, coord)
            kept = prod(_overlap(a, b) for a, b in zip(old, new, strict=True))
            got = (terms * prod(self.local_shape(after, coord)) - kept) * self.size_of(before)
            global_total += got
            if device in self.local:
                local_total += got
        return local_total, global_total

    def _received(self, kind, before, after, mesh_dim, coords, k, n) -> int:
        size = self.size_of(before)
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
        local_bytes, global_bytes = pricer.exchange_price(state, settled)
    except InvalidPlacementError:
        return None  # an interleave that does not divide at this nesting level
    return Step(
        dims,
        tuple(state[m] for m in dims),
        tuple(settled[m] for m in dims),
        "exchange",
        local_bytes,
        global_bytes,
    )


@lru_cache(maxsize=4096)
def _plan(
    mesh: DeviceMesh,
    shape: tuple[int, ...],
    itemsize: int,
    source: State,
    target: State,
    pending_itemsize: int | None = None,
) -> RedistributePlan:
    pricer = _Pricer(mesh, shape, itemsize, pending_itemsize or itemsize)
    options = [_candidates(source, target, m, shape) for m in range(mesh.ndim)]
    settled = tuple(Replicate() if p.is_partial() else p for p in target)
    # Dijkstra on (global bytes, exchanges, collectives, steps): an exchange is taken only
    # when it moves fewer bytes than the named collectives; ties keep the first found.
    best: dict[State, tuple[int, int, int, int]] = {source: (0, 0, 0, 0)}
    back: dict[State, tuple[State, Step]] = {}
    heap: list[tuple[tuple[int, int, int, int], int, State]] = [((0, 0, 0, 0), 0, source)]
    counter = 0
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
                if nxt not in best or new_cost < best[nxt]:
                    best[nxt] = new_cost
                    back[nxt] = (state, Step(m, a, b, kind, local_bytes, global_bytes))
                    counter += 1
                    heapq.heappush(heap, (new_cost, counter, nxt))
        direct = _exchange_step(pricer, state, settled)
        if direct is not None:
            new_cost = (cost[0] + direct.global_bytes, cost[1] + 1, cost[2] + 1, cost[3] + 1)
            if settled not in best or new_cost < best[settled]:
                best[settled] = new_cost
                back[settled] = (state, direct)
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
        if step.collective == "exchange":
            after = list(state)
            for m, p in zip(step.mesh_dim, step.target, strict=True):
                after[m] = p
            out = _run_exchange(mesh, plan.shape, state, tuple(after), step.mesh_dim, out)
            state = tuple(after)
        else:
            out = _run_step(step, mesh, out)
            state = state[: step.mesh_dim] + (step.target,) + state[step.mesh_dim + 1 :]
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


# per device: for each block of its new piece, where it goes in the new piece, its shape, and
# (holder, where it is in the holder's old piece) for each Partial term in reduction order
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
) -> dict[int, Route]:
    """For every device, each block of its new piece and, for each Partial term of the old
    placements (one term without Partial), the device it comes from: itself when it holds
    it, else a holder in its own process, else the nearest holder by mesh coordinate, then
    the lowest id."""
    devices = mesh.device_ids
    coords = {d: mesh.coordinate_of(d) for d in devices}
    partial = [m for m, p in enumerate(before) if p.is_partial()]
    term = {d: tuple(coords[d][m] for m in partial) for d in devices}
    old = {d: shard_segments(shape, mesh.shape, before, coords[d]) for d in devices}
    new = {d: shard_segments(shape, mesh.shape, after, coords[d]) for d in devices}
    blocks = _blocks(shape, [*old.values(), *new.values()])
    routes: dict[int, Route] = {}
    for d in devices:
        route = []
        for block in blocks:
            if prod(b - a for a, b in block) == 0 or not _covers(new[d], block):
                continue
            holders: dict[tuple[int, ...], list[int]] = {}
            for h in devices:
                if _covers(old[h], block):
                    holders.setdefault(term[h], []).append(h)
            sources = []
            for t in sorted(holders):
                holder = min(holders[t], key=lambda h: (
                    h != d,
                    mesh.owner_of(h) != mesh.owner_of(d),
                    sum(x != y for x, y in zip(coords[h], coords[d], strict=True)),
                    h,
                ))
                src = tuple(_local_slice(r, a, b) for r, (a, b) in zip(old[holder], block,
                                                                         strict=True))
                sources.append((holder, src))
            dst = tuple(_local_slice(r, a, b) for r, (a, b) in zip(new[d], block, strict=True))
            route.append((dst, tuple(b - a for a, b in block), tuple(sources)))
        routes[d] = tuple(route)
    return routes


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
    terms are reduced in term order, the same in every process."""
    sample = components[0]
    routes = _routes(mesh, shape, before, after)
    ops = {
        p.reduce_op for m, p in enumerate(before) if isinstance(p, Partial) and mesh.shape[m] > 1
    }
    op = ops.pop() if ops else None  # the planner exchanges only Partials that reduce alike
    local = mesh.local_device_ids
    index = {d: i for i, d in enumerate(local)}
    sends: list[list[tuple[int, torch.Tensor]]] = [[] for _ in local]
    receives: list[list[tuple[int, tuple[int, ...]]]] = [[] for _ in local]
    for d in mesh.device_ids:
        for _, block_shape, sources in routes[d]:
            for holder, src in sources:
                if holder == d:
                    continue
                if holder in index:
                    sends[index[holder]].append((d, components[index[holder]][src]))
                if d in index:
                    receives[index[d]].append((holder, block_shape))
    received = comm.exchange(mesh, mesh_dims, sends, receives, sample.dtype)
    out = []
    for i, d in enumerate(local):
        coord = mesh.coordinate_of(d)
        runs = shard_segments(shape, mesh.shape, after, coord)
        piece = sample.new_empty(tuple(sum(b - a for a, b in r) for r in runs))
        incoming = iter(received[i])
        for dst, _, sources in routes[d]:
            terms = [components[i][src] if h == d else next(incoming) for h, src in sources]
            if len(terms) == 1:
                piece[dst] = terms[0]
            else:
                piece[dst] = comm.reduce_terms(terms, op)
        out.append(piece)
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
    cuts = [{0, size} for size in shape]
    for segments in pieces:
        for dim, runs in enumerate(segments):
            for a, b in runs:
                cuts[dim].update((a, b))
    edges = [sorted(c) for c in cuts]
    spans = [list(zip(e[:-1], e[1:], strict=False)) or [(0, 0)] for e in edges]
    out: list[tuple[tuple[int, int], ...]] = [()]
    for dim_spans in spans:
        out = [b + (s,) for b in out for s in dim_spans]
    return out


def _covers(segments: tuple, block: tuple[tuple[int, int], ...]) -> bool:
    return all(
        any(a <= lo and hi <= b for a, b in runs)
        for runs, (lo, hi) in zip(segments, block, strict=True)
    )
