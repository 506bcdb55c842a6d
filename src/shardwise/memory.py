"""Allocation tracking: the peak bytes a block of code holds, from the allocator's own events.

``with track_allocations() as stats:`` records every CPU allocation and free that torch's
allocator reports to the profiler while the block runs (local pieces of DTensors, temporaries
inside ops and collectives included) and gives the peak of live bytes allocated inside the block
and the largest single allocation. Tensors allocated before the block do not count.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch.profiler import ProfilerActivity, profile


@dataclass
class AllocationStats:
    """Bytes allocated inside a ``track_allocations`` block."""

    peak_bytes: int = 0
    largest_bytes: int = 0
    allocated_bytes: int = 0
    count: int = 0


@contextmanager
def track_allocations() -> Iterator[AllocationStats]:
    """Measure the allocations of the block (see the module docstring); the stats are filled
    when the block exits."""
    stats = AllocationStats()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield stats
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        size = event.nbytes()
        live += size
        if size > 0:
            stats.count += 1
            stats.allocated_bytes += size
            stats.largest_bytes = max(stats.largest_bytes, size)
        stats.peak_bytes = max(stats.peak_bytes, live)
