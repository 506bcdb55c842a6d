"""The ``*_copy`` view variants, ``unsafe_split``, functional ``fill`` and ``unfold`` on
DTensors against single-device torch, forward and backward."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from op_oracle import run_oracle
from shardwise import Shard

MESHES = [(2,), (3,), (2, 2)]


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


CASES = [
    ("view_copy", lambda x: torch.view_copy(x, (4, 3, 2))),
    ("permute_copy", lambda x: torch.permute_copy(x, (2, 0, 1))),
    ("transpose_copy", lambda x: torch.transpose_copy(x, 0, 2)),
    ("unsqueeze_copy", lambda x: torch.unsqueeze_copy(x, 1)),
    ("unbind_copy", lambda x: torch.unbind_copy(x, 1)),
    ("split_with_sizes_copy", lambda x: torch.split_with_sizes_copy(x, [1, 2], 1)),
    ("narrow_copy", lambda x: torch.narrow_copy(x, 1, 1, 2)),
    ("expand_copy", lambda x: torch.expand_copy(x[:, :1], (4, 5, 2))),
    ("unsafe_split", lambda x: torch.unsafe_split(x, 2, 0)),
    ("unfold", lambda x: x.unfold(2, 2, 1)),
    ("fill", lambda x: torch.fill(x, 2.5) * x),
]


@pytest.mark.parametrize("name,fn", CASES, ids=[c[0] for c in CASES])
def test_copy_oracle(name, fn) -> None:
    assert run_oracle(fn, [randn(4, 3, 2)], mesh_shapes=MESHES, max_cases=3) > 0


def test_copy_does_not_alias_and_keeps_shards() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    x = randn(4, 6)
    dx = sw.distribute_tensor(x, mesh, [Shard(0)])
    out = torch.t_copy(dx)
    assert out.placements == (Shard(1),)
    out.mul_(0)
    torch.testing.assert_close(dx.full_tensor(), x)


def test_inplace_through_a_view_that_moved_its_input_raises() -> None:
    """A view whose input had to be redistributed is a copy: writing through it would not
    reach the viewed tensor, so it is refused instead of silently lost."""
    mesh = sw.init_device_mesh("cpu", (2,))
    dx = sw.distribute_tensor(randn(4, 6), mesh, [Shard(1)])
    with sw.config.allow_implicit_redistribute():
        moved = dx[:, 1:4]  # slicing the sharded dim gathers it first
        local = dx[1:3]  # slicing another dim is a local view
    local.mul_(0)
    assert torch.count_nonzero(dx.full_tensor()[1:3]) == 0
    with pytest.raises(sw.errors.UnsupportedOpError, match="redistribute"):
        moved.mul_(0)


def test_diagonal_of_row_sharded_matrix_is_a_local_view() -> None:
    mesh = sw.init_device_mesh("cpu", (3,))
    x = randn(5, 7)
    dx = sw.distribute_tensor(x, mesh, [Shard(0)])
    diag = dx.diagonal()
    assert diag.placements == (Shard(0),)
    torch.testing.assert_close(diag.full_tensor(), x.diagonal())
    diag.fill_(1.0)
    expected = x.clone()
    expected.diagonal().fill_(1.0)
    torch.testing.assert_close(dx.full_tensor(), expected)
    run_oracle(lambda t: t.diagonal(dim1=1, dim2=0) * 2, [randn(4, 6)], mesh_shapes=[(2,), (3,)],
               max_cases=4)
