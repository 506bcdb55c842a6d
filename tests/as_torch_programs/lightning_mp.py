"""Lightning Fabric's ``ModelParallelStrategy``: meta init, a ``parallelize_fn`` applying tensor
parallelism and FSDP2 (``fully_shard``) from PyTorch's modules, and Fabric's distributed
checkpoint (DCP) save and load.

``setup FOLDER`` writes the initial weights and the losses of the same training on one device
(``STEPS + 1`` steps); ``rank FOLDER TAG DP TP`` (one rank of a launch on DP x TP ranks) builds
the model on meta (seeding every rank alike, see ``rank``), lets Fabric parallelize and
materialize it, loads the initial weights with
``fabric.load_raw``, trains ``STEPS`` steps on its data-parallel share of each batch, saves a
sharded checkpoint, loads it into a fresh model and optimizer, checks that every parameter came
back exactly and trains one more step; it writes the losses and that check to
``FOLDER/TAG_rank<r>.json``. Needs lightning (never shardwise's dependency).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn

STEPS = 3
BATCH = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(16, 32), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def parallelize(model: Model, mesh) -> Model:
    """PyTorch's 2-D recipe: TP inside each block on mesh["tensor_parallel"], then FSDP2 over
    mesh["data_parallel"]."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp, dp = mesh["tensor_parallel"], mesh["data_parallel"]
    if tp.size() > 1:
        plan = {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}
        for block in model.blocks:
            parallelize_module(block, tp, plan)
    if dp.size() > 1:
        for block in model.blocks:
            fully_shard(block, mesh=dp)
        fully_shard(model, mesh=dp)
    return model


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g))
            for _ in range(STEPS + 1)]


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01)


def setup(folder: str) -> None:
    torch.manual_seed(0)
    model = Model()
    torch.save(model.state_dict(), os.path.join(folder, "init.pt"))
    opt = optimizer(model.parameters())
    losses = []
    for x, y in batches():
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with open(os.path.join(folder, "reference.json"), "w") as f:
        json.dump({"losses": losses}, f)


def rank(folder: str, tag: str, dp: str, tp: str) -> None:
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(parallelize, data_parallel_size=int(dp),
                                     tensor_parallel_size=int(tp))
    fabric = L.Fabric(accelerator="cpu", devices=int(dp) * int(tp), strategy=strategy)
    fabric.launch()
    # Fabric materializes the meta model with random DTensor ops: shardwise wants the same seed
    # in every rank where torch's DTensor RNG broadcasts rank 0's state (the values are then
    # replaced by load_raw's)
    fabric.seed_everything(0)
    share = BATCH // int(dp)
    dp_rank = fabric.strategy.device_mesh["data_parallel"].get_local_rank()

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        with fabric.init_module(empty_init=True):
            model = Model()
        assert next(model.parameters()).is_meta
        model = fabric.setup(model)
        return model, fabric.setup_optimizers(optimizer(model.parameters()))

    def step(model: nn.Module, opt: torch.optim.Optimizer, x, y) -> float:
        rows = slice(dp_rank * share, (dp_rank + 1) * share)
        loss = nn.functional.mse_loss(model(x[rows]), y[rows])
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        return fabric.all_reduce(loss.detach(), reduce_op="mean").item()

    model, opt = build()
    fabric.load_raw(os.path.join(folder, "init.pt"), model)
    data = batches()
    losses = [step(model, opt, x, y) for x, y in data[:STEPS]]
    ckpt = os.path.join(folder, f"ckpt_{tag}")
    fabric.save(ckpt, {"model": model, "optimizer": opt})
    def full(p: torch.Tensor) -> torch.Tensor:  # plain where no parallelism touched it
        return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()

    saved = {n: full(p).clone() for n, p in model.named_parameters()}
    model, opt = build()
    fabric.load(ckpt, {"model": model, "optimizer": opt})
    exact = all(torch.equal(full(p), saved[n]) for n, p in model.named_parameters())
    losses.append(step(model, opt, *data[STEPS]))
    import torch.distributed.tensor as tensor_module

    out = {"losses": losses, "load_exact": exact, "dtensor": tensor_module.DTensor.__module__,
           "classes": sorted({type(p).__module__ for p in model.parameters()})}
    with open(os.path.join(folder, f"{tag}_rank{fabric.global_rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    {"setup": setup, "rank": rank}[sys.argv[1]](*sys.argv[2:])
