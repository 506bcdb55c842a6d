"""A compiled tensor-parallel and FSDP x TP training step: shardwise vs the same parallelism
written by hand on local tensors vs torch.distributed.tensor, each compiled the same way, in the
same run, interleaved.

The models, plans and the three variants are ``bench_training.py``'s, built by its ``_build``:
an MLP and a transformer block (``parallelize_module`` with ColwiseParallel/RowwiseParallel for
shardwise and torch DTensor, Megatron's f/g functions for the hand-written one), and the MLP and
the Llama block under FSDP x TP (``*_fsdp_tp``: then ``fully_shard`` over "dp" of a ("dp", "tp")
mesh, (2, 1) on 2 processes and (1, 1) on 1; FSDP by hand for the hand-written one), each dp
rank on its own rows. Two ways to compile, each with ``--backend`` (inductor by default):

- ``fwd``: ``torch.compile`` (fullgraph) of forward and loss; the backward runs the compiled
  backward graph and the AdamW update runs eagerly. The FSDP x TP models compile without
  fullgraph: all three run their FSDP hooks eagerly (FSDP2's and shardwise's are
  ``torch.compiler.disable``d; the hand-written one's set attributes dynamo cannot trace).
- ``full``: the whole step, ``zero_grad``, forward, loss, ``backward`` and ``AdamW.step()``, as
  one compiled function, as users compile a DTensor training step: dynamo breaks where it
  breaks on any model (``zero_grad``, ``backward``, the optimizer's own ``graph_break()``, the
  FSDP hooks) and compiles the optimizer update over the (DTensor) parameters.

Reported per variant and kind: the median step time and the forward+backward time alone
(``fwd``), slowest rank; how long the first (compiling) call took; how many frames dynamo
compiled after the warmup steps (recompiles: 0 expected; the optimizer's state appears in the
first step, so the second compiles again, for plain tensors too); the graphs dynamo compiled and
the graph breaks it took over all steps (counted for the kind that compiled them: a frame the
kinds share with the same guards, as the step's ``return loss.detach()`` after the optimizer's
break, is compiled for the first kind, shardwise, and hit in the cache by the others); the
largest loss difference from the hand-written step's over steps and ranks. A kind whose step
raises (dynamo cannot compile it) is recorded with its error instead, its ratios None.

Run: python -m shardwise.launch --nproc 2 bench/bench_compile.py [--json FILE] [--quick]
[--models mlp,mlp_fsdp_tp,...] (``--nproc 1``: 1-device meshes in one process).
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
from bench_training import _build, _fsdp_tp_shape, _inputs, _local
from torch.distributed import tensor as torch_dt

import shardwise as sw
from shardwise.tracing import eager_under_dynamo

KINDS = ("shardwise", "hand", "torch_dt")
VARIANTS = ("fwd", "full")
MODELS = ("mlp", "block", "mlp_fsdp_tp", "llama_fsdp_tp")


def _compiled_loss(module: torch.nn.Module, backend: str, fullgraph: bool):
    def loss(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(_local(module(x)), target)

    return torch.compile(loss, backend=backend, fullgraph=fullgraph)


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


def _graphs() -> tuple[int, int]:
    """(graphs dynamo has compiled, graph breaks it has taken) so far."""
    counters = torch._dynamo.utils.counters
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


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


def _timings(steps: list, fwd_bwd: list, first: float, frames: int, losses: list,
             hand_losses: list) -> dict:
    """One kind's numbers, the slowest rank's (the largest loss difference over ranks: dp ranks
    train on other rows)."""
    return {
        "step_ms": _max_over_ranks(statistics.median(steps) * 1e3),
        "fwd_bwd_ms": _max_over_ranks(statistics.median(fwd_bwd) * 1e3),
        "compile_s": _max_over_ranks(first),
        "recompiles": int(_max_over_ranks(frames)),
        "max_loss_diff_vs_hand": _max_over_ranks(
            max(abs(a - b) for a, b in zip(losses, hand_losses, strict=True))),
    }


def _ratio(row: dict, key: str, other: str) -> float | None:
    """shardwise's ``key`` over ``other``'s; None when either failed to compile."""
    if "error" in row["shardwise"] or "error" in row[other]:
        return None
    return row["shardwise"][key] / row[other][key]


def run(quick: bool, backend: str, dim: int, batch: int, seq: int, heads: int,
        models: tuple[str, ...] = MODELS) -> dict:
    world = dist.get_world_size()
    shape2d = _fsdp_tp_shape(world)
    names = ("dp", "tp")
    meshes = {  # bench_training's: a 1-D tp mesh, and the (dp, tp) mesh of FSDP x TP
        "tp": {"shardwise": sw.init_device_mesh("cpu", (world,)),
               "torch_dt": torch_dt.init_device_mesh("cpu", (world,))},
        "fsdp_tp": {"shardwise": sw.init_device_mesh("cpu", shape2d, mesh_dim_names=names),
                    "torch_dt": torch_dt.init_device_mesh("cpu", shape2d,
                                                          mesh_dim_names=names)},
    }
    steps, warmup = (5, 2) if quick else (10, 2)
    results = {"world_size": world, "backend": backend, "dim": dim, "batch": batch, "seq": seq,
               "heads": heads, "fsdp_tp_mesh": list(shape2d),
               "load_avg": list(os.getloadavg()), "models": {}}
    _let_torch_dtensor_backward_run()
    for model in models:
        fsdp = model.endswith("_fsdp_tp")
        dp_rank = meshes["fsdp_tp"]["torch_dt"]["dp"].get_local_rank() if fsdp else 0
        inputs, targets = _inputs(model, warmup + steps, batch, seq, dim, dp_rank,
                                  torch.device("cpu"))
        torch._dynamo.reset()
        runs = [(v, k) for v in VARIANTS for k in KINDS]
        fns, opts = {}, {}
        for v, k in runs:
            module = _build(k, model, dim, heads, seq, meshes, "cpu")
            opts[v, k] = torch.optim.AdamW(module.parameters(), lr=1e-3)
            fns[v, k] = (_compiled_step(module, opts[v, k], backend) if v == "full"
                         else _compiled_loss(module, backend, fullgraph=not fsdp))
        step_t: dict = {r: [] for r in runs}
        fwd_bwd_t: dict = {r: [] for r in runs}
        losses: dict = {r: [] for r in runs}
        first: dict = {}
        frames = dict.fromkeys(runs, 0)  # frames dynamo compiled after the warmup steps
        graphs = {r: [0, 0] for r in runs}  # graphs and graph breaks, all steps
        errors: dict = {}  # a kind that fails to compile: its error, the same on every rank
        for i in range(warmup + steps):
            for r in runs:  # interleaved: every step index runs all of them in turn
                if r in errors:
                    continue
                dist.barrier()
                before, graphs_before = _frames(), _graphs()
                try:
                    loss, fwd_bwd, total = _one_step(r[0], fns[r], opts[r], inputs[i],
                                                     targets[i])
                except Exception as e:  # recorded and printed, not hidden
                    errors[r] = f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"
                    print(f"{model} {r[0]} {r[1]}: step {i} failed: {errors[r]}", flush=True)
                    continue
                graphs[r][0] += _graphs()[0] - graphs_before[0]
                graphs[r][1] += _graphs()[1] - graphs_before[1]
                if i >= warmup:
                    frames[r] += _frames() - before
                losses[r].append(loss)
                if i == 0:
                    first[r] = total
                if i >= warmup:
                    step_t[r].append(total)
                    fwd_bwd_t[r].append(fwd_bwd)
        row: dict = {"mesh": list(shape2d) if fsdp else [world], "fwd_fullgraph": not fsdp}
        for v, k in runs:
            r = (v, k)
            if r in errors or (v, "hand") in errors:
                row.setdefault(v, {})[k] = {"error": errors.get(r, "hand failed")}
                continue
            row.setdefault(v, {})[k] = _timings(step_t[r], fwd_bwd_t[r], first[r], frames[r],
                                                losses[r], losses[v, "hand"])
            row[v][k]["graphs"], row[v][k]["graph_breaks"] = graphs[r]
        for v in VARIANTS:
            for other in ("hand", "torch_dt"):
                row[v][f"ratio_step_vs_{other}"] = _ratio(row[v], "step_ms", other)
        for other in ("hand", "torch_dt"):  # the fwd variant's, under their older names
            row[f"ratio_step_vs_{other}"] = row["fwd"][f"ratio_step_vs_{other}"]
            row[f"ratio_fwd_bwd_vs_{other}"] = _ratio(row["fwd"], "fwd_bwd_ms", other)
        row.update(row.pop("fwd"))  # shardwise/hand/torch_dt at the top: the fwd variant
        results["models"][model] = row
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results to this file (rank 0)")
    parser.add_argument("--quick", action="store_true", help="fewer steps, smaller model")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--dim", type=int, default=None)
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, of {', '.join(MODELS)}")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    dim = args.dim or (128 if args.quick else 256)
    batch, seq, heads = (4, 32, 4) if args.quick else (8, 64, 8)
    rank = dist.get_rank()
    try:
        results = run(args.quick, args.backend, dim, batch, seq, heads,
                      tuple(args.models.split(",")))
        dist.barrier()  # no rank tears down while another still has collectives in flight
    finally:
        dist.destroy_process_group()
    if rank == 0:
        _print(results)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)


def _cell(x: float | None, width: int, fmt: str = ".2f") -> str:
    return f"{'-' if x is None else format(x, fmt):>{width}}"


def _print_variant(results: dict, variant: str) -> None:
    print(f"{'model':<14}{'sw':>8}{'hand':>8}{'DT':>8}{'vs hand':>9}{'vs DT':>7}"
          f"{'recompiles sw/hand/DT':>23}{'graphs/breaks sw; hand; DT':>28}"
          f"{'compile s sw/hand/DT':>24}{'loss diff':>11}")
    for model, r in results["models"].items():
        f = r if variant == "fwd" else r["full"]
        ok = [k for k in KINDS if "error" not in f[k]]
        compile_s = "/".join(f"{f[k]['compile_s']:.1f}" if k in ok else "-" for k in KINDS)
        recompiles = "/".join(str(f[k]["recompiles"]) if k in ok else "-" for k in KINDS)
        graphs = "; ".join(f"{f[k]['graphs']}/{f[k]['graph_breaks']}" if k in ok else "-"
                           for k in KINDS)
        diffs = [f[k]["max_loss_diff_vs_hand"] for k in ("shardwise", "torch_dt") if k in ok]
        print(f"{model:<14}"
              + "".join(_cell(f[k]["step_ms"] if k in ok else None, 8) for k in KINDS)
              + _cell(f["ratio_step_vs_hand"], 9) + _cell(f["ratio_step_vs_torch_dt"], 7)
              + f"{recompiles:>23}{graphs:>28}{compile_s:>24}"
              + _cell(max(diffs) if diffs else None, 11, ".2e"))
        for k in KINDS:
            if k not in ok:
                print(f"  {model} {variant} {k} failed: {f[k]['error']}")


def _print(results: dict) -> None:
    load = ", ".join(f"{x:.1f}" for x in results["load_avg"])
    print(f"compiled TP and FSDP x TP (mesh {tuple(results['fsdp_tp_mesh'])}) step "
          f"({results['backend']}) on {results['world_size']} gloo processes, dim "
          f"{results['dim']}, batch {results['batch']}x{results['seq']}, load average {load}; "
          "median ms (slowest rank)")
    print("fwd: forward+loss compiled (fullgraph; the FSDP x TP models: not, dynamo breaks at "
          "the FSDP hooks), AdamW eager")
    _print_variant(results, "fwd")
    print("full: zero_grad, forward, loss, backward, AdamW.step() compiled as one function")
    _print_variant(results, "full")


if __name__ == "__main__":
    main()
