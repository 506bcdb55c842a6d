"""Running a replica function once per local replica, as tf.distribute's mirrored strategy does:
one Python thread per replica, run one at a time in replica order; ``merge_call`` is the point
where every replica thread waits until all have arrived, then ``merge_fn`` runs once on the
calling (main) thread in a cross-replica context (so its collectives are counted there and are
issued in the same order in every process).

A replica that neither returns nor reaches the merge point within ``settings.REPLICA_TIMEOUT``
seconds, or that calls ``merge_call`` a different number of times than the others, is a
``ReplicaSyncError``, never a hang.
"""

from __future__ import annotations

import contextvars
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .. import settings
from ..errors import ReplicaSyncError
from . import context
from .context import StrategyLike as Strategy  # by its shape: strategy.py imports this module
from .values import PerReplica, regroup, select_replica


class _Aborted(BaseException):
    """Unwinds a replica thread whose run was abandoned (another replica failed)."""


class _Replica:
    def __init__(self, index: int) -> None:
        self.index = index
        self.go = threading.Event()
        self.paused = threading.Event()
        self.state = "ready"  # then running, merge (waiting in merge_call), done, error
        self.result: Any = None
        self.error: BaseException | None = None
        self.request: tuple[Callable, tuple, dict] | None = None
        self.reply: Any = None
        self.worker: _Worker | None = None


class _Worker:
    """A long-lived replica thread of a strategy: per-thread runtime state (OpenMP thread teams,
    allocator caches) is set up once, not on every ``run``. On CPU it runs torch ops with one
    intra-op thread: a simulated device is one core, and idle thread teams of the other
    replicas would otherwise spin against the running one."""

    def __init__(self, index: int, single_threaded: bool) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.busy = False
        ready = threading.Event()
        threading.Thread(
            target=self._loop,
            args=(ready, single_threaded),
            name=f"shardwise-replica-{index}",
            daemon=True,
        ).start()
        ready.wait()

    def _loop(self, ready: threading.Event, single_threaded: bool) -> None:
        if single_threaded:
            torch.set_num_threads(1)  # this thread's OpenMP setting (the global is restored)
        ready.set()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()
            del job  # holds the strategy: let it be collected while this thread waits

    def submit(self, ctx: contextvars.Context, fn: Callable[..., Any], *args: Any) -> None:
        self.busy = True
        self._jobs.put(lambda: ctx.run(fn, *args))

    def stop(self) -> None:
        self._jobs.put(None)


_WORKERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def replica_workers(extended: Any, count: int) -> list[_Worker]:
    """The replica threads of ``extended``'s strategy; one left busy by an abandoned run (a
    replica past the timeout) is replaced."""
    pool = _WORKERS.get(extended)
    if pool is None:
        pool = []
        _WORKERS[extended] = pool
        weakref.finalize(extended, _stop, pool)
    single = extended.mesh.device_type == "cpu"
    threads = torch.get_num_threads()
    created = False
    for i in range(count):
        if i < len(pool) and not pool[i].busy:
            continue
        if i < len(pool):
            pool[i].stop()  # exits once its stuck job returns
            pool[i] = _Worker(i, single)
        else:
            pool.append(_Worker(i, single))
        created = True
    if created and single:
        torch.set_num_threads(threads)  # the process-wide setting as it was
    return pool[:count]


def _stop(pool: list[_Worker]) -> None:
    for worker in pool:
        worker.stop()


