"""Communication budgets: ``with shardwise.debug.comm_budget(bytes=..., per_op=...):`` lets
the block communicate at most so much (explicit mode, which allows no implicit move, is a
budget of 0).

A budget counts what ``CommCounter`` counts: the bytes this process's devices receive under the
planner's cost model (the numbers of ``explain_redistribute`` and ``CommDebugMode``), in total,
per operation, per mesh dim, and the payload received from other processes. Every collective
is charged to every budget active in its context (nested budgets: each one is charged, the
innermost limits further). Where the plan is known ahead (an op moving its inputs, an explicit
``redistribute`` or ``full_tensor``), the budgets are checked before any data moves; other
collectives, and cross-process payloads (which depend on the transport), are checked as they
report.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, Literal

from . import settings
from .errors import CommBudgetExceededError, CommBudgetWarning, InvalidArgumentError

Key = str | int  # a mesh dim by name or by index


def _limit(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(
            f"comm_budget({name}={value!r}): a limit is a number of bytes (an int >= 0) or None"
        )
    return value


class CommBudget:
    """The limits of one ``comm_budget`` block and what was charged to it so far.

    ``used``, ``used_per_dim`` (by the keys of ``per_dim``), ``used_cross_process`` and
    ``largest_op`` (the most one operation moved) are bytes this process's devices received;
    ``remaining()`` is what ``bytes`` still allows (None without a total limit)."""

    def __init__(
        self,
        bytes: int | None = None,
        per_op: int | None = None,
        per_dim: Mapping[Key, int] | None = None,
        cross_process_bytes: int | None = None,
        on_exceed: Literal["raise", "warn"] = "raise",
    ) -> None:
        if on_exceed not in ("raise", "warn"):
            raise InvalidArgumentError(
                f"comm_budget(on_exceed={on_exceed!r}): use 'raise' or 'warn'"
            )
        self.bytes = _limit("bytes", bytes)
        self.per_op = _limit("per_op", per_op)
        self.per_dim: dict[Key, int] = {}
        for key, value in (per_dim or {}).items():
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise InvalidArgumentError(
                    f"comm_budget(per_dim=...): key {key!r} is neither a mesh dim name nor index"
                )
            self.per_dim[key] = _limit(f"per_dim[{key!r}]", value)
        self.cross_process_bytes = _limit("cross_process_bytes", cross_process_bytes)
        self.on_exceed = on_exceed
        self.used = 0
        self.used_per_dim: dict[Key, int] = dict.fromkeys(self.per_dim, 0)
        self.used_cross_process = 0
        self.largest_op = 0
        self._lock = threading.Lock()

    def remaining(self) -> int | None:
        """Bytes the total limit still allows (0 once over it), None without one."""
        return None if self.bytes is None else max(0, self.bytes - self.used)

    def __repr__(self) -> str:
        parts = [f"bytes={self.bytes}"] if self.bytes is not None else []
        if self.per_op is not None:
            parts.append(f"per_op={self.per_op}")
        if self.per_dim:
            parts.append(f"per_dim={self.per_dim}")
        if self.cross_process_bytes is not None:
            parts.append(f"cross_process_bytes={self.cross_process_bytes}")
        parts.append(f"on_exceed={self.on_exceed!r}")
        return f"comm_budget({', '.join(parts)})"

    def usage(self) -> str:
        """What was charged so far, one line."""
        text = f"{self.used} bytes used"
        if self.bytes is not None:
            text += f" of {self.bytes} ({self.remaining()} remaining)"
        if self.per_dim:
            text += ", per mesh dim " + ", ".join(
                f"{k!r}: {self.used_per_dim[k]} of {v}" for k, v in self.per_dim.items()
            )
        if self.cross_process_bytes is not None:
            text += f", cross-process {self.used_cross_process} of {self.cross_process_bytes}"
        return text

    def table_rows(self) -> list[tuple[str, int | None, int]]:
        """(scope, limit, used) per limit set, for ``CommDebugMode``'s table."""
        rows: list[tuple[str, int | None, int]] = [("total", self.bytes, self.used)]
        if self.per_op is not None:
            rows.append(("per op (largest)", self.per_op, self.largest_op))
        rows += [(f"mesh dim {k!r}", v, self.used_per_dim[k]) for k, v in self.per_dim.items()]
        if self.cross_process_bytes is not None:
            rows.append(("cross-process", self.cross_process_bytes, self.used_cross_process))
        return rows

    # ----- checking and charging ---------------------------------------------------------

    def excess(
        self, op_bytes: int, dims: Mapping[Key, int], cross: int = 0, *, op_total: int | None = None
    ) -> list[str]:
        """What charging ``op_bytes`` (``dims`` of them per budget key, ``cross`` from other
        processes) would put over a limit, one line each; ``op_total`` is the operation's whole
        use when that is more than ``op_bytes``."""
        over = []
        if self.bytes is not None and self.used + op_bytes > self.bytes:
            over.append(f"total: {self.used} used + {op_bytes} = {self.used + op_bytes} bytes "
                        f"> limit {self.bytes}")
        op_total = op_bytes if op_total is None else op_total
        if self.per_op is not None and op_total > self.per_op:
            over.append(f"per op: {op_total} bytes > limit {self.per_op}")
        for key, moved in dims.items():
            limit = self.per_dim.get(key)
            if limit is not None and self.used_per_dim[key] + moved > limit:
                over.append(f"mesh dim {key!r}: {self.used_per_dim[key]} used + {moved} = "
                            f"{self.used_per_dim[key] + moved} bytes > limit {limit}")
        if self.cross_process_bytes is not None and cross and (
            self.used_cross_process + cross > self.cross_process_bytes
        ):
            over.append(f"cross-process: {self.used_cross_process} used + {cross} = "
                        f"{self.used_cross_process + cross} bytes > limit "
                        f"{self.cross_process_bytes}")
        return over

    def charge(self, nbytes: int, dims: Mapping[Key, int], cross: int, op_total: int) -> None:
        with self._lock:
            self.used += nbytes
            for key, moved in dims.items():
                if key in self.used_per_dim:
                    self.used_per_dim[key] += moved
            self.used_cross_process += cross
            self.largest_op = max(self.largest_op, op_total)

    # ----- the block ---------------------------------------------------------------------

    def __enter__(self) -> CommBudget:
        if any(b is self for b in settings.COMM_BUDGETS.get()):
            raise InvalidArgumentError(
                f"{self!r} is already active in this context: a budget block is entered once "
                f"(nest a new comm_budget to limit further)"
            )
        settings.COMM_BUDGETS.push(self)
        return self

    def __exit__(self, *exc: object) -> None:
        settings.COMM_BUDGETS.pop()


