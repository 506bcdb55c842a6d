"""Tensor-parallel and FSDP x TP training steps: shardwise vs torch.distributed.tensor vs the
same parallelism written by hand on plain local tensors, the same model code, in the same run,
interleaved.

Models: an MLP (Linear -> GELU -> Linear); a transformer block (LayerNorm, attention with
q/k/v/o projections, LayerNorm, MLP, residuals); the demo's GPT (``shardwise.demo.GPT``, two
blocks, cross-entropy over the vocabulary); a torchtitan-style Llama block (RMSNorm, attention
with bias-free wq/wk/wv/wo and rotary embedding, SwiGLU feed-forward w1/w2/w3) with torchtitan's
plan (wq/wk/wv/w1/w3 colwise, wo/w2 rowwise). Every plan is plain tensor parallelism (no sequence
parallel, no loss_parallel): what all three variants express identically. ``*_fsdp_tp``: the MLP
and the Llama block on a ("dp", "tp") mesh, (N/2, 2) on N >= 4 processes, (2, 1) on 2 (there the
tensor-parallel dim is degenerate: FSDP alone; the hand-written step then calls no tensor-parallel
collective), each dp rank training on its own rows of the batch. One step is forward, backward and
an AdamW update. The three variants:

- ``shardwise``: ``shardwise.parallel.parallelize_module`` with ColwiseParallel/RowwiseParallel
  (then ``shardwise.parallel.fully_shard`` of the root over "dp");
- ``torch_dt``: ``torch.distributed.tensor.parallel.parallelize_module`` with torch's styles
  (the same plan dict, the other import; then ``torch.distributed.fsdp.fully_shard``);
- ``hand``: Megatron by hand on local tensors: each rank keeps its slice of the weights, an
  identity-forward/all-reduce-backward function in front of every column-parallel linear and an
  all-reduce-forward/identity-backward function after every row-parallel one (bias added after).
  FSDP by hand, as FSDP2 does it for one root unit: each rank stores its dp chunk (dim 0) of
  every local parameter; before the forward one all_gather_into_tensor over the dp group of the
  chunks packed flat, the gathered parameters kept until backward; at the end of backward one
  reduce_scatter_tensor of the packed gradients (the whole gradients and parameters freed
  before its output is allocated), divided by the dp size.

The losses of the three variants agree step by step (largest difference over ranks and steps,
recorded): the run fails when one differs from the hand-written step by more than float noise.
AdamW is blind to a uniform scale of the gradients, so that check cannot see a wrong averaging
factor alone; a missing or misplaced reduction it does see.

Peak memory is measured with the PyTorch profiler's CPU allocator events
(``profile_memory=True``): every allocation and free through torch's CPU allocator during one
step, in time order; the peak of the running sum, plus the bytes of parameters, gradients and
optimizer state alive before the step, is the peak tensor memory of the rank. Allocations gloo
makes outside torch's allocator are not counted: gloo's all_reduce works in its own buffers
(DTensor's and the hand-written steps' collectives), while its all_gather_into_tensor copies
through a flat buffer from torch's allocator (counted; shardwise and DTensor issue the same
functional collectives, so their buffers are counted alike).

Beside the wall time, each step's CPU time of the process (``time.process_time``: its own
work, gloo's threads included, not the time it waits descheduled) and its minor page faults are
recorded (medians, the largest rank's). On a host with more processes than cores a step's wall
time is several times its CPU time, so every ms of CPU shows as several ms of wall. The faults
are glibc's: a freed block at the top of the heap is given back to the system once the free top
exceeds the trim threshold, and the next large tensor faults its pages in afresh (4 KiB each,
2048 per 8 MiB). Whether that happens every step depends on the order of every allocation
before it, Python's included, so it falls on one variant or another by the process's history;
``--steady-heap`` sets glibc's mmap threshold to 64 MiB and its trim threshold to 1 GiB
(``mallopt``) for the whole run, the same for the three variants, so no step refaults its
tensors (what jemalloc or tcmalloc, which PyTorch recommends on CPU, do by keeping freed pages).

AdamW runs its per-parameter loop (``foreach=False``) for all three. On ``--device cuda`` (one
GPU per process, NCCL) the peak is ``torch.cuda.max_memory_allocated``
during one step and every step ends with a synchronize (its ``loss.item()``).

Run: python -m shardwise.launch --nproc 2 bench/bench_training.py [--json FILE] [--quick]
[--device cpu|cuda] [--models mlp,gpt,...] [--steady-heap]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import fsdp as torch_fsdp
from torch.distributed import tensor as torch_dt
from torch.distributed.tensor import parallel as torch_tp

import shardwise as sw
from shardwise import parallel as sw_tp
from shardwise.demo import GPT, Attention, GPTConfig


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.ln_1 = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.ln_1(x)

        def heads(t: torch.Tensor) -> torch.Tensor:  # -1: the heads this rank holds
            return t.view(b, s, -1, self.head_dim).transpose(1, 2)

        att = F.scaled_dot_product_attention(
            heads(self.q(h)), heads(self.k(h)), heads(self.v(h)), is_causal=True
        )
        x = x + self.o(att.transpose(1, 2).reshape(b, s, -1))
        return x + self.mlp(self.ln_2(x))


class _HeadLocalAttention(Attention):
    """The demo's attention, its forward reading the heads from the local width: the merged QKV
    output is chunked in three (not split at the global width), so on a rank that holds its
    heads' rows of q, k and v (see ``_interleave_qkv``) it attends over those heads. On one
    device it is the demo's forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        head_dim = x.shape[-1] // self.heads

        def split_heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, -1, head_dim).transpose(1, 2)

        att = F.scaled_dot_product_attention(
            split_heads(q), split_heads(k), split_heads(v), is_causal=True
        )
        return self.proj(att.transpose(1, 2).reshape(b, s, -1))


