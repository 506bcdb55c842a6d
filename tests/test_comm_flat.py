"""``comm.all_reduce_flat``: many tensors reduced as one buffer (a gradient bucket) over
several mesh dims equal each tensor reduced alone over the devices those dims span, shaped as
given, sharing no memory with the inputs."""

from __future__ import annotations

import torch

import shardwise as sw
from shardwise import comm

SHAPES = [(3, 4), (5,), (), (2, 0), (2, 3, 2)]
GRID = [[0, 1], [2, 3]]


def _peers(device: int, dims: tuple[int, ...]) -> list[int]:
    """The devices of the 2x2 grid that share ``device``'s coordinates off ``dims``."""
    row, col = divmod(device, 2)
    return [GRID[r][c] for r in range(2) for c in range(2)
            if (0 in dims or r == row) and (1 in dims or c == col)]


def test_all_reduce_flat_equals_each_tensor_reduced() -> None:
    mesh = sw.DeviceMesh("cpu", GRID)
    gen = torch.Generator().manual_seed(0)
    values = [[torch.randint(-9, 9, s, generator=gen).double() for _ in range(4)]
              for s in SHAPES]
    reduce = {"sum": lambda t: t.sum(0), "max": lambda t: t.max(0).values,
              "avg": lambda t: t.mean(0)}
    for dims, op in (((0, 1), "sum"), ((1,), "max"), ((0,), "avg")):
        got = comm.all_reduce_flat(mesh, dims, values, op)
        for j, shape in enumerate(SHAPES):
            for d in range(4):
                terms = torch.stack([values[j][m] for m in _peers(d, dims)])
                assert got[j][d].shape == shape
                if terms.numel():
                    torch.testing.assert_close(got[j][d], reduce[op](terms), rtol=0, atol=0)
                    assert (got[j][d].untyped_storage().data_ptr()
                            != values[j][d].untyped_storage().data_ptr())
