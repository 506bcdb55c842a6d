"""The planner's lower bound: checked element by element against an independent count, never
above a plan's bytes, and reached by 1-D plans and by Partial resolution on n-D meshes."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardwise as sw
from conftest import (
    NotDivisible,
    cases,
    check_components,
    components_for,
    make_tensor,
    placements_for,
    ref_coords,
    ref_indices,
)
from shardwise import Partial, Replicate, Shard
from shardwise.redistribute import lower_bound_bytes, plan_redistribute
from shardwise.redistribute.pricing import Pricer
from shardwise.spec import DTensorSpec, contiguous_meta, validate_placements


def _held(shape, mesh, placements, coord) -> set[tuple[int, ...]]:
    return set(itertools.product(*ref_indices(shape, mesh.shape, placements, coord)))


def _ref_bound(shape, mesh, source, target) -> int:
    """Transfers per element, element by element (see ``lower_bound_bytes`` for the model)."""
    coords = ref_coords(mesh.mesh)
    devices = sorted(coords)
    kept = [m for m, p in enumerate(source) if p.is_partial() and target[m] == p]
    partial = [
        m for m, p in enumerate(source) if p.is_partial() and mesh.shape[m] > 1 and m not in kept
    ]
    summed = [
        m for m, p in enumerate(target)
        if isinstance(p, Partial) and p.reduce_op == "sum" and m not in kept
    ]
    src = {d: _held(shape, mesh, source, coords[d]) for d in devices}
    dst = {d: _held(shape, mesh, target, coords[d]) for d in devices}
    total = 0
    for element in itertools.product(*(range(s) for s in shape)):
        holders = [d for d in devices if element in src[d]]
        needers = [d for d in devices if element in dst[d]]
        if summed:
            chosen: dict = {}
            for d in sorted(needers, key=lambda d: d not in holders):
                key = tuple(c for m, c in enumerate(coords[d]) if m not in summed)
                chosen.setdefault(key, d)
            needers = list(chosen.values())
        terms = {tuple(coords[d][m] for m in partial) for d in holders}
        if len(terms) <= 1:
            total += sum(d not in holders for d in needers)
        else:
            total += len(terms) + len(needers) - 1 - any(d in needers for d in holders)
    return total


@settings(max_examples=60, deadline=None)
@given(cases(max_dims=3), st.data())
def test_bound_counts_elements_and_never_beats_the_plan(case, data) -> None:
    target = data.draw(placements_for(case.shape, case.mesh_shape))
    shape, mesh = tuple(case.shape), case.mesh
    try:
        source = validate_placements(shape, mesh, case.placements)
        target = validate_placements(shape, mesh, target)
    except sw.errors.InvalidPlacementError:
        return
    try:
        expected = _ref_bound(shape, mesh, source, target)
    except NotDivisible:
        return
    bound = lower_bound_bytes(mesh, shape, 4, source, target)
    assert bound == 4 * expected
    x = torch.zeros(shape)
    dt = sw.distribute_tensor(x, mesh, [Replicate()] * mesh.ndim)
    spec = dt._spec.with_placements(source)
    planned = plan_redistribute(spec, target).global_bytes
    assert planned >= bound
    if not any(p.is_partial() for p in target):  # the planner's A* heuristic is admissible
        assert Pricer(mesh, shape, 4).lacking(source, target) <= bound
    if _exchange_reaches_the_bound(mesh, source, target):
        assert planned == bound


def _exchange_reaches_the_bound(mesh: sw.DeviceMesh, source: tuple, target: tuple) -> bool:
    """Where the planner is exact by construction: an exchange straight from ``source``
    resolves its Partials (one reduce op) into a Partial-free ``target`` at the bound."""
    ops = {p.reduce_op for p, n in zip(source, mesh.shape, strict=True)
           if isinstance(p, Partial) and n > 1}
    plain = all(type(p) in (Shard, Replicate, Partial) for p in source + target)
    return plain and len(ops) <= 1 and not any(p.is_partial() for p in target)


ONE_D = [Shard(0), Shard(1), Replicate(), Partial("sum"), Partial("max")]


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("shape", [(8, 6), (7, 5), (2, 9)])
def test_one_dimensional_plans_reach_the_bound(n: int, shape: tuple[int, int]) -> None:
    """On one mesh dim every collective of the ring model moves exactly what must move."""
    mesh = sw.init_device_mesh("cpu", (n,))
    for source, target in itertools.product(ONE_D, ONE_D):
        if target.is_partial():
            continue
        spec = DTensorSpec(mesh, (source,), contiguous_meta(shape, torch.float32))
        plan = plan_redistribute(spec, (target,))
        bound = lower_bound_bytes(mesh, shape, 4, (source,), (target,))
        assert plan.global_bytes == bound, (source, target, plan)


def test_partial_resolves_at_the_bound_on_a_cube() -> None:
    """reduce_scatter down the mesh dims, then all_gather back up: the ring all-reduce bound
    2(N-1)/N per device over all 8 devices, where successive all_reduces move 12/7 of it."""
    mesh = sw.init_device_mesh("cpu", (2, 2, 2))
    parts = [torch.randn(8, 6) for _ in range(8)]
    dt = sw.DTensor.from_local(parts, mesh, [Partial()] * 3)
    target = [Replicate()] * 3
    plan = sw.debug.explain_redistribute(dt, target)
    assert plan.global_bytes == plan.lower_bound == 8 * 2 * 7 * (8 * 6 * 4) // 8
    with sw.debug.CommCounter() as counter:
        out = dt.redistribute(placements=target)
    assert counter.total_bytes == plan.bytes
    expected = parts[0]
    for p in parts[1:]:
        expected = expected + p
    torch.testing.assert_close(out.full_tensor(), expected)


SRP = [Shard(0), Shard(1), Shard(2), Replicate(), Partial()]


def _pairs(ndim: int) -> list[tuple[tuple, tuple]]:
    states = list(itertools.product(SRP, repeat=ndim))
    return [(s, t) for s in states for t in states if not any(p.is_partial() for p in t)]


def _check_pair(mesh: sw.DeviceMesh, x: torch.Tensor, source: tuple, target: tuple) -> None:
    """The plan moves exactly the bound, and running it gives the oracle's values with the
    bytes the plan priced."""
    shape = tuple(x.shape)
    dt = sw.DTensor.from_local(components_for(x, mesh, source, 7), mesh, source, shape=shape)
    plan = sw.debug.explain_redistribute(dt, target)
    assert plan.global_bytes == plan.lower_bound == lower_bound_bytes(
        mesh, shape, 4, source, target
    ), (source, target, plan)
    with sw.debug.CommCounter() as counter:
        out = dt.redistribute(placements=target)
    assert counter.total_bytes == plan.bytes
    check_components(sw.local_components(out), x, mesh, target)
    assert torch.equal(out.full_tensor(), x)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
@pytest.mark.parametrize("shape", [(8, 4, 4), (5, 3, 7)])
def test_every_srp_pair_reaches_the_bound_and_the_values(mesh_shape, shape) -> None:
    """Every Shard/Replicate/Partial source to every Partial-free target, even and uneven
    shapes (some shards empty)."""
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    x = make_tensor(shape, torch.float32, 3)
    for source, target in _pairs(len(mesh_shape)):
        _check_pair(mesh, x, source, target)


@pytest.mark.parametrize("shape", [(8, 4, 4), (5, 3, 7)])
def test_cube_srp_pairs_reach_the_bound_and_the_values(shape) -> None:
    """A fixed sample of the 8000 pairs on a 2x2x2 mesh (all of them run in the benchmark)."""
    mesh = sw.init_device_mesh("cpu", (2, 2, 2))
    x = make_tensor(shape, torch.float32, 5)
    for source, target in random.Random(13).sample(_pairs(3), 300):
        _check_pair(mesh, x, source, target)


def _partial_pairs(ndim: int) -> list[tuple[tuple, tuple]]:
    states = list(itertools.product(SRP, repeat=ndim))
    return [(s, t) for s in states for t in states if any(p.is_partial() for p in t)]


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
@pytest.mark.parametrize("shape", [(8, 4, 4), (5, 3, 7)])
def test_every_srp_pair_to_a_partial_target(mesh_shape, shape) -> None:
    """Every Shard/Replicate/Partial source to every target with a Partial("sum"): the
    reference values with the bytes the plan priced, never below the bound nor above the plan
    to the target with Replicate for its Partials (then partitioned for free), and always at
    the bound: on one mesh dim a Shard spreads locally, a Partial reduce_scatters then spreads;
    on (2, 2) where per-mesh-dim steps cannot reach it, one point to point send/recv step."""
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    x = make_tensor(shape, torch.float32, 3)
    for source, target in _partial_pairs(len(mesh_shape)):
        dt = sw.DTensor.from_local(components_for(x, mesh, source, 7), mesh, source, shape=shape)
        plan = sw.debug.explain_redistribute(dt, target)
        assert plan.lower_bound == 4 * _ref_bound(shape, mesh, source, target)
        assert plan.global_bytes >= plan.lower_bound
        settled = [Replicate() if p.is_partial() else p for p in target]
        assert plan.global_bytes <= sw.debug.explain_redistribute(dt, settled).global_bytes
        assert plan.global_bytes == plan.lower_bound, (source, target, plan)
        with sw.debug.CommCounter() as counter:
            out = dt.redistribute(placements=target)
        assert counter.total_bytes == plan.bytes
        check_components(sw.local_components(out), x, mesh, target)
        assert torch.equal(out.full_tensor(), x)
