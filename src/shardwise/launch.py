"""``python -m shardwise.launch --nproc N script.py [args]``: run a script in N local processes.

For people without ``torchrun`` habits: each process gets the environment ``torchrun`` would
give it (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` on 127.0.0.1 and a free port), so ``init_device_mesh`` joins the processes
into one world (``--threads``: N rank threads of one process instead, see
``shardwise.rank_threads``). Every line a process prints comes out prefixed with its rank
(``[0] ...``, as torchrun's ``--tee``/``--role`` output). If one process fails the others are
stopped and its exit code is returned. SIGINT, SIGTERM and SIGHUP sent to the launcher are
forwarded to every process, and ``--timeout`` bounds the whole run; either way each process's
process group (the rank and what it started) is stopped, killed after a grace period. The ranks
die with the launcher even when it is killed with SIGKILL (a parent-death signal and a
watchdog process), are stopped when its output is closed (exit 141), and are stopped when not
all of them could be started (exit 1).

The launcher uses the standard library only (the package loads lazily, so nothing imports torch
here) and the processes start at once; it returns as soon as they have all exited.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import BinaryIO

from . import settings

_GRACE_S = 5.0
_POLL_S = 0.05  # how often the launcher looks at signals and the deadline
_TIMEOUT_CODE = 124  # as coreutils' timeout
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants a port number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 1 to 65535 (0: a free one), got {port}")
    return port


def positive_int(text: str) -> int:
    """argparse type: a whole number of at least 1 (launcher and demo counts)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m shardwise.launch",
        description="Run a shardwise script in N local processes (gloo on CPU), like torchrun.",
    )
    parser.add_argument(
        "--nproc", "--nproc-per-node", dest="nproc", type=positive_int, required=True,
        help="number of processes to start",
    )
    parser.add_argument("--master-port", type=_port, default=0, help="rendezvous port (0: free)")
    parser.add_argument(
        "--timeout", type=_seconds, metavar="SECONDS",
        help="limit on the whole run: past it the processes still running are stopped and the "
             "exit code is 124",
    )
    parser.add_argument(
        "--threads", action="store_true",
        help="run the N ranks as threads of this one process instead (each rank thread sees its "
             "own RANK/WORLD_SIZE environment, torch.distributed world on gloo and default "
             "random generator; same results as N processes). A failing rank's traceback is "
             "printed and the exit code is 1",
    )
    parser.add_argument(
        "--as-torch", action="store_true",
        help="PyTorch's DTensor modules resolve to shardwise in every rank (shardwise.as_torch; "
             "also SHARDWISE_AS_TORCH=1), for programs and libraries that import torch's",
    )
    parser.add_argument("-m", dest="module", action="store_true", help="run script as a module")
    parser.add_argument("script", help="the script (or module, with -m) to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    ns = parser.parse_args(argv)
    if ns.threads and ns.timeout is not None:
        parser.error("--timeout applies to processes, not to --threads")
    return ns


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    """Send ``signum`` to the process group ``proc`` leads (the rank and what it started)."""
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):  # the whole group is gone already
        pass


def _stop(procs: list[subprocess.Popen], signum: int = signal.SIGTERM) -> None:
    """Send ``signum`` to every process group, wait for the processes (SIGKILL to the groups
    that outlive the grace period), then kill what the processes left behind in their groups."""
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signum)
    deadline = time.monotonic() + _GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()
    for p in procs:  # grandchildren got the signal with their parent and as long to go
        _signal_group(p, signal.SIGKILL)


def _exit_code(returncode: int) -> int:
    """A child's exit status as a shell reports it (128 + signal for a killed child)."""
    return 128 - returncode if returncode < 0 else returncode


def _child_env(rank: int, nproc: int, port: int) -> dict[str, str]:
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
    env.setdefault("PYTHONUNBUFFERED", "1")  # lines come out as they are printed
    return env


