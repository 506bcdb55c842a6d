"""RaggedShard across processes (gloo, 2 and 4 ranks, one device each): from_local of each
rank's own rows (the global size from the sizes), redistribution to and from every other
placement with exact values and the planned bytes, and ops that keep it without communication.
The oracle is the full tensor every rank builds from the same seed."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from mp_harness import run_in_processes
from shardwise import InterleavedShard, Partial, RaggedShard, Replicate, Shard


def _sizes(world: int) -> tuple[int, ...]:
    return (3, 7) if world == 2 else (3, 0, 5, 2)


def _job() -> list[str]:
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = sw.init_device_mesh("cpu", (world,))
    x = torch.randn(10, 4, generator=torch.Generator().manual_seed(3))
    sizes = _sizes(world)
    ragged = RaggedShard(0, sizes)
    start = sum(sizes[:rank])
    mine = x[start:start + sizes[rank]]
    dt = sw.DTensor.from_local(mine, mesh, [ragged])  # no shape: the sizes give it
    failures = []
    if tuple(dt.shape) != (10, 4) or not torch.equal(dt.full_tensor(), x):
        failures.append("from_local")
    other = RaggedShard(0, tuple(reversed(sizes)))
    targets = [Replicate(), Shard(0), Shard(1), InterleavedShard(0, 2), other,
               RaggedShard(1, (1, 3) if world == 2 else (0, 1, 0, 3)), Partial()]
    for target in targets:
        plan = sw.debug.explain_redistribute(dt, [target])
        with sw.debug.CommCounter() as counter:
            out = dt.redistribute(placements=[target])
        if counter.total_bytes != plan.bytes:
            failures.append(f"bytes {target}: {counter.total_bytes} != {plan.bytes}")
        if not target.is_partial() and plan.global_bytes != plan.lower_bound:
            failures.append(f"bound {target}: {plan.global_bytes} != {plan.lower_bound}")
        if not torch.equal(out.full_tensor(), x):
            failures.append(f"to {target}")
        if not torch.equal(out.redistribute(placements=[ragged]).to_local(), mine):
            failures.append(f"back from {target}")
    w = torch.randn(4, 3, generator=torch.Generator().manual_seed(4))
    dw = sw.distribute_tensor(w, mesh, [Replicate()])  # (a broadcast from rank 0)
    with sw.debug.CommCounter() as counter:
        y = (dt @ dw).relu() * 2
        s = dt.sum(1)
    if counter.total_bytes or y.placements != (ragged,) or s.placements != (ragged,):
        failures.append(f"ops moved {counter.total_bytes} bytes: {y.placements} {s.placements}")
    if not torch.allclose(y.full_tensor(), (x @ w).relu() * 2, atol=1e-6):
        failures.append("matmul values")
    if not torch.allclose(dt.sum(0).full_tensor(), x.sum(0), atol=1e-6):
        failures.append("sum over the ragged dim")
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_ragged_across_processes(world: int) -> None:
    results = run_in_processes(_job, world, timeout=240)
    assert results == [[]] * world, results
