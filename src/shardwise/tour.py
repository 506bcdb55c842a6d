"""``shardwise tour``: a 7x10 tensor on a 2x3 mesh of simulated devices, distributed several
ways (which device holds which block), redistributed (the plan and what it moved), and
checked to round-trip."""

from __future__ import annotations

import sys

import torch

from . import dispatch as _dispatch  # noqa: F401  (DTensor ops run: the op layer is loaded)
from .comm import CommCounter
from .debug import explain_redistribute, visualize_sharding
from .factories import distribute_tensor
from .mesh import init_device_mesh
from .placements import Partial, Placement, Replicate, Shard


def tour(out=sys.stdout) -> None:
    """Distribute a 7x10 tensor on a 2x3 mesh several ways, redistribute, check round trips."""

    def say(text: str = "") -> None:
        print(text, file=out)

    mesh = init_device_mesh("cpu", (2, 3), mesh_dim_names=("x", "y"))
    tensor = torch.arange(70, dtype=torch.float32).reshape(7, 10)
    say(f"mesh {mesh}: this process owns devices {list(mesh.local_device_ids)}")
    say(f"global tensor: shape {list(tensor.shape)} (7 rows do not divide by 2, 10 cols by 3)")
    layouts: list[list[Placement]] = [
        [Shard(0), Shard(1)],
        [Shard(0), Replicate()],
        [Shard(1), Shard(1)],
        [Replicate(), Partial()],
    ]
    for placements in layouts:
        dt = distribute_tensor(tensor, mesh, placements)
        say(f"\nplacements {placements}: which device holds which block (rows x cols)")
        visualize_sharding(dt, file=out)
        if not torch.equal(dt.full_tensor(), tensor):
            raise SystemExit(f"round trip through {placements} changed the value")
    source = distribute_tensor(tensor, mesh, [Shard(0), Shard(0)])
    target: list[Placement] = [Replicate(), Shard(1)]
    plan = explain_redistribute(source, target)
    say(f"\nredistribute {list(source.placements)} -> {target}: plan")
    for step in plan.steps:
        say(
            f"  mesh dim {step.mesh_dim}: {step.source} -> {step.target} by {step.collective}, "
            f"{step.bytes} bytes received"
        )
    with CommCounter() as counter:
        moved = source.redistribute(placements=target)
    say(f"counted: {dict(counter.counts)} moving {counter.total_bytes} bytes "
        f"(plan said {plan.bytes})")
    visualize_sharding(moved, file=out)
    back = moved.redistribute(placements=[Shard(0), Shard(0)]).full_tensor()
    ok = torch.equal(back, tensor) and torch.equal(moved.full_tensor(), tensor)
    say(f"\nround trip equals the original: {ok}")
    if not ok:
        raise SystemExit(1)
