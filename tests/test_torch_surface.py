"""The semi-private surface libraries read off torch's DTensor (transformers' TP loader,
torchtitan, Lightning), answered as torch answers it for the same inputs: torch's own
functions on plain data are the oracle."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor import _utils as torch_utils
from torch.distributed.tensor import placement_types as tpt

import shardwise as sw
from shardwise.geometry import compute_local_shape_and_global_offset
from shardwise.placements import InterleavedShard, Partial, RaggedShard, Replicate, Shard


def _torch(p: object) -> object:
    if isinstance(p, InterleavedShard):
        return tpt._StridedShard(p.dim, split_factor=p.interleaved_size)
    if isinstance(p, Shard):
        return tpt.Shard(p.dim)
    return tpt.Partial() if isinstance(p, Partial) else tpt.Replicate()


def _rank_view(mesh_shape: tuple[int, ...], rank: int, first: int = 0) -> sw.DeviceMesh:
    """The mesh as process ``rank`` of a one-device-per-process world sees it."""
    ids = torch.arange(first, first + torch.Size(mesh_shape).numel()).reshape(mesh_shape)
    return sw.DeviceMesh("cpu", ids, _devices_per_process=1, _rank=rank)


CASES = [
    ((8, 6), (2, 2), [Shard(0), Shard(1)]),
    ((7, 5), (2, 2), [Shard(1), Shard(1)]),  # uneven, empty pieces
    ((3, 4), (4,), [Shard(0)]),  # an empty piece: its offset is the dim's size
    ((8, 4), (2, 2), [InterleavedShard(0, 2), Shard(0)]),  # FSDP2 x TP
    ((12, 2), (2, 2), [Replicate(), InterleavedShard(0, 3)]),
    ((6, 4), (2, 2), [Partial(), Shard(-1)]),
    ((5,), (2, 2), [Replicate(), Replicate()]),
]


@pytest.mark.parametrize(("shape", "mesh_shape", "placements"), CASES)
def test_compute_local_shape_and_global_offset_matches_torch(shape, mesh_shape, placements):
    for rank in range(torch.Size(mesh_shape).numel()):
        mesh = _rank_view(mesh_shape, rank)
        coord = list(mesh.get_coordinate())
        theirs = torch_utils._compute_local_shape_and_global_offset(
            shape, mesh_shape, coord, [_torch(p) for p in placements]
        )
        assert compute_local_shape_and_global_offset(shape, mesh, placements) == theirs


def test_a_process_outside_the_mesh_gets_torchs_empty_answer() -> None:
    mesh = _rank_view((2,), rank=0, first=1)  # ranks 1 and 2; this is rank 0
    assert not mesh._is_current_rank_part_of_mesh()
    assert compute_local_shape_and_global_offset((4,), mesh, [Shard(0)]) == ((0,), ())
    assert _rank_view((2,), rank=1, first=1)._is_current_rank_part_of_mesh()


def test_local_shard_size_and_offset_matches_torch() -> None:
    for size, n in itertools.product(range(0, 11), range(1, 5)):
        for rank in range(n):
            assert Shard.local_shard_size_and_offset(size, n, rank) == tuple(
                tpt.Shard.local_shard_size_and_offset(size, n, rank)
            )
            assert Shard(0).local_shard_size_and_offset(size, n, rank) == (
                tpt.Shard(0).local_shard_size_and_offset(size, n, rank)
            )
            for k, mode in itertools.product((1, 2, 3), tpt._StridedShardOffsetMode):
                ours = InterleavedShard(0, k).local_shard_size_and_offset(size, n, rank, mode)
                theirs = tpt._StridedShard(0, split_factor=k).local_shard_size_and_offset(
                    size, n, rank, mode
                )
                assert ours == theirs, (size, n, rank, k, mode)
    ragged = RaggedShard(0, (3, 0, 2))
    assert [ragged.local_shard_size_and_offset(5, 3, r) for r in range(3)] == [
        (3, 0), (0, 3), (2, 3)
    ]
    with pytest.raises(sw.errors.InvalidPlacementError, match=r"summing to the size 4"):
        ragged.local_shard_size_and_offset(4, 3, 0)


def test_local_tensor_is_the_component_itself() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    dt = sw.distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
    with pytest.raises(sw.errors.LocalComponentsError, match="_local_tensor of a DTensor"):
        dt._local_tensor  # noqa: B018  (this process owns both devices)
    single = sw.init_device_mesh("cpu", (1,))
    one = sw.distribute_tensor(torch.arange(3.0), single, [Shard(0)])
    one._local_tensor.mul_(2)  # written in place, as libraries load weights
    assert torch.equal(one.full_tensor(), torch.arange(3.0) * 2)
    assert one._local_tensor.data_ptr() == one.to_local().data_ptr()
    assert one._local_tensor.grad_fn is None


class _SizesOnly:
    """A mesh that only answers ``size(mesh_dim)``, as torch's helpers read it."""

    def __init__(self, *sizes: int) -> None:
        self.sizes = sizes

    def size(self, mesh_dim: int) -> int:
        return self.sizes[mesh_dim]


@pytest.mark.parametrize("perm", [(0, 1, 2), (2, 0, 1), (1, 2, 0)])
def test_global_and_local_tensor_info_match_torch(perm: tuple[int, ...]) -> None:
    """``_utils.compute_global_tensor_info`` / ``compute_local_tensor_info`` (answered by
    shardwise.geometry through the switch) give torch's shapes and strides, for permuted local
    tensors and every pair of placements over a (2, 3) mesh; the local info inverts the
    global one."""
    from shardwise.geometry import compute_global_tensor_info, compute_local_tensor_info

    mesh = _SizesOnly(2, 3)
    options = [Shard(0), Shard(1), Shard(2), Replicate(), Partial()]
    for placements in itertools.product(options, repeat=2):
        local = torch.empty(4, 6, 6).permute(*perm)
        torch_places = [_torch(p) for p in placements]
        expected = torch_utils.compute_global_tensor_info(local, mesh, torch_places)
        got = compute_global_tensor_info(local, mesh, list(placements))
        assert [list(x) for x in got] == [list(x) for x in expected], placements
        full = torch.empty_strided(*got)
        back = compute_local_tensor_info(full, mesh, list(placements))
        expected_back = torch_utils.compute_local_tensor_info(full, mesh, torch_places)
        assert [list(x) for x in back] == [list(x) for x in expected_back], placements
        assert [list(x) for x in back] == [list(local.shape), list(local.stride())]


def test_tensor_info_errors_name_the_layout() -> None:
    from shardwise.geometry import compute_global_tensor_info, compute_local_tensor_info

    class Other(sw.placements.Placement):
        pass

    with pytest.raises(sw.errors.UnsupportedOpError, match="only shards") as err:
        compute_global_tensor_info(torch.empty(2), _SizesOnly(2), [Other()])
    assert isinstance(err.value, RuntimeError)  # torch raises a RuntimeError here
    with pytest.raises(sw.errors.InvalidPlacementError, match="size 5 .* mesh dim of size 2"):
        compute_local_tensor_info(torch.empty(5, 2), _SizesOnly(2), [Shard(0)])
