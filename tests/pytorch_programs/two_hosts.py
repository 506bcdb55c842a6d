"""Run a program of ``harness.OURS`` on two hosts: two network namespaces joined by a veth pair.

``two_hosts()`` makes the hosts: two namespaces of unique names, each with loopback up and one end
of a veth pair created inside it with a private address (``HOSTS``; one /30, in every pair of
namespaces its own, so it never meets the machine's interfaces and concurrent runs do not
collide), and deletes both namespaces, and with them the veth pair, on the way out.

``run_two_hosts`` starts torchrun (``python -m torch.distributed.run``, what the ``torchrun``
script runs) in each namespace with ``--nnodes 2 --nproc-per-node N --node-rank R --master-addr
<host 0's address>`` (static rendezvous), gloo bound to the veth by ``GLOO_SOCKET_IFNAME``, and
every output line prefixed with its global rank as under ``shardwise.launch``. ``unavailable()``
says why hosts cannot be made here (not root, no ``ip``, no CAP_NET_ADMIN, ``ip netns exec``
refused), or returns None.

``python tests/pytorch_programs/two_hosts.py PROGRAM NPROC_PER_NODE [--torch]`` runs the shardwise
port on two hosts and under ``shardwise.launch`` on one (``--torch``: and torch's original on two
hosts) and prints every run's losses.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from harness import HERE, Run, parse_losses, prepare, program_env

HOSTS = (("swveth0", "10.200.0.1"), ("swveth1", "10.200.0.2"))  # (interface, address), /30
MASTER_PORT = 29500  # free: the namespaces are new, nothing else listens in them
_IP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Hosts:
    namespaces: tuple[str, str]

    def traffic(self) -> int:
        """Bytes host 1's end of the veth pair has sent and received so far."""
        out = _ip("-n", self.namespaces[1], "-j", "-s", "link", "show", "dev", HOSTS[1][0])
        stats = json.loads(out)[0]["stats64"]
        return stats["rx"]["bytes"] + stats["tx"]["bytes"]


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    if done.returncode:
        raise OSError(f"ip {' '.join(args)}: exit {done.returncode}: {done.stderr.strip()}")
    return done.stdout


@contextmanager
def two_hosts() -> Iterator[Hosts]:
    """Two namespaces joined by a veth pair, torn down (namespaces and veth) on exit."""
    tag = f"shardwise-{os.getpid()}-{secrets.token_hex(4)}"
    names = (f"{tag}-0", f"{tag}-1")
    made: list[str] = []
    try:
        for ns in names:
            _ip("netns", "add", ns)
            made.append(ns)
        # both ends are created inside the namespaces: the pair never exists on the host
        (if0, _), (if1, _) = HOSTS
        _ip("link", "add", if0, "netns", names[0], "type", "veth",
            "peer", "name", if1, "netns", names[1])
        for ns, (ifname, address) in zip(names, HOSTS, strict=True):
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{address}/30", "dev", ifname)
            _ip("-n", ns, "link", "set", ifname, "up")
        yield Hosts(names)
    finally:
        for ns in reversed(made):  # the veth pair goes with its namespaces
            try:
                _ip("netns", "del", ns)
            except (OSError, subprocess.TimeoutExpired) as err:
                print(f"two_hosts: could not delete namespace {ns}: {err}", file=sys.stderr)


def unavailable() -> str | None:
    """Why two hosts cannot be made on this machine, or None when they can."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux's; this is {sys.platform}"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN); not root here"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) to make network namespaces"
    try:
        with two_hosts() as hosts:
            for ns in hosts.namespaces:
                subprocess.run(["ip", "netns", "exec", ns, "true"], check=True,
                               capture_output=True, timeout=_IP_TIMEOUT_S)
    except subprocess.CalledProcessError as err:
        return f"`ip netns exec` refused (exit {err.returncode}): {err.stderr.decode().strip()}"
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"cannot make network namespaces and a veth pair (no CAP_NET_ADMIN?): {err}"
    return None


def _stop(hosts: Hosts, procs: list[subprocess.Popen]) -> None:
    """End the torchruns and every process they started inside the namespaces."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # torchrun stops its workers
    deadline = time.monotonic() + 5
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            pass
    for ns in hosts.namespaces:  # workers run in sessions of their own: kill what is left
        for pid in _ip("netns", "pids", ns).split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    for proc in procs:
        proc.wait(timeout=5)


