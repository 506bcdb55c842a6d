"""User errors: a ShardwiseError subclass whose message names the shapes, mesh and placements."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import shardwise as sw
from shardwise import DeviceMesh, InterleavedShard, Partial, Replicate, Shard
from shardwise.placements import RaggedShard

MESH4 = DeviceMesh("cpu", [0, 1, 2, 3])
MESH22 = sw.init_device_mesh("cpu", (2, 2))
X = torch.zeros(4, 6)


def _raises(
    call: Callable[[], object], cls: type[Exception], *fragments: str
) -> sw.errors.ShardwiseError:
    with pytest.raises(cls) as info:
        call()
    assert isinstance(info.value, sw.errors.ShardwiseError)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return info.value


def test_shard_dim_out_of_range() -> None:
    for dim in (2, -3):
        err = _raises(
            lambda dim=dim: sw.distribute_tensor(X, MESH4, [Shard(dim)]),
            sw.errors.InvalidPlacementError,
            "[4, 6]",
            f"Shard(dim={dim})",
            str(MESH4),
        )
        assert isinstance(err, ValueError)
    dt = sw.distribute_tensor(X, MESH22, [Shard(0), Replicate()])
    _raises(
        lambda: dt.redistribute(placements=[Replicate(), Shard(5)]),
        sw.errors.InvalidPlacementError,
        "[4, 6]",
        "Shard(dim=5)",
        str(MESH22),
    )
    _raises(
        lambda: sw.distribute_tensor(torch.tensor(3.0), MESH4, [Shard(0)]),
        sw.errors.InvalidPlacementError,
        "scalar",
        "Shard(dim=0)",
    )


def test_from_local_shard_dim_out_of_range_names_the_components() -> None:
    err = _raises(
        lambda: sw.DTensor.from_local([torch.zeros(1, 6)] * 4, MESH4, [Shard(3)]),
        sw.errors.InvalidPlacementError,
        "[1, 6]",
        "Shard(dim=3)",
        str(MESH4),
    )
    assert "[0, 0]" not in str(err)  # not a made-up global shape


def test_ragged_sizes_that_do_not_fit_and_a_bad_interleaved_size() -> None:
    # (an interleaved size that does not divide is cut as torch cuts _StridedShard:
    # tests/test_strided_uneven.py)
    _raises(
        lambda: sw.distribute_tensor(torch.zeros(10), MESH4, [RaggedShard(0, (1, 2, 3, 3))]),
        sw.errors.InvalidPlacementError,
        "[10]",
        "RaggedShard(dim=0, sizes=(1, 2, 3, 3))",
        "summing to 9",
        str(MESH4),
    )
    with pytest.raises(sw.errors.InvalidPlacementError):
        InterleavedShard(0, 0)


def test_placement_count_must_match_mesh() -> None:
    err = _raises(
        lambda: sw.distribute_tensor(X, MESH22, [Shard(0)]),
        sw.errors.InvalidPlacementError,
        "[4, 6]",
        "[Shard(dim=0)]",
        str(MESH22),
    )
    assert isinstance(err, ValueError)
    dt = sw.distribute_tensor(X, MESH4, [Shard(0)])
    _raises(
        lambda: dt.redistribute(placements=[Replicate(), Replicate()]),
        sw.errors.InvalidPlacementError,
        "[4, 6]",
        "[Replicate(), Replicate()]",
        str(MESH4),
    )
    _raises(
        lambda: sw.debug.explain_redistribute(dt, []),
        sw.errors.InvalidPlacementError,
        "[4, 6]",
        str(MESH4),
    )
    _raises(
        lambda: sw.DTensor.from_local([torch.zeros(1, 6)] * 4, MESH4, [Shard(0), Replicate()]),
        sw.errors.InvalidPlacementError,
        "[1, 6]",
        "[Shard(dim=0), Replicate()]",
        str(MESH4),
    )


def test_tensors_on_different_meshes() -> None:
    dt = sw.distribute_tensor(X, MESH4, [Shard(0)])
    # another mesh is a cross-mesh move (test_cross_mesh.py); one of another device type is not
    meta = DeviceMesh("meta", [[0, 1], [2, 3]])
    err = _raises(
        lambda: dt.redistribute(meta, [Shard(1), Replicate()]),
        sw.errors.MeshError,
        str(MESH4),
        str(meta),
        "[4, 6]",
        "[Shard(dim=0)]",
    )
    assert isinstance(err, ValueError)
    # an equal mesh built separately is the same mesh
    same = DeviceMesh("cpu", [0, 1, 2, 3])
    assert torch.equal(dt.redistribute(same, [Shard(1)]).full_tensor(), X)


def test_from_local_components_that_do_not_fit() -> None:
    parts = [torch.zeros(1, 6)] + [torch.zeros(3, 6)] * 3  # global 10 rows: chunks are 3,3,3,1
    err = _raises(
        lambda: sw.DTensor.from_local(parts, MESH4, [Shard(0)]),
        sw.errors.PackError,
        "[1, 6]",
        "[3, 6]",
        "[10, 6]",
        "Shard(dim=0)",
        str(MESH4),
    )
    assert isinstance(err, ValueError)
    _raises(
        lambda: sw.DTensor.from_local([torch.zeros(1, 6)] * 4, MESH4, [Shard(0)], shape=(5, 6)),
        sw.errors.PackError,
        "[5, 6]",
        "[2, 6]",
        "Shard(dim=0)",
    )
    _raises(
        lambda: sw.DTensor.from_local([torch.zeros(1, 6)] * 3, MESH4, [Shard(0)]),
        sw.errors.PackError,
        "4 components",
        "3",
        "Shard(dim=0)",
        str(MESH4),
    )
    replicated = [torch.zeros(2, 2), torch.zeros(2, 3), torch.zeros(2, 2), torch.zeros(2, 2)]
    _raises(
        lambda: sw.DTensor.from_local(replicated, MESH22, [Replicate(), Partial()]),
        sw.errors.PackError,
        "[2, 3]",
        "[2, 2]",
        "Partial()",
    )
    _raises(
        lambda: sw.DTensor.from_local(torch.zeros(2, 6), MESH4, [Shard(0)]),
        sw.errors.PackError,
        "4 components",
        "Shard(dim=0)",
    )


def test_to_local_with_several_local_devices_points_to_local_components() -> None:
    dt = sw.distribute_tensor(X, MESH22, [Shard(0), Partial()])
    err = _raises(
        lambda: dt.to_local(),
        sw.errors.LocalComponentsError,
        "local_components",
        str(MESH22),
        "[4, 6]",
        "[Shard(dim=0), Partial()]",
    )
    assert isinstance(err, RuntimeError)
    assert len(sw.local_components(dt)) == 4


def test_bad_placement_values() -> None:
    for make in (lambda: Partial("prod"), lambda: Shard(1.5), lambda: InterleavedShard(0, -1)):
        err = _raises(make, sw.errors.InvalidPlacementError)
        assert isinstance(err, ValueError)
    _raises(
        lambda: sw.distribute_tensor(X, MESH4, ["Shard(0)"]),
        sw.errors.InvalidPlacementError,
        "'Shard(0)'",
        "[4, 6]",
    )
    _raises(lambda: sw.tf.unpack(X), sw.errors.InvalidArgumentError, "[4, 6]")


def test_placements_that_passed_once_are_remembered_and_others_still_refused() -> None:
    """validate_placements remembers a combination that passed (the parallel styles ask it
    on every call); the same placements on another mesh, shape or rank stay checked."""
    from shardwise.errors import InvalidPlacementError
    from shardwise.spec import validate_placements

    one, two = sw.init_device_mesh("cpu", (2,)), sw.init_device_mesh("cpu", (2, 2))
    for _ in range(2):
        assert validate_placements((4, 6), one, [sw.Shard(-1)]) == (sw.Shard(1),)
    with pytest.raises(InvalidPlacementError, match="give exactly one placement per mesh dim"):
        validate_placements((4, 6), two, [sw.Shard(-1)])
    with pytest.raises(InvalidPlacementError):
        validate_placements((4,), one, [sw.Shard(1)])
    with pytest.raises(InvalidPlacementError, match="must be a list"):
        validate_placements((4, 6), one, sw.Shard(0))
