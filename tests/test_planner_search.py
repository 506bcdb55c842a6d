"""The planner's A* search: its guess is the lower bound (exact, and never lowered by a step,
which lets states be queued before their guess is worked out), the exchange it builds last
moves that bound, and its plans cost what an uninformed search over the same steps finds."""

from __future__ import annotations

import heapq
import itertools
import random

import pytest
import torch

import shardwise as sw
from shardwise import Partial, Replicate, Shard
from shardwise.geometry import lower_bound_bytes, pieces
from shardwise.redistribute.exchange import exchange_cost
from shardwise.redistribute.plan import (
    _candidates,
    _direct_exchange,
    _exchange_step,
    _plan,
    _step_kind,
)
from shardwise.redistribute.pricing import Pricer

SRP = [Shard(0), Shard(1), Shard(2), Replicate(), Partial()]
SETTLED = [Shard(0), Shard(1), Shard(2), Replicate()]
SHAPES = [(8, 4, 4), (5, 3, 7)]


def _cube() -> sw.DeviceMesh:
    return sw.DeviceMesh("meta", torch.arange(8).reshape(2, 2, 2))


def _pairs(count: int, seed: int, sources: list = SRP) -> list[tuple[tuple, tuple]]:
    pairs = list(itertools.product(itertools.product(sources, repeat=3),
                                   itertools.product(SETTLED, repeat=3)))
    return random.Random(seed).sample(pairs, count)


def _nested(state: tuple, m: int, p) -> bool:
    """A later mesh dim shards ``p``'s tensor dim too: no direct step on mesh dim ``m``."""
    return isinstance(p, Shard) and any(
        isinstance(q, Shard) and q.dim == p.dim for q in state[m + 1:]
    )


@pytest.mark.parametrize("shape", SHAPES)
def test_guess_is_the_bound_and_the_direct_exchange_moves_it(shape) -> None:
    """For plain placements and a Partial-free target the guess equals ``lower_bound_bytes``,
    and so do the bytes of the exchange straight from the source (sum or max Partials), which
    the planner therefore builds only when its plan takes it: same step, same rounds."""
    mesh = _cube()
    pricer = Pricer(mesh, shape, 2, 4)  # a half-precision sum moves float32 pieces
    sources = [*SRP, Partial("max")]
    for source, target in _pairs(120, 3, sources):
        if len({p.reduce_op for p in source if isinstance(p, Partial)}) > 1:
            continue
        bound = lower_bound_bytes(mesh, shape, 2, source, target)
        assert pricer.lacking(source, target) == bound, (source, target)
        if source == target:
            continue
        received, _ = exchange_cost(mesh, shape, source, target)
        assert 2 * sum(received) == bound, (source, target)
        moved = bound // 2 * pricer.size_of(source)
        assert _direct_exchange(pricer, source, target, moved) == _exchange_step(
            pricer, source, target
        ), (source, target)


@pytest.mark.parametrize("shape", SHAPES)
def test_a_step_never_lowers_the_guess(shape) -> None:
    """Consistency: the guess before a step is at most the step's bytes plus the guess after
    it, for every step the planner may take (so a state's guess is at least its parent's)."""
    mesh = _cube()
    pricer = Pricer(mesh, shape, 4)
    states = list(itertools.product(SRP, repeat=3))
    for target in random.Random(5).sample(list(itertools.product(SETTLED, repeat=3)), 12):
        guess = {s: pricer.lacking(s, target) for s in states}
        for state in states:
            for m, b in itertools.product(range(3), SRP):
                a = state[m]
                kind = None if a == b else _step_kind(a, b, mesh.shape[m])
                if kind is None or _nested(state, m, a) or _nested(state, m, b):
                    continue
                after = state[:m] + (b,) + state[m + 1:]
                moved = pricer.price(kind, state, after, m)[1]
                assert guess[state] <= moved + guess[after], (state, after, target)