def comm_budget(
    bytes: int | None = None,
    per_op: int | None = None,
    *,
    per_dim: Mapping[Key, int] | None = None,
    cross_process_bytes: int | None = None,
    on_exceed: Literal["raise", "warn"] = "raise",
) -> CommBudget:
    """A block (``with``) in which this thread communicates at most ``bytes`` in total and
    ``per_op`` per operation, ``per_dim[name or index]`` on a mesh dim and
    ``cross_process_bytes`` from other processes (None: no limit). Ops may redistribute their
    inputs inside it when the budget allows. Past a limit: ``"raise"``
    ``CommBudgetExceededError`` (before the data moves where the plan is known ahead),
    ``"warn"`` a ``CommBudgetWarning`` and go on."""
    return CommBudget(bytes, per_op, per_dim, cross_process_bytes, on_exceed)


def _dim_keys(mesh: Any, mesh_dim: int | tuple[int, ...]) -> list[Key]:
    """The budget keys of a collective on ``mesh_dim`` (an exchange spans several dims, each
    charged; a collective over the whole mesh, -1, none)."""
    dims = mesh_dim if isinstance(mesh_dim, tuple) else (mesh_dim,)
    names = getattr(mesh, "mesh_dim_names", None) if mesh is not None else None
    keys: list[Key] = []
    for m in dims:
        if m < 0:
            continue
        keys.append(m)
        if names:
            keys.append(names[m])
    return keys


def _exceeded(budget: CommBudget, message: str) -> None:
    if budget.on_exceed == "raise":
        raise CommBudgetExceededError(message)
    warnings.warn(message, CommBudgetWarning, stacklevel=4)


class _Operation:
    """The operation whose collectives are being charged: its name, whether its plans were
    checked ahead, and what it has moved so far."""

    __slots__ = ("checked", "moved", "name")

    def __init__(self, name: str | Callable[[], str], checked: bool) -> None:
        self.name, self.checked, self.moved = name, checked, 0

    def label(self) -> str:
        return self.name() if callable(self.name) else self.name


