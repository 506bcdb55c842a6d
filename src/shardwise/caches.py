"""Every cache of shardwise under one policy. Each maps a key to a value computed from the key
alone (op facts, plans, shard geometry, process groups), so none is ambient state; each is
bounded by one of the named bounds below (past it the least recently used entry, or for the
hand-rolled ones the oldest, goes, and is computed again when next used); and each is listed
here, so ``clear_all`` empties them all (tests, benchmarks of cold starts).

``cached(bound)`` is ``functools.lru_cache``; a hand-rolled cache (the dispatch decisions, the
plans by spec, the traced plans, the validated placements) registers its ``clear``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

# The bounds, in entries, by what a cache is keyed on.
PER_OP = 8192  # an op overload (dispatch's facts about an op)
PER_LAYOUT = 4096  # a (mesh, shape, placements) or (spec, target) key: plans, splits, decisions
PER_PIECE = 8192  # a device's pieces of one layout (geometry.pieces)
PER_SPEC = 8192  # a (spec, target placements) key of plan_redistribute
PER_SEGMENT = 16384  # a device's segments of one layout (geometry.shard_segments, shapes)
PER_GROUP = 1024  # a (mesh, mesh dim) or planner move set: groups, routes, cross-mesh plans
PER_SEARCH = 256  # the planner's group positions and the union meshes of two meshes

_CLEARS: dict[str, Callable[[], None]] = {}  # every cache: name -> its clear


def cached(bound: int) -> Callable[[F], F]:
    """``functools.lru_cache(maxsize=bound)``, listed under the function's qualified name."""

    def wrap(fn: F) -> F:
        out = functools.lru_cache(maxsize=bound)(fn)
        _CLEARS[f"{fn.__module__}.{fn.__qualname__}"] = out.cache_clear
        return out  # type: ignore[return-value]

    return wrap


def register(name: str, clear: Callable[[], None]) -> None:
    """List a hand-rolled cache (bounded by a named bound where it lives) by its ``clear``."""
    _CLEARS[name] = clear


def all_caches() -> list[str]:
    """The names of the caches of the modules loaded so far."""
    return sorted(_CLEARS)


def clear_all() -> None:
    """Empty every cache (each fills again as it is used)."""
    for clear in _CLEARS.values():
        clear()
