"""Collectives over one mesh dim, and their accounting."""

from .accounting import CommCounter, CommRecord
from .collectives import all_gather, all_reduce, all_to_all, broadcast, reduce_scatter

__all__ = [
    "CommCounter",
    "CommRecord",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "reduce_scatter",
]
