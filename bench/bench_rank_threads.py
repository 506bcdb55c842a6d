"""One process, many ranks. Per-rank: the time of one tensor-parallel MLP training step
(ColwiseParallel then RowwiseParallel on a 1-D mesh, SGD) with N ranks as threads of one process
(``shardwise.rank_threads``), as N gloo processes, and under PyTorch's ``LocalTensorMode``
running the same program with ``torch.distributed.tensor``, in the same run; ratios against the
threads, of rank 0's median wall time per step and of the CPU time per step of all ranks
(process CPU time, summed over the processes), which other load on the machine leaves alone;
beside them the same step written by hand on plain local shards (gloo all_reduce), run as
threads: the floor of any per-rank program in threads mode. Every mode runs one intra-op
thread per rank (torchrun's default for several processes).
Embedded (global view): the demo's GPT training step (``shardwise.demo.sharded_step``)
on a dp x tp mesh of simulated devices in this process against the single-device step
(``demo.single_step``) times the number of devices, interleaved; wall and CPU time (the CPU
time of this single-threaded process is what other load on the machine leaves alone).

Run: python bench/bench_rank_threads.py [--nproc 2,4,8] [--mesh 2x4] [--steps 20] [--quick]
[--json FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

HIDDEN = 256


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.ReLU(), nn.Linear(4 * HIDDEN, HIDDEN))


def _steps(parallelize, mesh, steps: int) -> tuple[float, float]:
    """Median wall seconds per step after two warm-up steps, and the CPU seconds this process
    spent per step over those steps (all its threads: every rank of the threads mode)."""
    from torch.distributed.tensor.parallel import ColwiseParallel as TorchCol
    from torch.distributed.tensor.parallel import RowwiseParallel as TorchRow

    from shardwise.parallel import ColwiseParallel, RowwiseParallel

    torch_api = parallelize.__module__.startswith("torch")
    col, row = (TorchCol, TorchRow) if torch_api else (ColwiseParallel, RowwiseParallel)
    return _time_steps(parallelize(_model(), mesh, {"0": col(), "2": row()}), steps)


def _time_steps(model: nn.Module, steps: int) -> tuple[float, float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, HIDDEN, generator=g), torch.randn(32, HIDDEN, generator=g)
    times = []
    for i in range(steps + 2):
        if i == 2:
            cpu = time.process_time()
        start = time.perf_counter()
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]), (time.process_time() - cpu) / steps


def shardwise_step(n: int, steps: int) -> tuple[float, float]:
    """The per-rank program: join the world, build the mesh, time the steps."""
    import shardwise
    from shardwise.parallel import parallelize_module

    mesh = shardwise.init_device_mesh("cpu", (n,))
    return _steps(parallelize_module, mesh, steps)


def hand_step(n: int, steps: int) -> tuple[float, float]:
    """The same step written by hand on plain local shards (bench_training's Megatron f and
    g around the linears, gloo all_reduce): the floor of any per-rank program."""
    from bench_training import _hand_parallelize

    dist.init_process_group("gloo")
    try:
        model = _model()
        _hand_parallelize(model, {"0": "col", "2": "row"}, None, dist.get_rank(), n)
        return _time_steps(model, steps)
    finally:
        dist.destroy_process_group()


def hand_in_threads(n: int, steps: int) -> tuple[float, float]:
    from shardwise.rank_threads import run_threads

    return run_threads(hand_step, n, n, steps, timeout=600)[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _process(rank: int, n: int, port: int, steps: int, out: mp.Queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    out.put((rank, shardwise_step(n, steps)))


def in_processes(n: int, steps: int) -> tuple[float, float]:
    """Rank 0's median wall seconds per step; the CPU seconds per step of all processes."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_process, args=(r, n, port, steps, out)) for r in range(n)]
    for p in procs:
        p.start()
    times = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return times[0][0], sum(cpu for _, cpu in times.values())


def in_threads(n: int, steps: int) -> tuple[float, float]:
    from shardwise.rank_threads import run_threads

    return run_threads(shardwise_step, n, n, steps, timeout=600)[0]


