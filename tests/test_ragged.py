"""RaggedShard: arbitrary per-device extents along one dim (zeros allowed). Geometry against
the reference index lists of conftest, redistribution to and from every other placement at
the byte lower bound with exact values, and op rules against single-device PyTorch."""

from __future__ import annotations

import io
import itertools

import pytest
import torch

import shardwise as sw
from conftest import check_components, components_for, make_tensor, ref_indices, ref_slice
from rng_oracle import expected_shards
from shardwise import InterleavedShard, Partial, RaggedShard, Replicate, Shard
from shardwise.debug import visualize_sharding
from shardwise.redistribute import lower_bound_bytes
from test_planner_bound import _ref_bound

# ----- placement and geometry ------------------------------------------------------------------


def test_sizes_are_checked_against_shape_and_mesh() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    x = torch.randn(10, 3)
    with pytest.raises(sw.errors.InvalidPlacementError, match=r"summing to the size 10.*\[10, 3\]"):
        sw.distribute_tensor(x, mesh, [RaggedShard(0, (3, 0, 5, 1))])
    with pytest.raises(
        sw.errors.InvalidPlacementError, match=r"one size per device of the mesh dim"
    ):
        sw.distribute_tensor(x, mesh, [RaggedShard(0, (5, 5))])
    with pytest.raises(sw.errors.InvalidPlacementError, match="ints >= 0"):
        RaggedShard(0, (3, -1))
    assert RaggedShard(0, [1, 2]) == RaggedShard(0, (1, 2)) != Shard(0)
    # not torch.chunk's pieces: PyTorch's is_shard() question answers no (test_strided_shard)
    assert not RaggedShard(-1, (1, 2)).is_shard(-1)
    assert sw.placements.is_any_shard(RaggedShard(-1, (1, 2)), -1)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_pieces_follow_the_sizes(mesh_shape) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    x = make_tensor((10, 6), torch.float32, 1)
    if mesh_shape == (4,):
        placements = [RaggedShard(0, (3, 0, 5, 2))]
    else:  # rows ragged on mesh dim 0, then each half's columns ragged on mesh dim 1
        placements = [RaggedShard(0, (0, 10)), RaggedShard(1, (6, 0))]
    dt = sw.distribute_tensor(x, mesh, placements)
    check_components(sw.local_components(dt), x, mesh, placements)
    assert torch.equal(dt.full_tensor(), x)
    back = sw.DTensor.from_local(sw.local_components(dt), mesh, placements, shape=x.shape)
    assert torch.equal(back.full_tensor(), x)
    coords = [mesh.coordinate_of(d) for d in mesh.device_ids]
    for d, c in zip(mesh.device_ids, coords, strict=True):
        expected = ref_slice(x, ref_indices(x.shape, mesh.shape, placements, c))
        assert tuple(dt._spec.local_shape(d)) == tuple(expected.shape)


def test_nested_sizes_must_fit_every_parent_piece() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    with pytest.raises(sw.errors.InvalidPlacementError, match="summing to the size 5"):
        sw.distribute_tensor(torch.randn(10, 2), mesh, [Shard(0), RaggedShard(0, (1, 3))])
    dt = sw.distribute_tensor(torch.arange(10.0), mesh, [Shard(0), RaggedShard(0, (0, 5))])
    assert [c.tolist() for c in sw.local_components(dt)] == [[], [0, 1, 2, 3, 4], [],
                                                             [5, 6, 7, 8, 9]]


# ----- redistribution --------------------------------------------------------------------------

ONE_D = [
    RaggedShard(0, (3, 0, 5, 2)), RaggedShard(0, (0, 0, 10, 0)), RaggedShard(0, (2, 3, 2, 3)),
    RaggedShard(1, (1, 0, 4, 1)), Shard(0), Shard(1), InterleavedShard(0, 2), Replicate(),
    Partial(), Partial("max"),
]
TWO_D = [
    (RaggedShard(0, (7, 3)), Replicate()), (RaggedShard(0, (0, 10)), RaggedShard(1, (2, 4))),
    (Shard(1), RaggedShard(0, (4, 6))), (RaggedShard(1, (6, 0)), Partial()),
    (Shard(0), Shard(1)), (Replicate(), Replicate()), (Partial(), Shard(0)),
    (Replicate(), RaggedShard(0, (1, 9))),
]


def _check(mesh, x, source, target) -> None:
    shape = tuple(x.shape)
    dt = sw.DTensor.from_local(components_for(x, mesh, source, 7), mesh, source, shape=shape)
    plan = sw.debug.explain_redistribute(dt, target)
    if not any(p.is_partial() for p in target):  # the planner's bound: Partial-free targets
        assert plan.global_bytes == plan.lower_bound == lower_bound_bytes(
            mesh, shape, 4, tuple(source), tuple(target)
        ) == 4 * _ref_bound(shape, mesh, tuple(source), tuple(target)), (source, target, plan)
    with sw.debug.CommCounter() as counter:
        out = dt.redistribute(placements=target)
    assert counter.total_bytes == plan.bytes
    assert out.placements == tuple(target)
    if not any(p.is_partial() for p in target):
        check_components(sw.local_components(out), x, mesh, target)
    torch.testing.assert_close(out.full_tensor(), x, rtol=1e-6, atol=1e-6)


def test_every_one_d_pair_reaches_the_bound_and_the_values() -> None:
    """Every pair among ragged (zeros included), even, interleaved, Replicate and Partial."""
    mesh = sw.init_device_mesh("cpu", (4,))
    x = make_tensor((10, 6), torch.float32, 3)
    for source, target in itertools.product(ONE_D, ONE_D):
        if source != target:
            _check(mesh, x, (source,), (target,))


def test_two_d_pairs_reach_the_bound_and_the_values() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    x = make_tensor((10, 6), torch.float32, 4)
    for source, target in itertools.product(TWO_D, TWO_D):
        if source != target:
            _check(mesh, x, source, target)


# ----- visualize_sharding ----------------------------------------------------------------------


def test_visualize_sharding_shows_the_ragged_extents() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    dt = sw.distribute_tensor(torch.zeros(10, 2), mesh, [RaggedShard(0, (3, 0, 5, 2))])
    text = visualize_sharding(dt, file=io.StringIO())
    cells = [[c.strip() for c in line.split("|")] for line in text.splitlines()[3:6]]
    assert cells == [["0:3", "0"], ["3:8", "2"], ["8:10", "3"]]
    assert "ragged dim 0 over mesh dim 0: extents [3, 0, 5, 2]" in text
    assert "devices holding no elements (uneven shards): [1]" in text


def test_factories_and_random_values_follow_the_geometry() -> None:
    """``randn`` draws each piece, whatever its size, from its own shard's stream."""
    mesh = sw.init_device_mesh("cpu", (4,))
    ragged = [RaggedShard(0, (3, 0, 5, 2))]
    sw.manual_seed(3)
    a = sw.randn(10, 3, device_mesh=mesh, placements=ragged)
    shapes = [c.shape for c in sw.local_components(a)]
    want = expected_shards(a, torch.Generator().manual_seed(3), lambda i: torch.randn(shapes[i]))
    assert all(torch.equal(c, w) for c, w in zip(sw.local_components(a), want, strict=True))
    z = sw.zeros(10, 3, device_mesh=mesh, placements=ragged)
    assert [tuple(c.shape) for c in sw.local_components(z)] == [(3, 3), (0, 3), (5, 3), (2, 3)]
