"""Issue 20, "One process": deepcopy, bounded caches, loss_parallel labels, clear errors."""

from __future__ import annotations

import copy

import torch

from shardwise import DeviceMesh, Replicate, Shard, distribute_tensor
from shardwise.parallel import ColwiseParallel, RowwiseParallel, fully_shard, parallelize_module

# ----- deepcopy with several local devices ------------------------------------------------------


def test_deepcopy_dtensor_several_local_devices() -> None:
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    x = torch.randn(8, 6)
    d = distribute_tensor(x, mesh, [Shard(0), Replicate()]).requires_grad_()
    e = copy.deepcopy(d)
    assert e.placements == d.placements and e.device_mesh is d.device_mesh
    assert e.requires_grad and e.is_leaf
    assert torch.equal(e.full_tensor(), x)
    with torch.no_grad():
        e.mul_(2)  # independent of the original
    assert torch.equal(d.full_tensor(), x)
    assert torch.equal(e.full_tensor(), x * 2)
    # a shared DTensor stays shared inside one deepcopy (memo), as for torch tensors
    a, b = copy.deepcopy([d, d])
    assert a is b


def test_deepcopy_parallelized_module_matches_torch() -> None:
    torch.manual_seed(0)
    mesh = DeviceMesh("cpu", [0, 1, 2, 3])
    ref = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 6))
    model = parallelize_module(
        copy.deepcopy(ref), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()}
    )
    clone = copy.deepcopy(model)
    x = torch.randn(5, 6)
    torch.testing.assert_close(clone(x), ref(x))
    for p, q in zip(clone.parameters(), model.parameters(), strict=True):
        assert isinstance(p, torch.nn.Parameter) or getattr(p, "_is_param", False)
        assert p.placements == q.placements
    with torch.no_grad():
        next(clone.parameters()).zero_()
    torch.testing.assert_close(model(x), ref(x))  # the original is untouched


def test_deepcopy_fully_sharded_module() -> None:
    torch.manual_seed(0)
    mesh = DeviceMesh("cpu", [0, 1, 2, 3])
    ref = torch.nn.Linear(8, 4)
    model = fully_shard(copy.deepcopy(ref), mesh=mesh)
    clone = copy.deepcopy(model)
    for p, q in zip(clone.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q)
    x = torch.randn(4, 8)
    out = clone(x)  # a plain batch in one process with 4 devices is global data, split on dim 0
    torch.testing.assert_close(out.full_tensor(), ref(x))
    torch.testing.assert_close(out.full_tensor(), model(x).full_tensor())
