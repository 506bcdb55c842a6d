"""``_StridedShard`` (PyTorch's FSDP2 x TP layout) is shardwise's ``InterleavedShard``, and like
torch's it answers ``is_shard()`` False: a reader that trusts ``is_shard()`` and ``dim`` (as
transformers' shard-on-read loader does) must never slice an interleaved layout as contiguous
chunks. The oracle is torch's own placement classes splitting the same tensor."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import placement_types as tpt

import shardwise as sw
from shardwise.placements import (
    InterleavedShard,
    RaggedShard,
    Replicate,
    Shard,
    _StridedShard,
    is_any_shard,
)


def _torch_placement(p: object) -> object:
    """The torch placement of the same layout (the oracle's input)."""
    if isinstance(p, InterleavedShard):
        return tpt._StridedShard(p.dim, split_factor=p.interleaved_size)
    if isinstance(p, Shard):
        return tpt.Shard(p.dim)
    return tpt.Replicate()


def _torch_local(full: torch.Tensor, placements: list, coord: tuple, mesh_shape) -> torch.Tensor:
    """torch's piece for mesh coordinate ``coord``: its placements applied left to right."""
    local = full
    for p, c, n in zip(placements, coord, mesh_shape, strict=True):
        tp = _torch_placement(p)
        if not isinstance(tp, tpt.Replicate):
            local = tp._split_tensor(local, n, with_padding=False)[0][c]
    return local


def _reader(full: torch.Tensor, placements, coord, mesh_shape) -> torch.Tensor:
    """A shard-on-read loader as libraries write it: ``is_shard()`` means contiguous
    ``torch.chunk`` pieces of ``dim``; a placement with a ``split_factor`` is strided (torch's
    ``_StridedShard``); anything else is read whole."""
    index = [torch.arange(s) for s in full.shape]
    for p, c, n in zip(placements, coord, mesh_shape, strict=True):
        if p.is_shard():
            index[p.dim] = torch.chunk(index[p.dim], n)[c]
        elif getattr(p, "split_factor", None) is not None:
            strided = tpt._StridedShard(0, split_factor=p.split_factor)  # on the 1-D index
            index[p.dim] = strided._split_tensor(index[p.dim], n, with_padding=False)[0][c]
    return full[torch.meshgrid(*index, indexing="ij")]


@pytest.mark.parametrize(
    ("shape", "placements"),
    [
        ((8, 4), [_StridedShard(0, split_factor=2), Shard(0)]),  # FSDP2 over a colwise weight
        ((4, 8), [Shard(0), _StridedShard(1, sf=2)]),
        ((12, 6), [InterleavedShard(0, 3), Replicate()]),  # merged QKV
        ((8, 6), [Replicate(), _StridedShard(0, split_factor=2)]),
    ],
)
def test_a_reader_trusting_is_shard_loads_what_each_device_holds(shape, placements) -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
    dt = sw.distribute_tensor(full, mesh, placements)
    for device, local in zip(mesh.local_device_ids, sw.local_components(dt), strict=True):
        coord = mesh.coordinate_of(device)
        assert torch.equal(local, _torch_local(full, placements, coord, mesh.shape))
        assert torch.equal(_reader(full, placements, coord, mesh.shape), local), (
            f"device {device} at {coord}: a reader trusting is_shard() misreads {placements}"
        )


def test_is_shard_answers_as_torch_does() -> None:
    assert _StridedShard is InterleavedShard
    ours, theirs = _StridedShard(0, split_factor=2), tpt._StridedShard(0, split_factor=2)
    assert ours.split_factor == theirs.split_factor == 2
    for dim in (None, 0, 1):
        assert ours.is_shard(dim) == theirs.is_shard(dim)
        assert Shard(0).is_shard(dim) == tpt.Shard(0).is_shard(dim)
    assert ours == InterleavedShard(0, 2) and _StridedShard(0, sf=2) == ours
    assert not RaggedShard(0, (1, 3)).is_shard()  # not torch.chunk's pieces either
    assert all(is_any_shard(p, 0) for p in (ours, Shard(0), RaggedShard(0, (1, 3))))
    assert not is_any_shard(Replicate()) and not is_any_shard(Shard(1), 0)
    with pytest.raises(
        sw.errors.InvalidPlacementError, match="one of interleaved_size, split_factor"
    ):
        InterleavedShard(0, 2, split_factor=2)
