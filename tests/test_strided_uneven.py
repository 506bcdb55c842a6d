"""``_StridedShard`` (shardwise's ``InterleavedShard``) of a size its split factor does not
divide, as PyTorch cuts it: ``torch.chunk`` in ``split_factor`` blocks, each block
``torch.chunk``-ed over the mesh dim (issue 30, PyTorch's test_utils.py). The oracle is torch's
own ``_StridedShard`` and ``_utils`` helpers on the same shapes, and the tensor itself."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor import _utils as torch_utils
from torch.distributed.tensor import placement_types as tpt

import shardwise as sw
from shardwise.geometry import _compute_local_shape_and_global_offset
from shardwise.placements import InterleavedShard, Partial, Replicate, Shard

PLACEMENTS = [
    (InterleavedShard(0, 2),),
    (InterleavedShard(0, 3),),
    (InterleavedShard(0, 3), Shard(0)),
    (InterleavedShard(0, 2), InterleavedShard(0, 3)),
    (Shard(0), InterleavedShard(0, 2)),
    (Replicate(), InterleavedShard(0, 4)),
]


def _torch(p: object) -> object:
    if isinstance(p, InterleavedShard):
        return tpt._StridedShard(p.dim, split_factor=p.interleaved_size)
    return tpt.Shard(p.dim) if isinstance(p, Shard) else tpt.Replicate()


@pytest.mark.parametrize("placements", PLACEMENTS, ids=str)
def test_local_shape_and_offset_as_torchs(placements: tuple) -> None:
    torch_placements = [_torch(p) for p in placements]
    for length in range(14):
        for mesh_shape in itertools.product((1, 2, 3, 4), repeat=len(placements)):
            for coord in itertools.product(*(range(n) for n in mesh_shape)):
                ours = _compute_local_shape_and_global_offset(
                    (length, 3), mesh_shape, coord, placements
                )
                theirs = torch_utils._compute_local_shape_and_global_offset(
                    (length, 3), mesh_shape, list(coord), torch_placements
                )
                assert ours == theirs, (length, mesh_shape, coord, placements)


@pytest.mark.parametrize("with_padding", [True, False])
def test_split_tensor_as_torchs(with_padding: bool) -> None:
    for dim, size, k, n in itertools.product((0, 1), range(12), (1, 2, 3, 5), (1, 2, 4)):
        x = torch.randn(size, 3) if dim == 0 else torch.randn(3, size)
        ours = InterleavedShard(dim, k)._split_tensor(x, n, with_padding=with_padding)
        theirs = tpt._StridedShard(dim, split_factor=k)._split_tensor(
            x, n, with_padding=with_padding
        )
        assert ours[1] == theirs[1], (dim, size, k, n)
        assert len(ours[0]) == len(theirs[0]) == n
        for a, b in zip(ours[0], theirs[0], strict=True):
            assert torch.equal(a, b), (dim, size, k, n)


@pytest.mark.parametrize("placements", PLACEMENTS[2:], ids=str)
def test_uneven_strided_pieces_and_redistributions(placements: tuple) -> None:
    """Each device holds torch's piece (torch's placements split left to right), and every
    redistribution from and to the layout keeps the tensor."""
    mesh = sw.init_device_mesh("cpu", (2, 2))
    for length in (2, 3, 5, 7, 11, 15):
        x = torch.arange(length * 2, dtype=torch.float32).reshape(length, 2)
        dt = sw.distribute_tensor(x, mesh, list(placements))
        for device, piece in zip(mesh.device_ids, sw.local_components(dt), strict=True):
            expected = x
            for p, c, n in zip(placements, mesh.coordinate_of(device), mesh.shape, strict=True):
                if not isinstance(p, Replicate):
                    expected = _torch(p)._split_tensor(expected, n, with_padding=False)[0][c]
            assert torch.equal(piece, expected), (length, placements, device)
        for other in ([Replicate(), Replicate()], [Shard(0), Shard(0)], [Partial(), Shard(1)],
                      [Shard(1), InterleavedShard(0, 3)]):
            moved = dt.redistribute(mesh, other)
            assert torch.equal(moved.full_tensor(), x), (length, placements, other)
            back = moved.redistribute(mesh, list(placements))
            assert all(torch.equal(a, b) for a, b in zip(
                sw.local_components(back), sw.local_components(dt), strict=True))
