"""A GPT-style block under tensor + sequence parallelism: merged QKV kept whole per head by
``InterleavedShard``, forward and backward equal to single device on meshes (2,), (3,), (2, 2),
and 2-D (data x tensor) training for several steps equal to single-device training."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise import InterleavedShard, Replicate, Shard
from shardwise.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(dim, 3 * dim)  # merged q, k, v
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=-1)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, d // self.heads).transpose(1, 2)

        att = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        return self.c_proj(att.transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential()
        self.mlp.c_fc = nn.Linear(dim, 2 * dim)
        self.mlp.act = nn.GELU()
        self.mlp.c_proj = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.block = Block(dim, heads)
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(self.block(self.wte(idx))))


def block_plan(prefix: str, heads: int) -> dict:
    """Megatron tensor parallel + sequence parallel between the blocks' matmuls."""
    return {
        f"{prefix}ln_1": SequenceParallel(),
        f"{prefix}attn": PrepareModuleInput(
            input_layouts=Shard(1), desired_input_layouts=Replicate()
        ),
        f"{prefix}attn.c_attn": ColwiseParallel(interleave=3, num_heads=heads),
        f"{prefix}attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
        f"{prefix}ln_2": SequenceParallel(),
        f"{prefix}mlp": PrepareModuleInput(
            input_layouts=Shard(1), desired_input_layouts=Replicate()
        ),
        f"{prefix}mlp.c_fc": ColwiseParallel(),
        f"{prefix}mlp.c_proj": RowwiseParallel(output_layouts=Shard(1)),
    }


def lm_plan(heads: int) -> dict:
    return {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        **block_plan("block.", heads),
        "ln_f": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
    }


@pytest.mark.parametrize("mesh_shape", [(2,), (3,), (2, 2)])
def test_attention_block_forward_backward(mesh_shape) -> None:
    torch.manual_seed(0)
    block = Block(dim=12, heads=6)
    reference = copy.deepcopy(block)
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    parallelize_module(block, mesh, block_plan("", heads=6))
    qkv = block.attn.c_attn.weight
    assert qkv.placements[-1] == InterleavedShard(0, 3)
    # every device holds whole heads of q, k and v: rows [j*12 + lo, j*12 + hi) for j = 0, 1, 2
    n = mesh_shape[-1]
    rows = 12 // n
    first = sw.tf.unpack(qkv)[0]
    expected = torch.cat([reference.attn.c_attn.weight[j * 12 : j * 12 + rows] for j in range(3)])
    torch.testing.assert_close(first, expected)

    x = torch.randn(2, 5, 12)  # sequence 5: uneven over 2 and 3 devices
    dx = sw.distribute_tensor(x, mesh, [Replicate()] * (len(mesh_shape) - 1) + [Shard(1)])
    with sw.debug.CommCounter() as counter:
        out = block(dx)
    assert out.placements[-1] == Shard(1)
    ref = reference(x)
    torch.testing.assert_close(out.full_tensor(), ref, atol=1e-5, rtol=1e-4)
    # the merged projection's output splits into q, k, v without moving data: per block the
    # only collectives are the all-gathers before attention and MLP and their reduce-scatters
    kinds = sorted(r.kind for r in counter.records)
    assert kinds == ["all_gather", "all_gather", "reduce_scatter", "reduce_scatter"], kinds
    grad = torch.randn_like(ref)
    ref.backward(grad)
    dgrad = sw.distribute_tensor(grad, mesh, out.placements)
    with sw.debug.CommCounter() as counter:
        out.backward(dgrad)
    # activation gradients: one reduce-scatter per all-gather and back; q, k and v gradients
    # add up before theirs; the all-reduces are the sequence-parallel norm weights' and biases'
    assert counter.counts["all_gather"] == 2 and counter.counts["reduce_scatter"] == 2
    assert counter.counts["all_reduce"] == 4
    for (name, p), r in zip(block.named_parameters(), reference.parameters(), strict=True):
        assert p.grad.placements == p.placements, name
        torch.testing.assert_close(p.grad.full_tensor(), r.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_dp_x_tp_training_matches_single_device() -> None:
    """Data parallel by sharding the batch over mesh dim 0 (gradients all-reduced there by
    hand), tensor + sequence parallel over dim 1, vocab-parallel loss, SGD with momentum, 4
    steps. (Not Adam: the key bias has a true gradient of zero, and Adam would scale rounding
    noise of either sign up to full steps.)"""
    torch.manual_seed(0)
    vocab, heads = 19, 2
    model = TinyLM(vocab, dim=8, heads=heads)
    reference = copy.deepcopy(model)
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh, lm_plan(heads))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, vocab, (4, 5), generator=g)
        target = torch.randint(0, vocab, (4, 5), generator=g)

        ref_loss = F.cross_entropy(reference(idx).flatten(0, 1), target.flatten())
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()

        didx = sw.distribute_tensor(idx, mesh, [Shard(0), Replicate()])
        dtarget = sw.distribute_tensor(target, mesh, [Shard(0), Replicate()])
        logits = model(didx)
        assert logits.placements == (Shard(0), Shard(2))
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), dtarget.flatten())
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():  # data parallel: sum the batch shards' gradients
            p.grad = p.grad.redistribute(placements=p.placements)
        opt.step()
        torch.testing.assert_close(loss.full_tensor(), ref_loss.detach(), atol=1e-5, rtol=1e-4)
        losses.append(ref_loss.item())
        for (name, p), r in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(
                p.full_tensor(), r.detach(), atol=1e-5, rtol=1e-4, msg=f"{name} at step {step}"
            )
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("mesh_shape", [(2,), (3,), (2, 2)])
def test_interleaved_blocks_split_and_join_without_communication(mesh_shape) -> None:
    """The ops behind a merged projection: split of InterleavedShard(d, 3) into its 3 blocks
    gives Shard(d) pieces, and cat of 3 equal Shard(d) pieces gives InterleavedShard(d, 3)."""
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    lead = [Replicate()] * (len(mesh_shape) - 1)
    x = torch.randn(2, 15)  # blocks of 5: uneven on every mesh
    dx = sw.distribute_tensor(x, mesh, [*lead, InterleavedShard(1, 3)])
    with sw.debug.CommCounter() as counter:
        pieces = dx.split(5, dim=1)
        sized = torch.split(dx, [5, 5, 5], dim=1)
        joined = torch.cat(pieces, dim=1)
    assert counter.total_bytes == 0
    for got, want in zip(pieces + sized, x.split(5, dim=1) * 2, strict=True):
        assert got.placements[-1] == Shard(1)
        torch.testing.assert_close(got.full_tensor(), want)
    assert joined.placements[-1] == InterleavedShard(1, 3)
    torch.testing.assert_close(joined.full_tensor(), x)
