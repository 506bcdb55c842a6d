"""Redistribution: exact round trips, byte accounting equal to the plan, cheapest plans.

Expected byte figures are derived here from the ring cost model of DESIGN.md: a device receives
(n-1)/n of the full piece for all_gather and reduce_scatter, 2(n-1)/n for all_reduce and
(n-1)/n of its local piece for all_to_all (exactly: what the other members hold of its piece).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import shardwise as sw
from conftest import (
    Case,
    cases,
    check_components,
    components_for,
    make_tensor,
    meshes,
    placements_for,
    ref_chunk,
    ref_coords,
    ref_indices,
    tensor_shapes,
)
from shardwise import DeviceMesh, InterleavedShard, Partial, Placement, Replicate, Shard
from shardwise.redistribute import cross_mesh_lower_bound_bytes, plan_redistribute


def _positive(p: Placement, rank: int) -> Placement:
    if isinstance(p, InterleavedShard):
        return InterleavedShard(p.dim % rank, p.interleaved_size)
    return Shard(p.dim % rank) if isinstance(p, Shard) else p


@st.composite
def transitions(draw: st.DrawFn, max_dims: int = 3) -> tuple:
    case = draw(cases(max_dims))
    target = draw(placements_for(case.shape, case.mesh_shape))
    return case, target


@given(transitions(), st.integers(0, 2**16))
def test_redistribute_round_trips_exactly(transition: tuple, seed: int) -> None:
    case, target = transition
    x = make_tensor(case.shape, case.dtype, seed)
    if case.dtype.is_floating_point is False and _has_avg(case.placements, target):
        # the mean of integers is not an integer: Partial("avg") refuses them (issue 7)
        with pytest.raises(sw.errors.InvalidPlacementError, match="Partial\\('avg'\\) needs"):
            sw.DTensor.from_local(
                components_for(x, case.mesh, case.placements, seed), case.mesh, case.placements
            ).redistribute(case.mesh, target)
        return
    dt = sw.DTensor.from_local(
        components_for(x, case.mesh, case.placements, seed), case.mesh, case.placements
    )
    plan = sw.debug.explain_redistribute(dt, target)
    with sw.debug.CommCounter() as counter:
        out = dt.redistribute(case.mesh, target)
    assert out.placements == tuple(_positive(p, len(case.shape)) for p in target)
    assert out.shape == x.shape and out.dtype == x.dtype
    check_components(sw.local_components(out), x, case.mesh, target,
                     rounded=_has_avg(case.placements, target))
    # avg Partials divide, so the order of reduction rounds differently: compare to float
    # tolerance there, exactly everywhere else
    same = torch.testing.assert_close if _has_avg(case.placements, target) else _assert_equal
    same(out.full_tensor(), x)
    same(out.redistribute(placements=case.placements).full_tensor(), x)
    # the counted communication is exactly the plan
    moving = [s for s in plan.steps if s.collective != "local"]
    assert all(s.bytes == 0 for s in plan.steps if s.collective == "local")
    # a reducing exchange runs in two rounds, each counted
    assert counter.counts == Counter(s.collective for s in moving for _ in range(s.rounds))
    expected_bytes: Counter = Counter()
    for s in moving:
        expected_bytes[s.collective] += s.bytes
    assert +counter.bytes == +expected_bytes
    assert counter.total_bytes == plan.bytes


def _has_avg(*placement_lists: tuple) -> bool:
    return any(p == Partial("avg") for ps in placement_lists for p in ps)


def _assert_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(a, b), (a, b)


def _chunk_lengths(size: int, n: int) -> list[int]:
    return [len(ref_chunk(list(range(size)), n, k)) for k in range(n)]


def _cheapest_1d(
    shape: tuple[int, ...], n: int, source: Placement, target: Placement, itemsize: int
) -> int:
    """Bytes all devices of a 1-D mesh receive on the cheapest way from source to target."""
    full = math.prod(shape) * itemsize
    if n == 1 or source == target or isinstance(source, Replicate):
        return 0
    if isinstance(source, Shard) and isinstance(target, Partial) and target.zeros_elsewhere:
        return 0  # each device keeps its piece in place, zeros around it
    gather = (n - 1) * full  # every device receives what the n-1 others hold
    if isinstance(source, Partial):
        # reduce_scatter straight to a shard (then spread to a sum); else all_reduce (2(n-1)/n
        # per device)
        spread = isinstance(target, Partial) and target.zeros_elsewhere
        return gather if isinstance(target, Shard) or spread else 2 * gather
    if type(source) is Shard and type(target) is Shard:
        d, e = source.dim, target.dim
        rest = full // (shape[d] * shape[e]) if shape[d] * shape[e] else 0
        lens_d, lens_e = _chunk_lengths(shape[d], n), _chunk_lengths(shape[e], n)
        # device k receives, from every other j, j's rows of dim d crossed with k's new part
        return sum(lens_e[k] * (shape[d] - lens_d[k]) * rest for k in range(n))
    through_replicate = gather
    if isinstance(target, Shard):  # or an exchange: each device receives what it lacks
        def piece(p: Placement, k: int) -> set:
            return set(itertools.product(*ref_indices(shape, (n,), [p], (k,))))

        held, wanted = [piece(source, k) for k in range(n)], [piece(target, k) for k in range(n)]
        exchange = sum(len(wanted[k] - held[k]) for k in range(n)) * itemsize
        return min(through_replicate, exchange)
    return through_replicate


@given(cases(max_dims=1), st.data())
def test_1d_plan_is_the_cheapest(case: Case, data: st.DataObject) -> None:
    target = data.draw(placements_for(case.shape, case.mesh_shape))
    x = torch.zeros(case.shape, dtype=case.dtype)
    dt = sw.distribute_tensor(x, case.mesh, case.placements)
    plan = sw.debug.explain_redistribute(dt, target)
    rank = len(case.shape)
    expected = _cheapest_1d(
        case.shape,
        case.mesh_shape[0],
        _positive(case.placements[0], rank),
        _positive(target[0], rank),
        x.element_size(),
    )
    assert plan.bytes == expected, plan


def _run(
    dt: sw.DTensor, target: list[Placement]
) -> tuple[sw.redistribute.RedistributePlan, Counter, int]:
    plan = sw.debug.explain_redistribute(dt, target)
    with sw.debug.CommCounter() as counter:
        dt.redistribute(placements=target)
    return plan, counter, counter.total_bytes


MESH4 = DeviceMesh("cpu", [0, 1, 2, 3])
X = torch.arange(96.0).reshape(8, 12)  # float32: 384 bytes, 96 per device when sharded


def test_shard_to_shard_is_one_all_to_all() -> None:
    plan, counter, total = _run(sw.distribute_tensor(X, MESH4, [Shard(0)]), [Shard(1)])
    assert [(s.collective, s.mesh_dim) for s in plan.steps] == [("all_to_all", 0)]
    # each device keeps 1/4 of its 96 bytes and receives 3/4: 72 bytes, 4 devices
    assert plan.bytes == total == 4 * 72
    assert counter.counts == {"all_to_all": 1}


def test_partial_to_shard_is_one_reduce_scatter() -> None:
    plan, counter, total = _run(sw.distribute_tensor(X, MESH4, [Partial()]), [Shard(1)])
    assert [(s.collective, s.mesh_dim) for s in plan.steps] == [("reduce_scatter", 0)]
    # (n-1)/n of the full 384 bytes per device
    assert plan.bytes == total == 4 * 288
    assert counter.counts == {"reduce_scatter": 1}


def test_partial_to_replicate_is_one_all_reduce() -> None:
    plan, counter, total = _run(sw.distribute_tensor(X, MESH4, [Partial("max")]), [Replicate()])
    assert [s.collective for s in plan.steps] == ["all_reduce"]
    assert plan.bytes == total == 4 * 2 * 288
    assert counter.counts == {"all_reduce": 1}


@pytest.mark.parametrize(
    "target", [[Shard(1)], [Shard(0)], [InterleavedShard(1, 3)], [Partial()], [Partial("min")]]
)
def test_from_replicate_moves_nothing(target: list[Placement]) -> None:
    dt = sw.distribute_tensor(X, MESH4, [Replicate()])
    plan, counter, total = _run(dt, target)
    assert plan.bytes == total == 0
    assert all(s.collective == "local" for s in plan.steps)
    assert sum(counter.counts.values()) == 0



@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize(
    "target", [[Shard(0)], [Shard(1)], [InterleavedShard(1, 3)], [Partial()], [Partial("max")]]
)
def test_redistribute_result_does_not_alias_its_source(
    target: list[Placement], async_op: bool
) -> None:
    """As in PyTorch (whose local chunks are cloned), a local cut gives dense tensors of their
    own: an in-place op on the result leaves the source alone, on every device (a view would
    write into one replica's rows and leave the replicas differing)."""
    dt = sw.distribute_tensor(X, MESH4, [Replicate()])
    out = dt.redistribute(MESH4, target, async_op=async_op)
    out.zero_()
    assert all(torch.equal(c, X) for c in sw.local_components(dt))
    assert all(c.is_contiguous() for c in sw.local_components(out))
    assert torch.equal(out.full_tensor(), torch.zeros_like(X))


def test_uneven_all_gather_bytes_are_exact() -> None:
    dt = sw.distribute_tensor(torch.arange(5.0), MESH4, [Shard(0)])
    plan, counter, total = _run(dt, [Replicate()])
    # pieces hold 2, 2, 1, 0 floats = 8, 8, 4, 0 bytes; each device receives the others'
    assert plan.bytes == total == 12 + 12 + 16 + 20
    assert counter.counts == {"all_gather": 1}


def test_2d_plan_orders_steps_to_move_least() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    x = torch.empty(1024, 1024, dtype=torch.float32)
    dt = sw.distribute_tensor(x, mesh, [Shard(0), Shard(0)])
    plan, counter, total = _run(dt, [Replicate(), Shard(1)])
    assert [(s.collective, s.mesh_dim) for s in plan.steps] == [
        ("all_to_all", 1),
        ("all_gather", 0),
    ]
    mib = 1 << 20
    # all_to_all on mesh dim 1: each device's 1 MiB piece, half of it arrives: 4 x 0.5 MiB;
    # then all_gather on mesh dim 0 of 2 MiB column blocks: 4 x 1 MiB.
    # Gathering mesh dim 1 first would move 4 x 1 MiB + 4 x 2 MiB.
    assert [s.bytes for s in plan.steps] == [2 * mib, 4 * mib]
    assert plan.bytes == total == 6 * mib
    assert counter.bytes == {"all_to_all": 2 * mib, "all_gather": 4 * mib}


def test_3d_partial_on_middle_dim_is_one_all_reduce() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2, 2))
    x = torch.arange(64.0).reshape(8, 8)
    dt = sw.distribute_tensor(x, mesh, [Replicate(), Partial(), Shard(0)])
    plan, counter, total = _run(dt, [Replicate(), Replicate(), Shard(0)])
    assert [(s.collective, s.mesh_dim) for s in plan.steps] == [("all_reduce", 1)]
    # pieces are 4 x 8 floats = 128 bytes; ring all_reduce of 2 members: 128 bytes each
    assert plan.bytes == total == 8 * 128


