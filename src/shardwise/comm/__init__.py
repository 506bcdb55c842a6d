"""Collectives over one mesh dim, and their accounting."""

from .accounting import CommCounter, CommRecord
from .collectives import (
    agree,
    all_gather,
    all_gather_tensor,
    all_reduce,
    all_reduce_flat,
    all_to_all,
    all_to_all_tensor,
    broadcast,
    exchange,
    reduce_scatter,
    scatter_from,
)
from .reduction import reduce_terms
from .safety import (
    debug_checks_enabled,
    deterministic,
    get_collective_timeout,
    moving,
    set_collective_timeout,
    set_debug_checks,
    set_deterministic,
)

__all__ = [
    "CommCounter",
    "CommRecord",
    "agree",
    "all_gather",
    "all_gather_tensor",
    "all_reduce",
    "all_reduce_flat",
    "all_to_all",
    "all_to_all_tensor",
    "broadcast",
    "exchange",
    "debug_checks_enabled",
    "deterministic",
    "get_collective_timeout",
    "moving",
    "reduce_scatter",
    "reduce_terms",
    "scatter_from",
    "set_collective_timeout",
    "set_debug_checks",
    "set_deterministic",
]
