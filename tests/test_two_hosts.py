"""Per-rank tensor- and sequence-parallel programs written for torch.distributed.tensor, ported to
shardwise by their imports only, train across two hosts as on one: two network namespaces joined
by a veth pair (private /30 inside them), torchrun on each (``--nnodes 2 --nproc-per-node 1|2
--node-rank R --master-addr <host 0>``, static rendezvous, gloo on the veth), the same per-rank
losses and final parameters and gradients as the same program under ``python -m
shardwise.launch --nproc 2|4`` on one host.

The hosts and runner are ``tests/pytorch_programs/two_hosts.py``; the programs, the port and the
single-host runner ``harness.py`` beside it. Skips where network namespaces cannot be made (not
root, no ``ip``, no CAP_NET_ADMIN).
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "pytorch_programs"))
import two_hosts as th
from harness import OURS, largest_difference, run

RTOL = 1e-5  # float32: same program, same library; only the transport differs


@pytest.fixture(scope="module")
def can_make_hosts() -> None:
    reason = th.unavailable()
    if reason is not None:
        pytest.skip(f"two hosts (network namespaces) unavailable: {reason}")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def test_unavailable_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(th.sys, "platform", "linux")
    monkeypatch.setattr(th.os, "geteuid", lambda: 1000)
    assert "not root" in th.unavailable()
    monkeypatch.setattr(th.os, "geteuid", lambda: 0)
    monkeypatch.setattr(th.shutil, "which", lambda name: None)
    assert "no `ip` command" in th.unavailable()


def test_hosts_are_torn_down_even_on_error(can_make_hosts: None) -> None:
    with pytest.raises(RuntimeError, match="inside"), th.two_hosts() as hosts:
        assert set(hosts.namespaces) <= _namespaces()
        raise RuntimeError("inside")
    assert not set(hosts.namespaces) & _namespaces()


@pytest.mark.timeout(300)
# one process per host for the tensor-parallel program, two for the sequence-parallel one
# (world 4: tp groups across the hosts): each pair of runs costs ~20 s on 2 cores
@pytest.mark.parametrize(("program", "nproc_per_node"), [
    ("tensor_parallel", 1), ("sequence_parallel", 2),
])
def test_program_trains_on_two_hosts_as_on_one(
    program: str, nproc_per_node: int, can_make_hosts: None, tmp_path: Path
) -> None:
    world = 2 * nproc_per_node
    with th.two_hosts() as hosts:
        before = hosts.traffic()
        two = th.run_two_hosts(hosts, program, "shardwise", nproc_per_node, tmp_path, timeout=120)
        crossed = hosts.traffic() - before
    assert two.returncode == 0, two.output[-4000:]
    assert crossed > 0  # the ranks of host 1 reached host 0 over the veth pair
    one = run(program, "shardwise", world, tmp_path, timeout=120)
    assert one.returncode == 0, one.output[-4000:]
    for r in (two, one):
        assert sorted(r.losses) == list(range(world)), r.output[-4000:]
        assert all(len(losses) == OURS.steps[program] for losses in r.losses.values())
    for rank in range(world):
        for step, (a, b) in enumerate(zip(two.losses[rank], one.losses[rank], strict=True)):
            assert math.isclose(a, b, rel_tol=RTOL, abs_tol=1e-4), (rank, step, a, b)
    assert two.record is not None and one.record is not None
    worst = largest_difference(two.record, one.record)
    assert worst["params"] <= RTOL and worst["grads"] <= RTOL, worst
