"""Redistribution time across processes: shardwise vs torch.distributed.tensor in the
same run (gloo on CPU, one device per process, same mesh, same tensor, same transitions),
beside the raw gloo collective moving the same bytes on plain tensors into a new tensor (as a
redistribution must return one): all_gather for
Shard -> Replicate, all_to_all for Shard -> Shard (of the columns each process sends, laid out
side by side first: the one copy any Shard(0) -> Shard(1) needs), all_reduce for Partial ->
Replicate, reduce_scatter for Partial -> Shard, and a local slice (no communication) for
Replicate -> Shard.

With ``--simulate N [--device cuda]`` it runs in one process instead: N simulated devices (all on
the one GPU with cuda), shardwise's redistribution beside the same data movement written with
plain torch ops in that process (cat, chunk, sum: what the devices' pieces must become);
torch.distributed.tensor has no simulated devices to compare.

Run: python -m shardwise.launch --nproc 4 bench/bench_redistribute.py [SIZE ...] [--json FILE]
     [--quick]   (default sizes 1024 and 4096; times are medians of repeats, max over ranks)
     python bench/bench_redistribute.py --simulate 4 [--device cpu|cuda] [SIZE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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


def _times(fns: list, repeat: int) -> list[float]:
    """Median ms of each of ``fns`` over ``repeat`` rounds that run them one after the other
    (interleaved: the machine's noise hits them alike), each call started together on all
    ranks; the slowest rank's."""
    for fn in fns:
        fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, mine in zip(fns, samples, strict=True):
            dist.barrier()
            start = time.perf_counter()
            fn()
            mine.append(time.perf_counter() - start)
    medians = torch.tensor([statistics.median(mine) * 1e3 for mine in samples])
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return medians.tolist()


_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _raw(code_src: str, code_dst: str, full: torch.Tensor):
    """The plain-tensor collective moving what the transition moves into a new tensor (a
    redistribution returns one, and a fresh buffer costs its page faults), and its name."""
    world, rank = dist.get_world_size(), dist.get_rank()
    shard = full.chunk(world, 0)[rank].contiguous()
    if (code_src, code_dst) == ("S0", "R"):
        return "all_gather", lambda: _ALL_GATHER(torch.empty_like(full), shard)
    if (code_src, code_dst) == ("S0", "S1"):
        # each process's column chunk j goes to process j: laid out side by side first (one
        # copy: no collective sends strided columns), then what arrives, in rank order, is the
        # new shard as it lies
        def columns() -> None:
            rows, cols = shard.shape
            packed = shard.view(rows, world, cols // world).transpose(0, 1).contiguous()
            dist.all_to_all_single(torch.empty_like(packed), packed)
        return "all_to_all of packed columns", columns
    if (code_src, code_dst) == ("P", "R"):
        return "all_reduce", lambda: dist.all_reduce(full.clone())
    if (code_src, code_dst) == ("P", "S0"):
        return "reduce_scatter", lambda: _REDUCE_SCATTER(torch.empty_like(shard), full)
    return "local slice", lambda: full.chunk(world, 0)[rank].clone()


def _plain_moves(code_src: str, code_dst: str, full: torch.Tensor, n: int):
    """The transition written by hand on the pieces of ``n`` simulated devices in one process:
    every device's new piece, made with plain torch ops."""
    shards = [p.contiguous() for p in full.chunk(n, 0)]
    parts = [full / n for _ in range(n)]
    if (code_src, code_dst) == ("S0", "R"):
        return lambda: [torch.cat(shards, 0) for _ in range(n)]
    if (code_src, code_dst) == ("S0", "S1"):
        return lambda: [torch.cat([s.chunk(n, 1)[j] for s in shards], 0) for j in range(n)]
    if (code_src, code_dst) == ("P", "R"):
        return lambda: [torch.stack(parts).sum(0) for _ in range(n)]
    if (code_src, code_dst) == ("P", "S0"):
        return lambda: [torch.stack([p.chunk(n, 0)[j] for p in parts]).sum(0) for j in range(n)]
    return lambda: [full.chunk(n, 0)[j].clone() for j in range(n)]


def _synced_ms(fns: list, repeat: int, sync) -> list[float]:
    """Median ms of each of ``fns``, interleaved, each call ended by ``sync``."""
    for fn in fns:
        fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, mine in zip(fns, samples, strict=True):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            mine.append(time.perf_counter() - start)
    return [statistics.median(mine) * 1e3 for mine in samples]


def run_simulated(sizes: list[int], repeat: int, n: int, device: str) -> dict:
    """Redistribution on ``n`` simulated devices in this process against plain torch ops."""
    mesh = sw.DeviceMesh(device, list(range(n)))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    for size in sizes:
        full = torch.randn(size, size, generator=torch.Generator().manual_seed(0)).to(device)
        for name, src, dst in TRANSITIONS:
            if src == "P":
                ours_src = sw.DTensor.from_local(
                    [full / n for _ in range(n)], mesh, _placements(sw, src)
                )
            else:
                ours_src = sw.distribute_tensor(full, mesh, _placements(sw, src))
            row = {"transition": name, "size": size, "raw_collective": "plain torch ops"}
            row["shardwise_ms"], row["raw_ms"] = _synced_ms(
                [lambda s=ours_src, d=dst: s.redistribute(placements=_placements(sw, d)),
                 _plain_moves(src, dst, full, n)],
                repeat, sync,
            )
            row["ratio_vs_raw"] = row["shardwise_ms"] / row["raw_ms"]
            rows.append(row)
    return {"simulated_devices": n, "device": device, "rows": rows}


def run(sizes: list[int], repeat: int) -> dict:
    smesh = sw.init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))  # starts gloo
    world = dist.get_world_size()
    tmesh = torch_dt.init_device_mesh("cpu", (world,))
    rows = []
    for size in sizes:
        full = torch.randn(size, size, generator=torch.Generator().manual_seed(0))
        for name, src, dst in TRANSITIONS:
            ours_src = sw.distribute_tensor(full, smesh, _placements(sw, src))
            theirs_src = torch_dt.distribute_tensor(full, tmesh, _placements(torch_dt, src))
            raw_name, raw = _raw(src, dst, full)
            row = {"transition": name, "size": size, "raw_collective": raw_name}
            row["shardwise_ms"], row["torch_dt_ms"], row["raw_ms"] = _times(
                [lambda s=ours_src, d=dst: s.redistribute(placements=_placements(sw, d)),
                 lambda s=theirs_src, d=dst: s.redistribute(tmesh, _placements(torch_dt, d)),
                 raw],
                repeat,
            )
            row["ratio_vs_torch_dt"] = row["shardwise_ms"] / row["torch_dt_ms"]
            row["ratio_vs_raw"] = row["shardwise_ms"] / row["raw_ms"]
            rows.append(row)
    return {"world_size": world, "rows": rows, "checks": _checks(smesh, sizes[0], repeat)}


