"""Communication accounting: bytes each device receives per collective, and ``CommCounter``.

The byte formulas are the cost model of DESIGN.md (ring / bandwidth-optimal algorithms), written
per device so uneven shards are exact: the planner prices plans with the same functions that the
collectives use to count what they did, so a plan's cost equals the counted bytes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import settings
from . import budget
from .safety import current_description


def all_gather_received(piece_bytes: Sequence[int], index: int) -> int:
    """Device ``index`` receives every other device's piece."""
    return sum(piece_bytes) - piece_bytes[index]


def reduce_scatter_received(piece_bytes: Sequence[int], index: int) -> int:
    """Ring reduce-scatter: device ``index`` receives a partial of every piece but its own."""
    return sum(piece_bytes) - piece_bytes[index]


def all_reduce_received(numel: int, element_size: int, n: int, index: int) -> int:
    """Ring all-reduce = reduce-scatter + all-gather of the flattened tensor's chunks."""
    chunk = -(-numel // n) if numel else 0
    own = max(0, min(chunk, numel - index * chunk))
    return 2 * (numel - own) * element_size


def all_to_all_received(incoming_bytes: Sequence[int], index: int) -> int:
    """Device ``index`` receives the piece every other device addresses to it."""
    return sum(incoming_bytes) - incoming_bytes[index]


def broadcast_received(nbytes: int, index: int, root: int) -> int:
    return 0 if index == root else nbytes


@dataclass
class CommRecord:
    """One collective over one mesh dim, with the bytes this process's devices received."""

    kind: str
    mesh_dim: int | tuple[int, ...]  # an exchange spans several mesh dims
    bytes: int
    label: str = ""
    cross_process_bytes: int = 0
    meta_bytes: int = 0


@dataclass
class CommCounter:
    """Counts the collectives run inside ``with CommCounter() as c:`` (in this thread).

    Per collective kind (``Counter``s, empty when nothing ran): ``c.counts[kind]`` collectives,
    ``c.bytes[kind]`` bytes this process's devices received under the ring model (what plans
    price), ``c.cross_process_bytes[kind]`` the payload this process really received from
    other processes, and ``c.meta_bytes[kind]`` the small headers and debug-check messages that
    went with it. ``c.total_bytes``, ``c.total_cross_process_bytes`` and ``c.total_meta_bytes``
    are their sums (ints; the cross-process ones are 0 in one process); ``c.records`` keeps
    each collective.
    """

    counts: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)
    records: list[CommRecord] = field(default_factory=list)
    cross_process_bytes: Counter = field(default_factory=Counter)
    meta_bytes: Counter = field(default_factory=Counter)
    _scopes: list = field(default_factory=list, repr=False, compare=False)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    @property
    def total_cross_process_bytes(self) -> int:
        return sum(self.cross_process_bytes.values())

    @property
    def total_meta_bytes(self) -> int:
        return sum(self.meta_bytes.values())

    def __enter__(self) -> CommCounter:
        scope = settings.COMM_COUNTERS.override((*settings.COMM_COUNTERS.get(), self))
        scope.__enter__()
        self._scopes.append(scope)
        return self

    def __exit__(self, *exc: object) -> None:
        self._scopes.pop().__exit__(*exc)

    def add(self, record: CommRecord) -> None:
        self.counts[record.kind] += 1
        self.bytes[record.kind] += record.bytes
        if record.cross_process_bytes:
            self.cross_process_bytes[record.kind] += record.cross_process_bytes
        if record.meta_bytes:
            self.meta_bytes[record.kind] += record.meta_bytes
        self.records.append(record)


def record(
    kind: str,
    mesh_dim: int | tuple[int, ...],
    nbytes: int,
    label: str = "",
    *,
    cross_process_bytes: int = 0,
    meta_bytes: int = 0,
    mesh: Any = None,
) -> None:
    """Report one collective to every active ``CommCounter`` and charge it to every active
    ``comm_budget`` (``mesh``, the collective's, names its dims for per-dim limits)."""
    counters = settings.COMM_COUNTERS.get()
    if counters:
        entry = CommRecord(kind, mesh_dim, nbytes, label, cross_process_bytes, meta_bytes)
        for counter in counters:
            counter.add(entry)
    budgets = settings.COMM_BUDGETS.get()
    if budgets:
        budget.charge(
            budgets, kind, mesh, mesh_dim, nbytes, cross_process_bytes, current_description
        )
