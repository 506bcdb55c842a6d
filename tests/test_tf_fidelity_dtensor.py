"""TF DTensor's answers, side by side with TF 2.21 (issue "TensorFlow users get TensorFlow's
answers"): the values TF gives are worked out here from plain torch on the global tensor."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from mp_harness import run_in_processes
from shardwise import Partial
from shardwise.errors import LayoutError
from shardwise.tf import MATCH, UNSHARDED, Layout


@pytest.fixture(scope="module")
def mesh() -> sw.DeviceMesh:
    return sw.tf.create_mesh([("x", 2), ("y", 3)])


def _x_of(mesh: sw.DeviceMesh, device: int) -> int:
    return mesh.coordinate_of(device)[0]


# ----- 1. pending reductions are done under the TF API --------------------------------------


def test_unpack_of_a_sum_over_a_sharded_axis_is_reduced(mesh: sw.DeviceMesh) -> None:
    x = torch.arange(12.0).reshape(2, 6)
    d = torch.sum(sw.tf.copy_to_mesh(x, Layout(["x", "y"], mesh)), dim=1)
    assert any(isinstance(p, Partial) for p in d.placements)  # PyTorch's view keeps Partial
    rows = x.sum(dim=1)  # TF 2.21: [15, 51]
    components = sw.tf.unpack(d)
    assert [c.tolist() for c in components] == [
        [rows[_x_of(mesh, i)].item()] for i in mesh.local_device_ids
    ]
    assert [c[0].item() for c in components] == [15.0] * 3 + [51.0] * 3
    assert sw.tf.fetch_layout(d) == Layout(["x"], mesh)
    sw.tf.check_layout(d, Layout(["x"], mesh))
    again = sw.tf.pack(sw.tf.unpack(d), sw.tf.fetch_layout(d))
    assert torch.equal(again.full_tensor(), rows)
    assert torch.equal(sw.tf.relayout(d, Layout([UNSHARDED], mesh)).full_tensor(), rows)
    assert any(isinstance(p, Partial) for p in d.placements)  # d itself is unchanged


def test_local_components_are_the_raw_partial_pieces(mesh: sw.DeviceMesh) -> None:
    x = torch.arange(12.0).reshape(2, 6)
    d = torch.sum(sw.tf.copy_to_mesh(x, Layout(["x", "y"], mesh)), dim=1)
    raw = sw.local_components(d)
    for device, piece in zip(mesh.local_device_ids, raw, strict=True):
        row, col = mesh.coordinate_of(device)
        assert piece.tolist() == [x[row].chunk(3)[col].sum().item()]  # the unreduced block sum
    assert torch.equal(sw.DTensor.from_local(raw, mesh, d.placements).full_tensor(), x.sum(1))


def test_unpack_of_a_pending_reduction_is_differentiable(mesh: sw.DeviceMesh) -> None:
    x = torch.arange(12.0).reshape(2, 6).requires_grad_()
    d = torch.sum(sw.tf.copy_to_mesh(x, Layout(["x", "y"], mesh)), dim=1)
    w = torch.tensor([2.0, 5.0])
    components = sw.tf.unpack(d)
    pairs = zip(mesh.local_device_ids, components, strict=True)
    sum(c.sum() * w[_x_of(mesh, i)] for i, c in pairs).backward()
    # the 3 copies of a row sum are replicas of one value (shardwise's SPMD convention for
    # Replicate components): the gradient is one replica's, d(w . x.sum(1))/dx
    assert torch.equal(x.grad, w[:, None].expand(2, 6))


def test_matmul_of_two_sharded_operands_is_reduced_under_the_tf_api(mesh: sw.DeviceMesh) -> None:
    a = torch.arange(24.0).reshape(4, 6)
    b = torch.arange(18.0).reshape(6, 3) - 5
    da = sw.tf.copy_to_mesh(a, Layout(["x", "y"], mesh))
    db = sw.tf.copy_to_mesh(b, Layout(["y", UNSHARDED], mesh))
    out = da @ db
    expected = a @ b
    assert sw.tf.fetch_layout(out) == Layout(["x", UNSHARDED], mesh)
    for device, component in zip(mesh.local_device_ids, sw.tf.unpack(out), strict=True):
        assert torch.equal(component, expected.chunk(2, dim=0)[_x_of(mesh, device)])
    repacked = sw.tf.pack(sw.tf.unpack(out), sw.tf.fetch_layout(out))
    assert torch.equal(repacked.full_tensor(), expected)
    contracted = torch.einsum("ij->i", da)
    assert sw.tf.fetch_layout(contracted) == Layout(["x"], mesh)
    assert torch.equal(torch.cat(sw.tf.unpack(contracted)[::3]), a.sum(dim=1))


def test_dvariable_of_a_pending_reduction_holds_the_reduced_value(mesh: sw.DeviceMesh) -> None:
    x = torch.arange(12.0).reshape(2, 6)
    d = torch.sum(sw.tf.copy_to_mesh(x, Layout(["x", "y"], mesh)), dim=1)
    v = sw.tf.DVariable(d)
    assert v.layout == Layout(["x"], mesh) and sw.tf.fetch_layout(v) == Layout(["x"], mesh)
    assert torch.equal(v.full_tensor(), x.sum(dim=1))
    assert [c.item() for c in sw.tf.unpack(v.read_value())] == [15.0] * 3 + [51.0] * 3
    assert torch.equal(sw.tf.DVariable(d, layout=Layout(["x"], mesh)).full_tensor(), x.sum(dim=1))


def test_pytorch_named_apis_keep_the_partial_state(mesh: sw.DeviceMesh) -> None:
    x = torch.arange(12.0).reshape(2, 6)
    d = torch.sum(sw.tf.copy_to_mesh(x, Layout(["x", "y"], mesh)), dim=1)
    sw.tf.unpack(d)
    assert isinstance(d.placements[1], Partial)
    partial_sums = [c.tolist() for c in sw.local_components(d)]
    assert partial_sums[0] == [x[0, :2].sum().item()]  # device 0 holds its block's sum


# ----- 2. MATCH keeps the axis's sharding ---------------------------------------------------


def test_relayout_match_keeps_axis_sharding(mesh: sw.DeviceMesh) -> None:
    value = torch.arange(36.0).reshape(6, 6)
    a = sw.tf.copy_to_mesh(value, Layout(["y", UNSHARDED], mesh))
    b = sw.tf.relayout(a, Layout([MATCH, "x"], mesh))
    assert sw.tf.fetch_layout(b) == Layout(["y", "x"], mesh)
    assert torch.equal(b.full_tensor(), value)
    c = sw.tf.copy_to_mesh(value, Layout([UNSHARDED, "y"], mesh))
    c = sw.tf.relayout(c, Layout([MATCH, "x"], mesh))
    assert sw.tf.fetch_layout(c) == Layout([UNSHARDED, "x"], mesh)


def test_relayout_match_that_would_repeat_a_mesh_dim_raises(mesh: sw.DeviceMesh) -> None:
    a = sw.tf.copy_to_mesh(torch.arange(36.0).reshape(6, 6), Layout(["x", UNSHARDED], mesh))
    with pytest.raises(LayoutError, match="MATCH") as info:
        sw.tf.relayout(a, Layout([MATCH, "x"], mesh))
    assert isinstance(info.value, ValueError)


# ----- 3. TF's names on meshes and layouts --------------------------------------------------


def test_create_mesh_gives_a_mesh_with_tf_meanings(mesh: sw.DeviceMesh) -> None:
    assert isinstance(mesh, sw.tf.Mesh) and isinstance(mesh, sw.DeviceMesh)
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
    d = sw.tf.copy_to_mesh(torch.arange(6.0), Layout(["y"], mesh))
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
        sw.tf.unpack(sw.tf.copy_to_mesh(value, layout)), layout.offset_to_shard(), strict=True
    ):
        assert torch.equal(component, value.chunk(3, 0)[r].chunk(2, 1)[c])


# ----- 4. device counts follow the current mesh ---------------------------------------------


def test_device_counts_follow_the_default_mesh(mesh: sw.DeviceMesh) -> None:
    with sw.tf.default_mesh(mesh):
        assert sw.tf.num_local_devices("CPU") == 6
        assert sw.tf.num_global_devices("CPU") == 6
        assert len(sw.tf.local_devices("CPU")) == 6
    assert sw.tf.num_local_devices("CPU") == 1  # no mesh: the one host CPU


# ----- 5. TF's InvalidArgumentError is a ValueError ----------------------------------------


def test_invalid_argument_errors_are_value_errors(mesh: sw.DeviceMesh) -> None:
    assert issubclass(sw.errors.InvalidArgumentError, ValueError)
    with pytest.raises(ValueError, match="requires 1 or more"):
        sw.tf.pack([], Layout(["x"], mesh))
    with pytest.raises(ValueError, match="expected 6 components"):
        sw.tf.pack([torch.zeros(1)] * 2, Layout(["x"], mesh))
    with pytest.raises(ValueError, match="rank"):
        sw.tf.pack([torch.zeros(())] * 6, Layout(["x"], mesh))
    with pytest.raises(ValueError):
        sw.tf.unpack(torch.zeros(3))
    with pytest.raises(ValueError):
        sw.tf.fetch_layout(torch.zeros(3))
    variable = sw.tf.DVariable(torch.zeros(1), layout=Layout([UNSHARDED], mesh))
    with pytest.raises(ValueError, match="Variable input is not supported") as info:
        sw.tf.pack([variable] * 6, Layout([UNSHARDED], mesh))  # TF 2.21: InvalidArgumentError
    assert isinstance(info.value, TypeError)  # older TF's TypeError


def test_op_shape_mismatches_are_value_errors_as_tf_and_runtime_errors_as_torch(
    mesh: sw.DeviceMesh,
) -> None:
    a, b = torch.ones(4), torch.ones(3)
    with pytest.raises(RuntimeError):
        a + b  # single-device torch rejects it too
    da = sw.tf.copy_to_mesh(a, Layout([UNSHARDED], mesh))
    db = sw.tf.copy_to_mesh(b, Layout([UNSHARDED], mesh))
    with pytest.raises(sw.errors.OpArgumentError, match=r"\[\[4\], \[3\]\]") as info:
        da + db  # TF 2.21: InvalidArgumentError "Incompatible shapes: [4] vs. [3]"
    assert isinstance(info.value, ValueError) and isinstance(info.value, RuntimeError)
    assert isinstance(info.value, sw.errors.InvalidArgumentError) and str(mesh) in str(info.value)
    left = sw.tf.copy_to_mesh(torch.ones(4, 3), Layout(["x", UNSHARDED], mesh))
    right = sw.tf.copy_to_mesh(torch.ones(2, 5), Layout.replicated(mesh, 2))
    with pytest.raises(ValueError, match=r"\[\[4, 3\], \[2, 5\]\].*Shard\(dim=0\)"):
        left @ right  # the global shapes are named, not the local pieces'
    with pytest.raises(ValueError, match="rank"):
        sw.tf.copy_to_mesh(torch.ones(2, 2), Layout(["x"], mesh))  # TF: layout rank mismatch
    with pytest.raises(ValueError, match="repeated"):
        Layout(["x", "x"], mesh)


# ----- 6. torch's factory functions under default_mesh -------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.ones(4),
        lambda: torch.zeros(2, 3, dtype=torch.float64),
        lambda: torch.full((2,), 3.5),
        lambda: torch.empty(3).fill_(2.0),
        lambda: torch.arange(5),
        lambda: torch.linspace(0.0, 1.0, 4),
    ],
    ids=["ones", "zeros", "full", "empty", "arange", "linspace"],
)
def test_factories_under_default_mesh_are_replicated_dtensors(
    mesh: sw.DeviceMesh, make
) -> None:
    expected = make()  # outside the block: torch's plain tensor
    assert not isinstance(expected, sw.DTensor)
    with sw.tf.default_mesh(mesh):
        got = make()
    assert isinstance(got, sw.DTensor) and got.device_mesh is mesh
    assert sw.tf.fetch_layout(got) == Layout.replicated(mesh, expected.ndim)
    assert got.dtype == expected.dtype and torch.equal(got.full_tensor(), expected)
    assert all(torch.equal(c, expected) for c in sw.tf.unpack(got))


def test_random_factories_under_default_mesh_draw_as_torch(mesh: sw.DeviceMesh) -> None:
    draws = [lambda: torch.rand(3), lambda: torch.randn(2, 2), lambda: torch.randint(0, 9, (4,))]
    for draw in draws:
        torch.manual_seed(3)
        expected = draw()
        torch.manual_seed(3)
        with sw.tf.default_mesh(mesh):
            got = draw()
        assert isinstance(got, sw.DTensor) and torch.equal(got.full_tensor(), expected)
        assert all(torch.equal(c, expected) for c in sw.tf.unpack(got))


def test_default_mesh_factories_keep_grad_and_leave_constants_and_libraries_plain(
    mesh: sw.DeviceMesh,
) -> None:
    given = torch.zeros(2)
    with sw.tf.default_mesh(mesh):
        w = torch.ones(3, requires_grad=True)
        constant = torch.tensor([1.0, 2.0])  # tf.constant stays a plain tensor too
        linear = torch.nn.Linear(3, 2)  # torch's own torch.empty inside stays plain
        written = torch.ones(2, out=given)
    assert isinstance(w, sw.DTensor) and w.is_leaf and w.requires_grad
    (w * 2).sum().full_tensor().backward()
    assert torch.equal(w.grad.full_tensor(), torch.full((3,), 2.0))
    assert type(constant) is torch.Tensor and type(linear.weight) is torch.nn.Parameter
    assert written is given and type(given) is torch.Tensor


def test_default_mesh_factories_nest_and_stay_in_their_thread(mesh: sw.DeviceMesh) -> None:
    import threading

    small = sw.tf.create_mesh([("a", 2)])
    assert type(torch.ones(2)) is torch.Tensor
    seen = []
    with sw.tf.default_mesh(mesh):
        with sw.tf.default_mesh(small):
            assert torch.ones(2).device_mesh is small  # the inner mesh wins
        assert torch.ones(2).device_mesh is mesh  # and the outer one is back
        other = threading.Thread(target=lambda: seen.append(type(torch.ones(2))))
        other.start()
        other.join(timeout=30)
        with mesh:  # PyTorch's `with mesh:` is not TF's default mesh: torch.ones stays plain
            pass
    assert seen == [torch.Tensor]  # another thread is not inside the block
    assert type(torch.ones(2)) is torch.Tensor
    with small:
        assert type(torch.ones(2)) is torch.Tensor


# ----- the same across two clients -------------------------------------------------------


def two_client_job() -> dict:
    """One of two clients on the x=2, y=3 mesh (3 devices each): TF's answers per client."""
    mesh = sw.tf.create_mesh([("x", 2), ("y", 3)])
    x = torch.arange(12.0).reshape(2, 6)
    total = torch.sum(sw.tf.copy_to_mesh(x, Layout(["x", "y"], mesh)), dim=1)
    with sw.tf.default_mesh(mesh):
        counts = (sw.tf.num_local_devices("CPU"), sw.tf.num_global_devices("CPU"))
    return {
        "is_mesh": isinstance(mesh, sw.tf.Mesh),
        "size": int(mesh.size),
        "unpacked": [c.tolist() for c in sw.tf.unpack(total)],
        "layout": sw.tf.fetch_layout(total).sharding_specs,
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


# ----- TF 2.21's answers, measured in TF 2.21 on logical CPU devices (issue 34) --------------


def test_copy_to_mesh_with_a_replicated_layout_of_another_rank(mesh: sw.DeviceMesh) -> None:
    """TF 2.21: a fully replicated layout of any rank replicates the tensor at its own rank
    (``Layout.replicated(mesh, 2)`` on [1., 2.] gives sharding_specs ['unsharded'] and [1., 2.]
    on every device); a sharded layout of another rank raises."""
    for rank in (0, 2, 3):
        d = sw.tf.copy_to_mesh(torch.tensor([1.0, 2.0]), Layout.replicated(mesh, rank))
        assert sw.tf.fetch_layout(d).sharding_specs == [UNSHARDED]
        assert [c.tolist() for c in sw.tf.unpack(d)] == [[1.0, 2.0]] * mesh.size()
    scalar = sw.tf.copy_to_mesh(torch.tensor(5.0), Layout.replicated(mesh, 2))
    assert sw.tf.fetch_layout(scalar).rank == 0
    assert [c.item() for c in sw.tf.unpack(scalar)] == [5.0] * mesh.size()
    with pytest.raises(LayoutError, match="rank 1"):
        sw.tf.copy_to_mesh(torch.tensor([1.0, 2.0]), Layout(["x", UNSHARDED], mesh))
    with pytest.raises(LayoutError, match="rank 0"):
        sw.tf.copy_to_mesh(torch.tensor(5.0), Layout(["x"], mesh))


_DEVICES = ",".join(f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(4))
_SHORT_2X2 = f"|x=2,y=2|0,1,2,3|0,1,2,3|{_DEVICES}"


def test_mesh_names_strings_and_equality() -> None:
    """TF 2.21: a named mesh differs from the unnamed one of the same devices (and from
    ``create_mesh``'s); ``name|dims|*CPU`` is TF's short form (devices 0..N-1)."""
    unnamed = sw.DeviceMesh.from_string(_SHORT_2X2)
    named = sw.DeviceMesh.from_string("mymesh" + _SHORT_2X2)
    assert unnamed == sw.tf.create_mesh([("x", 2), ("y", 2)])  # TF 2.21: True
    assert named != unnamed and named.mesh_name == "mymesh"  # TF 2.21: False, 'mymesh'
    short = sw.DeviceMesh.from_string("|x=2,y=2|*CPU")
    assert short.shape == (2, 2) and list(short.local_device_ids) == [0, 1, 2, 3]
    assert short == unnamed and sw.DeviceMesh.from_string("m|x=2|*CPU").mesh_name == "m"
    assert sw.DeviceMesh.from_string("|x=8|*CPU").shape == (8,)
    with pytest.raises(ValueError, match=r"expected a \*"):
        sw.DeviceMesh.from_string("|x=2,y=2|CPU")  # TF 2.21: "Expected a * ..."


def test_tf_mesh_constructor_checks() -> None:
    """TF 2.21's Mesh(dim_names, global_device_ids, local_device_ids, local_devices): ValueError
    for ids that do not increase row-major from 0 and for local_device_ids and local_devices
    of different lengths."""
    devices = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(4)]
    with pytest.raises(ValueError, match="row-major"):
        sw.tf.Mesh(["x", "y"], [[0, 2], [1, 3]], [0, 1, 2, 3], devices)
    with pytest.raises(ValueError, match="differ in length"):
        sw.tf.Mesh(["x", "y"], [[0, 1], [2, 3]], [0, 1, 2], devices)
    assert sw.tf.Mesh(["x", "y"], [[0, 1], [2, 3]], [0, 1, 2, 3], devices).shape == (2, 2)


