"""One cache policy: every cache is made by ``shardwise.caches`` (bounded, listed), and
``clear_all`` empties them all."""

from __future__ import annotations

import re
from pathlib import Path

import torch

import shardwise as sw
from shardwise import caches
from shardwise.geometry import pieces
from shardwise.redistribute import plan as plan_module

PACKAGE = Path(sw.__file__).parent


def test_no_cache_is_made_outside_the_policy() -> None:
    made = re.compile(r"\blru_cache\b|functools\.cache\b|@cache\b")
    outside = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if path.name != "caches.py" and made.search(path.read_text())
    ]
    assert not outside, f"caches made outside shardwise.caches: {outside}"


def test_clear_all_empties_every_listed_cache() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    x = torch.arange(24.0).reshape(4, 6)
    moved = sw.distribute_tensor(x, mesh, [sw.Shard(0), sw.Shard(1)]).redistribute(
        mesh, [sw.Replicate(), sw.Shard(0)]
    )
    assert torch.equal(moved.full_tensor(), x)
    names = caches.all_caches()
    assert "shardwise.geometry.pieces" in names and "shardwise.redistribute.plan._PLANS" in names
    assert "shardwise.dispatch sharding decisions" in names
    assert pieces.cache_info().currsize > 0 and plan_module._PLANS
    caches.clear_all()
    assert pieces.cache_info().currsize == 0 and not plan_module._PLANS
    # and everything is computed again
    again = sw.distribute_tensor(x, mesh, [sw.Shard(0), sw.Shard(1)]).redistribute(
        mesh, [sw.Replicate(), sw.Shard(0)]
    )
    assert torch.equal(again.full_tensor(), x) and pieces.cache_info().currsize > 0
