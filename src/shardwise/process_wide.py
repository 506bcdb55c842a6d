"""What rank threads share: the state their one process holds once (``rank_threads``).

Rank threads are threads of one process, so the working directory, torch's default dtype
and device, its intra-op thread count and a few more switches exist once, for every rank. A
rank thread changing one would change it under every other rank without a word; while ranks
run (``guarded``), the calls that change them raise ``ProcessStateError`` in a rank thread
(setting the value already set is fine: every rank may run
``torch.set_default_dtype(torch.float32)``). A thread that a rank thread starts acts for
that rank (its environment, ``torch.distributed`` world, generator, shardwise's per-process
state and settings), as a helper thread of a process sees that process.
"""

from __future__ import annotations

import contextvars
import functools
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from . import settings
from .errors import ProcessStateError


def _same_dir(path: Any) -> bool:
    return os.path.samestat(os.stat(path), os.stat("."))


def _same_device(device: Any) -> bool:
    current = torch.get_default_device()
    return (device is None and current == torch.device("cpu")) or (
        device is not None and torch.device(device) == current)


# (module, function name, whether the call keeps the process's value, what it changes)
_GUARDED: list[tuple[Any, str, Callable[..., bool], str]] = [
    (os, "chdir", _same_dir, "the working directory"),
    (os, "fchdir", lambda fd: os.path.samestat(os.fstat(fd), os.stat(".")),
     "the working directory"),
    (torch, "set_default_dtype", lambda d: d == torch.get_default_dtype(),
     "torch's default dtype (pass dtype= to the factories instead)"),
    (torch, "set_default_device", _same_device,
     "torch's default device (pass device= to the factories instead)"),
    (torch, "set_num_threads", lambda n: n == torch.get_num_threads(),
     "torch's intra-op thread count"),
    (torch, "use_deterministic_algorithms",
     lambda mode, **_: bool(mode) == torch.are_deterministic_algorithms_enabled(),
     "torch's deterministic-algorithms switch"),
    (torch, "set_float32_matmul_precision",
     lambda p: p == torch.get_float32_matmul_precision(), "torch's float32 matmul precision"),
]


def _refusing(module: Any, name: str, keeps: Callable[..., bool], what: str) -> Callable:
    original = getattr(module, name)

    def call(*args: Any, **kwargs: Any) -> Any:
        rank = settings.RANK_THREAD.get()
        if rank is not None and not keeps(*args, **kwargs):
            raise ProcessStateError(
                f"{module.__name__}.{name}{args!r} in rank thread {rank.rank} of "
                f"{rank.world_size}: {what} is one per process, shared by every rank thread, "
                f"so this would change it for all ranks. Set it before the ranks start (in "
                f"the script, outside the rank threads), or run ranks as processes "
                f"(python -m shardwise.launch without --threads)"
            )
        return original(*args, **kwargs)

    return functools.wraps(original)(call)


def _start_as_rank(start: Callable[[threading.Thread], None]) -> Callable:
    """``Thread.start`` that runs a thread a rank thread starts in a copy of the rank's
    context: it acts for that rank, with the rank's shardwise settings."""

    def start_thread(self: threading.Thread) -> None:
        if settings.RANK_THREAD.get() is not None:
            self.run = functools.partial(contextvars.copy_context().run, self.run)  # type: ignore[method-assign]
        start(self)

    return start_thread


@contextmanager
def guarded() -> Iterator[None]:
    """While rank threads run: process-wide changes refused in them, and threads they start
    acting for their rank."""
    saved = [(module, name, getattr(module, name)) for module, name, _, _ in _GUARDED]
    start = threading.Thread.start
    for module, name, keeps, what in _GUARDED:
        setattr(module, name, _refusing(module, name, keeps, what))
    threading.Thread.start = _start_as_rank(start)  # type: ignore[method-assign]
    try:
        yield
    finally:
        threading.Thread.start = start  # type: ignore[method-assign]
        for module, name, original in saved:
            setattr(module, name, original)
