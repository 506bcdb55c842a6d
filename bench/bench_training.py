"""Tensor-parallel training steps: shardwise vs torch.distributed.tensor vs hand-written tensor
parallelism on plain local tensors, the same model code, in the same run, interleaved.

Two models: an MLP (Linear -> GELU -> Linear) and a transformer block (LayerNorm, attention with
q/k/v/o projections, LayerNorm, MLP, residuals). One step is forward, backward and an AdamW
update. The three variants:

- ``shardwise``: ``shardwise.parallel.parallelize_module`` with ColwiseParallel/RowwiseParallel;
- ``torch_dt``: ``torch.distributed.tensor.parallel.parallelize_module`` with torch's styles
  (the same plan dict, the other import);
- ``hand``: Megatron by hand on local tensors: each rank keeps its slice of the weights, an
  identity-forward/all-reduce-backward function in front of every column-parallel linear and an
  all-reduce-forward/identity-backward function after every row-parallel one (bias added after).

Peak memory is measured with the PyTorch profiler's CPU allocator events
(``profile_memory=True``): every allocation and free through torch's CPU allocator during one
step, in time order; the peak of the running sum, plus the bytes of parameters, gradients and
optimizer state alive before the step, is the peak tensor memory of the rank. Allocations gloo
makes outside torch's allocator are not counted: gloo's all_reduce works in its own buffers
(DTensor's and the hand-written steps' collectives), while its all_gather_into_tensor copies
through a flat buffer from torch's allocator (counted; shardwise receives point to point, in
place, so its all_reduce's buffers are all counted: the result and a combine accumulator).

AdamW runs its per-parameter loop (``foreach=False``) for all three. On ``--device cuda`` (one
GPU per process, NCCL) the peak is ``torch.cuda.max_memory_allocated``
during one step and every step ends with a synchronize (its ``loss.item()``).

Run: python -m shardwise.launch --nproc 2 bench/bench_training.py [--json FILE] [--quick]
[--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import tensor as torch_dt
from torch.distributed.tensor import parallel as torch_tp

import shardwise as sw
from shardwise import parallel as sw_tp


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


def _plan(model: str, colwise, rowwise) -> dict:
    if model == "mlp":
        return {"up": colwise(), "down": rowwise()}
    return {"q": colwise(), "k": colwise(), "v": colwise(), "o": rowwise(),
            "mlp.up": colwise(), "mlp.down": rowwise()}


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _hand_parallelize(module: nn.Module, plan: dict) -> None:
    """Keep this rank's slice of every planned linear and put f and g where Megatron does."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for name, style in plan.items():
        lin = module.get_submodule(name)
        if style == "col":
            lin.weight = nn.Parameter(lin.weight.detach().chunk(world, 0)[rank].clone())
            lin.bias = nn.Parameter(lin.bias.detach().chunk(world, 0)[rank].clone())
            lin.register_forward_pre_hook(lambda m, args: (_CopyToTP.apply(args[0]),))
        else:
            lin.weight = nn.Parameter(lin.weight.detach().chunk(world, 1)[rank].clone())
            lin.tp_bias = nn.Parameter(lin.bias.detach().clone())
            lin.bias = None
            lin.register_forward_hook(lambda m, args, out: _ReduceFromTP.apply(out) + m.tp_bias)


def _build(kind: str, model: str, dim: int, heads: int, meshes: dict, device: str) -> nn.Module:
    torch.manual_seed(0)
    module = (MLP(dim) if model == "mlp" else Block(dim, heads)).to(_device(device))
    if kind == "shardwise":
        sw_tp.parallelize_module(
            module, meshes["shardwise"],
            _plan(model, sw_tp.ColwiseParallel, sw_tp.RowwiseParallel),
        )
    elif kind == "torch_dt":
        torch_tp.parallelize_module(
            module, meshes["torch_dt"],
            _plan(model, torch_tp.ColwiseParallel, torch_tp.RowwiseParallel),
        )
    else:
        _hand_parallelize(module, _plan(model, lambda: "col", lambda: "row"))
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
    loss = F.mse_loss(_local(module(x)), target)
    loss.backward()
    opt.step()
    return loss.item()


