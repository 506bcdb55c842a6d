"""PyTorch's keywords on DTensor: to_local(grad_placements=), full_tensor(grad_placements=),
redistribute(forward_dtype=, backward_dtype=); and where DTensor answers as PyTorch's: the
backward of a redistribution to the same placements, storage_offset(), distribute_tensor of a
tensor autograd made. Single-device PyTorch is the oracle; torch.distributed.tensor, run beside
shardwise across 2 processes, is the oracle for the DTensor-level behaviour."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise as sw
from mp_harness import run_in_processes
from shardwise import DeviceMesh, Partial, Replicate, Shard
from shardwise.errors import InvalidPlacementError
from shardwise.parallel import ColwiseParallel, parallelize_module


@pytest.fixture
def mesh() -> DeviceMesh:
    return sw.init_device_mesh("cpu", (2,))


def test_to_local_grad_placements():
    one = DeviceMesh("cpu", [0])
    w = torch.arange(6.0).reshape(3, 2)
    dt = sw.distribute_tensor(w, one, [Shard(0)]).requires_grad_()
    (dt.to_local(grad_placements=[Partial()]) * 3).sum().backward()
    assert dt.grad.placements == (Partial(),)
    assert torch.equal(dt.grad.full_tensor(), torch.full((3, 2), 3.0))
    plain = sw.distribute_tensor(w, one, [Shard(0)]).requires_grad_()
    (plain.to_local() * 3).sum().backward()
    assert plain.grad.placements == (Shard(0),)


def test_full_tensor_grad_placements(mesh):
    x = torch.arange(8.0).reshape(4, 2)
    dt = sw.distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
    # each of the 2 devices computes the same loss: as partial gradients they add up
    (dt.full_tensor(grad_placements=[Partial()]) * x).sum().backward()
    assert torch.equal(dt.grad.full_tensor(), 2 * x)
    dt.grad = None
    (dt.full_tensor(grad_placements=[Replicate()]) * x).sum().backward()
    assert torch.equal(dt.grad.full_tensor(), x)
    # the gradient of the full tensor has the full shape: a Shard would not fit it
    with pytest.raises(InvalidPlacementError, match=r"Shard\(dim=1\)\].*holds \[4, 2\]"):
        dt.full_tensor(grad_placements=[Shard(1)])


def test_redistribute_forward_and_backward_dtype(mesh):
    x = torch.randn(4, 6, dtype=torch.float32)
    dt = sw.distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
    with sw.debug.CommCounter() as forward:
        out = dt.redistribute(mesh, [Replicate()], forward_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.placements == (Replicate(),)
    assert torch.equal(out.full_tensor(), x.to(torch.bfloat16))
    assert forward.bytes["all_gather"] == 2 * 12 * 2  # each device receives 12 bf16 values
    # the backward Replicate -> Partial -> Shard: run it in float16, come back in float32
    mid = dt.redistribute(mesh, [Shard(1)], backward_dtype=torch.float16)
    assert mid.dtype == torch.float32
    grad = sw.distribute_tensor(torch.randn(4, 6), mesh, [Replicate()])
    grad = grad.redistribute(mesh, [Shard(1)])
    with sw.debug.CommCounter() as backward:
        mid.backward(grad)
    assert dt.grad.dtype == torch.float32 and dt.grad.placements == (Shard(0),)
    assert backward.bytes["all_to_all"] == 2 * 6 * 2  # 6 float16 values to the other device
    assert torch.allclose(dt.grad.full_tensor(), grad.full_tensor().half().float())


def test_redistribute_same_placements_with_a_dtype_casts(mesh):
    dt = sw.distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
    out = dt.redistribute(mesh, [Shard(0)], forward_dtype=torch.float64)
    assert out.dtype == torch.float64 and out.placements == (Shard(0),)
    assert torch.equal(out.full_tensor(), torch.arange(4.0, dtype=torch.float64))


def test_from_local_takes_torchs_keywords_and_grad_placements(mesh):
    """``DTensor.from_local(local_tensor=..., grad_placements=...)`` as in PyTorch: with
    ``grad_placements=[Partial()]`` each local gradient is a piece of the pending sum (they
    add up to the global gradient); by default each is the whole (replicated) gradient."""
    w = torch.randn(3)
    dw = sw.distribute_tensor(w, mesh, [Replicate()])
    pieces = [torch.randn(3, requires_grad=True) for _ in range(2)]
    dt = sw.DTensor.from_local(local_tensor=pieces, device_mesh=mesh, placements=[Replicate()],
                               grad_placements=[Partial()])
    (dt * dw).sum().backward()
    torch.testing.assert_close(pieces[0].grad + pieces[1].grad, w)
    pieces = [torch.randn(3, requires_grad=True) for _ in range(2)]
    (sw.DTensor.from_local(local_tensor=pieces, device_mesh=mesh) * dw).sum().backward()
    for p in pieces:
        torch.testing.assert_close(p.grad, w)
    with pytest.raises(InvalidPlacementError, match="grad_placements"):
        sw.DTensor.from_local(pieces, mesh, [Replicate()], grad_placements=[Shard(0)])


# ----- the backward of redistribute to the same placements -------------------------------------


def test_full_tensor_partial_grad_through_a_replicate_is_reduced(mesh):
    """A Replicate DTensor's ``full_tensor(grad_placements=[Partial()])`` passes through a
    Replicate -> Replicate redistribution: its backward reduces the partial gradients (one
    all_reduce), so the leaf's gradient is Replicate, as in PyTorch."""
    x = torch.arange(8.0).reshape(4, 2)
    dt = sw.distribute_tensor(x, mesh, [Replicate()]).requires_grad_()
    loss = (dt.full_tensor(grad_placements=[Partial()]) * x).sum()
    with sw.debug.CommCounter() as backward:
        loss.backward()
    assert dt.grad.placements == (Replicate(),)
    assert torch.equal(dt.grad.full_tensor(), 2 * x)  # each of the 2 devices' gradient, summed
    assert backward.counts == {"all_reduce": 1}
    # no gradient needed: the same DTensor comes back, nothing recorded
    with torch.no_grad():
        assert dt.redistribute(mesh, [Replicate()]) is dt