def test_plans_are_cached() -> None:
    dt = sw.distribute_tensor(X, MESH4, [Shard(0)])
    assert plan_redistribute(dt._spec, (Shard(1),)) is plan_redistribute(dt._spec, (Shard(1),))
    explain = sw.debug.explain_redistribute
    assert explain(dt, [Shard(1)]) == explain(dt, [Shard(-1)])


def test_redistribute_to_same_placements_is_free() -> None:
    dt = sw.distribute_tensor(X, MESH4, [Shard(0)])
    plan, counter, total = _run(dt, [Shard(0)])
    assert plan.steps == () and total == 0


@given(meshes(), tensor_shapes(), st.integers(0, 2**16), st.data())
def test_replicate_to_anything_moves_nothing(
    mesh: DeviceMesh, shape: tuple[int, ...], seed: int, data: st.DataObject
) -> None:
    target = data.draw(placements_for(shape, tuple(mesh.mesh.shape)))
    x = make_tensor(shape, torch.float32, seed)
    dt = sw.distribute_tensor(x, mesh, [Replicate()] * mesh.ndim)
    plan, counter, total = _run(dt, target)
    assert plan.bytes == total == 0 and sum(counter.counts.values()) == 0


def _ref_numel(shape: tuple[int, ...], mesh_shape: tuple, state: tuple, coord: tuple) -> int:
    return math.prod(len(i) for i in ref_indices(shape, mesh_shape, state, coord))


