"""Any placement -> Partial: an explicit redistribution spreads a Shard to a Partial("sum")
locally (its piece in place, zeros around it), so such plans move nothing; values and
gradients against plain torch. An op's input moves never spread: explicit mode still refuses
them and they keep their components shard-sized."""

from __future__ import annotations

import itertools

import pytest
import torch

import shardwise as sw
from conftest import check_components, components_for, fits, make_tensor
from mp_harness import run_in_processes
from shardwise import InterleavedShard, Partial, Placement, RaggedShard, Replicate, Shard
from shardwise.debug import CommDebugMode
from shardwise.redistribute import lower_bound_bytes, plan_redistribute, traced
from shardwise.spec import DTensorSpec, contiguous_meta

TARGET_OPS = [Partial("sum"), Partial("avg"), Partial("max"), Partial("min")]


def _sources_1d(shape: tuple[int, ...], n: int) -> list[Placement]:
    ragged = [shape[0] - 1, 0, *([0] * (n - 3)), 1] if n > 2 else [shape[0] - 1, 1]
    return [Shard(0), Shard(1), InterleavedShard(0, 2), RaggedShard(0, tuple(ragged)),
            Replicate(), Partial("sum"), Partial("max"), Partial("avg")]


def _check(mesh: sw.DeviceMesh, x: torch.Tensor, source: tuple, target: tuple) -> sw.DTensor:
    """Run ``source`` -> ``target``: the reference values, the bytes the plan priced, never
    below the bound; returns the result."""
    shape = tuple(x.shape)
    dt = sw.DTensor.from_local(components_for(x, mesh, source, 3), mesh, source, shape=shape)
    plan = sw.debug.explain_redistribute(dt, target)
    assert plan.global_bytes >= plan.lower_bound == lower_bound_bytes(mesh, shape, 4, source,
                                                                      target)
    with sw.debug.CommCounter() as counter:
        out = dt.redistribute(placements=target)
    assert counter.total_bytes == plan.bytes
    check_components(sw.local_components(out), x, mesh, target)
    torch.testing.assert_close(out.full_tensor(), x, rtol=0, atol=1e-5)
    return out


def _spreads(source: tuple, target: tuple) -> bool:
    """Every changed mesh dim goes from a Shard or Replicate to a Partial("sum")."""
    return all(
        p == q or (isinstance(q, Partial) and q.reduce_op == "sum" and not p.is_partial())
        for p, q in zip(source, target, strict=True)
    )


@pytest.mark.parametrize("shape", [(8, 6), (7, 5)])
def test_one_dimensional_every_source_to_every_partial(shape: tuple[int, int]) -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    x = make_tensor(shape, torch.float32, 1)
    for source, target in itertools.product(_sources_1d(shape, 4), TARGET_OPS):
        if not fits(shape, mesh.shape, (source,)):
            continue
        _check(mesh, x, (source,), (target,))
        if _spreads((source,), (target,)):
            plan = sw.debug.explain_redistribute(
                sw.DTensor.from_local(components_for(x, mesh, (source,), 3), mesh, (source,),
                                      shape=shape), (target,))
            assert plan.global_bytes == plan.lower_bound == 0, (source, plan)
            assert all(s.collective == "local" for s in plan.steps)


SOURCES_2D = [Shard(0), Shard(1), InterleavedShard(1, 2), Replicate(), Partial("sum"),
              Partial("max")]
TARGETS_2D = [Partial("sum"), Partial("avg"), Partial("max"), Replicate(), Shard(0)]


@pytest.mark.parametrize("shape", [(8, 4), (5, 6)])
def test_two_dimensional_every_source_to_every_partial(shape: tuple[int, int]) -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    x = make_tensor(shape, torch.float32, 2)
    for source in itertools.product(SOURCES_2D, repeat=2):
        if not fits(shape, mesh.shape, source):
            continue
        for target in itertools.product(TARGETS_2D, repeat=2):
            if not any(p.is_partial() for p in target) or not fits(shape, mesh.shape, target):
                continue
            _check(mesh, x, source, target)
            if _spreads(source, target) and not any(
                isinstance(p, Shard) and isinstance(q, Shard) for p, q in zip(source, target,
                                                                              strict=True)
            ):
                plan = sw.debug.explain_redistribute(
                    sw.DTensor.from_local(components_for(x, mesh, source, 3), mesh, source,
                                          shape=shape), target)
                assert plan.global_bytes == 0, (source, target, plan)


