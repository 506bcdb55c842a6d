"""Pooling, interpolation, grid sampling and pixel shuffles on DTensors against single-device
torch, forward and backward, on even and uneven meshes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from op_oracle import run_oracle
from shardwise import Shard
from shardwise.debug import CommCounter

MESHES = [(2,), (3,), (2, 2)]


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


CASES = [
    ("max_pool2d", lambda x: F.max_pool2d(x, 2), (3, 4, 6, 6)),
    ("max_pool1d_indices", lambda x: F.max_pool1d(x, 3, 2, return_indices=True), (5, 3, 9)),
    ("max_pool3d", lambda x: F.max_pool3d(x, 2), (2, 3, 4, 4, 4)),
    ("avg_pool2d", lambda x: F.avg_pool2d(x, 3, 2, padding=1), (3, 4, 6, 6)),
    ("adaptive_avg_pool2d", lambda x: F.adaptive_avg_pool2d(x, (2, 3)), (3, 5, 6, 7)),
    ("adaptive_max_pool1d", lambda x: F.adaptive_max_pool1d(x, 4), (5, 3, 9)),
    ("interpolate_bilinear",
     lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), (3, 4, 3, 5)),
    ("interpolate_nearest", lambda x: F.interpolate(x, size=7), (5, 3, 4)),
    ("interpolate_bicubic", lambda x: F.interpolate(x, size=(5, 4), mode="bicubic"),
     (3, 2, 3, 3)),
    ("pixel_shuffle", lambda x: F.pixel_shuffle(x, 2), (3, 8, 2, 3)),
    ("pixel_unshuffle", lambda x: F.pixel_unshuffle(x, 2), (3, 2, 4, 6)),
    ("channel_shuffle", lambda x: F.channel_shuffle(x, 2), (3, 4, 5)),
]


@pytest.mark.parametrize("name,fn,shape", CASES, ids=[c[0] for c in CASES])
def test_spatial_op_oracle(name, fn, shape) -> None:
    assert run_oracle(fn, [randn(*shape)], mesh_shapes=MESHES, max_cases=3) > 0


def test_grid_sample_oracle() -> None:
    x, grid = randn(3, 4, 5, 5), randn(3, 2, 3, 2, seed=1).tanh()
    run_oracle(lambda x, g: F.grid_sample(x, g, align_corners=False), [x, grid],
               mesh_shapes=MESHES, max_cases=4)


def test_fractional_max_pool_oracle() -> None:
    x = randn(4, 3, 7, 7)
    samples = torch.rand(4, 3, 2, generator=torch.Generator().manual_seed(3))

    def fn(x, s):
        return F.fractional_max_pool2d(x, 2, output_size=3, _random_samples=s)

    run_oracle(fn, [x, samples], mesh_shapes=MESHES, max_cases=4, grad=False)


def test_batch_sharded_pooling_is_local() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    x = randn(4, 3, 6, 6)
    dx = sw.distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
    with CommCounter() as counter:
        out = F.max_pool2d(dx, 2)
        out.backward(sw.distribute_tensor(torch.ones(4, 3, 3, 3), mesh, [Shard(0)]))
    assert out.placements == (Shard(0),) and dx.grad.placements == (Shard(0),)
    assert not counter.records
