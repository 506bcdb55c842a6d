"""``Local``: what this program holds of a DTensor (its pieces and spec), the one way the layers
above dtensor.py read and replace them; and the fence that keeps DTensor's fields its own."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import shardwise as sw
from shardwise import Partial, Replicate, Shard
from shardwise.dtensor import Local, build, local_of, set_local

PACKAGE = Path(__file__).parents[1] / "src" / "shardwise"
# the DTensor's own modules (and the op handler and the planner, which run on its fields)
# dispatch_args.py and dispatch_decision.py are dispatch.py split in three (its cache key and
# decision read the specs of every call: the hot path, no Local in between)
OWNERS = {"dtensor.py", "components.py", "pending.py", "dispatch.py", "dispatch_args.py",
          "dispatch_decision.py"}


def _mesh() -> sw.DeviceMesh:
    return sw.init_device_mesh("cpu", (4,))


def test_local_reads_the_pieces_and_spec_without_an_autograd_edge() -> None:
    x = torch.arange(24.0).reshape(8, 3).requires_grad_()
    dt = sw.distribute_tensor(x, _mesh(), [Shard(0)])
    held = local_of(dt)
    assert held.spec.placements == (Shard(0),) and tuple(held.spec.shape) == (8, 3)
    assert [p.shape for p in held.pieces] == [torch.Size([2, 3])] * 4
    torch.testing.assert_close(torch.cat(held.pieces), x.detach())
    assert all(p.grad_fn is None for p in held.pieces)
    assert list(held.by_device()) == list(dt.device_mesh.local_device_ids)


def test_map_zip_replace_and_build_give_the_oracle_values() -> None:
    mesh = _mesh()
    x, y = torch.randn(8, 3), torch.randn(8, 3)
    dx, dy = (sw.distribute_tensor(t, mesh, [Shard(0)]) for t in (x, y))
    doubled = build(local_of(dx).map(lambda p: p * 2))
    torch.testing.assert_close(doubled.full_tensor(), x * 2)
    summed = local_of(dx).zip(local_of(dy), torch.add)
    torch.testing.assert_close(torch.cat(summed), x + y)
    replicated = sw.distribute_tensor(x, mesh, [Replicate()])
    as_partial = local_of(replicated).replace(spec=local_of(replicated).spec.with_placements(
        (Partial(),)))
    terms = build(as_partial.map(lambda p: p / 4))  # four equal terms of a pending sum
    torch.testing.assert_close(terms.full_tensor(), x)
    built = build(Local(list(local_of(dx).pieces), local_of(dx).spec), requires_grad=True)
    assert built.requires_grad and built.is_leaf


def test_set_local_replaces_in_place() -> None:
    mesh = _mesh()
    x = torch.randn(8, 3)
    dt = sw.distribute_tensor(x, mesh, [Shard(0)])
    before = id(dt)
    set_local(dt, local_of(dt).map(torch.neg))
    assert id(dt) == before
    torch.testing.assert_close(dt.full_tensor(), -x)


def test_only_the_dtensor_modules_touch_its_fields() -> None:
    """Every read or write of a DTensor's ``_components`` / ``_spec`` outside dtensor.py and
    its own modules, dispatch.py and redistribute/ goes through ``Local``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        owner = str(relative) in OWNERS or relative.parts[0] == "redistribute"
        if owner:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("_components", "_spec"):
                found.append(f"{relative}:{node.lineno} .{node.attr}")
    assert found == []