@pytest.mark.parametrize(
    ("source", "target"),
    [((Shard(0), Replicate()), (Partial(), Replicate())),
     ((Shard(0), Shard(1)), (Partial(), Partial())),
     ((Shard(0), Shard(0)), (Partial(), Partial())),
     ((RaggedShard(0, (5, 2)), Shard(1)), (Partial(), Shard(1)))],
)
def test_two_dimensional_spreads_move_nothing(source: tuple, target: tuple) -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    x = make_tensor((7, 6), torch.float32, 4)
    dt = sw.DTensor.from_local(components_for(x, mesh, source, 3), mesh, source, shape=(7, 6))
    plan = sw.debug.explain_redistribute(dt, list(target))
    assert plan.global_bytes == plan.lower_bound == 0, plan
    _check(mesh, x, source, target)


def test_half_precision_spread_is_exact() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    x = make_tensor((7, 3), torch.bfloat16, 5)
    out = sw.distribute_tensor(x, mesh, [Shard(0)]).redistribute(placements=[Partial()])
    assert torch.equal(out.full_tensor(), x)


@pytest.mark.parametrize("source", [Shard(0), InterleavedShard(0, 2), RaggedShard(0, (3, 0, 4, 1))])
@pytest.mark.parametrize("grad_placement", [Partial(), Replicate()])
def test_spread_gradient(source: Placement, grad_placement: Placement) -> None:
    """The gradient of a spread reaches each piece: the cotangent (Partial or Replicate)
    redistributed back to the source, as torch's gradient of the identity."""
    mesh = sw.init_device_mesh("cpu", (4,))
    x = make_tensor((8, 3), torch.float32, 6)
    w = make_tensor((8, 3), torch.float32, 7)
    leaf = sw.distribute_tensor(x, mesh, [source]).detach().requires_grad_()
    out = leaf.redistribute(placements=[Partial()])
    plan = sw.debug.explain_redistribute(leaf, [Partial()])
    assert plan.global_bytes == 0
    grad = sw.distribute_tensor(w, mesh, [Replicate()]).redistribute(placements=[grad_placement])
    out.backward(grad)
    assert leaf.grad.placements == (source,)
    torch.testing.assert_close(leaf.grad.full_tensor(), w)


def _spread_in_processes() -> list:
    """Per source: whether the spread's full tensor is the value, and the bytes counted."""
    mesh = sw.init_device_mesh("cpu", (2,))
    x = make_tensor((6, 3), torch.float32, 8)
    out = []
    for source in [Shard(0), InterleavedShard(0, 3), RaggedShard(0, (5, 1)), Shard(1)]:
        dt = sw.distribute_tensor(x, mesh, [source])
        with sw.debug.CommCounter() as counter:
            spread = dt.redistribute(placements=[Partial()])
        out.append((torch.equal(spread.full_tensor(), x), counter.total_bytes,
                    tuple(spread.to_local().shape)))
    return out


def test_spread_across_processes() -> None:
    for rank in run_in_processes(_spread_in_processes, 2, timeout=180):
        assert rank == [(True, 0, (6, 3))] * 4


@pytest.mark.parametrize("op", ["norm2", "norminf"])
def test_spread_to_a_pending_norm(op: str) -> None:
    """A p-norm target holds a value on one member and zeros elsewhere, as Replicate -> it
    does: a spread moves nothing and the norm of the pieces is the (non-negative) value."""
    mesh = sw.init_device_mesh("cpu", (4,))
    x = make_tensor((7, 3), torch.float32, 9).abs()
    dt = sw.distribute_tensor(x, mesh, [Shard(0)])
    assert sw.debug.explain_redistribute(dt, [Partial(op)]).global_bytes == 0
    torch.testing.assert_close(dt.redistribute(placements=[Partial(op)]).full_tensor(), x)


