"""Indexing and sorting ops (index_select, gather, scatter, index_add, index/index_put, sort,
topk, unique) against single-device torch, forward and backward."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from op_oracle import run_oracle
from shardwise import Partial, Replicate, Shard


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _t(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed))


def _unique_rows(n: int, k: int, cols: int, seed: int = 0) -> torch.Tensor:
    """A (k, cols) index into a dim of size n with distinct entries per column (scatter
    without duplicate targets, so the result does not depend on write order)."""
    g = _gen(seed)
    return torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(cols)], 1)


IDX7 = torch.tensor([4, 0, 2, 2, 1, 3, 0])

ORACLE = {
    "index_select_0": (lambda a, i: a.index_select(0, i), [_t(5, 3), IDX7]),
    "index_select_1": (lambda a, i: a.index_select(1, i), [_t(5, 3), torch.tensor([2, 0, 2])]),
    "gather_0": (
        lambda a, i: a.gather(0, i),
        [_t(5, 3), torch.randint(0, 5, (7, 3), generator=_gen(1))],
    ),
    "gather_1_narrow": (
        lambda a, i: a.gather(1, i),
        [_t(5, 3), torch.randint(0, 3, (4, 2), generator=_gen(1))],
    ),
    "scatter_src": (
        lambda a, i, s: a.scatter(0, i, s),
        [_t(5, 3), _unique_rows(5, 3, 3), _t(3, 3, seed=1)],
    ),
    "scatter_src_dim1": (
        lambda a, i, s: a.scatter(1, i, s),
        [_t(3, 5), _unique_rows(5, 2, 3).t(), _t(3, 2, seed=1)],
    ),
    "scatter_value": (lambda a, i: a.scatter(0, i, 2.5), [_t(5, 3), _unique_rows(5, 3, 3)]),
    "scatter_add": (
        lambda a, i, s: a.scatter_add(0, i, s),
        [_t(5, 3), torch.randint(0, 5, (7, 3), generator=_gen(2)), _t(7, 3, seed=1)],
    ),
    "index_add": (
        lambda a, i, s: a.index_add(0, i, s, alpha=2.0),
        [_t(5, 3), IDX7, _t(7, 3, seed=1)],
    ),
    "index_add_dim1": (lambda a, i, s: a.index_add(1, i, s), [_t(3, 5), IDX7, _t(3, 7, seed=1)]),
    "index_rows": (lambda a, i: a[i], [_t(5, 3), IDX7]),
    "index_cols": (lambda a, i: a[:, i], [_t(3, 5), IDX7]),
    "index_pair": (lambda a, i, j: a[i, j], [_t(5, 3), IDX7, torch.tensor([2, 0, 1, 1, 0, 2, 2])]),
    "index_put_accumulate": (
        lambda a, i, v: a.index_put((i,), v, accumulate=True),
        [_t(5, 3), IDX7, _t(7, 3, seed=1)],
    ),
    "index_put": (
        lambda a, i, v: a.index_put((i,), v),
        [_t(5, 3), torch.tensor([4, 0, 2]), _t(3, 3, seed=1)],
    ),
    "index_put_broadcast": (
        lambda a, i, v: a.index_put((i,), v, accumulate=True),
        [_t(5, 3), IDX7, _t(3, seed=1)],
    ),
    "bool_mask": (lambda a, m: a[m], [_t(5, 3), torch.rand(5, 3, generator=_gen(3)) > 0.5]),
    "sort_1": (lambda a: a.sort(1), [_t(5, 3)]),
    "sort_0_descending": (lambda a: a.sort(0, descending=True), [_t(5, 3)]),
    "sort_stable": (
        lambda a: torch.sort(a, dim=-1, stable=True),
        [torch.randint(0, 3, (5, 4), generator=_gen(4)).float()],
    ),
    "argsort": (lambda a: a.argsort(0), [_t(5, 3)]),
    "topk_0": (lambda a: a.topk(2, dim=0), [_t(5, 3)]),
    "topk_1_smallest": (lambda a: a.topk(2, dim=1, largest=False), [_t(5, 3)]),
    "unique": (
        lambda a: torch.unique(a, return_inverse=True, return_counts=True),
        [torch.randint(0, 4, (5, 3), generator=_gen(5))],
    ),
}


@pytest.mark.parametrize("name", list(ORACLE))
def test_oracle(name: str) -> None:
    fn, tensors = ORACLE[name]
    assert run_oracle(fn, tensors, max_cases=8) > 0


def _setitem(a: torch.Tensor, i: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = a * 1
    out[i] = v
    return out


INPLACE = {
    "scatter_": (
        lambda a, i, s: (a * 1).scatter_(0, i, s),
        [_t(5, 3), _unique_rows(5, 3, 3), _t(3, 3, seed=1)],
    ),
    "setitem": (_setitem, [_t(5, 3), torch.tensor([3, 1]), _t(2, 3, seed=1)]),
    "index_add_": (lambda a, i, s: (a * 1).index_add_(0, i, s), [_t(5, 3), IDX7, _t(7, 3, seed=1)]),
}


@pytest.mark.parametrize("name", list(INPLACE))
def test_inplace_oracle(name: str) -> None:
    """In place on every placement (a ``self`` sharded on the written dim 0 is moved first, in
    implicit mode); in explicit mode that move is refused with ImplicitRedistributeError."""
    fn, tensors = INPLACE[name]
    assert run_oracle(fn, tensors, mesh_shapes=[(2,), (3,), (2, 2)], max_cases=10) > 0
    mesh = sw.init_device_mesh("cpu", (2,))
    row_sharded = sw.distribute_tensor(tensors[0], mesh, [Shard(0)])
    others = [sw.distribute_tensor(t, mesh, [Replicate()]) for t in tensors[1:]]
    with pytest.raises(sw.errors.ImplicitRedistributeError):
        fn(row_sharded, *others)
    column_sharded = sw.distribute_tensor(tensors[0], mesh, [Shard(1)])
    with sw.debug.CommCounter() as counter:
        out = fn(column_sharded, *others)
    assert counter.total_bytes == 0 and out.placements == (Shard(1),)
    assert torch.equal(out.full_tensor(), fn(*tensors))


# ----- chosen strategies: what stays sharded and what moves ------------------------------------


def test_gather_along_sharded_index_backward_stays_partial() -> None:
    """Index sharded on the gather dim: the forward moves nothing; the gradient of ``self``
    is a Partial("sum") scatter_add (each device adds its share), never a gather of the grad."""
    mesh = sw.init_device_mesh("cpu", (2,))
    x = _t(5, 3)
    index = torch.randint(0, 5, (6, 3), generator=_gen(0))
    dx = sw.distribute_tensor(x, mesh, [Replicate()]).requires_grad_()
    di = sw.distribute_tensor(index, mesh, [Shard(0)])
    with sw.debug.CommCounter() as counter:
        out = dx.gather(0, di)
    assert counter.total_bytes == 0 and out.placements == (Shard(0),)
    grad = sw.distribute_tensor(torch.ones(6, 3), mesh, [Shard(0)])
    with sw.debug.CommCounter() as counter:
        out.backward(grad)
    assert counter.total_bytes == 0
    assert dx.grad.placements == (Partial(),)
    expected = torch.zeros(5, 3).scatter_add(0, index, torch.ones(6, 3))
    assert torch.equal(dx.grad.full_tensor(), expected)


def test_index_select_sharded_index_moves_nothing() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    x = _t(5, 6)
    dx = sw.distribute_tensor(x, mesh, [Shard(1), Replicate()])
    di = sw.distribute_tensor(IDX7, mesh, [Replicate(), Shard(0)])
    with sw.debug.CommCounter() as counter:
        out = dx.index_select(0, di)
    assert counter.total_bytes == 0
    assert out.placements == (Shard(1), Shard(0))
    assert torch.equal(out.full_tensor(), x.index_select(0, IDX7))


@pytest.mark.parametrize(
    ("mesh_shape", "placements", "out_placements"),
    [
        ((3,), [Shard(1)], (Partial(),)),  # uneven pieces of the gather dim
        ((2, 2), [Shard(1), Shard(0)], (Partial(), Shard(0))),
        ((2, 2), [Shard(1), Shard(1)], (Partial(), Partial())),
    ],
)
def test_gather_on_sharded_dim_is_a_masked_partial_sum(mesh_shape, placements, out_placements):
    """``self`` sharded on the gather dim, index replicated: each device reads the positions it
    holds and writes zeros elsewhere, a Partial("sum") result with nothing moved (PyTorch's
    masked gather); values and the gradient of ``self`` as on one device."""
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    x = _t(6, 7, 4).requires_grad_()
    index = torch.randint(0, 7, (6, 5, 4), generator=_gen(2))
    dx = sw.distribute_tensor(x.detach(), mesh, placements).requires_grad_()
    di = sw.distribute_tensor(index, mesh, [Replicate()] * len(mesh_shape))
    with sw.debug.CommCounter() as counter:
        out = dx.gather(1, di)
    assert counter.total_bytes == 0 and out.placements == out_placements
    expected = x.gather(1, index)
    assert torch.equal(out.full_tensor(), expected)
    weights = _t(6, 5, 4, seed=3)
    (expected * weights).sum().backward()
    dw = sw.distribute_tensor(weights, mesh, [Replicate()] * len(mesh_shape))
    with sw.config.allow_implicit_redistribute():
        (out * dw).sum().backward()
    assert torch.allclose(dx.grad.full_tensor(), x.grad)


def test_gather_needing_a_move_is_explicit() -> None:
    """``self`` and the index both sharded on the gather dim: one of them must move."""
    mesh = sw.init_device_mesh("cpu", (2,))
    dx = sw.distribute_tensor(_t(5, 3), mesh, [Shard(0)])
    di = sw.distribute_tensor(torch.zeros(2, 3, dtype=torch.int64), mesh, [Shard(0)])
    with pytest.raises(sw.errors.ImplicitRedistributeError, match="gather"):
        dx.gather(0, di)


def test_scatter_value_into_partial() -> None:
    mesh = sw.init_device_mesh("cpu", (3,))
    x = _t(5, 3)
    index = _unique_rows(5, 2, 3)
    dx = sw.distribute_tensor(x, mesh, [Partial()])
    di = sw.distribute_tensor(index, mesh, [Replicate()])
    out = dx.scatter(0, di, 4.0)
    assert out.placements == (Partial(),)
    assert torch.equal(out.full_tensor(), x.scatter(0, index, 4.0))


def test_sort_keeps_other_dims_sharded() -> None:
    mesh = sw.init_device_mesh("cpu", (3,))
    x = _t(7, 4)
    dx = sw.distribute_tensor(x, mesh, [Shard(0)])
    with sw.debug.CommCounter() as counter:
        values, indices = dx.sort(1)
    assert counter.total_bytes == 0
    assert values.placements == indices.placements == (Shard(0),)
    with pytest.raises(sw.errors.ImplicitRedistributeError, match="sort"):
        dx.sort(0)


def test_topk_on_sharded_dim_gives_global_indices() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    x = _t(9, 3)
    dx = sw.distribute_tensor(x, mesh, [Shard(0)])
    with sw.config.allow_implicit_redistribute():
        values, indices = dx.topk(3, dim=0)
    ev, ei = x.topk(3, dim=0)
    assert torch.equal(values.full_tensor(), ev)
    assert torch.equal(indices.full_tensor(), ei)


def test_unique_is_replicated_and_explicit() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    x = torch.tensor([3, 1, 3, 2, 1])
    dx = sw.distribute_tensor(x, mesh, [Shard(0)])
    with pytest.raises(sw.errors.ImplicitRedistributeError):
        torch.unique(dx)
    with sw.config.allow_implicit_redistribute():
        values = torch.unique(dx)
    assert values.placements == (Replicate(),)
    assert torch.equal(values.full_tensor(), torch.unique(x))


@pytest.mark.parametrize("fn", [torch.cummax, torch.cummin])
def test_cummax_cummin_backward_of_a_0d_tensor(fn) -> None:
    """Autograd's formula scatters the gradient into plain zeros made with ``torch.zeros``; on
    a 0-d input those zeros are a 0-d plain tensor, which is an operand here, not a scalar."""
    mesh = sw.init_device_mesh("cpu", (2,))
    x = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    dx = sw.distribute_tensor(x.detach().clone(), mesh, [Replicate()]).requires_grad_()
    values, _ = fn(dx, 0)
    (values * 3.0).sum().backward()
    (fn(x, 0)[0] * 3.0).sum().backward()
    assert torch.equal(dx.grad.full_tensor(), x.grad)


def test_scatter_add_into_a_0d_plain_zero() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    index = sw.distribute_tensor(torch.tensor(0), mesh, [Replicate()])
    src = sw.distribute_tensor(torch.tensor(2.5), mesh, [Replicate()])
    out = torch.zeros(()).scatter_add(0, index, src)
    assert out.placements == (Replicate(),)
    assert torch.equal(out.full_tensor(), torch.zeros(()).scatter_add(0, torch.tensor(0),
                                                                        torch.tensor(2.5)))
