"""``optimizer.step()`` over DTensor parameters against the same optimizer over plain tensors of
the local shapes, in the same run, interleaved: SGD (momentum) and AdamW, each with its
per-parameter loop (``foreach=False``) and its foreach path (``foreach=True``).

The parameters are those of ``LAYERS`` tensor-parallel MLP layers on a 1-D mesh of the world's
size (the world of this process: 1 without the launcher): the up projection's weight and bias
``Shard(0)``, the down projection's weight ``Shard(1)``, its bias ``Replicate()``; the plain
tensors are each rank's local shards of them. Gradients are set once; a step is timed alone.

Also ``torch.nn.utils.clip_grad_norm_`` over the DTensor gradients (foreach and not): the
collectives it runs, counted by ``CommDebugMode`` (one scalar all-reduce is the target), and its
time beside the same clip written by hand on the local gradients (local norms, one
``all_reduce`` of the sum of their squares, ``_foreach_mul_``).

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
        q.replicated = isinstance(placement, sw.Replicate)  # counted once by the hand clip
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


def _hand_clip(params: list[torch.nn.Parameter], max_norm: float, world: int) -> torch.Tensor:
    """2-norm clipping of sharded gradients by hand: one all-reduce of the local sums of
    squares (a replicated gradient counted once: divided by the world size)."""
    grads = [q.grad for q in params]
    squares = torch.stack([
        torch.linalg.vector_norm(q.grad) ** 2 / (world if q.replicated else 1) for q in params])
    total = squares.sum()
    if world > 1:
        dist.all_reduce(total)
    norm = total.sqrt()
    torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


def clip(mesh: sw.DeviceMesh, world: int, repeats: int) -> list[dict]:
    """clip_grad_norm_ over the DTensor gradients: collectives and time, beside by hand."""
    from shardwise.debug import CommDebugMode

    rows = []
    for foreach in (False, True):
        sharded, plain = _params(mesh)

        def ours(sharded=sharded, foreach=foreach) -> torch.Tensor:
            with sw.config.allow_implicit_redistribute():  # the norm's reduction
                return torch.nn.utils.clip_grad_norm_(sharded, 1e9, foreach=foreach)

        def hand(plain=plain) -> torch.Tensor:
            return _hand_clip(plain, 1e9, world)

        with CommDebugMode() as mode:
            total = ours()
        records = [(r.kind, max(r.bytes, r.cross_process_bytes)) for r in mode.records]
        torch.testing.assert_close(total.full_tensor(), hand(), msg="clip norms differ")
        times: dict[str, list[float]] = {"shardwise": [], "hand": []}
        for _ in range(repeats):
            for key, run in (("shardwise", ours), ("hand", hand)):
                if world > 1:
                    dist.barrier()
                start = time.perf_counter()
                run()
                took = torch.tensor(time.perf_counter() - start)
                if world > 1:
                    dist.all_reduce(took, op=dist.ReduceOp.MAX)
                times[key].append(float(took))
        sw_ms = statistics.median(times["shardwise"]) * 1e3
        hand_ms = statistics.median(times["hand"]) * 1e3
        rows.append({"foreach": foreach, "tensors": len(sharded), "collectives": len(records),
                     "kinds": sorted({k for k, _ in records}),
                     "max_bytes": max((b for _, b in records), default=0),
                     "shardwise_ms": sw_ms, "hand_ms": hand_ms, "ratio_vs_hand": sw_ms / hand_ms})
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
    steps = 5 if args.quick else args.steps
    rows = measure(mesh, world, steps)
    clips = clip(mesh, world, steps)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        for r in rows:
            print(f"{r['optimizer']:<6} foreach={r['foreach']!s:<5} {r['tensors']} tensors: "
                  f"DTensor {r['shardwise_ms']:.3f} ms, plain {r['plain_ms']:.3f} ms, "
                  f"ratio {r['ratio_vs_plain']:.2f}", flush=True)
        for r in clips:
            print(f"clip_grad_norm_ foreach={r['foreach']!s:<5}: {r['collectives']} collectives "
                  f"{r['kinds']} (largest {r['max_bytes']} bytes), {r['shardwise_ms']:.3f} ms, "
                  f"by hand {r['hand_ms']:.3f} ms, ratio {r['ratio_vs_hand']:.2f}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world_size": world, "dim": DIM, "layers": LAYERS, "rows": rows,
                           "clip": clips}, f, indent=1)


if __name__ == "__main__":
    main()
