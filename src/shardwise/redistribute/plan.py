"""Planning a redistribution: the cheapest per-mesh-dim steps from one placement tuple to another.

A step changes the placement of one mesh dim, or of several at once (an exchange: point to
point messages that may also reduce pending Partials). ``_Search`` walks the (small) space of
placement tuples with A*, pricing each step by the bytes every device of the mesh receives
(``pricing.Pricer``: the cost model of DESIGN.md, exact for uneven shards) and guessing what
is left by the lower bound (``geometry.block_transfers``). Plans are cached by data (the spec
and the target placements), and are the same in every process, so SPMD stays in step.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from math import prod

import torch

from ..caches import PER_GROUP, PER_LAYOUT, PER_SPEC, cached, register
from ..errors import InvalidPlacementError
from ..geometry import Pieces, Placements
from ..mesh import DeviceMesh
from ..placements import Partial, Placement, Replicate, Shard
from ..spec import LOW_PRECISION, DTensorSpec
from .cross_mesh import plan_cross_mesh
from .pricing import Collective, Pricer, shard_dim

State = Placements
Cost = tuple[int, int, int, int]  # bytes all devices receive, exchanges, collectives, steps
Index = tuple[int, ...]  # a state as the index of each mesh dim's placement in its options


@dataclass(frozen=True)
class Step:
    """One change of placement on one mesh dim, with the collective it needs. A "send/recv"
    step (explicit redistribution only, see ``plan_redistribute``) is the whole move at once,
    ``cross_mesh``'s point to point plan with the mesh as its own target: ``source`` and
    ``target`` are whole placement tuples, ``mesh_dim`` the dims its messages cross."""

    mesh_dim: int | tuple[int, ...]  # an exchange changes several mesh dims at once
    source: Placement | tuple[Placement, ...]
    target: Placement | tuple[Placement, ...]
    collective: Collective  # "local" when no data moves between devices
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
    # planned for an explicit redistribution, where a Shard may spread to a Partial target
    # (``plan_redistribute``'s ``spread``; a traced plan's key carries it)
    spread: bool = False

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.steps)

    @property
    def global_bytes(self) -> int:
        return sum(s.global_bytes for s in self.steps)


def after_step(state: State, step: Step) -> State:
    """The placements after ``step``."""
    if step.collective == "send/recv":
        return step.target
    if step.collective == "exchange":
        after = list(state)
        for m, p in zip(step.mesh_dim, step.target, strict=True):
            after[m] = p
        return tuple(after)
    return state[: step.mesh_dim] + (step.target,) + state[step.mesh_dim + 1 :]


def _step_kind(
    a: Placement, b: Placement, mesh_size: int, spread: bool = False
) -> Collective | None:
    """The collective that turns placement ``a`` into ``b`` on one mesh dim, None if no direct
    step exists (such moves go through Replicate). ``spread``: a Shard may reach a
    Partial("sum") or p-norm locally (explicit redistribution only, see ``plan_redistribute``)."""
    if mesh_size == 1:
        return "local"
    if isinstance(a, Replicate):
        return "local"  # Replicate -> Shard takes a chunk; Replicate -> Partial partitions
    if spread and isinstance(a, Shard) and isinstance(b, Partial) and b.zeros_elsewhere:
        return "local"  # each device keeps its piece in place, zeros around it (a spread)
    if isinstance(b, Replicate):
        return "all_reduce" if isinstance(a, Partial) else "all_gather"
    if isinstance(a, Partial):
        return "reduce_scatter" if isinstance(b, Shard) else None
    if type(a) is Shard and type(b) is Shard and a.dim != b.dim:
        return "all_to_all"
    return None


# ----- the steps worth trying ----------------------------------------------------------------

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


@cached(PER_GROUP)
def _moves(
    options: tuple[Placement, ...], mesh_size: int, spread: bool
) -> tuple[tuple[tuple[int, Collective], ...], ...]:
    """Per placement of ``options`` (distinct), the (index in ``options``, collective) of every
    other one a single step on a mesh dim of ``mesh_size`` reaches (a table of ``_step_kind``)."""
    return tuple(
        tuple((j, kind) for j, b in enumerate(options)
              if i != j and (kind := _step_kind(a, b, mesh_size, spread)) is not None)
        for i, a in enumerate(options)
    )


def _exchange_step(pricer: Pricer, state: State, settled: State) -> Step | None:
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
    return Step(dims, tuple(state[m] for m in dims), tuple(settled[m] for m in dims), "exchange",
                local_bytes, global_bytes, rounds)


def _direct_exchange(pricer: Pricer, source: State, settled: State, moved: int) -> Step:
    """``_exchange_step`` from ``source`` (plain placements, one reduce op) when it is known to
    move ``moved`` bytes over all devices, the lower bound: with every device in this process
    that is what they receive, in two rounds when several Partial terms reach several needers
    (see ``exchange_cost``); otherwise each device's share is worked out."""
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


