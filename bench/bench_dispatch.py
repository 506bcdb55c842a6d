"""Dispatch overhead: an op on a DTensor vs the same op on the local tensor, for shardwise and
torch.distributed.tensor in the same run (world size 1, gloo, one device, so both run exactly
one local kernel per op and the difference is the library's own cost).

Run: python bench/bench_dispatch.py
"""

from __future__ import annotations

import os
import tempfile
import timeit

import torch
import torch.distributed as dist
from torch.distributed import tensor as torch_dt

import shardwise as sw


def _time(fn, number: int = 2000) -> float:
    fn()
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def main() -> None:
    store = tempfile.NamedTemporaryFile(delete=False)
    dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
    try:
        tmesh = torch_dt.init_device_mesh("cpu", (1,))
        smesh = sw.init_device_mesh("cpu", (1,))
        x, y = torch.randn(64, 64), torch.randn(64, 64)
        cases = {
            "add": lambda a, b: a + b,
            "mm": torch.mm,
            "sum(dim=0)": lambda a, b: a.sum(0),
            "relu": lambda a, b: torch.relu(a),
        }
        print(f"{'op':<12}{'local us':>10}{'shardwise us':>14}{'torch DT us':>13}{'ratio':>8}")
        for name, op in cases.items():
            local = _time(lambda op=op: op(x, y))
            sa = sw.distribute_tensor(x, smesh, [sw.Shard(0)])
            sb = sw.distribute_tensor(y, smesh, [sw.Replicate()])
            ta = torch_dt.distribute_tensor(x, tmesh, [torch_dt.Shard(0)])
            tb = torch_dt.distribute_tensor(y, tmesh, [torch_dt.Replicate()])
            ours = _time(lambda op=op, sa=sa, sb=sb: op(sa, sb))
            theirs = _time(lambda op=op, ta=ta, tb=tb: op(ta, tb))
            print(f"{name:<12}{local:>10.1f}{ours:>14.1f}{theirs:>13.1f}{ours / theirs:>8.2f}")
    finally:
        dist.destroy_process_group()
        os.unlink(store.name)


if __name__ == "__main__":
    main()