def run_two_hosts(
    hosts: Hosts, program: str, variant: str, nproc_per_node: int, workdir: Path,
    timeout: float = 120, same_seed: bool = False,
) -> Run:
    """Run ``variant`` of ``program`` with torchrun on both hosts; parse every rank's losses.
    ``returncode`` is the first non-zero exit of the two torchruns (0 when both succeed)."""
    path, _ = prepare(program, variant, workdir / f"{variant}-two-hosts")
    record = workdir / f"{variant}-two-hosts.pt"
    procs: list[subprocess.Popen] = []
    logs = [workdir / f"{variant}-host{node}.log" for node in range(2)]
    try:
        for node, (ns, (ifname, _)) in enumerate(zip(hosts.namespaces, HOSTS, strict=True)):
            env = program_env(program, variant, record, same_seed)
            env.update(GLOO_SOCKET_IFNAME=ifname, TP_SOCKET_IFNAME=ifname,
                       TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="[${rank}] ",
                       SHARDWISE_COLLECTIVE_TIMEOUT=str(timeout))
            command = [
                "ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run",
                "--nnodes", "2", "--nproc-per-node", str(nproc_per_node), "--node-rank", str(node),
                "--master-addr", HOSTS[0][1], "--master-port", str(MASTER_PORT),
                "--rdzv-conf", f"timeout={int(timeout)}", "--tee", "3",
                "--log-dir", str(workdir / f"{variant}-host{node}-logs"),
                str(HERE / "record.py"), str(path),
            ]
            with logs[node].open("w") as log:
                procs.append(subprocess.Popen(
                    command, cwd=path.parent, env=env, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True,
                ))
        deadline = time.monotonic() + timeout
        killed = ""
        for proc in procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                killed = f"\ntwo_hosts: killed after {timeout} s"
                break
    finally:
        _stop(hosts, procs)
    output = "".join(f"--- host {n} ---\n{log.read_text()}" for n, log in enumerate(logs))
    code = next((p.returncode for p in procs if p.returncode), 0)
    return Run(variant, code, output + killed, parse_losses(output),
               record if record.exists() else None)


def main(argv: list[str]) -> int:
    import tempfile

    from harness import OURS, largest_difference, run

    with_torch = "--torch" in argv
    argv = [a for a in argv if a != "--torch"]
    if len(argv) != 2 or argv[0] not in OURS.steps:
        print(f"usage: two_hosts.py {{{','.join(OURS.steps)}}} NPROC_PER_NODE [--torch]",
              file=sys.stderr)
        return 2
    if (reason := unavailable()) is not None:
        print(f"two hosts unavailable: {reason}", file=sys.stderr)
        return 1
    program, nproc = argv[0], int(argv[1])
    with tempfile.TemporaryDirectory() as tmp, two_hosts() as hosts:
        runs = {
            "two hosts": run_two_hosts(hosts, program, "shardwise", nproc, Path(tmp)),
            "one host": run(program, "shardwise", 2 * nproc, Path(tmp), timeout=300),
        }
        if with_torch:
            runs["torch, two hosts"] = run_two_hosts(hosts, program, "torch", nproc, Path(tmp))
        print(f"veth traffic: {hosts.traffic()} bytes")
        for name, r in runs.items():
            print(f"{name}: exit {r.returncode}")
            for rank, losses in sorted(r.losses.items()):
                print(f"  rank {rank}: " + " ".join(f"{v:.7g}" for v in losses))
            if r.returncode:
                print("\n".join("    " + ln for ln in r.output.splitlines()[-30:]))
        first, *others = runs.items()
        for name, r in others:
            if first[1].record and r.record:
                print(f"final largest relative difference, {first[0]} against {name}:",
                      largest_difference(first[1].record, r.record))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