# ----- the search ----------------------------------------------------------------------------


@dataclass(order=True, slots=True)
class _Entry:
    """A queued state: ordered by its guess of the whole plan's cost, then the furthest along
    first (minus the cost so far: it stops at the first of many equally cheap orders), then
    the first queued."""

    guess: Cost
    ahead: Cost
    number: int
    cost: Cost = field(compare=False)  # the cost so far
    state: Index = field(compare=False)
    exact: bool = field(compare=False)  # the guess is the heuristic's, not a bound below it


def _ahead(cost: Cost) -> Cost:
    return (-cost[0], -cost[1], -cost[2], -cost[3])


class _Search:
    """A* from ``source`` to ``target`` on (global bytes, exchanges, collectives, steps).

    An exchange is taken only when it moves fewer bytes than the named collectives. The bytes
    any plan from a state still moves (``Pricer.lacking``, the lower bound) guide the search
    (not towards a Partial target, where the guess is 0 bytes: a sum group needs the value on
    one member only, which ``lacking`` does not model, so a spread may cost nothing); so
    do the collectives and steps still needed without an exchange (a mesh dim leaves a
    placement other than Replicate only by a collective on it, except a Shard spreading to a
    Partial("sum") or p-norm target where ``spread`` allows it). An exchange straight from the
    source already moves the fewest bytes any schedule can (see ``exchange_cost``), so it
    bounds the search: states that cannot beat it are never expanded, and no later exchange
    can do better. Only mixed reduce ops, which it cannot resolve, need exchanges from states
    past the source.

    A state is searched as the indices of its placements in ``options`` (ints hash and
    compare in C, placements in Python); the source is all zeros."""

    def __init__(
        self, pricer: Pricer, source: State, target: State, spread: bool = False
    ) -> None:
        self.pricer, self.source, self.target = pricer, source, target
        self.sizes = sizes = pricer.mesh.shape
        self.options = options = _candidates(source, target, pricer.shape)
        self.settled_placements = tuple(Replicate() if p.is_partial() else p for p in target)
        self.start: Index = (0,) * len(sizes)
        self.goal = tuple(o.index(p) for o, p in zip(options, target, strict=True))
        self.settled = tuple(o.index(p) for o, p in zip(options, self.settled_placements,
                                                        strict=True))
        self.shard = [[shard_dim(p) for p in o] for o in options]
        # the reduce op of a Partial that needs reducing (mesh dim size > 1), else None
        self.op = [[p.reduce_op if isinstance(p, Partial) and n > 1 else None for p in o]
                   for o, n in zip(options, sizes, strict=True)]
        # per mesh dim, whether a Shard may spread locally to its target, a Partial (explicit
        # redistribution only)
        self.spread = [spread and isinstance(p, Partial) and p.zeros_elsewhere for p in target]
        self.moves = [_moves(tuple(o), n, s)
                      for o, n, s in zip(options, sizes, self.spread, strict=True)]
        self.replicate = [[p.is_replicate() for p in o] for o in options]
        self.partial = [[p.is_partial() for p in o] for o in options]
        self.pending = [[p.is_partial() and p.reduce_op in ("sum", "avg") for p in o]
                        for o in options]
        self.guided = not any(p.is_partial() and n > 1 for p, n in zip(target, sizes, strict=True))
        try:
            self.wanted = pricer.layout(target)
        except InvalidPlacementError:
            self.guided = False  # an interleave the target cannot hold: searched unguided
        self.needers = prod(n for n, p in zip(sizes, target, strict=True)
                            if not isinstance(p, Shard))
        self._placements: dict[Index, State] = {}
        self._layouts: dict[Index, Pieces] = {}
        self._guesses: dict[Index, Cost] = {}
        self._left: dict[Index, tuple[int, int]] = {}
        self.best: dict[Index, Cost] = {self.start: (0, 0, 0, 0)}
        # how each state was reached: (previous state, mesh dim, collective, bytes here, bytes
        # everywhere), or (previous state, exchange or None for the direct one built last)
        self.back: dict[Index, tuple] = {}
        self.heap: list[_Entry] = []
        self.order = itertools.count(1)
        self.limit: int | None = None

    # -- what a state is and what is left from it

    def decode(self, state: Index) -> State:
        found = self._placements.get(state)
        if found is None:
            found = self._placements[state] = tuple(
                o[i] for o, i in zip(self.options, state, strict=True)
            )
        return found

    def layout(self, state: Index) -> Pieces:
        found = self._layouts.get(state)
        if found is None:
            found = self._layouts[state] = self.pricer.layout(self.decode(state))
        return found

    def steps_left(self, state: Index) -> tuple[int, int]:
        """The collectives and steps still needed without an exchange."""
        left = self._left.get(state)
        if left is None:
            changed = [m for m, i in enumerate(state) if i != self.goal[m]]
            collectives = sum(self.sizes[m] > 1 and not self.replicate[m][state[m]]
                              and not (self.spread[m] and self.shard[m][state[m]] is not None)
                              for m in changed)
            left = self._left[state] = (collectives, len(changed))
        return left

    def guess(self, state: Index) -> Cost:
        """What any plan from ``state`` still costs at least (consistent: a step never lowers
        it by more than it costs)."""
        h = self._guesses.get(state)
        if h is None:
            moved = 0
            if self.guided:
                terms = prod(n for n, o, i in zip(self.sizes, self.partial, state, strict=True)
                             if o[i])
                moved = self.pricer.lacking_from(self.layout(state), self.wanted, terms,
                                                 self.needers)
            h = self._guesses[state] = (moved, 0, *self.steps_left(state))
        return h

    # -- the search

    def push(self, state: Index, cost: Cost, how: tuple) -> None:
        """Queue ``state`` at ``cost`` with its guess, if that is the cheapest way there."""
        if state not in self.best or cost < self.best[state]:
            self.best[state], self.back[state] = cost, how
            h = self.guess(state)
            key = (cost[0] + h[0], cost[1], cost[2] + h[2], cost[3] + h[3])
            heapq.heappush(self.heap, _Entry(key, _ahead(cost), next(self.order), cost, state,
                                             True))

    def bound(self) -> Step | None:
        """Queue the start and the exchange straight from the source, whose bytes bound the
        search (``limit``); return that exchange unless it is built only if taken."""
        h = self.guess(self.start)
        heapq.heappush(self.heap, _Entry(h, (0, 0, 0, 0), 0, (0, 0, 0, 0), self.start, True))
        source, settled = self.source, self.settled_placements
        ops = {p.reduce_op for p, n in zip(source, self.sizes, strict=True)
               if isinstance(p, Partial) and n > 1}
        plain = all(type(p) in (Shard, Replicate, Partial) for p in source + self.target)
        direct = None
        if self.guided and plain and len(ops) <= 1 and source != settled:
            # the exchange moves exactly the lower bound, the guess at the start (see
            # ``exchange_cost``): its step is built only if the plan takes it
            self.limit = h[0] // self.pricer.itemsize * self.pricer.size_of(source)
        else:
            direct = _exchange_step(self.pricer, source, settled)
            self.limit = None if direct is None else direct.global_bytes
        if self.limit is not None:
            self.push(self.settled, (self.limit, 1, 1, 1), (self.start, direct))
        return direct

    def run(self) -> None:
        """Pop states cheapest guess first until the goal comes out."""
        heap = self.heap
        while heap:
            entry = heapq.heappop(heap)
            if not entry.exact:
                self.requeue(entry)
            elif entry.state == self.goal:
                return
            elif entry.cost == self.best[entry.state]:  # else a cheaper way was queued later
                self.expand(entry)

    def requeue(self, entry: _Entry) -> None:
        """A state queued with a bound below its guess: the guess is worked out now, and the
        state queued again in the place the guess gives it (most never get here)."""
        if entry.cost != self.best[entry.state]:
            return
        try:
            h = self.guess(entry.state)
        except InvalidPlacementError:
            return  # an interleave that does not divide at this nesting level
        if self.limit is not None and entry.cost[0] + h[0] > self.limit:
            return
        heapq.heappush(self.heap, _Entry((entry.cost[0] + h[0], *entry.guess[1:]), entry.ahead,
                                         entry.number, entry.cost, entry.state, True))

    def moves_from(self, state: Index) -> Iterator[tuple[int, int, Collective, int | None]]:
        """(mesh dim, new placement index, collective, tensor dim it shards) of every single
        step allowed from ``state``. A mesh dim whose tensor dim a later mesh dim also shards
        cannot change directly (the lower mesh dim splits first), and mixed Partials reduce
        the lowest mesh dim first (PyTorch's order: another could change the value or, for
        sum and avg, its rounding)."""
        sharding = [self.shard[m][i] for m, i in enumerate(state)]
        ops = [self.op[m][i] for m, i in enumerate(state)]
        for m, a in enumerate(state):
            nested = sharding[m + 1:] if self.sizes[m] > 1 else ()
            if sharding[m] is not None and sharding[m] in nested:
                continue
            if ops[m] is not None and any(o not in (None, ops[m]) for o in ops[:m]):
                continue
            for b, kind in self.moves[m][a]:
                dim = self.shard[m][b]
                if dim is None or dim not in nested:
                    yield m, b, kind, dim

    def expand(self, entry: _Entry) -> None:
        """Queue every state one step from ``entry``'s, and the exchange from it when the
        search has no bound."""
        state = entry.state
        pending = any(o[i] for o, i in zip(self.pending, state, strict=True))
        size = self.pricer.pending_itemsize if pending else self.pricer.itemsize
        for m, b, kind, dim in self.moves_from(state):
            self.relax(entry, m, b, kind, dim, size)
        if self.limit is None:
            later = _exchange_step(self.pricer, self.decode(state), self.settled_placements)
            if later is not None:
                cost = entry.cost
                self.push(self.settled, (cost[0] + later.global_bytes, cost[1] + 1, cost[2] + 1,
                                         cost[3] + 1), (state, later))

    def relax(
        self, entry: _Entry, m: int, b: int, kind: Collective, dim: int | None, size: int
    ) -> None:
        """Queue the state that mesh dim ``m`` moving to option ``b`` by ``kind`` reaches, if
        this is the cheapest way there so far and it can still beat the bound."""
        state, cost = entry.state, entry.cost
        nxt = state[:m] + (b,) + state[m + 1 :]
        collective = kind != "local"
        known = self.best.get(nxt)
        if known is not None and known <= (cost[0], cost[1], cost[2] + collective, cost[3] + 1):
            return  # reached as cheaply already, whatever this step moves
        local_bytes = global_bytes = 0
        if collective:
            try:
                here = self.layout(state)
                local_bytes, global_bytes = self.pricer.price_from(
                    kind, here, self.layout(nxt) if kind in _RESHAPING else here, m, size, dim
                )
            except InvalidPlacementError:
                return  # an interleave that does not divide at this nesting level
        new = (cost[0] + global_bytes, cost[1], cost[2] + collective, cost[3] + 1)
        h = self._guesses.get(nxt)
        if h is None:  # queued on a bound (a step never lowers the guess), worked out later
            left = self.steps_left(nxt)
            key = (max(new[0], entry.guess[0]), new[1], new[2] + left[0], new[3] + left[1])
        elif self.limit is not None and new[0] + h[0] > self.limit:
            return
        else:
            key = (new[0] + h[0], new[1], new[2] + h[2], new[3] + h[3])
        if known is None or new < known:
            self.best[nxt] = new
            self.back[nxt] = (state, m, kind, local_bytes, global_bytes)
            heapq.heappush(self.heap, _Entry(key, _ahead(new), next(self.order), new, nxt,
                                             h is not None))

    def path(self) -> tuple[Step, ...]:
        """The steps from the start to the goal, in order."""
        steps: list[Step] = []
        state = self.goal
        while state != self.start:
            previous, *how = self.back[state]
            if len(how) == 1:
                steps.append(how[0] or _direct_exchange(
                    self.pricer, self.source, self.settled_placements, self.limit
                ))
            else:
                m, kind, local_bytes, global_bytes = how
                steps.append(Step(m, self.options[m][previous[m]], self.options[m][state[m]],
                                  kind, local_bytes, global_bytes))
            state = previous
        return tuple(reversed(steps))


