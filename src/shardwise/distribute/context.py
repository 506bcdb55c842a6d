"""tf.distribute's contexts: which strategy is current, and whether this thread is in a
replica context, a cross-replica context or an update context (spec 1B.0).

The state is one ``settings.DISTRIBUTION_MODE`` value per thread (a ``Mode``); ``with`` blocks
replace it and restore it on exit, so nesting is a stack.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Protocol

from .. import settings
from ..errors import DistributeContextError


class StrategyLike(Protocol):
    """A tf.distribute strategy as this package's modules beneath ``strategy.py`` use it
    (``Strategy`` is one). They name it by its shape: ``strategy.py`` imports them, and nothing
    imports back up."""

    extended: Any
    _is_default: bool

    @property
    def num_replicas_in_sync(self) -> int: ...

    def scope(self) -> Any: ...

    def run(self, fn: Callable[..., Any], args: Any = (), kwargs: Any = None,
            options: Any = None) -> Any: ...

    def reduce(self, reduce_op: Any, value: Any, axis: Any = None) -> Any: ...

    def distribute_module(self, module: Any) -> Any: ...


class ReplicaContextLike(Protocol):
    """A replica context (``replica_context.ReplicaContext``), by its shape as above."""

    _strategy: StrategyLike

    @property
    def num_replicas_in_sync(self) -> int: ...

    def merge_call(self, merge_fn: Callable[..., Any], args: Any = (),
                   kwargs: Any = None) -> Any: ...


CROSS_REPLICA_ONLY = (
    "Method requires being in cross-replica context, use get_replica_context().merge_call()"
)


@dataclass(frozen=True)
class Mode:
    """One entry of the context stack: a strategy and its replica context (None: cross-replica);
    ``update_replica`` is set inside ``extended.update``."""

    strategy: StrategyLike
    replica_context: ReplicaContextLike | None
    update_replica: int | None = None
    explicit_default: bool = False


# the maker of the strategy in force outside every scope, installed by ``strategies`` (which the
# package's ``__init__`` imports before any submodule is used): contexts sit below strategies
_default_strategy: Callable[[], StrategyLike] | None = None


def install_default_strategy(make: Callable[[], StrategyLike]) -> None:
    """Set the function returning the default strategy (``strategies.default_strategy``)."""
    global _default_strategy
    _default_strategy = make


def current_mode() -> Mode:
    mode = settings.DISTRIBUTION_MODE.get()
    if mode is None:
        strategy = _default_strategy()
        return Mode(strategy, strategy.extended._default_replica_context)
    return mode


@contextmanager
def entered(mode: Mode) -> Iterator[None]:
    with settings.DISTRIBUTION_MODE.override(mode):
        yield


def get_strategy() -> StrategyLike:
    """The current strategy: the one whose scope or ``run`` we are in, else the default one."""
    return current_mode().strategy


def has_strategy() -> bool:
    """True inside a (non-default) strategy's scope or ``run``."""
    return not current_mode().strategy._is_default


def in_cross_replica_context() -> bool:
    """True in a strategy's scope outside ``run``, in ``merge_call``'s merge_fn and in
    ``extended.update``."""
    return current_mode().replica_context is None


def get_replica_context() -> ReplicaContextLike | None:
    """The current ``ReplicaContext`` (the default one outside every scope), or None in a
    cross-replica context."""
    return current_mode().replica_context


def get_cross_replica_context() -> StrategyLike | None:
    """The current strategy in a cross-replica context, else None."""
    mode = current_mode()
    return mode.strategy if mode.replica_context is None else None


def get_update_replica_id() -> int | None:
    """Inside ``extended.update`` / ``update_non_slot``: the replica being updated, else None."""
    return current_mode().update_replica


def in_replica_context_of(strategy: StrategyLike) -> bool:
    mode = current_mode()
    return (
        mode.replica_context is not None
        and mode.strategy is strategy
        and not (
            strategy._is_default
            and mode.replica_context is strategy.extended._default_replica_context
        )
    )


@contextmanager
def update_context(replica: int) -> Iterator[None]:
    """The update context for one replica/device inside ``extended.update``."""
    with entered(replace(current_mode(), replica_context=None, update_replica=replica)):
        yield


@contextmanager
def variable_sync_on_read_context() -> Iterator[None]:
    """Replica-context reads of sync-on-read variables are aggregated (a collective every
    replica must reach) instead of local."""
    with settings.SYNC_ON_READ_AGGREGATES.override(True):
        yield


def require_cross_replica(strategy: StrategyLike, what: str) -> Any:
    """Enter ``strategy``'s scope for a method that needs a cross-replica (or default) context;
    raises inside ``run`` or while another strategy is current."""
    mode = current_mode()
    if mode.strategy is strategy:
        if mode.replica_context is not None and not strategy._is_default:
            raise DistributeContextError(f"{what}: {CROSS_REPLICA_ONLY}")
        return strategy.scope()
    if mode.strategy._is_default and not mode.explicit_default:
        return strategy.scope()
    raise DistributeContextError(
        f"{what}: mixing different tf.distribute.Strategy objects: {strategy!r} is not the current "
        f"{mode.strategy!r}; call it inside `with {type(strategy).__name__}.scope()`"
    )


def experimental_set_strategy(strategy: StrategyLike | None) -> None:
    """Make ``strategy`` current in this process without a ``with`` (None: back to default)."""
    if settings.DISTRIBUTION_MODE.get() is not settings.DISTRIBUTION_MODE._default:
        raise DistributeContextError(
            "experimental_set_strategy must not be called inside a `with strategy.scope()` block"
        )
    settings.DISTRIBUTION_MODE.set_default(None if strategy is None else Mode(strategy, None))
