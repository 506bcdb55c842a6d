"""Batch, instance and group norm on DTensors against single-device torch, forward and backward:
a batch-sharded batch norm uses the global statistics (SyncBatchNorm's result), and a small CNN
(Conv2d + BatchNorm2d + MaxPool2d + Linear) trains on a batch-sharded mesh exactly like on one
device, running statistics included."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from op_oracle import check_op, run_oracle
from shardwise import Replicate, Shard
from shardwise.debug import CommCounter

MESHES = [(2,), (3,), (2, 2)]


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_batch_norm_training_oracle() -> None:
    x, w, b = randn(5, 4, 3, 2), randn(4, seed=1), randn(4, seed=2)

    def fn(x, w, b):
        return F.batch_norm(x, None, None, w, b, training=True)

    assert run_oracle(fn, [x, w, b], mesh_shapes=MESHES, max_cases=4) > 0


def test_batch_norm_eval_and_instance_norm_oracle() -> None:
    x, rm, rv = randn(6, 3, 4), randn(3, seed=1), randn(3, seed=2).abs() + 0.5

    def eval_fn(x):  # running statistics: plain tensors every rank holds whole
        with sw.config.implicit_replication():
            return F.batch_norm(x, rm, rv, training=False)

    run_oracle(eval_fn, [x], mesh_shapes=MESHES, max_cases=4)
    run_oracle(F.instance_norm, [x], mesh_shapes=MESHES, max_cases=4)


def test_batch_sharded_batch_norm_all_reduces_only_statistics() -> None:
    """Forward: two all-reduces of C values (mean, variance), no activation moves."""
    mesh = sw.init_device_mesh("cpu", (2,))
    x = randn(8, 4, 5, 5)
    dx = sw.distribute_tensor(x, mesh, [Shard(0)])
    with CommCounter() as counter:
        out = F.batch_norm(dx, None, None, training=True)
    assert out.placements == (Shard(0),)
    torch.testing.assert_close(out.full_tensor(), F.batch_norm(x, None, None, training=True))
    assert [c.kind for c in counter.records] == ["all_reduce", "all_reduce"]
    assert all(c.bytes <= 4 * x.element_size() * 2 for c in counter.records)


def test_group_norm_oracle() -> None:
    x, w, b = randn(5, 4, 3), randn(4, seed=1), randn(4, seed=2)

    def fn(x, w, b):
        return F.group_norm(x, 2, w, b)

    run_oracle(fn, [x, w, b], mesh_shapes=MESHES, max_cases=4)


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(F.relu(self.bn(self.conv(x)))).flatten(1))


def _replicate_module(module: nn.Module, mesh: sw.DeviceMesh) -> None:
    rep = [Replicate()] * mesh.ndim
    for child in module.modules():
        for name, p in list(child.named_parameters(recurse=False)):
            setattr(child, name, nn.Parameter(sw.distribute_tensor(p.detach(), mesh, rep)))
        for name, buf in list(child.named_buffers(recurse=False)):
            child.register_buffer(name, sw.distribute_tensor(buf, mesh, rep))


@pytest.mark.parametrize(
    "mesh_shape,placements",
    [((2,), [Shard(0)]), ((2, 2), [Shard(0), Shard(0)])],
)
def test_cnn_trains_like_single_device(mesh_shape, placements) -> None:
    torch.manual_seed(0)
    reference = CNN()
    sharded = copy.deepcopy(reference)
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    _replicate_module(sharded, mesh)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(sharded.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 5, (8,), generator=g)
        ref_loss = F.cross_entropy(reference(x), y)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        dx, dy = (sw.distribute_tensor(t, mesh, placements) for t in (x, y))
        with sw.config.allow_implicit_redistribute():
            loss = F.cross_entropy(sharded(dx), dy)
            opt.zero_grad()
            loss.backward()
            opt.step()
        torch.testing.assert_close(loss.full_tensor(), ref_loss.detach(), atol=1e-5, rtol=1e-4)
        for (name, p), ref in zip(sharded.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.full_tensor(), ref.detach(), atol=1e-5, rtol=1e-4,
                                       msg=f"{name} at step {step}")
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(sharded.bn, name).full_tensor(),
                                   getattr(reference.bn, name), msg=name)
    sharded.eval()
    reference.eval()
    x = torch.randn(4, 3, 8, 8)
    with sw.config.allow_implicit_redistribute():
        out = sharded(sw.distribute_tensor(x, mesh, placements))
    torch.testing.assert_close(out.full_tensor(), reference(x), atol=1e-5, rtol=1e-4)


def test_channel_sharded_batch_norm_is_local() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    x, w = randn(4, 6, 3), randn(6, seed=1)
    check_op(lambda x, w: F.batch_norm(x, None, None, w, training=True), [x, w], (2,),
             [(Shard(1),), (Shard(0),)])
    dx = sw.distribute_tensor(x, mesh, [Shard(1)])
    dw = sw.distribute_tensor(w, mesh, [Shard(0)])
    with CommCounter() as counter:
        out = F.batch_norm(dx, None, None, dw, training=True)
    assert out.placements == (Shard(1),) and not counter.records
    running = sw.distribute_tensor(torch.zeros(6), mesh, [Replicate()])
    F.batch_norm(dx, running, None, dw, training=True, momentum=0.5)  # gathers the 6 means
    torch.testing.assert_close(running.full_tensor(), 0.5 * x.mean(dim=(0, 2)))
