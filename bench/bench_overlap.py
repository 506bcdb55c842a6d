"""Communication/computation overlap with ``async_op=True``: a matmul and an independent
all_gather (``Shard(0) -> Replicate``) of about the same duration, in sequence and overlapped.

Run: python -m shardwise.launch --nproc 2 bench/bench_overlap.py [MiB per process] [--json FILE]
Prints the time of each alone, in sequence, overlapped, and the ratio overlapped / sequential
(1.0: no overlap, 0.5: perfect overlap of two equal parts).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import Replicate, Shard


def _best(fn: Callable[[], object], repeat: int = 7, sync: bool = True) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        if sync:
            dist.barrier()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mib", nargs="?", type=float, default=16.0, help="MiB per process")
    parser.add_argument("--json", help="write the results to this file (rank 0)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    mib = args.mib
    mesh = sw.init_device_mesh("cpu", (world,))
    rows = int(mib * 2**20 / 4 / 256)
    x = sw.distribute_tensor(torch.randn(rows * world, 256), mesh, [Shard(0)])

    def gather() -> torch.Tensor:
        return x.redistribute(placements=[Replicate()]).to_local()

    t_comm = _best(gather)
    # grow the matmul until it takes about as long as the all_gather (each process on its
    # own, without collectives), then agree on the largest size
    n = 64
    while n < 4096:
        a = torch.randn(n, n)
        if _best(lambda a=a: a @ a, 2, sync=False) >= t_comm:
            break
        n = int(n * 1.1)
    agreed = torch.tensor([n])
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    n = int(agreed.item())
    a = torch.randn(n, n)
    t_mm = _best(lambda: a @ a)

    def sequential() -> None:
        a @ a
        gather()

    def overlapped() -> None:
        pending = x.redistribute(placements=[Replicate()], async_op=True)
        a @ a
        pending.wait()

    want = gather()
    got = x.redistribute(placements=[Replicate()], async_op=True).wait().to_local()
    assert torch.equal(got, want), "async result differs from blocking"
    t_seq, t_ovl = _best(sequential), _best(overlapped)
    if rank == 0:
        print(f"all_gather of {mib:g} MiB per process over {world} gloo processes: "
              f"{t_comm * 1e3:.1f} ms; matmul {n}x{n}: {t_mm * 1e3:.1f} ms")
        print(f"sequential {t_seq * 1e3:.1f} ms, overlapped (async_op=True) {t_ovl * 1e3:.1f} ms,"
              f" ratio {t_ovl / t_seq:.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"mib": mib, "all_gather_ms": t_comm * 1e3, "matmul_ms": t_mm * 1e3,
                           "sequential_ms": t_seq * 1e3, "overlapped_ms": t_ovl * 1e3,
                           "ratio": t_ovl / t_seq}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