def _interleave_qkv(gpt: GPT, ways: int) -> None:
    """Reorder the rows of every merged QKV projection to [q_0, k_0, v_0, q_1, k_1, v_1, ...]:
    the contiguous ``ways``-th chunk r of the rows (ColwiseParallel's Shard(0)) is then rank r's
    heads of q, k and v, so a plain colwise plan splits attention by heads (the demo's plan does
    it with ``InterleavedShard``, which torch's styles cannot express)."""
    for block in gpt.blocks:
        block.attn.__class__ = _HeadLocalAttention
        lin = block.attn.qkv
        with torch.no_grad():
            for name in ("weight", "bias"):
                t = getattr(lin, name)
                parts = [p.chunk(ways, 0) for p in t.chunk(3, 0)]
                t.copy_(torch.cat([parts[j][r] for r in range(ways) for j in range(3)]))


def _rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of (batch, heads, seq, head_dim), rotate-half form."""
    s, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    angles = torch.outer(torch.arange(s, device=x.device, dtype=torch.float32), inv)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class LlamaAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # -1: the heads this rank holds
            return t.view(b, s, -1, self.head_dim).transpose(1, 2)

        att = F.scaled_dot_product_attention(
            _rotary(heads(self.wq(x))), _rotary(heads(self.wk(x))), heads(self.wv(x)),
            is_causal=True,
        )
        return self.wo(att.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1(x)) * w3(x)), hidden 2/3 of 4 * dim rounded up to a multiple of 64."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        hidden = 64 * math.ceil(int(2 * 4 * dim / 3) / 64)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    """torchtitan's TransformerBlock: pre-RMSNorm attention and feed-forward, residuals."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim, eps=1e-5)
        self.attention = LlamaAttention(dim, heads)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)
        self.feed_forward = FeedForward(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


GPT_LAYERS, GPT_VOCAB = 2, 64


def _plan(model: str, colwise, rowwise) -> dict:
    """Module name -> style; ``model`` without its ``_fsdp_tp`` suffix."""
    if model == "mlp":
        return {"up": colwise(), "down": rowwise()}
    if model == "block":
        return {"q": colwise(), "k": colwise(), "v": colwise(), "o": rowwise(),
                "mlp.up": colwise(), "mlp.down": rowwise()}
    if model == "gpt":
        plan = {}
        for i in range(GPT_LAYERS):
            plan |= {f"blocks.{i}.attn.qkv": colwise(), f"blocks.{i}.attn.proj": rowwise(),
                     f"blocks.{i}.mlp.up": colwise(), f"blocks.{i}.mlp.down": rowwise()}
        return plan
    return {"attention.wq": colwise(), "attention.wk": colwise(), "attention.wv": colwise(),
            "attention.wo": rowwise(), "feed_forward.w1": colwise(),
            "feed_forward.w2": rowwise(), "feed_forward.w3": colwise()}


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _hand_parallelize(module: nn.Module, plan: dict, group, rank: int, size: int) -> None:
    """Keep this rank's slice of every planned linear and put f and g where Megatron does (no
    collective on a group of one)."""
    for name, style in plan.items():
        lin = module.get_submodule(name)
        if style == "col":
            lin.weight = nn.Parameter(lin.weight.detach().chunk(size, 0)[rank].clone())
            if lin.bias is not None:
                lin.bias = nn.Parameter(lin.bias.detach().chunk(size, 0)[rank].clone())
            if size > 1:
                lin.register_forward_pre_hook(
                    lambda m, args: (_CopyToTP.apply(args[0], group),))
        else:
            lin.weight = nn.Parameter(lin.weight.detach().chunk(size, 1)[rank].clone())
            if lin.bias is not None:
                lin.tp_bias = nn.Parameter(lin.bias.detach().clone())
                lin.bias = None
            lin.register_forward_hook(lambda m, args, out: _row_output(m, out, group, size))


def _row_output(lin: nn.Module, out: torch.Tensor, group, size: int) -> torch.Tensor:
    if size > 1:
        out = _ReduceFromTP.apply(out, group)
    bias = getattr(lin, "tp_bias", None)
    return out if bias is None else out + bias


def _all_gather_packed(shards: list[torch.Tensor], group, rank: int,
                       size: int) -> list[torch.Tensor]:
    """FSDP2's all-gather: every shard packed flat straight into this rank's part of one buffer,
    one all_gather_into_tensor, each whole parameter copied out of it."""
    numels = [t.numel() for t in shards]
    numel = sum(numels)
    gathered = shards[0].new_empty(size * numel)
    mine = gathered[rank * numel:(rank + 1) * numel]
    torch.cat([t.reshape(-1) for t in shards], out=mine)
    dist.all_gather_into_tensor(gathered, mine, group=group)
    pieces = gathered.view(size, -1).split(numels, dim=1)
    return [piece.reshape(size * t.shape[0], *t.shape[1:])
            for piece, t in zip(pieces, shards, strict=True)]


def _reduce_scatter_packed(full: list[torch.Tensor], shards: list[nn.Parameter], group,
                           size: int) -> None:
    """FSDP2's reduce-scatter: the gradients of the whole parameters packed rank by rank into
    one buffer, freed with the whole parameters before the output is allocated, one
    reduce_scatter_tensor, averaged; each shard's gradient a view of the output."""
    packed = torch.cat([t.grad.reshape(size, -1) for t in full], dim=1)
    for t in full:  # free the whole gradients and parameters (backward is over)
        t.grad = None
        t.untyped_storage().resize_(0)
    out = packed.new_empty(packed.shape[1])
    dist.reduce_scatter_tensor(out, packed.view(-1), group=group)
    del packed
    out.div_(size)
    for shard, grad in zip(shards, out.split([t.numel() for t in shards]), strict=True):
        shard.grad = grad.view(shard.shape)


def _hand_fully_shard(module: nn.Module, group, rank: int, size: int) -> None:
    """Store this rank's dp chunk (dim 0) of every parameter of ``module`` (one unit, the root,
    as FSDP2 handles a root: unsharded from its forward to the end of backward). Before the
    forward the chunks are gathered into leaf tensors set as plain attributes (removed when the
    forward ends: autograd keeps what backward needs); once backward is over, their gradients
    are reduce-scattered into the chunks' gradients and they are freed."""
    names = [n for n, _ in module.named_parameters()]
    owners = [module.get_submodule(n.rpartition(".")[0]) for n in names]
    leaves = [n.rpartition(".")[2] for n in names]
    shards = [nn.Parameter(owner._parameters.pop(leaf).detach().chunk(size, 0)[rank].clone())
              for owner, leaf in zip(owners, leaves, strict=True)]
    module.fsdp_shards = nn.ParameterList(shards)
    gathered: list[torch.Tensor] = []

    def gather(m: nn.Module, args):
        with torch.no_grad():
            gathered[:] = [t.requires_grad_() for t in
                           _all_gather_packed(list(m.fsdp_shards), group, rank, size)]
        for owner, leaf, t in zip(owners, leaves, gathered, strict=True):
            object.__setattr__(owner, leaf, t)

    def after_backward() -> None:
        _reduce_scatter_packed(gathered, shards, group, size)
        gathered.clear()

    def release(m: nn.Module, args, out: torch.Tensor) -> torch.Tensor:
        for owner, leaf in zip(owners, leaves, strict=True):
            object.__delattr__(owner, leaf)
        if out.requires_grad:  # when backward reaches the output: reduce at its end
            out.register_hook(lambda grad: torch.autograd.Variable._execution_engine
                              .queue_callback(after_backward))
        return out

    module.register_forward_pre_hook(gather)
    module.register_forward_hook(release)


def _fresh(model: str, dim: int, heads: int, seq: int, tp: int) -> nn.Module:
    torch.manual_seed(0)
    if model == "mlp":
        return MLP(dim)
    if model == "block":
        return Block(dim, heads)
    if model == "llama":
        return LlamaBlock(dim, heads)
    gpt = GPT(GPTConfig(vocab=GPT_VOCAB, seq=seq, dim=dim, heads=heads, layers=GPT_LAYERS))
    _interleave_qkv(gpt, tp)
    return gpt


def _build(kind: str, model: str, dim: int, heads: int, seq: int, meshes: dict,
           device: str) -> nn.Module:
    base, fsdp = model.removesuffix("_fsdp_tp"), model.endswith("_fsdp_tp")
    mesh = meshes["fsdp_tp" if fsdp else "tp"]
    tp_mesh, dp_mesh = (mesh["shardwise"]["tp"], mesh["shardwise"]["dp"]) if fsdp else (
        mesh["shardwise"], None)
    module = _fresh(base, dim, heads, seq, tp_mesh.size()).to(_device(device))
    if kind == "shardwise":
        sw_tp.parallelize_module(module, tp_mesh,
                                 _plan(base, sw_tp.ColwiseParallel, sw_tp.RowwiseParallel))
        if fsdp:
            sw_tp.fully_shard(module, mesh=dp_mesh)
    elif kind == "torch_dt":
        dt = mesh["torch_dt"]
        torch_tp.parallelize_module(module, dt["tp"] if fsdp else dt,
                                    _plan(base, torch_tp.ColwiseParallel, torch_tp.RowwiseParallel))
        if fsdp:
            torch_fsdp.fully_shard(module, mesh=dt["dp"])
    else:
        tp = mesh["torch_dt"]["tp"] if fsdp else mesh["torch_dt"]
        _hand_parallelize(module, _plan(base, lambda: "col", lambda: "row"), tp.get_group(),
                          tp.get_local_rank(), tp.size())
        if fsdp:
            dp = mesh["torch_dt"]["dp"]
            _hand_fully_shard(module, dp.get_group(), dp.get_local_rank(), dp.size())
    return module


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _state_bytes(module: nn.Module, opt: torch.optim.Optimizer) -> int:
    tensors = []
    for p in module.parameters():
        tensors.append(_local(p))
        if p.grad is not None:
            tensors.append(_local(p.grad))
    for state in opt.state.values():
        tensors += [_local(v) for v in state.values() if isinstance(v, torch.Tensor)]
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _device(device: str) -> torch.device:
    """This rank's device: its GPU on cuda (one per process), else the CPU."""
    if device == "cuda":
        return torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def _peak_bytes(module: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                target: torch.Tensor, repeats: int = 5) -> int:
    """Peak of the running sum of CPU allocator events during one step: the median of
    ``repeats`` steps after one more that is dropped (the first profiled step cannot see the
    frees of the gradients allocated before profiling began, so it counted them twice)."""
    if x.is_cuda:  # the allocator's own high-water mark, less what was alive before the step
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _step(module, opt, x, target)
        return torch.cuda.max_memory_allocated() - before
    peaks = []
    for _ in range(repeats + 1):
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        ) as prof:
            _step(module, opt, x, target)
        events = sorted(
            (e.start_ns(), e.nbytes())
            for e in prof.profiler.kineto_results.events()
            if e.name() == "[memory]"
        )
        live = peak = 0
        for _, delta in events:
            live += delta
            peak = max(peak, live)
        peaks.append(peak)
    return int(statistics.median(peaks[1:]))


