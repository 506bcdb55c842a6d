"""``_StridedShard`` (shardwise's ``InterleavedShard``) of a size its split factor does not
divide, as PyTorch cuts it: ``torch.chunk`` in ``split_factor`` blocks, each block
``torch.chunk``-ed over the mesh dim (issue 30, PyTorch's test_utils.py). The oracle is torch's
own ``_StridedShard`` and ``_utils`` helpers on the same shapes, and the tensor itself; under
the switch, torch's private ``_to_replicate_tensor`` and ``compute_global_tensor_shape`` on 4
gloo processes."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor import _utils as torch_utils
from torch.distributed.tensor import placement_types as tpt

import shardwise as sw
from mp_harness import run_in_processes
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


@pytest.mark.parametrize(
    "placements", [*PLACEMENTS[2:], (InterleavedShard(-2, 2), Shard(-2))], ids=str
)
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


def _switch_job() -> dict:
    """Under the switch, torch's private helpers on shardwise's mesh and placements."""
    import torch.distributed as dist

    from shardwise.as_torch import as_torch

    as_torch()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor._utils import (
        _compute_local_shape_and_global_offset,
        compute_global_tensor_shape,
        compute_local_shape_and_global_offset,
    )
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    rank = dist.get_rank()
    out: dict = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out["local"] = compute_local_shape_and_global_offset(
        (15, 5), mesh, [_StridedShard(0, split_factor=2), Shard(0)])
    # torch's private form on plain values: [4096] rows over (DP=30, TP=8), PyTorch's case
    out["private"] = [_compute_local_shape_and_global_offset(
        (4096, 4096), (30, 8), [dp, 7], [_StridedShard(0, split_factor=8), Shard(0)])
        for dp in (0, 28, 29)]
    # _to_replicate_tensor: this rank's strided piece of each size, gathered whole
    line = init_device_mesh("cpu", (4,))
    out["whole"] = []
    for size, sf in itertools.product((8, 9, 11), (1, 2, 3)):
        x = torch.arange(size)
        placement = _StridedShard(0, split_factor=sf)
        piece = placement._split_tensor(x, 4)[0][rank]
        out["whole"].append(torch.equal(placement._to_replicate_tensor(piece, line, 0, [size]), x))
    x = torch.arange(10).view(2, 5)
    pieces = _StridedShard(1, split_factor=2)._split_tensor(x, 2)[0]
    whole = _StridedShard(1, split_factor=2)._to_replicate_tensor(
        pieces[mesh.get_local_rank("dp")], mesh, 0, [2, 5])
    out["whole"].append(torch.equal(whole, x))
    # the uneven layout as a redistribution target (PyTorch's test_2d_mesh_uneven_strided_shard)
    out["round_trip"] = []
    for size in (2, 3, 5, 11):
        t = torch.arange(size).view(1, -1)
        dt = distribute_tensor(t, mesh, [Replicate(), Replicate()]).redistribute(
            mesh, [_StridedShard(1, split_factor=2), Shard(1)])
        out["round_trip"].append(torch.equal(dt.full_tensor(), t))
    # compute_global_tensor_shape: the local shapes gathered, a shard dim summed
    out["global"] = [
        tuple(compute_global_tensor_shape(torch.Size([5, rank]), line, [Shard(1)])),
        tuple(compute_global_tensor_shape(torch.Size([rank + 1, 5]), line, [Shard(0)])),
        tuple(compute_global_tensor_shape(torch.Size([5, 5]), line, [Replicate()])),
    ]
    out["errors"] = []
    for shape, mesh_, placements in (
        ([5 + rank % 2, 2], line, [Shard(1)]),  # another dim than the shard dim differs
        ([2, 2], mesh, [Shard(0), Shard(1)]),  # one mesh dim only, as torch's
        ([2, 2], mesh, [Shard(0)]),  # one placement per mesh dim
    ):
        try:
            compute_global_tensor_shape(torch.Size(shape), mesh_, placements)
        except (NotImplementedError, RuntimeError) as err:
            kind = "NotImplementedError" if isinstance(err, NotImplementedError) else "Runtime"
            out["errors"].append((kind, str(err).split(",")[0].split(":")[0]))
    return out


@pytest.mark.slow
def test_torchs_private_helpers_through_the_switch() -> None:
    results = run_in_processes(_switch_job, 4, timeout=240)
    torch_placements = [tpt._StridedShard(0, split_factor=2), tpt.Shard(0)]
    for rank, out in enumerate(results):
        expected = torch_utils._compute_local_shape_and_global_offset(
            (15, 5), (2, 2), [rank // 2, rank % 2], torch_placements)
        assert out["local"] == expected, (rank, out["local"], expected)
        # 18 rows on each DP coordinate of a TP block of 512, 8 on coordinate 28, none on 29
        assert out["private"] == [((18, 4096), (3584, 0)), ((8, 4096), (3584 + 18 * 28, 0)),
                                  ((0, 4096), (4096, 0))]
        assert out["whole"] == [True] * 10, (rank, out["whole"])
        assert out["round_trip"] == [True] * 4, (rank, out["round_trip"])
        assert out["global"] == [(5, 6), (10, 5), (5, 5)], (rank, out["global"])
        assert out["errors"] == [
            ("Runtime", "Non-sharded dimensions should have identical size across ranks"),
            ("NotImplementedError", "compute_global_tensor_shape only supports 1 placement "
                                    "for now"),
            ("Runtime", "Expected one placement per mesh dim"),
        ], (rank, out["errors"])
