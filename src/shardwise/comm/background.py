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

from .. import settings
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
        except BaseException as err:
            self._error = err
        finally:
            self._done.set()

    def _described(self, fn: Callable[[], T]) -> T:
        with moving(self.description):
            return fn()


class _Worker:
    """The worker thread of one process (of one rank thread in the launcher's threads mode)."""

    def __init__(self) -> None:
        self.jobs: queue.Queue = queue.Queue()
        self.thread: threading.Thread | None = None
        self.pending = 0
        self.lock = threading.Condition()

    def loop(self) -> None:
        while True:
            work, fn, context = self.jobs.get()
            work._run(fn, context)
            with self.lock:
                self.pending -= 1
                self.lock.notify_all()


_worker: settings.ProcessLocal[_Worker] = settings.ProcessLocal(_Worker)


def submit(fn: Callable[[], T], description: str) -> Work[T]:
    """Run ``fn`` on the worker thread after every job submitted before it."""
    work: Work[T] = Work(description)
    worker = _worker.get()
    with worker.lock:
        if worker.thread is None:
            worker.thread = threading.Thread(
                target=worker.loop, name="shardwise-collectives", daemon=True
            )
            worker.thread.start()
        worker.pending += 1
    worker.jobs.put((work, fn, contextvars.copy_context()))
    return work


def drain() -> None:
    """Wait until the worker ran every submitted job (a no-op on the worker itself)."""
    worker = _worker.get()
    if threading.current_thread() is worker.thread:
        return
    with worker.lock:
        worker.lock.wait_for(lambda: worker.pending == 0)
