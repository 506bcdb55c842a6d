"""Convolutions (1-d to 3-d, transposed, grouped) on DTensors against single-device torch,
forward and backward: batch-sharded inputs give batch-sharded outputs, input-channel-sharded
ones Partial outputs, output-channel-sharded weights channel-sharded outputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from op_oracle import check_op, run_oracle
from shardwise import Partial, Replicate, Shard
from shardwise.debug import CommCounter

MESHES = [(2,), (3,), (2, 2)]


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


CASES = [
    ("conv1d", lambda x, w, b: F.conv1d(x, w, b, padding=1), (5, 4, 7), (6, 4, 3)),
    ("conv2d", lambda x, w, b: F.conv2d(x, w, b, stride=2), (3, 4, 5, 5), (5, 4, 3, 3)),
    ("conv3d", lambda x, w, b: F.conv3d(x, w, b), (2, 4, 3, 3, 3), (3, 4, 2, 2, 2)),
    ("conv_transpose2d", lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2),
     (3, 4, 3, 3), (4, 5, 2, 2)),
    ("grouped", lambda x, w, b: F.conv2d(x, w, b, groups=2), (3, 4, 4, 4), (6, 2, 3, 3)),
]


@pytest.mark.parametrize("name,fn,x_shape,w_shape", CASES, ids=[c[0] for c in CASES])
def test_convolution_oracle(name, fn, x_shape, w_shape) -> None:
    transposed = name.startswith("conv_transpose")
    out_channels = w_shape[1] if transposed else w_shape[0]
    x, w, b = randn(*x_shape), randn(*w_shape, seed=1), randn(out_channels, seed=2)
    assert run_oracle(fn, [x, w, b], mesh_shapes=MESHES, max_cases=3) > 0


@pytest.mark.parametrize(
    "placements,expected",
    [
        ([(Shard(0),), (Replicate(),), (Replicate(),)], Shard(0)),
        ([(Replicate(),), (Shard(0),), (Shard(0),)], Shard(1)),
        ([(Shard(1),), (Shard(1),), (Replicate(),)], Partial()),
    ],
)
def test_convolution_output_placements_need_no_communication(placements, expected) -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    x, w, b = randn(4, 6, 5, 5), randn(8, 6, 3, 3, seed=1), randn(8, seed=2)
    d = [sw.distribute_tensor(t, mesh, p) for t, p in zip((x, w, b), placements, strict=True)]
    with CommCounter() as counter:
        out = F.conv2d(*d)
    assert out.placements == (expected,) and not counter.records
    torch.testing.assert_close(out.full_tensor(), F.conv2d(x, w, b), atol=1e-5, rtol=1e-4)
    check_op(F.conv2d, [x, w, b], (2,), placements)


def test_convolution_without_bias_and_uneven_channels() -> None:
    x, w = randn(3, 5, 6), randn(7, 5, 3, seed=1)
    run_oracle(F.conv1d, [x, w], mesh_shapes=[(3,), (2, 2)], max_cases=3)
