"""TF parity: DVariable is a real variable (ops, torch.optim, settable .grad, assign /
assign_add / read_value), pack / unpack / fetch_layout refuse to run while tracing, relayout
takes TF's name=. Single-device PyTorch is the oracle."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise import Replicate, Shard
from shardwise.errors import NotEagerError
from shardwise.mesh import DeviceMesh
from shardwise.tf import DVariable, Layout


@pytest.fixture
def mesh() -> DeviceMesh:
    return sw.tf.create_mesh([("x", 2), ("y", 2)])


def test_dvariable_in_ops(mesh):
    w = torch.arange(12.0).reshape(4, 3) / 7
    x = torch.arange(6.0).reshape(3, 2) - 2
    v = DVariable(w, layout=Layout(["x", sw.tf.UNSHARDED], mesh))
    dx = sw.distribute_tensor(x, mesh, [Replicate(), Replicate()])
    assert isinstance(v, sw.DTensor) and v.is_leaf and v.requires_grad
    plus = v + 1
    assert type(plus) is sw.DTensor and torch.allclose(plus.full_tensor(), w + 1)
    product = v @ dx
    assert type(product) is sw.DTensor and torch.allclose(product.full_tensor(), w @ x)
    assert torch.allclose((2 * v - v).full_tensor(), w)
    assert sw.tf.fetch_layout(v) == v.layout and v.value is v


def test_dvariable_trains_with_torch_optim(mesh):
    torch.manual_seed(0)
    w0, x = torch.randn(4, 3), torch.randn(3, 5)
    ref = w0.clone().requires_grad_()
    v = DVariable(w0, layout=Layout(["x", "y"], mesh))
    dx = sw.distribute_tensor(x, mesh, [Replicate(), Replicate()])
    opt, ref_opt = torch.optim.Adam([v], lr=0.1), torch.optim.Adam([ref], lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        with sw.config.allow_implicit_redistribute():
            (v @ dx).pow(2).sum().full_tensor().backward()
        (ref @ x).pow(2).sum().backward()
        assert isinstance(v.grad, sw.DTensor) and v.grad.placements == v.placements
        assert torch.allclose(v.grad.full_tensor(), ref.grad, atol=1e-5)
        opt.step()
        ref_opt.step()
    assert type(v) is DVariable and v.layout == Layout(["x", "y"], mesh)
    assert torch.allclose(v.full_tensor(), ref.detach(), atol=1e-5)


def test_dvariable_grad_is_settable(mesh):
    v = DVariable(torch.ones(4, 2), layout=Layout(["x", sw.tf.UNSHARDED], mesh))
    v.grad = sw.distribute_tensor(torch.full((4, 2), 2.0), mesh, v.placements)
    torch.optim.SGD([v], lr=0.25).step()
    assert torch.equal(v.full_tensor(), torch.full((4, 2), 0.5))
    v.grad = None
    assert v.grad is None


def test_dvariable_assign_and_read_value(mesh):
    layout = Layout(["x", "y"], mesh)
    v = DVariable(torch.zeros(2, 4), layout=layout)
    a = torch.arange(8.0).reshape(2, 4)
    assert v.assign(a) is v and torch.equal(v.read_value().full_tensor(), a)
    v.assign_add(torch.ones(2, 4))
    snapshot = v.read_value()
    v.assign_add(torch.ones(2, 4))
    assert torch.equal(snapshot.full_tensor(), a + 1)  # a snapshot, not a view
    assert torch.equal(v.full_tensor(), a + 2) and sw.tf.fetch_layout(snapshot) == layout
    assert type(snapshot) is sw.DTensor


def test_dvariable_not_trainable_and_int(mesh):
    frozen = DVariable(torch.ones(2), layout=Layout(["x"], mesh), trainable=False)
    ints = DVariable([1, 2], layout=Layout(["x"], mesh), dtype=torch.int64)
    assert not frozen.requires_grad and not ints.requires_grad and ints.dtype == torch.int64
    assert (ints * 3).full_tensor().tolist() == [3, 6]


def test_pack_unpack_fetch_layout_must_be_called_eagerly(mesh):
    layout = Layout(["x"], mesh)
    dt = sw.tf.pack([torch.ones(1)] * 4, layout)

    def pack_inside(a: torch.Tensor):
        return sw.tf.pack([a, a, a, a], layout)

    for fn, arg in ((pack_inside, torch.ones(1)), (sw.tf.unpack, dt), (sw.tf.fetch_layout, dt)):
        torch._dynamo.reset()
        with pytest.raises(NotEagerError, match="must be called eagerly") as info:
            torch.compile(fn, backend="eager")(arg)
        assert isinstance(info.value, RuntimeError)
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="must be called eagerly"):
        torch.compile(pack_inside, backend="eager", fullgraph=True)(torch.ones(1))
    torch._dynamo.reset()
    with pytest.raises(NotEagerError, match="unpack must be called eagerly"):
        torch.fx.symbolic_trace(lambda t: sw.tf.unpack(t))
    # eagerly they work
    assert [c.tolist() for c in sw.tf.unpack(dt)] == [[1.0]] * 4
    assert sw.tf.fetch_layout(dt) == layout


def test_relayout_takes_a_name(mesh):
    dt = sw.tf.copy_to_mesh(torch.arange(4.0), Layout(["x"], mesh))
    out = sw.tf.relayout(dt, Layout(["y"], mesh), name="to_y")
    assert out.placements == (Replicate(), Shard(0))
    assert torch.equal(out.full_tensor(), torch.arange(4.0))
