"""A compiled tensor-parallel training step: shardwise vs hand-written tensor parallelism on
local tensors vs torch.distributed.tensor, each compiled the same way, in the same run,
interleaved.

The models, plans and the three variants are ``bench_training.py``'s (an MLP and a
transformer block; ``parallelize_module`` with ColwiseParallel/RowwiseParallel for shardwise and
torch DTensor, Megatron's f/g functions for the hand-written one). Two ways to compile, each
with ``--backend`` (inductor by default):

- ``fwd``: ``torch.compile`` (fullgraph) of forward and loss; the backward runs the compiled
  backward graph and the AdamW update runs eagerly.
- ``full``: the whole step, ``zero_grad``, forward, loss, ``backward`` and ``AdamW.step()``, as
  one compiled function, as users compile a DTensor training step: dynamo breaks where it
  breaks on any model (``zero_grad``, ``backward``, the optimizer's own ``graph_break()``) and
  compiles the optimizer update over the (DTensor) parameters.

Reported per variant: the median step time and (``fwd``) the forward+backward time alone,
slowest rank; how long the first (compiling) call took; for ``full``, how many frames dynamo
compiled after the warmup steps (recompiles: 0 expected; the optimizer's state appears in the
first step, so the second compiles again, for plain tensors too).

Run: python -m shardwise.launch --nproc 2 bench/bench_compile.py [--json FILE] [--quick]
(``--nproc 1``: a 1-device mesh in one process).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_training import _build, _local
from torch.distributed import tensor as torch_dt

import shardwise as sw
from shardwise.tracing import eager_under_dynamo

KINDS = ("shardwise", "hand", "torch_dt")
VARIANTS = ("fwd", "full")


def _compiled_loss(module: torch.nn.Module, backend: str):
    def loss(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(_local(module(x)), target)

    return torch.compile(loss, backend=backend, fullgraph=True)


def _compiled_step(module: torch.nn.Module, opt: torch.optim.Optimizer, backend: str):
    """The whole training step as one compiled function (dynamo splits it where it must)."""

    def step(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(_local(module(x)), target)
        loss.backward()
        opt.step()
        return loss.detach()

    return torch.compile(step, backend=backend)


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _frames() -> int:
    """Frames dynamo has tried to compile so far (a cache hit adds none)."""
    return torch._dynamo.utils.counters["frames"]["total"]


def _one_step(variant: str, fn, opt, x, target) -> tuple[float, float, float]:
    """(loss, seconds to the end of backward, seconds in all) for one step."""
    start = time.perf_counter()
    if variant == "full":
        loss = fn(x, target)
        end = time.perf_counter()
        return loss.item(), end - start, end - start
    opt.zero_grad(set_to_none=True)
    loss = fn(x, target)
    loss.backward()
    middle = time.perf_counter()
    opt.step()
    end = time.perf_counter()
    return loss.item(), middle - start, end - start


def _let_torch_dtensor_backward_run() -> None:
    """torch 2.13's DTensor fails the ``full`` variant as shipped: the eager backward after
    dynamo's break at ``loss.backward()`` rebuilds DTensors from the compiled graph's outputs
    and dynamo tries to trace ``DTensor.__tensor_unflatten__`` there (``SymNodeVariable() is not
    a constant``). The benchmark gives it what shardwise does for its own: that code runs as it
    is under dynamo."""
    eager_under_dynamo(torch_dt.DTensor.__tensor_unflatten__)


def run(quick: bool, backend: str, dim: int, batch: int, seq: int, heads: int) -> dict:
    world = dist.get_world_size()
    meshes = {
        "shardwise": sw.init_device_mesh("cpu", (world,)),
        "torch_dt": torch_dt.init_device_mesh("cpu", (world,)),
    }
    steps, warmup = (5, 2) if quick else (10, 2)
    results = {"world_size": world, "backend": backend, "dim": dim, "batch": batch, "seq": seq,
               "heads": heads, "load_avg": list(os.getloadavg()), "models": {}}
    runs = [(v, k) for v in VARIANTS for k in KINDS]
    _let_torch_dtensor_backward_run()
    for model in ("mlp", "block"):
        shape = (batch * seq, dim) if model == "mlp" else (batch, seq, dim)
        g = torch.Generator().manual_seed(1)
        inputs = [torch.randn(shape, generator=g) for _ in range(warmup + steps)]
        targets = [torch.randn(shape, generator=g) for _ in range(warmup + steps)]
        torch._dynamo.reset()
        fns, opts = {}, {}
        for v, k in runs:
            module = _build(k, model, dim, heads, meshes, "cpu")
            opts[v, k] = torch.optim.AdamW(module.parameters(), lr=1e-3)
            fns[v, k] = (_compiled_step(module, opts[v, k], backend) if v == "full"
                         else _compiled_loss(module, backend))
        step_t: dict = {r: [] for r in runs}
        fwd_bwd_t: dict = {r: [] for r in runs}
        losses: dict = {r: [] for r in runs}
        first: dict = {}
        frames = dict.fromkeys(runs, 0)  # frames dynamo compiled after the warmup steps
        for i in range(warmup + steps):
            for r in runs:  # interleaved: every step index runs all of them in turn
                dist.barrier()
                before = _frames()
                loss, fwd_bwd, total = _one_step(r[0], fns[r], opts[r], inputs[i], targets[i])
                if i >= warmup:
                    frames[r] += _frames() - before
                losses[r].append(loss)
                if i == 0:
                    first[r] = total
                if i >= warmup:
                    step_t[r].append(total)
                    fwd_bwd_t[r].append(fwd_bwd)
        row: dict = {}
        for v, k in runs:
            r = (v, k)
            row.setdefault(v, {})[k] = {
                "step_ms": _max_over_ranks(statistics.median(step_t[r]) * 1e3),
                "fwd_bwd_ms": _max_over_ranks(statistics.median(fwd_bwd_t[r]) * 1e3),
                "compile_s": _max_over_ranks(first[r]),
                "recompiles": int(_max_over_ranks(frames[r])),
                "max_loss_diff_vs_hand": max(
                    abs(a - b) for a, b in zip(losses[r], losses[v, "hand"], strict=True)
                ),
            }
        for v in VARIANTS:
            for other in ("hand", "torch_dt"):
                ratio = row[v]["shardwise"]["step_ms"] / row[v][other]["step_ms"]
                row[v][f"ratio_step_vs_{other}"] = ratio
        for other in ("hand", "torch_dt"):  # the fwd variant's, under their older names
            row[f"ratio_step_vs_{other}"] = row["fwd"][f"ratio_step_vs_{other}"]
            row[f"ratio_fwd_bwd_vs_{other}"] = (
                row["fwd"]["shardwise"]["fwd_bwd_ms"] / row["fwd"][other]["fwd_bwd_ms"]
            )
        row.update(row.pop("fwd"))  # shardwise/hand/torch_dt at the top: the fwd variant
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
    load = ", ".join(f"{x:.1f}" for x in results["load_avg"])
    print(f"compiled TP step ({results['backend']}) on {results['world_size']} gloo processes, "
          f"dim {results['dim']}, batch {results['batch']}x{results['seq']}, load average "
          f"{load}; median ms")
    print("fwd: forward+loss compiled (fullgraph), AdamW eager")
    print(f"{'model':<7}{'sw':>8}{'hand':>8}{'DT':>8}{'vs hand':>9}{'vs DT':>7}"
          f"{'fb vs hand':>12}{'compile s sw/hand/DT':>24}{'loss diff':>11}")
    for model, r in results["models"].items():
        compile_s = "/".join(f"{r[k]['compile_s']:.1f}" for k in KINDS)
        diff = max(r[k]["max_loss_diff_vs_hand"] for k in ("shardwise", "torch_dt"))
        print(f"{model:<7}{r['shardwise']['step_ms']:>8.2f}{r['hand']['step_ms']:>8.2f}"
              f"{r['torch_dt']['step_ms']:>8.2f}{r['ratio_step_vs_hand']:>9.2f}"
              f"{r['ratio_step_vs_torch_dt']:>7.2f}{r['ratio_fwd_bwd_vs_hand']:>12.2f}"
              f"{compile_s:>24}{diff:>11.2e}")
    print("full: zero_grad, forward, loss, backward, AdamW.step() compiled as one function")
    print(f"{'model':<7}{'sw':>8}{'hand':>8}{'DT':>8}{'vs hand':>9}{'vs DT':>7}"
          f"{'recompiles sw/hand/DT':>23}{'compile s sw/hand/DT':>24}"
          f"{'loss diff':>11}")
    for model, r in results["models"].items():
        f = r["full"]
        compile_s = "/".join(f"{f[k]['compile_s']:.1f}" for k in KINDS)
        recompiles = "/".join(str(f[k]["recompiles"]) for k in KINDS)
        diff = max(f[k]["max_loss_diff_vs_hand"] for k in ("shardwise", "torch_dt"))
        print(f"{model:<7}{f['shardwise']['step_ms']:>8.2f}{f['hand']['step_ms']:>8.2f}"
              f"{f['torch_dt']['step_ms']:>8.2f}{f['ratio_step_vs_hand']:>9.2f}"
              f"{f['ratio_step_vs_torch_dt']:>7.2f}{recompiles:>23}"
              f"{compile_s:>24}{diff:>11.2e}")


if __name__ == "__main__":
    main()
