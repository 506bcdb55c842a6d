"""Fault injection over 2 gloo processes (issue 7): divergent programs, mismatched inputs,
different seeds, dead and late peers, meshes built directly under a launcher. Every scenario
is bounded in time and checks the exception class that every rank got."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
import torch.distributed as dist

import shardwise as sw
from mp_harness import run_in_processes
from shardwise import Partial, Replicate, Shard

ROOT = Path(__file__).resolve().parents[1]


def _outcome(fn) -> str:
    """The class name of what ``fn()`` raised, or "ok"."""
    try:
        fn()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "ok"


def faults() -> dict:
    """Run each fault scenario on both ranks; return what each raised (scenarios in which every
    rank raises a shardwise error leave the processes in step, so they share one job)."""
    rank = dist.get_rank()
    mesh = sw.init_device_mesh("cpu", (2,))
    sw.config.set_collective_timeout(20)
    out: dict = {}

    # 5: rank 1 skips a step whose collective has the same shape as the next one
    a = sw.distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    b = sw.distribute_tensor(torch.arange(8.0).reshape(4, 2) + 100, mesh, [Shard(0)])
    sw.config.set_debug_checks(True)

    def skipped() -> None:
        if rank == 0:
            a.redistribute(placements=[Replicate()])
        b.redistribute(placements=[Replicate()])

    out["skipped_step"] = _outcome(skipped)
    sw.config.set_debug_checks(False)

    # 6: different global shapes, debug checks off; src_data_rank semantics
    rows = 8 if rank == 0 else 7
    out["shapes"] = _outcome(lambda: sw.distribute_tensor(torch.ones(rows, 2), mesh, [Shard(0)]))
    mine = torch.arange(6.0).reshape(3, 2) + 10 * rank  # same shape, different values
    from_0 = sw.distribute_tensor(mine, mesh, [Shard(0)])
    out["src_0"] = from_0.full_tensor()
    from_1 = sw.distribute_tensor(mine, mesh, [Replicate()], src_data_rank=1)
    out["src_1"] = sw.tf.unpack(from_1)[0]
    with sw.debug.CommCounter() as counter:
        own = sw.distribute_tensor(mine, mesh, [Shard(0)], src_data_rank=None)
    out["src_none_comm"] = counter.total_cross_process_bytes + counter.total_meta_bytes
    out["src_none"] = sw.tf.unpack(own)[0]

    # 7: different seeds before a random op, then the same seed
    sw.manual_seed(rank)
    out["seeds"] = _outcome(lambda: sw.randn(4, 3, device_mesh=mesh, placements=[Shard(0)]))
    sw.manual_seed(5)
    out["randn"] = sw.randn(4, 3, device_mesh=mesh, placements=[Shard(0)]).full_tensor()

    # 8: different collectives with debug checks off (gloo would abort on the size mismatch)
    partial = sw.DTensor.from_local(torch.ones(5, 3), mesh, [Partial()])
    sharded = sw.distribute_tensor(torch.ones(4, 7), mesh, [Shard(0)])

    def different() -> None:
        if rank == 0:
            partial.redistribute(placements=[Replicate()])
        else:
            sharded.redistribute(placements=[Replicate()])

    start = time.monotonic()
    out["different_collectives"] = _outcome(different)
    out["different_s"] = time.monotonic() - start
    # the processes are still in step afterwards
    out["after"] = sw.distribute_tensor(torch.arange(4.0), mesh, [Shard(0)]).full_tensor()

    # 10: rank 0 times out and goes away; rank 1 comes late to the collective
    sw.config.set_collective_timeout(2)
    late = sw.distribute_tensor(torch.ones(4), mesh, [Shard(0)])
    if rank == 0:
        out["late"] = _outcome(lambda: late.redistribute(placements=[Replicate()]))
        dist.destroy_process_group()
    else:
        time.sleep(4)
        out["late"] = _outcome(lambda: late.redistribute(placements=[Replicate()]))
        dist.destroy_process_group()
    return out


def test_faults_raise_shardwise_errors_on_every_rank() -> None:
    per_rank = run_in_processes(faults, 2, timeout=90)
    sw.manual_seed(5)
    embedded_randn = sw.randn(4, 3, device_mesh=sw.init_device_mesh("cpu", (2,)),
                              placements=[Shard(0)]).full_tensor()
    for rank, out in enumerate(per_rank):
        where = f"rank {rank}"
        assert out["skipped_step"].startswith("CollectiveMismatchError"), where
        assert "call site" in out["skipped_step"], out["skipped_step"]
        assert out["shapes"].startswith("CollectiveMismatchError"), where
        assert "[8, 2]" in out["shapes"] and "[7, 2]" in out["shapes"], out["shapes"]
        assert torch.equal(out["src_0"], torch.arange(6.0).reshape(3, 2)), where
        assert torch.equal(out["src_1"], torch.arange(6.0).reshape(3, 2) + 10), where
        assert out["src_none_comm"] == 0, where
        assert torch.equal(out["src_none"], (torch.arange(6.0).reshape(3, 2) + 10 * rank)[
            rank * 2 : rank * 2 + 2]), where
        assert out["seeds"].startswith("CollectiveMismatchError"), where
        assert "manual_seed" in out["seeds"], out["seeds"]
        assert torch.equal(out["randn"], embedded_randn), where  # the same draws per shard
        assert out["different_collectives"].startswith("CollectiveMismatchError"), where
        assert out["different_s"] < 10, where
        assert torch.equal(out["after"], torch.arange(4.0)), where
    assert per_rank[0]["late"].startswith("CollectiveTimeoutError"), per_rank[0]["late"]
    assert per_rank[1]["late"].startswith("CollectiveError"), per_rank[1]["late"]
    assert "all_gather" in per_rank[1]["late"], per_rank[1]["late"]


def _run_script(body: str, env: dict[str, str], tmp_path: Path, timeout: float) -> tuple:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **env}, cwd=ROOT,
    )
    return run, time.monotonic() - start


def test_dead_peer_before_setup_names_the_missing_rank(tmp_path: Path) -> None:
    """Rank 1 never starts: rank 0's setup honours the collective timeout and names rank 1."""
    from mp_harness import _free_port

    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "SHARDWISE_COLLECTIVE_TIMEOUT": "3"}
    body = """
        import shardwise as sw
        try:
            sw.init_device_mesh("cpu", (2,))
        except sw.errors.CollectiveTimeoutError as err:
            print("raised:", err)
    """
    run, seconds = _run_script(body, env, tmp_path, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "raised:" in run.stdout and "ranks [1] of 2 did not join" in run.stdout, run.stdout
    assert seconds < 30


def test_mesh_built_directly_under_the_launcher_joins_the_group(tmp_path: Path) -> None:
    script = tmp_path / "direct.py"
    script.write_text(textwrap.dedent("""
        import torch, shardwise as sw
        mesh = sw.DeviceMesh("cpu", [0, 1, 2, 3])
        x = sw.distribute_tensor(torch.arange(8.0), mesh, [sw.Shard(0)])
        rank = torch.distributed.get_rank()
        print(f"rank {rank} devices {mesh.local_device_ids} sum {x.full_tensor().sum().item()}")
    """))
    run = subprocess.run(
        [sys.executable, "-m", "shardwise.launch", "--nproc", "2", str(script)],
        capture_output=True, text=True, timeout=90, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert run.returncode == 0, run.stderr
    assert "rank 0 devices (0, 1) sum 28.0" in run.stdout, run.stdout
    assert "rank 1 devices (2, 3) sum 28.0" in run.stdout, run.stdout
