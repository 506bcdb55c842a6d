"""Communication/computation overlap with ``async_op=True``, FSDP-style: a stack of layers whose
weights are sharded ``Shard(0)`` over 2 gloo processes; each layer all_gathers its weight
(``Shard(0) -> Replicate``) and multiplies the activations by it. In sequence every layer
gathers, then computes; overlapped, the next layer's gather is started (``async_op=True``) before
this layer's matmul, as FSDP prefetches. The same two loops with raw ``torch.distributed``
(``dist.all_gather(..., async_op=True)``) show what gloo itself overlaps on this machine.

On a CPU machine the collective is not free for the computation: gloo over loopback TCP copies
every byte through the kernel on both sides, on the same cores as the matmuls. Overlap can only
fill the time the collective waits, so the benchmark also measures the CPU time the collective
uses (all threads of the process) beside its wall time: the best any overlap can reach is
(matmul + collective CPU) / (matmul + collective wall) when the processes fill the cores.

Run: python -m shardwise.launch --nproc 2 bench/bench_overlap.py [MiB per weight] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import Replicate, Shard


def _cpu_seconds() -> float:
    """CPU time of every thread of this process (gloo's included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall s, process CPU s) of one call, all processes starting together."""
    dist.barrier()
    cpu, start = _cpu_seconds(), time.perf_counter()
    fn()
    return time.perf_counter() - start, _cpu_seconds() - cpu


def _alone(fn: Callable[[], object]) -> float:
    """Wall s of one call in this process, without synchronizing with the others."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mib", nargs="?", type=float, default=2.0,
                        help="MiB of one gathered weight (float32, square)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--json", help="write the results to this file (rank 0)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # one core per process for the matmuls: the cores are all used
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = sw.init_device_mesh("cpu", (world,))
    dim = int((args.mib * 2**20 / 4) ** 0.5) // world * world
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(dim, dim, generator=gen) / dim**0.5 for _ in range(args.layers)]
    weights = [sw.distribute_tensor(w, mesh, [Shard(0)]) for w in full]
    shards = [sw.tf.unpack(w)[0] for w in weights]

    def gather(layer: int) -> torch.Tensor:
        return weights[layer].redistribute(placements=[Replicate()]).to_local()

    def raw_gather(layer: int, async_op: bool = False) -> tuple[torch.Tensor, object]:
        whole = torch.empty(dim, dim)
        work = dist.all_gather(list(whole.chunk(world)), shards[layer], async_op=async_op)
        return whole, work

    # the batch whose matmul takes about as long as one gather (each process on its own),
    # then the largest of the processes' choices
    t_gather = statistics.median(_timed(lambda: gather(0))[0] for _ in range(5))
    batch = 8
    while batch < 1 << 14:
        x = torch.randn(batch, dim)
        x @ full[0]
        t_matmul = statistics.median(_alone(lambda x=x: x @ full[0]) for _ in range(3))
        if t_matmul >= t_gather:
            break
        batch = int(batch * 1.25) + 1
    agreed = torch.tensor([batch])
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    x0 = torch.randn(int(agreed.item()), dim, generator=gen)

    def compute_only() -> torch.Tensor:
        x = x0
        for w in full:
            x = x @ w
        return x

    def sequential() -> torch.Tensor:
        x = x0
        for layer in range(args.layers):
            x = x @ gather(layer)
        return x

    def overlapped() -> torch.Tensor:
        x = x0
        pending = weights[0].redistribute(placements=[Replicate()], async_op=True)
        for layer in range(args.layers):
            w = pending.to_local()  # waits on first use, in the matmul
            if layer + 1 < args.layers:  # prefetch the next layer's weight
                pending = weights[layer + 1].redistribute(placements=[Replicate()],
                                                          async_op=True)
            x = x @ w
        return x

    def gathers_only() -> None:
        for layer in range(args.layers):
            gather(layer)

    def raw_sequential() -> torch.Tensor:
        x = x0
        for layer in range(args.layers):
            x = x @ raw_gather(layer)[0]
        return x

    def raw_overlapped() -> torch.Tensor:
        x = x0
        whole, work = raw_gather(0, async_op=True)
        for layer in range(args.layers):
            work.wait()
            w = whole
            if layer + 1 < args.layers:
                whole, work = raw_gather(layer + 1, async_op=True)
            x = x @ w
        return x

    def raw_gathers_only() -> None:
        for layer in range(args.layers):
            raw_gather(layer)

    want = compute_only()
    for fn in (sequential, overlapped, raw_sequential, raw_overlapped):
        assert torch.equal(fn(), want), f"{fn.__name__} differs from the plain matmuls"
    runs = {
        "matmuls": compute_only, "gathers": gathers_only, "sequential": sequential,
        "overlapped": overlapped, "raw_gathers": raw_gathers_only,
        "raw_sequential": raw_sequential, "raw_overlapped": raw_overlapped,
    }
    walls: dict[str, list[float]] = {k: [] for k in runs}
    cpus: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.repeat):  # interleaved: the machine's noise hits every variant alike
        for name, fn in runs.items():
            wall, cpu = _timed(fn)
            walls[name].append(wall)
            cpus[name].append(cpu)
    names = list(runs)
    # per variant, the median over repeats; then the slowest process's
    summary = torch.tensor([statistics.median(walls[k]) for k in names]
                           + [statistics.median(cpus[k]) for k in names], dtype=torch.float64)
    dist.all_reduce(summary, op=dist.ReduceOp.MAX)
    ms = {k: summary[j].item() * 1e3 / args.layers for j, k in enumerate(names)}
    cpu_ms = {k: summary[len(names) + j].item() * 1e3 / args.layers
              for j, k in enumerate(names)}
    result = {
        "mib": args.mib, "layers": args.layers, "dim": dim, "batch": x0.shape[0],
        "cores": os.cpu_count(), "processes": world,
        "matmul_ms": ms["matmuls"], "all_gather_ms": ms["gathers"],
        "all_gather_cpu_ms": cpu_ms["gathers"],
        "sequential_ms": ms["sequential"], "overlapped_ms": ms["overlapped"],
        "ratio": ms["overlapped"] / ms["sequential"],
        "raw_all_gather_ms": ms["raw_gathers"], "raw_all_gather_cpu_ms": cpu_ms["raw_gathers"],
        "raw_sequential_ms": ms["raw_sequential"], "raw_overlapped_ms": ms["raw_overlapped"],
        "raw_ratio": ms["raw_overlapped"] / ms["raw_sequential"],
    }
    # what the cores allow: with a matmul on every core, the collective's CPU time adds to
    # the matmuls' and only its waiting can hide; with idle cores, the longer of the two remains
    mm, wall = ms["matmuls"], ms["gathers"]
    spare = (os.cpu_count() or 1) > world
    result["bound_ratio"] = (max(mm, wall) if spare else mm + cpu_ms["gathers"]) / (mm + wall)
    if rank == 0:
        print(f"{args.layers} layers, weight {dim}x{dim} ({args.mib:g} MiB) Shard(0) over "
              f"{world} gloo processes, activations {x0.shape[0]}x{dim}; per layer, slowest "
              f"process, median of {args.repeat}:")
        print(f"  matmul {ms['matmuls']:.2f} ms; all_gather: shardwise {ms['gathers']:.2f} ms "
              f"({cpu_ms['gathers']:.2f} ms CPU), raw gloo {ms['raw_gathers']:.2f} ms "
              f"({cpu_ms['raw_gathers']:.2f} ms CPU)")
        print(f"  shardwise: sequential {ms['sequential']:.2f} ms, overlapped (async_op=True) "
              f"{ms['overlapped']:.2f} ms, ratio {result['ratio']:.2f}")
        print(f"  raw gloo:  sequential {ms['raw_sequential']:.2f} ms, overlapped "
              f"{ms['raw_overlapped']:.2f} ms, ratio {result['raw_ratio']:.2f}")
        print(f"  best ratio the cores allow (matmul + gather CPU) / (matmul + gather wall): "
              f"{result['bound_ratio']:.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
