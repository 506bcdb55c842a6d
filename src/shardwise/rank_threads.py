"""N ranks as threads of one process: ``run_threads(fn, nproc)`` and the launcher's ``--threads``.

Each rank thread acts as one process of a gloo world of ``nproc`` ranks, so a per-rank PyTorch
program runs unchanged and gives the bits it gives in ``nproc`` processes (the same messages,
reduced in the same order):

- ``torch.distributed`` state is per rank thread: ``init_process_group``, ``get_rank``,
  ``new_group``... act on the thread's own world (c10d's ``_world`` extension point), and each
  rank's process groups are real gloo groups over loopback TCP. shardwise's own collectives
  send their point-to-point messages through the ranks' shared ``comm.wire.Mailbox`` instead:
  a hand-over in memory.
- ``os.environ`` shows each rank thread its torchrun variables (``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``MASTER_ADDR``...); what a rank thread sets there stays its own.
- torch's default CPU generator is per rank thread: ``torch.manual_seed``, ``get_rng_state``,
  ``set_rng_state`` and every random op on plain tensors use the thread's own state (a random op
  runs with that state swapped in under a lock), so a rank draws the numbers it draws alone.
- shardwise's per-process state (process groups, collective sequence numbers, the background
  collective worker) is per rank thread (``settings.ProcessLocal``).
- what the process holds once (the working directory, torch's default dtype...) a rank thread
  cannot change, and a thread a rank starts acts for that rank (``process_wide``).

The process must not be part of a multi-process world itself: threads mode replaces processes.
"""

from __future__ import annotations

import builtins
import functools
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch.overrides import TorchFunctionMode

from . import process_wide, runtime, settings
from .comm.wire import Mailbox
from .errors import CollectiveError, CollectiveTimeoutError, InvalidArgumentError
from .torch_compat import (
    C10dWorld,
    c10d_world,
    set_c10d_world,
    set_thread_isolation_mode,
    tree_leaves,
)

T = TypeVar("T")
_GRACE_S = 5.0  # after a rank fails, how long the others get to fail or finish
_THREAD_NAME = "shardwise-rank-"


def _rank() -> settings.RankThread | None:
    return settings.RANK_THREAD.get()


class _RankWorld(C10dWorld):
    """One rank thread's ``torch.distributed`` state (c10d keeps its maps in module globals)."""

    def __init__(self) -> None:
        super().__init__()
        self._maps: dict[str, dict] = {
            name: {} for name in ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config",
                                  "tags_to_pg", "pg_to_tag")
        }
        self._group_count = 0

    pg_map = property(lambda self: self._maps["pg_map"])
    pg_names = property(lambda self: self._maps["pg_names"])
    pg_group_ranks = property(lambda self: self._maps["pg_group_ranks"])
    pg_backend_config = property(lambda self: self._maps["pg_backend_config"])
    tags_to_pg = property(lambda self: self._maps["tags_to_pg"])
    pg_to_tag = property(lambda self: self._maps["pg_to_tag"])

    @property
    def group_count(self) -> int:
        return self._group_count

    @group_count.setter
    def group_count(self, value: int) -> None:
        self._group_count = value


