"""loss_parallel: cross entropy on class-sharded logits equals F.cross_entropy, forward and
backward, with and without class weights, without gathering the logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise import Replicate, Shard
from shardwise.parallel import loss_parallel

CASES = [
    ((2,), [Shard(1)]),
    ((3,), [Shard(1)]),
    ((2, 2), [Shard(0), Shard(1)]),  # rows over dim 0 (data parallel), classes over dim 1
    ((2, 2), [Replicate(), Shard(1)]),
    ((2, 2), [Shard(1), Shard(1)]),  # classes over both mesh dims
]


@pytest.mark.parametrize("mesh_shape,placements", CASES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_cross_entropy(mesh_shape, placements, reduction) -> None:
    torch.manual_seed(0)
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    logits = torch.randn(7, 11, requires_grad=True)  # 11 classes: uneven on every mesh
    target = torch.randint(0, 11, (7,))
    target[3] = -100  # ignored row
    expected = F.cross_entropy(logits, target, reduction=reduction)
    grad = torch.randn_like(expected)
    expected.backward(grad)

    dlogits = sw.distribute_tensor(logits.detach(), mesh, placements).requires_grad_()
    with loss_parallel(), sw.debug.CommCounter() as counter:
        loss = F.cross_entropy(dlogits, target, reduction=reduction)
    torch.testing.assert_close(loss.full_tensor(), expected.detach(), atol=1e-6, rtol=1e-5)
    # only per-row values move (all-reduces), never the logits themselves
    assert {r.kind for r in counter.records} <= {"all_reduce"}
    (loss.full_tensor() * grad).sum().backward()
    assert dlogits.grad.placements == dlogits.placements
    torch.testing.assert_close(dlogits.grad.full_tensor(), logits.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mesh_shape,placements", CASES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("given", ["plain", "replicated"])
def test_class_weights_match_cross_entropy(mesh_shape, placements, reduction, given) -> None:
    """PyTorch's weighted loss: each row's loss times weight[target], a mean divided by the
    sum of those weights over the rows not ignored; the weight a plain tensor or a DTensor
    replicated over the mesh."""
    torch.manual_seed(2)
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    logits = torch.randn(7, 11, requires_grad=True)
    target = torch.randint(0, 11, (7,))
    target[3] = -100
    weight = torch.rand(11) + 0.1
    expected = F.cross_entropy(logits, target, weight=weight, reduction=reduction)
    grad = torch.randn_like(expected)
    expected.backward(grad)

    if given == "replicated":
        weight = sw.distribute_tensor(weight, mesh, [Replicate()] * mesh.ndim)
    dlogits = sw.distribute_tensor(logits.detach(), mesh, placements).requires_grad_()
    with loss_parallel(), sw.debug.CommCounter() as counter:
        loss = F.cross_entropy(dlogits, target, weight=weight, reduction=reduction)
    torch.testing.assert_close(loss.full_tensor(), expected.detach(), atol=1e-6, rtol=1e-5)
    assert {r.kind for r in counter.records} <= {"all_reduce"}
    (loss.full_tensor() * grad).sum().backward()
    assert dlogits.grad.placements == dlogits.placements
    torch.testing.assert_close(dlogits.grad.full_tensor(), logits.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_class_weights_on_spatial_logits_as_torchs_test_loss_parallel(reduction) -> None:
    """torch's test_loss_parallel setup: 16 classes over a mesh of 4, (N, C) and (N, C, d)
    logits (nll_loss and nll_loss2d), a plain weight: 3 all-reduces forward (row max, sum of
    exponentials, target logit), none backward, the gradient sharded as the logits."""
    torch.manual_seed(3)
    mesh = sw.init_device_mesh("cpu", (4,))
    weight = torch.rand(16)
    for shape, rows in (((8, 16), (8,)), ((8, 16, 12), (8, 12))):
        logits = torch.rand(*shape, requires_grad=True)
        target = torch.randint(16, rows)
        expected = F.cross_entropy(logits, target, weight, reduction=reduction)
        expected.sum().backward()
        dlogits = sw.distribute_tensor(logits.detach(), mesh, [Shard(1)]).requires_grad_()
        with loss_parallel():
            with sw.debug.CommCounter() as counter:
                loss = F.cross_entropy(dlogits, target, weight, reduction=reduction)
            assert counter.counts == {"all_reduce": 3}
            assert loss.placements == (Replicate(),)
            torch.testing.assert_close(loss.full_tensor(), expected.detach())
            with sw.debug.CommCounter() as counter:
                loss.sum().backward()
            assert not counter.counts
        assert dlogits.grad.placements == (Shard(1),)
        torch.testing.assert_close(dlogits.grad.full_tensor(), logits.grad)


def test_weighted_mean_of_only_ignored_rows_is_nan_as_torchs() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    logits, target, weight = torch.randn(3, 4), torch.full((3,), -100), torch.rand(4)
    assert F.cross_entropy(logits, target, weight=weight).isnan()  # 0 / 0
    with loss_parallel():
        loss = F.cross_entropy(sw.distribute_tensor(logits, mesh, [Shard(1)]), target,
                               weight=weight)
    assert loss.full_tensor().isnan()


def test_weights_torch_refuses_are_refused_by_name() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    x, t = torch.randn(4, 6), torch.randint(0, 6, (4,))
    dx = sw.distribute_tensor(x, mesh, [Shard(1)])
    bad = {
        r"shape \[5\].*each of the 6 classes": torch.rand(5),
        "dtype torch.float64.*logits' dtype torch.float32": torch.rand(6, dtype=torch.float64),
        "not differentiable in its weight": torch.rand(6, requires_grad=True),
    }
    with loss_parallel():
        for message, weight in bad.items():
            with pytest.raises(RuntimeError):  # as single-device torch
                F.cross_entropy(x, t, weight=weight)
            with pytest.raises(sw.errors.OpArgumentError, match=message):
                F.cross_entropy(dx, t, weight=weight)
        sharded = sw.distribute_tensor(torch.rand(6), mesh, [Shard(0)])
        with pytest.raises(sw.errors.InvalidPlacementError, match="must be replicated"):
            F.cross_entropy(dx, t, weight=sharded)


def test_communication_does_not_grow_with_the_vocabulary() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    target = torch.randint(0, 10, (6,))
    moved = []
    for vocab in (10, 1000):
        logits = sw.distribute_tensor(torch.randn(6, vocab), mesh, [Shard(0), Shard(1)])
        with loss_parallel(), sw.debug.CommCounter() as counter:
            F.cross_entropy(logits, target)
        moved.append(counter.total_bytes)
    assert moved[0] == moved[1] > 0


def test_spatial_logits_and_dtensor_target() -> None:
    torch.manual_seed(1)
    mesh = sw.init_device_mesh("cpu", (3,))
    logits = torch.randn(2, 5, 4, requires_grad=True)  # (N, C, d): classes on dim 1
    target = torch.randint(0, 5, (2, 4))
    expected = F.cross_entropy(logits, target, ignore_index=2)
    expected.backward()
    dlogits = sw.distribute_tensor(logits.detach(), mesh, [Shard(1)]).requires_grad_()
    dtarget = sw.distribute_tensor(target, mesh, [Shard(0)])  # moved to the rows' placement
    with loss_parallel():
        loss = F.cross_entropy(dlogits, dtarget, ignore_index=2)
    loss.backward()
    torch.testing.assert_close(loss.full_tensor(), expected.detach())
    torch.testing.assert_close(dlogits.grad.full_tensor(), logits.grad)


def test_other_calls_are_unchanged_and_unsupported_options_raise() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    x, t = torch.randn(4, 6), torch.randint(0, 6, (4,))
    with loss_parallel():
        torch.testing.assert_close(F.cross_entropy(x, t), F.cross_entropy(x, t))
        dx = sw.distribute_tensor(x, mesh, [Shard(1)])
        with pytest.raises(sw.errors.UnsupportedOpError, match="label smoothing"):
            F.cross_entropy(dx, t, label_smoothing=0.1)
        mesh22 = sw.init_device_mesh("cpu", (2, 2))
        pending = sw.distribute_tensor(x, mesh22, [sw.Partial(), Shard(1)])
        with pytest.raises(sw.errors.InvalidPlacementError, match="Partial"):
            F.cross_entropy(pending, t)


def test_logits_not_sharded_on_the_class_dim_with_plain_labels_name_loss_parallel() -> None:
    # PyTorch's loss_parallel raises a ValueError naming itself there (its test_tp_examples)
    mesh = sw.init_device_mesh("cpu", (2,))
    x, t = torch.randn(4, 6), torch.randint(0, 6, (4,))
    with loss_parallel():
        for placements in ([Shard(0)], [sw.Replicate()]):
            dx = sw.distribute_tensor(x, mesh, placements)
            with pytest.raises(ValueError, match=r"loss_parallel\(\).*class dim 1"):
                F.cross_entropy(dx, t)
        with sw.config.implicit_replication():  # plain labels taken as replicated: as before
            dx = sw.distribute_tensor(x, mesh, [Shard(0)])
            torch.testing.assert_close(F.cross_entropy(dx, t).full_tensor(), F.cross_entropy(x, t))