def test_same_placements_partial_gradient_stays_partial(mesh):
    """Partial -> Partial: the backward passes a gradient of that same Partial unreduced (no
    collective), each piece to its own local tensor (from_local told to keep it pending), as
    PyTorch's."""
    pieces = [torch.ones(3, 2, requires_grad=True) for _ in range(2)]
    dt = sw.DTensor.from_local(pieces, mesh, [Partial()], grad_placements=[Partial()])
    out = dt.redistribute(mesh, [Partial()])
    grad = sw.DTensor.from_local([torch.ones(3, 2), 2 * torch.ones(3, 2)], mesh, [Partial()])
    with sw.debug.CommCounter() as backward:
        out.backward(grad)
    assert backward.counts == {}
    assert torch.equal(pieces[0].grad, torch.ones(3, 2))
    assert torch.equal(pieces[1].grad, 2 * torch.ones(3, 2))


# ----- storage_offset ----------------------------------------------------------------------------

# name -> (view, global shape, the Shard dim it leaves alone: no move needed)
_VIEWS = {
    "slice": (lambda t: t[1:], (10,), None),
    "slice dim 1": (lambda t: t[:, 2:], (12, 8), 0),
    "slice dim 0": (lambda t: t[2:, :], (10, 12), 1),
    "narrow": (lambda t: t.narrow(1, 3, 4), (12, 8), 0),
    "select": (lambda t: t.select(0, 3), (10, 12), 1),
    "transposed slice": (lambda t: t[:, 2:].t(), (12, 8), 0),
    "split": (lambda t: t.split(2, 1)[2], (6, 6), 0),
    "not a view": (lambda t: t[:, 1:] + 1, (6, 6), 0),
}


