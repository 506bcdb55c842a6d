"""median / nanmedian / mode / kthvalue along a dim, the whole-tensor median, and searches
(bucketize, searchsorted, isin) on DTensors against single-device torch."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from op_oracle import run_oracle
from shardwise import Shard
from shardwise.debug import CommCounter

MESHES = [(2,), (3,), (2, 2)]


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


CASES = [
    ("median_dim", lambda x: torch.median(x, dim=1)),
    ("nanmedian_keepdim", lambda x: torch.nanmedian(x, dim=0, keepdim=True)),
    ("kthvalue", lambda x: torch.kthvalue(x, 2, dim=1)),
    ("mode", lambda x: torch.mode(x.round(), dim=0)),
    ("median", torch.median),
]


@pytest.mark.parametrize("name,fn", CASES, ids=[c[0] for c in CASES])
def test_order_statistic_oracle(name, fn) -> None:
    assert run_oracle(fn, [randn(5, 4)], mesh_shapes=MESHES, max_cases=3) > 0


BOUNDARIES = torch.tensor([-1.0, 0.0, 0.5, 2.0])


def _whole(fn):
    """``fn`` with the plain ``BOUNDARIES`` every rank holds whole taken as replicated."""

    def run(*args):
        with sw.config.implicit_replication():
            return fn(*args)

    return run


def test_searches_oracle() -> None:
    x = randn(5, 4)
    run_oracle(_whole(lambda x: torch.bucketize(x, BOUNDARIES)), [x], mesh_shapes=MESHES,
               max_cases=3)
    run_oracle(_whole(lambda x: torch.searchsorted(BOUNDARIES, x, right=True)), [x],
               mesh_shapes=MESHES, max_cases=3)
    seqs = torch.sort(randn(5, 6, seed=1), dim=1).values
    run_oracle(torch.searchsorted, [seqs, x], mesh_shapes=MESHES, max_cases=4, grad=False)
    run_oracle(_whole(lambda x: torch.isin(x.round(), BOUNDARIES)), [x], mesh_shapes=MESHES,
               max_cases=3)


def test_sharded_median_along_dim_is_local() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    x = randn(6, 5)
    dx = sw.distribute_tensor(x, mesh, [Shard(0)])
    with CommCounter() as counter:
        values, indices = torch.median(dx, dim=1)
    assert values.placements == indices.placements == (Shard(0),) and not counter.records
    expected = torch.median(x, dim=1)
    torch.testing.assert_close(values.full_tensor(), expected.values)
    torch.testing.assert_close(indices.full_tensor(), expected.indices)
