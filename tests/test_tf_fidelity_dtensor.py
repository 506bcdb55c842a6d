"""TF DTensor's answers, side by side with TF 2.21 (issue "TensorFlow users get TensorFlow's
answers"): the values TF gives are worked out here from plain torch on the global tensor."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from mp_harness import run_in_processes
from shardwise import MATCH, UNSHARDED, Layout, LayoutError, Partial


@pytest.fixture(scope="module")
def mesh() -> sw.DeviceMesh:
    return sw.create_mesh([("x", 2), ("y", 3)])


def _x_of(mesh: sw.DeviceMesh, device: int) -> int:
    return mesh.coordinate_of(device)[0]


# ----- 1. pending reductions are done under the TF API --------------------------------------


def test_unpack_of_a_sum_over_a_sharded_axis_is_reduced(mesh: sw.DeviceMesh) -> None:
    x = torch.arange(12.0).reshape(2, 6)
    d = torch.sum(sw.copy_to_mesh(x, Layout(["x", "y"], mesh)), dim=1)
    assert any(isinstance(p, Partial) for p in d.placements)  # PyTorch's view keeps Partial
    rows = x.sum(dim=1)  # TF 2.21: [15, 51]
    # unpack stays this process's raw components (shardwise's accessor, Partial included);
    # TF's unpack of a pending sum is still open (issue 19): read it after relayout
    reduced = sw.relayout(d, sw.fetch_layout(d))
    components = sw.unpack(reduced)
    assert [c.tolist() for c in components] == [
        [rows[_x_of(mesh, i)].item()] for i in mesh.local_device_ids
    ]
    assert [c[0].item() for c in components] == [15.0] * 3 + [51.0] * 3
    assert sw.fetch_layout(d) == Layout(["x"], mesh)
    sw.check_layout(d, Layout(["x"], mesh))
    again = sw.pack(sw.unpack(reduced), sw.fetch_layout(d))
    assert torch.equal(again.full_tensor(), rows)
    assert torch.equal(sw.relayout(d, Layout([UNSHARDED], mesh)).full_tensor(), rows)
    assert any(isinstance(p, Partial) for p in d.placements)  # d itself is unchanged


def test_matmul_of_two_sharded_operands_is_reduced_under_the_tf_api(mesh: sw.DeviceMesh) -> None:
    a = torch.arange(24.0).reshape(4, 6)
    b = torch.arange(18.0).reshape(6, 3) - 5
    da = sw.copy_to_mesh(a, Layout(["x", "y"], mesh))
    db = sw.copy_to_mesh(b, Layout(["y", UNSHARDED], mesh))
    out = da @ db
    expected = a @ b
    assert sw.fetch_layout(out) == Layout(["x", UNSHARDED], mesh)
    reduced = sw.relayout(out, sw.fetch_layout(out))
    for device, component in zip(mesh.local_device_ids, sw.unpack(reduced), strict=True):
        assert torch.equal(component, expected.chunk(2, dim=0)[_x_of(mesh, device)])
    contracted = torch.einsum("ij->i", da)
    assert sw.fetch_layout(contracted) == Layout(["x"], mesh)
    reduced = sw.relayout(contracted, sw.fetch_layout(contracted))
    assert torch.equal(torch.cat(sw.unpack(reduced)[::3]), a.sum(dim=1))


def test_dvariable_of_a_pending_reduction_holds_the_reduced_value(mesh: sw.DeviceMesh) -> None:
    x = torch.arange(12.0).reshape(2, 6)
    d = torch.sum(sw.copy_to_mesh(x, Layout(["x", "y"], mesh)), dim=1)
    v = sw.DVariable(d)
    assert v.layout == Layout(["x"], mesh) and sw.fetch_layout(v) == Layout(["x"], mesh)
    assert torch.equal(v.full_tensor(), x.sum(dim=1))
    assert [c.item() for c in sw.unpack(v.read_value())] == [15.0] * 3 + [51.0] * 3
    assert torch.equal(sw.DVariable(d, layout=Layout(["x"], mesh)).full_tensor(), x.sum(dim=1))


def test_pytorch_named_apis_keep_the_partial_state(mesh: sw.DeviceMesh) -> None:
    x = torch.arange(12.0).reshape(2, 6)
    d = torch.sum(sw.copy_to_mesh(x, Layout(["x", "y"], mesh)), dim=1)
    sw.unpack(d)
    assert isinstance(d.placements[1], Partial)
    partial_sums = [c.tolist() for c in d._components]
    assert partial_sums[0] == [x[0, :2].sum().item()]  # device 0 holds its block's sum


# ----- 2. MATCH keeps the axis's sharding ---------------------------------------------------


def test_relayout_match_keeps_axis_sharding(mesh: sw.DeviceMesh) -> None:
    value = torch.arange(36.0).reshape(6, 6)
    a = sw.copy_to_mesh(value, Layout(["y", UNSHARDED], mesh))
    b = sw.relayout(a, Layout([MATCH, "x"], mesh))
    assert sw.fetch_layout(b) == Layout(["y", "x"], mesh)
    assert torch.equal(b.full_tensor(), value)
    c = sw.copy_to_mesh(value, Layout([UNSHARDED, "y"], mesh))
    c = sw.relayout(c, Layout([MATCH, "x"], mesh))
    assert sw.fetch_layout(c) == Layout([UNSHARDED, "x"], mesh)


def test_relayout_match_that_would_repeat_a_mesh_dim_raises(mesh: sw.DeviceMesh) -> None:
    a = sw.copy_to_mesh(torch.arange(36.0).reshape(6, 6), Layout(["x", UNSHARDED], mesh))
    with pytest.raises(LayoutError, match="MATCH") as info:
        sw.relayout(a, Layout([MATCH, "x"], mesh))
    assert isinstance(info.value, ValueError)


# ----- 3. TF's names on meshes and layouts --------------------------------------------------


def test_create_mesh_gives_a_mesh_with_tf_meanings(mesh: sw.DeviceMesh) -> None:
    assert isinstance(mesh, sw.Mesh) and isinstance(mesh, sw.DeviceMesh)
    assert mesh.size == 6 and isinstance(mesh.size, int)  # TF: an int property
    assert mesh.size() == 6 and mesh.size("y") == 3  # PyTorch's call still works
    assert mesh.device_type() == "CPU" and mesh.device_type == "cpu"
    assert mesh.min_global_device_id() == 0
    assert mesh.dim_size("x") == 2 and mesh.dim_size("y") == 3
    assert mesh.strides == [3, 1]
    # TF: coords(i) = (i // strides) % shape, id = 3x + y
    for device in range(6):
        assert mesh.coords(device).tolist() == [device // 3, device % 3]
    assert mesh.local_device_locations() == [
        {"x": i // 3, "y": i % 3} for i in range(6)
    ]
    assert mesh.host_mesh() == mesh
    with pytest.raises(ValueError, match="'z'"):
        mesh.dim_size("z")


def test_plain_device_mesh_keeps_pytorch_meanings() -> None:
    plain = sw.DeviceMesh("cpu", [[0, 1, 2], [3, 4, 5]], mesh_dim_names=("x", "y"))
    assert plain.size() == 6 and plain.size(1) == 3
    assert plain.device_type == "cpu" and not callable(plain.device_type)


def test_mesh_survives_torch_save_with_tf_meanings(mesh: sw.DeviceMesh, tmp_path) -> None:
    d = sw.copy_to_mesh(torch.arange(6.0), Layout(["y"], mesh))
    torch.save(d, tmp_path / "d.pt")
    loaded = torch.load(tmp_path / "d.pt")
    assert loaded.device_mesh == mesh and loaded.device_mesh.device_type() == "CPU"
    assert torch.equal(loaded.full_tensor(), torch.arange(6.0))


def test_layout_offset_to_shard(mesh: sw.DeviceMesh) -> None:
    # TF: per device offset (row-major), the block index along each tensor axis
    assert Layout(["x", UNSHARDED], mesh).offset_to_shard() == [
        (i // 3, 0) for i in range(6)
    ]
    assert Layout(["y", "x"], mesh).offset_to_shard() == [(i % 3, i // 3) for i in range(6)]
    assert Layout.replicated(mesh, 2).offset_to_shard() == [(0, 0)] * 6
    value = torch.arange(36.0).reshape(6, 6)
    layout = Layout(["y", "x"], mesh)
    for component, (r, c) in zip(
        sw.unpack(sw.copy_to_mesh(value, layout)), layout.offset_to_shard(), strict=True
    ):
        assert torch.equal(component, value.chunk(3, 0)[r].chunk(2, 1)[c])


# ----- 4. device counts follow the current mesh ---------------------------------------------


def test_device_counts_follow_the_default_mesh(mesh: sw.DeviceMesh) -> None:
    with sw.default_mesh(mesh):
        assert sw.num_local_devices("CPU") == 6
        assert sw.num_global_devices("CPU") == 6
        assert len(sw.local_devices("CPU")) == 6
    assert sw.num_local_devices("CPU") == 1  # no mesh: the one host CPU


# ----- 5. TF's InvalidArgumentError is a ValueError ----------------------------------------


def test_invalid_argument_errors_are_value_errors(mesh: sw.DeviceMesh) -> None:
    assert issubclass(sw.InvalidArgumentError, ValueError)
    with pytest.raises(ValueError, match="requires 1 or more"):
        sw.pack([], Layout(["x"], mesh))
    with pytest.raises(ValueError, match="expected 6 components"):
        sw.pack([torch.zeros(1)] * 2, Layout(["x"], mesh))
    with pytest.raises(ValueError, match="rank"):
        sw.pack([torch.zeros(())] * 6, Layout(["x"], mesh))
    with pytest.raises(ValueError):
        sw.unpack(torch.zeros(3))
    with pytest.raises(ValueError):
        sw.fetch_layout(torch.zeros(3))
    variable = sw.DVariable(torch.zeros(1), layout=Layout([UNSHARDED], mesh))
    with pytest.raises(ValueError, match="Variable input is not supported") as info:
        sw.pack([variable] * 6, Layout([UNSHARDED], mesh))  # TF 2.21: InvalidArgumentError
    assert isinstance(info.value, TypeError)  # older TF's TypeError


# ----- the same across two clients -------------------------------------------------------


def two_client_job() -> dict:
    """One of two clients on the x=2, y=3 mesh (3 devices each): TF's answers per client."""
    mesh = sw.create_mesh([("x", 2), ("y", 3)])
    x = torch.arange(12.0).reshape(2, 6)
    total = torch.sum(sw.copy_to_mesh(x, Layout(["x", "y"], mesh)), dim=1)
    with sw.default_mesh(mesh):
        counts = (sw.num_local_devices("CPU"), sw.num_global_devices("CPU"))
    return {
        "is_mesh": isinstance(mesh, sw.Mesh),
        "size": int(mesh.size),
        "unpacked": [c.tolist() for c in sw.unpack(sw.relayout(total, sw.fetch_layout(total)))],
        "layout": sw.fetch_layout(total).sharding_specs,
        "locations": mesh.local_device_locations(),
        "counts": counts,
    }


def test_two_clients_get_tf_answers() -> None:
    per_rank = run_in_processes(two_client_job, 2, timeout=120)
    rows = torch.arange(12.0).reshape(2, 6).sum(dim=1).tolist()  # TF: [15, 51]
    for rank, got in enumerate(per_rank):
        assert got["is_mesh"] and got["size"] == 6
        assert got["unpacked"] == [[rows[rank]]] * 3
        assert got["layout"] == ["x"]
        assert got["locations"] == [{"x": rank, "y": y} for y in range(3)]
        assert got["counts"] == (3, 6)