SRP = [Shard(0), Shard(1), Replicate(), Partial()]


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_op_input_plans_never_spread(mesh_shape: tuple[int, ...]) -> None:
    """The plan an op's input move gets (``plan_redistribute`` without ``spread``) has no local
    Shard -> Partial step; the explicit plan moves no more than it, the same where the target
    holds no sum to spread to."""
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    x = make_tensor((8, 4, 4), torch.float32, 10)
    states = list(itertools.product(SRP, repeat=len(mesh_shape)))
    for source, target in itertools.product(states, states):
        spec = sw.distribute_tensor(x, mesh, list(source))._spec
        moves, explicit = plan_redistribute(spec, target), plan_redistribute(spec, target,
                                                                             spread=True)
        assert not any(
            s.collective == "local" and isinstance(s.source, Shard)
            and isinstance(s.target, Partial) for s in moves.steps
        ), (source, target, moves)
        assert explicit.global_bytes <= moves.global_bytes, (source, target)
        if not any(p.is_partial() for p in target):
            assert explicit == moves


def _partial(t: torch.Tensor, mesh: sw.DeviceMesh) -> sw.DTensor:
    return sw.distribute_tensor(t, mesh, [Replicate()]).redistribute(placements=[Partial()])


# ops whose strategies take a Partial input beside a Shard: a spread of the Shard to Partial
# would be a zero-byte move that beats reduce-scattering the Partial
def _add(a, b):
    return a + b


def _sub(a, b):
    return a - b


def _stack(a, b):
    return torch.stack([a, b])


def _where(a, b):
    return torch.where(a > 0, a, b)


SHARD_BESIDE_PARTIAL = [_add, _sub, _stack, _where]


@pytest.mark.parametrize("fn", [*SHARD_BESIDE_PARTIAL, torch.cat, torch.addmm])
def test_explicit_mode_refuses_a_move_a_spread_would_hide(fn) -> None:
    """With implicit redistribution off, an op whose Shard input would need a move beside a
    Partial one raises instead of spreading the Shard for free."""
    mesh = sw.init_device_mesh("cpu", (4,))
    x, y = make_tensor((8, 8), torch.float32, 11), make_tensor((8, 8), torch.float32, 12)
    a = sw.distribute_tensor(x, mesh, [Shard(0)])
    with (
        sw.config.allow_implicit_redistribute(False),
        pytest.raises(sw.errors.ImplicitRedistributeError),
    ):
        if fn is torch.cat:
            fn([a, _partial(y, mesh)])
        elif fn is torch.addmm:  # the bias beside a row-parallel product (Partial)
            fn(a, sw.distribute_tensor(x, mesh, [Shard(1)]),
               sw.distribute_tensor(y, mesh, [Shard(0)]))
        else:
            fn(a, _partial(y, mesh))


@pytest.mark.parametrize("fn", SHARD_BESIDE_PARTIAL)
def test_implicit_moves_keep_components_shard_sized(fn) -> None:
    """Allowed to move, the op reduce-scatters the Partial rather than spreading the Shard:
    the result is torch's and its components are a quarter of the whole, not whole ones."""
    mesh = sw.init_device_mesh("cpu", (4,))
    x, y = make_tensor((8, 8), torch.float32, 13), make_tensor((8, 8), torch.float32, 14)
    with sw.config.allow_implicit_redistribute(), sw.debug.CommCounter() as counter:
        out = fn(sw.distribute_tensor(x, mesh, [Shard(0)]), _partial(y, mesh))
    expected = fn(x, y)
    assert counter.total_bytes > 0
    assert all(4 * c.numel() == expected.numel() for c in sw.local_components(out))
    assert not any(p.is_partial() for p in out.placements)
    torch.testing.assert_close(out.full_tensor(), expected)