def _placements(shard_dim: int | None, replicate: type, shard: type) -> list:
    return [replicate()] + ([] if shard_dim is None else [shard(shard_dim)])


def test_storage_offset_on_one_device_is_torchs():
    """On a 1-device mesh the local tensor is the whole value: a view's storage_offset() is
    that of the same view of the plain tensor (and of the local tensor)."""
    one = DeviceMesh("cpu", [0])
    for name, (view, shape, shard_dim) in _VIEWS.items():
        for placement in _placements(shard_dim, Replicate, Shard):
            x = torch.randn(shape)
            out = view(sw.distribute_tensor(x, one, [placement]))
            assert out.storage_offset() == view(x).storage_offset(), (name, placement)
            assert out.to_local().storage_offset() == out.storage_offset(), (name, placement)
            assert torch.equal(out.full_tensor(), view(x)), (name, placement)
    assert any(view(torch.randn(shape)).storage_offset() for view, shape, _ in _VIEWS.values())
    x = torch.arange(12.0)
    assert sw.DTensor.from_local(x[5:], one).storage_offset() == 5


def test_storage_offset_with_several_local_devices_is_zero(mesh):
    """With two devices in this process there is no one local tensor: 0, whatever the
    pieces' own offsets."""
    out = sw.distribute_tensor(torch.randn(12, 8), mesh, [Shard(0)])[:, 2:]
    assert [p.storage_offset() for p in sw.local_components(out)] == [2, 2]
    assert out.storage_offset() == 0


# ----- distribute_tensor of a tensor autograd made ------------------------------------------------


def test_distribute_tensor_refuses_a_non_leaf(mesh):
    g = torch.randn(4, 4, requires_grad=True)
    with pytest.raises(sw.errors.NonLeafTensorError, match=r"distribute leaf tensor") as info:
        sw.distribute_tensor(g + 2, mesh, [Shard(0)])
    assert isinstance(info.value, RuntimeError)
    for fragment in ("[4, 4]", "Shard(dim=0)", str(mesh), "detach()",
                     "DTensor.from_local"):
        assert fragment in str(info.value), fragment
    # leaves go through: one that requires grad gives a leaf that does, a detached one
    # (or one made under no_grad) a leaf that does not
    for tensor, grad in [(g, True), ((g + 2).detach(), False)]:
        d = sw.distribute_tensor(tensor, mesh, [Shard(0)])
        assert d.is_leaf and d.requires_grad is grad
    with torch.no_grad():
        assert sw.distribute_tensor(g + 2, mesh, [Shard(0)]).is_leaf


def test_distribute_tensor_of_a_dtensor_is_torchs(mesh):
    """A DTensor already placed so comes back as it is; another mesh or other placements are
    refused with PyTorch's words (ValueErrors)."""
    d = sw.distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)])
    assert sw.distribute_tensor(d, mesh, [Shard(-1)]) is d
    with pytest.raises(sw.errors.MeshError, match="to a different device mesh") as info:
        sw.distribute_tensor(d, DeviceMesh("cpu", [0]), [Shard(1)])
    assert "[4, 6]" in str(info.value) and isinstance(info.value, ValueError)
    with pytest.raises(InvalidPlacementError, match="to a different placements") as info:
        sw.distribute_tensor(d, mesh, [Replicate()])
    assert "redistribute" in str(info.value)
    with pytest.raises(sw.errors.NonLeafTensorError, match=r"\[4, 6\]"):
        sw.distribute_tensor(d.requires_grad_() * 2, mesh, [Shard(1)])