def local_tensor_mode(n: int, steps: int) -> tuple[float, float]:
    """torch.distributed.tensor under LocalTensorMode (one thread simulates every rank)."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=n, store=FakeStore())
    try:
        with LocalTensorMode(n):
            mesh = init_device_mesh("cpu", (n,))
            return _steps(parallelize_module, mesh, steps)
    finally:
        dist.destroy_process_group()


def simulated_gpt(dp: int, tp: int, steps: int) -> dict:
    """The demo's GPT step on ``dp`` x ``tp`` simulated devices against ``dp * tp`` times the
    single-device step (medians after three warm-up steps, interleaved)."""
    from shardwise import demo, init_device_mesh
    from shardwise.ops.random import manual_seed

    cfg = demo.GPTConfig()
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    manual_seed(0)
    single = demo.GPT(cfg)
    model = demo.sharded_model(cfg, mesh, 0)
    demo.start_alike(single, model)
    opt_single = torch.optim.AdamW(single.parameters(), lr=1e-2, weight_decay=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    wall: dict[str, list[float]] = {"single": [], "embedded": []}
    cpu: dict[str, list[float]] = {"single": [], "embedded": []}
    diff = 0.0
    for step in range(steps + 3):
        ids, targets = demo.make_batch(step, 16, cfg, 0)
        for name, run, args in (("single", demo.single_step, (single, opt_single)),
                                ("embedded", demo.sharded_step, (model, opt, mesh))):
            start, start_cpu = time.perf_counter(), time.thread_time()
            loss = run(*args, ids, targets)
            if step >= 3:
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.thread_time() - start_cpu)
            if name == "single":
                expected = loss.item()
            else:
                diff = max(diff, abs(loss.full_tensor().item() - expected))
    n = dp * tp
    out = {"mesh": f"{dp}x{tp}", "devices": n, "max_loss_diff": diff}
    for kind, times in (("", wall), ("cpu_", cpu)):
        single_ms = statistics.median(times["single"]) * 1e3
        embedded_ms = statistics.median(times["embedded"]) * 1e3
        out.update({f"single_{kind}ms": single_ms, f"embedded_{kind}ms": embedded_ms,
                    f"{kind}ratio_vs_n_single": embedded_ms / (n * single_ms)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nproc", default="2,4,8", help="comma-separated rank counts")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--mesh", default="2x4",
                        help="the embedded GPT's simulated mesh, DPxTP (default 2x4: 8 devices)")
    parser.add_argument("--quick", action="store_true", help="N=2 only, 3 steps")
    parser.add_argument("--json", help="write the results to this file")
    ns = parser.parse_args()
    # one intra-op thread everywhere: what torchrun gives each of several processes and rank
    # threads get; with two, OpenMP's spinning team made LocalTensorMode and the single-device
    # step up to 10x slower whenever another process held the second core
    torch.set_num_threads(1)
    counts = [2] if ns.quick else [int(n) for n in ns.nproc.split(",")]
    steps = 3 if ns.quick else ns.steps
    rows = []
    for n in counts:
        row = {"nproc": n}
        for name, fn in (("threads", in_threads), ("processes", in_processes),
                         ("local_tensor_mode", local_tensor_mode),
                         ("hand_threads", hand_in_threads)):
            wall, cpu = fn(n, steps)
            row[f"{name}_ms"], row[f"{name}_cpu_ms"] = wall * 1e3, cpu * 1e3
        for other in ("local_tensor_mode", "processes"):
            row[f"{other}_vs_threads"] = row[f"{other}_ms"] / row["threads_ms"]
            row[f"{other}_vs_threads_cpu"] = row[f"{other}_cpu_ms"] / row["threads_cpu_ms"]
        rows.append(row)
        print(f"N={n}: threads {row['threads_ms']:.2f} ms/step, processes "
              f"{row['processes_ms']:.2f} ms/step, torch LocalTensorMode "
              f"{row['local_tensor_mode_ms']:.2f} ms/step; LocalTensorMode / threads "
              f"{row['local_tensor_mode_vs_threads']:.2f}, processes / threads "
              f"{row['processes_vs_threads']:.2f}; CPU ms/step of all ranks: threads "
              f"{row['threads_cpu_ms']:.2f}, processes {row['processes_cpu_ms']:.2f}, "
              f"LocalTensorMode {row['local_tensor_mode_cpu_ms']:.2f}; hand-written per-rank "
              f"code as threads {row['hand_threads_ms']:.2f} ms/step (CPU "
              f"{row['hand_threads_cpu_ms']:.2f})", flush=True)
    dp, tp = (int(v) for v in ns.mesh.lower().split("x"))
    gpt = simulated_gpt(dp, tp, 5 if ns.quick else ns.steps)
    print(f"demo GPT step on {gpt['mesh']} simulated devices: {gpt['embedded_ms']:.2f} ms "
          f"(CPU {gpt['embedded_cpu_ms']:.2f}), single device {gpt['single_ms']:.2f} ms "
          f"(CPU {gpt['single_cpu_ms']:.2f}); / ({gpt['devices']} x single) "
          f"{gpt['ratio_vs_n_single']:.2f} (CPU {gpt['cpu_ratio_vs_n_single']:.2f})", flush=True)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"hidden": HIDDEN, "batch": 32, "steps": steps, "rows": rows,
                       "simulated_gpt": gpt}, f, indent=1)


if __name__ == "__main__":
    main()
