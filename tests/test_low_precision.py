"""Issue 7, point 4: float16/bfloat16 values left pending a sum by any op (row-parallel matmuls,
dot/mv, conv over sharded channels, the backward of column-parallel layers, Partial + Partial)
accumulate in float32 and round once, as single-device torch does."""

from __future__ import annotations

import io
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from mp_harness import run_in_processes
from shardwise import DTensor, Partial, Replicate, Shard
from shardwise.redistribute import plan_redistribute

f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32
HALF = [f16, bf16]
MESH2 = sw.init_device_mesh("cpu", (2,))
MESH4 = sw.init_device_mesh("cpu", (4,))


def _d(t: torch.Tensor, placements: list, mesh: sw.DeviceMesh = MESH2) -> DTensor:
    return sw.distribute_tensor(t, mesh, placements)


def _cancelling(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A [2, 4] @ [4, 2] product whose pieces over the two halves of the contraction are
    +-75000 (past float16's 65504) and cancel: torch gives small finite values."""
    a = torch.tensor([[300.0, 250.0, 300.0, 250.0], [1.0, 2.0, 3.0, 4.0]])
    b = torch.tensor([[125.0, 1.0], [150.0, 2.0], [-125.0, 0.5], [-149.0, 1.0]])
    return a.to(dtype), b.to(dtype)


def _within_one_ulp(got: torch.Tensor, want: torch.Tensor) -> None:
    """torch's CPU kernels accumulate in float32 in their own blocking order; two float32 sums
    in different orders round to half precision alike except next to a rounding boundary, so
    the two may differ by one unit in the last place there (and only there)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    ulp = (torch.nextafter(want.abs(), torch.tensor(float("inf"), dtype=want.dtype))
           - want.abs()).float()
    assert ((got.float() - want.float()).abs() <= ulp).all(), (got, want)


# ----- matmul family: the contraction dim sharded gives Partial("sum") --------------------------

def _addmm_whole_bias(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """addmm with a plain bias every rank holds whole (taken as replicated)."""
    with sw.config.implicit_replication():
        return torch.addmm(torch.full((2,), 0.5, dtype=a.dtype), a, b)


ROW_PARALLEL: dict[str, Callable] = {
    "mm": torch.mm,
    "matmul": torch.matmul,
    "addmm": lambda a, b: _addmm_whole_bias(a, b),
    "bmm": lambda a, b: torch.bmm(a.unsqueeze(0), b.unsqueeze(0)).squeeze(0),
    "linear": lambda a, b: F.linear(a, b.t()),
    "einsum": lambda a, b: torch.einsum("ik,kj->ij", a, b),
}


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("name", list(ROW_PARALLEL))
def test_row_parallel_matmul_cancelling_pieces_equal_torch(name: str, dtype: torch.dtype) -> None:
    fn = ROW_PARALLEL[name]
    a, b = _cancelling(dtype)
    want = fn(a, b)
    assert torch.isfinite(want).all()
    got = fn(_d(a, [Shard(1)]), _d(b, [Shard(0)]))
    assert got.dtype == dtype and Partial() in got.placements
    assert torch.equal(got.full_tensor(), want)  # exact: every float32 partial sum is exact


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_random_row_parallel_matmul_within_one_ulp(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(16, 96, generator=gen).to(dtype)
    b = torch.randn(96, 8, generator=gen).to(dtype)
    want = a @ b
    for mesh, placements in [(MESH2, [Shard(1)]), (MESH4, [Shard(1)])]:
        got = (_d(a, placements, mesh) @ _d(b, [Shard(0)], mesh)).full_tensor()
        _within_one_ulp(got, want)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_dot_mv_and_conv_pieces_accumulate_in_float32(dtype: torch.dtype) -> None:
    a, b = _cancelling(dtype)
    row, col = a[0], b[:, 0]
    got = torch.dot(_d(row, [Shard(0)]), _d(col, [Shard(0)]))
    assert got.placements == (Partial(),) and torch.equal(got.full_tensor(), torch.dot(row, col))
    got = torch.mv(_d(a, [Shard(1)]), _d(col, [Shard(0)]))
    assert got.placements == (Partial(),) and torch.equal(got.full_tensor(), torch.mv(a, col))
    x = a.reshape(1, 2, 4).transpose(1, 2).contiguous()  # 4 channels, length 2
    w = b.t().reshape(2, 4, 1)  # 2 output channels, kernel 1
    got = F.conv1d(_d(x, [Shard(1)]), _d(w, [Shard(1)]))
    assert got.placements == (Partial(),)
    assert torch.equal(got.full_tensor(), F.conv1d(x, w))


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_partial_plus_partial_and_scaling_do_not_round_each_piece(dtype: torch.dtype) -> None:
    big = 60000.0 if dtype == f16 else 2.0**20  # float16: x + x overflows a piece
    pieces = [torch.tensor([big, 1.0], dtype=dtype), torch.tensor([-big, 0.5], dtype=dtype)]
    value = (pieces[0].float() + pieces[1].float()).to(dtype)  # the global value: [0, 1.5]
    x = DTensor.from_local(pieces, MESH2, [Partial()])
    for got, want in [(x + x, value + value), (x * 4, value * 4), (x - x * 0.5, value * 0.5),
                      ((x + x).sum(0), (value + value).sum(0))]:
        assert got.placements == (Partial(),) and got.dtype == dtype
        assert torch.equal(got.full_tensor(), want), (got.full_tensor(), want)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_column_parallel_input_gradient_is_accumulated_in_float32(dtype: torch.dtype) -> None:
    a, b = _cancelling(dtype)
    x = torch.tensor([[1.0, 1.0]], dtype=dtype, requires_grad=True)
    w = b.clone().requires_grad_()  # [4 out, 2 in]: y = x @ w.t()
    (x @ w.t()).backward(a[:1])  # x.grad = a[:1] @ w: pieces of +-75000 over the outputs
    dx = sw.distribute_tensor(x.detach(), MESH2, [Replicate()]).requires_grad_()
    dw = sw.distribute_tensor(w.detach(), MESH2, [Shard(0)]).requires_grad_()
    y = dx @ dw.t()  # column parallel: output features sharded
    assert y.placements == (Shard(1),)
    y.backward(_d(a[:1], [Shard(1)]))
    assert dx.grad.placements == (Replicate(),) or Partial() in dx.grad.placements
    assert torch.isfinite(x.grad).all() and torch.equal(dx.grad.full_tensor(), x.grad)


# ----- what a pending half sum looks like from outside -----------------------------------------


def test_pending_half_sum_keeps_its_dtype_and_rounds_once() -> None:
    a, b = _cancelling(f16)
    out = _d(a, [Shard(1)], MESH4) @ _d(b, [Shard(0)], MESH4)
    assert out.dtype == f16 and out.placements == (Partial(),)
    local = sw.local_components(out)  # what a user declared: float16 pieces (each rounded)
    assert all(c.dtype == f16 for c in local)
    assert out.redistribute(placements=[Shard(0)]).dtype == f16
    assert torch.equal(out.redistribute(placements=[Shard(0)]).full_tensor(), a @ b)
    # from_local of float16 pieces: their exact sum, rounded once
    back = DTensor.from_local(local, MESH4, [Partial()])
    assert back.dtype == f16
    assert torch.equal(back.full_tensor(), torch.stack(local).float().sum(0).half())


def test_float32_pieces_are_what_moves_and_what_the_planner_prices() -> None:
    a, b = _cancelling(f16)
    out = _d(a, [Shard(1)], MESH4) @ _d(b, [Shard(0)], MESH4)
    wide = out._spec
    as_f32 = sw.spec.DTensorSpec(wide.mesh, wide.placements,
                           sw.spec.TensorMeta(wide.shape, wide.tensor_meta.stride, f32))
    for target in ([Shard(0)], [Shard(1)]):  # a reduce_scatter of float32 pieces
        half_plan = plan_redistribute(wide, target)
        assert half_plan.global_bytes == plan_redistribute(as_f32, target).global_bytes > 0
    # to Replicate: reduce_scatter the float32 pieces, round, all_gather float16 (cheaper
    # than an all_reduce of float32 pieces)
    half_plan = plan_redistribute(wide, [Replicate()])
    assert [s.collective for s in half_plan.steps] == ["reduce_scatter", "all_gather"]
    assert half_plan.global_bytes < plan_redistribute(as_f32, [Replicate()]).global_bytes
    for target in ([Replicate()], [Shard(0)], [Shard(1)]):
        with sw.debug.CommCounter() as counter:
            got = out.redistribute(placements=target)
        assert counter.total_bytes == plan_redistribute(wide, target).bytes  # moved as priced
        assert torch.equal(got.full_tensor(), a @ b)
    settled = out.redistribute(placements=[Replicate()])._spec
    assert plan_redistribute(settled, [Shard(0)]).global_bytes == 0


def test_pending_half_sum_survives_pickling() -> None:
    a, b = _cancelling(bf16)
    out = _d(a, [Shard(1)]) @ _d(b, [Shard(0)])
    buffer = io.BytesIO()
    torch.save(out, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert loaded.dtype == bf16 and loaded.placements == (Partial(),)
    assert torch.equal(loaded.full_tensor(), a @ b)


def test_compiled_row_parallel_matmul_keeps_float32_pieces() -> None:
    torch._dynamo.reset()
    a, b = _cancelling(f16)

    def f(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = x @ w
        return out, out.redistribute(placements=[Replicate()])

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    pending, reduced = compiled(_d(a, [Shard(1)]), _d(b, [Shard(0)]))
    assert pending.placements == (Partial(),) and pending.dtype == f16
    assert torch.equal(pending.full_tensor(), a @ b) and torch.equal(reduced.full_tensor(), a @ b)


# ----- the same bits in one process and across processes ---------------------------------------


def _half_results(mesh_shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Row-parallel products of random and cancelling operands, their moves and a Partial sum,
    on ``mesh_shape`` (whatever the processes)."""
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    out: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(1)
    for dtype in HALF:
        a = torch.randn(6, 48, generator=gen).to(dtype)
        b = torch.randn(48, 4, generator=gen).to(dtype)
        for name, (x, w) in {"random": (a, b), "cancelling": _cancelling(dtype)}.items():
            prod = _d(x, [Shard(1)], mesh) @ _d(w, [Shard(0)], mesh)
            out[f"{dtype}-{name}"] = prod.full_tensor()
            out[f"{dtype}-{name}-shard"] = prod.redistribute(placements=[Shard(0)]).full_tensor()
            out[f"{dtype}-{name}-twice"] = (prod + prod).full_tensor()
    return out


def test_processes_give_the_bits_of_one_process() -> None:
    per_rank = run_in_processes(_half_results, 2, (4,), timeout=120)
    alone = _half_results((4,))
    for rank in per_rank:
        assert rank.keys() == alone.keys()
        for key, value in alone.items():
            assert torch.equal(rank[key], value), key