def test_a_traced_spread_is_planned_again_as_a_spread() -> None:
    """The key of a traced plan records that it may spread, so a process that plans it again
    (a graph from torch's caches) runs the same steps."""
    mesh = sw.init_device_mesh("cpu", (4,))
    dt = sw.distribute_tensor(make_tensor((8, 3), torch.float32, 15), mesh, [Shard(0)])
    plan = sw.debug.explain_redistribute(dt, [Partial()])
    key = traced._key(plan, mesh, dt.dtype)
    traced._entries.pop(key, None)
    traced._replan(key)
    assert traced._entries[key][0].steps == plan.steps
    assert plan.steps[0].collective == "local" and plan.steps[0].target == Partial()


def _spreads_on_four() -> list:
    """On a 2x2 mesh: per (source, target), whether the full tensor is the value, the bytes
    this process counted and the bytes the plan priced for all devices."""
    x = make_tensor((6, 4), torch.float32, 16)
    mesh = sw.init_device_mesh("cpu", (2, 2))
    out = []
    for source, target in [((Shard(0), Shard(1)), (Partial(), Partial())),
                           ((Shard(0), Replicate()), (Partial(), Replicate())),
                           ((Replicate(), Shard(1)), (Replicate(), Partial())),
                           ((Shard(1), Shard(0)), (Partial(), Shard(0))),
                           ((Shard(0), Shard(0)), (Shard(0), Partial()))]:
        dt = sw.distribute_tensor(x, mesh, list(source))
        with sw.debug.CommCounter() as counter:
            moved = dt.redistribute(placements=list(target))
        plan = sw.debug.explain_redistribute(dt, list(target))
        out.append((torch.equal(moved.full_tensor(), x), counter.total_bytes,
                    plan.global_bytes, plan.lower_bound))
    return out


def test_spreads_on_four_processes_and_two_devices_each_on_two() -> None:
    """The same spreads one device per process (4 ranks) and two per process (2 ranks): the
    value, nothing moved, at the bound."""
    for world in (4, 2):
        for rank in run_in_processes(_spreads_on_four, world, timeout=300):
            assert rank == [(True, 0, 0, 0)] * 5, (world, rank)


SRP = [Shard(0), Shard(1), Shard(2), Replicate(), Partial()]
P2P_SHAPE = (8, 4, 6)


def _point_to_point_pairs(mesh: sw.DeviceMesh) -> list[tuple[tuple, tuple]]:
    """The pairs on the (2, 2) ``mesh`` to a Partial target that explicit redistribution plans
    as one send/recv step (per-mesh-dim steps would move more than the lower bound)."""
    spec = DTensorSpec(mesh, (Replicate(), Replicate()), contiguous_meta(P2P_SHAPE, torch.float32))
    states = list(itertools.product(SRP, repeat=2))
    return [(s, t) for s in states for t in states if any(p.is_partial() for p in t)
            and [step.collective for step in plan_redistribute(
                spec.with_placements(s), t, spread=True).steps] == ["send/recv"]]


def test_point_to_point_step_where_per_dim_steps_miss_the_bound() -> None:
    """Such pairs exist (each member of a sum group would receive what one member needs),
    and the op input plan of each (never spread, never point to point) moves more."""
    mesh = sw.init_device_mesh("cpu", (2, 2))
    pairs = _point_to_point_pairs(mesh)
    assert pairs
    for source, target in pairs:
        spec = DTensorSpec(mesh, source, contiguous_meta(P2P_SHAPE, torch.float32))
        explicit = plan_redistribute(spec, target, spread=True)
        assert [s.collective for s in explicit.steps] == ["send/recv"]
        assert explicit.global_bytes == lower_bound_bytes(mesh, P2P_SHAPE, 4, source, target)
        implicit = plan_redistribute(spec, target)
        assert all(s.collective != "send/recv" for s in implicit.steps)
        assert implicit.global_bytes > explicit.global_bytes, (source, target)


