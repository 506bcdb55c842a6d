"""Reductions and scans on DTensors against single-device torch (forward and backward), the
placements they give over sharded dims (Partial where a pending reduction exists, exact for
uneven shards), and Python values (``.item()``, ``float()``, ``bool()``) of DTensors."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from op_oracle import run_oracle
from shardwise import Partial, Replicate, Shard

MESHES = [(2,), (3,), (4,), (2, 2)]


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _mesh(*shape: int) -> sw.DeviceMesh:
    return sw.init_device_mesh("cpu", shape)


REDUCTIONS = {
    "sum_all": lambda x: x.sum(),
    "sum_dim": lambda x: x.sum(0),
    "sum_dims_keepdim": lambda x: x.sum((0, 2), keepdim=True),
    "sum_dtype": lambda x: x.sum(1, dtype=torch.float64),
    "mean_all": lambda x: x.mean(),
    "mean_dim": lambda x: x.mean(-1),
    "mean_dims_keepdim": lambda x: x.mean((0, 1), keepdim=True),
    "prod_dim": lambda x: x.prod(1),
    "prod_all": lambda x: x.prod(),
    "amax": lambda x: x.amax((0, 2)),
    "amin_keepdim": lambda x: x.amin(1, keepdim=True),
    "max_all": lambda x: x.max(),
    "min_all": lambda x: x.min(),
    "max_dim": lambda x: x.max(1),
    "min_dim_keepdim": lambda x: x.min(0, keepdim=True),
    "var": lambda x: x.var(1),
    "var_correction": lambda x: torch.var(x, (0, 2), correction=0),
    "std": lambda x: x.std(),
    "std_keepdim": lambda x: x.std(0, keepdim=True),
    "var_mean": lambda x: torch.var_mean(x, 1),
    "std_mean": lambda x: torch.std_mean(x, (0, 1)),
    "norm": lambda x: x.norm(),
    "norm_dim": lambda x: torch.linalg.vector_norm(x, dim=1),
    "norm_1": lambda x: torch.linalg.vector_norm(x, ord=1, dim=(0, 1)),
    "norm_inf": lambda x: torch.linalg.vector_norm(x, ord=float("inf"), dim=0),
    "norm_3": lambda x: torch.linalg.vector_norm(x, ord=3),
    "logsumexp": lambda x: torch.logsumexp(x, 1),
    "cumsum": lambda x: x.cumsum(0),
    "cumsum_last": lambda x: x.cumsum(-1),
    "cumprod": lambda x: x.cumprod(1),
}


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_reduction_oracle(name: str) -> None:
    """Uneven (5, 3, 2): 5 and 3 divide no mesh size, 2 is smaller than 3 and 4."""
    run_oracle(REDUCTIONS[name], [_x(5, 3, 2)], mesh_shapes=MESHES, max_cases=6)


def test_indices_and_bool_reductions() -> None:
    x = _x(7, 5)
    for fn in [
        lambda t: t.argmax(),
        lambda t: t.argmax(0),
        lambda t: t.argmin(1, keepdim=True),
        lambda t: (t > 0).any(),
        lambda t: (t > -1).all(1),
        lambda t: (t > 0).any(0, keepdim=True),
        lambda t: torch.count_nonzero(t > 0, 0),
    ]:
        run_oracle(fn, [x], mesh_shapes=MESHES, max_cases=6, grad=False)


def test_integer_and_rank0_inputs() -> None:
    ints = torch.randint(-5, 6, (6, 5), generator=torch.Generator().manual_seed(3))
    run_oracle(lambda t: torch.stack([t.sum(), t.amax(), t.prod() % 7]), [ints],
               mesh_shapes=MESHES, max_cases=6)
    run_oracle(lambda t: t.sum(0) + t.amin(0) + t.cumsum(1)[-1], [ints],
               mesh_shapes=MESHES, max_cases=6)
    scalar = torch.tensor(1.5)
    run_oracle(lambda t: t.sum() + t.mean() + t.amax(), [scalar], mesh_shapes=MESHES)


def test_sharded_reduction_placements_without_communication() -> None:
    mesh = _mesh(2, 2)
    x = _x(5, 7, 3)
    d = sw.distribute_tensor(x, mesh, [Shard(0), Shard(2)])
    with sw.debug.CommCounter() as counter:
        cases = {
            "sum0": (d.sum(0), x.sum(0), (Partial(), Shard(1))),
            "sum1_keepdim": (d.sum(1, keepdim=True), x.sum(1, keepdim=True), (Shard(0), Shard(2))),
            "sum_all": (d.sum(), x.sum(), (Partial(), Partial())),
            "mean02": (d.mean((0, 2)), x.mean((0, 2)), (Partial(), Partial())),
            "mean1": (d.mean(1), x.mean(1), (Shard(0), Shard(1))),
            "amax0": (d.amax(0), x.amax(0), (Partial("max"), Shard(1))),
            "amin_all": (d.amin((0, 1, 2)), x.amin(), (Partial("min"), Partial("min"))),
            "norm1": (torch.linalg.vector_norm(d, 1), torch.linalg.vector_norm(x, 1),
                      (Partial("norm1"), Partial("norm1"))),
            "var1": (d.var(1), x.var(1), (Shard(0), Shard(1))),
            "cumsum1": (d.cumsum(1), x.cumsum(1), (Shard(0), Shard(2))),
            "argmax1": (d.argmax(1), x.argmax(1), (Shard(0), Shard(1))),
            "any0": ((d > 0).any(0), (x > 0).any(0), (Partial("max"), Shard(1))),
            "all_all": ((d > -1).all(), (x > -1).all(), (Partial("min"), Partial("min"))),
        }
    assert counter.counts == {}
    for name, (got, want, placements) in cases.items():
        assert got.placements == placements, name
        torch.testing.assert_close(got.full_tensor(), want, msg=name)


def test_mean_over_uneven_shards_is_exact() -> None:
    """4 rows on 3 devices (2, 2, 0): the average of local means would be wrong."""
    mesh = _mesh(3)
    x = torch.tensor([[1.0], [2.0], [3.0], [10.0]])
    d = sw.distribute_tensor(x, mesh, [Shard(0)])
    m = d.mean(0)
    assert m.placements == (Partial(),)
    torch.testing.assert_close(m.full_tensor(), torch.tensor([4.0]))


def test_partial_inputs() -> None:
    mesh = _mesh(3)
    x = _x(5, 4)
    p = sw.distribute_tensor(x, mesh, [Partial()])
    with sw.debug.CommCounter() as counter:
        s, m = p.sum(0), p.mean()
    assert counter.counts == {} and s.placements == m.placements == (Partial(),)
    torch.testing.assert_close(s.full_tensor(), x.sum(0))
    torch.testing.assert_close(m.full_tensor(), x.mean())
    for fn in (lambda t: t.amax(0), lambda t: t.var(1), lambda t: t.prod(0), lambda t: t.norm()):
        with pytest.raises(sw.errors.ImplicitRedistributeError):
            fn(p)
        with sw.config.allow_implicit_redistribute():
            torch.testing.assert_close(fn(p).full_tensor(), fn(x))
    peak = sw.distribute_tensor(x, mesh, [Shard(0)]).amax(0)
    assert peak.amax().placements == (Partial("max"),)
    torch.testing.assert_close(peak.amax().full_tensor(), x.max())


def test_sharded_dim_needing_whole_data_is_gathered_in_implicit_mode() -> None:
    mesh = _mesh(3)
    x = _x(7, 2)
    d = sw.distribute_tensor(x, mesh, [Shard(0)])
    with pytest.raises(sw.errors.ImplicitRedistributeError, match="argmax"):
        d.argmax(0)
    with pytest.raises(sw.errors.ImplicitRedistributeError, match="cumsum"):
        d.cumsum(0)
    with sw.config.allow_implicit_redistribute(), sw.debug.CommCounter() as counter:
        idx = d.argmax(0)
        values, indices = d.max(0)
    assert sum(counter.counts.values()) == 2
    assert torch.equal(idx.full_tensor(), x.argmax(0))
    assert torch.equal(indices.full_tensor(), x.max(0).indices)
    assert torch.equal(values.full_tensor(), x.max(0).values)


def test_max_over_empty_shards() -> None:
    """6 rows on 4 devices (2, 2, 2, 0): a device holds no row, so no Partial("max")."""
    mesh = _mesh(4)
    x = _x(6, 3)
    d = sw.distribute_tensor(x, mesh, [Shard(0)])
    with sw.config.allow_implicit_redistribute():
        for fn in (lambda t: t.amax(0), lambda t: t.max(), lambda t: t.amin()):
            torch.testing.assert_close(fn(d).full_tensor(), fn(x))


# ----- Python values -------------------------------------------------------------------------


@pytest.mark.parametrize("placement", [Partial(), Shard(0), Partial("avg"), Replicate()],
                         ids=str)
def test_python_values_are_global(placement) -> None:
    mesh = _mesh(3)
    x = torch.tensor([-1.0, 2.0, 3.5, 0.25])
    value = sw.distribute_tensor(x, mesh, [placement]).sum()
    assert value.item() == pytest.approx(x.sum().item())
    assert float(value) == pytest.approx(4.75)
    assert int(value) == 4
    assert bool(value) is True
    one = sw.distribute_tensor(torch.tensor([2.0]), mesh, [placement])
    assert one.item() == 2.0
    assert bool(sw.distribute_tensor(torch.tensor(0.0), mesh, [Partial()])) is False


def test_partial_item_is_not_one_devices_piece() -> None:
    """Components 1, 2 and 3 of a Partial("sum"): the value is 6 (PyTorch 2.13 says 1)."""
    mesh = _mesh(3)
    dt = sw.DTensor.from_local(
        [torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)], mesh, [Partial()]
    )
    with sw.debug.CommCounter() as counter:
        assert dt.item() == 6.0
    assert counter.counts == {"all_reduce": 1}
    assert float(dt) == 6.0 and int(dt) == 6 and bool(dt) is True


def test_item_of_many_elements_raises() -> None:
    d = sw.distribute_tensor(torch.ones(4), _mesh(2), [Shard(0)])
    with pytest.raises(RuntimeError, match="4 elements"):
        d.item()
