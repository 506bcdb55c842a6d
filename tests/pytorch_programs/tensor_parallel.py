"""Tensor parallelism on a two-layer MLP, written as a PyTorch user writes it.

One rank of ``torchrun --nproc-per-node N tensor_parallel.py`` (or ``python -m shardwise.launch
--nproc N``; N divides 48). The first linear layer is split by its output features
(``ColwiseParallel``) and the second by its input features (``RowwiseParallel``): the hidden
activations stay sharded and one all-reduce ends the forward (Megatron-LM's split). Every rank
feeds the same batch, drawn after seeding with the step number as the tensor-parallel group's
shared data loader would, learns a sine of its first features, and steps AdamW on its shards.
The initial weights are whatever the rank's generator gives: ``parallelize_module`` distributes
rank 0's.

Only the public API of PyTorch's DTensor and its parallel styles; ``port.py`` turns this into the
shardwise program by rewriting the imports. CPU and gloo.
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

STEPS, BATCH, FEATURES, HIDDEN, OUTPUTS, LR = 10, 16, 12, 48, 6, 0.05


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(FEATURES, HIDDEN)
        self.down = nn.Linear(HIDDEN, OUTPUTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def main() -> None:
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),), mesh_dim_names=("tp",))
    model = parallelize_module(MLP(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        torch.manual_seed(step)
        x = torch.randn(BATCH, FEATURES)
        target = x[:, :OUTPUTS].sin()  # something to learn
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
