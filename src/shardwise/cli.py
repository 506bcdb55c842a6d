"""Command line: ``python -m shardwise demo`` trains a sharded GPT beside a single-device one
(``shardwise.demo``); ``tour`` shows the data model on a 2x3 mesh; ``ops-table`` prints the
supported ops."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from .comm import CommCounter
from .debug import explain_redistribute, op_table_markdown
from .dtensor import DTensor, distribute_tensor
from .mesh import init_device_mesh
from .placements import Partial, Placement, Replicate, Shard
from .tf_dtensor import unpack


def _runs(segments: tuple) -> str:
    return "+".join(f"{a}:{b}" for a, b in segments)


def device_table(dt: DTensor) -> str:
    """One line per device: its mesh coordinate, the global slice it holds and its shape."""
    spec = dt._spec
    lines = [f"  {'device':>6}  {'coord':>7}  {'rows':>9}  {'cols':>9}  local shape"]
    for device, component in zip(dt.device_mesh.local_device_ids, unpack(dt), strict=True):
        rows, cols = spec.local_segments(device)
        lines.append(
            f"  {device:>6}  {str(dt.device_mesh.coordinate_of(device)):>7}  "
            f"{_runs(rows):>9}  {_runs(cols):>9}  {list(component.shape)}"
        )
    return "\n".join(lines)


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
        say(f"\nplacements {placements}: which device holds which slice (rows, cols)")
        say(device_table(dt))
        if any(p.is_partial() for p in placements):
            say("  (Partial: the devices' components sum to the value)")
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
    say(device_table(moved))
    back = moved.redistribute(placements=[Shard(0), Shard(0)]).full_tensor()
    ok = torch.equal(back, tensor) and torch.equal(moved.full_tensor(), tensor)
    say(f"\nround trip equals the original: {ok}")
    if not ok:
        raise SystemExit(1)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:  # its own options: shardwise demo --help
        from .demo import main as demo_main

        return demo_main(argv[1:])
    parser = argparse.ArgumentParser(prog="shardwise", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "demo",
        help="train a small GPT with data x tensor parallelism next to single-device training "
        "(see shardwise demo --help)",
    )
    sub.add_parser("tour", help="show the data model on a 2x3 mesh of simulated devices")
    sub.add_parser("ops-table", help="print docs/ops.md: the supported ops, from the registry")
    args = parser.parse_args(argv)
    if args.command == "tour":
        tour()
    elif args.command == "ops-table":
        print(op_table_markdown(), end="")
    return 0
