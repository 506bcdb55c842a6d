"""Allocation tracking: the peak bytes a block of code holds, from the allocator's own events.

``with track_allocations() as stats:`` records every CPU allocation and free that torch's
allocator reports to the profiler while the block runs (local pieces of DTensors, temporaries
inside ops and collectives included) and gives the peak of live bytes allocated inside the block
and the largest single allocation. Tensors allocated before the block do not count. The
``USDT: ... profiler_start``/``profiler_stop`` trace lines kineto writes to the process's stderr
(file descriptor 2) when the profiler starts and stops are held back; anything else written
there meanwhile comes through.
"""

from __future__ import annotations

import os
import sys
import tempfile
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
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _without_kineto_trace_lines():
        prof.start()
    try:
        yield stats
    finally:
        with _without_kineto_trace_lines():
            prof.stop()
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


@contextmanager
def _without_kineto_trace_lines() -> Iterator[None]:
    """Catch what is written to file descriptor 2 inside the block (kineto writes there from
    C++, past ``sys.stderr``) and write it back without kineto's ``USDT:`` lines."""
    sys.stderr.flush()
    with tempfile.TemporaryFile() as held:
        saved = os.dup(2)
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = b"".join(line for line in held if not line.startswith(b"USDT:"))
            if kept:
                os.write(2, kept)
