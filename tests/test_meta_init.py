"""PyTorch's meta-device flow (torchtitan's): build the model under ``torch.device("meta")``,
shard it there, ``to_empty`` allocates each device's pieces, the model's own ``init_weights``
fills them. The values equal the model built normally with its parameters sharded alike
(random initializers draw per shard); with those values, the forward and SGD steps equal
single-device PyTorch's."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from mp_harness import run_in_processes
from shardwise import Placement, Replicate, Shard
from shardwise.deferred_init import is_deferred
from shardwise.memory import track_allocations
from shardwise.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    fully_shard,
    parallelize_module,
)

VOCAB, DIM, HEADS, HIDDEN, LAYERS, MAX_SEQ = 32, 16, 4, 24, 2, 8
HEAD_DIM = DIM // HEADS


def precompute_freqs(head_dim: int, max_seq: int, theta: float = 10000.0) -> torch.Tensor:
    """RoPE's rotation per position and frequency, as (cos, sin) on the last dim."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(max_seq).float(), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate the (first half, second half) pairs of ``x`` (batch, seq, heads, head_dim)."""
    seq, half = x.shape[1], x.shape[-1] // 2
    cos = freqs[:seq, :, 0].view(1, seq, 1, half)
    sin = freqs[:seq, :, 1].view(1, seq, 1, half)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class RMSNorm(nn.Module):
    """No ``reset_parameters``: the model's ``init_weights`` fills it."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        # -1 heads: the heads this rank holds (per rank) or all of them (global view)
        q = rotate(self.wq(x).view(bs, seq, -1, HEAD_DIM), freqs)
        k = rotate(self.wk(x).view(bs, seq, -1, HEAD_DIM), freqs)
        v = self.wv(x).view(bs, seq, -1, HEAD_DIM)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))

    def init_weights(self, std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=std)


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        nn.init.normal_(self.w2.weight, std=std)
        nn.init.zeros_(self.w2.bias)
        bound = 1 / math.sqrt(DIM)
        nn.init.uniform_(self.w3.weight, -bound, bound)


class Block(nn.Module):
    def __init__(self, layer: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = RMSNorm(DIM)
        self.feed_forward = FeedForward()
        self.std = 0.02 / math.sqrt(2 * (layer + 1))

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            nn.init.ones_(norm.weight)
        self.attention.init_weights(self.std)
        self.feed_forward.init_weights(self.std)


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block(i) for i in range(LAYERS)})
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs(HEAD_DIM, MAX_SEQ), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))

    def init_weights(self) -> None:
        self.freqs_cis = precompute_freqs(HEAD_DIM, MAX_SEQ)  # a plain tensor into the buffer
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        nn.init.ones_(self.norm.weight)
        std = DIM**-0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


def apply_tp(model: Transformer, tp_mesh: sw.DeviceMesh, *, per_rank: bool = False) -> None:
    """torchtitan's tensor + sequence parallel plan (loss_parallel off). The blocks' second
    input, the RoPE table, is declared Replicate in one process holding several devices: there
    the attention sees DTensors (the global view), and shardwise mixes a plain tensor with them
    only when told how it is laid out. Per rank the attention computes on local tensors and
    torchtitan's ``None`` (left plain) works as in PyTorch."""
    freqs_layout = None if per_rank else Replicate()
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in model.layers.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), freqs_layout),
                    desired_input_layouts=(Replicate(), freqs_layout),
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
            },
        )


def plan_placement(name: str) -> Placement:
    """The tensor-parallel placement the plan gives parameter ``name`` (PyTorch's styles:
    Colwise splits a Linear's output features, Rowwise its input features and an Embedding's
    vocabulary; SequenceParallel and a Rowwise bias replicate)."""
    if name.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight")):
        return Shard(0)
    if name == "output.weight" or name == "tok_embeddings.weight":
        return Shard(0)
    if name.endswith(("wo.weight", "w2.weight")):
        return Shard(1)
    return Replicate()  # norms, w2.bias



def shard_bytes(model: nn.Module) -> int:
    return sum(c.numel() * c.element_size() for p in model.parameters() for c in sw.tf.unpack(p))


