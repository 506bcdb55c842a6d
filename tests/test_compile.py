"""torch.compile over DTensors (embedded mode): the subclass flattens into its components, so
dynamo and AOT autograd trace dispatch's local ops and in-process collectives into one graph
(fullgraph), forward and backward, with eager's values and placements."""

from __future__ import annotations

import torch

import shardwise as sw
from shardwise import Replicate, Shard


def _mlp_loss(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    hidden = torch.relu(x @ w1.t())
    out = (hidden @ w2.t()).redistribute(placements=[Replicate()])
    return (out * out).mean()


def _inputs(mesh: sw.DeviceMesh, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x, w1, w2 = torch.randn(6, 4, generator=g), torch.randn(10, 4, generator=g), torch.randn(
        4, 10, generator=g
    )
    rep = [Replicate()] * mesh.ndim
    col = [Shard(0)] + [Replicate()] * (mesh.ndim - 1)
    row = [Shard(1)] + [Replicate()] * (mesh.ndim - 1)
    return (
        sw.distribute_tensor(x, mesh, rep),
        sw.distribute_tensor(w1, mesh, col).requires_grad_(),
        sw.distribute_tensor(w2, mesh, row).requires_grad_(),
    ), (x, w1.requires_grad_(), w2.requires_grad_())


def test_compiled_tensor_parallel_step_equals_eager_and_single_device() -> None:
    torch._dynamo.reset()
    for mesh_shape in [(2,), (3,)]:  # (3,): uneven shards of the 10 hidden units
        mesh = sw.init_device_mesh("cpu", mesh_shape)
        (dx, d1, d2), (x, w1, w2) = _inputs(mesh, 0)
        compiled = torch.compile(_mlp_loss, backend="aot_eager", fullgraph=True)
        loss = compiled(dx, d1, d2)
        loss.backward()
        ref = ((torch.relu(x @ w1.t()) @ w2.t()) ** 2).mean()
        ref.backward()
        torch.testing.assert_close(loss.full_tensor(), ref)
        assert d1.grad.placements == d1.placements and d2.grad.placements == d2.placements
        torch.testing.assert_close(d1.grad.full_tensor(), w1.grad)
        torch.testing.assert_close(d2.grad.full_tensor(), w2.grad)


def test_compiled_function_returns_dtensor_with_eager_spec() -> None:
    torch._dynamo.reset()
    mesh = sw.init_device_mesh("cpu", (2, 2))
    x = torch.randn(8, 6)
    dx = sw.distribute_tensor(x, mesh, [Shard(0), Shard(1)])

    def f(t: torch.Tensor) -> torch.Tensor:
        return torch.softmax(t * 2.0, dim=0).sum(1)

    with sw.allow_implicit_redistribute():
        eager = f(dx)
        out = torch.compile(f, backend="aot_eager", fullgraph=True)(dx)
    assert isinstance(out, sw.DTensor) and out.placements == eager.placements
    torch.testing.assert_close(out.full_tensor(), torch.softmax(x * 2.0, dim=0).sum(1))
