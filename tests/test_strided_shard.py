"""``_StridedShard`` (PyTorch's FSDP2 x TP layout) is shardwise's ``InterleavedShard``, and like
torch's it answers ``is_shard()`` False: a reader that trusts ``is_shard()`` and ``dim`` (as
transformers' shard-on-read loader does) must never slice an interleaved layout as contiguous
chunks. The oracle is torch's own placement classes splitting the same tensor."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import placement_types as tpt

import shardwise as sw
from mp_harness import run_in_processes
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


# ----- views to and from strided layouts (torch's test_dtensor_flatten_2d / _unflatten) -------

S0, S1, S2, R = Shard(0), Shard(1), Shard(2), Replicate()
SS = _StridedShard
# (mesh, shape, placements, view, torch 2.13's output placements: its DTensor on 4 gloo
# processes, the oracle; test_view_across_processes_matches_torch rechecks them live)
FLATTENS = [
    ((2, 2), (4, 4), [S0, S1], (-1,), [S0, SS(0, sf=2)]),
    ((2, 2), (4, 6), [S1, S0], (-1,), [SS(0, sf=4), S0]),
    ((2, 2), (6, 4, 3, 3), [S1, S2], (-1, 3), [SS(0, sf=6), SS(0, sf=12)]),
    ((2, 2), (6, 4, 5, 3), [S1, S2], (-1, 3), [SS(0, sf=6), SS(0, sf=12)]),  # uneven last dim
    ((2, 2), (6, 4, 4, 3), [S1, S2], (-1,), [SS(0, sf=6), SS(0, sf=12)]),
    ((2, 2), (6, 6, 6, 3), [S1, S2], (-1, 3), [SS(0, sf=6), SS(0, sf=18)]),
    ((2, 2), (6, 4, 3, 3), [S1, S2], (6, -1, 3), [S1, SS(1, sf=2)]),
    ((2, 2), (6, 4, 3, 3), [S1, S1], (-1, 3), [SS(0, sf=6), SS(0, sf=6)]),
    ((2, 2), (6, 4, 3, 3), [R, S2], (6, -1, 3), [R, SS(1, sf=4)]),
    *(  # torch's test_dtensor_flatten_2d cases (its world of 6)
        ((3, 2), (6, 6, d1, 3), [S1, S2], (-1, 3), [SS(0, sf=6), SS(0, sf=12)]) for d1 in (3, 4, 5)
    ),
    ((4,), (6, 5, 4), [S1], (-1, 4), [SS(0, sf=6)]),
]


def _arange(shape) -> torch.Tensor:
    return torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)


def _view_no_comm(dt, shape):
    with sw.debug.CommCounter() as counter:
        out = dt.view(shape)
    assert counter.total_bytes == 0 and not counter.counts, counter.counts
    return out


@pytest.mark.parametrize(("mesh_shape", "shape", "placements", "view", "expected"), FLATTENS)
def test_flatten_gives_torchs_strided_placements_and_back(
    mesh_shape, shape, placements, view, expected
) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    full = _arange(shape)
    flat = _view_no_comm(sw.distribute_tensor(full, mesh, placements), view)
    assert list(flat.placements) == expected
    assert torch.equal(flat.full_tensor(), full.view(view))
    for device, local in zip(mesh.local_device_ids, sw.local_components(flat), strict=True):
        coord = mesh.coordinate_of(device)  # each piece is what torch's placements cut
        assert torch.equal(local, _torch_local(full.view(view), expected, coord, mesh.shape))
    back = _view_no_comm(flat, shape)  # the unflatten turns the strided shards back
    assert list(back.placements) == placements
    assert torch.equal(back.full_tensor(), full)


def test_flatten_and_unflatten_by_name() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    full = _arange((4, 4, 3))
    dt = sw.distribute_tensor(full, mesh, [S0, S1])
    flat = dt.flatten(0, 1)
    assert list(flat.placements) == [S0, SS(0, sf=2)]
    assert torch.equal(flat.full_tensor(), full.flatten(0, 1))
    back = flat.unflatten(0, (4, 4))
    assert list(back.placements) == [S0, S1]
    assert torch.equal(back.full_tensor(), full)


@pytest.mark.parametrize(
    ("mesh_shape", "shape", "placements", "view", "expected"),
    [  # torch's test_dtensor_unflatten cases (its world of 6), then on the 2x2 mesh
        ((6,), (36, 3), [SS(0, sf=6)], (6, 6, 3), [S1]),
        ((3, 2), (216, 3), [SS(0, sf=6), SS(0, sf=12)], (6, 6, 6, 3), [S1, S2]),
        ((3, 2), (216, 3), [R, SS(0, sf=36)], (6, 6, 6, 3), [R, S2]),
        ((2, 2), (216, 3), [R, SS(0, sf=36)], (6, 6, 6, 3), [R, S2]),
        ((2, 2), (216, 3), [SS(0, sf=6), SS(0, sf=18)], (6, 6, 6, 3), [S1, S2]),
        ((2, 2), (16,), [S0, SS(0, sf=2)], (4, 4), [S0, S1]),
        ((2, 2), (24,), [SS(0, sf=4), S0], (4, 6), [S1, S0]),
    ],
)
def test_unflatten_of_strided_shards_gives_torchs_placements(
    mesh_shape, shape, placements, view, expected
) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    full = _arange(shape)
    out = _view_no_comm(sw.distribute_tensor(full, mesh, placements), view)
    assert list(out.placements) == expected
    assert torch.equal(out.full_tensor(), full.view(view))


def test_strided_view_that_no_placement_keeps_is_a_move() -> None:
    """On the 3x2 mesh the second split factor 18 cuts the rows of a [6, 6, 6, 3] view in
    the middle of a dim; no placement keeps it (torch's view raises), so explicit mode
    refuses and an implicit move gives the single-device values."""
    mesh = sw.init_device_mesh("cpu", (3, 2))
    full = _arange((216, 3))
    dt = sw.distribute_tensor(full, mesh, [SS(0, sf=6), SS(0, sf=18)])
    with pytest.raises(sw.errors.ImplicitRedistributeError, match="aten.view"):
        dt.view(6, 6, 6, 3)
    with sw.config.allow_implicit_redistribute():
        assert torch.equal(dt.view(6, 6, 6, 3).full_tensor(), full.view(6, 6, 6, 3))


def test_split_factor_one_is_a_plain_shard() -> None:
    """Where torch's split factor comes out 1 (`_StridedShard(0, sf=1)`, the layout of
    `Shard(0)`), shardwise names the plain shard (a deliberate difference)."""
    mesh = sw.init_device_mesh("cpu", (2, 2))
    full = _arange((2, 4, 6))
    flat = _view_no_comm(sw.distribute_tensor(full, mesh, [S0, S1]), (-1,))
    assert list(flat.placements) == [S0, S0]
    assert torch.equal(flat.full_tensor(), full.view(-1))


def _views_beside_torch() -> list:
    """One rank of 4: each 4-device case of FLATTENS viewed by torch's DTensor and by
    shardwise's, and back: (torch's placements, shardwise's as torch's, the local pieces
    equal) for the flatten and for the unflatten."""
    from torch.distributed.tensor import distribute_tensor, init_device_mesh

    found = []
    for mesh_shape, shape, placements, view, _ in FLATTENS:
        if math.prod(mesh_shape) != 4:
            continue
        full = _arange(shape)
        theirs = distribute_tensor(
            full, init_device_mesh("cpu", mesh_shape), [_torch_placement(p) for p in placements]
        )
        ours = sw.distribute_tensor(full, sw.init_device_mesh("cpu", mesh_shape), placements)
        for target in (view, shape):
            ours = ours.view(target)
            mine = [_torch_placement(p) for p in ours.placements]
            try:
                theirs = theirs.view(target)
            except RuntimeError:  # torch refuses: shardwise's values must still be right
                found.append((placements, None, mine, torch.equal(
                    ours.full_tensor(), full.view(target))))
                break
            found.append((placements, list(theirs.placements), mine,
                          torch.equal(theirs.to_local(), ours.to_local())))
    return found


@pytest.mark.slow
def test_view_across_processes_matches_torch() -> None:
    """4 gloo processes, torch's DTensor beside shardwise's on the same meshes: the same
    placements and the same local piece on every rank, flattening and back."""
    for rank in run_in_processes(_views_beside_torch, 4, timeout=120):
        for placements, theirs, ours, same in rank:
            assert same
            if theirs is None:  # torch 2.13 cannot unflatten its own [_StridedShard(0, sf=6)] * 2
                assert placements == [S1, S1] and ours == [tpt.Shard(1)] * 2
            else:
                assert ours == theirs
