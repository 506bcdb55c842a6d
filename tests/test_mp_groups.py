"""Meshes whose process groups are not one device per process, and uneven tensor parallelism,
across processes: values against plain torch.

A (2, 3) mesh over 3 processes gives each process two devices, and process 1 owns one device
of each row: the rows' process groups overlap ([0, 1] and [1, 2]), and ``mesh["tp"]`` has no
single answer on process 1 (it used to hang process 2 until the timeout).
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

import shardwise as sw
from mp_harness import run_in_processes
from shardwise import Replicate, Shard
from shardwise.errors import ConcurrentCollectiveError, MeshError
from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

ENV = {"SHARDWISE_COLLECTIVE_TIMEOUT": "20"}


def _full(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(float(torch.Size(shape).numel())).reshape(shape) / 3


def mesh_checks(mesh_shapes: list[tuple[int, ...]]) -> dict:
    """Per mesh: every Shard/Replicate layout redistributed to Replicate and to the transposed
    layout, a matmul, and each named sub-mesh (its values, or the MeshError it raises)."""
    out: dict = {}
    for shape in mesh_shapes:
        names = ("dp", "tp")[: len(shape)] if len(shape) == 2 else ("tp",)
        mesh = sw.init_device_mesh("cpu", shape, mesh_dim_names=names)
        x, w = _full((7, 5)), _full((5, 6))
        got: dict = {}
        for placements in itertools.product([Shard(0), Shard(1), Replicate()], repeat=len(shape)):
            d = sw.distribute_tensor(x, mesh, list(placements))
            replicated = d.redistribute(mesh, [Replicate()] * len(shape))
            got[str(placements), "replicate"] = sw.tf.unpack(replicated)
            flipped = [Shard(1 - p.dim) if isinstance(p, Shard) else p for p in placements]
            got[str(placements), "flipped"] = d.redistribute(mesh, flipped).full_tensor()
        with sw.config.allow_implicit_redistribute():
            dx = sw.distribute_tensor(x, mesh, [Shard(0)] + [Shard(1)] * (len(shape) - 1))
            dw = sw.distribute_tensor(w, mesh, [Replicate()] * len(shape))
            got["mm"] = torch.mm(dx, dw).full_tensor()
        for name in names:
            try:
                sub = mesh[name]
            except MeshError as err:
                got["sub", name] = str(err)
                continue
            got["sub", name] = sw.distribute_tensor(x, sub, [Shard(0)]).full_tensor()
        out[shape] = got
    return out


def _would_hang(shape: tuple[int, ...], world: int, name: str) -> bool:
    """Whether the sub-mesh that some process takes (through its first device) holds a device
    of another process that takes a different one (computed here from the geometry alone)."""
    ids = torch.arange(torch.Size(shape).numel()).reshape(shape)
    dim = ("dp", "tp").index(name) if len(shape) == 2 else 0
    per = ids.numel() // world
    where = {int(ids[i]): i for i in itertools.product(*map(range, shape))}

    def row(device: int) -> tuple:
        return tuple(c for d, c in enumerate(where[device]) if d != dim)

    taken = {rank: row(rank * per) for rank in range(world)}
    return any(
        taken[device // per] != row(device) and row(device) in taken.values()
        for device in where
    )


@pytest.mark.parametrize(
    "world, mesh_shapes", [(3, [(2, 3), (3, 2)]), (2, [(2, 2), (4,)])], ids=["3proc", "2proc"]
)
def test_meshes_with_several_devices_per_process(world: int, mesh_shapes: list) -> None:
    per_rank = run_in_processes(mesh_checks, world, mesh_shapes, timeout=120, env=ENV)
    x, w = _full((7, 5)), _full((5, 6))
    for rank, result in enumerate(per_rank):
        for shape in mesh_shapes:
            got = result[shape]
            for placements in itertools.product([Shard(0), Shard(1), Replicate()],
                                                repeat=len(shape)):
                for component in got[str(placements), "replicate"]:
                    assert torch.equal(component, x), (rank, shape, placements)
                assert torch.equal(got[str(placements), "flipped"], x), (rank, shape, placements)
            torch.testing.assert_close(got["mm"], x @ w)
            names = ("dp", "tp") if len(shape) == 2 else ("tp",)
            for name in names:
                if _would_hang(shape, world, name):
                    assert "wait forever" in got["sub", name], (rank, shape, name)
                else:
                    assert torch.equal(got["sub", name], x), (rank, shape, name)
    assert any(_would_hang(s, world, n) for s in mesh_shapes for n in ("dp", "tp")) == (world == 3)


# ----- uneven tensor parallelism --------------------------------------------------------------


def _mlp(hidden: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 8)
    )


def uneven_tp(hidden: int) -> dict:
    """Colwise then Rowwise on a 1-D mesh over every process: output, input gradient and the
    full parameter gradients after one backward."""
    mesh = sw.init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    model = _mlp(hidden)
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    y = model(x)
    (y * torch.arange(8.0)).sum().backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return {"y": y.detach(), "x_grad": x.grad, "grads": grads}


@pytest.mark.parametrize("world", [2, 3])
def test_uneven_colwise_rowwise_matches_torch(world: int) -> None:
    hidden = 13
    per_rank = run_in_processes(uneven_tp, world, hidden, timeout=90, env=ENV)
    ref = _mlp(hidden)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    y = ref(x)
    (y * torch.arange(8.0)).sum().backward()
    for rank, got in enumerate(per_rank):
        torch.testing.assert_close(got["y"], y.detach(), msg=f"rank {rank} output")
        torch.testing.assert_close(got["x_grad"], x.grad, msg=f"rank {rank} input grad")
        for name, p in ref.named_parameters():
            torch.testing.assert_close(got["grads"][name], p.grad, msg=f"rank {rank} {name}")


# ----- two threads of one process in collectives across processes ------------------------------


def two_threads() -> dict:
    """Process 1 comes late to a distribute_tensor; meanwhile process 0's thread A waits inside
    it and its thread B starts another collective across processes."""
    mesh = sw.init_device_mesh("cpu", (2,))
    full = torch.arange(10.0)
    if torch.distributed.get_rank() == 1:
        time.sleep(1.5)
        return {"a": sw.distribute_tensor(full, mesh, [Shard(0)]).full_tensor()}
    out: dict = {}

    def a() -> None:
        out["a"] = sw.distribute_tensor(full, mesh, [Shard(0)]).full_tensor()

    def b() -> None:
        start = time.monotonic()
        try:
            sw.distribute_tensor(full * 2, mesh, [Replicate()])
        except ConcurrentCollectiveError as err:
            out["b"] = (str(err), time.monotonic() - start)

    first = threading.Thread(target=a, name="thread-a")
    first.start()
    time.sleep(0.3)
    second = threading.Thread(target=b, name="thread-b")
    second.start()
    second.join()
    first.join()
    return out


def test_second_thread_in_a_collective_is_refused_before_gloo() -> None:
    """Two threads of one process in collectives across processes at once used to abort the
    process inside gloo (SIGABRT): the second is refused in Python, the first completes."""
    first, second = run_in_processes(two_threads, 2, timeout=60, env=ENV)
    assert torch.equal(first["a"], torch.arange(10.0))
    assert torch.equal(second["a"], torch.arange(10.0))
    message, waited = first["b"]
    assert "'thread-b'" in message and "'thread-a'" in message, message
    assert waited < 1.0, f"refused after {waited:.2f} s, not at once"