class _WorldSwitch:
    """Stands in for c10d's ``_world``: the rank thread's world, else the process's."""

    def __init__(self, base: Any) -> None:
        object.__setattr__(self, "_base", base)

    def _current(self) -> Any:
        rank = _rank()
        return self._base if rank is None else rank.world

    def __getattr__(self, name: str) -> Any:
        return getattr(self._current(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._current(), name, value)


class _Environ(MutableMapping):
    """Stands in for ``os.environ``: a rank thread sees its own variables over the process's."""

    def __init__(self, base: MutableMapping[str, str]) -> None:
        self._base = base

    def _mine(self) -> dict[str, str] | None:
        rank = _rank()
        return None if rank is None else rank.env

    def __getitem__(self, key: str) -> str:
        mine = self._mine()
        if mine is not None and key in mine:
            return mine[key]
        return self._base[key]

    def __setitem__(self, key: str, value: str) -> None:
        mine = self._mine()
        if mine is None:
            self._base[key] = value
        else:
            mine[key] = str(value)

    def __delitem__(self, key: str) -> None:
        mine = self._mine()
        if mine is None or key not in mine:
            self._base.__delitem__(key)
        else:
            del mine[key]

    def __iter__(self) -> Iterator[str]:
        mine = self._mine() or {}
        yield from mine
        yield from (k for k in self._base if k not in mine)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def copy(self) -> dict[str, str]:
        return dict(self)


class _Generator:
    """Stands in for ``torch.random.default_generator`` (what ``torch.manual_seed``,
    ``torch.seed``, ``get_rng_state`` and ``set_rng_state`` use): a rank thread's own."""

    def __init__(self, base: torch.Generator) -> None:
        self._base = base
        self._own: dict[int, torch.Generator] = {}  # by rank

    def current(self) -> torch.Generator:
        rank = _rank()
        if rank is None:
            return self._base
        gen = self._own.get(rank.rank)
        if gen is None:
            gen = self._own[rank.rank] = torch.Generator()
            gen.set_state(self._base.get_state())  # as a fresh process: the default seed
        return gen

    def __getattr__(self, name: str) -> Any:
        return getattr(self.current(), name)


_swap_lock = threading.RLock()


@contextmanager
def _drawing(generators: _Generator) -> Iterator[None]:
    """The calling rank thread's generator state in torch's default generator (the one the
    kernels draw from) for the duration, under a lock that other draws wait on."""
    mine = generators.current()
    base = generators._base
    with _swap_lock:
        saved = base.get_state()
        base.set_state(mine.get_state())
        try:
            yield
        finally:
            mine.set_state(base.get_state())
            base.set_state(saved)


# torch functions and Tensor methods that draw from the default generator
_RANDOM = frozenset({
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "normal",
    "bernoulli", "multinomial", "poisson", "dropout", "dropout_", "alpha_dropout",
    "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d", "rrelu", "rrelu_",
    "uniform_", "normal_", "bernoulli_", "random_", "exponential_", "cauchy_", "log_normal_",
    "geometric_",
})


_DRAWS: dict[Any, bool] = {}  # per torch function: whether it draws from the default generator


def _draws(func: Any) -> bool:
    return getattr(func, "__name__", None) in _RANDOM or (
        getattr(func, "__module__", None) == "torch.nn.init"  # calls Tensor.uniform_ inside
    )


class _RankRandom(TorchFunctionMode):
    """In a rank thread, a random torch function on plain tensors runs with the thread's
    generator state in torch's default generator (swapped in and out under a lock); other calls
    pass through. A torch function mode, not a dispatch mode: shardwise takes a dispatch mode
    for a tracer. Calls inside a torch function do not come here, hence ``torch.nn.init``'s
    functions count as random ones. A call on a DTensor passes through too: shardwise swaps the
    generator in around its draw of the global value only (``settings.RankThread.drawing``),
    since the op may communicate first (the generator check), and a lock held across a
    collective would stop the other ranks from reaching it."""

    def __init__(self, generators: _Generator) -> None:
        super().__init__()
        self._generators = generators

    def __torch_function__(self, func, types, args=(), kwargs=None):
        try:
            random = _DRAWS.get(func)
        except TypeError:  # an unhashable callable: decided on every call
            random = _draws(func)
        if random is None:
            random = _DRAWS[func] = _draws(func)
        if not random:  # nearly every call: as fast out as a mode allows
            return func(*args, **kwargs) if kwargs else func(*args)
        kwargs = kwargs or {}
        if any(
            t is not torch.Tensor and t is not torch.nn.Parameter for t in types
        ) or any(  # a DTensor does not list its type in ``types`` (no __torch_function__)
            isinstance(t, torch.Tensor) and type(t) not in (torch.Tensor, torch.nn.Parameter)
            for t in tree_leaves((args, kwargs))
        ):
            return func(*args, **kwargs)
        with _drawing(self._generators):
            return func(*args, **kwargs)


_installed_lock = threading.Lock()


@contextmanager
def _installed() -> Iterator[_Generator]:
    """Per-rank-thread ``torch.distributed``, environment and generator, while ranks run."""
    if not _installed_lock.acquire(blocking=False):
        raise InvalidArgumentError(
            "run_threads is already running in this process; rank threads cannot start rank "
            "threads of their own"
        )
    world, environ = c10d_world(), os.environ
    generator = torch.random.default_generator
    switch = _Generator(generator)
    set_c10d_world(_WorldSwitch(world))
    os.environ = _Environ(environ)  # type: ignore[assignment]  # noqa: B003 - a view, not a reset
    torch.random.default_generator = switch  # type: ignore[assignment]
    # process groups are registered by name (the same names in every rank): one registry per
    # thread
    set_thread_isolation_mode(True)
    try:
        yield switch
    finally:
        set_thread_isolation_mode(False)
        torch.random.default_generator = generator
        os.environ = environ  # type: ignore[assignment]  # noqa: B003
        set_c10d_world(world)
        _installed_lock.release()


@contextmanager
def _serialized_imports() -> Iterator[None]:
    """Imports that load something take turns across rank threads: a lazily importing package
    (transformers' ``from transformers import LlamaForCausalLM``) is not safe for two threads
    racing through it, and N processes never race. Imports of what is loaded already skip
    the lock."""
    lock = threading.RLock()
    original = builtins.__import__

    def serialized(name: str, globals=None, locals=None, fromlist=(), level=0):
        module = sys.modules.get(name) if level == 0 else None
        spec = getattr(module, "__spec__", None)
        if module is not None and not getattr(spec, "_initializing", False) and all(
            n in module.__dict__ for n in fromlist or () if n != "*"
        ):
            return original(name, globals, locals, fromlist, level)
        with lock:
            return original(name, globals, locals, fromlist, level)

    builtins.__import__ = serialized
    try:
        yield
    finally:
        builtins.__import__ = original


@contextmanager
def _one_intra_op_thread(nproc: int) -> Iterator[None]:
    """As torchrun gives each of several processes one intra-op thread unless
    ``OMP_NUM_THREADS`` says otherwise: torch's intra-op pool is the process's, and every rank
    thread entering a parallel kernel would bring a team of its own onto the same cores."""
    if nproc == 1 or settings.environ("OMP_NUM_THREADS") is not None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    """The torchrun variables of ``rank`` of ``nproc`` ranks meeting at 127.0.0.1:``port``."""
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
        "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        **({"OMP_NUM_THREADS": settings.environ("OMP_NUM_THREADS") or "1"} if nproc > 1 else {}),
    }


