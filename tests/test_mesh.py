"""DeviceMesh: attributes, coordinates, named sub-meshes, groups, equality and errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given

import shardwise as sw
from conftest import meshes, ref_coords
from shardwise import DeviceMesh


@pytest.fixture
def mesh3d() -> DeviceMesh:
    return sw.init_device_mesh("cpu", (2, 3, 2), mesh_dim_names=("a", "b", "c"))


def test_init_device_mesh_attributes(mesh3d: DeviceMesh) -> None:
    assert mesh3d.device_type == "cpu"
    assert torch.equal(mesh3d.mesh, torch.arange(12).reshape(2, 3, 2))
    assert mesh3d.mesh_dim_names == ("a", "b", "c")
    assert mesh3d.ndim == 3
    assert mesh3d.shape == (2, 3, 2) and type(mesh3d.shape) is tuple
    assert mesh3d.size() == 12 and mesh3d.size(1) == 3 and mesh3d.size("c") == 2
    assert mesh3d.dim_size("b") == 3
    assert "a" in mesh3d and "z" not in mesh3d
    # embedded mode: this process owns every device, ascending
    assert list(mesh3d.local_device_ids) == list(range(12))
    assert mesh3d.num_local_devices() == 12
    assert mesh3d.local_devices() == [torch.device("cpu")] * 12
    assert mesh3d.get_coordinate() == (0, 0, 0)
    assert mesh3d.get_local_rank("b") == 0


def test_device_mesh_from_list_is_one_dimensional() -> None:
    mesh = DeviceMesh("cpu", [0, 1, 2, 3])
    assert mesh.ndim == 1 and tuple(mesh.shape) == (4,) and mesh.mesh_dim_names is None
    assert mesh.get_local_rank() == 0
    assert [mesh.coordinate_of(i) for i in range(4)] == [(0,), (1,), (2,), (3,)]


@given(meshes())
def test_coordinate_of_matches_the_id_array(mesh: DeviceMesh) -> None:
    coords = ref_coords(mesh.mesh)
    for device, coord in coords.items():
        assert mesh.coordinate_of(device) == coord
    assert list(mesh.local_device_ids) == sorted(coords)


@given(meshes())
def test_groups_partition_the_mesh_along_each_dim(mesh: DeviceMesh) -> None:
    coords = ref_coords(mesh.mesh)
    for m in range(mesh.ndim):
        groups = mesh.groups(m)
        assert sorted(d for g in groups for d in g) == sorted(coords)
        for group in groups:
            assert len(group) == mesh.mesh.shape[m]
            # members in coordinate order, equal everywhere but on dim m
            assert [coords[d][m] for d in group] == list(range(len(group)))
            assert len({coords[d][:m] + coords[d][m + 1 :] for d in group}) == 1
            for d in group:
                assert mesh.group_of(d, m) == group


def test_named_submesh(mesh3d: DeviceMesh) -> None:
    b = mesh3d["b"]
    assert b == DeviceMesh("cpu", [0, 2, 4], mesh_dim_names=("b",))
    ca = mesh3d["c", "a"]
    # ca[i][j] is the device at (a=j, b=0, c=i)
    assert ca.mesh.tolist() == [[0, 6], [1, 7]]
    assert ca.mesh_dim_names == ("c", "a")
    assert mesh3d["a", "b", "c"] == mesh3d


def test_submeshes(mesh3d: DeviceMesh) -> None:
    subs = mesh3d.submeshes("b")
    assert [s.mesh.tolist() for s in subs] == [[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11]]
    assert all(s.mesh_dim_names == ("b",) for s in subs)
    pairs = mesh3d.submeshes(["a", "c"])
    assert len(pairs) == 3
    assert [s.mesh.tolist() for s in pairs] == [
        [[0, 1], [6, 7]],
        [[2, 3], [8, 9]],
        [[4, 5], [10, 11]],
    ]
    assert mesh3d.submeshes(1) == subs


def test_equality_and_hash() -> None:
    a = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))
    b = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("x", "y"))
    assert a == b and hash(a) == hash(b)
    assert a != sw.init_device_mesh("cpu", (2, 2))
    assert a != sw.init_device_mesh("cpu", (4,))
    assert a != DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("x", "y"))
    assert a != DeviceMesh("meta", [[0, 1], [2, 3]], mesh_dim_names=("x", "y"))
    assert len({a, b}) == 1


def test_create_mesh_is_named_row_major() -> None:
    mesh = sw.tf.create_mesh([("x", 2), ("y", 3)])
    assert mesh == sw.init_device_mesh("cpu", (2, 3), mesh_dim_names=("x", "y"))


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda: DeviceMesh("cpu", []), "at least one device"),
        (lambda: DeviceMesh("cpu", [0, 1, 1]), "[0, 1, 1]"),
        (lambda: DeviceMesh("cpu", [-1, 0]), "[-1, 0]"),
        (lambda: DeviceMesh("tpu", [0, 1]), "'tpu'"),
        (lambda: DeviceMesh("cpu", [[0, 1]], mesh_dim_names=("x",)), "(1, 2)"),
        (lambda: DeviceMesh("cpu", [[0, 1]], mesh_dim_names=("x", "x")), "('x', 'x')"),
        (lambda: sw.init_device_mesh("cpu", (2, 0)), "(2, 0)"),
        (lambda: sw.init_device_mesh("cpu", ()), "()"),
        (lambda: sw.tf.create_mesh([("x", 2)], devices=[0, 1, 2]), "3 devices"),
    ],
)
def test_malformed_meshes_raise(make: object, fragment: str) -> None:
    with pytest.raises(sw.errors.MeshError) as info:
        make()
    assert isinstance(info.value, sw.errors.ShardwiseError) and isinstance(info.value, ValueError)
    assert fragment in str(info.value)


def test_bad_dims_raise(mesh3d: DeviceMesh) -> None:
    with pytest.raises(sw.errors.MeshError, match="'z'") as info:
        mesh3d["z"]
    assert isinstance(info.value, KeyError)
    with pytest.raises(sw.errors.MeshError, match="mesh dim 3"):
        mesh3d.size(3)
    with pytest.raises(sw.errors.MeshError, match="repeat"):
        mesh3d.submeshes(["a", 0])
    with pytest.raises(sw.errors.MeshError, match="device 12"):
        mesh3d.coordinate_of(12)
    with pytest.raises(sw.errors.MeshError, match="needs a mesh_dim"):
        mesh3d.get_local_rank()
    with pytest.raises(sw.errors.MeshError, match="'a'"):
        DeviceMesh("cpu", [0, 1])["a"]
