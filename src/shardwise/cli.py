"""Command line: ``python -m shardwise demo`` shows the data model on a 2x3 mesh."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from .comm import CommCounter
from .debug import explain_redistribute, op_table_markdown, visualize_sharding
from .dtensor import distribute_tensor
from .mesh import init_device_mesh
from .placements import Partial, Placement, Replicate, Shard


def demo(out=sys.stdout) -> None:
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


def training_demo(out=sys.stdout, steps: int = 3) -> None:
    """Train a 2-layer MLP on a 2x2 mesh (data x tensor parallel) beside single-device
    training, printing both losses and the bytes each step moved."""
    import copy

    from torch import nn

    from .dispatch import allow_implicit_redistribute

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "tensor"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    sharded = copy.deepcopy(model)
    plans = {  # column-parallel up projection, row-parallel down projection
        "0.weight": [Replicate(), Shard(0)],
        "0.bias": [Replicate(), Shard(0)],
        "2.weight": [Replicate(), Shard(1)],
        "2.bias": [Replicate(), Replicate()],
    }
    for name, placements in plans.items():
        layer, pname = name.split(".")
        module = sharded[int(layer)]
        dparam = distribute_tensor(getattr(module, pname).detach(), mesh, placements)
        setattr(module, pname, nn.Parameter(dparam))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    dopt = torch.optim.Adam(sharded.parameters(), lr=0.01)
    print(f"\ntraining on {mesh}: batch sharded over 'data', weights over 'tensor'", file=out)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        batch = [Shard(0), Replicate()]
        with allow_implicit_redistribute(), CommCounter() as counter:
            dx, dy = distribute_tensor(x, mesh, batch), distribute_tensor(y, mesh, batch)
            dloss = nn.functional.mse_loss(sharded(dx), dy)
            dopt.zero_grad()
            dloss.backward()
            dopt.step()
        print(
            f"  step {step}: loss {loss.item():.6f} single-device, {dloss.item():.6f} sharded; "
            f"moved {counter.total_bytes} bytes in {dict(counter.counts)}",
            file=out,
        )
    worst = max(
        (p.full_tensor() - q).abs().max().item()
        for p, q in zip(sharded.parameters(), model.parameters(), strict=True)
    )
    print(f"largest parameter difference after {steps} steps: {worst:.2e}", file=out)
    if worst > 1e-4:
        raise SystemExit("sharded training diverged from single-device training")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardwise", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="show the data model on a 2x3 mesh of simulated devices")
    sub.add_parser("ops-table", help="print docs/ops.md: the supported ops, from the registry")
    args = parser.parse_args(argv)
    if args.command == "demo":
        demo()
        training_demo()
    elif args.command == "ops-table":
        print(op_table_markdown(), end="")
    return 0
