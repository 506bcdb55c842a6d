"""Dispatch overhead: ops on DTensors vs the same ops on local tensors, shardwise and
torch.distributed.tensor in the same run, interleaved, medians of repeats.

World size 1 (gloo, one device), so both libraries run exactly one local kernel per op and the
difference is their own cost: warm (cached sharding, CPU time) and cold (first call after
clearing the caches), with and without autograd. shardwise also runs on 4 simulated devices in
one process (no DTensor counterpart): the cost of each extra device is (t4 - t1) / 3 minus the
extra kernels.

On ``--device cuda`` both libraries use one GPU (NCCL for torch's world of one) and the 4
simulated devices share it; the times are still CPU time per call (the launch cost: kernels run
asynchronously, and every repeat ends with a synchronize so the queue never backs up).

Run: python bench/bench_dispatch.py [--json FILE] [--quick] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import tensor as torch_dt

import shardwise as sw

OPS = {
    "add": lambda a, b, e: a + b,
    "mul_scalar": lambda a, b, e: a * 2.0,
    "mm": lambda a, b, e: torch.mm(a, b),
    "sum": lambda a, b, e: a.sum(0),
    "transpose": lambda a, b, e: a.t(),
    "softmax": lambda a, b, e: torch.softmax(a, -1),
    "cat": lambda a, b, e: torch.cat([a, b], 0),
    "cat_same": lambda a, b, e: torch.cat([a, a], 1),
    "view": lambda a, b, e: a.view(-1),
    "embedding": lambda a, b, e: F.embedding(e, b),
}


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class _Plain:
    """The plain-tensor stand-in for a library in ``_inputs``: tensors stay local."""

    Shard = Replicate = staticmethod(lambda *args: None)

    @staticmethod
    def distribute_tensor(t: torch.Tensor, mesh: None, placements: list) -> torch.Tensor:
        return t


def _interleaved_us(fns: dict, number: int, repeat: int) -> dict:
    """Median CPU time per call (us) of each function; every repeat times each of them once
    in turn, so a slow patch of the machine hits all of them alike (CPU time: a process
    that waits for a core on a busy machine is not charged for the wait)."""
    for fn in fns.values():
        fn()
    samples: dict = {who: [] for who in fns}
    for _ in range(repeat):
        for who, fn in fns.items():
            start = time.process_time()
            for _ in range(number):
                fn()
            samples[who].append((time.process_time() - start) / number)
            _sync()
    return {who: statistics.median(times) * 1e6 for who, times in samples.items()}


def _cold_us(fn, clear, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        clear()
        start = time.perf_counter()
        fn()
        _sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def _clear_torch_dt() -> None:
    prop = torch_dt.DTensor._op_dispatcher.sharding_propagator
    for name in ("propagate_op_sharding",):
        fn = getattr(prop, name, None)
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()


def _inputs(lib, mesh, grad: bool, device: str):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 64, generator=g).to(device)
    y = torch.randn(64, 64, generator=g).to(device)
    idx = torch.randint(0, 64, (32,), generator=g).to(device)
    a = lib.distribute_tensor(x, mesh, [lib.Shard(0)])
    b = lib.distribute_tensor(y, mesh, [lib.Replicate()])
    e = lib.distribute_tensor(idx, mesh, [lib.Replicate()])
    if grad:
        a.requires_grad_(True)
        b.requires_grad_(True)
    return a, b, e


def run(quick: bool, device: str = "cpu") -> dict:
    number, repeat = (100, 5) if quick else (200, 21)
    smesh1 = sw.init_device_mesh(device, (1,))
    smesh4 = sw.DeviceMesh(device, list(range(4)))
    tmesh = torch_dt.init_device_mesh(device, (1,))
    lx, ly, lidx = _inputs(_Plain, None, False, device)
    rows = []
    for grad in (False, True):
        ours1 = _inputs(sw, smesh1, grad, device)
        ours4 = _inputs(sw, smesh4, grad, device)
        theirs = _inputs(torch_dt, tmesh, grad, device)
        local = (lx.requires_grad_(grad), ly.requires_grad_(grad), lidx)
        with sw.config.allow_implicit_redistribute():
            for name, op in OPS.items():
                row = {"op": name, "autograd": grad}
                row.update(_interleaved_us(
                    {who: (lambda op=op, args=args: op(*args)) for who, args in (
                        ("local", local), ("shardwise", ours1), ("torch_dt", theirs),
                        ("shardwise_4dev", ours4),
                    )},
                    number, repeat,
                ))
                row["local_4x"] = 4 * row["local"]
                if not grad:
                    row["shardwise_cold"] = _cold_us(
                        lambda op=op, a=ours1: op(*a), sw.rules.clear_sharding_cache, repeat
                    )
                    row["torch_dt_cold"] = _cold_us(
                        lambda op=op, a=theirs: op(*a), _clear_torch_dt, repeat
                    )
                rows.append(row)
    return {"device": device, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    store = tempfile.NamedTemporaryFile(delete=False)
    backend = "cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store.name}", rank=0, world_size=1)
    try:
        results = run(args.quick, args.device)
    finally:
        dist.destroy_process_group()
        os.unlink(store.name)
    print(f"Per-op time in us (median), 64x64 float32 on {args.device}; "
          f"ratio = shardwise / torch DTensor")
    print(f"{'op':<12}{'grad':>5}{'local':>8}{'sw':>8}{'DT':>8}{'ratio':>7}{'sw cold':>9}"
          f"{'DT cold':>9}{'us/extra dev':>14}")
    for r in results["rows"]:
        per_device = (r["shardwise_4dev"] - r["shardwise"] - 3 * r["local"]) / 3
        r["us_per_extra_device"] = per_device
        cold = (f"{r['shardwise_cold']:>9.0f}{r['torch_dt_cold']:>9.0f}"
                if "shardwise_cold" in r else " " * 18)
        print(f"{r['op']:<12}{'yes' if r['autograd'] else 'no':>5}{r['local']:>8.1f}"
              f"{r['shardwise']:>8.1f}{r['torch_dt']:>8.1f}"
              f"{r['shardwise'] / r['torch_dt']:>7.2f}{cold}{per_device:>14.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