def _check_alone(nproc: int) -> None:
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise InvalidArgumentError(f"nproc must be a positive int, got {nproc!r}")
    rank, world = runtime.rank_and_world()
    if world > 1:
        raise InvalidArgumentError(
            f"threads mode runs {nproc} ranks in this process, but this process is already rank "
            f"{rank} of a torch.distributed world of {world} processes; threads mode does not "
            f"combine with several processes (gloo cannot run two threads' collectives on one "
            f"group)"
        )
    if int(settings.environ("WORLD_SIZE") or "1") > 1:
        raise InvalidArgumentError(
            f"threads mode runs {nproc} ranks in this process, but this process was started as "
            f"rank {settings.environ('RANK')} of WORLD_SIZE={settings.environ('WORLD_SIZE')} "
            f"processes; "
            f"threads mode does not combine with several processes: start one process"
        )


def _run_rank(
    rank: settings.RankThread, generators: _Generator, fn: Callable[..., T], args: tuple,
    kwargs: dict, done: queue.Queue,
) -> None:
    with settings.RANK_THREAD.override(rank):
        rank.mailbox.turns.enroll()
        try:
            with _RankRandom(generators):
                result = fn(*args, **kwargs)
        except SystemExit as err:
            if err.code not in (None, 0):
                done.put((rank.rank, False, err, "", time.monotonic()))
            else:
                done.put((rank.rank, True, None, "", time.monotonic()))
        except BaseException as err:
            done.put((rank.rank, False, err, traceback.format_exc(), time.monotonic()))
        else:
            done.put((rank.rank, True, result, "", time.monotonic()))
        finally:  # closing this rank's sockets makes peers waiting on it fail at once
            rank.mailbox.turns.leave()
            rank.mailbox.leave(rank.rank)
            runtime.shutdown()


class RankFailedError(CollectiveError):
    """A rank of ``run_threads`` raised; the original error is its ``__cause__``."""

    def __init__(self, rank: int, nproc: int, error: BaseException, trace: str) -> None:
        super().__init__(
            f"rank {rank} of {nproc} rank threads failed with "
            f"{type(error).__name__}: {error}\n{trace}"
        )
        self.rank = rank
        self.error = error


