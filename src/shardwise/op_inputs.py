"""An op's inputs brought where its sharding needs them: plain tensors among DTensors taken as
replicated by PyTorch's rule (0-d or one-element constants, ``implicit_replication()``,
autograd's backward) or refused, composite ops whose decomposition makes plain tensors named
as exceptions (``register_plain_making_decomposition``), composite ops that read a tensor
argument's values (``register_value_reading_decomposition``), and DTensor inputs moved to the
chosen placements under the explicit-redistribution rule (a move that needs a collective raises
``ImplicitRedistributeError`` unless ``allow_implicit_redistribute()`` is on or autograd's
backward runs). ``dispatch`` uses it for every op, handlers that bypass dispatch
(``ops/common``) through the same functions.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from . import execution, settings
from .call_site import call_site
from .dtensor import DTensor, local_of
from .errors import ImplicitRedistributeError, MeshError
from .factories import place_tensor
from .mesh import DeviceMesh
from .placements import Placement, Replicate, norm_order
from .redistribute import execute_plan, move, plan_redistribute
from .torch_compat import (
    DispatchKey,
    current_graph_task_id,
    dispatch_has_kernel_for_dispatch_key,
    len_torch_dispatch_stack,
    torch_allows_implicit_replication,
)

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


@contextlib.contextmanager
def implicit_replication(enabled: bool = True) -> Iterator[None]:
    """Within the block, plain tensors mixed with DTensors are taken as replicated global
    values (PyTorch's ``implicit_replication``), e.g. a mask the user built whole on every rank."""
    with settings.IMPLICIT_REPLICATION.override(bool(enabled)):
        yield


def _refused(func: Any, tensor: torch.Tensor, mesh: DeviceMesh) -> bool:
    """True if the plain ``tensor`` cannot be taken as replicated beside ``func``'s DTensors:
    it has more than one element (one rule for every size and view, see ``execution``),
    outside autograd's backward and outside ``implicit_replication()`` (shardwise's, or the flag
    torch's kernels set for the tensors they make, e.g. vmap's embedding batch rule)."""
    return (
        tensor.numel() > 1
        and current_graph_task_id() == -1
        and not settings.IMPLICIT_REPLICATION.get()
        and not torch_allows_implicit_replication()
    )


def _refusal(func: Any, tensor: torch.Tensor, mesh: DeviceMesh) -> MeshError:
    execution.plain_view(mesh)  # raises where this program acts for no device of the mesh
    return MeshError(
        f"{func} mixes DTensors with a plain torch.Tensor of shape {list(tensor.shape)} "
        f"({execution.of(mesh).describe()}); only a 0-d or one-element tensor is taken as "
        f"replicated by itself. "
        f"Distribute it first (shardwise.distribute_tensor(t, {mesh}, placements)), or, if "
        f"every rank holds the same whole value, take it as replicated inside "
        f"`with shardwise.config.implicit_replication():`"
    )


def implicitly_replicated(func: Any, tensor: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """A plain tensor among DTensor arguments is taken as replicated when it is a 0-d or
    one-element constant, when autograd's backward made it, or inside
    ``implicit_replication()`` (which ``register_plain_making_decomposition`` turns on for
    the decompositions it names); otherwise it is refused with a ``MeshError``. The rule is
    the same for every size and in both views: a program that works at toy size works at
    real size."""
    if _refused(func, tensor, mesh):
        raise _refusal(func, tensor, mesh)
    return place_tensor(tensor, mesh, [Replicate()] * mesh.ndim, src_data_rank=None)


# ----- composite ops whose decomposition makes plain tensors -----------------------------------

#: the CompositeImplicitAutograd ops whose decomposition creates plain tensors of its own (what
#: it makes), registered with ``register_plain_making_decomposition``
PLAIN_MAKING_DECOMPOSITIONS: dict[Any, str] = {}
_LIBRARY = torch.library.Library("aten", "IMPL")  # holds the kernels registered below
_AUTOGRAD_KEYS = ("AutogradCPU", "AutogradCUDA")


def register_plain_making_decomposition(op: Any, makes: str) -> None:
    """Name ``op`` (an ``aten`` CompositeImplicitAutograd overload, e.g. SDPA's math variant)
    as one whose decomposition creates plain tensors (``makes`` says which): called with
    DTensors, its own plain tensor arguments are checked by the usual rule (the user's are
    refused), then its decomposition runs inside ``implicit_replication()``, so the tensors
    torch makes there are taken as replicated. The kernel sits at the op's autograd keys,
    above ``__torch_dispatch__``; without DTensor arguments it runs torch's decomposition."""
    composite = DispatchKey.CompositeImplicitAutograd
    if not dispatch_has_kernel_for_dispatch_key(op.name(), composite):
        raise TypeError(f"{op} is not CompositeImplicitAutograd: it has no decomposition")

    def kernel(*args: Any, **kwargs: Any) -> Any:
        values = (*args, *kwargs.values())
        first = next((a for a in values if isinstance(a, DTensor)), None)
        if first is None:
            return op._op_dk(composite, *args, **kwargs)
        mesh = first.device_mesh
        for a in values:
            if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and a.ndim and (
                _refused(op, a, mesh)
            ):
                raise _refusal(op, a, mesh)
        with settings.IMPLICIT_REPLICATION.override(True):
            return op._op_dk(composite, *args, **kwargs)

    for key in _AUTOGRAD_KEYS:
        _LIBRARY.impl(op, kernel, key)
    PLAIN_MAKING_DECOMPOSITIONS[op] = makes


def register_value_reading_decomposition(op: Any, argument: str) -> None:
    """Name ``op`` (an ``aten`` CompositeImplicitAutograd overload) as one whose decomposition
    reads the values of its tensor ``argument`` on the host (``tensor_split``'s indices), where
    a DTensor holds no data: given a DTensor there, the decomposition gets that argument as a
    plain tensor, its global value (replicated first under the explicit-redistribution rule).
    The kernel sits at the op's autograd keys, above ``__torch_dispatch__``."""
    composite = DispatchKey.CompositeImplicitAutograd
    if not dispatch_has_kernel_for_dispatch_key(op.name(), composite):
        raise TypeError(f"{op} is not CompositeImplicitAutograd: it has no decomposition")
    names = [a.name for a in op._schema.arguments]
    position = names.index(argument)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        args = list(args)
        value = args[position] if position < len(args) else kwargs.get(argument)
        if isinstance(value, DTensor):
            target = [Replicate()] * value.device_mesh.ndim
            plain = redistribute_inputs(op, [value], [target])[0][0]
            if position < len(args):
                args[position] = plain
            else:
                kwargs[argument] = plain
        return op._op_dk(composite, *args, **kwargs)

    for key in _AUTOGRAD_KEYS:
        _LIBRARY.impl(op, kernel, key)


# ----- moves -----------------------------------------------------------------------------------


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
        spec = local_of(dt).spec
        if spec.placements != tuple(target):
            plan = plan_redistribute(spec, tuple(target))
            moves.append((n, plan, functools.partial(execute_plan, plan, spec.mesh)))
    moves = tuple(moves)
    return run_moves(func, dtensors, moves, communicating(moves)) if moves else [
        local_of(dt).pieces for dt in dtensors
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
    explicit = tuple((i, p) for i, p in moving if not _scalar_norm(dtensors[i]))
    if explicit and not move.implicit_allowed():
        lines = []
        for i, p in explicit:
            dt = dtensors[i]
            lines.append(
                f"  input {i}: shape {list(dt.shape)}, placements {list(dt.placements)} -> "
                f"{list(p.target)} (needs {[s.collective for s in p.steps]}); call "
                f"x.redistribute(placements={list(p.target)}) on it first"
            )
        raise ImplicitRedistributeError(
            f"{func} on {dtensors[0].device_mesh} needs its inputs redistributed:\n"
            + "\n".join(lines)
            + "\nor allow it with `with shardwise.config.allow_implicit_redistribute():`"
        )
    log_moves = bool(moving) and settings.LOG_REDISTRIBUTE.get()
    if budgeted:  # a comm_budget allows the moves it has room for, checked before any runs
        with move.planned(
            str(func), [(f"input {i}", local_of(dtensors[i]).spec, p) for i, p in moving]
        ):
            return _run_each(func, dtensors, moves, log_moves)
    return _run_each(func, dtensors, moves, log_moves)


def _scalar_norm(dt: DTensor) -> bool:
    """The one move explicit mode makes itself: a scalar pending p-norm (``Partial("norm<p>")``
    on some mesh dims, from a norm of sharded values) reduced where an op uses it, one scalar
    all_reduce per such mesh dim, as ``clip_grad_norm_`` over sharded gradients needs (PyTorch's
    cost). Nothing else is moved without being asked."""
    return dt.ndim == 0 and all(
        p.is_replicate() or (p.is_partial() and norm_order(p.reduce_op) is not None)
        for p in dt.placements
    )


def _run_each(
    func: Any, dtensors: list[DTensor], moves: tuple, log_moves: bool
) -> list[list[torch.Tensor]]:
    """``run_moves``' moves, once allowed: each input's components after its plan."""
    components = [local_of(dt).pieces for dt in dtensors]
    for i, plan, run in moves:
        dt = dtensors[i]
        if log_moves and any(s.collective != "local" for s in plan.steps):
            log.info(
                "%s redistributes %s: %s at %s", func, list(dt.shape), plan.steps, call_site()
            )
        components[i] = _cut(dt, plan, run) if getattr(run, "cuts", False) else run(
            local_of(dt).pieces
        )
    return components


# per DTensor (by id, dropped with it): (a weak reference to it, the plan, its components,
# their versions, the cut views)
_CUTS: dict[int, tuple] = {}


def _cut(dt: DTensor, plan: Any, run: Any) -> list[torch.Tensor]:
    """``run(pieces of dt)`` for a ``plan`` that only cuts (``compile_plan``'s ``cuts``),
    the views kept for the next move by that plan while the DTensor holds the same components
    unchanged (a replicated weight that ops cut to the shards' shape at every step is cut
    once): views of its own components hold no memory of their own."""
    comps = local_of(dt).pieces
    versions = [c._version for c in comps]  # set_ and resize_ change a component in place
    held = _CUTS.get(id(dt))
    if held is not None and held[0]() is dt and held[2] is comps and (
        held[1] is plan or held[1] == plan
    ) and held[3] == versions:
        return list(held[4])
    out = run(comps)
    if not len_torch_dispatch_stack():  # not fake or traced components
        key = id(dt)
        ref = held[0] if held is not None and held[0]() is dt else weakref.ref(
            dt, lambda r, key=key: _drop_cut(key, r)
        )
        _CUTS[key] = (ref, plan, comps, versions, out)
    return list(out)


def _drop_cut(key: int, ref: weakref.ref) -> None:
    held = _CUTS.get(key)
    if held is not None and held[0] is ref:
        del _CUTS[key]