def _cheapest(
    mesh: sw.DeviceMesh, shape: tuple, source: tuple, target: tuple, spread: bool = False
) -> tuple:
    """(bytes, exchanges, collectives, steps) of the cheapest plan by Dijkstra without a
    guess, over the planner's placements per mesh dim, its steps (with ``spread``, a Shard
    reaching a Partial target locally) and the exchange straight from the source (one reduce
    op) to the target with Replicate for its Partials."""
    pricer = Pricer(mesh, shape, 4)
    options = _candidates(source, target, shape)
    best = {source: (0, 0, 0, 0)}
    order = itertools.count()
    queue = [((0, 0, 0, 0), next(order), source)]
    settled = tuple(Replicate() if p.is_partial() else p for p in target)
    exchange = _exchange_step(pricer, source, settled)
    if exchange is not None:
        best[settled] = (exchange.global_bytes, 1, 1, 1)
        heapq.heappush(queue, (best[settled], next(order), settled))
    while queue:
        cost, _, state = heapq.heappop(queue)
        if state == target:
            return cost
        if cost != best[state]:
            continue
        for m in range(mesh.ndim):
            for b in options[m]:
                a = state[m]
                kind = None if a == b else _step_kind(a, b, mesh.shape[m],
                                                      spread and target[m].is_partial())
                if kind is None or _nested(state, m, a) or _nested(state, m, b):
                    continue
                after = state[:m] + (b,) + state[m + 1:]
                try:
                    moved = pricer.price(kind, state, after, m)[1]
                except sw.errors.InvalidPlacementError:
                    continue
                new = (cost[0] + moved, cost[1], cost[2] + (kind != "local"), cost[3] + 1)
                if after not in best or new < best[after]:
                    best[after] = new
                    heapq.heappush(queue, (new, next(order), after))
    raise AssertionError(f"no plan from {source} to {target}")


@pytest.mark.parametrize("shape", SHAPES)
def test_plans_cost_what_an_uninformed_search_finds(shape) -> None:
    """A* with its guess, queued bounds and furthest-first ties finds plans exactly as cheap
    (bytes, then exchanges, collectives and steps) as Dijkstra over the same steps."""
    mesh = _cube()
    for source, target in _pairs(60, 11):
        _plan.cache_clear()
        plan = _plan(mesh, shape, 4, source, target)
        found = (
            plan.global_bytes,
            sum(s.collective == "exchange" for s in plan.steps),
            sum(s.collective != "local" for s in plan.steps),
            len(plan.steps),
        )
        assert found == _cheapest(mesh, shape, source, target), (source, target, plan)


def test_box_keys_are_data() -> None:
    """The geometry cache holds data only: a box's key is a function of the box (equal keys
    exactly for equal boxes, over every layout met), so dropping the cache between layouts
    (as an eviction does) cannot make two boxes share a key: every guess stays the bound,
    in whatever order pricers meet the states."""
    mesh = _cube()
    shape = (8, 4, 4)
    pairs = _pairs(60, 17, SETTLED)
    first, second = Pricer(mesh, shape, 4), Pricer(mesh, shape, 4)
    for source, target in pairs:
        first.layout(source)
        pieces.cache_clear()
        first.layout(target)
    for source, target in reversed(pairs):
        second.layout(target)
        pieces.cache_clear()
        second.layout(source)
    boxes = {}
    for state in {s for pair in pairs for s in pair}:
        held = pieces(mesh, shape, state)
        assert held == pieces.__wrapped__(mesh, shape, state)
        for box, key in zip(held.boxes, held.keys, strict=True):
            assert boxes.setdefault(key, box) == box
    assert len(set(boxes.values())) == len(boxes)
    for source, target in pairs:
        bound = lower_bound_bytes(mesh, shape, 4, source, target)
        assert first.lacking(source, target) == second.lacking(source, target) == bound


@pytest.mark.parametrize("mesh_shape", [(2, 2), (2, 2, 2)])
def test_explicit_plans_to_partial_targets_cost_what_an_uninformed_search_finds(
    mesh_shape,
) -> None:
    """With spreads allowed (explicit redistribution), plans to targets holding a
    Partial("sum") are as cheap as Dijkstra over the same steps: every pair that spreads and
    collectives can bring to the lower bound is planned at it (all 2-D pairs, a sample of
    3-D ones)."""
    mesh = sw.DeviceMesh("meta", torch.arange(4 if len(mesh_shape) == 2 else 8).reshape(mesh_shape))
    shape = (8, 4, 4)
    states = list(itertools.product(SRP, repeat=len(mesh_shape)))
    pairs = [(s, t) for s in states for t in states if any(p.is_partial() for p in t)]
    if len(mesh_shape) == 3:
        pairs = random.Random(19).sample(pairs, 60)
    for source, target in pairs:
        plan = _plan(mesh, shape, 4, source, target, None, True)
        found = (
            plan.global_bytes,
            sum(s.collective == "exchange" for s in plan.steps),
            sum(s.collective != "local" for s in plan.steps),
            len(plan.steps),
        )
        assert found == _cheapest(mesh, shape, source, target, spread=True), (source, target)
