"""TF DTensor's user API: Layout, pack/unpack (seed 002's examples), relayout, DVariable.

The oracle is plain torch: a device's expected component is its ``torch.chunk`` block of the
global tensor along every sharded axis, worked out here from the mesh coordinates.
"""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise import InterleavedShard, Partial, Replicate, Shard
from shardwise.errors import InvalidArgumentError, LayoutError, ShardwiseError
from shardwise.tf import MATCH, UNSHARDED, DVariable, Layout


@pytest.fixture(scope="module")
def mesh() -> sw.DeviceMesh:
    return sw.tf.create_mesh([("x", 2), ("y", 3)])


def coords(device: int) -> dict[str, int]:
    """Seed 002's device table for the x=2, y=3 mesh: device id = 3x + y."""
    return {"x": device // 3, "y": device % 3}


def expected_component(
    value: torch.Tensor, specs: list[str], sizes: dict[str, int], coord: dict[str, int]
) -> torch.Tensor:
    """Device ``coord``'s block of ``value``: torch.chunk pieces, missing trailing ones empty."""
    out = value
    for axis, spec in enumerate(specs):
        if spec == UNSHARDED:
            continue
        pieces = torch.chunk(out, sizes[spec], dim=axis)
        k = coord[spec]
        out = pieces[k] if k < len(pieces) else out.narrow(axis, out.shape[axis], 0)
    return out


def check_components(dt: sw.DTensor, value: torch.Tensor, specs: list[str]) -> None:
    sizes = {"x": 2, "y": 3}
    comps = sw.tf.unpack(dt)
    assert len(comps) == 6
    for device, comp in enumerate(comps):
        want = expected_component(value, specs, sizes, coords(device))
        assert comp.shape == want.shape, (device, comp.shape, want.shape)
        assert torch.equal(comp, want), device


def check_round_trip(dt: sw.DTensor) -> None:
    """pack(unpack(d), fetch_layout(d)) == d in content and layout."""
    again = sw.tf.pack(sw.tf.unpack(dt), sw.tf.fetch_layout(dt))
    assert sw.tf.fetch_layout(again) == sw.tf.fetch_layout(dt)
    assert again.shape == dt.shape
    assert torch.equal(again.full_tensor(), dt.full_tensor())
    for a, b in zip(sw.tf.unpack(again), sw.tf.unpack(dt), strict=True):
        assert torch.equal(a, b)


# ----- seed 002: the four worked examples ----------------------------------------------------


def test_seed_example_1_vector_sharded_over_x(mesh):
    layout = Layout(["x"], mesh)
    table = {d: torch.arange(0, 64) if d < 3 else torch.arange(64, 128) for d in range(6)}
    dt = sw.tf.pack([table[d] for d in range(6)], layout)
    assert list(dt.shape) == [128]
    assert torch.equal(dt.full_tensor(), torch.arange(128))
    for d, comp in enumerate(sw.tf.unpack(dt)):
        assert comp.shape == (64,)
        assert torch.equal(comp, table[d])
    placed = sw.tf.copy_to_mesh(torch.arange(128), layout)
    for d, comp in enumerate(sw.tf.unpack(placed)):
        assert torch.equal(comp, table[d])
    check_round_trip(dt)
    check_round_trip(placed)


def test_seed_example_1_shape_2_gives_shape_1_components(mesh):
    dt = sw.tf.copy_to_mesh(torch.tensor([7.0, 8.0]), Layout(["x"], mesh))
    for d, comp in enumerate(sw.tf.unpack(dt)):
        assert comp.shape == (1,)
        assert comp.item() == (7.0 if d < 3 else 8.0)


def test_seed_example_2_fully_sharded_matrix(mesh):
    layout = Layout(["x", "y"], mesh)
    value = torch.arange(6.0).reshape(2, 3)
    dt = sw.tf.pack([torch.tensor([[float(d)]]) for d in range(6)], layout)
    assert list(dt.shape) == [2, 3]
    assert torch.equal(dt.full_tensor(), value)
    for d, comp in enumerate(sw.tf.unpack(dt)):
        assert comp.shape == (1, 1)
        assert torch.equal(comp, torch.tensor([[float(d)]]))
    check_components(sw.tf.copy_to_mesh(value, layout), value, ["x", "y"])
    check_round_trip(dt)


def test_seed_example_3_scalar(mesh):
    layout = Layout([], mesh)
    dt = sw.tf.pack([torch.tensor(123.0) for _ in range(6)], layout)
    assert dt.shape == ()
    assert layout.is_fully_replicated()
    assert sw.tf.fetch_layout(dt) == layout
    assert torch.equal(dt.full_tensor(), torch.tensor(123.0))
    for comp in sw.tf.unpack(dt):
        assert comp.shape == ()
        assert comp.item() == 123.0
    check_round_trip(dt)


def test_seed_example_4_rank_3(mesh):
    layout = Layout(["x", UNSHARDED, UNSHARDED], mesh)
    value = torch.arange(12.0).reshape(2, 2, 3)
    table = {
        d: torch.arange(6.0).reshape(1, 2, 3) if d < 3 else torch.arange(6.0, 12.0).reshape(1, 2, 3)
        for d in range(6)
    }
    dt = sw.tf.pack([table[d] for d in range(6)], layout)
    assert list(dt.shape) == [2, 2, 3]
    assert torch.equal(dt.full_tensor(), value)
    for d, comp in enumerate(sw.tf.unpack(dt)):
        assert comp.shape == (1, 2, 3)
        assert torch.equal(comp, table[d])
    placed = sw.tf.copy_to_mesh(value, layout)
    for d, comp in enumerate(sw.tf.unpack(placed)):
        assert torch.equal(comp, table[d])
    check_round_trip(dt)


def test_unpack_of_pack_returns_the_components(mesh):
    layout = Layout([UNSHARDED, "y"], mesh)
    comps = [torch.full((4, 2), float(d)) for d in range(6)]  # replicas not checked, as in TF
    for given, got in zip(comps, sw.tf.unpack(sw.tf.pack(comps, layout)), strict=True):
        assert torch.equal(given, got)


def test_layout_y_x_puts_element_y_x_on_device_x_y(mesh):
    value = torch.arange(6.0).reshape(3, 2)
    dt = sw.tf.copy_to_mesh(value, Layout(["y", "x"], mesh))
    for d, comp in enumerate(sw.tf.unpack(dt)):
        c = coords(d)
        assert torch.equal(comp, value[c["y"] : c["y"] + 1, c["x"] : c["x"] + 1])


# ----- Layout -----------------------------------------------------------------------------


def test_layout_queries(mesh):
    layout = Layout(["y", UNSHARDED, MATCH], mesh)
    assert layout.rank == 3
    assert layout.mesh == mesh
    assert layout.sharding_specs == ["y", UNSHARDED, MATCH]
    assert [layout.num_shards(i) for i in range(3)] == [3, 1, -1]
    assert layout.shape == [3, 1, -1]
    assert not layout.is_fully_replicated()
    assert Layout.replicated(mesh, 2).sharding_specs == [UNSHARDED, UNSHARDED]
    assert Layout.replicated(mesh, 2).is_fully_replicated()
    assert Layout.batch_sharded(mesh, "x", 3).sharding_specs == ["x", UNSHARDED, UNSHARDED]
    assert Layout.batch_sharded(mesh, "y", 3, axis=1).sharding_specs == [UNSHARDED, "y", UNSHARDED]
    assert Layout.inner_sharded(mesh, "y", 2).sharding_specs == [UNSHARDED, "y"]
    one = sw.tf.create_mesh([("a", 1), ("b", 2)])
    assert Layout(["a", UNSHARDED], one).is_fully_replicated()
    assert not Layout(["b"], one).is_fully_replicated()


def test_layout_equality_hash_repr(mesh):
    a, b = Layout(["x", "y"], mesh), Layout(["x", "y"], sw.tf.create_mesh([("x", 2), ("y", 3)]))
    assert a == b and hash(a) == hash(b)
    assert a != Layout(["y", "x"], mesh)
    assert a != Layout(["x", "y"], sw.tf.create_mesh([("x", 3), ("y", 2)]))
    assert a != ["x", "y"]
    assert len({a, b, Layout(["y", "x"], mesh)}) == 2
    assert "'x', 'y'" in repr(a) and "DeviceMesh" in repr(a)


def test_layout_errors(mesh):
    with pytest.raises(LayoutError, match="DeviceMesh"):
        Layout(["x"], "not a mesh")
    with pytest.raises(ValueError, match="repeated"):
        Layout(["x", "x"], mesh)
    with pytest.raises(LayoutError, match="'z'"):
        Layout(["z"], mesh)
    with pytest.raises(LayoutError):
        Layout("x", mesh)
    with pytest.raises(LayoutError):
        Layout.batch_sharded(mesh, "x", 2, axis=2)
    with pytest.raises(LayoutError):
        Layout.replicated(mesh, -1)
    Layout([UNSHARDED, UNSHARDED, MATCH, MATCH], mesh)  # these may repeat
    assert issubclass(LayoutError, ShardwiseError) and issubclass(LayoutError, ValueError)


@pytest.mark.parametrize(
    ("specs", "placements"),
    [
        (["y", "x"], [Shard(1), Shard(0)]),
        (["x", UNSHARDED], [Shard(0), Replicate()]),
        ([], [Replicate(), Replicate()]),
        ([UNSHARDED, "y", UNSHARDED], [Replicate(), Shard(1)]),
        (["x", "y"], [Shard(0), Shard(1)]),
    ],
)
def test_layout_placements_conversion(mesh, specs, placements):
    layout = Layout(specs, mesh)
    assert layout.to_placements() == tuple(placements)
    assert Layout.from_placements(placements, mesh, len(specs)) == layout


def test_from_placements_normalizes_negative_dims(mesh):
    assert Layout.from_placements([Replicate(), Shard(-1)], mesh, 2) == Layout.inner_sharded(
        mesh, "y", 2
    )


@pytest.mark.parametrize(
    "placements",
    [[Shard(0), Shard(0)], [Partial(), Replicate()], [InterleavedShard(0, 2), Replicate()]],
)
def test_from_placements_not_representable(mesh, placements):
    with pytest.raises(LayoutError) as info:
        Layout.from_placements(placements, mesh, 2)
    assert str(placements[0]) in str(info.value) and "DeviceMesh" in str(info.value)


def test_from_placements_unnamed_mesh():
    unnamed = sw.init_device_mesh("cpu", (2,))
    with pytest.raises(LayoutError, match="no name"):
        Layout.from_placements([Shard(0)], unnamed, 1)
    assert Layout.from_placements([Replicate()], unnamed, 1) == Layout([UNSHARDED], unnamed)


def test_to_placements_rejects_match(mesh):
    with pytest.raises(LayoutError, match="match"):
        Layout([MATCH], mesh).to_placements()


# ----- pack errors --------------------------------------------------------------------------


def test_pack_no_components(mesh):
    with pytest.raises(InvalidArgumentError, match="1 or more"):
        sw.tf.pack([], Layout(["x"], mesh))


def test_pack_wrong_count(mesh):
    with pytest.raises(InvalidArgumentError) as info:
        sw.tf.pack([torch.zeros(2)] * 5, Layout(["x"], mesh))
    msg = str(info.value)
    assert "expected 6" in msg and "[2]" in msg and "Layout(['x']" in msg


def test_pack_dtensor_component(mesh):
    dt = sw.tf.copy_to_mesh(torch.zeros(2), Layout(["x"], mesh))
    with pytest.raises(InvalidArgumentError, match="already a DTensor"):
        sw.tf.pack([dt] + [torch.zeros(1)] * 5, Layout(["x"], mesh))


def test_pack_dvariable_component(mesh):
    v = DVariable(torch.zeros(1), layout=Layout([UNSHARDED], mesh))
    with pytest.raises(TypeError, match="DVariable") as info:
        sw.tf.pack([v] * 6, Layout([UNSHARDED], mesh))
    assert isinstance(info.value, ShardwiseError)


def test_pack_non_tensor_components(mesh):
    with pytest.raises(TypeError):
        sw.tf.pack([1.0] * 6, Layout([], mesh))
    with pytest.raises(TypeError, match="list of components"):
        sw.tf.pack(torch.zeros(6), Layout([UNSHARDED], mesh))
    with pytest.raises(TypeError, match="Layout"):
        sw.tf.pack([torch.zeros(2)] * 6, ["x"])


def test_pack_different_dtypes(mesh):
    comps = [torch.zeros(2)] * 5 + [torch.zeros(2, dtype=torch.int64)]
    with pytest.raises(TypeError) as info:
        sw.tf.pack(comps, Layout([UNSHARDED], mesh))
    assert isinstance(info.value, ShardwiseError)
    assert "int64" in str(info.value) and "[2]" in str(info.value) and "Layout" in str(info.value)


def test_pack_rank_must_match_layout(mesh):
    scalars = [torch.tensor(1.0)] * 6
    with pytest.raises(InvalidArgumentError) as info:
        sw.tf.pack(scalars, Layout([UNSHARDED], mesh))
    assert "rank 1" in str(info.value) and "[]" in str(info.value)
    assert sw.tf.pack(scalars, Layout([], mesh)).shape == ()
    with pytest.raises(InvalidArgumentError):
        sw.tf.pack([torch.zeros(2, 2)] * 6, Layout(["x"], mesh))


def test_pack_differing_shapes_rejected(mesh):
    comps = [torch.zeros(2), torch.zeros(3), torch.zeros(2)] + [torch.zeros(2)] * 3
    with pytest.raises(ValueError) as info:
        sw.tf.pack(comps, Layout(["x"], mesh))
    msg = str(info.value)
    assert isinstance(info.value, ShardwiseError)
    assert "[3]" in msg and "Layout(['x']" in msg and "DeviceMesh" in msg


def test_pack_uneven_chunk_geometry_accepted(mesh):
    value = torch.arange(5.0 * 7).reshape(5, 7)  # 5 over x=2 -> 3, 2; 7 over y=3 -> 3, 3, 1
    layout = Layout(["x", "y"], mesh)
    sizes = {"x": 2, "y": 3}
    comps = [expected_component(value, ["x", "y"], sizes, coords(d)) for d in range(6)]
    assert [list(c.shape) for c in comps] == [[3, 3], [3, 3], [3, 1], [2, 3], [2, 3], [2, 1]]
    dt = sw.tf.pack(comps, layout)
    assert list(dt.shape) == [5, 7]
    assert torch.equal(dt.full_tensor(), value)
    check_round_trip(dt)
    empty_tail = [torch.ones(1)] * 3 + [torch.ones(0)] * 3  # global size 1 over x=2
    assert list(sw.tf.pack(empty_tail, Layout(["x"], mesh)).shape) == [1]


def test_pack_uneven_other_geometry_rejected(mesh):
    small_first = [torch.zeros(2)] * 3 + [torch.zeros(3)] * 3  # chunk(5, 2) is 3, 2
    with pytest.raises(ValueError, match="torch.chunk"):
        sw.tf.pack(small_first, Layout(["x"], mesh))
    per_y = [torch.zeros(1), torch.zeros(2), torch.zeros(2)] * 2  # chunk(5, 3) is 2, 2, 1
    with pytest.raises(ValueError):
        sw.tf.pack(per_y, Layout(["y"], mesh))


# ----- unpack / fetch_layout / check_layout / is_dtensor -----------------------------------


def test_unpack_errors(mesh):
    v = DVariable(torch.zeros(3), layout=Layout(["y"], mesh))
    with pytest.raises(TypeError, match="read it first"):
        sw.tf.unpack(v)
    assert len(sw.tf.unpack(v.read_value())) == 6
    with pytest.raises(InvalidArgumentError, match=r"\[3\]"):
        sw.tf.unpack(torch.zeros(3))
    with pytest.raises(TypeError):
        sw.tf.unpack([[1, 2], [3, 4]])


def test_fetch_and_check_layout(mesh):
    layout = Layout(["y", UNSHARDED], mesh)
    dt = sw.tf.copy_to_mesh(torch.zeros(3, 2), layout)
    assert sw.tf.fetch_layout(dt) == layout
    sw.tf.check_layout(dt, layout)
    with pytest.raises(ValueError) as info:
        sw.tf.check_layout(dt, Layout(["x", UNSHARDED], mesh))
    assert "'x'" in str(info.value) and "'y'" in str(info.value)
    with pytest.raises(InvalidArgumentError, match=r"\[3, 2\]"):
        sw.tf.fetch_layout(torch.zeros(3, 2))
    assert sw.tf.fetch_layout(-1024) is None
    partial = sw.distribute_tensor(torch.zeros(2), mesh, [Partial(), Replicate()])
    assert sw.tf.fetch_layout(partial) == Layout.replicated(mesh, 1)  # TF: reductions are done


def test_is_dtensor(mesh):
    layout = Layout([UNSHARDED], mesh)
    assert sw.tf.is_dtensor(sw.tf.copy_to_mesh(torch.zeros(2), layout))
    assert sw.tf.is_dtensor(DVariable(torch.zeros(2), layout=layout))
    for other in (torch.zeros(2), [1, 2], {"a": 1}, 3, object()):
        assert not sw.tf.is_dtensor(other)


# ----- relayout / relayout_like / copy_to_mesh ----------------------------------------------

LAYOUTS_2D = [
    [UNSHARDED, UNSHARDED],
    ["x", UNSHARDED],
    [UNSHARDED, "x"],
    ["y", UNSHARDED],
    ["x", "y"],
    ["y", "x"],
    [UNSHARDED, "y"],
]


@pytest.mark.parametrize("shape", [(6, 6), (5, 7)])
def test_relayout_preserves_value(mesh, shape):
    value = torch.arange(float(shape[0] * shape[1])).reshape(shape)
    for src in LAYOUTS_2D:
        dt = sw.tf.copy_to_mesh(value, Layout(src, mesh))
        check_components(dt, value, src)
        for dst in LAYOUTS_2D:
            out = sw.tf.relayout(dt, Layout(dst, mesh))
            assert sw.tf.fetch_layout(out) == Layout(dst, mesh)
            check_components(out, value, dst)


def test_relayout_same_layout_is_identity(mesh):
    layout = Layout(["x", "y"], mesh)
    dt = sw.tf.copy_to_mesh(torch.zeros(4, 6), layout)
    assert sw.tf.relayout(dt, layout) is dt
    assert sw.tf.copy_to_mesh(dt, layout) is dt


def test_relayout_match_keeps_current_sharding(mesh):
    value = torch.arange(24.0).reshape(4, 6)
    dt = sw.tf.copy_to_mesh(value, Layout(["x", "y"], mesh))
    out = sw.tf.relayout(dt, Layout([MATCH, UNSHARDED], mesh))
    assert sw.tf.fetch_layout(out) == Layout(["x", UNSHARDED], mesh)
    check_components(out, value, ["x", UNSHARDED])
    with pytest.raises(LayoutError, match="MATCH"):  # axis 0 keeps x, which axis 1 also names
        sw.tf.relayout(dt, Layout([MATCH, "x"], mesh))
    kept = sw.tf.relayout(dt, Layout([MATCH, UNSHARDED], mesh))
    moved = sw.tf.relayout(kept, Layout(["y", MATCH], mesh))
    assert sw.tf.fetch_layout(moved) == Layout(["y", UNSHARDED], mesh)
    check_components(moved, value, ["y", UNSHARDED])
    plain = sw.tf.relayout(value, Layout([MATCH, "y"], mesh))
    assert sw.tf.fetch_layout(plain) == Layout([UNSHARDED, "y"], mesh)


def test_relayout_errors(mesh):
    dt = sw.tf.copy_to_mesh(torch.zeros(4, 6), Layout(["x", "y"], mesh))
    with pytest.raises(LayoutError, match=r"\[4, 6\]"):
        sw.tf.relayout(dt, Layout(["x"], mesh))
    other = sw.tf.create_mesh([("x", 3), ("y", 2)])
    with pytest.raises(sw.errors.MeshError, match="another mesh"):
        sw.tf.relayout(dt, Layout(["x", "y"], other))
    with pytest.raises(TypeError):
        sw.tf.relayout(dt, ["x", "y"])


def test_relayout_of_plain_tensor_is_copy_to_mesh(mesh):
    value = torch.arange(12.0).reshape(2, 6)
    layout = Layout(["x", "y"], mesh)
    a, b = sw.tf.relayout(value, layout), sw.tf.copy_to_mesh(value, layout)
    for x, y in zip(sw.tf.unpack(a), sw.tf.unpack(b), strict=True):
        assert torch.equal(x, y)
    check_components(a, value, ["x", "y"])


def test_relayout_like(mesh):
    value = torch.arange(36.0).reshape(6, 6)
    target = sw.tf.copy_to_mesh(torch.zeros(3, 3), Layout([UNSHARDED, "x"], mesh))
    dt = sw.tf.copy_to_mesh(value, Layout(["y", "x"], mesh))
    out = sw.tf.relayout_like(dt, target)
    assert sw.tf.fetch_layout(out) == Layout([UNSHARDED, "x"], mesh)
    check_components(out, value, [UNSHARDED, "x"])
    with pytest.raises(TypeError):
        sw.tf.relayout_like(dt, 3)


def test_copy_to_mesh(mesh):
    value = torch.arange(10.0)
    dt = sw.tf.copy_to_mesh(value, Layout(["y"], mesh))
    check_components(dt, value, ["y"])
    rep = sw.tf.copy_to_mesh([1.0, 2.0], Layout.replicated(mesh, 1))
    assert all(torch.equal(c, torch.tensor([1.0, 2.0])) for c in sw.tf.unpack(rep))
    with pytest.warns(DeprecationWarning):
        sw.tf.copy_to_mesh(value, Layout(["y"], mesh), source_layout=Layout([UNSHARDED], mesh))
    with pytest.raises(LayoutError, match="rank 0"):
        sw.tf.copy_to_mesh(torch.tensor(1.0), Layout(["y"], mesh))


def test_relayout_and_copy_to_mesh_gradients(mesh):
    value = torch.arange(24.0).reshape(4, 6).requires_grad_()
    weight = torch.arange(24.0).reshape(4, 6) / 7
    dt = sw.tf.copy_to_mesh(value, Layout(["x", "y"], mesh))
    out = sw.tf.relayout(dt, Layout(["y", UNSHARDED], mesh))
    (out.full_tensor() * weight).sum().backward()
    assert torch.allclose(value.grad, weight)


# ----- call_with_layout / default_mesh ------------------------------------------------------


def test_call_with_layout(mesh):
    layout = Layout.replicated(mesh, 2)
    out = sw.tf.call_with_layout(torch.ones, layout, size=[2, 3])
    assert sw.tf.fetch_layout(out) == layout and list(out.shape) == [2, 3]
    assert torch.equal(out.full_tensor(), torch.ones(2, 3))
    sharded = Layout(["x", "y"], mesh)
    seen = []

    def make(n: int) -> tuple[torch.Tensor, int]:
        seen.append(sw.tf.get_default_mesh())
        return torch.arange(float(n * 6)).reshape(n, 6), 5

    first, extra = sw.tf.call_with_layout(make, sharded, 4)
    assert seen == [mesh] and extra == 5
    check_components(first, torch.arange(24.0).reshape(4, 6), ["x", "y"])
    assert torch.equal(sw.tf.call_with_layout(torch.ones, None, 2), torch.ones(2))
    with pytest.raises(LayoutError):
        sw.tf.call_with_layout(torch.ones, Layout(["x"], mesh), 2, 2)


def test_default_mesh_nesting(mesh):
    other = sw.tf.create_mesh([("b", 6)])
    assert sw.tf.get_default_mesh() is None
    with sw.tf.default_mesh(mesh):
        assert sw.tf.get_default_mesh() is mesh
        with sw.tf.default_mesh(other):
            assert sw.tf.get_default_mesh() is other
        assert sw.tf.get_default_mesh() is mesh
    assert sw.tf.get_default_mesh() is None
    with pytest.raises(ValueError, match="DeviceMesh"), sw.tf.default_mesh("x"):
        pass
    assert sw.tf.get_default_mesh() is None


# ----- DVariable ------------------------------------------------------------------------------


def test_dvariable_from_tensor_and_layout(mesh):
    layout = Layout(["x", "y"], mesh)
    value = torch.arange(24.0).reshape(4, 6)
    v = DVariable(value, layout=layout)
    assert v.layout == layout and sw.tf.fetch_layout(v) == layout
    assert v.shape == (4, 6) and v.dtype == torch.float32
    assert v.value.requires_grad and v.value.grad_fn is None
    check_components(v.read_value(), value, ["x", "y"])
    assert "DVariable" in repr(v)


def test_dvariable_from_dtensor_and_callable(mesh):
    layout = Layout([UNSHARDED, "y"], mesh)
    dt = sw.tf.copy_to_mesh(torch.arange(6.0).reshape(2, 3), layout)
    v = DVariable(dt)
    assert v.layout == layout
    assert DVariable(dt, layout=layout).layout == layout
    w = DVariable(lambda: torch.ones(2, 3), layout=layout)
    check_components(w.read_value(), torch.ones(2, 3), [UNSHARDED, "y"])
    ints = DVariable([1, 2, 3], layout=Layout(["y"], mesh), dtype=torch.int64)
    assert ints.dtype == torch.int64 and not ints.value.requires_grad


def test_dvariable_errors(mesh):
    dt = sw.tf.copy_to_mesh(torch.zeros(2, 3), Layout([UNSHARDED, "y"], mesh))
    with pytest.raises(InvalidArgumentError, match="Conflicting layout"):
        DVariable(dt, layout=Layout(["x", UNSHARDED], mesh))
    with pytest.raises(InvalidArgumentError, match="Neither layout nor DTensor"):
        DVariable(torch.zeros(2, 3))
    v = DVariable(dt)
    with pytest.raises(InvalidArgumentError, match=r"\[3, 2\]"):
        v.assign(torch.zeros(3, 2))
    with pytest.raises(TypeError):
        v.assign(torch.zeros(2, 3, dtype=torch.float64))


def test_dvariable_updates_keep_layout(mesh):
    layout = Layout(["x", "y"], mesh)
    v = DVariable(torch.zeros(4, 6), layout=layout)
    storage = v.value
    a = torch.arange(24.0).reshape(4, 6)
    v.assign(a)
    check_components(v.read_value(), a, ["x", "y"])
    v.assign_add(sw.tf.copy_to_mesh(torch.ones(4, 6), Layout([UNSHARDED, "x"], mesh)))
    check_components(v.read_value(), a + 1, ["x", "y"])
    v.assign_sub(torch.full((4, 6), 3.0))
    check_components(v.read_value(), a - 2, ["x", "y"])
    assert v.value is storage and sw.tf.fetch_layout(v.read_value()) == layout
    s = DVariable(torch.tensor(1.0), layout=Layout([], mesh))
    s.assign_add(2.0)
    assert s.read_value().full_tensor().item() == 3.0


def test_dvariable_gradient(mesh):
    v = DVariable(torch.arange(24.0).reshape(4, 6), layout=Layout(["x", "y"], mesh))
    weight = torch.arange(24.0).reshape(4, 6) / 5
    (v.read_value().full_tensor() * weight).sum().backward()
    assert isinstance(v.grad, sw.DTensor)
    assert torch.allclose(v.grad.full_tensor(), weight)
