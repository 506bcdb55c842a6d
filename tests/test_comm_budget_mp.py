"""``comm_budget`` across 2 and 4 processes (gloo): every rank checks the same plans and raises
together before moving; cross-process bytes are what crosses processes (a mesh with 2 devices
per process: moves inside a process are not cross-process). Expected bytes are worked out from
the tensor sizes."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

import shardwise as sw
from mp_harness import run_in_processes
from shardwise import Partial, Replicate, Shard
from shardwise.errors import CommBudgetExceededError, CommBudgetWarning

SHAPE = (8, 4)
FULL = 8 * 4 * 4  # bytes of the float32 global tensor


def _refused(fn: object) -> str:
    """The message of the ``CommBudgetExceededError`` ``fn()`` raises, or ''."""
    try:
        fn()
    except CommBudgetExceededError as err:
        return str(err)
    return ""


def one_device_per_process() -> dict:
    """Mesh (W,) on W processes."""
    w, rank = dist.get_world_size(), dist.get_rank()
    mesh = sw.init_device_mesh("cpu", (w,))
    x = torch.arange(32, dtype=torch.float32).reshape(SHAPE)
    dx = sw.distribute_tensor(x, mesh, [Shard(0)])
    out: dict = {}
    with sw.debug.comm_budget(bytes=FULL - FULL // w) as budget, sw.debug.CommCounter() as counter:
        out["gathered"] = torch.equal(dx.full_tensor(), x)
    out["used"], out["counted"] = budget.used, counter.total_bytes
    out["cross_used"], out["cross_counted"] = (budget.used_cross_process,
                                               counter.total_cross_process_bytes)
    with (
        sw.debug.comm_budget(bytes=FULL - FULL // w - 1) as budget,
        sw.debug.CommCounter() as counter,
    ):
        out["refused"] = _refused(dx.full_tensor)
    out["refused_moved"] = counter.total_bytes + budget.used
    # an op's implicit move: the pending sum reduced by a reduce-scatter
    p = sw.DTensor.from_local(torch.full(SHAPE, rank + 1.0), mesh, [Partial()])
    with sw.debug.comm_budget(per_op=FULL - FULL // w) as budget:
        out["exp"] = torch.exp(p).full_tensor()
    out["exp_largest"] = budget.largest_op
    with sw.debug.comm_budget(per_op=FULL - FULL // w - 1):
        out["exp_refused"] = _refused(lambda: torch.exp(p))
    # every byte crosses processes here: checked as the transport reports it
    with sw.debug.comm_budget(cross_process_bytes=0):
        out["cross_refused"] = _refused(dx.full_tensor)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sw.debug.comm_budget(bytes=1, on_exceed="warn"):
            out["warned_value"] = torch.equal(dx.full_tensor(), x)
    out["warnings"] = [str(c.message) for c in caught if c.category is CommBudgetWarning]
    return out


def two_devices_per_process() -> dict:
    """Mesh (2, 2) ("host", "local") on 2 processes: "local" stays inside a process."""
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("host", "local"))
    x = torch.arange(32, dtype=torch.float32).reshape(SHAPE)
    inside = sw.distribute_tensor(x, mesh, [Replicate(), Shard(0)])
    across = sw.distribute_tensor(x, mesh, [Shard(0), Replicate()])
    out: dict = {}
    # each of this process's 2 devices lacks the other's half
    with sw.debug.comm_budget(cross_process_bytes=0, per_dim={"local": FULL, "host": 0}) as budget:
        out["inside"] = torch.equal(inside.full_tensor(), x)
    out["inside_used"], out["inside_cross"] = budget.used, budget.used_cross_process
    with sw.debug.comm_budget(per_dim={"host": FULL - 1}) as budget:
        out["host_refused"] = _refused(across.full_tensor)
    out["host_moved"] = budget.used
    with sw.debug.comm_budget(cross_process_bytes=0) as budget:
        out["cross_refused"] = _refused(across.full_tensor)
    out["cross_used"], out["ring_used"] = budget.used_cross_process, budget.used
    return out


def _check_one_device(per_rank: list[dict], w: int) -> None:
    want_exp = torch.exp(torch.full(SHAPE, sum(range(1, w + 1)), dtype=torch.float32))
    for r in per_rank:
        assert r["gathered"] and r["used"] == r["counted"] == FULL - FULL // w
        assert r["cross_used"] == r["cross_counted"] > 0
        assert "nothing was moved" in r["refused"] and r["refused_moved"] == 0
        assert f"{FULL - FULL // w} bytes on this process's devices" in r["refused"]
        assert f"({w * (FULL - FULL // w)} on all devices" in r["refused"]
        torch.testing.assert_close(r["exp"], want_exp)
        assert r["exp_largest"] == FULL - FULL // w
        assert "aten.exp.default" in r["exp_refused"] and "reduce_scatter" in r["exp_refused"]
        assert "cross-process: 0 used" in r["cross_refused"]
        assert "has already run" in r["cross_refused"]
        assert r["warned_value"] and len(r["warnings"]) == 1
        assert "DTensor.redistribute would exceed" in r["warnings"][0]


def test_two_processes() -> None:
    _check_one_device(run_in_processes(one_device_per_process, 2, timeout=180), 2)
    for r in run_in_processes(two_devices_per_process, 2, timeout=180):
        assert r["inside"] and r["inside_used"] == FULL and r["inside_cross"] == 0
        assert f"mesh dim 'host': 0 used + {FULL}" in r["host_refused"]
        assert r["host_moved"] == 0
        assert "cross-process" in r["cross_refused"] and r["cross_used"] > 0
        assert r["ring_used"] == FULL  # each device lacks the other process's half


def test_four_processes() -> None:
    _check_one_device(run_in_processes(one_device_per_process, 4, timeout=240), 4)
