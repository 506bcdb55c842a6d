"""A veScale-style sharding plan on a nanoGPT-like model: regular expressions over parameter
and module names say how every parameter is placed and how every module's inputs and outputs
are laid out, in veScale's own format (``{"parameter": ..., "forward": ...}``).

The plan below is Megatron tensor parallelism with sequence parallel residuals, written the way
veScale's nanoGPT example writes it; ``shardwise.parallel.parallelize_module`` runs it
unchanged. The same model trains on one device beside it and the losses are compared.

    python examples/vescale_plan.py --steps 20 --tp 4
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise import Replicate, Shard
from shardwise.parallel import parallelize_module

VOCAB, BLOCK, DIM, HEADS, LAYERS = 64, 16, 32, 4, 2


class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(DIM, DIM)
        self.k_proj = nn.Linear(DIM, DIM, bias=False)
        self.v_proj = nn.Linear(DIM, DIM)
        self.c_proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, HEADS, c // HEADS).transpose(1, 2)

        y = F.scaled_dot_product_attention(
            heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)), is_causal=True
        )
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc = nn.Linear(DIM, 4 * DIM)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(DIM)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(DIM)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(VOCAB, DIM),
                "wpe": nn.Embedding(BLOCK, DIM),
                "h": nn.ModuleList(Block() for _ in range(LAYERS)),
                "ln_f": nn.LayerNorm(DIM),
            }
        )
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT

    def forward(self, idx: torch.Tensor, pos: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


# veScale's format: parameter placements and forward layouts by regular expression
param_plan = {
    r"transformer.wte.weight": [Shard(1)],
    r"transformer.wpe.weight": [Shard(1)],
    r"transformer.h.\d+.attn.q_proj.weight": [Shard(0)],
    r"transformer.h.\d+.attn.q_proj.bias": [Shard(0)],
    r"transformer.h.\d+.attn.k_proj.weight": [Shard(0)],
    r"transformer.h.\d+.attn.v_proj.weight": [Shard(0)],
    r"transformer.h.\d+.attn.v_proj.bias": [Shard(0)],
    r"transformer.h.\d+.attn.c_proj.weight": [Shard(1)],
    r"transformer.h.\d+.attn.c_proj.bias": [Replicate()],
    r"transformer.h.\d+.mlp.c_fc.weight": [Shard(0)],
    r"transformer.h.\d+.mlp.c_fc.bias": [Shard(0)],
    r"transformer.h.\d+.mlp.c_proj.weight": [Shard(1)],
    r"transformer.h.\d+.mlp.c_proj.bias": [Replicate()],
    r"lm_head.weight": [Shard(1)],
}
fwd_plan = {
    r"input": [[Replicate()], [Replicate()], [Replicate()]],
    r"transformer.wte.output": [[Replicate()]],
    r"transformer.wpe.output": [[Replicate()]],
    r"transformer.h.\d+.input": [[Shard(1)]],
    r"transformer.h.\d+.attn.input": [[Replicate()]],
    r"transformer.h.\d+.attn.c_proj.output": [[Replicate()]],
    r"transformer.h.\d+.attn.output": [[Shard(1)]],
    r"transformer.h.\d+.mlp.c_fc.input": [[Replicate()]],
    r"transformer.h.\d+.mlp.c_proj.output": [[Replicate()]],
    r"transformer.h.\d+.mlp.output": [[Shard(1)]],
    r"transformer.ln_f.input": [[Shard(1)]],
    r"lm_head.input": [[Shard(2)]],
    r"lm_head.output": [[Replicate()]],
}
nanoGPT_plan = {"parameter": param_plan, "forward": fwd_plan}


def batch(step: int, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences counting up by a small stride from a random start: learnable quickly."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (size, 1), generator=g)
    stride = torch.randint(1, 4, (size, 1), generator=g)
    seq = (start + stride * torch.arange(BLOCK + 1)) % VOCAB
    return seq[:, :-1], seq[:, 1:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps")
    parser.add_argument("--tp", type=int, default=4, help="tensor-parallel devices")
    opts = parser.parse_args(argv)

    sw.manual_seed(0)
    model = GPT()
    reference = copy.deepcopy(model)
    mesh = sw.init_device_mesh("cpu", (opts.tp,))
    parallelize_module(model, mesh, nanoGPT_plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=True)
    pos = torch.arange(BLOCK)

    worst = 0.0
    say = print if mesh.get_coordinate() == (0,) else (lambda *_: None)
    say(f"{'step':>4}  {'loss (tp)':>10}  {'loss (1 dev)':>12}  {'diff':>8}")
    for step in range(opts.steps):
        idx, targets = batch(step)
        loss = model(idx, pos, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = reference(idx, pos, targets)
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
