"""Collectives in the background: ``async_op=True`` paths hand their work to one worker thread.

One worker per process runs the submitted jobs in submission order, so every process starts its
asynchronous collectives in the same order whatever the timing; a collective started on another
thread first waits until the worker has nothing queued (``drain``), so blocking and background
collectives never interleave differently in two processes. Across processes the worker's
collectives are ``torch.distributed`` isend/irecv work handles, which release the GIL while they
wait, so the main thread computes meanwhile; in one process the worker copies components
between simulated devices. A job keeps the caller's settings (its ``contextvars``) and the
description of what it moves; an error inside it is kept and raised at ``wait()``.

Work whose every collective is one of the backend's own (``native.py``) needs no thread:
``issue`` runs it at once under ``settings.WAIT_AT_FIRST_USE``, so its collectives are issued
and their results, torch's ``AsyncCollectiveTensor``s, are waited by ``wait()`` or by their
first use, as PyTorch's functional collectives are.
"""

from __future__ import annotations

import contextvars
import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from .. import settings
from ..errors import CollectiveError, ShardwiseError
from ..torch_compat import AsyncCollectiveTensor
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
        return self._outcome()

    def _outcome(self) -> T:
        """The job's result, or its error raised naming the job."""
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


class Issued(Work[list]):
    """A job run at once whose backend collectives are issued and not waited: ``wait()`` waits
    for each, once, and returns the job's tensors; ``done()`` is whether that happened."""

    def __init__(self, fn: Callable[[], list], description: str) -> None:
        super().__init__(description)
        try:
            with settings.WAIT_AT_FIRST_USE.override(True):
                self._result = self._described(fn)
        except BaseException as err:  # raised at wait(), as a background job's
            self._error = err
            self._done.set()

    def unwaited(self) -> list:
        """The job's tensors as issued (torch's ``AsyncCollectiveTensor``s where a collective
        is pending: view ops on them stay unwaited), or its error raised."""
        return self._result if self._error is None else self._outcome()

    def wait(self) -> list:
        if not self._done.is_set():
            try:
                self._result = [t.trigger_wait() if isinstance(t, AsyncCollectiveTensor) else t
                                for t in self._result]
            except RuntimeError as err:
                self._error = err
            self._done.set()
        return self._outcome()


def issue(fn: Callable[[], list], description: str) -> Issued:
    """Run ``fn`` (a job of backend collectives returning tensors) now, its collectives left
    to wait at ``wait()`` or at first use (no thread)."""
    return Issued(fn, description)
