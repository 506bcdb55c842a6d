"""Any placement -> Partial: a Shard spreads to a Partial("sum") locally (its piece in place,
zeros around it), so such plans move nothing; values and gradients against plain torch."""

from __future__ import annotations

import itertools

import pytest
import torch

import shardwise as sw
from conftest import check_components, components_for, fits, make_tensor
from mp_harness import run_in_processes
from shardwise import InterleavedShard, Partial, Placement, RaggedShard, Replicate, Shard
from shardwise.redistribute import lower_bound_bytes

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
    plan = sw.explain_redistribute(dt, target)
    assert plan.global_bytes >= plan.lower_bound == lower_bound_bytes(mesh, shape, 4, source,
                                                                      target)
    with sw.CommCounter() as counter:
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
            plan = sw.explain_redistribute(
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
                plan = sw.explain_redistribute(
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
    plan = sw.explain_redistribute(dt, list(target))
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
    plan = sw.explain_redistribute(leaf, [Partial()])
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
        with sw.CommCounter() as counter:
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
    assert sw.explain_redistribute(dt, [Partial(op)]).global_bytes == 0
    torch.testing.assert_close(dt.redistribute(placements=[Partial(op)]).full_tensor(), x)