@cached(PER_LAYOUT)
def _plan(
    mesh: DeviceMesh,
    shape: tuple[int, ...],
    itemsize: int,
    source: State,
    target: State,
    pending_itemsize: int | None = None,
    spread: bool = False,
) -> RedistributePlan:
    """The cheapest plan for these data (a fresh search each time it is not cached)."""
    search = _Search(Pricer(mesh, shape, itemsize, pending_itemsize), source, target, spread)
    search.bound()
    search.run()
    if search.goal not in search.best:
        raise InvalidPlacementError(
            f"no redistribution from {list(source)} to {list(target)} for shape {list(shape)} "
            f"on {mesh}"
        )
    return RedistributePlan(source, target, search.path(), shape, spread=spread)


def _spreads_to(target: Sequence[Placement]) -> bool:
    """Whether ``target`` has a Partial a Shard may spread to (sum, p-norms): where it has
    none, a plan allowing spreads is the plan without them."""
    return any(isinstance(p, Partial) and p.zeros_elsewhere for p in target)


def _point_to_point(spec: DTensorSpec, plan: RedistributePlan) -> RedistributePlan:
    """``plan``, or where it moves more bytes over all devices, one "send/recv" step: the
    cross-mesh plan with ``spec``'s mesh as its own target (targets whose Partials are sums).
    It reaches what per-mesh-dim steps cannot: a Partial("sum") target needs each block on one
    member of each sum group only, so a group that lacks it receives it once, not once per
    collective group of the other dims.
    Bytes are in the components' dtype (a float32 pending sum for a half-precision tensor)."""
    mesh = spec.mesh
    ops = {p.reduce_op for p, n in zip(plan.source, mesh.shape, strict=True)
           if isinstance(p, Partial) and n > 1}
    if len(ops) > 1 or any(isinstance(p, Partial) and p.reduce_op != "sum" and n > 1
                           for p, n in zip(plan.target, mesh.shape, strict=True)):
        # the cross-mesh plan reduces one op only, and its zeros are a target sum's: beside a
        # target max, avg or p-norm (reduced in mesh dim order) they would change the value
        return plan
    route = plan_cross_mesh(plan.shape, spec.component_dtype.itemsize, mesh, plan.source, mesh,
                            plan.target)
    if route.global_bytes >= plan.global_bytes:
        return plan
    step = Step(route.crossed_dims, plan.source, plan.target, "send/recv", route.bytes,
                route.global_bytes, route.rounds)
    return dataclasses.replace(plan, steps=(step,))


