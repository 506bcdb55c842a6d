"""Redistribution time across processes: shardwise vs torch.distributed.tensor in the
same run (gloo on CPU, one device per process, same mesh, same tensor, same transitions).

Run: python -m shardwise.launch --nproc 4 bench/bench_redistribute.py [size]
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed import tensor as torch_dt

import shardwise as sw

TRANSITIONS = [
    ("Shard(0) -> Replicate", "S0", "R"),
    ("Shard(0) -> Shard(1)", "S0", "S1"),
    ("Partial -> Replicate", "P", "R"),
    ("Partial -> Shard(0)", "P", "S0"),
    ("Replicate -> Shard(0)", "R", "S0"),
]


def _placements(module, code: str) -> list:
    return {
        "S0": [module.Shard(0)],
        "S1": [module.Shard(1)],
        "R": [module.Replicate()],
        "P": [module.Partial()],
    }[code]


def _time(fn, repeat: int = 5) -> float:
    fn()
    dist.barrier()
    best = float("inf")
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    smesh = sw.init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))  # starts gloo
    world = dist.get_world_size()
    tmesh = torch_dt.init_device_mesh("cpu", (world,))
    full = torch.randn(size, size, generator=torch.Generator().manual_seed(0))
    rows = []
    for name, src, dst in TRANSITIONS:
        ours_src = sw.distribute_tensor(full, smesh, _placements(sw, src))
        theirs_src = torch_dt.distribute_tensor(full, tmesh, _placements(torch_dt, src))
        ours = _time(lambda s=ours_src, d=dst: s.redistribute(placements=_placements(sw, d)))
        theirs = _time(
            lambda s=theirs_src, d=dst: s.redistribute(tmesh, _placements(torch_dt, d))
        )
        rows.append((name, ours, theirs))
    if dist.get_rank() == 0:
        print(f"{world} processes (gloo), {size}x{size} float32; best of 5, ms")
        print(f"{'transition':<24}{'shardwise':>11}{'torch DT':>11}{'ratio':>8}")
        for name, ours, theirs in rows:
            print(f"{name:<24}{ours:>11.2f}{theirs:>11.2f}{ours / theirs:>8.2f}")


if __name__ == "__main__":
    main()