def test_internal_paths_still_place_tensors_autograd_made(mesh):
    """shardwise's own layers place non-leaf tensors: a one-element operand among DTensors
    (its gradient still reaches the leaf it came from) and a module's plain input."""
    x = torch.arange(8.0).reshape(4, 2)
    w = torch.tensor(3.0, requires_grad=True)
    dt = sw.distribute_tensor(x, mesh, [Shard(0)])
    out = dt * (w * 2)
    assert torch.equal(out.full_tensor(), x * 6)
    out.sum().full_tensor().backward()
    grad = w.grad.full_tensor() if isinstance(w.grad, sw.DTensor) else w.grad
    assert torch.equal(grad, 2 * x.sum())
    torch.manual_seed(0)
    model = parallelize_module(nn.Linear(2, 4), mesh, ColwiseParallel())
    base = torch.randn(3, 2, requires_grad=True)
    made = base * 1
    assert not made.is_leaf
    with torch.no_grad():  # a non-leaf input, no gradient wanted: placed, not refused
        y = model(made)
        want = base @ model.weight.full_tensor().t() + model.bias.full_tensor()
    torch.testing.assert_close(y.full_tensor(), want)


# ----- beside torch.distributed.tensor, across 2 processes --------------------------------------


def _beside_torch() -> dict:
    """The same per-rank program on torch.distributed.tensor and on shardwise."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial as TorchPartial
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor import distribute_tensor as torch_distribute
    from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

    tmesh, mesh = init_device_mesh("cpu", (2,)), sw.init_device_mesh("cpu", (2,))
    libs = {
        "torch": (tmesh, torch_distribute, TorchReplicate, TorchPartial, TorchShard,
                  TorchCommDebugMode),
        "shardwise": (mesh, sw.distribute_tensor, Replicate, Partial, Shard,
                      sw.debug.CommDebugMode),
    }
    out: dict = {}
    for lib, (m, distribute, rep, part, shard, counting) in libs.items():
        got = out[lib] = {}
        for dtype in (torch.float32, torch.cfloat):
            x = torch.randn(12, 3, dtype=dtype, generator=torch.Generator().manual_seed(1),
                            requires_grad=True)
            dt = distribute(x, m, [rep()])
            with counting() as counter:
                local = dt.redistribute(m, [rep()]).to_local(grad_placements=[part()])
                local.backward(torch.ones_like(local))
            counts = {str(k).rsplit(".", 1)[-1].removesuffix("_into_tensor"): v
                      for k, v in counter.get_comm_counts().items() if v}
            kind = type(dt.grad.placements[0]).__name__
            got[f"grad {dtype}"] = (counts, kind, dt.grad.to_local(), x.grad is None)
        for name, (view, shape, shard_dim) in _VIEWS.items():
            for p in _placements(shard_dim, rep, shard):
                x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
                v = view(distribute(x, m, [p]))
                got[f"offset {name} {type(p).__name__}"] = (
                    v.storage_offset(), v.to_local().storage_offset())
        try:
            distribute(torch.randn(4, 4, requires_grad=True) + 2, m, [shard(0)])
            got["non-leaf"] = "accepted"
        except RuntimeError as err:
            got["non-leaf"] = "distribute leaf tensor" in str(err)
        d = distribute(torch.randn(4, 4), m, [shard(0)])
        got["a DTensor placed so"] = distribute(d, m, [shard(0)]) is d
        try:
            distribute(d, m, [rep()])
            got["a DTensor placed otherwise"] = "accepted"
        except ValueError as err:
            got["a DTensor placed otherwise"] = "to a different placements" in str(err)
    return out


@pytest.mark.slow
def test_beside_torch_across_processes() -> None:
    for rank in run_in_processes(_beside_torch, 2, timeout=180):
        theirs, ours = rank["torch"], rank["shardwise"]
        assert theirs.keys() == ours.keys()
        for key, want in theirs.items():
            got = ours[key]
            if key.startswith("grad"):
                assert got[0] == want[0] == {"all_reduce": 1}, (key, got, want)
                assert got[1] == want[1] == "Replicate", (key, got, want)
                assert torch.equal(got[2], want[2]), key
                assert torch.equal(got[2], 2 * torch.ones_like(got[2])), key  # summed
                assert got[3] and want[3], key  # distribute_tensor made a new leaf
            else:
                assert got == want, (key, got, want)
        assert ours["non-leaf"] is ours["a DTensor placed so"] is True
        assert ours["a DTensor placed otherwise"] is True
