"""The one road for bytes: every move of the layers above (a redistribution plan, or one
collective they run themselves: fully_shard's packed gather, a DDP bucket, a strategy's reduce,
a data-dependent op's reduction) goes through here.

The road names the move (``comm.moving``, for errors and the collective safety checks), checks
the ``comm_budget``s ahead of it (a plan by its steps, a collective by the cost model's bytes:
raising there moves nothing), says whether an op may move its inputs itself (explicit mode),
and every collective on it is counted by ``comm.accounting`` (``CommCounter``,
``CommDebugMode``) and charged to the budgets. ``what`` is the text naming a move, or a
function making it (only called when needed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from .. import comm, settings
from ..comm import accounting, background, budget
from ..comm.native import Pending
from ..comm.safety import redistribution
from ..comm.transport import local_groups
from ..mesh import DeviceMesh
from ..torch_compat import current_graph_task_id
from .cross_mesh import CrossMeshPlan, run_cross_mesh
from .plan import RedistributePlan
from .traced import execute_plan, issues_async

What = str | Callable[[], str]


# ----- plans ---------------------------------------------------------------------------------


def run_plan(
    what: What, op: What, spec: Any, plan: RedistributePlan, components: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """The components of a DTensor of ``spec`` moved by ``plan``, for the operation ``op``
    (the budgets are checked against the plan first), as new tensors (``_own``)."""
    with (
        comm.moving(what, spec=lambda: redistribution(spec, tuple(plan.target))),
        budget.around(op, [("the DTensor", spec, plan)]),
    ):
        return _own(plan, components, execute_plan(plan, spec.mesh, components))


def _own(
    plan: RedistributePlan, before: Sequence[torch.Tensor], after: list[torch.Tensor]
) -> list[torch.Tensor]:
    """A redistribution that moves anything gives tensors of their own, as PyTorch's (whose
    local chunks are cloned, dense): a piece cut locally (Replicate -> Shard, or the value a
    Partial target keeps) would otherwise be a view of the source, and an in-place op on the
    result would write into the source's components. A collective's output is already new."""
    if not any(step.collective == "local" for step in plan.steps):
        return after
    sources = {_storage(c) for c in before} - {None}
    return [
        c.clone(memory_format=torch.contiguous_format) if _storage(c) in sources else c
        for c in after
    ]


def _storage(t: Any) -> int | None:
    """Where ``t``'s memory starts; None for what has none to read yet (an issued
    collective's pending output)."""
    try:
        return t.untyped_storage().data_ptr()
    except (AttributeError, RuntimeError):
        return None


def submit_plan(
    what: str, op: What, spec: Any, plan: RedistributePlan, components: Sequence[torch.Tensor]
) -> background.Work:
    """``run_plan`` started now (``async_op``): issued by this thread when the plan runs on
    the backend's collectives alone (results waited at first use), else on the background
    worker. The budgets are checked now; the job charges them in this context's copy."""

    def job() -> list[torch.Tensor]:
        with comm.moving(what, spec=lambda: redistribution(spec, tuple(plan.target))):
            return _own(plan, components, execute_plan(plan, spec.mesh, components))

    with budget.around(op, [("the DTensor", spec, plan)]):
        start = background.issue if issues_async(plan, spec.mesh) else background.submit
        return start(job, what)


def submit(what: str, job: Callable[[], list[torch.Tensor]]) -> background.Work:
    """``job`` (which moves bytes only through this module) on the background worker."""
    return background.submit(job, what)


def planned(op: What, moves: Sequence[tuple[str, Any, RedistributePlan]]) -> Any:
    """Around running one operation's plans ((what, spec, plan) triples, e.g. an op's input
    moves): the budgets are checked against all of them first."""
    return budget.planned(op, moves)


def implicit_allowed() -> bool:
    """Whether an op may move its inputs itself (explicit mode refuses otherwise): inside
    ``allow_implicit_redistribute()``, a ``comm_budget`` (which ``planned`` checks), or
    autograd's backward."""
    return bool(settings.COMM_BUDGETS.get()) or settings.IMPLICIT_REDISTRIBUTE.get() or (
        current_graph_task_id() != -1
    )


def cross_mesh(
    what: What, plan: CrossMeshPlan, components: Sequence[torch.Tensor], held: torch.dtype
) -> list[torch.Tensor]:
    """The components moved to another mesh by ``plan`` (``reshard``); each collective is
    charged as it runs."""
    with comm.moving(what):
        return run_cross_mesh(plan, components, held)


# ----- one collective ------------------------------------------------------------------------


@contextmanager
def _road(what: What, kind: str, mesh: DeviceMesh, mesh_dim: int,
          nbytes: Callable[[], int]) -> Iterator[None]:
    with comm.moving(what), budget.collective(what, kind, mesh, mesh_dim, nbytes):
        yield


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _received(mesh: DeviceMesh, mesh_dim: int, each: Callable[[int, int, int], int]) -> int:
    """Sum of ``each(local index, member position, group size)`` over this process's devices."""
    return sum(
        each(i, k, len(members))
        for members, indices in local_groups(mesh, mesh_dim)
        for k, i in enumerate(indices)
        if i is not None
    )


def all_reduce(
    what: What, mesh: DeviceMesh, mesh_dim: int, components: Sequence[torch.Tensor],
    op: str = "sum",
) -> list[torch.Tensor]:
    """``comm.all_reduce`` on the road."""
    def nbytes() -> int:
        return _received(mesh, mesh_dim, lambda i, k, n: accounting.all_reduce_received(
            components[i].numel(), components[i].element_size(), n, k))

    with _road(what, "all_reduce", mesh, mesh_dim, nbytes):
        return comm.all_reduce(mesh, mesh_dim, components, op)