class ReplicaRunner:
    """Runs ``fn`` on every local replica of ``strategy`` (``args``: already per replica)."""

    def __init__(
        self,
        strategy: Strategy,
        fn: Callable[..., Any],
        args: list[tuple],
        kwargs: list[dict],
    ) -> None:
        self.strategy = strategy
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.count = len(args)
        self.replicas = [_Replica(i) for i in range(self.count)]
        self.aborted = False
        self.merges = 0

    # ----- main thread ------------------------------------------------------------------------
    def run(self) -> list[Any]:
        from .replica_context import ReplicaContext

        extended = self.strategy.extended
        grad_enabled = torch.is_grad_enabled()
        workers = replica_workers(extended, self.count)
        for rep, worker in zip(self.replicas, workers, strict=True):
            rc = ReplicaContext(
                self.strategy, extended._global_replica_id(rep.index), rep.index, self
            )
            rep.worker = worker
            worker.submit(contextvars.copy_context(), self._body, rep, rc, grad_enabled)
        try:
            while True:
                for rep in self.replicas:
                    if rep.state != "done":
                        self._resume(rep)
                states = [rep.state for rep in self.replicas]
                if all(s == "done" for s in states):
                    return [rep.result for rep in self.replicas]
                if all(s == "merge" for s in states):
                    self._merge()
                    continue
                done = [r.index for r in self.replicas if r.state == "done"]
                waiting = [r.index for r in self.replicas if r.state == "merge"]
                raise ReplicaSyncError(
                    f"Some replicas made a different number of replica_context().merge_call() "
                    f"calls: after {self.merges} merge(s), replicas {done} of "
                    f"{self.strategy!r} returned while replicas {waiting} wait in merge_call; "
                    f"every replica must reach the same merge points (merge_call, all_reduce, "
                    f"assign on an aggregated variable, optimizer step, from_local)"
                )
        finally:
            self._abort()

    def _resume(self, rep: _Replica) -> None:
        rep.paused.clear()
        rep.state = "running"
        rep.go.set()
        timeout = settings.REPLICA_TIMEOUT.get()
        if not rep.paused.wait(timeout):
            raise ReplicaSyncError(
                f"replica {rep.index} of {self.strategy!r} neither returned nor reached a "
                f"merge_call within {timeout:g} s (after {self.merges} merge(s)); every replica "
                f"must reach the same merge points (shardwise.settings.REPLICA_TIMEOUT sets the "
                f"limit)"
            )
        if rep.error is not None:
            raise rep.error

    def _merge(self) -> None:
        self.merges += 1
        requests = [rep.request for rep in self.replicas]
        merge_fn = requests[0][0]  # type: ignore[index]
        args = regroup([r[1] for r in requests])  # type: ignore[index]
        kwargs = regroup([r[2] for r in requests])  # type: ignore[index]
        with context.entered(context.Mode(self.strategy, None)):
            result = merge_fn(self.strategy, *args, **kwargs)
        for rep in self.replicas:
            rep.reply = select_replica(rep.index, result)

    def _abort(self) -> None:
        self.aborted = True
        for rep in self.replicas:
            rep.go.set()

    # ----- replica threads ------------------------------------------------------------------
    def _body(self, rep: _Replica, rc: Any, grad_enabled: bool) -> None:
        rep.go.wait()
        rep.go.clear()
        if self.aborted:
            self._release(rep)
            return
        view = settings.ReplicaThread(rep.index, self.count, self._rendezvous(rep))
        try:
            with (
                context.entered(context.Mode(self.strategy, rc)),
                settings.REPLICA_THREAD.override(view),
                torch.set_grad_enabled(grad_enabled),
            ):
                rep.result = self.fn(*self.args[rep.index], **self.kwargs[rep.index])
            rep.state = "done"
        except _Aborted:
            rep.state = "aborted"
        except BaseException as e:
            rep.error = e
            rep.state = "error"
        self._release(rep)
        rep.paused.set()

    @staticmethod
    def _release(rep: _Replica) -> None:
        if rep.worker is not None:
            rep.worker.busy = False

    def merge_call(
        self, index: int, merge_fn: Callable[..., Any], args: tuple, kwargs: dict
    ) -> Any:
        """Called on replica thread ``index``: wait for the others, get this replica's part of
        ``merge_fn``'s result."""
        rep = self.replicas[index]
        rep.request = (merge_fn, tuple(args), dict(kwargs))
        rep.state = "merge"
        rep.paused.set()
        rep.go.wait()
        rep.go.clear()
        if self.aborted:
            raise _Aborted
        rep.request = None
        return rep.reply

    def _rendezvous(self, rep: _Replica) -> Callable[[Any, Callable[[list], Any]], Any]:
        count = self.count

        def merge(value: Any, fn: Callable[[list], Any]) -> Any:
            def merge_fn(_strategy: Strategy, merged: Any) -> Any:
                return fn(
                    list(merged.values) if isinstance(merged, PerReplica) else [merged] * count
                )

            return self.merge_call(rep.index, merge_fn, (value,), {})

        return merge