def run_threads(
    fn: Callable[..., T], nproc: int, *args: Any, timeout: float = 300.0, **kwargs: Any
) -> list[T]:
    """Run ``fn(*args, **kwargs)`` as ranks ``0..nproc-1`` of a gloo world, one thread each, in
    this process; return each rank's result, in rank order.

    Inside ``fn`` everything is as in ``nproc`` processes started by ``torchrun``: the
    environment, ``torch.distributed`` (``init_process_group("gloo")`` or
    ``shardwise.init_device_mesh`` set it up), torch's default CPU generator. If a rank raises,
    ``RankFailedError`` names the first one (its error is the ``__cause__``); if the ranks have
    not all finished after ``timeout`` seconds, ``CollectiveTimeoutError`` names those still
    running (their threads are left behind, as daemons).
    """
    _check_alone(nproc)
    port = _free_port()
    done: queue.Queue = queue.Queue()
    mailbox = Mailbox()
    with (_one_intra_op_thread(nproc), _serialized_imports(), _installed() as generators,
          process_wide.guarded()):
        threads = []
        for r in range(nproc):
            rank = settings.RankThread(r, nproc, rank_env(r, nproc, port), _RankWorld())
            rank.drawing = functools.partial(_drawing, generators)
            rank.mailbox = mailbox
            threads.append(threading.Thread(
                target=_run_rank, args=(rank, generators, fn, args, kwargs, done),
                name=f"{_THREAD_NAME}{r}", daemon=True,
            ))
        for t in threads:
            t.start()
        results: dict[int, Any] = {}
        failures: list[tuple[float, int, BaseException, str]] = []
        deadline = time.monotonic() + timeout
        while len(results) + len(failures) < nproc:
            left = deadline - time.monotonic()
            if failures:
                left = min(left, failures[0][0] + _GRACE_S - time.monotonic())
            try:
                r, ok, value, trace, when = done.get(timeout=max(left, 0.0))
            except queue.Empty:
                break
            if ok:
                results[r] = value
            else:
                failures.append((when, r, value, trace))
        if failures:
            # the ranks that reported still close their groups: joined, since a thread in
            # gloo's C++ at interpreter exit aborts the process ("terminate called...")
            _, r, err, trace = min(failures, key=lambda f: f[0])
            until = max(failures[0][0] + _GRACE_S, time.monotonic() + 1.0)
            for t in threads:
                t.join(timeout=max(until - time.monotonic(), 0.0))
            raise RankFailedError(r, nproc, err, trace) from err
        if len(results) < nproc:
            running = [r for r in range(nproc) if r not in results]
            raise CollectiveTimeoutError(
                f"rank threads {running} of {nproc} were still running after {timeout:g} s "
                f"(a collective that not every rank reached, or a rank stuck); ranks "
                f"{sorted(results)} finished"
            )
        for t in threads:
            t.join()
    return [results[r] for r in range(nproc)]


def launch_threads(script: str, args: Sequence[str] = (), *, nproc: int, module: bool = False,
                   timeout: float = 1e9) -> int:
    """``python -m shardwise.launch --threads``: run ``script`` (a module with ``module``) as
    ``nproc`` rank threads of this process; 0 if all succeed, else 1 with the first failing
    rank's traceback on stderr (a rank's ``sys.exit(code)`` returns ``code``). SIGINT, SIGTERM
    or SIGHUP stop the run at once: 128 + the signal. Ranks still inside a collective then (a
    failure's peers past the grace period too) end with the process (``os._exit``: a thread
    left in gloo at interpreter exit would abort it)."""
    import runpy
    import sys

    sys.argv = [script, *args]

    def main() -> None:
        if module:
            runpy.run_module(script, run_name="__main__", alter_sys=False)
        else:
            runpy.run_path(script, run_name="__main__")

    out, err_stream = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Lines(out), _Lines(err_stream)  # type: ignore[assignment]
    previous = _stop_on_signals()
    code = 0
    try:
        run_threads(main, nproc, timeout=timeout)
    except _Signalled as stop:
        print(f"shardwise.launch --threads: received {signal.Signals(stop.signum).name}; "
              f"stopped the rank threads", file=sys.stderr)
        code = 128 + stop.signum
    except RankFailedError as err:
        code = 1
        if isinstance(err.error, SystemExit) and (
                err.error.code is None or isinstance(err.error.code, int)):
            code = err.error.code or 0
        else:
            print(f"shardwise.launch --threads: {err}", file=sys.stderr)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = out, err_stream
    if any(t.name.startswith(_THREAD_NAME) and t.is_alive() for t in threading.enumerate()):
        # a rank still inside a collective: the interpreter's exit would abort under it
        os._exit(code)
    return code


class _Signalled(BaseException):
    """SIGINT, SIGTERM or SIGHUP reached the launcher in threads mode."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stop_on_signals() -> dict[int, Any]:
    """Make SIGINT, SIGTERM and SIGHUP raise ``_Signalled`` in the main thread (even where the
    shell started the launcher with SIGINT ignored, as a background job); the previous
    handlers (none outside the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def stop(signum: int, _frame: Any) -> None:
        raise _Signalled(signum)

    return {signum: signal.signal(signum, stop)
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}


class _Lines:
    """A text stream shared by rank threads that writes whole lines only, as the process
    launcher's pumps do: each thread's partial line waits for its newline (or a flush)."""

    def __init__(self, base: Any) -> None:
        self.base = base
        self.lock = threading.Lock()
        self.pending: dict[int, str] = {}

    def write(self, text: str) -> int:
        ident = threading.get_ident()
        with self.lock:
            held = self.pending.pop(ident, "") + text
            cut = held.rfind("\n") + 1
            if cut:
                self.base.write(held[:cut])
            if held[cut:]:
                self.pending[ident] = held[cut:]
        return len(text)

    def flush(self) -> None:
        with self.lock:
            rest = self.pending.pop(threading.get_ident(), "")
            if rest:
                self.base.write(rest)
            self.base.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)