def all_reduce_flat(
    what: What, mesh: DeviceMesh, mesh_dims: Sequence[int],
    values: Sequence[Sequence[torch.Tensor]], op: str = "sum",
) -> list[list[torch.Tensor]]:
    """``comm.all_reduce_flat`` (one bucket: the tensors flattened per device, one all_reduce
    per mesh dim, cut back) on the road: every dim's collective is checked ahead."""

    def nbytes(d: int) -> Callable[[], int]:
        def count() -> int:
            return _received(mesh, d, lambda i, k, n: accounting.all_reduce_received(
                sum(v[i].numel() for v in values), values[0][i].element_size(), n, k))
        return count

    with comm.moving(what), ExitStack() as ahead:
        for d in mesh_dims:
            ahead.enter_context(budget.collective(what, "all_reduce", mesh, d, nbytes(d)))
        return comm.all_reduce_flat(mesh, mesh_dims, values, op)


def _gathered(
    mesh: DeviceMesh, mesh_dim: int, components: Sequence[torch.Tensor], shapes: Any
) -> int:
    """Bytes this process's devices receive gathering ``components`` (``shapes``: device id
    -> its piece's shape where pieces differ)."""
    total = 0
    for members, indices in local_groups(mesh, mesh_dim):
        first = components[next(i for i in indices if i is not None)]
        sizes = [
            first.element_size() * (torch.Size(shapes(m)).numel() if shapes else first.numel())
            for m in members
        ]
        total += sum(
            accounting.all_gather_received(sizes, k) for k, i in enumerate(indices)
            if i is not None
        )
    return total


def all_gather(
    what: What, mesh: DeviceMesh, mesh_dim: int, components: Sequence[torch.Tensor],
    shapes: Any = None,
) -> list[list[torch.Tensor]]:
    """``comm.all_gather`` on the road."""
    with _road(what, "all_gather", mesh, mesh_dim,
               lambda: _gathered(mesh, mesh_dim, components, shapes)):
        return comm.all_gather(mesh, mesh_dim, components, shapes)


def all_gather_tensor(
    what: What, mesh: DeviceMesh, mesh_dim: int, components: Sequence[torch.Tensor],
    gather_dim: int, shapes: Any = None, async_op: bool = False,
) -> Any:
    """``comm.all_gather_tensor`` on the road (checked ahead also when ``async_op``: the
    ``Pending`` result is named the same when it finishes)."""
    with _road(what, "all_gather", mesh, mesh_dim,
               lambda: _gathered(mesh, mesh_dim, components, shapes)):
        out = comm.all_gather_tensor(mesh, mesh_dim, components, gather_dim, shapes,
                                     async_op=async_op)
    if not async_op:
        return out

    def finish() -> list[torch.Tensor]:
        with comm.moving(what):
            return out.finish()

    return Pending(finish)


def reduce_scatter(
    what: What, mesh: DeviceMesh, mesh_dim: int, pieces: Sequence[Sequence[torch.Tensor]],
    op: str = "sum", async_op: bool = False,
) -> list[torch.Tensor] | Pending[list[torch.Tensor]]:
    """``comm.reduce_scatter`` on the road (``async_op``: its ``Pending`` result, charged when
    issued)."""
    def nbytes() -> int:
        sizes = [_nbytes(p) for p in pieces[0]]
        return _received(mesh, mesh_dim,
                         lambda i, k, n: accounting.reduce_scatter_received(sizes, k))

    with _road(what, "reduce_scatter", mesh, mesh_dim, nbytes):
        return comm.reduce_scatter(mesh, mesh_dim, pieces, op, async_op)


def broadcast(
    what: What, mesh: DeviceMesh, mesh_dim: int, components: Sequence[torch.Tensor],
    src: int = 0,
) -> list[torch.Tensor]:
    """``comm.broadcast`` on the road."""
    def nbytes() -> int:
        return _received(mesh, mesh_dim, lambda i, k, n: accounting.broadcast_received(
            _nbytes(components[i]), k, src))

    with _road(what, "broadcast", mesh, mesh_dim, nbytes):
        return comm.broadcast(mesh, mesh_dim, components, src)


def broadcast_replicated(spec: Any, components: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Every Replicate mesh dim's components made equal to coordinate 0's
    (``from_local(run_check=True)``)."""
    out = list(components)
    for m, p in enumerate(spec.placements):
        if p.is_replicate():
            out = broadcast(lambda: f"from_local(run_check=True) of {spec}", spec.mesh, m, out)
    return out


def scatter_from(
    what: What, mesh: DeviceMesh, src: int, piece: Callable[[int], torch.Tensor],
    local_shapes: Sequence[Sequence[int]], sample: torch.Tensor,
) -> list[torch.Tensor]:
    """``comm.scatter_from`` on the road (its bytes cross processes only: charged as they
    arrive)."""
    with comm.moving(what):
        return comm.scatter_from(mesh, src, piece, local_shapes, sample)


def agree(
    what: What, mesh: DeviceMesh, label: str, fields: dict[str, Any], sample: torch.Tensor
) -> None:
    """``comm.agree`` on the road: the processes of ``mesh`` check they call the same."""
    with comm.moving(what):
        comm.agree(mesh, label, fields, sample)
