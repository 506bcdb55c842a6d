"""PyTorch's keywords on DTensor: to_local(grad_placements=), full_tensor(grad_placements=),
redistribute(forward_dtype=, backward_dtype=). Single-device PyTorch is the oracle."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise import DeviceMesh, Partial, Replicate, Shard
from shardwise.errors import InvalidPlacementError


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
