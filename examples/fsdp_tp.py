"""FSDP x TP: a Llama-style model trained with tensor parallelism inside each data-parallel
replica and fully sharded data parallelism across them, on a 2-D mesh ("dp", "tp").

The same program as with ``torch.distributed.tensor.parallel`` and ``fully_shard``, with
shardwise imports: build the model on the meta device, shard it with a tensor parallel plan
(which materializes each device's shard), wrap every block and the root in ``fully_shard`` on
the "dp" sub-mesh, train. Here it runs on 4 simulated devices in one process and checks every
loss against the same model trained on one device from the same seed;
``python -m shardwise.launch --nproc 4 examples/fsdp_tp.py`` runs it over 4 processes.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise import Replicate, Shard
from shardwise.deferred_init import deferred_init
from shardwise.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    fully_shard,
    parallelize_module,
)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Layer(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.feed_forward(self.norm(x))


class Model(nn.Module):
    def __init__(self, vocab: int = 24, dim: int = 16, hidden: int = 40, layers: int = 2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Layer(dim, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


# PyTorch's fsdp_tp_example plan, with the keys as globs over the layers; module outputs stay
# DTensors (use_local_output=False), so the model code is the single-device code
PLAN = {
    "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                      use_local_output=False),
    "norm": SequenceParallel(),
    "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(),
                              use_local_output=False),
    "layers.*.norm": SequenceParallel(),
    "layers.*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                desired_input_layouts=(Replicate(),)),
    "layers.*.feed_forward.w1": ColwiseParallel(use_local_output=False),
    "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    "layers.*.feed_forward.w3": ColwiseParallel(use_local_output=False),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    args = parser.parse_args(argv)

    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    talk = mesh.owner_of(0) == (dist.get_rank() if dist.is_initialized() else 0)
    reference = Model()
    sw.manual_seed(0)
    model = deferred_init(Model)  # no memory yet
    parallelize_module(model, mesh, PLAN)  # tensor parallel on "tp": each device's shard
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])  # then Shard(0) over "dp", gathered per layer
    fully_shard(model, mesh=mesh["dp"])
    with torch.no_grad():  # each device drew its own shards: one device starts from them
        for ref, p in zip(reference.parameters(), model.parameters(), strict=True):
            ref.copy_(p.full_tensor())

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        tokens = torch.randint(0, 24, (8, 12), generator=g)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        # the global batch as DTensors, sharded over "dp": one meaning in one process and
        # across processes (a plain tensor would be each rank's own batch there)
        dinputs, dtargets = (sw.distribute_tensor(t, mesh, [Shard(0), Replicate()])
                             for t in (inputs, targets))
        logits = model(dinputs)
        loss = F.cross_entropy(logits.flatten(0, 1), dtargets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_loss = F.cross_entropy(reference(inputs).flatten(0, 1), targets.flatten())
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        value = loss.full_tensor().item()
        if talk:
            print(f"step {step}: loss {value:.6f} (one device {ref_loss.item():.6f})")
        if abs(value - ref_loss.item()) > 1e-5:
            raise SystemExit("FSDP x TP training diverged from single-device training")
    if talk:
        print("layers.0.feed_forward.w1.weight:", model.layers[0].feed_forward.w1.weight.placements)


if __name__ == "__main__":
    main()
