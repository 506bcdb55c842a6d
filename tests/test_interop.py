"""Third-party kernels on DTensors (``data_ptr``, ``local_map``, ``register_sharding``) and
asynchronous collectives in one process; single-device PyTorch is the oracle."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

import shardwise as sw
from shardwise import InterleavedShard, Partial, Replicate, Shard

# ----- a third-party kernel: raw pointer arithmetic on float32 buffers ---------------------


def _floats(ptr: int, n: int) -> np.ndarray:
    """The ``n`` float32 values at address ``ptr`` (no copy)."""
    return np.ctypeslib.as_array((ctypes.c_float * n).from_address(ptr)) if n else np.empty(0)


@torch.library.custom_op("shardwise_test::axpy", mutates_args=())
def axpy(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    """out = alpha * x + y, computed element by element through the buffers' addresses."""
    x, y = x.contiguous(), y.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    xs, ys, outs = _floats(x.data_ptr(), n), _floats(y.data_ptr(), n), _floats(out.data_ptr(), n)
    for i in range(n):  # a deliberately naive kernel: one address at a time
        outs[i] = alpha * xs[i] + ys[i]
    return out


@axpy.register_fake
def _(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    return torch.empty_like(x)


def _axpy_backward(ctx, grad: torch.Tensor):
    return grad * ctx.alpha, grad, None


def _axpy_setup(ctx, inputs, output) -> None:
    ctx.alpha = inputs[2]


axpy.register_autograd(_axpy_backward, setup_context=_axpy_setup)


@sw.rules.register_sharding(torch.ops.shardwise_test.axpy.default)
def _axpy_sharding(x, y, alpha):
    """Elementwise: any tensor dim sharded alike on x, y and the output, or all replicated."""
    options = [([Replicate()], [Replicate(), Replicate(), None])]
    for dim in range(x.ndim):
        options.append(([Shard(dim)], [Shard(dim), Shard(dim), None]))
    return options


@pytest.fixture
def mesh22() -> sw.DeviceMesh:
    return sw.DeviceMesh("cpu", [[0, 1], [2, 3]])


def test_data_ptr_is_the_local_component_pointer() -> None:
    mesh = sw.DeviceMesh("cpu", [0])
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    dt = sw.distribute_tensor(x, mesh, [Shard(0)])
    (local,) = sw.local_components(dt)
    assert dt.data_ptr() == local.data_ptr()
    assert _floats(dt.data_ptr(), 12).tolist() == x.flatten().tolist()


def test_data_ptr_with_several_local_devices_says_what_to_use(mesh22: sw.DeviceMesh) -> None:
    dt = sw.distribute_tensor(torch.zeros(4, 4), mesh22, [Shard(0), Replicate()])
    with pytest.raises(sw.errors.LocalComponentsError, match=r"local_components.*local_map") as err:
        dt.data_ptr()
    assert "[4, 4]" in str(err.value) and "Shard(dim=0)" in str(err.value)


def test_custom_pointer_kernel_through_local_map_with_autograd(mesh22: sw.DeviceMesh) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(7, 5), torch.randn(7, 5)  # uneven over both mesh dims
    placements = [Shard(0), Shard(1)]
    dx = sw.distribute_tensor(x.clone().requires_grad_(), mesh22, placements)
    dy = sw.distribute_tensor(y.clone().requires_grad_(), mesh22, placements)
    calls = []

    def fused(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        calls.append(list(a.shape))
        return axpy(a, b, 3.0)

    mapped = sw.local_map(fused, out_placements=placements, in_placements=(placements, placements))
    out = mapped(dx, dy)
    assert isinstance(out, sw.DTensor) and out.placements == tuple(placements)
    assert calls == [[4, 3], [4, 2], [3, 3], [3, 2]]  # once per local device, ascending id
    assert torch.equal(out.full_tensor(), 3.0 * x + y)
    weight = torch.randn(7, 5)
    (out.full_tensor() * weight).sum().backward()
    assert torch.allclose(dx.grad.full_tensor(), 3.0 * weight)
    assert torch.allclose(dy.grad.full_tensor(), weight)


def test_local_map_checks_and_redistributes_inputs(mesh22: sw.DeviceMesh) -> None:
    x = torch.randn(4, 6)
    dx = sw.distribute_tensor(x, mesh22, [Shard(1), Replicate()])
    want = [Shard(0), Shard(1)]
    mapped = sw.local_map(torch.sin, out_placements=want, in_placements=(want,))
    with pytest.raises(sw.errors.InvalidPlacementError, match=r"redistribute_inputs=True") as err:
        mapped(dx)
    assert "[4, 6]" in str(err.value)
    again = sw.local_map(
        torch.sin, out_placements=want, in_placements=(want,), redistribute_inputs=True
    )
    out = again(dx)
    assert out.placements == tuple(want) and torch.equal(out.full_tensor(), torch.sin(x))
    with pytest.raises(sw.errors.InvalidArgumentError, match="2 entries"):
        sw.local_map(torch.sin, out_placements=(want, want))(dx)
    # decorator form, a non-tensor output, a plain tensor argument passed through
    bias = torch.ones(6)

    @sw.local_map(out_placements=([Shard(1), Replicate()], None))
    def shifted(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, str]:
        return a + b[: a.shape[1]], "ok"

    value, tag = shifted(dx, bias)
    assert tag == "ok" and torch.equal(value.full_tensor(), x + 1)
    assert sw.local_map(torch.cos, out_placements=want)(x).equal(torch.cos(x))  # no DTensor


def test_local_map_partial_output_reduces_like_torch(mesh22: sw.DeviceMesh) -> None:
    a, b = torch.randn(5, 8), torch.randn(8, 3)
    da = sw.distribute_tensor(a, mesh22, [Replicate(), Shard(1)])
    db = sw.distribute_tensor(b, mesh22, [Replicate(), Shard(0)])
    mm = sw.local_map(torch.mm, out_placements=[Replicate(), Partial()])
    out = mm(da, db)
    assert torch.allclose(out.full_tensor(), a @ b, atol=1e-5)


def test_register_sharding_runs_the_pointer_kernel_on_shards(mesh22: sw.DeviceMesh) -> None:
    torch.manual_seed(1)
    x, y = torch.randn(6, 5), torch.randn(6, 5)
    for placements in ([Shard(0), Shard(1)], [Replicate(), Shard(0)], [Shard(1), Replicate()]):
        dx = sw.distribute_tensor(x, mesh22, placements)
        dy = sw.distribute_tensor(y, mesh22, placements)
        out = torch.ops.shardwise_test.axpy(dx, dy, -2.0)
        assert out.placements == tuple(placements)
        assert torch.equal(out.full_tensor(), -2.0 * x + y)


# ----- asynchronous collectives in one process ---------------------------------------------

CASES = [
    ((8, 6), [Shard(0), Shard(1)], [Replicate(), Shard(0)]),
    ((7, 5), [Shard(1), Shard(0)], [Replicate(), Replicate()]),
    ((6, 4), [Partial(), Shard(0)], [Shard(1), Shard(0)]),
    ((8, 3), [InterleavedShard(0, 2), Replicate()], [Shard(0), Shard(1)]),
]


@pytest.mark.parametrize(("shape", "source", "target"), CASES)
def test_async_redistribute_equals_blocking_bit_for_bit(
    mesh22: sw.DeviceMesh, shape: tuple, source: list, target: list
) -> None:
    torch.manual_seed(2)
    x = torch.randn(shape)
    dt = sw.distribute_tensor(x, mesh22, [p if not p.is_partial() else Replicate() for p in source])
    if any(p.is_partial() for p in source):  # a genuine Partial value: local sums differ
        dt = sw.DTensor.from_local(
            [torch.randn(c.shape) for c in sw.local_components(dt)], mesh22, source, shape=shape
        )
    with sw.debug.CommCounter() as expected:
        blocking = dt.redistribute(placements=target)
    with sw.debug.CommCounter() as counted:
        pending = dt.redistribute(placements=target, async_op=True)
        assert isinstance(pending, sw.dtensor.AsyncDTensor)
        assert pending.shape == blocking.shape and pending.placements == blocking.placements
        ready = pending.wait()
    assert counted.counts == expected.counts and counted.bytes == expected.bytes
    for got, want in zip(sw.local_components(ready), sw.local_components(blocking), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_first_use_waits_and_to_local_returns_a_waiting_tensor() -> None:
    mesh = sw.DeviceMesh("cpu", [0])
    x = torch.randn(5, 3)
    dt = sw.distribute_tensor(x, mesh, [Shard(0)])
    pending = dt.redistribute(placements=[Replicate()], async_op=True)
    assert torch.equal((pending * 2).full_tensor(), x * 2)  # an op on it waits
    local = dt.redistribute(placements=[Replicate()], async_op=True).to_local()
    assert isinstance(local, sw.dtensor.AsyncCollectiveTensor)
    result = local + 1  # first use waits, the result is a plain tensor
    assert type(result) is torch.Tensor and torch.equal(result, x + 1)
    assert torch.equal(local.wait(), x)
    back = sw.DTensor.from_local(local, mesh, [Replicate()], async_op=True)
    assert isinstance(back, sw.dtensor.AsyncDTensor) and torch.equal(back.full_tensor(), x)


def test_async_redistribute_is_differentiable(mesh22: sw.DeviceMesh) -> None:
    x = torch.randn(4, 6)
    dx = sw.distribute_tensor(x.clone().requires_grad_(), mesh22, [Shard(0), Shard(1)])
    pending = dx.redistribute(placements=[Replicate(), Shard(0)], async_op=True)
    (pending.full_tensor() ** 2).sum().backward()
    assert dx.grad.placements == (Shard(0), Shard(1))
    assert torch.allclose(dx.grad.full_tensor(), 2 * x)


def test_async_from_local_with_run_check_broadcasts(mesh22: sw.DeviceMesh) -> None:
    parts = [torch.full((2, 3), float(i)) for i in range(4)]
    out = sw.DTensor.from_local(parts, mesh22, [Replicate(), Shard(0)], run_check=True,
                                async_op=True)
    want = sw.DTensor.from_local(parts, mesh22, [Replicate(), Shard(0)], run_check=True)
    for got, ref in zip(sw.local_components(out), sw.local_components(want), strict=True):
        assert torch.equal(got, ref)


def test_background_error_surfaces_at_wait_naming_the_collective() -> None:
    from shardwise.comm import background

    work = background.submit(lambda: 1 / 0, "all_gather of the test tensor")
    with pytest.raises(sw.errors.CollectiveError, match=r"all_gather of the test tensor.*division"):
        work.wait()

    def timeout() -> None:
        raise sw.errors.CollectiveTimeoutError("peer 1 did not answer")

    work = background.submit(timeout, "broadcast of y")
    with pytest.raises(
        sw.errors.CollectiveTimeoutError, match=r"broadcast of y.*peer 1 did not answer"
    ):
        work.wait()
    assert background.submit(lambda: 42, "fine").wait() == 42  # the worker lives on
