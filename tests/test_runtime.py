"""The process runtime (``shardwise.runtime``): start-up under one deadline, explicit shutdown.

Start-up runs scripts as single ranks of a world whose other ranks never come; shutdown runs
a script that ends right after its collectives many times under the launcher (a backend thread
that outlives the interpreter's finalization aborts the process, which a blind pause at exit
only made rarer).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from mp_harness import _free_port, run_in_processes
from shardwise import DTensor, runtime  # a name first: the runtime loads before the world

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 2.0
SETUP = """
    import time, shardwise as sw
    init_device_mesh = sw.init_device_mesh  # loads the package first: not start-up time
    start = time.monotonic()
    try:
        init_device_mesh("cpu", (WORLD,))
        print("joined")
    except sw.errors.CollectiveError as err:
        print(f"{type(err).__name__} after {time.monotonic() - start:.2f} s: {err}")
"""


def _start_rank(rank: int, world: int, port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "RANK": str(rank),
           "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "SHARDWISE_COLLECTIVE_TIMEOUT": str(TIMEOUT)}
    body = textwrap.dedent(SETUP).replace("WORLD", str(world))
    return subprocess.Popen([sys.executable, "-c", body], env=env, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _waited(out: str) -> float:
    return float(out.split(" after ")[1].split(" s: ")[0])


def test_start_up_honours_the_timeout_once() -> None:
    """Ranks 0 and 1 of 3 come, rank 2 never does; then rank 1 of 2 comes alone (no rank 0).
    Each gives up within the collective timeout (not once per phase: a late rank used to wait
    2.4 times it), and rank 0 names the rank that never came."""
    port = _free_port()
    first, second = _start_rank(0, 3, port), _start_rank(1, 3, port)
    out0, _ = first.communicate(timeout=60)
    out1, _ = second.communicate(timeout=60)
    assert out0.startswith("CollectiveTimeoutError") and "ranks [2] of 3" in out0, out0
    assert "ranks [2]" in out1, out1  # its own timeout, or rank 0's store gone with [2] missing
    lone = _start_rank(1, 2, _free_port())
    out2, _ = lone.communicate(timeout=60)
    assert out2.startswith("CollectiveTimeoutError") and "store of rank 0" in out2, out2
    for out in (out0, out1, out2):
        assert _waited(out) < 1.3 * TIMEOUT, out


def _native_threads() -> int:
    """Threads of this process that belong to torch.distributed: gloo's workers and loops and
    the store's (by their OS thread names, ``gloo_*`` and ``pt_*``)."""
    names = [Path(f"/proc/self/task/{t}/comm").read_text().strip()
             for t in os.listdir("/proc/self/task")]
    return sum(name.startswith(("gloo", "pt_")) for name in names)


def shutdown_job() -> dict:
    """Collectives on meshes over both processes (the world's group and the process groups
    shardwise makes), then ``runtime.shutdown`` twice."""
    assert DTensor is sw.DTensor
    mesh = sw.init_device_mesh("cpu", (4,))
    x = sw.distribute_tensor(torch.arange(8.0), mesh, [sw.Shard(0)])
    full = x.redistribute(mesh, [sw.Replicate()]).full_tensor()
    before = (runtime.initialized(), runtime.rank_and_world()[1], _native_threads())
    runtime.shutdown()
    runtime.shutdown()  # again: nothing left to do
    after = (dist.is_initialized(), runtime.rank_and_world(), len(runtime._process_groups.get()),
             _native_threads())
    return {"full": full, "before": before, "after": after}


def test_shutdown_joins_the_backend_threads() -> None:
    """After shutdown no process group is left and no backend worker thread runs, so none can
    wake up during the interpreter's finalization (which aborted about one program in four that
    ended right after its collectives, exit 134, before shutdown ran at exit)."""
    for result in run_in_processes(shutdown_job, 2, timeout=60):
        assert torch.equal(result["full"], torch.arange(8.0))
        initialized, world, threads = result["before"]
        assert initialized and world == 2 and threads > 0, result["before"]
        assert result["after"] == (False, (0, 1), 0, 0), result["after"]


def reinit_job(store_path: str) -> list:
    """A program that destroys its process groups itself and joins a new world (PyTorch's test
    harness, per test), then communicates over the same ranks again."""
    rank, world = dist.get_rank(), dist.get_world_size()
    fulls = []
    for attempt in range(2):
        mesh = sw.DeviceMesh("cpu", list(range(world)))
        x = sw.distribute_tensor(torch.arange(8.0) + attempt, mesh, [sw.Shard(0)])
        fulls.append(x.full_tensor())
        dist.destroy_process_group()  # the program's own call: shardwise's groups die with it
        store = dist.FileStore(f"{store_path}.{attempt}", world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    return fulls


@pytest.mark.slow
def test_groups_of_a_destroyed_world_are_not_used_again(tmp_path: Path) -> None:
    for fulls in run_in_processes(reinit_job, 2, str(tmp_path / "store"), timeout=90):
        assert [f.tolist() for f in fulls] == [
            torch.arange(8.0).tolist(), (torch.arange(8.0) + 1).tolist()]