def _ref_step_bytes(
    shape: tuple[int, ...], mesh: DeviceMesh, before: tuple, after: tuple, m: int, kind: str
) -> int:
    """Bytes all devices receive in one step, from the reference geometry and the ring model."""
    mesh_shape = tuple(mesh.mesh.shape)
    coords = list(ref_coords(mesh.mesh).values())
    total = 0
    if kind == "exchange":  # per element with k Partial terms (1 without Partial) and m
        # devices that need it: a root needer gathers the k terms (k - 1 if it holds one) and
        # sends the result to the m - 1 others; one term goes straight to who lacks it
        partial = [m for m, p in enumerate(before) if p.is_partial() and mesh_shape[m] > 1]
        old = {c: set(itertools.product(*ref_indices(shape, mesh_shape, before, c)))
               for c in coords}
        new = {c: set(itertools.product(*ref_indices(shape, mesh_shape, after, c)))
               for c in coords}
        for element in itertools.product(*(range(s) for s in shape)):
            holders = [c for c in coords if element in old[c]]
            needers = [c for c in coords if element in new[c]]
            terms = {tuple(c[m] for m in partial) for c in holders}
            if len(terms) == 1:
                total += sum(c not in holders for c in needers)
            else:
                total += len(terms) + len(needers) - 1 - any(c in holders for c in needers)
        return total
    for coord in coords:  # the receiver
        group = [coord[:m] + (i,) + coord[m + 1 :] for i in range(mesh_shape[m])]
        others = [g for g in group if g != coord]
        if kind == "all_gather":
            total += sum(_ref_numel(shape, mesh_shape, before, g) for g in others)
        elif kind == "reduce_scatter":
            total += sum(_ref_numel(shape, mesh_shape, after, g) for g in others)
        elif kind == "all_reduce":
            numel = _ref_numel(shape, mesh_shape, before, coord)
            own = len(ref_chunk(list(range(numel)), mesh_shape[m], coord[m]))
            total += 2 * (numel - own)
        else:  # all_to_all: from each other member, its old rows inside my new columns
            e = after[m].dim
            mine = ref_indices(shape, mesh_shape, after, coord)
            for g in others:
                theirs = ref_indices(shape, mesh_shape, before, g)
                total += math.prod(
                    len(mine[i]) if i == e else len(theirs[i]) for i in range(len(shape))
                )
    return total