def _pump(rank: int, source: BinaryIO, sink: BinaryIO, lock: threading.Lock,
          closed: threading.Event) -> None:
    """Copy a child's output to ``sink`` line by line, each line prefixed with its rank. When
    ``sink`` is closed (the reader of a pipe left) set ``closed`` and read on, dropping the
    lines, so the child never blocks on a full pipe."""
    prefix = f"[{rank}] ".encode()
    for line in iter(source.readline, b""):
        if closed.is_set():
            continue
        with lock:
            try:
                sink.write(prefix + line)
                sink.flush()
            except (BrokenPipeError, ValueError):  # ValueError: the sink object was closed
                closed.set()
    source.close()


def _report_exit(rank: int, proc: subprocess.Popen, exits: queue.Queue) -> None:
    exits.put((rank, proc.wait()))


def _binary(stream: object) -> BinaryIO:
    return getattr(stream, "buffer", stream)  # type: ignore[return-value]


def launch(
    script: str,
    args: Sequence[str] = (),
    *,
    nproc: int,
    master_port: int = 0,
    module: bool = False,
    timeout: float | None = None,
) -> int:
    """Run ``script`` in ``nproc`` processes; return 0 if all succeed, else the first failing
    process's exit code (the others are stopped). SIGINT, SIGTERM or SIGHUP to this process
    (when called from the main thread) stops them all and returns 128 + the signal; past
    ``timeout`` seconds they are stopped and the result is 124."""
    port = master_port or _free_port()
    command = [sys.executable, *(["-m", script] if module else [script]), *args]
    received: list[int] = []
    previous = _catch_signals(received)
    try:
        return _run(command, nproc, port, timeout, received)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _catch_signals(received: list[int]) -> dict[int, object]:
    """Record SIGINT/SIGTERM/SIGHUP in ``received`` instead of dying; the previous handlers
    (nothing outside the main thread, where handlers cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {
        signum: signal.signal(signum, lambda got, _frame: received.append(got))
        for signum in _FORWARDED
    }


def _parent_death_signal() -> Callable[[], None] | None:
    """What a rank runs between fork and exec so that the kernel kills it when the launcher
    dies (which a launcher killed with SIGKILL cannot do itself): Linux's
    ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, looked up here, before any fork; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    launcher = os.getpid()

    def die_with_launcher() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != launcher:  # it died before the prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return die_with_launcher


# Started beside the ranks, in a session of its own: it waits on a pipe from the launcher and,
# when the pipe ends before the launcher says "done" (the launcher died, even by SIGKILL),
# kills every rank's process group (the ranks and what they started).
_WATCHDOG = """
import os, signal, sys
groups = []
for line in sys.stdin:
    if line.strip() == "done":
        sys.exit(0)
    groups.append(int(line))
for group in groups:
    try:
        os.killpg(group, signal.SIGKILL)
    except OSError:
        pass
"""


def _watchdog() -> subprocess.Popen | None:
    """The watchdog (None where it cannot start: the ranks still die by the parent-death
    signal on Linux)."""
    try:
        return subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCHDOG],
                                stdin=subprocess.PIPE, text=True, start_new_session=True)
    except OSError:
        return None


def _tell(watchdog: subprocess.Popen | None, line: str) -> None:
    if watchdog is not None:
        try:
            watchdog.stdin.write(line + "\n")
            watchdog.stdin.flush()
        except OSError:
            pass


def _start(command: list[str], nproc: int, port: int,
           watchdog: subprocess.Popen | None) -> list[subprocess.Popen]:
    """Start the ranks, each leading its own process group (stopping reaches its children)
    and dying with the launcher; if one cannot start (open files or processes exhausted),
    stop those started and raise ``_StartFailed``."""
    procs: list[subprocess.Popen] = []
    die_with_launcher = _parent_death_signal()
    try:
        for rank in range(nproc):
            procs.append(subprocess.Popen(
                command, env=_child_env(rank, nproc, port), stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, start_new_session=True, preexec_fn=die_with_launcher,
            ))
            _tell(watchdog, str(procs[-1].pid))
    except OSError as err:
        _stop(procs, signal.SIGKILL)
        for p in procs:
            p.stdout.close()
            p.stderr.close()
        raise _StartFailed(
            f"could not start process {len(procs)} of {nproc} ({err}); stopped the "
            f"{len(procs)} already started"
        ) from None
    return procs


class _StartFailed(Exception):
    """Not every rank could be started (the started ones were stopped)."""


