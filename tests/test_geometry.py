"""Shard geometry: every device's component is the slice the (independent) reference predicts."""

from __future__ import annotations

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
)
from shardwise import DeviceMesh, InterleavedShard, Partial, Placement, Replicate, Shard


def _positive(p: Placement, rank: int) -> Placement:
    if isinstance(p, InterleavedShard):
        return InterleavedShard(p.dim % rank, p.interleaved_size)
    return Shard(p.dim % rank) if isinstance(p, Shard) else p


@given(cases(), st.integers(0, 2**16))
def test_distribute_tensor_components_follow_reference(case: Case, seed: int) -> None:
    x = make_tensor(case.shape, case.dtype, seed)
    dt = sw.distribute_tensor(x, case.mesh, case.placements)
    assert dt.shape == x.shape and dt.dtype == x.dtype
    assert dt.placements == tuple(_positive(p, len(case.shape)) for p in case.placements)
    check_components(sw.local_components(dt), x, case.mesh, case.placements)


@given(cases(), st.integers(0, 2**16))
def test_from_local_infers_shape_and_round_trips(case: Case, seed: int) -> None:
    x = make_tensor(case.shape, case.dtype, seed)
    components = components_for(x, case.mesh, case.placements, seed)
    dt = sw.DTensor.from_local(components, case.mesh, case.placements)
    assert dt.shape == x.shape
    unpacked = sw.local_components(dt)
    assert all(torch.equal(a, b) for a, b in zip(unpacked, components, strict=True))
    check_components(unpacked, x, case.mesh, case.placements)
    assert torch.equal(dt.full_tensor(), x)


def _pieces(size: int, mesh: DeviceMesh, placements: list) -> list[list[int]]:
    x = torch.arange(size)
    return [c.tolist() for c in sw.local_components(sw.distribute_tensor(x, mesh, placements))]


def test_uneven_chunks_by_hand() -> None:
    mesh = DeviceMesh("cpu", [0, 1, 2, 3])
    assert _pieces(5, mesh, [Shard(0)]) == [[0, 1], [2, 3], [4], []]
    assert _pieces(2, mesh, [Shard(0)]) == [[0], [1], [], []]
    assert _pieces(0, mesh, [Shard(0)]) == [[], [], [], []]
    assert _pieces(6, mesh, [Shard(0)]) == [[0, 1], [2, 3], [4, 5], []]


def test_nested_shards_split_lower_mesh_dim_first() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 3))
    # mesh dim 0 halves [0..6] into [0..3] / [4..6]; mesh dim 1 chunks each half in three
    assert _pieces(7, mesh, [Shard(0), Shard(0)]) == [[0, 1], [2, 3], [], [4], [5], [6]]
    # only mesh dim 1 shards: both rows of the mesh hold the same three chunks
    assert _pieces(7, mesh, [Replicate(), Shard(0)]) == [[0, 1, 2], [3, 4, 5], [6]] * 2


def test_interleaved_shard_by_hand() -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    # [12] seen as [3, 4]: each device keeps its half of every block of four
    assert _pieces(12, mesh, [InterleavedShard(0, 3)]) == [
        [0, 1, 4, 5, 8, 9],
        [2, 3, 6, 7, 10, 11],
    ]
    # [9] seen as [3, 3]: blocks of 3 chunk unevenly into 2 + 1
    assert _pieces(9, mesh, [InterleavedShard(0, 3)]) == [[0, 1, 3, 4, 6, 7], [2, 5, 8]]
    x = torch.arange(24).reshape(2, 12)
    parts = sw.local_components(sw.distribute_tensor(x, mesh, [InterleavedShard(-1, 2)]))
    assert torch.equal(parts[1], x[:, [3, 4, 5, 9, 10, 11]])


def test_components_are_in_ascending_device_id() -> None:
    mesh = DeviceMesh("cpu", [[3, 1], [0, 2]])
    x = torch.arange(8).reshape(4, 2)
    parts = sw.local_components(sw.distribute_tensor(x, mesh, [Shard(0), Shard(1)]))
    # device 0 sits at (1, 0), device 1 at (0, 1), device 2 at (1, 1), device 3 at (0, 0)
    assert torch.equal(parts[0], x[2:, :1])
    assert torch.equal(parts[1], x[:2, 1:])
    assert torch.equal(parts[2], x[2:, 1:])
    assert torch.equal(parts[3], x[:2, :1])


def test_partial_components_reduce_to_value() -> None:
    mesh = DeviceMesh("cpu", [0, 1, 2])
    x = torch.tensor([[1.0, -2.0], [3.5, 0.25]])
    for op, reduce in (
        ("sum", lambda t: t.sum(0)),
        ("avg", lambda t: t.mean(0)),
        ("max", lambda t: t.amax(0)),
        ("min", lambda t: t.amin(0)),
    ):
        parts = sw.local_components(sw.distribute_tensor(x, mesh, [Partial(op)]))
        assert torch.equal(reduce(torch.stack(parts)), x), op


def test_seed_matmul_example_data() -> None:
    """The data part of the seed guide's matmul example (the matmul needs dispatch)."""
    device_mesh = DeviceMesh("cpu", [0, 1, 2, 3])
    t1 = torch.ones(12, 8)
    t2 = torch.ones(8, 16)
    dt1 = sw.distribute_tensor(t1, device_mesh, [Shard(dim=1)])
    dt2 = sw.distribute_tensor(t2, device_mesh, [Shard(dim=0)])
    assert isinstance(dt1, sw.DTensor) and isinstance(dt2, sw.DTensor)
    assert dt1.shape == (12, 8) and dt2.shape == (8, 16)
    assert [tuple(c.shape) for c in sw.local_components(dt1)] == [(12, 2)] * 4
    assert [tuple(c.shape) for c in sw.local_components(dt2)] == [(2, 16)] * 4
    assert torch.equal(dt1.full_tensor(), t1) and torch.equal(dt2.full_tensor(), t2)
    a = torch.arange(96.0).reshape(12, 8)
    parts = sw.local_components(sw.distribute_tensor(a, device_mesh, [Shard(dim=1)]))
    assert all(torch.equal(parts[i], a[:, 2 * i : 2 * i + 2]) for i in range(4))
