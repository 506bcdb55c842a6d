"""A compiled tensor-parallel training step: shardwise vs hand-written tensor parallelism on
local tensors vs torch.distributed.tensor, each compiled the same way, in the same run,
interleaved.

The models, plans and the three variants are ``bench_training.py``'s (an MLP and a
transformer block; ``parallelize_module`` with ColwiseParallel/RowwiseParallel for shardwise and
torch DTensor, Megatron's f/g functions for the hand-written one). ``torch.compile`` (fullgraph,
``--backend``, inductor by default) compiles forward and loss; the backward runs the compiled
backward graph and the AdamW update runs eagerly, the same for the three. Reported: the median
step time (forward, backward, optimizer) and the median forward+backward time alone, slowest
rank, and how long the first (compiling) call took.

Run: python -m shardwise.launch --nproc 2 bench/bench_compile.py [--json FILE] [--quick]
(``--nproc 1``: a 1-device mesh in one process).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_training import _build, _local
from torch.distributed import tensor as torch_dt

import shardwise as sw

KINDS = ("shardwise", "hand", "torch_dt")


def _compiled_loss(module: torch.nn.Module, backend: str):  # noqa: ANN202
    def loss(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(_local(module(x)), target)

    return torch.compile(loss, backend=backend, fullgraph=True)


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def run(quick: bool, backend: str, dim: int, batch: int, seq: int, heads: int) -> dict:
    world = dist.get_world_size()
    meshes = {
        "shardwise": sw.init_device_mesh("cpu", (world,)),
        "torch_dt": torch_dt.init_device_mesh("cpu", (world,)),
    }
    steps, warmup = (5, 2) if quick else (10, 2)
    results = {"world_size": world, "backend": backend, "dim": dim, "batch": batch, "seq": seq,
               "heads": heads, "models": {}}
    for model in ("mlp", "block"):
        shape = (batch * seq, dim) if model == "mlp" else (batch, seq, dim)
        g = torch.Generator().manual_seed(1)
        inputs = [torch.randn(shape, generator=g) for _ in range(warmup + steps)]
        targets = [torch.randn(shape, generator=g) for _ in range(warmup + steps)]
        mods = {k: _build(k, model, dim, heads, meshes) for k in KINDS}
        opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in mods.items()}
        torch._dynamo.reset()
        losses_fn = {k: _compiled_loss(m, backend) for k, m in mods.items()}
        step_t: dict[str, list[float]] = {k: [] for k in KINDS}
        fwd_bwd_t: dict[str, list[float]] = {k: [] for k in KINDS}
        losses: dict[str, list[float]] = {k: [] for k in KINDS}
        first: dict[str, float] = {}
        for i in range(warmup + steps):
            for k in KINDS:  # interleaved: every step index runs all three in turn
                dist.barrier()
                start = time.perf_counter()
                opts[k].zero_grad(set_to_none=True)
                loss = losses_fn[k](inputs[i], targets[i])
                loss.backward()
                middle = time.perf_counter()
                opts[k].step()
                end = time.perf_counter()
                losses[k].append(loss.item())
                if i == 0:
                    first[k] = end - start
                if i >= warmup:
                    step_t[k].append(end - start)
                    fwd_bwd_t[k].append(middle - start)
        row: dict = {}
        for k in KINDS:
            row[k] = {
                "step_ms": _max_over_ranks(statistics.median(step_t[k]) * 1e3),
                "fwd_bwd_ms": _max_over_ranks(statistics.median(fwd_bwd_t[k]) * 1e3),
                "compile_s": _max_over_ranks(first[k]),
                "max_loss_diff_vs_hand": max(
                    abs(a - b) for a, b in zip(losses[k], losses["hand"], strict=True)
                ),
            }
        for other in ("hand", "torch_dt"):
            row[f"ratio_step_vs_{other}"] = row["shardwise"]["step_ms"] / row[other]["step_ms"]
            row[f"ratio_fwd_bwd_vs_{other}"] = (
                row["shardwise"]["fwd_bwd_ms"] / row[other]["fwd_bwd_ms"]
            )
        results["models"][model] = row
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results to this file (rank 0)")
    parser.add_argument("--quick", action="store_true", help="fewer steps, smaller model")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--dim", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    dim = args.dim or (128 if args.quick else 256)
    batch, seq, heads = (4, 32, 4) if args.quick else (8, 64, 8)
    rank = dist.get_rank()
    try:
        results = run(args.quick, args.backend, dim, batch, seq, heads)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        _print(results)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)


def _print(results: dict) -> None:
    print(f"compiled TP step ({results['backend']}) on {results['world_size']} gloo processes, "
          f"dim {results['dim']}, batch {results['batch']}x{results['seq']}; median ms")
    print(f"{'model':<7}{'sw':>8}{'hand':>8}{'DT':>8}{'vs hand':>9}{'vs DT':>7}"
          f"{'fb vs hand':>12}{'compile s sw/hand/DT':>24}{'loss diff':>11}")
    for model, r in results["models"].items():
        compile_s = "/".join(f"{r[k]['compile_s']:.1f}" for k in KINDS)
        diff = max(r[k]["max_loss_diff_vs_hand"] for k in ("shardwise", "torch_dt"))
        print(f"{model:<7}{r['shardwise']['step_ms']:>8.2f}{r['hand']['step_ms']:>8.2f}"
              f"{r['torch_dt']['step_ms']:>8.2f}{r['ratio_step_vs_hand']:>9.2f}"
              f"{r['ratio_step_vs_torch_dt']:>7.2f}{r['ratio_fwd_bwd_vs_hand']:>12.2f}"
              f"{compile_s:>24}{diff:>11.2e}")


if __name__ == "__main__":
    main()