def _run(
    command: list[str], nproc: int, port: int, timeout: float | None, received: list[int]
) -> int:
    watchdog = _watchdog()
    try:
        return _supervise(command, nproc, port, timeout, received, watchdog)
    except _StartFailed as err:
        return _finish([], 1, str(err))
    finally:
        _tell(watchdog, "done")
        if watchdog is not None:
            with contextlib.suppress(OSError):
                watchdog.stdin.close()
            watchdog.wait()


def _supervise(
    command: list[str], nproc: int, port: int, timeout: float | None, received: list[int],
    watchdog: subprocess.Popen | None,
) -> int:
    procs = _start(command, nproc, port, watchdog)
    locks = {"out": threading.Lock(), "err": threading.Lock()}
    closed = threading.Event()  # the launcher's stdout or stderr was closed (| head)
    pumps = [
        threading.Thread(target=_pump, args=(rank, pipe, _binary(sink), locks[name], closed),
                         daemon=True)
        for rank, p in enumerate(procs)
        for name, pipe, sink in (("out", p.stdout, sys.stdout), ("err", p.stderr, sys.stderr))
    ]
    exits: queue.Queue[tuple[int, int]] = queue.Queue()
    for rank, p in enumerate(procs):
        threading.Thread(target=_report_exit, args=(rank, p, exits), daemon=True).start()
    for t in pumps:
        t.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    running = set(range(nproc))
    while running:
        if received:
            signum = received[0]
            _stop(procs, signum)
            return _finish(pumps, 128 + signum, f"received {signal.Signals(signum).name}; "
                           "stopped the processes")
        if closed.is_set():
            _stop(procs)
            return _finish(pumps, 128 + signal.SIGPIPE, "its output was closed; stopped the "
                           "processes")
        if deadline is not None and time.monotonic() >= deadline:
            _stop(procs)
            return _finish(pumps, _TIMEOUT_CODE, f"timed out after {timeout:g} s; stopped the "
                           f"processes still running: {sorted(running)}")
        try:
            rank, returncode = exits.get(timeout=_POLL_S)
        except queue.Empty:
            continue
        running.discard(rank)
        if returncode != 0:
            code = _exit_code(returncode)
            _stop(procs)
            return _finish(pumps, code, f"process {rank} exited with code {code}; "
                           "stopped the others")
    _drain(pumps)
    return 0


def _finish(pumps: list[threading.Thread], code: int, message: str) -> int:
    """Let the processes' last lines out, then say in one line why the run ended."""
    _drain(pumps)
    for stream, text in ((sys.stdout, ""), (sys.stderr, f"shardwise.launch: {message}\n")):
        try:
            stream.write(text)
            stream.flush()
        except (BrokenPipeError, ValueError):
            _silence(stream)
    return code


def _silence(stream: object) -> None:
    """Point a closed output's descriptor at /dev/null, so the interpreter's last flush does
    not fail on it (as Python's documentation advises for a broken pipe)."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())  # type: ignore[attr-defined]
    except (OSError, ValueError, AttributeError):
        pass


def _drain(pumps: list[threading.Thread]) -> None:
    """Wait for the children's last lines (a grandchild holding a pipe open is not waited
    for beyond a moment)."""
    deadline = time.monotonic() + _GRACE_S
    for t in pumps:
        t.join(timeout=max(deadline - time.monotonic(), 0.01))


def main(argv: Sequence[str] | None = None) -> int:
    ns = _parse(argv)
    if (ns.as_torch or settings.AS_TORCH) and ns.threads:  # one process: switch it on here
        from .as_torch import as_torch

        as_torch()
    elif ns.as_torch or settings.AS_TORCH:  # each process runs the script under the switch
        ns.script, ns.args, ns.module = (
            "shardwise.as_torch", [*(["-m"] if ns.module else []), ns.script, *ns.args], True
        )
    if ns.threads:
        from .rank_threads import launch_threads  # imports torch: only in threads mode

        return launch_threads(ns.script, ns.args, nproc=ns.nproc, module=ns.module)
    return launch(
        ns.script, ns.args, nproc=ns.nproc, master_port=ns.master_port, module=ns.module,
        timeout=ns.timeout,
    )


if __name__ == "__main__":
    sys.exit(main())