@given(transitions(), st.integers(0, 2**16))
def test_plan_steps_are_priced_by_the_ring_model(transition: tuple, seed: int) -> None:
    case, target = transition
    x = make_tensor(case.shape, case.dtype, seed)
    dt = sw.distribute_tensor(x, case.mesh, case.placements)
    plan = sw.debug.explain_redistribute(dt, target)
    rank, itemsize = len(case.shape), x.element_size()
    state = tuple(_positive(p, rank) for p in case.placements)
    for step in plan.steps:
        if step.collective == "send/recv":  # the whole move point to point, at its own bound
            assert step.source == state and plan.steps == (step,)
            assert step.global_bytes == cross_mesh_lower_bound_bytes(
                tuple(case.shape), itemsize, case.mesh, state, case.mesh, step.target)
            state = step.target
            continue
        dims = step.mesh_dim if step.collective == "exchange" else (step.mesh_dim,)
        sources = step.source if step.collective == "exchange" else (step.source,)
        targets = step.target if step.collective == "exchange" else (step.target,)
        assert sources == tuple(state[m] for m in dims)
        after = tuple(targets[dims.index(m)] if m in dims else p for m, p in enumerate(state))
        if step.collective != "local":
            expected = _ref_step_bytes(
                case.shape, case.mesh, state, after, step.mesh_dim, step.collective
            )
            assert step.bytes == expected * itemsize, (step, plan)
        state = after
    assert state == tuple(_positive(p, rank) for p in target)
    # never dearer than gathering everything (last mesh dim first), then splitting for free
    naive, state = 0, tuple(_positive(p, rank) for p in case.placements)
    for m in reversed(range(case.mesh.ndim)):
        after = state[:m] + (Replicate(),) + state[m + 1 :]
        if isinstance(state[m], Shard):
            naive += _ref_step_bytes(case.shape, case.mesh, state, after, m, "all_gather")
        elif isinstance(state[m], Partial):
            naive += _ref_step_bytes(case.shape, case.mesh, state, after, m, "all_reduce")
        state = after
    assert plan.bytes <= naive * itemsize


