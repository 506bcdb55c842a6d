"""Ambient settings: the one place for state that a ``with`` block, a ``set_*`` call or a
thread changes.

Each setting is a process-wide default (changed by the public ``set_*`` functions) plus a
``contextvars.ContextVar`` override (changed by ``with`` blocks). A ``with`` block therefore
affects only the thread (or asyncio task) that entered it and is undone when it leaves, as
torch's modes are; a new thread sees the process-wide defaults.
"""

from __future__ import annotations

import contextvars
import math
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Generic, TypeVar

from .errors import InvalidArgumentError

T = TypeVar("T")
_UNSET: Any = object()


class Setting(Generic[T]):
    """A process-wide default with a per-context override."""

    def __init__(self, name: str, default: T) -> None:
        self.name = name
        self._default = default
        self._override: contextvars.ContextVar[Any] = contextvars.ContextVar(
            f"shardwise.{name}", default=_UNSET
        )

    def get(self) -> T:
        value = self._override.get()
        return self._default if value is _UNSET else value

    def set_default(self, value: T) -> None:
        """Change the process-wide value (seen by every thread without an override). In a
        rank thread of the launcher's threads mode, a process of its own, the rank's value
        instead: its context's (and the threads it starts), left as it is by the ``with``
        blocks that end after it, except one of this setting itself."""
        if RANK_THREAD.get() is None:
            self._default = value
        else:
            self._override.set(value)

    def push(self, item: Any) -> None:
        """For a tuple-valued setting: ``item`` appended in this context until ``pop`` (for a
        context manager whose ``__enter__`` and ``__exit__`` are separate calls)."""
        self._override.set((*self.get(), item))

    def pop(self) -> Any:
        """Remove and return the last item ``push`` appended in this context."""
        stack = self.get()
        self._override.set(stack[:-1])
        return stack[-1]

    def enter(self, value: T) -> contextvars.Token:
        """In this context the setting is ``value`` until ``leave(token)`` (for hooks whose
        start and end are separate calls)."""
        return self._override.set(value)

    def leave(self, token: contextvars.Token) -> None:
        """Undo the ``enter`` that returned ``token``."""
        self._override.reset(token)

    @contextmanager
    def override(self, value: T) -> Iterator[None]:
        """Within the block, in this context only, the setting is ``value``."""
        token = self._override.set(value)
        try:
            yield
        finally:
            self._override.reset(token)


# ----- environment variables (docs/multiprocess.md, "Environment variables") -------------------

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def env_flag(name: str) -> bool:
    """The on/off environment variable ``name``: 1, true, yes, on or 0, false, no, off (any
    case); unset or empty is off. Any other value raises ``InvalidArgumentError`` naming the
    variable and the values it takes."""
    text = os.environ.get(name, "")
    if text.lower() in _ON:
        return True
    if text == "" or text.lower() in _OFF:
        return False
    raise InvalidArgumentError(
        f"{name}={text!r} is not an on/off value: it takes {', '.join(_ON)} (on) or "
        f"{', '.join(_OFF)} (off), in any case; unset or empty is off"
    )


def env_seconds(name: str, default: float) -> float:
    """The environment variable ``name`` as a finite positive number of seconds (``default``
    when unset or empty); any other value raises ``InvalidArgumentError`` naming it."""
    text = os.environ.get(name, "")
    try:
        value = float(text) if text else default
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise InvalidArgumentError(
            f"{name}={text!r} is not a number of seconds: it takes a finite positive number "
            f"(such as 30 or 2.5); unset or empty is {default:g}"
        )
    return value


def environ(name: str) -> str | None:
    """The environment variable ``name`` as this thread sees it (a rank thread of the
    launcher's threads mode sees its own torchrun variables); None when unset. The package reads
    the environment here only."""
    return os.environ.get(name)


# torchrun's variables a process starts from (runtime.start)
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def torchrun_environ() -> dict[str, str]:
    """The torchrun variables that are set, as this thread sees them."""
    return {k: v for k in TORCHRUN_VARIABLES if (v := environ(k)) is not None}


# SHARDWISE_AS_TORCH=1: the drop-in switch (shardwise.as_torch) is on in every process that
# imports shardwise, and in the processes and rank threads of shardwise.launch.
AS_TORCH_ENV = "SHARDWISE_AS_TORCH"
AS_TORCH: bool = env_flag(AS_TORCH_ENV)
# Ops may redistribute their inputs themselves (explicit mode forbids it; the default).
IMPLICIT_REDISTRIBUTE: Setting[bool] = Setting(
    "implicit_redistribute", env_flag("SHARDWISE_IMPLICIT_REDISTRIBUTE")
)
# Plain tensors mixed with DTensors are taken as replicated global values.
IMPLICIT_REPLICATION: Setting[bool] = Setting("implicit_replication", False)
# Every redistribution an op makes is logged with the user's call site.
LOG_REDISTRIBUTE: Setting[bool] = Setting("log_redistribute", False)
# The top-level packages whose code is the library's, not the program's (``call_site``): their
# torch factory calls stay plain under ``default_mesh``, and call sites skip their frames.
LIBRARY_PACKAGES: Setting[tuple[str, ...]] = Setting("library_packages", ("torch", "shardwise"))
# Every cross-process collective (and process-group setup) is bounded by this many seconds.
COLLECTIVE_TIMEOUT: Setting[float] = Setting(
    "collective_timeout", env_seconds("SHARDWISE_COLLECTIVE_TIMEOUT", 300.0)
)
# Processes compare what they are about to do before each cross-process collective.
DEBUG_CHECKS: Setting[bool] = Setting("debug_checks", env_flag("SHARDWISE_DEBUG_CHECKS"))
# The agreement of processes is posted in shared memory on each host (``comm.board``; across
# hosts with the hosts' exchange, ``comm.host_tree``) rather than gathered on the CPU side group.
AGREE_IN_SHARED_MEMORY: Setting[bool] = Setting(
    "agree_in_shared_memory", not env_flag("SHARDWISE_AGREE_ON_SIDE_GROUP"))
