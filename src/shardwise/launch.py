"""``python -m shardwise.launch --nproc N script.py [args]``: run a script in N local processes.

For people without ``torchrun`` habits: each process gets the environment ``torchrun`` would
give it (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` on 127.0.0.1 and a free port), so ``init_device_mesh`` joins the processes
into one world. If one process fails the others are stopped and its exit code is returned.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

_GRACE_S = 5.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m shardwise.launch",
        description="Run a shardwise script in N local processes (gloo on CPU), like torchrun.",
    )
    parser.add_argument(
        "--nproc", "--nproc-per-node", dest="nproc", type=int, required=True,
        help="number of processes to start",
    )
    parser.add_argument("--master-port", type=int, default=0, help="rendezvous port (0: free)")
    parser.add_argument("-m", dest="module", action="store_true", help="run script as a module")
    parser.add_argument("script", help="the script (or module, with -m) to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    ns = parser.parse_args(argv)
    if ns.nproc < 1:
        parser.error(f"--nproc must be at least 1, got {ns.nproc}")
    return ns


def _stop(procs: list[subprocess.Popen]) -> None:
    """Terminate the processes still running, then kill those that outlive the grace period."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + _GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _exit_code(returncode: int) -> int:
    """A child's exit status as a shell reports it (128 + signal for a killed child)."""
    return 128 - returncode if returncode < 0 else returncode


def launch(
    script: str,
    args: Sequence[str] = (),
    *,
    nproc: int,
    master_port: int = 0,
    module: bool = False,
) -> int:
    """Run ``script`` in ``nproc`` processes; return 0 if all succeed, else the first failing
    process's exit code (the others are stopped)."""
    port = master_port or _free_port()
    target = ["-m", script] if module else [script]
    procs = []
    for rank in range(nproc):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            GROUP_RANK="0",
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        if nproc > 1:  # as torchrun: one intra-op thread each unless the user chose otherwise
            env.setdefault("OMP_NUM_THREADS", "1")
        procs.append(subprocess.Popen([sys.executable, *target, *args], env=env))
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                print(
                    f"shardwise.launch: process {rank} exited with code {_exit_code(code)}; "
                    f"stopping the others",
                    file=sys.stderr,
                )
                _stop(procs)
                return _exit_code(code)
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.05)
    except KeyboardInterrupt:
        _stop(procs)
        return 128 + signal.SIGINT


def main(argv: Sequence[str] | None = None) -> int:
    ns = _parse(argv)
    return launch(
        ns.script, ns.args, nproc=ns.nproc, master_port=ns.master_port, module=ns.module
    )


if __name__ == "__main__":
    sys.exit(main())
