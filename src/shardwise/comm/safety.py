"""Safety settings of collectives across processes: the timeout, the debug checks, and a
description of what is being moved, for error messages.

A program whose processes diverge would otherwise hang in a collective forever: every wait is
bounded by the collective timeout, and the debug checks compare what each process is about to do
before any data moves.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from .. import settings
from ..caches import PER_GROUP, cached
from ..errors import ConcurrentCollectiveError, InvalidArgumentError
from . import protocol


def set_collective_timeout(seconds: float) -> None:
    """Bound every cross-process collective to ``seconds`` (default 300, or the environment
    variable ``SHARDWISE_COLLECTIVE_TIMEOUT``); a collective past it raises
    ``CollectiveTimeoutError``. Call it with the same value in every process."""
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, (int, float))
        or not math.isfinite(seconds)
        or seconds <= 0
    ):
        raise InvalidArgumentError(
            f"the collective timeout must be a finite positive number of seconds, got {seconds!r}"
        )
    settings.COLLECTIVE_TIMEOUT.set_default(float(seconds))


def get_collective_timeout() -> float:
    """The collective timeout in seconds."""
    return settings.COLLECTIVE_TIMEOUT.get()


def set_debug_checks(enabled: bool) -> None:
    """Before each cross-process collective, check that every process of its group agrees on
    the collective, its sequence number, the call site, mesh dim, dtype, shapes and tensor being
    moved, and raise ``CollectiveMismatchError`` naming what differs per rank (also
    ``SHARDWISE_DEBUG_CHECKS=1``). These fields join the agreement's fingerprint (no extra
    message; the call site costs some Python per collective)."""
    settings.DEBUG_CHECKS.set_default(bool(enabled))


def debug_checks_enabled() -> bool:
    return settings.DEBUG_CHECKS.get()


def set_deterministic(enabled: bool) -> None:
    """Reduce across processes in coordinate order, as the embedded run does, so N processes
    give its bits (also ``SHARDWISE_DETERMINISTIC=1``; ``deterministic()`` for a block). The
    default reduces in the backend's order, as PyTorch does: within float rounding. Same
    backend collectives, same bytes: an all_to_all and an all_gather instead of one
    all_reduce. Call it with the same value in every process."""
    settings.DETERMINISTIC.set_default(bool(enabled))


def deterministic(enabled: bool = True) -> AbstractContextManager[None]:
    """Within the block (this thread only), ``set_deterministic(enabled)``."""
    return settings.DETERMINISTIC.override(bool(enabled))


class _Moving:
    """One ``moving`` block: what it names for messages, and the spec every process must move
    alike with its fingerprint (asked for once, at the first collective across processes)."""

    __slots__ = ("description", "spec", "_checked")

    def __init__(self, description: str | Callable[[], str],
                 spec: Callable[[], tuple[dict[str, object], int]] | None) -> None:
        self.description, self.spec = description, spec
        self._checked: tuple[dict[str, object], int] | None = None

    def checked(self) -> tuple[dict[str, object], int]:
        if self._checked is None:
            self._checked = self.spec()
        return self._checked


@contextmanager
def moving(
    description: str | Callable[[], str],
    spec: Callable[[], tuple[dict[str, object], int]] | None = None,
) -> Iterator[None]:
    """Name what the collectives inside are moving (a spec and its target), for the error
    messages of timeouts and mismatches; a callable is only formatted when a message needs it.
    ``spec`` returns what every process must be moving alike (JSON values: global shape, dtype,
    placements...) and its ``protocol.fingerprint`` (``redistribution`` makes both): the
    fingerprint rides in the header of every collective inside, checked always. Per context:
    another thread does not see this thread's description."""
    with settings.MOVING.override((*settings.MOVING.get(), _Moving(description, spec))):
        yield


def current_description() -> str:
    """What the innermost ``moving`` block said, or an empty string."""
    stack = settings.MOVING.get()
    if not stack:
        return ""
    description = stack[-1].description
    return description() if callable(description) else description


@cached(PER_GROUP)
def redistribution(spec: Any, target: tuple[Any, ...]) -> tuple[dict[str, object], int]:
    """What every process redistributing the DTensor of ``spec`` (a ``DTensorSpec``) to
    ``target`` moves alike, for ``moving``: its global shape, dtype, placements and target,
    and their fingerprint (kept for the last 1024 pairs: a training loop repeats them)."""
    values = {"global shape": list(spec.shape), "dtype": str(spec.tensor_meta.dtype),
              "placements": [repr(p) for p in spec.placements], "to": [repr(p) for p in target]}
    return values, protocol.fingerprint(values)


def current_spec() -> tuple[dict[str, object], int] | None:
    """The spec of the innermost ``moving`` block that gave one, and its fingerprint; None if
    none did."""
    for entry in reversed(settings.MOVING.get()):
        if entry.spec is not None:
            return entry.checked()
    return None


class _Speaker:
    """The thread of this process that is inside a collective across processes, if any."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.depth = 0
        self.what: str | Callable[[], str] = ""


# per process (per rank thread in the launcher's threads mode, which is a process of its own)
_speaker: settings.ProcessLocal[_Speaker] = settings.ProcessLocal(_Speaker)


def _text(what: str | Callable[[], str]) -> str:
    return what() if callable(what) else what


@contextmanager
def one_thread(what: str | Callable[[], str]) -> Iterator[None]:
    """The calling thread speaks for this process in the collective across processes ``what``.

    gloo matches a group's messages by their order, so two threads of one process in
    collectives at once corrupt its groups (the process aborts inside gloo, or data goes to
    the wrong collective). A second thread that comes while another is inside raises
    ``ConcurrentCollectiveError`` before any message is sent; the same thread may nest.
    ``what`` may be a callable, formatted only for that error."""
    speaker = _speaker.get()
    me = threading.current_thread()
    with speaker.lock:
        other = speaker.thread
        if other is not None and other is not me:
            raise ConcurrentCollectiveError(
                f"thread {me.name!r} entered a collective across processes ({_text(what)}) "
                f"while thread {other.name!r} of this process is inside one "
                f"({_text(speaker.what)}): a "
                f"process runs its collectives across processes one at a time, from one thread, "
                f"in the same order as the other processes. Issue them from one thread (or "
                f"hand them to it), or run ranks as threads with shardwise.run_threads"
            )
        if other is None:
            speaker.thread, speaker.what = me, what
        speaker.depth += 1
    try:
        yield
    finally:
        with speaker.lock:
            speaker.depth -= 1
            if not speaker.depth:
                speaker.thread, speaker.what = None, ""
