"""An op's inputs brought where its sharding needs them: plain tensors among DTensors taken as
replicated (or refused), and DTensor inputs moved to the chosen placements under the
explicit-redistribution rule (a move that needs a collective raises
``ImplicitRedistributeError`` unless ``allow_implicit_redistribute()`` is on or autograd's
backward runs). ``dispatch`` uses it for every op, handlers that bypass dispatch
(``ops/common``) through the same functions.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import sys
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from . import budget, settings
from .dtensor import DTensor, distribute_tensor
from .errors import ImplicitRedistributeError, MeshError
from .mesh import DeviceMesh
from .placements import Placement, Replicate
from .plain_tensors import plain_is_local
from .redistribute import execute_plan, plan_redistribute

log = logging.getLogger("shardwise.redistribute")

# ----- settings (per context: see ``settings``) ------------------------------------------------


def set_implicit_redistribute(enabled: bool) -> None:
    """Process-wide: allow (True) or forbid (False, the default) implicit redistribution."""
    settings.IMPLICIT_REDISTRIBUTE.set_default(bool(enabled))


@contextlib.contextmanager
def allow_implicit_redistribute(enabled: bool = True) -> Iterator[None]:
    """Within the block (this thread only), ops may redistribute their inputs themselves."""
    with settings.IMPLICIT_REDISTRIBUTE.override(bool(enabled)):
        yield


def set_redistribute_logging(enabled: bool) -> None:
    """Log every redistribution an op makes, with the user's call site, to
    the ``shardwise.redistribute`` logger (level INFO)."""
    settings.LOG_REDISTRIBUTE.set_default(bool(enabled))


# ----- plain tensors among DTensors ------------------------------------------------------------


SMALL_CONSTANT_NUMEL = 16


@contextlib.contextmanager
def implicit_replication(enabled: bool = True) -> Iterator[None]:
    """Within the block, plain tensors mixed with DTensors are taken as replicated global
    values (PyTorch's ``implicit_replication``), e.g. masks that decompositions create."""
    with settings.IMPLICIT_REPLICATION.override(bool(enabled)):
        yield


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIR = os.path.dirname(__file__) + os.sep


def _holds(values: Any, tensor: torch.Tensor) -> bool:
    """True if ``tensor`` is one of ``values`` or inside one of their lists, tuples, dicts."""
    for v in values:
        if v is tensor:
            return True
        if isinstance(v, (list, tuple)) and any(x is tensor for x in v):
            return True
        if isinstance(v, dict) and any(x is tensor for x in v.values()):
            return True
        if isinstance(v, torch.nn.Module) and any(
            x is tensor for x in (*v._parameters.values(), *v._buffers.values())
        ):
            return True
    return False


def made_by_torch(tensor: torch.Tensor) -> bool:
    """True if a plain tensor reaching dispatch was made by torch's own decomposition of the
    op the user called (SDPA's causal mask, ``masked.var``'s count, fractional max pooling's
    samples), not passed by the user: it is neither a variable of the user's calling frame
    nor an argument the user gave the torch function running the decomposition, nor a
    parameter or buffer of a module in reach, nor a tensor that requires grad."""
    if tensor.requires_grad or isinstance(tensor, torch.nn.Parameter):
        return False
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_OWN_DIR):
        frame = frame.f_back
    entry = None  # the outermost torch frame: the torch function the user called
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH_DIR):
        entry, frame = frame, frame.f_back
    if entry is not None:
        code = entry.f_code
        n_args = code.co_argcount + code.co_kwonlyargcount
        n_args += bool(code.co_flags & inspect.CO_VARARGS) + bool(
            code.co_flags & inspect.CO_VARKEYWORDS
        )
        names = code.co_varnames[:n_args]
        return not _holds([entry.f_locals.get(n) for n in names], tensor)
    # the user's code called an op (or a C++ composite) directly: its variables are its own
    return frame is not None and not (
        _holds(frame.f_locals.values(), tensor) or _holds(frame.f_globals.values(), tensor)
    )


