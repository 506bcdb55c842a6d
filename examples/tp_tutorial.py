"""PyTorch's tensor parallel tutorial, ported to shardwise by changing imports.

The tutorial trains a Llama-style transformer with tensor parallel linears, sequence parallel
norms and a vocabulary-parallel loss. Where it imports

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, ...

this file imports the same names from ``shardwise`` and ``shardwise.parallel``; the model, the
plan and the training loop are written as a PyTorch user writes them. The same model trains on
one device beside it, from the same seed, and the losses are compared step by step.

    python examples/tp_tutorial.py                      # 4 simulated devices, one process
    python -m shardwise.launch --nproc 2 examples/tp_tutorial.py --tp 2   # a device per process

With several devices in one process a sharded "local output" would be one of several shards,
so ``use_local_output`` keeps the DTensor there (a Replicate output is the global value, a plain
tensor, as every device holds it); attention reshapes with ``-1`` heads, which
reads the global head count from a DTensor and the local one from a local tensor (the
tutorial's ``n_heads // tp`` adjustment is then not needed).
"""

from __future__ import annotations

import argparse
import copy
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardwise import Replicate, Shard, init_device_mesh
from shardwise.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)


@dataclass
class ModelArgs:
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    hidden_dim: int = 64
    vocab_size: int = 61


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x)), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def parallelize(model: Transformer, tp_mesh) -> Transformer:  # noqa: ANN001
    """The tutorial's plan: vocabulary-parallel embedding, TP + SP blocks, loss-parallel head."""
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
        },
    )
    for block in model.layers:
        layer_plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        parallelize_module(block, tp_mesh, layer_plan)
    return model


def batch(step: int, args: ModelArgs, size: int = 4, seqlen: int = 12) -> torch.Tensor:
    """A learnable synthetic task: each sequence counts up by a fixed stride from a random start."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, args.vocab_size, (size, 1), generator=g)
    stride = torch.randint(1, 4, (size, 1), generator=g)
    return (start + stride * torch.arange(seqlen + 1)) % args.vocab_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps")
    parser.add_argument("--tp", type=int, default=4, help="tensor-parallel devices")
    opts = parser.parse_args(argv)

    torch.manual_seed(0)
    args = ModelArgs()
    model = Transformer(args)
    reference = copy.deepcopy(model)  # trained on one device beside the sharded model
    tp_mesh = init_device_mesh("cpu", (opts.tp,), mesh_dim_names=("tp",))
    parallelize(model, tp_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=True)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3, foreach=True)

    worst = 0.0
    say = print if tp_mesh.get_coordinate() == (0,) else (lambda *_: None)  # one process prints
    say(f"{'step':>4}  {'loss (tp)':>10}  {'loss (1 dev)':>12}  {'diff':>8}")
    for step in range(opts.steps):
        seq = batch(step, args)
        inputs, labels = seq[:, :-1], seq[:, 1:]

        with loss_parallel():
            pred = model(inputs)
            loss = F.cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1))
            loss.backward()
        opt.step()
        opt.zero_grad()

        ref_loss = F.cross_entropy(reference(inputs).flatten(0, 1), labels.flatten(0, 1))
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()

        value, expected = loss.full_tensor().item(), ref_loss.item()
        worst = max(worst, abs(value - expected))
        say(f"{step:>4}  {value:>10.5f}  {expected:>12.5f}  {abs(value - expected):>8.1e}")
    say(f"largest difference {worst:.1e}")
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
