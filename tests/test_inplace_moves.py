"""In-place ops whose written arguments must move first (a pending sum reduced before ``exp_``)
write every one of them: each element of a foreach op's first list and a fused optimizer's
states, not only the first argument."""

from __future__ import annotations

import torch

import shardwise as sw
from shardwise import Partial, Replicate, Shard


def _pending(mesh: sw.DeviceMesh, left: torch.Tensor, right: torch.Tensor) -> sw.DTensor:
    """``left @ right`` left pending a sum over the mesh (contraction dim sharded)."""
    out = sw.distribute_tensor(left, mesh, [Shard(1)]) @ sw.distribute_tensor(
        right, mesh, [Shard(0)]
    )
    assert out.placements == (Partial(),)
    return out


def test_foreach_inplace_writes_every_moved_element() -> None:
    torch.manual_seed(0)
    mesh = sw.init_device_mesh("cpu", (4,))
    pairs = [(torch.randn(3, 8), torch.randn(8, 5)) for _ in range(3)]
    xs = [_pending(mesh, a, b) for a, b in pairs]
    with sw.config.allow_implicit_redistribute():
        torch._foreach_exp_(xs)
    for x, (a, b) in zip(xs, pairs, strict=True):
        torch.testing.assert_close(x.full_tensor(), torch.exp(a @ b), rtol=1e-5, atol=1e-5)


def test_foreach_inplace_with_a_second_list_moves_every_self() -> None:
    torch.manual_seed(1)
    mesh = sw.init_device_mesh("cpu", (4,))
    pairs = [(torch.randn(4, 8), torch.randn(8, 4)) for _ in range(2)]
    others = [torch.randn(4, 4) for _ in range(2)]
    xs = [_pending(mesh, a, b) for a, b in pairs]
    ys = [sw.distribute_tensor(o, mesh, [Replicate()]) for o in others]
    with sw.config.allow_implicit_redistribute():
        torch._foreach_maximum_(xs, ys)
    for x, (a, b), o in zip(xs, pairs, others, strict=True):
        torch.testing.assert_close(x.full_tensor(), torch.maximum(a @ b, o))


def test_written_arguments_follow_the_schema() -> None:
    from shardwise.dispatch import _written_arguments

    aten = torch.ops.aten
    assert _written_arguments(aten.add_.Tensor) == {0, "self"}
    assert _written_arguments(aten.add.Tensor) == frozenset()
    fused = _written_arguments(aten._fused_adam_.default)
    assert {"self", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"} <= fused
    assert "state_steps" not in fused  # read only: the step counts are bumped apart
