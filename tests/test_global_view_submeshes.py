"""PyTorch's 2-D recipe, ``parallelize_module(model, mesh["tp"], plan)`` then
``fully_shard(block, mesh=mesh["dp"])``, runs unchanged in one process (the embedded global
view, where a sub-mesh stands for its dim of the whole mesh) and per rank (4 rank threads),
with the losses and final parameters of single-device PyTorch."""

from __future__ import annotations

import torch
from torch import nn

import shardwise as sw
from shardwise.parallel import ColwiseParallel, RowwiseParallel, fully_shard, parallelize_module
from shardwise.rank_threads import run_threads

STEPS, ROWS = 3, 8
PLAN = {f"{i}.{name}": style for i in range(2)
        for name, style in (("0", ColwiseParallel()), ("2", RowwiseParallel()))}


def _build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
                           for _ in range(2)))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(ROWS, 8, generator=g), torch.randn(ROWS, 8, generator=g))
            for _ in range(STEPS)]


def _train(model: nn.Module, rows: slice = slice(None)) -> tuple[list[float], dict]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in _batches():
        out = model(x[rows])
        out = out.full_tensor() if isinstance(out, sw.DTensor) else out
        loss = nn.functional.mse_loss(out, y[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: (p.full_tensor() if isinstance(p, sw.DTensor) else p).detach().clone()
              for n, p in model.named_parameters()}
    return losses, params


def _recipe() -> tuple[list[float], dict]:
    """The recipe as PyTorch writes it; per rank, each dp rank trains on its rows."""
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(_build(), mesh["tp"], PLAN)
    for block in model:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    per_rank = mesh.num_local_devices() == 1
    half = ROWS // 2
    dp = mesh.get_local_rank("dp")
    return _train(model, slice(dp * half, (dp + 1) * half) if per_rank else slice(None))


def test_the_2d_recipe_runs_embedded_and_per_rank_as_on_one_device() -> None:
    ref_losses, ref_params = _train(_build())
    losses, params = _recipe()  # one process, four devices: the global view
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6)
    ranks = run_threads(_recipe, 4, timeout=240)
    for step, expected in enumerate(ref_losses):  # each dp rank's loss is its rows' mean
        by_dp = {r: ranks[r][0][step] for r in (0, 2)}
        assert abs(sum(by_dp.values()) / 2 - expected) <= 1e-5 * abs(expected)
    for r in range(4):
        for name, value in ref_params.items():
            torch.testing.assert_close(ranks[r][1][name], value, rtol=1e-5, atol=1e-6)