def _checks(mesh, size: int, repeat: int) -> dict:
    """What the divergence checks cost on ``Shard(0) -> Replicate`` at ``size``: the default
    (the agreement before the data, on CPU: a word posted on the shared-memory board of these
    processes of one host), the same with the agreement gathered on the gloo side group instead
    (processes of several hosts), the default under debug checks (call site and mesh dim join
    the fingerprint), and each agreement alone."""
    from shardwise import settings
    from shardwise.comm import agreement
    from shardwise.runtime import side_group_for_ranks

    ranks = tuple(range(dist.get_world_size()))
    full = torch.randn(size, size, generator=torch.Generator().manual_seed(0))
    src = sw.distribute_tensor(full, mesh, [sw.Shard(0)])
    src.redistribute(placements=[sw.Replicate()])  # the board is set up
    boards = agreement._boards.get()
    with_board = boards[ranks]
    side = side_group_for_ranks(ranks)
    words = torch.empty(len(ranks), dtype=torch.int64)
    word = torch.ones(1, dtype=torch.int64)

    def on_side_group() -> None:
        boards[ranks] = (with_board[0], None)
        try:
            src.redistribute(placements=[sw.Replicate()])
        finally:
            boards[ranks] = with_board

    def debug() -> None:
        with settings.DEBUG_CHECKS.override(True):
            src.redistribute(placements=[sw.Replicate()])

    def posted() -> None:
        board = with_board[1]
        board.wait(board.post(1), 1, ranks, lambda: "bench")

    default_ms, side_ms, debug_ms, board_ms, word_ms = _times(
        [lambda: src.redistribute(placements=[sw.Replicate()]), on_side_group, debug,
         posted if with_board[1] is not None else lambda: None,
         lambda: _ALL_GATHER(words, word, group=side)], 3 * repeat)
    return {"size": size, "default_ms": default_ms, "side_group_ms": side_ms,
            "debug_ms": debug_ms, "board": with_board[1] is not None,
            "board_agreement_ms": board_ms, "side_group_agreement_ms": word_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sizes", nargs="*", type=int, help="square tensor sizes")
    parser.add_argument("--json", help="write the results to this file (rank 0)")
    parser.add_argument("--quick", action="store_true", help="size 1024 only, fewer repeats")
    parser.add_argument("--simulate", type=int, default=0,
                        help="N simulated devices in this one process (no launcher)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    sizes = args.sizes or ([1024] if args.quick else [1024, 4096])
    if args.simulate:
        results = run_simulated(sizes, 3 if args.quick else 7, args.simulate, args.device)
        print(f"{args.simulate} simulated devices on {args.device}, float32; median ms")
        print(f"{'transition':<24}{'size':>6}{'shardwise':>11}{'plain ops':>11}{'vs plain':>10}")
        for r in results["rows"]:
            print(f"{r['transition']:<24}{r['size']:>6}{r['shardwise_ms']:>11.2f}"
                  f"{r['raw_ms']:>11.2f}{r['ratio_vs_raw']:>10.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return
    results = run(sizes, 3 if args.quick else 7)
    if dist.get_rank() == 0:
        print(f"{results['world_size']} processes (gloo), float32; median ms (slowest rank)")
        print(f"{'transition':<24}{'size':>6}{'shardwise':>11}{'torch DT':>10}{'raw':>9}"
              f"{'vs DT':>7}{'vs raw':>8}  raw collective")
        for r in results["rows"]:
            print(f"{r['transition']:<24}{r['size']:>6}{r['shardwise_ms']:>11.2f}"
                  f"{r['torch_dt_ms']:>10.2f}{r['raw_ms']:>9.2f}{r['ratio_vs_torch_dt']:>7.2f}"
                  f"{r['ratio_vs_raw']:>8.2f}  {r['raw_collective']}")
        c = results["checks"]
        print(f"checks, Shard(0) -> Replicate {c['size']}: default {c['default_ms']:.2f} ms "
              f"(agreement on the {'board' if c['board'] else 'side group'}), on the side group "
              f"{c['side_group_ms']:.2f} ms, debug checks {c['debug_ms']:.2f} ms; the "
              f"agreement alone: board {c['board_agreement_ms']:.3f} ms, side-group gather "
              f"{c['side_group_agreement_ms']:.3f} ms")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
