"""The agreement every cross-process collective starts with is checked always, not only under
debug checks: processes that redistribute DTensors of different global shapes raise
``CollectiveMismatchError`` on every rank, naming both shapes, at every piece size (before gloo
sees messages of another size, on which it aborts the process); processes that enter different
collectives (the point-to-point transport against the backend's) find out from the first
message instead of waiting for the timeout."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from mp_harness import run_in_processes
from shardwise import Partial, Replicate, Shard
from shardwise.comm import native

COLS = 1024  # a row of float32 is 4 KiB
PIECES_KIB = (16, 1024, 12 * 1024)


def _outcome(fn) -> str:
    try:
        fn()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "ok"


def _sharded(rows: int, mesh: sw.DeviceMesh) -> sw.DTensor:
    """A DTensor of ``rows`` rows per process, made by the checked ``distribute_tensor``."""
    world = dist.get_world_size()
    return sw.distribute_tensor(torch.ones(rows * world, COLS), mesh, [Shard(0)])


def gather_other_sizes() -> dict:
    """The last rank all-gathers a DTensor whose pieces hold 2x or 0.5x the bytes of the one
    the others gather, after the same all_gather repeated."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = sw.init_device_mesh("cpu", (world,))
    sw.config.set_collective_timeout(60)
    out: dict = {}
    for kib in PIECES_KIB:
        rows = kib // 4
        base = _sharded(rows, mesh)
        for factor in (2, 0.5):
            other = _sharded(int(rows * factor), mesh)
            for _ in range(3):  # a training loop's repeated collective first
                base.redistribute(placements=[Replicate()])
            mine = other if rank == world - 1 else base
            out[(kib, factor)] = _outcome(lambda m=mine: m.redistribute(placements=[Replicate()]))
            del other
        # still in step: the same collective afterwards gives the right value
        out[(kib, "after")] = bool(
            (base.redistribute(placements=[Replicate()]).to_local() == 1).all()
        )
    # asynchronous: raised at wait()
    small, large = _sharded(2, mesh), _sharded(4, mesh)
    mine = large if rank == world - 1 else small
    out["async"] = _outcome(lambda: mine.redistribute(placements=[Replicate()], async_op=True)
                            .wait())
    # two devices per process (the point-to-point transport), and with debug checks on
    several = sw.init_device_mesh("cpu", (2 * world,))
    x = sw.distribute_tensor(torch.ones(4 * world * (2 if rank == 0 else 1), 3), several,
                             [Shard(0)], src_data_rank=None)  # rank 0's has twice the rows
    for debug in (False, True):
        sw.config.set_debug_checks(debug)
        out[("several", debug)] = _outcome(x.full_tensor)
    sw.config.set_debug_checks(False)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_gathering_other_global_shapes_raises_on_every_rank(world: int) -> None:
    per_rank = run_in_processes(gather_other_sizes, world, timeout=240)
    for rank, out in enumerate(per_rank):
        for kib in PIECES_KIB:
            rows = kib // 4
            for factor in (2, 0.5):
                got = out[(kib, factor)]
                where = f"rank {rank}, {kib} KiB pieces, {factor}x"
                assert got.startswith("CollectiveMismatchError"), (where, got[:300])
                for shape in ([rows * world, COLS], [int(rows * factor) * world, COLS]):
                    assert str(shape) in got, (where, shape, got)
            assert out[(kib, "after")], (rank, kib)
        assert out["async"].startswith("CollectiveMismatchError"), (rank, out["async"])
        assert f"[{2 * world}, {COLS}]" in out["async"], (rank, out["async"])
        assert f"[{4 * world}, {COLS}]" in out["async"], (rank, out["async"])
        for debug in (False, True):
            got = out[("several", debug)]
            assert got.startswith("CollectiveMismatchError"), (rank, debug, got)
            assert f"[{8 * world}, 3]" in got and f"[{4 * world}, 3]" in got, (rank, debug, got)


def different_collectives(timeout: float) -> dict:
    """``distribute_tensor``'s agree step on the first ranks against an all_reduce on the last
    one, and the other way round, with debug checks off."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = sw.init_device_mesh("cpu", (world,))
    sw.config.set_collective_timeout(timeout)
    partial = sw.DTensor.from_local(torch.ones(5, 3), mesh, [Partial()])
    out: dict = {}
    for last_reduces in (True, False):

        def diverge(last_reduces: bool = last_reduces) -> None:
            if (rank == world - 1) == last_reduces:
                partial.redistribute(placements=[Replicate()])
            else:
                sw.distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])

        start = time.monotonic()
        out[last_reduces] = (_outcome(diverge), time.monotonic() - start)
    out["after"] = sw.distribute_tensor(torch.arange(8.0), mesh, [Shard(0)]).full_tensor()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_different_collectives_raise_mismatch_before_the_timeout(world: int) -> None:
    timeout = 20.0
    per_rank = run_in_processes(different_collectives, world, timeout, timeout=120)
    for rank, out in enumerate(per_rank):
        for last_reduces in (True, False):
            got, seconds = out[last_reduces]
            where = f"rank {rank}, last rank reduces: {last_reduces}"
            assert got.startswith("CollectiveMismatchError"), (where, got)
            assert "all_reduce" in got and "agree" in got, (where, got)
            assert seconds < timeout / 4, (where, seconds)
        assert torch.equal(out["after"], torch.arange(8.0)), rank


def test_native_transport_takes_no_private_name_from_the_shared_call() -> None:
    """The protocol lives in ``comm/protocol.py``; ``native.py`` uses only public names of the
    collective call both transports share (``comm/call.py``) and of the point-to-point
    transport (issue 21)."""
    tree = ast.parse(Path(native.__file__).read_text())
    taken = [alias.name for node in ast.walk(tree)
             if isinstance(node, ast.ImportFrom) and node.module in ("call", "distributed")
             for alias in node.names]
    assert taken, "native.py no longer imports from call.py: update this test"
    assert not [name for name in taken if name.startswith("_")], taken
