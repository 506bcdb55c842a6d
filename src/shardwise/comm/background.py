"""Collectives in the background: ``async_op=True`` paths hand their work to one worker thread.

One worker per process runs the submitted jobs in submission order, so every process starts its
asynchronous collectives in the same order whatever the timing; a collective started on another
thread first waits until the worker has nothing queued (``drain``), so blocking and background
collectives never interleave differently in two processes. Across processes the worker's
collectives are ``torch.distributed`` isend/irecv work handles, which release the GIL while they
wait, so the main thread computes meanwhile; in one process the worker copies components
between simulated devices. A job keeps the caller's settings (its ``contextvars``) and the
description of what it moves; an error inside it is kept and raised at ``wait()``.
"""

from __future__ import annotations

import contextvars
import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from ..errors import CollectiveError, ShardwiseError
from .safety import moving

T = TypeVar("T")


class Work(Generic[T]):
    """A background job: ``wait()`` blocks until it ran and returns its result or raises."""

    def __init__(self, description: str) -> None:
        self.description = description
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> T:
        """The job's result; an error inside the job is raised here, naming the job."""
        self._done.wait()  # on the worker itself, a job only waits on earlier (finished) ones
        if self._error is not None:
            err = self._error
            cls = type(err) if isinstance(err, ShardwiseError) else CollectiveError
            raise cls(
                f"the background collective ({self.description}) failed, raised at its "
                f"wait(): {err}"
            ) from err
        return self._result

    def _run(self, fn: Callable[[], T], context: contextvars.Context) -> None:
        """Run ``fn`` in the submitter's context (its settings and ``CommCounter``s)."""
        try:
            self._result = context.run(self._described, fn)
        except BaseException as err:  # noqa: BLE001 - kept and raised at wait()
            self._error = err
        finally:
            self._done.set()

    def _described(self, fn: Callable[[], T]) -> T:
        with moving(self.description):
            return fn()


_jobs: queue.Queue = queue.Queue()
_state: dict[str, Any] = {"thread": None, "pending": 0}
_lock = threading.Condition()


def _worker_thread() -> threading.Thread | None:
    return _state["thread"]


def _loop() -> None:
    while True:
        work, fn, context = _jobs.get()
        work._run(fn, context)
        with _lock:
            _state["pending"] -= 1
            _lock.notify_all()


def submit(fn: Callable[[], T], description: str) -> Work[T]:
    """Run ``fn`` on the worker thread after every job submitted before it."""
    work: Work[T] = Work(description)
    with _lock:
        if _state["thread"] is None:
            thread = threading.Thread(target=_loop, name="shardwise-collectives", daemon=True)
            _state["thread"] = thread
            thread.start()
        _state["pending"] += 1
    _jobs.put((work, fn, contextvars.copy_context()))
    return work


def drain() -> None:
    """Wait until the worker ran every submitted job (a no-op on the worker itself)."""
    if threading.current_thread() is _worker_thread():
        return
    with _lock:
        _lock.wait_for(lambda: _state["pending"] == 0)
