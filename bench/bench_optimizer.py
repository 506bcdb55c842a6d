"""``optimizer.step()`` over DTensor parameters against the same optimizer over plain tensors of
the local shapes, in the same run, interleaved: SGD (momentum) and AdamW, each with its
per-parameter loop (``foreach=False``) and its foreach path (``foreach=True``).

The parameters are those of ``LAYERS`` tensor-parallel MLP layers on a 1-D mesh of the world's
size (the world of this process: 1 without the launcher): the up projection's weight and bias
``Shard(0)``, the down projection's weight ``Shard(1)``, its bias ``Replicate()``; the plain
tensors are each rank's local shards of them. Gradients are set once; a step is timed alone.

Run: python -m shardwise.launch --nproc 2 bench/bench_optimizer.py [--json FILE] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

import shardwise as sw

DIM = 256
LAYERS = 4
OPTIMIZERS = {
    "SGD": (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9}),
    "AdamW": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01}),
}


def _params(mesh: sw.DeviceMesh) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(DTensor parameters with gradients, plain parameters of their local shards with the
    local shards of the gradients)."""
    g = torch.Generator().manual_seed(0)
    shapes = [((4 * DIM, DIM), sw.Shard(0)), ((4 * DIM,), sw.Shard(0)),
              ((DIM, 4 * DIM), sw.Shard(1)), ((DIM,), sw.Replicate())] * LAYERS
    sharded, plain = [], []
    for shape, placement in shapes:
        value = sw.distribute_tensor(torch.randn(shape, generator=g), mesh, [placement])
        grad = sw.distribute_tensor(torch.randn(shape, generator=g), mesh, [placement])
        p = torch.nn.Parameter(value)
        p.grad = grad
        q = torch.nn.Parameter(value.to_local().clone())
        q.grad = grad.to_local().clone()
        sharded.append(p)
        plain.append(q)
    return sharded, plain


def _time(opt: torch.optim.Optimizer, world: int) -> float:
    """Seconds of one step (the slowest rank's, after a barrier)."""
    if world > 1:
        dist.barrier()
    start = time.perf_counter()
    opt.step()
    took = torch.tensor(time.perf_counter() - start)
    if world > 1:
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def measure(mesh: sw.DeviceMesh, world: int, steps: int) -> list[dict]:
    rows = []
    for name, (cls, kwargs) in OPTIMIZERS.items():
        for foreach in (False, True):
            sharded, plain = _params(mesh)
            opt_sw = cls(sharded, foreach=foreach, **kwargs)
            opt_plain = cls(plain, foreach=foreach, **kwargs)
            times: dict[str, list[float]] = {"shardwise": [], "plain": []}
            for i in range(steps + 3):
                for key, opt in (("shardwise", opt_sw), ("plain", opt_plain)):
                    t = _time(opt, world)
                    if i >= 3:  # the first steps create the optimizer state
                        times[key].append(t)
            for p, q in zip(sharded, plain, strict=True):
                torch.testing.assert_close(p.to_local(), q, msg="the steps diverged")
            sw_ms = statistics.median(times["shardwise"]) * 1e3
            plain_ms = statistics.median(times["plain"]) * 1e3
            rows.append({"optimizer": name, "foreach": foreach, "tensors": len(sharded),
                         "shardwise_ms": sw_ms, "plain_ms": plain_ms,
                         "ratio_vs_plain": sw_ms / plain_ms})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="5 steps")
    parser.add_argument("--json", help="write the results to this file (rank 0)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    mesh = sw.init_device_mesh("cpu", (world,))
    rows = measure(mesh, world, 5 if args.quick else args.steps)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        for r in rows:
            print(f"{r['optimizer']:<6} foreach={r['foreach']!s:<5} {r['tensors']} tensors: "
                  f"DTensor {r['shardwise_ms']:.3f} ms, plain {r['plain_ms']:.3f} ms, "
                  f"ratio {r['ratio_vs_plain']:.2f}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world_size": world, "dim": DIM, "layers": LAYERS, "rows": rows}, f,
                          indent=1)


if __name__ == "__main__":
    main()
