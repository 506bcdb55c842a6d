"""The agreement of a group across hosts (``comm/host_tree.py``): each process says which host it
runs on (``board._host`` replaced per rank), so the processes of this one machine form 2 or 3
"hosts". Checked: the values against one device, who carries the agreement (the host tree,
boards only where a host has two processes), the messages each agreement costs (ceil(log2
hosts) rounds at each host's first process, none at the others), and that disagreeing
processes raise ``CollectiveMismatchError`` on every rank naming what differs, then go on."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from mp_harness import outcomes, run_in_processes
from shardwise import Partial, Replicate, Shard, comm
from shardwise.comm import agreement, board, host_tree
from shardwise.errors import CollectiveMismatchError

FULL = torch.arange(96.0).reshape(12, 8)


def _across_hosts(hosts: str) -> dict:
    """Redistributions with rank r on host ``hosts[r]``; the isend calls of one of them."""
    rank = dist.get_rank()
    board._host = lambda: hosts[rank]
    mesh = sw.init_device_mesh("cpu", (dist.get_world_size(),))
    x = sw.distribute_tensor(FULL, mesh, [Shard(0)])
    got = [x.redistribute(placements=[Shard(1)]).full_tensor(),
           x.redistribute(placements=[Replicate()]).to_local(),
           sw.DTensor.from_local(FULL, mesh, [Partial()]).full_tensor()]
    sends = []
    real = dist.isend

    def counted(*args: object, **kwargs: object) -> object:
        sends.append(kwargs.get("tag"))
        return real(*args, **kwargs)

    dist.isend = counted
    try:
        x.redistribute(placements=[Replicate()]).to_local()
    finally:
        dist.isend = real
    (channel,) = [made for _, made in agreement._boards.get().values()]
    return {"got": got, "tree": isinstance(channel, host_tree.HostTree),
            "leader": getattr(channel, "leader", None),
            "board": getattr(channel, "board", None) is not None, "sends": sends}


@pytest.mark.slow
@pytest.mark.parametrize("hosts", ["ab", "aabb", "abc", "abcc"])
def test_a_group_across_hosts_agrees_by_its_host_tree(hosts: str) -> None:
    world, count = len(hosts), len(set(hosts))
    rounds = math.ceil(math.log2(count))
    for rank, out in enumerate(run_in_processes(_across_hosts, world, hosts, timeout=120)):
        torch.testing.assert_close(out["got"], [FULL, FULL, FULL * world], rtol=0, atol=0)
        assert out["tree"], f"rank {rank}"
        leader = hosts.index(hosts[rank]) == rank
        assert out["leader"] == leader, f"rank {rank}"
        assert out["board"] == (hosts.count(hosts[rank]) > 1), f"rank {rank}"
        # one all_gather: one agreement, one message a round from each host's first process
        assert out["sends"] == (list(range(rounds)) if leader else []), f"rank {rank}: {out}"


def _disagree(hosts: str) -> dict:
    """The last rank disagrees on a reduce op, then on a shape, then skips a collective; then
    all gather alike."""
    rank = dist.get_rank()
    board._host = lambda: hosts[rank]
    mesh = sw.init_device_mesh("cpu", (dist.get_world_size(),))
    odd = rank == dist.get_world_size() - 1
    tries = {
        "op": lambda: comm.all_reduce(mesh, 0, [torch.ones(4)], "max" if odd else "sum"),
        "shape": lambda: sw.distribute_tensor(
            torch.ones(6 if odd else 4, 2), mesh, [Shard(0)]).redistribute(
                placements=[Replicate()]).to_local(),
        # the last rank skips the second all_reduce and goes on to the next collective
        "skipped": lambda: [comm.all_reduce(mesh, 0, [torch.ones(4)], "sum")
                            for _ in range(1 if odd else 2)]
        + ([comm.all_gather(mesh, 0, [torch.ones(2)])] if odd else []),
    }
    out: dict = outcomes(tries, CollectiveMismatchError)
    out["after"] = torch.cat(comm.all_gather(mesh, 0, [torch.full((2,), float(rank))])[0])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("hosts", ["aabb", "abc"])
def test_processes_across_hosts_that_disagree_all_raise_naming_it(hosts: str) -> None:
    world = len(hosts)
    for rank, out in enumerate(run_in_processes(_disagree, world, hosts, timeout=120)):
        assert "op: rank 0: 'sum'" in out["op"] and f"rank {world - 1}: 'max'" in out["op"], (
            f"rank {rank}: {out['op']}")
        assert "[6, 2]" in out["shape"] and "[4, 2]" in out["shape"], (
            f"rank {rank}: {out['shape']}")
        assert "all_gather" in out["skipped"] and "all_reduce" in out["skipped"], (
            f"rank {rank}: {out['skipped']}")
        torch.testing.assert_close(
            out["after"], torch.arange(world, dtype=torch.float32).repeat_interleave(2))