# ----- the hooks: ahead of planned moves, and on every collective ------------------------------


def _step_text(step: Any) -> str:
    return f"{step.collective} on mesh dim {step.mesh_dim}: {step.source} -> {step.target}, " \
           f"{step.bytes} bytes"


def _plan_text(what: str, spec: Any, plan: Any) -> str:
    from .geometry import lower_bound_bytes

    try:
        bound = str(lower_bound_bytes(spec.mesh, tuple(spec.shape), spec.tensor_meta.dtype.itemsize,
                                      plan.source, plan.target))
    except Exception:
        bound = "unknown"
    steps = "".join(f"\n      {_step_text(s)}" for s in plan.steps)
    return (f"  {what}: shape {list(spec.shape)} {spec.tensor_meta.dtype} on {spec.mesh}, "
            f"{list(plan.source)} -> {list(plan.target)}; plan:{steps}\n"
            f"    {plan.bytes} bytes on this process's devices ({plan.global_bytes} on all "
            f"devices, lower bound {bound})")


@contextmanager
def planned(
    op: str | Callable[[], str], moves: Sequence[tuple[str, Any, Any]]
) -> Iterator[None]:
    """Around running the redistribution plans of one operation ``op``, ``moves`` as (what,
    spec, plan) triples: every active budget is checked against the plans' bytes before the
    block runs (raising there moves nothing); the collectives inside are charged to ``op``."""
    budgets = settings.COMM_BUDGETS.get()
    total = 0
    dims: dict[Key, int] = {}
    for _, spec, plan in moves:
        for step in plan.steps:
            if step.collective == "local" or not step.bytes:
                continue
            total += step.bytes
            for key in _dim_keys(spec.mesh, step.mesh_dim):
                dims[key] = dims.get(key, 0) + step.bytes
    for budget in budgets:
        over = budget.excess(total, dims)
        if over:
            name = op() if callable(op) else op
            plans = "\n".join(_plan_text(*move) for move in moves)
            verb = "nothing was moved" if budget.on_exceed == "raise" else "moving anyway"
            _exceeded(budget, (
                f"{name} would exceed {budget!r}:\n"
                + "".join(f"  {line}\n" for line in over)
                + f"{plans}\n  used so far: {budget.usage()}; {verb}"
            ))
    with settings.BUDGET_OPERATION.override(_Operation(op, True)):
        yield


def around(op: str | Callable[[], str], moves: Sequence[tuple[str, Any, Any]]) -> Any:
    """``planned(op, moves)`` when a budget is active, else a no-op (the common case)."""
    return planned(op, moves) if settings.COMM_BUDGETS.get() else nullcontext()


def charge(
    budgets: Sequence[CommBudget],
    kind: str,
    mesh: Any,
    mesh_dim: int | tuple[int, ...],
    nbytes: int,
    cross_process_bytes: int,
    describe: Callable[[], str],
) -> None:
    """Charge one collective to ``budgets``; past a limit the plan did not foresee (a
    collective outside a planned operation, or its cross-process payload), raise or warn
    now, after it ran (``describe()`` says what it was moving, for the message)."""
    operation = settings.BUDGET_OPERATION.get()
    dims = dict.fromkeys(_dim_keys(mesh, mesh_dim), nbytes)
    op_total = nbytes if operation is None else operation.moved + nbytes
    for budget in budgets:
        if operation is not None and operation.checked:
            over = budget.excess(0, {}, cross_process_bytes)  # the bytes were checked ahead
        else:
            over = budget.excess(nbytes, dims, cross_process_bytes, op_total=op_total)
        budget.charge(nbytes, dims, cross_process_bytes, op_total)
        if over:
            what = operation.label() if operation is not None else ""
            name = what or describe() or kind
            _exceeded(budget, (
                f"{kind} on mesh dim {mesh_dim} of {mesh} for {name} ({nbytes} bytes here, "
                f"{cross_process_bytes} from other processes) exceeded {budget!r}:\n"
                + "".join(f"  {line}\n" for line in over)
                + f"  used now: {budget.usage()}; this collective has already run"
            ))
    if operation is not None:
        operation.moved = op_total
