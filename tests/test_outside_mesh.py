"""A process that owns no device of a DTensor's mesh (PyTorch's non-participating rank):
``distribute_tensor`` / ``from_local`` / ops / ``redistribute`` take no part there and
``to_local`` / ``full_tensor`` give an empty tensor, as ``torch.distributed.tensor`` does (run
beside shardwise in the same processes as the oracle)."""

from __future__ import annotations

from typing import Any

import torch

from mp_harness import run_in_processes


def _describe(t: Any) -> Any:
    if isinstance(t, torch.Tensor):
        return (list(t.shape), str(t.dtype), bool(t.requires_grad), t.detach().tolist())
    return t


def _program(lib: str) -> dict:
    """The same program on the mesh of ranks [0, 1] of a world of 3, in ``lib``."""
    if lib == "torch":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    else:
        from shardwise import DeviceMesh, DTensor, Partial, Replicate, Shard, distribute_tensor
    mesh = DeviceMesh("cpu", [0, 1])
    x = torch.arange(8.0).reshape(4, 2)
    dt = distribute_tensor(x, mesh, [Shard(0)])
    grad_input = distribute_tensor(torch.ones(4, 2, requires_grad=True), mesh, [Shard(0)])
    mine = torch.full((2, 3), 1.0 + torch.distributed.get_rank())
    local = DTensor.from_local(mine, mesh, [Shard(1)])
    pending = DTensor.from_local(torch.ones(2, dtype=torch.float64), mesh, [Partial()])
    return {
        "shape": list(dt.shape),
        "to_local": _describe(dt.to_local()),
        "to_local_grad": _describe(grad_input.to_local()),
        "full_tensor": _describe(dt.full_tensor()),
        "op": _describe((dt * 2 + 1).to_local()),
        "op_shape": list((dt @ distribute_tensor(torch.ones(2, 5), mesh, [Replicate()])).shape),
        "redistribute": _describe(dt.redistribute(mesh, [Replicate()]).to_local()),
        "from_local_shape": list(local.shape),
        "from_local": _describe(local.to_local()),
        "partial": _describe(pending.to_local()),
        "int": _describe(distribute_tensor(torch.arange(4), mesh, [Replicate()]).to_local()),
    }


def _job() -> dict:
    return {"torch": _program("torch"), "shardwise": _program("shardwise")}


def test_rank_outside_the_mesh_matches_pytorch() -> None:
    per_rank = run_in_processes(_job, 3, timeout=180)
    for got in per_rank:
        assert got["shardwise"] == got["torch"]
    outside = per_rank[2]["shardwise"]
    assert outside["shape"] == [4, 2] and outside["to_local"] == ([0], "torch.float32", False, [])
    assert outside["to_local_grad"][:3] == ([0], "torch.float32", True)
    assert outside["int"][:2] == ([0], "torch.int64")
    assert per_rank[0]["shardwise"]["to_local"][3] == [[0.0, 1.0], [2.0, 3.0]]
