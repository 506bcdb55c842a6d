"""Module boundaries as layout contracts: how a style turns a module's inputs and outputs into
DTensors with the placements it declares, on one tensor-parallel mesh dim of any mesh.

A boundary redistributes explicitly, so no op inside a module needs an implicit
redistribution; in the backward, gradients that are pending sums stay pending until a
redistribution needs them reduced (the all-gather before a block reduce-scatters them once).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from .. import execution
from ..dtensor import DTensor
from ..errors import ParallelPlanError
from ..factories import distribute_tensor, place_tensor
from ..mesh import DeviceMesh
from ..placements import Placement, Replicate
from ..spec import validate_placements
from ..tracing import dynamo_opaque


def resolve_tp_dim(mesh: DeviceMesh, tp_mesh_dim: int | str | None) -> int:
    """The mesh dim tensor parallelism shards on: ``tp_mesh_dim`` if given, else the dim
    named ``"tp"``, else the last dim (PyTorch slices that dim as its 1-D TP mesh)."""
    if tp_mesh_dim is not None:
        return mesh.dim_index(tp_mesh_dim)
    if "tp" in mesh:
        return mesh.dim_index("tp")
    return mesh.ndim - 1


def tp_on_root(
    mesh: DeviceMesh, tp_mesh_dim: int | str | None, what: str
) -> tuple[DeviceMesh, int | str | None]:
    """The mesh and dim tensor parallelism shards on. In the embedded global view (this
    process acts for several devices of the root mesh) a sub-mesh such as ``mesh["tp"]``
    stands for its dim of the root: the placements are lifted onto the root mesh (Replicate
    over its other dims), so PyTorch's 2-D recipe (``parallelize_module(model, mesh["tp"],
    plan)``, then ``fully_shard(block, mesh=mesh["dp"])``) runs as it does per rank."""
    root = mesh.root_mesh
    if root is mesh or not root.local_device_ids or execution.per_rank(root, what):
        return mesh, tp_mesh_dim
    return root, mesh.root_dims[resolve_tp_dim(mesh, tp_mesh_dim)]


def on_tp_dim(
    mesh: DeviceMesh, tp_dim: int, placement: Placement | Sequence[Placement], base=None
) -> tuple[Placement, ...]:
    """Full placements: ``base`` (default all Replicate) with the tp dim set to ``placement``.
    A list as long as the mesh is taken as the full placements already."""
    if not isinstance(placement, Placement):
        given = tuple(placement)
        if len(given) == mesh.ndim:
            return given
        if len(given) != 1:
            raise ParallelPlanError(
                f"placements {list(given)} need one entry (the tensor-parallel dim) or one per "
                f"mesh dim of {mesh}"
            )
        placement = given[0]
    full = list(base) if base is not None else [Replicate()] * mesh.ndim
    full[tp_dim] = placement
    return tuple(full)


@dynamo_opaque
def as_dtensor(
    x: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    shape: Sequence[int] | None = None,
) -> DTensor:
    """A module input as a DTensor. A DTensor passes unchanged. A plain tensor is this
    process's shard when it owns one device of the mesh (PyTorch's ``from_local``, with the
    global ``shape`` when the caller knows it: an uneven shard alone cannot tell it), and the
    global value when it owns several (embedded mode: there is no single local shard).

    Modules that receive the same plain tensor (q, k and v projections of one normed input)
    get the same DTensor while it is alive, so their input gradients add up as pending sums
    and the backward reduces them once instead of once per module."""
    if isinstance(x, DTensor):
        return x
    key = _wrap_key(x, mesh, placements, shape)
    if key is not None:
        made = _WRAPPED.get(key)
        if made is not None and made.source() is x and made.version == x._version:
            dtensor = made.dtensor()
            if dtensor is not None:
                return dtensor
    if execution.per_rank(mesh, f"a plain module input of shape {list(x.shape)}"):
        dtensor = DTensor.from_local(x, mesh, placements, shape=shape)
    elif x.requires_grad and torch.is_grad_enabled():
        dtensor = _Distribute.apply(x, mesh, tuple(placements))
    else:
        dtensor = place_tensor(x, mesh, placements)
    if key is not None:
        _WRAPPED[key] = _Wrapped(x, dtensor, key)
    return dtensor


class _Distribute(torch.autograd.Function):
    """``distribute_tensor`` of a global value that passes its gradient back (the global
    gradient), where ``distribute_tensor`` itself makes a leaf."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: DeviceMesh, placements: tuple) -> DTensor:
        return distribute_tensor(x.detach(), mesh, placements)

    @staticmethod
    def backward(ctx, grad: DTensor) -> tuple:
        return grad.full_tensor(), None, None