def _step(module: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
          target: torch.Tensor) -> float:
    """One training step: forward, loss, backward, optimizer update."""
    opt.zero_grad(set_to_none=True)
    out = _local(module(x))
    if target.dtype == torch.long:  # token ids: next-token cross-entropy over the vocabulary
        loss = F.cross_entropy(out.flatten(0, -2), target.flatten())
    else:
        loss = F.mse_loss(out, target)
    loss.backward()
    opt.step()
    return loss.item()


MODELS = ("mlp", "block", "gpt", "llama", "mlp_fsdp_tp", "llama_fsdp_tp")


def _fsdp_tp_shape(world: int) -> tuple[int, int]:
    """(dp, tp): tp 2 and the rest dp on 4 or more processes; (2, 1) on 2."""
    return (world // 2, 2) if world >= 4 else (world, 1)


def _inputs(model: str, n: int, batch: int, seq: int, dim: int, dp_rank: int,
            on: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``n`` (input, target) pairs: this dp rank's rows (the same on every tp rank)."""
    base = model.removesuffix("_fsdp_tp")
    g = torch.Generator().manual_seed(1 + 1000 * dp_rank)
    if base == "gpt":
        ids = [torch.randint(0, GPT_VOCAB, (batch, seq + 1), generator=g) for _ in range(n)]
        return [t[:, :-1].to(on) for t in ids], [t[:, 1:].to(on) for t in ids]
    shape = (batch * seq, dim) if base == "mlp" else (batch, seq, dim)
    inputs = [torch.randn(shape, generator=g).to(on) for _ in range(n)]
    return inputs, [torch.randn(shape, generator=g).to(on) for _ in range(n)]


def _loss_tolerance(losses: list[float]) -> float:
    """Float noise between equal programs whose sums run in another order: relative 1e-4."""
    return 1e-4 * max(1.0, max(abs(x) for x in losses))


def _minor_faults() -> int:
    """Minor page faults of this process so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _steady_heap() -> None:
    """glibc's heap keeps what is freed (mmap threshold 64 MiB, trim threshold 1 GiB), so a
    step's large tensors reuse pages already faulted in, whatever the allocation history."""
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    if not (libc.mallopt(m_mmap_threshold, 64 * 2**20) and libc.mallopt(m_trim_threshold, 2**30)):
        raise RuntimeError("mallopt refused the thresholds of --steady-heap")


def run(quick: bool, dim: int, batch: int, seq: int, heads: int, device: str = "cpu",
        models: tuple[str, ...] = MODELS) -> dict:
    world = dist.get_world_size()
    shape2d = _fsdp_tp_shape(world)
    names = ("dp", "tp")
    meshes = {
        "tp": {"shardwise": sw.init_device_mesh(device, (world,)),
               "torch_dt": torch_dt.init_device_mesh(device, (world,))},
        "fsdp_tp": {"shardwise": sw.init_device_mesh(device, shape2d, mesh_dim_names=names),
                    "torch_dt": torch_dt.init_device_mesh(device, shape2d,
                                                          mesh_dim_names=names)},
    }
    on = _device(device)
    steps, warmup = (12, 3) if quick else (20, 3)  # medians of 5 steps were too noisy
    kinds = ("shardwise", "torch_dt", "hand")
    results = {"world_size": world, "device": device, "dim": dim, "batch": batch, "seq": seq,
               "heads": heads, "fsdp_tp_mesh": list(shape2d), "models": {}}
    for model in models:
        fsdp = model.endswith("_fsdp_tp")
        dp_rank = meshes["fsdp_tp"]["torch_dt"]["dp"].get_local_rank() if fsdp else 0
        inputs, targets = _inputs(model, warmup + steps, batch, seq, dim, dp_rank, on)
        mods = {k: _build(k, model, dim, heads, seq, meshes, device) for k in kinds}
        # foreach=False: on CUDA torch's default multi-tensor AdamW fails inside DTensor
        # ("got mixed torch.Tensor and DTensor", torch 2.11); all three run the same loop
        opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False)
                for k, m in mods.items()}
        times: dict[str, list[float]] = {k: [] for k in kinds}
        cpu: dict[str, list[float]] = {k: [] for k in kinds}
        faults: dict[str, list[int]] = {k: [] for k in kinds}
        losses: dict[str, list[float]] = {k: [] for k in kinds}

        for i in range(warmup + steps):
            for k in kinds:  # interleaved: every step index runs all three in turn
                dist.barrier()
                faulted = _minor_faults()
                cpu_start, start = time.process_time(), time.perf_counter()
                loss = _step(mods[k], opts[k], inputs[i], targets[i])
                elapsed = time.perf_counter() - start
                cpu_elapsed = time.process_time() - cpu_start
                faulted = _minor_faults() - faulted
                losses[k].append(loss)
                if i >= warmup:
                    times[k].append(elapsed)
                    cpu[k].append(cpu_elapsed)
                    faults[k].append(faulted)
        row: dict = {"mesh": list(shape2d) if fsdp else [world]}
        for k in kinds:
            resident = _state_bytes(mods[k], opts[k])
            dist.barrier()
            step_peak = _peak_bytes(mods[k], opts[k], inputs[0], targets[0])
            peak = torch.tensor([float(resident + step_peak)], device=on)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            median = torch.tensor([statistics.median(times[k]) * 1e3,
                                   statistics.median(cpu[k]) * 1e3,
                                   float(statistics.median(faults[k]))], device=on)
            dist.all_reduce(median, op=dist.ReduceOp.MAX)
            step_ms, cpu_ms, step_faults = median.tolist()
            row[k] = {"step_ms": step_ms, "cpu_ms": cpu_ms, "minor_faults": int(step_faults),
                      "peak_mb": peak.item() / 2**20,
                      "resident_mb": resident / 2**20, "step_peak_mb": step_peak / 2**20}
        # the same tolerance on every rank (dp ranks see other losses): all raise or none does
        bound = torch.tensor([_loss_tolerance(losses["hand"])], device=on)
        dist.all_reduce(bound, op=dist.ReduceOp.MAX)
        tolerance = bound.item()
        for k in ("shardwise", "torch_dt"):  # the largest difference over steps and ranks
            diff = torch.tensor([max(abs(a - b) for a, b in
                                     zip(losses[k], losses["hand"], strict=True))], device=on)
            dist.all_reduce(diff, op=dist.ReduceOp.MAX)
            row[k]["max_loss_diff_vs_hand"] = diff.item()
        row["ratio_time_vs_torch_dt"] = row["shardwise"]["step_ms"] / row["torch_dt"]["step_ms"]
        row["ratio_time_vs_hand"] = row["shardwise"]["step_ms"] / row["hand"]["step_ms"]
        row["ratio_cpu_vs_hand"] = row["shardwise"]["cpu_ms"] / row["hand"]["cpu_ms"]
        row["ratio_mem_vs_torch_dt"] = row["shardwise"]["peak_mb"] / row["torch_dt"]["peak_mb"]
        row["ratio_mem_vs_hand"] = row["shardwise"]["peak_mb"] / row["hand"]["peak_mb"]
        results["models"][model] = row
        diverged = {k: row[k]["max_loss_diff_vs_hand"] for k in ("shardwise", "torch_dt")
                    if not row[k]["max_loss_diff_vs_hand"] <= tolerance}
        if diverged:  # the same on every rank (all-reduced): all raise together
            raise RuntimeError(
                f"{model} on {world} processes: the losses differ from the hand-written step's "
                f"by {diverged} (tolerance {tolerance:.1e}): a variant computes another step"
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results to this file (rank 0)")
    parser.add_argument("--quick", action="store_true", help="fewer steps, smaller model")
    parser.add_argument("--dim", type=int, default=None)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--steady-heap", action="store_true",
                        help="glibc keeps freed heap pages (no refaults; see the docstring)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.steady_heap:
        _steady_heap()
    dist.init_process_group("cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo")
    dim = args.dim or (128 if args.quick else 256)
    batch, seq, heads = (4, 32, 4) if args.quick else (8, 64, 8)
    rank = dist.get_rank()
    try:
        results = run(args.quick, dim, batch, seq, heads, args.device,
                      tuple(args.models.split(",")))
        results["steady_heap"] = args.steady_heap
        dist.barrier()  # no rank tears down while another still has collectives in flight
    finally:
        dist.destroy_process_group()
    if rank == 0:
        _print(results)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)


