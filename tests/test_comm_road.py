"""The one road for bytes (``redistribute.move``): the collectives the parallel layer runs
itself (fully_shard's packed gather and gradient reduce-scatter, replicate's gradient bucket)
are checked by ``comm_budget`` before they move anything, named in the error, and counted by
``CommCounter`` / ``CommDebugMode`` like the planner's moves.

Expected bytes are worked out here from the parameter sizes under the ring model (bytes every
device receives, summed over the devices of this process), never read back from shardwise."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise import Shard
from shardwise.debug import CommDebugMode
from shardwise.errors import CommBudgetExceededError
from shardwise.parallel import fully_shard, replicate

N = 4
FLOAT = 4


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 8)
        self.down = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def _ring_all_reduce(numel: int, n: int) -> int:
    """Bytes the n devices receive in all in a ring all-reduce of ``numel`` floats."""
    chunk = -(-numel // n)
    return sum(2 * (numel - max(0, min(chunk, numel - k * chunk))) * FLOAT for k in range(n))


def _packed_gather_bytes(model: nn.Module, n: int) -> int:
    """fully_shard's one packed all-gather of a module's parameters sharded on dim 0 (rows
    divide evenly here): every device receives the n - 1 pieces it lacks."""
    piece = sum(p.numel() // n for p in model.parameters())
    return n * (n - 1) * piece * FLOAT


def test_fully_shard_gather_over_the_budget_raises_before_moving() -> None:
    torch.manual_seed(0)
    mesh = sw.init_device_mesh("cpu", (N,))
    model = fully_shard(MLP(), mesh=mesh)
    gather = _packed_gather_bytes(MLP(), N)
    x, _ = _data()
    with sw.debug.CommCounter() as counter, sw.debug.comm_budget(bytes=gather - 1) as budget:
        with pytest.raises(CommBudgetExceededError, match="would exceed") as info:
            model(x)
    message = str(info.value)
    assert "fully_shard's packed gather" in message and "nothing was moved" in message
    assert f"{gather} bytes" in message
    assert counter.total_bytes == 0 and budget.used == 0  # checked ahead: nothing ran


def test_fully_shard_step_is_charged_and_counted_within_the_budget() -> None:
    torch.manual_seed(0)
    ref = MLP()
    mesh = sw.init_device_mesh("cpu", (N,))
    model = fully_shard(copy.deepcopy(ref), mesh=mesh, reshard_after_forward=False)
    x, _ = _data()
    gather = _packed_gather_bytes(ref, N)
    # the gradient reduce-scatter: every device receives a partial of each of the n - 1
    # pieces it does not keep
    reduce_scatter = gather
    with sw.debug.comm_budget(bytes=gather + reduce_scatter) as budget, CommDebugMode() as debug:
        model(x).pow(2).sum().backward()
    counts = debug.get_comm_counts()
    assert counts["all_gather"] == 1 and counts["reduce_scatter"] == 1
    assert budget.used == debug.total_bytes == gather + reduce_scatter
    ref(x).pow(2).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad)


def test_fully_shard_gradient_reduce_scatter_over_per_op_raises_before_moving() -> None:
    torch.manual_seed(0)
    mesh = sw.init_device_mesh("cpu", (N,))
    model = fully_shard(MLP(), mesh=mesh, reshard_after_forward=False)
    x, _ = _data()
    loss = model(x).pow(2).sum()  # the gather ran outside the budget
    params = [p.detach().full_tensor().clone() for p in model.parameters()]
    with sw.debug.CommCounter() as counter, sw.debug.comm_budget(per_op=1):
        with pytest.raises(CommBudgetExceededError, match="fully_shard's packed gradient"):
            loss.backward()
    assert counter.counts["reduce_scatter"] == 0
    for p, before in zip(model.parameters(), params, strict=True):
        torch.testing.assert_close(p.detach().full_tensor(), before)


def test_replicate_bucket_over_the_budget_raises_before_moving() -> None:
    torch.manual_seed(0)
    mesh = sw.init_device_mesh("cpu", (N,), mesh_dim_names=("dp",))
    model = replicate(MLP(), mesh)
    x, y = _data()
    bucket = _ring_all_reduce(sum(p.numel() for p in MLP().parameters()), N)
    target = sw.distribute_tensor(y, mesh, [Shard(0)])
    loss = F.mse_loss(model(x), target)
    with sw.debug.CommCounter() as counter, sw.debug.comm_budget(per_dim={"dp": bucket - 1}):
        with pytest.raises(CommBudgetExceededError, match="replicate's gradient bucket") as info:
            loss.backward()
    assert "nothing was moved" in str(info.value) and f"{bucket} bytes" in str(info.value)
    assert counter.counts["all_reduce"] == 0


def test_replicate_bucket_is_charged_and_counted_within_the_budget() -> None:
    torch.manual_seed(0)
    ref = MLP()
    mesh = sw.init_device_mesh("cpu", (N,), mesh_dim_names=("dp",))
    model = replicate(copy.deepcopy(ref), mesh)
    x, y = _data()
    bucket = _ring_all_reduce(sum(p.numel() for p in ref.parameters()), N)
    target = sw.distribute_tensor(y, mesh, [Shard(0)])
    with (
        sw.debug.comm_budget(bytes=bucket, per_dim={0: bucket}) as budget,
        CommDebugMode() as debug,
    ):
        F.mse_loss(model(x), target).backward()
    assert debug.get_comm_counts()["all_reduce"] == 1
    assert budget.used == budget.used_per_dim[0] == debug.total_bytes == bucket
    F.mse_loss(ref(x), y).backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad)