def build_on_meta(mesh_shape: tuple[int, ...], fsdp: bool) -> tuple[nn.Module, dict]:
    """The model built on meta and sharded there (tensor parallel on the mesh's "tp" dim, on
    its "tp" sub-mesh without ``fsdp``; with ``fsdp``, ``fully_shard`` over "dp" after), and
    the placements the plan gives each parameter."""
    names = ("dp", "tp") if len(mesh_shape) == 2 else ("tp",)
    mesh = sw.init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    with torch.device("meta"):
        model = Transformer()
    apply_tp(model, mesh if fsdp or len(mesh_shape) == 1 else mesh["tp"])
    if fsdp:
        # inner units, then the root (a whole block is left out: fully_shard takes a plain
        # input of its module as the global batch, and would split the RoPE table over dp)
        for block in model.layers.values():
            fully_shard(block.feed_forward, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    # the global view lifts the "tp" sub-mesh's placements onto the whole mesh (Replicate on dp)
    lifted = (Replicate(),) if len(mesh_shape) == 2 else ()
    expected = {
        name: (_fsdp_placement(plan_placement(name), p), plan_placement(name)) if fsdp
        else (*lifted, plan_placement(name))
        for name, p in model.named_parameters()
    }
    return model, expected


def _sharded_like(module: nn.Module, like: nn.Module) -> nn.Module:
    """``module`` (built normally) with each parameter a DTensor placed as ``like``'s."""
    for (name, p), q in zip(list(module.named_parameters()), like.parameters(), strict=True):
        owner, attr = name.rsplit(".", 1)
        dparam = sw.distribute_tensor(p.detach(), q.device_mesh, q.placements)
        setattr(module.get_submodule(owner), attr, nn.Parameter(dparam))
    return module


def _load_full(reference: nn.Module, model: nn.Module) -> None:
    """``reference`` takes ``model``'s initial values (whole tensors), to train alike."""
    with torch.no_grad():
        for ref, p in zip(reference.parameters(), model.parameters(), strict=True):
            ref.copy_(p.full_tensor())


def _fsdp_placement(tp: object, param: torch.Tensor) -> object:
    """fully_shard's placement on "dp": each device's dp chunk of its own tp shard where the tp
    shard is on dim 0 too (FSDP2's strided shard), else Shard(0)."""
    if tp == Shard(0) and param.shape[0] % 2 == 0:
        return sw.InterleavedShard(0, interleaved_size=2)
    return Shard(0)


CASES = [((2,), False), ((2, 2), False), ((2, 2), True)]


@pytest.mark.parametrize(("mesh_shape", "fsdp"), CASES, ids=["tp2", "tp_of_2x2", "fsdp2xtp2"])
def test_meta_model_sharded_to_empty_and_init_weights_trains_like_one_device(
    mesh_shape: tuple[int, ...], fsdp: bool
) -> None:
    sw.manual_seed(0)
    reference = Transformer()
    sw.manual_seed(11)
    reference.init_weights()

    model, expected = build_on_meta(mesh_shape, fsdp)
    assert is_deferred(model)  # the sharding calls left it on meta
    for name, p in model.named_parameters():
        assert sw.tf.is_dtensor(p) and p.placements == expected[name], name
        assert p._components[0].is_meta, name  # fully_shard too leaves them meta (FSDP2)

    with track_allocations() as stats:
        model.to_empty(device="cpu")
    assert not is_deferred(model)
    for name, p in model.named_parameters():
        assert p.placements == expected[name], name
        assert all(c.device.type == "cpu" for c in sw.tf.unpack(p)), name
    # each device allocated only its pieces: the parameters' shards and the plain RoPE table
    plain = sum(b.numel() * b.element_size() for b in model.buffers())
    assert stats.allocated_bytes == shard_bytes(model) + plain
    largest_sharded = max(
        p.numel() * p.element_size() for n, p in reference.named_parameters()
        if plan_placement(n) != Replicate()
    )
    assert stats.largest_bytes < largest_sharded

    with torch.no_grad():
        sw.manual_seed(11)
        model.init_weights()  # nn.init on DTensor parameters: each device draws its shard
    assert not sw.tf.is_dtensor(model.freqs_cis)
    torch.testing.assert_close(model.freqs_cis, reference.freqs_cis, rtol=0, atol=0)
    eager = _sharded_like(Transformer(), model)
    with torch.no_grad():
        sw.manual_seed(11)
        eager.init_weights()  # the same init on parameters sharded eagerly: the same draws
    for (name, p), want in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert p.placements == expected[name], name
        torch.testing.assert_close(p.full_tensor(), want.full_tensor(), rtol=0, atol=0, msg=name)
    _load_full(reference, model)

    tokens = torch.randint(0, VOCAB, (2, MAX_SEQ), generator=torch.Generator().manual_seed(3))
    targets = torch.randint(0, VOCAB, (2, MAX_SEQ), generator=torch.Generator().manual_seed(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(2):
        out = model(tokens)
        ref_out = reference(tokens)
        out_full = out.full_tensor() if sw.tf.is_dtensor(out) else out
        torch.testing.assert_close(out_full, ref_out, msg=f"forward, step {step}")
        with sw.config.implicit_replication():  # the plain targets: every rank holds them whole
            loss = F.cross_entropy(out.flatten(0, 1), targets.flatten())
        ref_loss = F.cross_entropy(ref_out.flatten(0, 1), targets.flatten())
        loss_full = loss.full_tensor() if sw.tf.is_dtensor(loss) else loss
        torch.testing.assert_close(loss_full, ref_loss, msg=f"loss, step {step}")
        loss.backward()
        ref_loss.backward()
        for (name, p), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert p.grad.placements == expected[name], name
            torch.testing.assert_close(p.grad.full_tensor(), ref.grad, msg=name)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()


def test_parallelize_module_keeps_even_a_resettable_meta_model_on_meta() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    assert all(p._components[0].is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    assert model[0].weight.placements == (Shard(0),)
    assert model[2].weight.placements == (Shard(1),)
    assert [c.shape for c in sw.tf.unpack(model[2].weight)] == [torch.Size([8, 8])] * 2


class Scale(nn.Module):
    """A parameter without reset_parameters."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def test_replicate_on_meta_then_to_empty_still_reduces_gradients_once_per_bucket() -> None:
    """replicate's gradient hooks sit on the meta parameters; to_empty swaps in the real ones
    and the hooks must follow them."""
    from shardwise.parallel import replicate

    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(6, 8), Scale(8), nn.Tanh(), nn.Linear(8, 2))

    def init(model: nn.Module) -> None:
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, nn.Linear):
                    nn.init.uniform_(m.weight, -0.5, 0.5)
                    nn.init.zeros_(m.bias)
            nn.init.normal_(model[1].weight)

    reference = build()
    sw.manual_seed(5)
    init(reference)
    mesh = sw.init_device_mesh("cpu", (2,))
    with torch.device("meta"):
        model = build()
    replicate(model, mesh)
    assert is_deferred(model)  # Scale cannot be reset: left to to_empty and the user's init
    model.to_empty(device="cpu")
    sw.manual_seed(5)
    init(model)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    reference(x).square().sum().backward()
    with sw.debug.CommCounter() as counter:
        model(x).square().sum().backward()
    assert counter.counts["all_reduce"] == 1  # the one bucket, reduced by replicate's hooks
    for p, ref in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.grad.placements == (Replicate(),)
        torch.testing.assert_close(p.grad.full_tensor(), ref.grad)


def test_empty_like_refuses_a_device_the_mesh_does_not_have() -> None:
    mesh = sw.init_device_mesh("meta", (2,))
    w = sw.distribute_tensor(torch.empty(4, 3, device="meta"), mesh, [Shard(0)])
    assert torch.empty_like(w, device="meta")._components[0].is_meta
    with pytest.raises(sw.errors.InvalidArgumentError, match=r"\[4, 3\].*Shard.*'meta'"):
        torch.empty_like(w, device="cpu")


def _per_rank_job() -> list[float]:
    """One rank of torchtitan's flow, word for word (the RoPE table left plain)."""
    reference = Transformer()
    sw.manual_seed(11)
    reference.init_weights()
    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    with torch.device("meta"):
        model = Transformer()
    apply_tp(model, mesh, per_rank=True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        sw.manual_seed(11)
        model.init_weights()
    _load_full(reference, model)
    tokens = torch.randint(0, VOCAB, (2, MAX_SEQ), generator=torch.Generator().manual_seed(3))
    targets = torch.randint(0, VOCAB, (2, MAX_SEQ), generator=torch.Generator().manual_seed(4))
    losses = []
    for m in (model, reference):
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        for _ in range(2):
            out = m(tokens)
            # use_local_output: the rank's local (replicated) logits
            assert not sw.tf.is_dtensor(out)
            loss = F.cross_entropy(out.flatten(0, 1), targets.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses


def test_per_rank_program_matches_one_device_across_two_processes() -> None:
    for losses in run_in_processes(_per_rank_job, 2, timeout=240):
        got, want = losses[:2], losses[2:]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want))