def test_point_to_point_step_is_charged_to_the_mesh_dims_it_crosses() -> None:
    """(Partial, Shard(0)) -> (Shard(0), Partial): target group i (mesh row i) needs rows of
    half i summed once; device (i, i) holds term i of them and receives term 1 - i from
    (1 - i, i), across mesh dim 0 only. A budget charges its bytes to dim 0, none to dim 1,
    and refuses it before moving when dim 0 allows less."""
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    x = make_tensor((8, 6), torch.float32, 21)
    source, target = (Partial(), Shard(0)), (Shard(0), Partial())
    dt = sw.DTensor.from_local(components_for(x, mesh, source, 3), mesh, source, shape=(8, 6))
    plan = sw.debug.explain_redistribute(dt, target)
    (step,) = plan.steps
    assert (step.collective, step.mesh_dim) == ("send/recv", (0,))
    assert plan.global_bytes == plan.lower_bound == 2 * 4 * 4 * 6  # two devices, 4 x 6 each
    with sw.debug.comm_budget(per_dim={"a": plan.bytes, "b": 0}) as budget, \
            CommDebugMode() as debug:
        out = dt.redistribute(placements=target)
    assert budget.used == plan.bytes and budget.used_per_dim == {"a": plan.bytes, "b": 0}
    assert debug.get_comm_counts()["send/recv"] == 1 and debug.total_bytes == plan.bytes
    check_components(sw.local_components(out), x, mesh, target)
    with pytest.raises(sw.errors.CommBudgetExceededError, match="send/recv"), \
            sw.debug.comm_budget(per_dim={0: plan.bytes - 1}):
        dt.redistribute(placements=target)


def _point_to_point_in_processes() -> list:
    """Every point to point pair on a 2x2 mesh: whether the value is exact and the local
    shapes are the reference's, and the bytes this process counted, the plan priced here, the
    mesh dims the step crosses, the cross-process payload counted and charged to a budget."""
    from shardwise.geometry import shard_segments

    x = make_tensor(P2P_SHAPE, torch.float32, 22)
    mesh = sw.init_device_mesh("cpu", (2, 2))
    out = []
    for source, target in _point_to_point_pairs(mesh):
        comps = components_for(x, mesh, source, 5)
        dt = sw.DTensor.from_local([comps[d] for d in mesh.local_device_ids], mesh,
                                   list(source), shape=P2P_SHAPE)
        plan = sw.debug.explain_redistribute(dt, list(target))
        with (
            sw.debug.CommCounter() as counter,
            sw.debug.comm_budget(cross_process_bytes=10**9) as budget,
        ):
            moved = dt.redistribute(placements=list(target))
        shapes = [tuple(sum(b - a for a, b in r) for r in shard_segments(
            P2P_SHAPE, mesh.shape, target, mesh.coordinate_of(d))) for d in mesh.local_device_ids]
        ok = torch.equal(moved.full_tensor(), x) and shapes == [
            tuple(c.shape) for c in sw.local_components(moved)]
        out.append((ok, counter.total_bytes, plan.bytes, plan.steps[0].mesh_dim,
                    counter.total_cross_process_bytes, budget.used_cross_process,
                    plan.global_bytes == plan.lower_bound))
    return out


def test_point_to_point_on_four_processes_and_two_devices_each_on_two() -> None:
    """The point to point pairs one device per process (every message crosses processes) and
    two per process (devices (i, 0) and (i, 1) share process i: only mesh dim 0 crosses):
    values, bytes as priced, at the bound, cross-process payload counted and charged."""
    for world in (4, 2):
        ranks = run_in_processes(_point_to_point_in_processes, world, timeout=300)
        for cases in zip(*ranks, strict=True):
            assert all(c[0] and c[1] == c[2] and c[4] == c[5] and c[6] for c in cases), cases
            dims = cases[0][3]
            moved = sum(c[1] for c in cases)
            crossed = sum(c[4] for c in cases)
            if world == 4 or dims == (0, 1):
                assert crossed == moved if world == 4 else 0 < crossed <= moved, cases
            else:
                assert crossed == (moved if dims == (0,) else 0), cases
