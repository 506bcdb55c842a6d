"""``fully_shard(..., shard_placement_fn=...)`` returning a RaggedShard: each device keeps
whole blocks of rows (veScale's reason for RaggedShard), embedded and per rank on 2 and 4
processes. The oracle is single-device PyTorch training on the same batches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from mp_harness import run_in_processes
from shardwise import RaggedShard, Shard
from shardwise.errors import DataParallelError
from shardwise.parallel import fully_shard

BLOCK, STEPS, ROWS = 4, 3, 4


def block_sizes(rows: int, devices: int, block: int = BLOCK) -> tuple[int, ...]:
    """Whole blocks of ``block`` rows per device, in order (the last ones may get none)."""
    blocks = [min(block, rows - start) for start in range(0, rows, block)]
    per = -(-len(blocks) // devices)
    return tuple(sum(blocks[k * per:(k + 1) * per]) for k in range(devices))


def aligned(devices: int):
    def fn(param: nn.Parameter) -> RaggedShard:
        return RaggedShard(0, block_sizes(param.shape[0], devices))
    return fn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 10)
        self.down = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def _batches(rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(rows, 6, generator=g), torch.randn(rows, 3, generator=g))
            for _ in range(STEPS)]


def _reference(rows: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    losses = []
    for x, y in _batches(rows):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("n", [3, 4])
def test_ragged_fully_shard_trains_like_one_device(n: int) -> None:
    ref_losses, ref_state = _reference(8)
    mesh = sw.init_device_mesh("cpu", (n,))
    torch.manual_seed(0)
    model = Net()
    fully_shard(model.up, mesh=mesh, shard_placement_fn=aligned(n))
    fully_shard(model, mesh=mesh, shard_placement_fn=aligned(n))
    for name, p in model.named_parameters():
        assert p.placements == (RaggedShard(0, block_sizes(p.shape[0], n)),), name
        starts = [sum(p.placements[0].sizes[:k]) for k in range(n)]
        assert all(s % BLOCK == 0 or s == p.shape[0] for s in starts)  # on a block boundary
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    for step, (x, y) in enumerate(_batches(8)):
        with sw.config.allow_implicit_redistribute():
            loss = F.mse_loss(model(x), sw.distribute_tensor(y, mesh, [Shard(0)]))
            opt.zero_grad()
            loss.backward()
        for p in model.parameters():
            assert p.grad.placements == p.placements
        opt.step()
        assert abs(loss.full_tensor().item() - ref_losses[step]) < 1e-5
    for name, p in model.named_parameters():
        assert p.placements == (RaggedShard(0, block_sizes(p.shape[0], n)),)
        torch.testing.assert_close(p.full_tensor(), ref_state[name], atol=1e-5, rtol=1e-5)
        state = opt.state[p]["exp_avg"]
        assert state.placements == p.placements  # optimizer state sharded alike


def test_ragged_shard_placement_fn_errors_name_the_parameter() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    with pytest.raises(DataParallelError, match=r"'weight' of shape \[10, 6\].*summing to 10"):
        fully_shard(Net(), mesh=mesh, shard_placement_fn=lambda p: RaggedShard(0, (1, 2)))
    with pytest.raises(DataParallelError, match="one entry per device"):
        fully_shard(Net(), mesh=mesh, shard_placement_fn=lambda p: RaggedShard(0, (p.shape[0],)))


def _per_rank_job() -> tuple[list[float], dict[str, torch.Tensor], list]:
    import torch.distributed as dist

    world = dist.get_world_size()
    mesh = sw.init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = Net()
    fully_shard(model, mesh=mesh, shard_placement_fn=aligned(world))
    placements = [tuple(p.placements) for p in model.parameters()]
    rank = dist.get_rank()
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    losses = []
    for x, y in _batches(world * ROWS):
        rows = slice(rank * ROWS, (rank + 1) * ROWS)
        loss = F.mse_loss(model(x[rows]), y[rows])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    local = [tuple(p.to_local().shape) for p in model.parameters()]
    state = {n: p.full_tensor() for n, p in model.named_parameters()}
    return losses, state, [placements, local]


@pytest.mark.parametrize("world", [2, 4])
def test_ragged_fully_shard_per_rank_on_processes(world: int) -> None:
    ref_losses, ref_state = _reference(world * ROWS)
    results = run_in_processes(_per_rank_job, world, timeout=240)
    for step, want in enumerate(ref_losses):
        got = sum(r[0][step] for r in results) / world
        assert abs(got - want) < 1e-5, (step, got, want)
    model = Net()
    for rank, (_, state, (placements, local)) in enumerate(results):
        for (name, p), placed, shape in zip(model.named_parameters(), placements, local,
                                            strict=True):
            sizes = block_sizes(p.shape[0], world)
            assert placed == (RaggedShard(0, sizes),)
            assert shape[0] == sizes[rank]
            torch.testing.assert_close(state[name], ref_state[name], atol=1e-5, rtol=1e-5)
