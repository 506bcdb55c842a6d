"""The switches a program turns: explicit or implicit redistribution, implicit replication of
plain tensors, redistribution logging, the collective timeout, cross-process debug checks and
deterministic reductions. Each is a process default (``set_*``) with a ``with`` form where one
exists (the values live in ``settings``)."""

from __future__ import annotations

from .comm import (
    deterministic,
    get_collective_timeout,
    set_collective_timeout,
    set_debug_checks,
    set_deterministic,
)
from .op_inputs import (
    allow_implicit_redistribute,
    implicit_replication,
    set_implicit_redistribute,
    set_redistribute_logging,
)

__all__ = [
    "allow_implicit_redistribute",
    "deterministic",
    "get_collective_timeout",
    "implicit_replication",
    "set_collective_timeout",
    "set_debug_checks",
    "set_deterministic",
    "set_implicit_redistribute",
    "set_redistribute_logging",
]