def test_mesh_indexed_by_position_raises_type_error() -> None:
    """TF 2.21: ``mesh[0]`` raises TypeError (a mesh is indexed by dim name)."""
    with pytest.raises(TypeError):
        sw.tf.create_mesh([("x", 2), ("y", 2)])[0]


def test_documented_mesh_differences_keep_pytorch_meanings() -> None:
    """The rows of docs/tf_dtensor.md's differences table (TF 2.21 on the left): ``shape()``
    [2, 2] is the property (2, 2); ``mesh["x"]`` MeshDimension('x', 2) is the sub-mesh, its
    size ``dim_size``; ``mesh == 3`` TypeError is False; repeated dim names, accepted, raise."""
    mesh = sw.tf.create_mesh([("x", 2), ("y", 2)])
    assert mesh.shape == (2, 2)
    assert mesh["x"].mesh.tolist() == [0, 2] and mesh.dim_size("x") == 2
    assert (mesh == 3) is False and (mesh == None) is False  # noqa: E711
    with pytest.raises(sw.errors.MeshError, match="unique"):
        sw.tf.create_mesh([("x", 2), ("x", 2)])


def test_dvariable_gradient_has_tf_value_in_the_variable_layout() -> None:
    """TF 2.21: the gradient of ``matmul(v, x)`` (v: [4, 3] on ["x", UNSHARDED]) with upstream
    arange(8).reshape(4, 2) is [[-1, 1, 3], [-7, 3, 13], [-13, 5, 23], [-19, 7, 33]], laid out
    [UNSHARDED, UNSHARDED]; shardwise gives the same value in the variable's layout."""
    mesh = sw.tf.create_mesh([("x", 2), ("y", 2)])
    layout = Layout(["x", UNSHARDED], mesh)
    v = sw.tf.DVariable(torch.arange(12.0).reshape(4, 3) / 7, layout=layout)
    x = sw.tf.copy_to_mesh(torch.arange(6.0).reshape(3, 2) - 2, Layout.replicated(mesh, 2))
    up = sw.tf.copy_to_mesh(torch.arange(8.0).reshape(4, 2), layout)
    torch.matmul(v, x).backward(up)
    tf_grad = [[-1.0, 1.0, 3.0], [-7.0, 3.0, 13.0], [-13.0, 5.0, 23.0], [-19.0, 7.0, 33.0]]
    assert v.grad.full_tensor().tolist() == tf_grad
    assert sw.tf.fetch_layout(v.grad) == layout
    assert [list(c.shape) for c in sw.tf.unpack(v.grad)] == [[2, 3]] * 4


def test_mirrored_strategy_without_devices_takes_one_cpu() -> None:
    """TF 2.21 takes every logical CPU device tf.config made (8); shardwise has none to take
    and gives one replica; naming the 8 gives TF's count (docs/distribute.md)."""
    import shardwise.distribute as swd

    for s in (swd.MirroredStrategy(), swd.MirroredStrategy([])):
        assert s.extended.worker_devices == ("cpu:0",) and s.num_replicas_in_sync == 1
    assert swd.MirroredStrategy([f"cpu:{i}" for i in range(8)]).num_replicas_in_sync == 8
