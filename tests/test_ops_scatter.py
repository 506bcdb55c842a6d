"""Scatters with reduce, index_fill/copy/reduce, slice/select/diagonal scatters, diag_embed
(diag, diagflat) and trace on DTensors against single-device torch, forward and backward."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from op_oracle import run_oracle
from shardwise import Shard
from shardwise.debug import CommCounter

MESHES = [(2,), (3,), (2, 2)]
INDEX = torch.tensor([2, 0, 3])


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _with_index(fn):
    """``fn`` given the plain ``INDEX`` (a whole value every rank holds: taken as replicated
    inside ``implicit_replication()``, PyTorch's rule for plain tensors beside DTensors)."""

    def run(*args):
        with sw.config.implicit_replication():
            return fn(*args)

    return run


CASES = [
    ("index_fill", _with_index(lambda x: x.index_fill(1, INDEX, -1.0)), [(5, 4)]),
    ("index_copy", _with_index(lambda x, s: x.index_copy(1, INDEX, s)), [(5, 4), (5, 3)]),
    ("index_reduce", _with_index(lambda x, s: x.index_reduce(1, INDEX, s, "amax")),
     [(5, 4), (5, 3)]),
    ("slice_scatter", lambda x, s: torch.slice_scatter(x, s, 1, 1, 4), [(5, 6), (5, 3)]),
    ("select_scatter", lambda x, s: torch.select_scatter(x, s, 0, 2), [(4, 5), (5,)]),
    ("diagonal_scatter", lambda x, s: torch.diagonal_scatter(x, s, 0, 1, 2),
     [(3, 4, 4), (3, 4)]),
    ("diag_embed", lambda x: torch.diag_embed(x, offset=1), [(3, 4)]),
    ("diag", torch.diag, [(5,)]),
    ("diagflat", torch.diagflat, [(2, 3)]),
    ("trace", torch.trace, [(5, 5)]),
]


@pytest.mark.parametrize("name,fn,shapes", CASES, ids=[c[0] for c in CASES])
def test_scatter_family_oracle(name, fn, shapes) -> None:
    tensors = [randn(*s, seed=i) for i, s in enumerate(shapes)]
    assert run_oracle(fn, tensors, mesh_shapes=MESHES, max_cases=3) > 0


def test_scatter_reduce_with_sharded_rows() -> None:
    x, src = randn(4, 5), randn(4, 5, seed=1)
    index = torch.tensor([[0, 1, 2, 0, 4]] * 4)

    def fn(x, s):
        with sw.config.implicit_replication():  # the plain index: the same on every device
            return x.scatter(1, index, s, reduce="multiply")

    run_oracle(fn, [x, src], mesh_shapes=MESHES, max_cases=3, grad=False)
    mesh = sw.init_device_mesh("cpu", (2,))
    dx, ds, di = (sw.distribute_tensor(t, mesh, [Shard(0)]) for t in (x, src, index))
    with CommCounter() as counter:
        out = dx.scatter(1, di, ds, reduce="add")
    assert out.placements == (Shard(0),) and not counter.records
    torch.testing.assert_close(out.full_tensor(), x.scatter(1, index, src, reduce="add"))