def _print(results: dict) -> None:
    print(f"TP and FSDP x TP (mesh {tuple(results['fsdp_tp_mesh'])}) training step on "
          f"{results['world_size']} processes ({results['device']}), "
          f"dim {results['dim']}, "
          f"batch {results['batch']}x{results['seq']}; median ms, peak MiB per rank")
    print(f"{'model':<14}{'sw ms':>8}{'DT ms':>8}{'hand ms':>9}{'vs DT':>7}{'vs hand':>9}"
          f"{'sw MiB':>8}{'DT MiB':>8}{'hand MiB':>10}{'vs DT':>7}{'loss diff':>11}")
    for model, r in results["models"].items():
        diff = max(r["shardwise"]["max_loss_diff_vs_hand"], r["torch_dt"]["max_loss_diff_vs_hand"])
        print(f"{model:<14}{r['shardwise']['step_ms']:>8.2f}{r['torch_dt']['step_ms']:>8.2f}"
              f"{r['hand']['step_ms']:>9.2f}{r['ratio_time_vs_torch_dt']:>7.2f}"
              f"{r['ratio_time_vs_hand']:>9.2f}{r['shardwise']['peak_mb']:>8.2f}"
              f"{r['torch_dt']['peak_mb']:>8.2f}{r['hand']['peak_mb']:>10.2f}"
              f"{r['ratio_mem_vs_torch_dt']:>7.2f}{diff:>11.2e}")
    print(f"CPU ms per step (process time) and minor page faults per step, median"
          f"{' (steady heap)' if results.get('steady_heap') else ''}")
    print(f"{'model':<14}{'sw CPU':>8}{'DT CPU':>8}{'hand CPU':>10}{'vs hand':>9}"
          f"{'sw flt':>8}{'DT flt':>8}{'hand flt':>10}")
    for model, r in results["models"].items():
        print(f"{model:<14}{r['shardwise']['cpu_ms']:>8.2f}{r['torch_dt']['cpu_ms']:>8.2f}"
              f"{r['hand']['cpu_ms']:>10.2f}{r['ratio_cpu_vs_hand']:>9.2f}"
              f"{r['shardwise']['minor_faults']:>8}{r['torch_dt']['minor_faults']:>8}"
              f"{r['hand']['minor_faults']:>10}")


if __name__ == "__main__":
    main()