# plans by (spec, target, spread), bounded: oldest first out past the bound (the plans
# themselves are shared with ``_plan``'s cache, so this bound also bounds how many stay alive)
_PLANS: dict[tuple[DTensorSpec, State, bool], RedistributePlan] = {}
PLAN_CACHE_SIZE = PER_SPEC
register("shardwise.redistribute.plan._PLANS", _PLANS.clear)


def plan_redistribute(
    spec: DTensorSpec, placements: Sequence[Placement], *, spread: bool = False
) -> RedistributePlan:
    """The cheapest plan from ``spec`` to ``placements`` on the same mesh, cached per (spec,
    target) so a repeated redistribution costs one dictionary lookup (specs cache their hash);
    ``_plan`` shares the planning itself between specs that differ only in strides.

    ``spread`` lets a Shard reach a Partial("sum") or p-norm target without moving data: each
    device keeps its piece in place with zeros around it, a component as large as the whole
    tensor along that dim. Only an explicit redistribution (``DTensor.redistribute``,
    ``explain_redistribute``), whose caller asked for that Partial, passes it: an op's input
    moves never do, or a zero-byte spread would beat every real move, so ops in explicit mode
    would stop refusing and their components would grow to the whole tensor. With ``spread``
    the plan is one point to point "send/recv" step instead where that moves fewer bytes
    (``_point_to_point``)."""
    target = tuple(placements)
    spread = spread and _spreads_to(target)
    key = (spec, target, spread)
    plan = _PLANS.get(key)
    if plan is None:
        meta = spec.tensor_meta
        if meta.dtype in LOW_PRECISION:
            plan = _plan(spec.mesh, tuple(meta.shape), meta.dtype.itemsize, spec.placements,
                         target, torch.float32.itemsize, spread)
            start, end = spec.component_dtype, spec.with_placements(target).component_dtype
            if start != end:
                plan = dataclasses.replace(plan, cast=end)
        else:
            plan = _plan(spec.mesh, tuple(meta.shape), meta.dtype.itemsize, spec.placements,
                         target, None, spread)
        if spread:
            plan = _point_to_point(spec, plan)
        while len(_PLANS) >= PLAN_CACHE_SIZE:
            try:
                del _PLANS[next(iter(_PLANS))]
            except (KeyError, StopIteration, RuntimeError):  # another thread evicted it first
                break
        _PLANS[key] = plan
    return plan
