"""A small Llama-style decoder, plain single-device PyTorch, for ``fsdp_tp.py``.

RMSNorm before attention and before the feed-forward, rotary position embedding (pairs of
features turned as complex numbers), causal self-attention through SDPA, a SwiGLU feed-forward
and untied input and output embeddings. Under tensor parallelism the attention projections'
outputs stay DTensors (``use_local_output=False``), so the ``view`` that splits heads is written
in the global shape, as here.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Config:
    vocab: int = 256
    dim: int = 64
    heads: int = 4
    hidden: int = 128
    layers: int = 2
    max_seq: int = 64
    eps: float = 1e-5


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotations(head_dim: int, length: int, base: float = 10000.0) -> torch.Tensor:
    """Unit complex numbers turning feature pair j at position p by p / base^(2j/head_dim):
    (length, head_dim / 2)."""
    speeds = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.arange(length, dtype=torch.float32)[:, None] * speeds[None, :]
    return torch.polar(torch.ones_like(angles), angles)


def rotate(x: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` (batch, seq, heads, head_dim) by ``turns[:seq]``."""
    batch, seq, heads, head_dim = x.shape
    pairs = torch.view_as_complex(x.float().reshape(batch, seq, heads, head_dim // 2, 2))
    turned = pairs * turns[:seq].reshape(1, seq, 1, head_dim // 2)
    return torch.view_as_real(turned).reshape(batch, seq, heads, head_dim).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.dim // cfg.heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (w(x).view(batch, seq, self.heads, self.head_dim)
                   for w in (self.wq, self.wk, self.wv))
        q, k = rotate(q, turns), rotate(k, turns)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), turns)
        return h + self.feed_forward(self.ffn_norm(h))


class TinyLlama(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, cfg.eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.register_buffer("turns", rotations(cfg.dim // cfg.heads, cfg.max_seq),
                             persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        turns = self.turns[: tokens.shape[1]]
        for layer in self.layers:
            h = layer(h, turns)
        return self.output(self.norm(h))
