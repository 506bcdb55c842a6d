"""Sequence parallelism on a residual MLP block, written as a PyTorch user writes it.

One rank of ``torchrun --nproc-per-node N sequence_parallel.py`` (or ``python -m shardwise.launch
--nproc N``; N divides 40). Each rank holds its own rows (tokens) of the batch, drawn from its
own generator. The LayerNorm runs on them where they are (``SequenceParallel``), the first linear
layer gathers them and splits its output features (``ColwiseParallel`` from ``Shard(0)``), the
second reduce-scatters its output back to the rows (``RowwiseParallel`` to ``Shard(0)``), and
the residual adds the rank's own rows. Each rank's loss is over its rows; AdamW steps the
shards.

Only the public API of PyTorch's DTensor and its parallel styles; ``port.py`` turns this into the
shardwise program by rewriting the imports. CPU and gloo.
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

STEPS, ROWS, FEATURES, HIDDEN, LR = 10, 6, 10, 40, 0.05


class ResidualMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(FEATURES)
        self.up = nn.Linear(FEATURES, HIDDEN)
        self.down = nn.Linear(HIDDEN, FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def main() -> None:
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),), mesh_dim_names=("sp",))
    model = parallelize_module(ResidualMLP(), mesh, {
        "norm": SequenceParallel(sequence_dim=0),
        "up": ColwiseParallel(input_layouts=Shard(0)),
        "down": RowwiseParallel(output_layouts=Shard(0)),
    })
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        x = torch.randn(ROWS, FEATURES)
        target = x.flip(-1)
        optimizer.zero_grad()
        loss = (model(x) - target).pow(2).mean()
        loss.backward()
        optimizer.step()
        if dist.get_rank() == 0:
            print(f"step {step}: rank 0's loss {loss.item():.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
