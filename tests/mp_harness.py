"""Run a function in W fresh processes (forked from a server that has preloaded torch and
shardwise) joined by gloo on 127.0.0.1 (the multi-process fixture).

``run_in_processes(fn, W, *args, timeout=...)`` returns ``[fn(*args) in rank r for r in range(W)]``
or raises the first failing rank's traceback. Every run is bounded: past ``timeout`` the
processes are killed and ``TimeoutError`` says which ranks had not answered. Spawning and gloo
setup cost seconds, so a test should run many checks inside one job; ``fn`` must be a
module-level function (pickled by name) and return picklable values (tensors too).
"""

from __future__ import annotations

import io
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp


class ChildProcessFailed(AssertionError):
    """A spawned rank raised; the message holds its traceback."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple,
    results: Any,
    env: dict[str, str],
    timeout: float,
) -> None:
    import torch.distributed as dist

    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    ok = False
    try:
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
        value = fn(*args)
        buffer = io.BytesIO()
        torch.save(value, buffer)
        payload: Any = buffer.getvalue()
        ok = True
    except BaseException:
        payload = traceback.format_exc()
    results.put((rank, ok, payload))
    if ok and dist.is_initialized():
        try:  # keep every rank's sockets open until all are done
            dist.barrier()
            dist.destroy_process_group()
        except RuntimeError:
            pass  # a test that broke the group on purpose (timeouts)
    results.close()
    results.join_thread()


def outcomes(tries: dict[str, Callable[[], Any]], error: type[BaseException]) -> dict[str, str]:
    """Run each of ``tries``: "ok", or the text of the ``error`` it raised."""
    out = {}
    for name, fn in tries.items():
        try:
            fn()
            out[name] = "ok"
        except error as err:
            out[name] = str(err)
    return out


def _context() -> Any:
    """Fresh processes forked from one server that has imported torch, torch.distributed and
    shardwise's layers once (seconds per process under spawn): each rank starts clean, as a
    spawned one does, without paying the imports again."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "shardwise.dtensor",
                                "shardwise.ops", "shardwise.parallel", "mp_harness"])
    return ctx


def run_in_processes(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` in ``world_size`` gloo processes; return the per-rank results."""
    ctx = _context()
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, rank, world_size, port, args, results, dict(env or {}), timeout),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    answers: dict[int, Any] = {}
    try:
        while len(answers) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(answers))
                raise TimeoutError(
                    f"{fn.__name__} on {world_size} processes did not finish in {timeout:g} s; "
                    f"ranks {missing} did not answer"
                )
            try:
                rank, ok, payload = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                dead = [r for r in dead if r not in answers]
                if dead:
                    raise ChildProcessFailed(
                        f"rank {dead[0]} of {fn.__name__} died with exit code "
                        f"{procs[dead[0]].exitcode} without a result"
                    ) from None
                continue
            if not ok:
                raise ChildProcessFailed(f"rank {rank} of {fn.__name__} raised:\n{payload}")
            answers[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        for p in procs:
            p.join(timeout=min(max(deadline - time.monotonic(), 1.0), 10.0))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [answers[r] for r in range(world_size)]
