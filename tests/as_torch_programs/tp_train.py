"""A per-rank tensor-parallel training program written against PyTorch's own modules only, as
a library's code is: ``python -m shardwise.launch --nproc 2 [--as-torch] tp_train.py OUT``
writes each rank's losses, the loss summed over the mesh as torchtitan's ``dist_sum`` sums it
(``funcol.all_reduce(x, "sum", mesh)``), the clipped gradient norm and the final parameters to
``OUT/rank<r>.json``. ``train(model)`` is the same loop on one device."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

STEPS = 3


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(STEPS)]


def train(model: nn.Module, mesh: object = None) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict = {"losses": [], "dist_sum": [], "grad_norm": []}
    for x, y in batches():
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
        out["grad_norm"].append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
        if mesh is not None:
            out["dist_sum"].append(float(funcol.all_reduce(loss.detach(), "sum", mesh)))
    out["params"] = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().tolist()
        for n, p in model.named_parameters()
    }
    return out


def main(folder: str) -> None:
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),), mesh_dim_names=("tp",))
    model = parallelize_module(build(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    result = train(model, mesh)
    result["dtensor"] = DTensor.__module__
    with open(os.path.join(folder, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