def run(quick: bool, dim: int, batch: int, seq: int, heads: int, device: str = "cpu") -> dict:
    world = dist.get_world_size()
    meshes = {
        "shardwise": sw.init_device_mesh(device, (world,)),
        "torch_dt": torch_dt.init_device_mesh(device, (world,)),
    }
    on = _device(device)
    steps, warmup = (12, 3) if quick else (20, 3)  # medians of 5 steps were too noisy
    kinds = ("shardwise", "torch_dt", "hand")
    results = {"world_size": world, "device": device, "dim": dim, "batch": batch, "seq": seq,
               "heads": heads, "models": {}}
    for model in ("mlp", "block"):
        shape = (batch * seq, dim) if model == "mlp" else (batch, seq, dim)
        g = torch.Generator().manual_seed(1)
        inputs = [torch.randn(shape, generator=g).to(on) for _ in range(warmup + steps)]
        targets = [torch.randn(shape, generator=g).to(on) for _ in range(warmup + steps)]
        mods = {k: _build(k, model, dim, heads, meshes, device) for k in kinds}
        # foreach=False: on CUDA torch's default multi-tensor AdamW fails inside DTensor
        # ("got mixed torch.Tensor and DTensor", torch 2.11); all three run the same loop
        opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False)
                for k, m in mods.items()}
        times: dict[str, list[float]] = {k: [] for k in kinds}
        losses: dict[str, list[float]] = {k: [] for k in kinds}

        for i in range(warmup + steps):
            for k in kinds:  # interleaved: every step index runs all three in turn
                dist.barrier()
                start = time.perf_counter()
                loss = _step(mods[k], opts[k], inputs[i], targets[i])
                elapsed = time.perf_counter() - start
                losses[k].append(loss)
                if i >= warmup:
                    times[k].append(elapsed)
        row: dict = {}
        for k in kinds:
            resident = _state_bytes(mods[k], opts[k])
            dist.barrier()
            step_peak = _peak_bytes(mods[k], opts[k], inputs[0], targets[0])
            peak = torch.tensor([float(resident + step_peak)], device=on)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            median = torch.tensor([statistics.median(times[k]) * 1e3], device=on)
            dist.all_reduce(median, op=dist.ReduceOp.MAX)
            row[k] = {"step_ms": median.item(), "peak_mb": peak.item() / 2**20,
                      "resident_mb": resident / 2**20, "step_peak_mb": step_peak / 2**20}
        for k in ("shardwise", "torch_dt"):
            row[k]["max_loss_diff_vs_hand"] = max(
                abs(a - b) for a, b in zip(losses[k], losses["hand"], strict=True)
            )
        row["ratio_time_vs_torch_dt"] = row["shardwise"]["step_ms"] / row["torch_dt"]["step_ms"]
        row["ratio_time_vs_hand"] = row["shardwise"]["step_ms"] / row["hand"]["step_ms"]
        row["ratio_mem_vs_torch_dt"] = row["shardwise"]["peak_mb"] / row["torch_dt"]["peak_mb"]
        row["ratio_mem_vs_hand"] = row["shardwise"]["peak_mb"] / row["hand"]["peak_mb"]
        results["models"][model] = row
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results to this file (rank 0)")
    parser.add_argument("--quick", action="store_true", help="fewer steps, smaller model")
    parser.add_argument("--dim", type=int, default=None)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo")
    dim = args.dim or (128 if args.quick else 256)
    batch, seq, heads = (4, 32, 4) if args.quick else (8, 64, 8)
    rank = dist.get_rank()
    try:
        results = run(args.quick, dim, batch, seq, heads, args.device)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        _print(results)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)


def _print(results: dict) -> None:
    print(f"TP training step on {results['world_size']} processes ({results['device']}), "
          f"dim {results['dim']}, "
          f"batch {results['batch']}x{results['seq']}; median ms, peak MiB per rank")
    print(f"{'model':<7}{'sw ms':>8}{'DT ms':>8}{'hand ms':>9}{'vs DT':>7}{'vs hand':>9}"
          f"{'sw MiB':>8}{'DT MiB':>8}{'hand MiB':>10}{'vs DT':>7}{'loss diff':>11}")
    for model, r in results["models"].items():
        diff = max(r["shardwise"]["max_loss_diff_vs_hand"], r["torch_dt"]["max_loss_diff_vs_hand"])
        print(f"{model:<7}{r['shardwise']['step_ms']:>8.2f}{r['torch_dt']['step_ms']:>8.2f}"
              f"{r['hand']['step_ms']:>9.2f}{r['ratio_time_vs_torch_dt']:>7.2f}"
              f"{r['ratio_time_vs_hand']:>9.2f}{r['shardwise']['peak_mb']:>8.2f}"
              f"{r['torch_dt']['peak_mb']:>8.2f}{r['hand']['peak_mb']:>10.2f}"
              f"{r['ratio_mem_vs_torch_dt']:>7.2f}{diff:>11.2e}")


if __name__ == "__main__":
    main()