class _Wrapped:
    """A plain tensor and the DTensor ``as_dtensor`` made of it, both held weakly: the entry
    lives as long as the DTensor (saved for backward, it lives until the backward used it)."""

    __slots__ = ("source", "dtensor", "version")

    def __init__(self, source: torch.Tensor, dtensor: DTensor, key: tuple) -> None:
        self.source = weakref.ref(source)
        self.version = source._version
        self.dtensor = weakref.ref(dtensor, lambda ref: _forget(key, ref))


_WRAPPED: dict[tuple, _Wrapped] = {}


def _forget(key: tuple, ref: weakref.ref) -> None:
    made = _WRAPPED.get(key)
    if made is not None and made.dtensor is ref:
        del _WRAPPED[key]


def _wrap_key(
    x: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    shape: Sequence[int] | None,
) -> tuple | None:
    """What makes two wrappings of ``x`` interchangeable; None where sharing is not safe:
    tensors being traced (fake or functional subclasses), inference tensors (no version counter
    tells an in-place change) and the per-replica view, whose threads merge their pieces in
    ``from_local``."""
    if type(x) is not torch.Tensor or x.is_inference() or execution.replica() is not None:
        return None
    if torch.compiler.is_compiling():
        return None
    return (
        id(x), mesh, tuple(placements), None if shape is None else tuple(shape), x.requires_grad,
        torch.is_grad_enabled(),
    )


def to_layout(x: DTensor, placements: Sequence[Placement]) -> DTensor:
    """``x`` in ``placements``: itself when it is already there, as PyTorch's styles skip that
    move (``redistribute`` to the same placements is an autograd step whose backward would
    reduce a Partial gradient there, where the step before reduce-scatters it cheaper)."""
    if validate_placements(x.shape, x.device_mesh, placements) == x.placements:
        return x
    return x.redistribute(placements=placements)


@dynamo_opaque
def on_tp(x: DTensor, mesh: DeviceMesh, tp_dim: int, placement: Placement) -> DTensor:
    """``x`` with the tp mesh dim of ``mesh`` moved to ``placement`` (other mesh dims
    unchanged). ``x`` may live on a larger mesh of the same root (the global view beside data
    parallelism, when tensor parallelism was applied per rank on the tp sub-mesh): the tp dim
    is then found there by what it is in the root."""
    here = x.device_mesh
    if here != mesh and here.root_mesh == mesh.root_mesh:
        root_dim = mesh.root_dims[tp_dim]
        if root_dim in here.root_dims:
            tp_dim = here.root_dims.index(root_dim)
    return to_layout(x, on_tp_dim(here, tp_dim, placement, base=x.placements))


@dynamo_opaque
def local_output(x: object, use_local_output: bool) -> object:
    """PyTorch's ``use_local_output``: a plain tensor wherever every device this program acts
    for holds the same value. Acting for one device of the mesh (the plain-tensor rule), that is
    its local tensor; acting for several, only a Replicate output qualifies, and its plain
    tensor is the global value (differentiable: the gradient comes back replicated). Any other
    output in the global view has no single local tensor, so the DTensor is kept."""
    if not use_local_output or not isinstance(x, DTensor):
        return x
    if execution.per_rank(x.device_mesh):
        return x.to_local()
    if all(p.is_replicate() for p in x.placements):
        return x.full_tensor()
    return x
