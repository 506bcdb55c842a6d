"""Parity names of the mesh: PyTorch's get_group / get_all_groups / get_rank / flatten, dim
names in groups, mesh[0]; TF's Mesh, dim_names, contains_dim, to_string / from_string, the
client and device queries, create_distributed_mesh and barrier (in one process and across two)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from mp_harness import run_in_processes
from shardwise import DeviceMesh, Replicate, Shard
from shardwise.errors import MeshError, ShardwiseTypeError
from shardwise.tf import Layout, Mesh


@pytest.fixture
def mesh() -> DeviceMesh:
    return sw.init_device_mesh("cpu", (2, 3), mesh_dim_names=("x", "y"))


# ----- PyTorch names -------------------------------------------------------------------------


def test_groups_and_group_of_take_dim_names(mesh):
    assert mesh.groups("y") == mesh.groups(1) == [(0, 1, 2), (3, 4, 5)]
    assert mesh.groups("x") == [(0, 3), (1, 4), (2, 5)]
    assert mesh.group_of(4, "x") == (1, 4) and mesh.group_of(4, "y") == (3, 4, 5)
    with pytest.raises(MeshError, match="'z'"):
        mesh.groups("z")


def test_indexing_a_mesh_by_int_is_a_clear_error(mesh):
    with pytest.raises(ShardwiseTypeError, match=r"mesh dim names.*got 0.*mesh\.mesh"):
        mesh[0]
    with pytest.raises(TypeError):
        mesh["x", 1]
    assert mesh["y"].mesh.tolist() == [0, 1, 2]


def test_rank_and_groups_in_one_process(mesh):
    assert mesh.get_rank() == 0
    with pytest.raises(MeshError, match="lives inside process 0.*redistribute"):
        mesh.get_group("x")
    with pytest.raises(MeshError, match="needs a mesh_dim"):
        mesh.get_group()
    with pytest.raises(MeshError):
        mesh.get_all_groups()


def test_flatten_is_a_1d_mesh_for_placements_and_collectives(mesh):
    flat = mesh.flatten()
    assert flat.mesh.tolist() == [0, 1, 2, 3, 4, 5] and flat.mesh_dim_names == ("x_y",)
    assert mesh._flatten("dp").mesh_dim_names == ("dp",)
    assert mesh["y", "x"].flatten().mesh.tolist() == [0, 3, 1, 4, 2, 5]
    assert mesh["y"].flatten("row").mesh.tolist() == [0, 1, 2]
    t = torch.arange(24.0).reshape(12, 2)
    dt = sw.distribute_tensor(t, flat, [Shard(0)])
    # device k of the flat mesh holds rows 2k, 2k+1: one shard per device of the 2x3 mesh
    expected = [t[2 * k : 2 * k + 2].tolist() for k in range(6)]
    assert [c.tolist() for c in sw.tf.unpack(dt)] == expected
    with sw.debug.CommCounter() as counter:
        full = dt.redistribute(flat, [Replicate()])
    assert counter.counts == {"all_gather": 1} and torch.equal(full.full_tensor(), t)
    assert torch.equal((dt * 2).full_tensor(), t * 2)
    assert DeviceMesh("cpu", [[0, 1]]).flatten().mesh_dim_names is None


# ----- TF names ------------------------------------------------------------------------------


def test_tf_mesh_names_and_round_trip(mesh):
    assert mesh.dim_names == ["x", "y"] and DeviceMesh("cpu", [0, 1]).dim_names == ["dim0"]
    assert mesh.contains_dim("x") and not mesh.contains_dim("z")
    text = mesh.to_string()
    assert text.startswith("|x=2,y=3|0,1,2,3,4,5|0,1,2,3,4,5|")
    assert "/job:localhost/replica:0/task:0/device:CPU:5" in text
    assert DeviceMesh.from_string(text) == mesh
    unnamed = DeviceMesh("cpu", [[3, 1], [0, 2]])
    back = DeviceMesh.from_string(unnamed.to_string())
    assert back == unnamed and back.mesh.tolist() == [[3, 1], [0, 2]]
    for bad in ("x=2|0,1", "|x=2,3|0,1|0,1|", "|x=2|0,1,2|0,1|CPU:0"):
        with pytest.raises(MeshError, match="cannot read a mesh"):
            DeviceMesh.from_string(bad)


def test_tf_mesh_constructor():
    ids = torch.arange(6).reshape(2, 3)
    m = Mesh(["a", "b"], ids, list(range(6)), [f"CPU:{i}" for i in range(6)], mesh_name="m")
    assert isinstance(m, DeviceMesh) and m.device_type == "cpu" and m.mesh_name == "m"
    assert m == Mesh(["a", "b"], ids, mesh_name="m")
    assert m != sw.tf.create_mesh([("a", 2), ("b", 3)])  # TF 2.21: the name is part of a mesh
    assert m.num_local_devices() == 6 and len(m.local_devices()) == 6
    assert Mesh.from_string(m.to_string()).mesh_name == "m"
    with pytest.raises(MeshError, match=r"local_device_ids \[0, 1\] disagree"):
        Mesh(["a", "b"], ids, [0, 1], ["CPU:0", "CPU:1"])
    with pytest.raises(MeshError, match="'TPU'"):
        Mesh(["a"], [0, 1], device_type="TPU")
    dt = sw.tf.copy_to_mesh(torch.arange(4.0), Layout(["a"], Mesh(["a"], [0, 1])))
    assert [c.tolist() for c in sw.tf.unpack(dt)] == [[0.0, 1.0], [2.0, 3.0]]


def test_tf_device_type_spelling():
    assert sw.tf.create_mesh([("x", 2)], device_type="CPU").device_type == "cpu"
    m = sw.tf.create_distributed_mesh(
        [("batch", 4), ("model", 2)], mesh_name="d", device_type="CPU"
    )
    assert isinstance(m, Mesh) and m.shape == (4, 2) and m.mesh_name == "d"
    assert m.mesh.flatten().tolist() == list(range(8)) and m.dim_names == ["batch", "model"]
    with pytest.raises(MeshError, match="mesh_dims"):
        sw.tf.create_distributed_mesh([("x", 0)])


def test_layout_strings_and_delete(mesh):
    layout = Layout(["x", sw.tf.UNSHARDED, "y"], mesh)
    text = layout.to_string()
    assert text.startswith("sharding_specs:x,unsharded,y, mesh:|x=2,y=3|")
    assert Layout.from_string(text) == layout
    assert Layout.from_string(Layout([], mesh).to_string()) == Layout([], mesh)
    assert layout.delete([0]) == Layout([sw.tf.UNSHARDED, "y"], mesh)
    assert layout.delete([-1, 0]) == Layout([sw.tf.UNSHARDED], mesh)
    with pytest.raises(sw.errors.LayoutError, match="out of range"):
        layout.delete([3])
    with pytest.raises(sw.errors.LayoutError, match="cannot read a layout"):
        Layout.from_string("x,y")


def test_clients_and_devices_in_one_process(mesh):
    assert sw.tf.client_id() == 0 and sw.tf.num_clients() == 1
    assert sw.tf.local_devices("CPU") == [torch.device("cpu")] == sw.tf.local_devices("cpu", 0)
    assert sw.tf.num_local_devices("CPU") == 1 == sw.tf.num_global_devices("CPU")
    assert sw.tf.num_local_devices("GPU") == torch.cuda.device_count()
    with pytest.raises(sw.errors.InvalidArgumentError, match="for_client_id 1"):
        sw.tf.local_devices("CPU", for_client_id=1)
    sw.tf.barrier(mesh, "in one process")  # nothing to wait for
    with pytest.raises(MeshError):
        sw.tf.barrier("not a mesh")


# ----- across two processes ------------------------------------------------------------------


def _two_process_job() -> dict:
    mesh = sw.tf.create_distributed_mesh([("x", 2), ("y", 2)])  # devices 2r, 2r+1 on rank r
    rank = dist.get_rank()
    out: dict = {
        "client": (sw.tf.client_id(), sw.tf.num_clients(), sw.tf.num_global_devices("CPU"))
    }
    out["rank"] = mesh.get_rank()
    # along x the groups {0, 2} and {1, 3} both join ranks 0 and 1: one process group
    group = mesh.get_group("x")
    out["group_ranks"] = dist.get_process_group_ranks(group)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=group)
    out["group_sum"] = t.item()
    try:
        mesh.get_group("y")  # {2r, 2r+1} is inside this process
    except MeshError as err:
        out["y_error"] = str(err)
    try:
        mesh.get_all_groups()
    except MeshError:
        out["all_groups_error"] = True
    one_each = sw.tf.create_distributed_mesh([("d", 2)])
    out["all_groups"] = [dist.get_process_group_ranks(g) for g in one_each.get_all_groups()]
    flat = mesh.flatten()
    dt = sw.distribute_tensor(torch.arange(8.0), flat, [Shard(0)])
    out["flat_local"] = [c.tolist() for c in sw.tf.unpack(dt)]
    out["flat_full"] = dt.full_tensor().tolist()
    sw.tf.barrier(mesh, "after the checks", timeout_in_ms=30_000)
    out["round_trip"] = DeviceMesh.from_string(mesh.to_string()) == mesh
    return out


def test_two_processes_groups_clients_barrier():
    results = run_in_processes(_two_process_job, 2, timeout=120)
    for rank, out in enumerate(results):
        assert out["client"] == (rank, 2, 2) and out["rank"] == rank
        assert out["group_ranks"] == [0, 1] and out["group_sum"] == 3.0
        assert "lives inside process" in out["y_error"] and out["all_groups_error"]
        assert out["all_groups"] == [[0, 1]]
        devices = (2 * rank, 2 * rank + 1)
        assert out["flat_local"] == [[2.0 * d, 2.0 * d + 1] for d in devices]
        assert out["flat_full"] == list(range(8)) and out["round_trip"]
