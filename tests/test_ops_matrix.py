"""Matrix products on DTensors (mm, bmm, addmm, baddbmm, mv, dot, and matmul/linear/einsum
through their decompositions) against single-device torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from op_oracle import run_oracle
from shardwise import DeviceMesh, DTensor, InterleavedShard, Partial, Replicate, Shard
from shardwise.redistribute import plan_redistribute

MESHES_1D = [(2,), (3,), (4,)]


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed + sum(shape)))


def test_seed_matmul_example_exactly() -> None:
    device_mesh = DeviceMesh("cpu", [0, 1, 2, 3])
    t1 = torch.ones(12, 8)
    t2 = torch.ones(8, 16)
    t3 = torch.mm(t1, t2)
    dt1 = sw.distribute_tensor(t1, device_mesh, [Shard(dim=1)])
    dt2 = sw.distribute_tensor(t2, device_mesh, [Shard(dim=0)])
    dt3 = torch.mm(dt1, dt2)
    assert isinstance(dt3, DTensor)
    assert dt3.placements[0].is_partial()
    dt4 = dt3.redistribute(device_mesh, [Replicate()])
    assert torch.equal(sw.tf.unpack(dt4)[0], t3)
    assert torch.equal(dt4.full_tensor(), t3)


def test_contraction_is_partial_without_communication() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    a, b, bias = _rand(5, 7), _rand(7, 3), _rand(3)
    da = sw.distribute_tensor(a, mesh, [Shard(1), Shard(0)])
    db = sw.distribute_tensor(b, mesh, [Shard(0), Replicate()])
    dbias = sw.distribute_tensor(bias, mesh, [Replicate(), Replicate()])
    with sw.debug.CommCounter() as counter:
        out = torch.addmm(dbias, da, db)
    assert counter.total_bytes == 0 and not counter.counts
    assert out.placements == (Partial(), Shard(0))
    # the bias is added once, not once per partial sum
    torch.testing.assert_close(out.full_tensor(), torch.addmm(bias, a, b))


@pytest.mark.parametrize(
    ("pa", "pb", "expected"),
    [
        (Shard(0), Replicate(), Shard(0)),
        (Replicate(), Shard(1), Shard(1)),
        (Shard(1), Shard(0), Partial()),
        (Partial(), Replicate(), Partial()),
        (Replicate(), Partial("avg"), Partial("avg")),
        (Replicate(), Replicate(), Replicate()),
    ],
)
def test_mm_keeps_input_placements(pa, pb, expected) -> None:
    mesh = sw.init_device_mesh("cpu", (3,))
    a, b = _rand(5, 7), _rand(7, 4)
    da, db = sw.distribute_tensor(a, mesh, [pa]), sw.distribute_tensor(b, mesh, [pb])
    with sw.debug.CommCounter() as counter:
        out = torch.mm(da, db)
    assert counter.total_bytes == 0
    assert out.placements == (expected,)
    torch.testing.assert_close(out.full_tensor(), a @ b)


def test_explicit_mode_refuses_mm_of_row_shards() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    da = sw.distribute_tensor(_rand(8, 6), mesh, [Shard(0)])
    db = sw.distribute_tensor(_rand(6, 5), mesh, [Shard(0)])
    with pytest.raises(sw.errors.ImplicitRedistributeError) as info:
        torch.mm(da, db)
    message = str(info.value)
    assert "aten.mm" in message
    assert "redistribute(placements=" in message
    assert "Shard(dim=0)" in message


@pytest.mark.parametrize("m", [8, 64])
def test_implicit_mode_picks_the_cheapest_move(m: int) -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    a, b = _rand(m, 6), _rand(6, 5)
    da = sw.distribute_tensor(a, mesh, [Shard(0)])
    db = sw.distribute_tensor(b, mesh, [Shard(0)])
    # the ways to run Shard(0) x Shard(0): gather B (rows of A stay), move A to Shard(1)
    # (contraction to Partial), or gather both
    alternatives = [
        plan_redistribute(db._spec, [Replicate()]).bytes,
        plan_redistribute(da._spec, [Shard(1)]).bytes,
        plan_redistribute(da._spec, [Replicate()]).bytes
        + plan_redistribute(db._spec, [Replicate()]).bytes,
    ]
    with sw.config.allow_implicit_redistribute(), sw.debug.CommCounter() as counter:
        out = torch.mm(da, db)
    assert counter.total_bytes == min(alternatives) > 0
    torch.testing.assert_close(out.full_tensor(), a @ b)


def test_addmm_with_plain_scalar_bias_is_not_added_per_partial() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    a, b = _rand(4, 6), _rand(6, 3)
    da = sw.distribute_tensor(a, mesh, [Shard(1)])
    db = sw.distribute_tensor(b, mesh, [Shard(0)])
    with sw.config.allow_implicit_redistribute():
        out = torch.addmm(torch.tensor(2.0), da, db)
    torch.testing.assert_close(out.full_tensor(), torch.addmm(torch.tensor(2.0), a, b))


# ----- oracle: every op, uneven shapes, forward and backward -----------------------------------


def test_mm_oracle() -> None:
    assert run_oracle(torch.mm, [_rand(5, 7), _rand(7, 3)], max_cases=20) > 0
    run_oracle(torch.mm, [_rand(1, 2), _rand(2, 5)], max_cases=10)


def test_bmm_oracle() -> None:
    run_oracle(torch.bmm, [_rand(3, 5, 7), _rand(3, 7, 2)], max_cases=16)


@pytest.mark.parametrize("bias_shape", [(3,), (5, 3), (1, 3), (5, 1)])
def test_addmm_oracle(bias_shape) -> None:
    run_oracle(
        lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0),
        [_rand(*bias_shape), _rand(5, 7), _rand(7, 3)],
        max_cases=10,
    )


def test_baddbmm_oracle() -> None:
    run_oracle(
        lambda c, a, b: torch.baddbmm(c, a, b, beta=1.5, alpha=-1.0),
        [_rand(5, 2), _rand(3, 5, 7), _rand(3, 7, 2)],
        max_cases=8,
    )
    run_oracle(torch.baddbmm, [_rand(3, 5, 2), _rand(3, 5, 7), _rand(3, 7, 2)], max_cases=8)


def test_mv_dot_addmv_outer_oracle() -> None:
    run_oracle(torch.mv, [_rand(5, 7), _rand(7)], max_cases=10)
    run_oracle(torch.dot, [_rand(7), _rand(7)], max_cases=10)
    run_oracle(torch.addmv, [_rand(5), _rand(5, 7), _rand(7)], max_cases=8)
    run_oracle(torch.outer, [_rand(5), _rand(3)], max_cases=8)


@pytest.mark.parametrize(
    ("sa", "sb"),
    [((7,), (7, 3)), ((5, 7), (7,)), ((7,), (7,)), ((2, 5, 7), (7, 3)), ((5, 7), (2, 7, 3)),
     ((2, 5, 7), (2, 7, 3)), ((2, 3, 5, 7), (3, 7, 2)), ((2, 5, 7), (7,)), ((7,), (2, 7, 3))],
)
def test_matmul_oracle(sa, sb) -> None:
    run_oracle(torch.matmul, [_rand(*sa), _rand(*sb)], max_cases=4)


@pytest.mark.parametrize(
    ("sx", "bias"), [((5, 7), True), ((2, 5, 7), True), ((2, 5, 7), False), ((7,), True)]
)
def test_linear_oracle(sx, bias: bool) -> None:
    tensors = [_rand(*sx), _rand(3, 7)] + ([_rand(3)] if bias else [])
    run_oracle(F.linear, tensors, max_cases=6)


@pytest.mark.parametrize(
    ("equation", "shapes"),
    [
        ("bij,bjk->bik", [(2, 3, 5), (2, 5, 3)]),
        ("ij,kj->ik", [(3, 5), (4, 5)]),
        ("bhqd,bhkd->bhqk", [(2, 3, 5, 4), (2, 3, 3, 4)]),
        ("ij,j->i", [(3, 5), (5,)]),
    ],
)
def test_einsum_oracle(equation: str, shapes) -> None:
    run_oracle(
        lambda a, b: torch.einsum(equation, a, b), [_rand(*s) for s in shapes], max_cases=4
    )


def test_interleaved_operands_oracle() -> None:
    run_oracle(
        torch.mm, [_rand(6, 4), _rand(4, 6)], interleaved=True, mesh_shapes=MESHES_1D,
        max_cases=12,
    )


def test_interleaved_contraction_is_partial() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    a, b = _rand(3, 8), _rand(8, 5)
    da = sw.distribute_tensor(a, mesh, [InterleavedShard(1, 2)])
    db = sw.distribute_tensor(b, mesh, [InterleavedShard(0, 2)])
    with sw.debug.CommCounter() as counter:
        out = torch.mm(da, db)
    assert counter.total_bytes == 0 and out.placements == (Partial(),)
    torch.testing.assert_close(out.full_tensor(), a @ b)
