"""Training on a 2x2 mesh (data parallel x tensor parallel) matches single-device training step
by step: a 2-layer MLP and a small transformer block, with SGD, Adam and AdamW."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise import Replicate, Shard

DP, TP = 0, 1  # mesh dims


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-norm attention + MLP block with heads and hidden units to shard."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        # no key bias: it shifts every score of a row equally, so its true gradient is zero
        # and Adam would amplify rounding noise of either sign
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, 2 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.norm1(x)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, d // self.heads).transpose(1, 2)

        att = F.scaled_dot_product_attention(
            heads(self.q(h)), heads(self.k(h)), heads(self.v(h)), is_causal=True
        )
        x = x + self.out(att.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.norm2(x))


# Megatron-style plan: column-parallel weights shard their output features, row-parallel ones
# their input features; everything is replicated over the data-parallel mesh dim.
COLUMN = ("up", "q", "k", "v")
ROW = ("down", "out")


def shard_module(module: nn.Module, mesh: sw.DeviceMesh) -> None:
    for name, child in module.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        for pname, param in list(child.named_parameters(recurse=False)):
            if leaf in COLUMN:
                placements = [Replicate(), Shard(0)]
            elif leaf in ROW and pname == "weight":
                placements = [Replicate(), Shard(1)]
            else:
                placements = [Replicate(), Replicate()]
            dparam = sw.distribute_tensor(param.detach(), mesh, placements)
            setattr(child, pname, nn.Parameter(dparam))


OPTIMIZERS = [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (torch.optim.Adam, {"lr": 0.01, "foreach": False}),
    (torch.optim.Adam, {"lr": 0.01, "foreach": True}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1, "foreach": True}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1, "foreach": False}),
]


def _train_and_compare(model: nn.Module, make_batch, opt_cls, opt_kwargs, steps: int = 3) -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    reference = model
    sharded = copy.deepcopy(model)
    shard_module(sharded, mesh)
    ref_opt = opt_cls(reference.parameters(), **opt_kwargs)
    opt = opt_cls(sharded.parameters(), **opt_kwargs)
    for step in range(steps):
        x, target = make_batch(step)
        ref_loss = F.mse_loss(reference(x), target)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()

        dx = sw.distribute_tensor(x, mesh, [Shard(0), Replicate()])
        dtarget = sw.distribute_tensor(target, mesh, [Shard(0), Replicate()])
        with sw.config.allow_implicit_redistribute():
            loss = F.mse_loss(sharded(dx), dtarget)
            opt.zero_grad()
            loss.backward()
            opt.step()
        torch.testing.assert_close(loss.full_tensor(), ref_loss.detach(), atol=1e-5, rtol=1e-4)
        for (name, p), ref in zip(sharded.named_parameters(), reference.parameters(), strict=True):
            assert isinstance(p, sw.DTensor), name
            torch.testing.assert_close(
                p.full_tensor(), ref.detach(), atol=1e-5, rtol=1e-4, msg=f"{name} at step {step}"
            )


@pytest.mark.parametrize("opt_cls,opt_kwargs", OPTIMIZERS, ids=lambda o: str(o))
def test_mlp_trains_like_single_device(opt_cls, opt_kwargs) -> None:
    torch.manual_seed(0)
    model = MLP(8, 12)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        return torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)

    _train_and_compare(model, batch, opt_cls, opt_kwargs)


@pytest.mark.parametrize("opt_cls,opt_kwargs", OPTIMIZERS[:2], ids=lambda o: str(o))
def test_transformer_block_trains_like_single_device(opt_cls, opt_kwargs) -> None:
    torch.manual_seed(0)
    model = Block(dim=8, heads=2)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(100 + step)
        return torch.randn(4, 5, 8, generator=g), torch.randn(4, 5, 8, generator=g)

    _train_and_compare(model, batch, opt_cls, opt_kwargs)


def test_clip_grad_norm_matches_single_device() -> None:
    torch.manual_seed(0)
    model = MLP(8, 12)
    sharded = copy.deepcopy(model)
    mesh = sw.init_device_mesh("cpu", (2, 2))
    shard_module(sharded, mesh)
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    F.mse_loss(model(x), y).backward()
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    dx = sw.distribute_tensor(x, mesh, [Shard(0), Replicate()])
    dy = sw.distribute_tensor(y, mesh, [Shard(0), Replicate()])
    with sw.config.allow_implicit_redistribute():
        F.mse_loss(sharded(dx), dy).backward()
        total = torch.nn.utils.clip_grad_norm_(sharded.parameters(), 0.1)
    torch.testing.assert_close(total.full_tensor(), expected)
    for p, ref in zip(sharded.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), ref.grad)