# Cross-process reductions combine in coordinate order (the embedded run's bits) instead of the
# backend's order.
DETERMINISTIC: Setting[bool] = Setting("deterministic", env_flag("SHARDWISE_DETERMINISTIC"))
# Backend collectives (``comm.native``) return their results unwaited, as torch's functional
# collectives do: ``AsyncCollectiveTensor``s that wait at the first op that is not a view.
WAIT_AT_FIRST_USE: Setting[bool] = Setting("wait_at_first_use", False)
# What the collectives inside ``comm.moving`` blocks are moving (innermost last), for errors.
MOVING: Setting[tuple] = Setting("moving", ())
# The meshes of the ``with mesh:`` and ``default_mesh(mesh)`` blocks of this context, innermost
# last: PyTorch's current mesh and TF DTensor's default mesh are the last one.
MESHES: Setting[tuple] = Setting("meshes", ())
# The ``CommCounter``s entered in this context (innermost last).
COMM_COUNTERS: Setting[tuple] = Setting("comm_counters", ())
# The ``comm_budget`` blocks of this context (outermost first): every collective is charged to
# each of them.
COMM_BUDGETS: Setting[tuple] = Setting("comm_budgets", ())
# The operation whose collectives are being charged to the budgets (``budget.planned``).
BUDGET_OPERATION: Setting[Any] = Setting("budget_operation", None)
# The forward/backward schedule of the outermost fully_shard module running (parallel.dp_unit).
FSDP_SCHEDULE: Setting[Any] = Setting("fsdp_schedule", None)
# The view the outermost data-parallel forward running chose (parallel.data_parallel).
DATA_PARALLEL_VIEW: Setting[Any] = Setting("data_parallel_view", None)


# ----- the execution context (shardwise.execution) ----------------------------------------------
# This thread's ``execution.ExecutionContext``, declared by whoever made it (a rank thread, a
# replica thread of ``Strategy.run``); None: the process's own (``execution.current``).
EXECUTION: Setting[Any] = Setting("execution", None)
# -------------------------------------------------------------------------------------------------

# tf.distribute's context of this thread: the current strategy mode (None: default context).
DISTRIBUTION_MODE: Setting[Any] = Setting("distribution_mode", None)
# Seconds a replica thread may run before it reaches a merge point or returns.
REPLICA_TIMEOUT: Setting[float] = Setting(
    "replica_timeout", env_seconds("SHARDWISE_REPLICA_TIMEOUT", 120.0)
)
# Replica-context reads of sync-on-read variables aggregate (tf.distribute's internal
# variable_sync_on_read_context).
SYNC_ON_READ_AGGREGATES: Setting[bool] = Setting("sync_on_read_aggregates", False)


class RankThread:
    """What a rank thread of the launcher's threads mode (``shardwise.rank_threads``) is: its
    ``rank`` among ``world_size`` ranks, its view of the environment ``env`` (the torchrun
    variables), its ``torch.distributed`` state ``world`` and ``state``, the per-process state
    of ``ProcessLocal``s, which each rank thread holds for itself."""

    def __init__(self, rank: int, world_size: int, env: dict[str, str], world: Any) -> None:
        self.rank = rank
        self.world_size = world_size
        self.env = env
        self.world = world
        self.state: dict[int, Any] = {}
        # the context a draw from torch's default generator runs in (rank_threads: this rank's
        # generator swapped in)
        self.drawing: Callable[[], AbstractContextManager[Any]] = nullcontext
        # the messages between the ranks of its run (``comm.wire.Mailbox``), shared with them:
        # the transport of its execution context
        self.mailbox: Any = None


# The rank this thread runs as in the launcher's threads mode (None: this process's own rank).
RANK_THREAD: Setting[RankThread | None] = Setting("rank_thread", None)


def drawing_from_default_generator() -> AbstractContextManager[Any]:
    """Where shardwise draws a random DTensor's shards from torch's default generator: in a
    rank thread, with that rank's generator in it (only around the draws, never around a
    collective); elsewhere as it is."""
    rank = RANK_THREAD.get()
    return nullcontext() if rank is None else rank.drawing()


class ProcessLocal(Generic[T]):
    """State a process holds once (process groups, collective sequence numbers, the background
    collective worker): made by ``factory`` on first use, and once per rank thread in the
    launcher's threads mode, where every thread acts as a process of its own."""

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._value: T = factory()

    def get(self) -> T:
        rank = RANK_THREAD.get()
        if rank is None:
            return self._value
        value = rank.state.get(id(self), _UNSET)
        if value is _UNSET:
            value = rank.state[id(self)] = self._factory()
        return value