def test_mixed_partials_reduce_lowest_mesh_dim_first_whatever_the_target() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    # components c[i][j] at mesh coordinate (i, j); sum over mesh dim 0, then max over dim 1
    c = [torch.tensor([1.0]), torch.tensor([5.0]), torch.tensor([4.0]), torch.tensor([2.0])]
    dt = sw.DTensor.from_local(c, mesh, [Partial(), Partial("max")])
    value = torch.tensor([max(1.0 + 4.0, 5.0 + 2.0)])
    for target in (
        [Replicate(), Replicate()],
        [Shard(0), Replicate()],
        [Replicate(), Shard(0)],
        [Partial(), Replicate()],
        [Replicate(), Partial("max")],
    ):
        assert torch.equal(dt.redistribute(placements=target).full_tensor(), value), target


@pytest.mark.parametrize("joined", [True, False], ids=["one torch device", "several"])
@pytest.mark.parametrize("mesh_shape", [(4,), (3,), (2, 3)])
@pytest.mark.parametrize("shape", [(8, 12), (5, 7, 3), (2, 9)])
def test_in_process_shard_to_shard_counts_the_pieces_all_to_all(
    mesh_shape: tuple[int, ...], shape: tuple[int, ...], joined: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In one process an all_to_all joins a group's components once and cuts the new pieces
    out of that (members on several torch devices send pieces): the values are torch.chunk's,
    dense, and the bytes counted are those the pieces' all_to_all moves (the reference
    geometry's), uneven shards and 2-D meshes included."""
    from shardwise.comm import transport

    if not joined:  # as if every member kept its components on a torch device of its own
        monkeypatch.setattr(transport, "_one_device", lambda mesh, members: None)
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    x = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    for m in range(len(mesh_shape)):
        for d, e in itertools.permutations(range(len(shape)), 2):
            before = [Replicate()] * len(mesh_shape)
            before[m] = Shard(d)
            after = list(before)
            after[m] = Shard(e)
            dt = sw.distribute_tensor(x, mesh, before)
            plan, counter, total = _run(dt, after)
            assert [s.collective for s in plan.steps] == ["all_to_all"]
            expected = _ref_step_bytes(shape, mesh, tuple(before), tuple(after), m, "all_to_all")
            assert total == plan.bytes == expected * x.element_size()
            out = dt.redistribute(placements=after)
            check_components(out._components, x, mesh, after)
            assert all(c.is_contiguous() for c in out._components)  # as joined pieces are
            assert torch.equal(out.full_tensor(), x)