def implicitly_replicated(func: Any, tensor: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """A plain tensor among DTensor arguments is taken as replicated when it is a small
    constant (TF DTensor's rule; per rank, one element), when autograd's backward or one of
    torch's decompositions made it (``made_by_torch``), or inside ``implicit_replication()``;
    otherwise (the user's own tensor) it is refused."""
    # per rank (plain_tensors.py) a plain tensor is this rank's data, which may differ from
    # its peers': only a one-element constant is taken as replicated there
    small = 1 if plain_is_local(mesh) else SMALL_CONSTANT_NUMEL
    if (
        tensor.numel() > small
        and torch._C._current_graph_task_id() == -1
        and not settings.IMPLICIT_REPLICATION.get()
        and not made_by_torch(tensor)
    ):
        raise MeshError(
            f"{func} mixes DTensors with a plain torch.Tensor of shape {list(tensor.shape)}; "
            f"distribute it first (shardwise.distribute_tensor(t, {mesh}, placements)) or "
            f"take it as replicated inside `with shardwise.implicit_replication():`"
        )
    return distribute_tensor(tensor, mesh, [Replicate()] * mesh.ndim, src_data_rank=None)


# ----- moves -----------------------------------------------------------------------------------


def _call_site() -> str:
    for frame in reversed(traceback.extract_stack()[:-3]):
        name = frame.filename
        if "shardwise" not in name and "torch" not in name:
            return f"{name}:{frame.lineno}"
    return "<unknown>"


def redistribute_inputs(
    func: Any, dtensors: Sequence[DTensor], targets: Sequence[Sequence[Placement]]
) -> list[list[torch.Tensor]]:
    """The components of ``dtensors`` moved to ``targets`` (one placement tuple each), as an op
    ``func`` moves its inputs: a move that needs communication raises
    ``ImplicitRedistributeError`` unless ``allow_implicit_redistribute()`` is on or autograd's
    backward runs. For handlers registered with ``bypass_dispatch``."""
    dtensors = list(dtensors)
    moves = []
    for n, (dt, target) in enumerate(zip(dtensors, targets, strict=True)):
        if dt._spec.placements != tuple(target):
            plan = plan_redistribute(dt._spec, tuple(target))
            moves.append((n, plan, functools.partial(execute_plan, plan, dt._spec.mesh)))
    moves = tuple(moves)
    return run_moves(func, dtensors, moves, communicating(moves)) if moves else [
        dt._components for dt in dtensors
    ]


def communicating(moves: tuple) -> tuple:
    """The (input index, plan) pairs of ``moves`` whose plan needs a collective."""
    return tuple(
        (n, plan) for n, plan, _ in moves if any(s.collective != "local" for s in plan.steps)
    )


def run_moves(
    func: Any, dtensors: list[DTensor], moves: tuple, moving: tuple
) -> list[list[torch.Tensor]]:
    """The components of ``dtensors`` after running the plans of ``moves`` ((input index,
    plan, function running it on the components) triples); ``moving``, the (index, plan)
    pairs that communicate, must be allowed."""
    budgeted = bool(moving) and bool(settings.COMM_BUDGETS.get())
    if moving and not budgeted and not settings.IMPLICIT_REDISTRIBUTE.get() and (
        torch._C._current_graph_task_id() == -1
    ):
        lines = []
        for i, p in moving:
            dt = dtensors[i]
            lines.append(
                f"  input {i}: shape {list(dt.shape)}, placements {list(dt.placements)} -> "
                f"{list(p.target)} (needs {[s.collective for s in p.steps]}); call "
                f"x.redistribute(placements={list(p.target)}) on it first"
            )
        raise ImplicitRedistributeError(
            f"{func} on {dtensors[0].device_mesh} needs its inputs redistributed:\n"
            + "\n".join(lines)
            + "\nor allow it with `with shardwise.allow_implicit_redistribute():`"
        )
    components = [dt._components for dt in dtensors]
    log_moves = bool(moving) and settings.LOG_REDISTRIBUTE.get()
    scope = budget.planned(
        str(func), [(f"input {i}", dtensors[i]._spec, p) for i, p in moving]
    ) if budgeted else contextlib.nullcontext()
    with scope:  # a comm_budget allows the moves it has room for, checked before any runs
        for i, plan, run in moves:
            dt = dtensors[i]
            if log_moves and any(s.collective != "local" for s in plan.steps):
                log.info(
                    "%s redistributes %s: %s at %s", func, list(dt.shape), plan.steps,
                    _call_site()
                )
            components[i] = run(dt._components)
    return components
