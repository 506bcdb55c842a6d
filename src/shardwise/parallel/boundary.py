"""Module boundaries as layout contracts: how a style turns a module's inputs and outputs into
DTensors with the placements it declares, on one tensor-parallel mesh dim of any mesh.

A boundary redistributes explicitly, so no op inside a module needs an implicit
redistribution; in the backward, gradients that are pending sums stay pending until a
redistribution needs them reduced (the all-gather before a block reduce-scatters them once).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..dtensor import DTensor, distribute_tensor
from ..errors import ParallelPlanError
from ..mesh import DeviceMesh
from ..placements import Placement, Replicate
from ..tracing import dynamo_opaque


def resolve_tp_dim(mesh: DeviceMesh, tp_mesh_dim: int | str | None) -> int:
    """The mesh dim tensor parallelism shards on: ``tp_mesh_dim`` if given, else the dim
    named ``"tp"``, else the last dim (PyTorch slices that dim as its 1-D TP mesh)."""
    if tp_mesh_dim is not None:
        return mesh.dim_index(tp_mesh_dim)
    if "tp" in mesh:
        return mesh.dim_index("tp")
    return mesh.ndim - 1


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
def as_dtensor(x: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    """A module input as a DTensor. A DTensor passes unchanged. A plain tensor is this
    process's shard when it owns one device of the mesh (PyTorch's ``from_local``), and the
    global value when it owns several (embedded mode: there is no single local shard)."""
    if isinstance(x, DTensor):
        return x
    if mesh.num_local_devices() == 1:
        return DTensor.from_local(x, mesh, placements)
    return distribute_tensor(x, mesh, placements)


def to_layout(x: DTensor, placements: Sequence[Placement]) -> DTensor:
    """``x`` in ``placements`` (itself when it is already there)."""
    return x.redistribute(placements=placements)


@dynamo_opaque
def on_tp(x: DTensor, tp_dim: int, placement: Placement) -> DTensor:
    """``x`` with the tp mesh dim moved to ``placement`` (other mesh dims unchanged)."""
    return to_layout(x, on_tp_dim(x.device_mesh, tp_dim, placement, base=x.placements))


@dynamo_opaque
def local_output(x: object, use_local_output: bool) -> object:
    """PyTorch's ``use_local_output``: the local tensor when the process owns one device of the
    mesh; with several there is no single local tensor, so the DTensor is kept."""
    if use_local_output and isinstance(x, DTensor) and x.device_mesh.num_local_devices() == 1:
        return x.to_local()
    return x
