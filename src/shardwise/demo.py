"""The demo: a small GPT trained with data x tensor (+ sequence) parallelism on a mesh of
simulated devices, beside the same model trained on one device from the same seed.

The sharded model is built on the meta device and materialized straight into its shards by
``parallelize_module``; data parallelism is ``replicate`` (or ``fully_shard`` with ``--fsdp``).
The task is synthetic: every sequence is an arithmetic progression modulo the vocabulary with a
random start and step, so predicting the next token needs the context (attention) and the loss
falls visibly within a few dozen steps.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

import torch
import torch.nn.functional as F
from torch import nn

from . import dispatch as _dispatch  # noqa: F401  (DTensor ops run: the op layer is loaded)
from . import runtime, settings
from .comm import CommCounter
from .deferred_init import deferred_init
from .dtensor import DTensor, local_of
from .factories import distribute_tensor
from .memory import track_allocations
from .mesh import DeviceMesh, init_device_mesh
from .op_inputs import allow_implicit_redistribute
from .ops.random import manual_seed
from .parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    fully_shard,
    loss_parallel,
    parallelize_module,
    replicate,
)
from .placements import Replicate, Shard

# ----- the model ---------------------------------------------------------------------------


@dataclass
class GPTConfig:
    vocab: int = 32
    seq: int = 16
    dim: int = 32
    heads: int = 4  # demo_cli.HEADS: the options are checked without importing this module
    layers: int = 2
    tied: bool = False


class Attention(nn.Module):
    """Causal self-attention with one merged QKV projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)

        def split_heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, d // self.heads).transpose(1, 2)

        att = F.scaled_dot_product_attention(
            split_heads(q), split_heads(k), split_heads(v), is_causal=True
        )
        return self.proj(att.transpose(1, 2).reshape(b, s, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.down = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Positions(nn.Module):
    """Learned position embeddings, added to the token embeddings."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.seq, cfg.dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.weight[: x.shape[1]]


class GPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final norm, an output head (tied to
    the token embedding or not)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = Positions(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if cfg.tied:
            self.head.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.pos(self.tok(ids))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def tensor_parallel_plan(cfg: GPTConfig) -> dict[str, Any]:
    """Megatron-style tensor parallelism with sequence parallel norms: activations between
    blocks are sharded on the sequence dim over 'tp', attention heads and MLP hidden units are
    split over 'tp', the merged QKV weight by ``InterleavedShard`` so each device keeps whole
    heads of q, k and v, and the logits stay split by vocabulary."""
    seq = Shard(1)
    plan: dict[str, Any] = {
        "tok": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=seq, use_local_output=False
        ),
        "blocks.*.norm1": SequenceParallel(),
        "blocks.*.attn.qkv": ColwiseParallel(
            input_layouts=seq, interleave=3, num_heads=cfg.heads, use_local_output=False
        ),
        "blocks.*.attn.proj": RowwiseParallel(output_layouts=seq, use_local_output=False),
        "blocks.*.norm2": SequenceParallel(),
        "blocks.*.mlp.up": ColwiseParallel(input_layouts=seq, use_local_output=False),
        "blocks.*.mlp.down": RowwiseParallel(output_layouts=seq, use_local_output=False),
        "norm": SequenceParallel(),
        # vocabulary-sharded logits, never gathered: the loss runs under loss_parallel()
        "head": ColwiseParallel(input_layouts=seq, use_local_output=False),
    }
    if cfg.tied:  # the head reuses the vocabulary-sharded embedding weight
        del plan["head"]
    return plan


def _child_plan(plan: dict[str, Any], child: str) -> list[tuple[str | None, Any]]:
    """The entries of ``plan`` under module ``child``, keys relative to it (None: the child
    itself)."""
    entries: list[tuple[str | None, Any]] = []
    for key, style in plan.items():
        if key == child:
            entries.append((None, style))
        elif key.startswith(child + "."):
            entries.append((key[len(child) + 1 :], style))
    return entries


# ----- the synthetic task ------------------------------------------------------------------


def make_batch(step: int, batch: int, cfg: GPTConfig, seed: int) -> tuple[torch.Tensor, ...]:
    """Arithmetic progressions modulo ``vocab``: (inputs, next-token targets)."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    start = torch.randint(0, cfg.vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 6, (batch, 1), generator=g)
    tokens = (start + stride * torch.arange(cfg.seq + 1)) % cfg.vocab
    return tokens[:, :-1], tokens[:, 1:]


# ----- the run -----------------------------------------------------------------------------


@dataclass
class DemoResult:
    losses_sharded: list[float]
    losses_single: list[float]
    comm_per_step: dict[tuple[str, str], tuple[float, float]]  # (kind, dim) -> (count, bytes)
    bytes_per_step: list[int]
    memory: dict[str, int | None]  # sharded_peak: None where not measured (rank threads)
    wall_s: float
    max_difference: float
    tolerance: float


def run(args: argparse.Namespace, out: IO[str] | None = None) -> DemoResult:
    """Train both models, print the tables (to ``out``, default stdout); the result says how
    close they came."""
    out = out if out is not None else sys.stdout
    started = time.perf_counter()
    dp_size, tp_size = args.mesh
    cfg = GPTConfig(layers=args.layers, tied=args.tied)
    mesh = init_device_mesh("cpu", (dp_size, tp_size), mesh_dim_names=("dp", "tp"))
    talk = mesh.owner_of(0) == _rank()

    def say(text: str = "") -> None:
        if talk:
            print(text, file=out, flush=True)

    manual_seed(args.seed)
    single = GPT(cfg)
    if settings.RANK_THREAD.get() is None:
        with track_allocations() as sharded_alloc:
            model = sharded_model(cfg, mesh, args.seed, args.fsdp)
        peak: int | None = sharded_alloc.peak_bytes
    else:  # torch's profiler is one per process: rank threads would share (and crash) it
        model = sharded_model(cfg, mesh, args.seed, args.fsdp)
        peak = None
    start_alike(single, model)
    memory = _memory(single, model)
    memory.update(sharded_peak=peak, materialized=_local_bytes(model))

    opt_single = torch.optim.AdamW(single.parameters(), lr=args.lr, weight_decay=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    dp_name = "fully_shard" if args.fsdp else "replicate"
    say(f"GPT ({sum(p.numel() for p in single.parameters())} parameters: {cfg.layers} blocks, "
        f"dim {cfg.dim}, {cfg.heads} heads, vocabulary {cfg.vocab}, sequence {cfg.seq}) on mesh "
        f"dp={dp_size} x tp={tp_size}: {dp_name} on 'dp', tensor + sequence parallel on 'tp'"
        + (", simulated devices in one process" if _world_size() == 1
           else f", {_world_size()} processes (gloo)" if settings.RANK_THREAD.get() is None
           else f", {_world_size()} rank threads of one process"))
    losses_sharded, losses_single, bytes_per_step = [], [], []
    comm: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    names = mesh.mesh_dim_names or ()
    for step in _progress(range(args.steps), talk and not args.no_progress):
        ids, targets = make_batch(step, args.batch, cfg, args.seed)
        losses_single.append(single_step(single, opt_single, ids, targets).item())
        with CommCounter() as counter:
            dloss = sharded_step(model, opt, mesh, ids, targets)
        losses_sharded.append(dloss.full_tensor().item())
        bytes_per_step.append(counter.total_bytes)
        for record in counter.records:
            dims = record.mesh_dim if isinstance(record.mesh_dim, tuple) else (record.mesh_dim,)
            entry = comm[(record.kind, "+".join(names[d] for d in dims))]
            entry[0] += 1 / args.steps
            entry[1] += record.bytes / args.steps
    wall = time.perf_counter() - started
    diffs = [abs(a - b) for a, b in zip(losses_sharded, losses_single, strict=True)]
    worst = max(diffs, default=0.0)
    tolerance = _tolerance(losses_single)
    _loss_table(say, losses_sharded, losses_single)
    say(f"largest difference {worst:.2e} (float32 rounding tolerance {tolerance:.1e}): "
        + ("sharded training matches single-device training" if worst <= tolerance
           else "MISMATCH"))
    _comm_table(say, comm, bytes_per_step)
    _memory_table(say, memory)
    for name in _shown_parameters(model):
        say()
        say(placement_grid(name, model.get_parameter(name)))
    say(f"\nwall time {wall:.1f} s ({args.steps} steps of both models)")
    result = DemoResult(losses_sharded, losses_single,
                        {k: (v[0], v[1]) for k, v in comm.items()}, bytes_per_step, memory,
                        wall, worst, tolerance)
    if args.plot and talk:  # demo_cli checked the file name and matplotlib before training
        plot(result, args.plot)
        say(f"plot written to {args.plot}")
    return result


def start_alike(single: nn.Module, model: nn.Module) -> None:
    """The single-device model takes the sharded model's initial values (each device drew its
    own shard of them, which one device does not draw), so both train from one start."""
    with torch.no_grad():
        for p, q in zip(single.parameters(), model.parameters(), strict=True):
            p.copy_(q.full_tensor() if isinstance(q, DTensor) else q)


def sharded_model(cfg: GPTConfig, mesh: DeviceMesh, seed: int, fsdp: bool = False) -> GPT:
    """The GPT of ``seed`` on ``mesh`` ('dp' x 'tp'), each device drawing its shards: tensor +
    sequence parallel on 'tp', ``replicate`` (or ``fully_shard``) on 'dp'."""
    manual_seed(seed)
    model = deferred_init(GPT, cfg)  # meta: no memory until its shards are known
    plan = tensor_parallel_plan(cfg)
    if fsdp and not cfg.tied:
        # the plan applied child by child keeps the model meta; the root's fully_shard
        # then materializes it straight into its 2-D (dp x tp) shards
        for name, child in model.named_children():
            for key, style in _child_plan(plan, name):
                parallelize_module(child, mesh, style if key is None else {key: style})
    else:
        parallelize_module(model, mesh, plan)  # the root: materializes the tp shards
    if fsdp:
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    else:
        replicate(model, mesh["dp"])
    return model


def single_step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor,
                targets: torch.Tensor) -> torch.Tensor:
    """One training step of the single-device model; its loss."""
    loss = F.cross_entropy(model(ids).transpose(1, 2), targets)  # classes on dim 1
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def sharded_step(model: nn.Module, opt: torch.optim.Optimizer, mesh: DeviceMesh,
                 ids: torch.Tensor, targets: torch.Tensor) -> DTensor:
    """The same step of the sharded model on the global batch (split over 'dp'); its loss."""
    placements = [Shard(0), Replicate()]
    with allow_implicit_redistribute():
        # the global batch as a DTensor: one meaning in one process and across processes
        logits = model(distribute_tensor(ids, mesh, placements))
        dtargets = distribute_tensor(targets, mesh, placements)
        with loss_parallel():  # only around the loss: a torch function mode costs every op
            loss = F.cross_entropy(logits.transpose(1, 2), dtargets)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss


def _rank() -> int:
    return runtime.rank_and_world()[0]


def _world_size() -> int:
    return runtime.rank_and_world()[1]


def _tolerance(losses: Sequence[float]) -> float:
    """A few float32 ulps of the loss per step: reductions summed in another order (per
    device, then across devices) round differently, and the differences compound slowly."""
    scale = max((abs(v) for v in losses), default=1.0)
    return 16 * torch.finfo(torch.float32).eps * scale * max(1.0, math.sqrt(len(losses)))


def _progress(steps: range, show: bool) -> Any:
    if not show:
        return steps
    try:
        from tqdm import tqdm
    except ImportError:  # the progress bar is optional (pip install shardwise[demo])
        return steps
    return tqdm(steps, desc="training", unit="step", file=sys.stderr)


def _loss_table(say: Any, sharded: Sequence[float], single: Sequence[float]) -> None:
    say(f"\n{'step':>5}  {'loss sharded':>13}  {'loss single':>12}  {'difference':>10}")
    n = len(sharded)
    shown = sorted({*range(min(n, 5)), *range(max(n - 3, 0), n), *range(0, n, 10)})
    for i in shown:
        diff = abs(sharded[i] - single[i])
        say(f"{i:>5}  {sharded[i]:>13.6f}  {single[i]:>12.6f}  {diff:>10.2e}")


def _comm_table(say: Any, comm: dict, bytes_per_step: Sequence[int]) -> None:
    say(f"\ncommunication per step (ring-model bytes received, summed over this process's "
        f"devices; mean of {len(bytes_per_step)} steps)")
    say(f"  {'collective':<15} {'mesh dim':<8} {'count':>6} {'bytes':>10}")
    for (kind, dim), (count, nbytes) in sorted(comm.items()):
        say(f"  {kind:<15} {dim:<8} {count:>6.1f} {nbytes:>10.0f}")
    total = sum(bytes_per_step) / max(len(bytes_per_step), 1)
    say(f"  {'total':<15} {'':<8} {'':>6} {total:>10.0f}")


def _local_bytes(model: nn.Module) -> int:
    """Bytes of the parameter pieces this process holds."""
    return sum(
        c.numel() * c.element_size()
        for p in model.parameters()
        for c in (local_of(p).pieces if isinstance(p, DTensor) else [p])
    )


def _memory(single: nn.Module, model: nn.Module) -> dict[str, int]:
    """Parameter bytes of the single-device model, of the sharded model's largest device of
    this process, and of the largest parameter."""
    per_device: dict[int, int] = defaultdict(int)
    for p in model.parameters():
        if isinstance(p, DTensor):
            for d, c in zip(p.device_mesh.local_device_ids, local_of(p).pieces, strict=True):
                per_device[d] += c.numel() * c.element_size()
    return {
        "single_model": sum(p.numel() * p.element_size() for p in single.parameters()),
        "sharded_per_device": max(per_device.values()),
        "largest_parameter": max(p.numel() * p.element_size() for p in single.parameters()),
    }


def _memory_table(say: Any, memory: dict[str, Any]) -> None:
    bound = memory["materialized"] + memory["largest_parameter"]
    say("\nparameter memory (bytes)")
    say(f"  single-device model                {memory['single_model']:>9}")
    say(f"  sharded model, largest device here {memory['sharded_per_device']:>9}")
    if memory["sharded_peak"] is None:
        say("  building the sharded model from meta: peak not measured in rank threads (the "
            "allocation profiler is one per process)")
        return
    say(f"  building the sharded model from meta in this process: peak {memory['sharded_peak']}"
        f" <= its shards {memory['materialized']} + one full parameter "
        f"{memory['largest_parameter']}: {memory['sharded_peak'] <= bound}")


def _shown_parameters(model: nn.Module) -> list[str]:
    wanted = ["blocks.0.attn.qkv.weight", "blocks.0.mlp.down.weight", "tok.weight",
              "blocks.0.norm1.weight"]
    names = dict(model.named_parameters())
    return [n for n in wanted if n in names]


def placement_grid(name: str, param: torch.Tensor) -> str:
    """Which slice of ``param`` each device of a 2-D mesh holds, drawn as the mesh grid
    (rows: the first mesh dim, columns: the second)."""
    if not isinstance(param, DTensor):
        return f"{name} {list(param.shape)}: a plain tensor"
    spec = local_of(param).spec
    mesh = spec.mesh
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    grid = mesh.mesh if mesh.ndim == 2 else mesh.mesh.reshape(1, -1)
    cells = [[_slice_text(spec, d) for d in row.tolist()] for row in grid]
    width = max(len(c) for row in cells for c in row) + 2
    lines = [f"{name} {list(param.shape)} placements {list(param.placements)}"]
    col_dim = names[-1]
    row_dim = names[0] if mesh.ndim == 2 else ""
    lines.append(" " * 10 + "".join(f"{f'{col_dim}={j}':^{width}}" for j in range(grid.shape[1])))
    for i, row in enumerate(cells):
        label = f"{row_dim}={i}" if row_dim else ""
        lines.append(f"{label:>8}  " + "".join(f"[{c:^{width - 2}}]" for c in row))
    return "\n".join(lines)


def _slice_text(spec: Any, device: int) -> str:
    dims = []
    for runs, size in zip(spec.local_segments(device), spec.shape, strict=True):
        if len(runs) == 1 and runs[0] == (0, size):
            dims.append(":")
        else:
            dims.append("+".join(f"{a}:{b}" for a, b in runs))
    return f"d{device} " + ",".join(dims)


def plot(result: DemoResult, path: str) -> None:
    """Loss curves of both models and bytes per step, as a PNG."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'shardwise[demo]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_bytes) = plt.subplots(1, 2, figsize=(10, 4))
    steps = range(len(result.losses_single))
    ax_loss.plot(steps, result.losses_single, label="single device", linewidth=3, alpha=0.5)
    ax_loss.plot(steps, result.losses_sharded, label="sharded", linestyle="--")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("cross entropy")
    ax_loss.set_title("training loss")
    ax_loss.legend()
    labels = [f"{kind}\n{dim}" for kind, dim in result.comm_per_step]
    ax_bytes.bar(labels, [b for _, b in result.comm_per_step.values()])
    ax_bytes.set_ylabel("bytes per step")
    ax_bytes.set_title("communication per step")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
