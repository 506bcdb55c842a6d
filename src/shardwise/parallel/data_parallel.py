"""What ``replicate`` and ``fully_shard`` share: which mesh dim is the data-parallel one, the
placements of a parameter on it, and the hook that shards a plain input batch over it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..dtensor import DTensor, distribute_tensor
from ..errors import DataParallelError
from ..mesh import DeviceMesh
from ..placements import Placement, Replicate, Shard


def dp_mesh_dim(
    module: nn.Module, device_mesh: DeviceMesh, mesh_dim: int | str | None, what: str
) -> tuple[DeviceMesh, int]:
    """(the mesh the parameters live on, the data-parallel dim of it).

    ``device_mesh`` is either that mesh (its dim ``mesh_dim``, default 0, is data parallel) or
    its named 1-D sub-mesh (``mesh["dp"]``) when the parameters already are DTensors on the
    full mesh (tensor parallelism applied first).
    """
    meshes = {p.device_mesh for p in module.parameters() if isinstance(p, DTensor)}
    if len(meshes) > 1:
        raise DataParallelError(
            f"{what} of {type(module).__name__}: its parameters live on several meshes "
            f"{sorted(map(str, meshes))}; put them on one"
        )
    parent = next(iter(meshes)) if meshes else device_mesh
    if parent == device_mesh:
        return parent, parent.dim_index(mesh_dim if mesh_dim is not None else 0)
    names = device_mesh.mesh_dim_names or ()
    parent_names = parent.mesh_dim_names or ()
    if device_mesh.ndim == 1 and names and names[0] in parent_names and mesh_dim is None:
        return parent, parent.dim_index(names[0])
    raise DataParallelError(
        f"{what} of {type(module).__name__} on {device_mesh}: its parameters are DTensors on "
        f"{parent}; pass that mesh (with mesh_dim=) or its 1-D sub-mesh by name"
    )


def dp_placements(
    param: torch.Tensor, mesh: DeviceMesh, dp: int, name: str, what: str
) -> list[Placement]:
    """The parameter's placements before data parallelism (Replicate on the dp dim)."""
    if not isinstance(param, DTensor):
        return [Replicate()] * mesh.ndim
    placements = list(param.placements)
    if not placements[dp].is_replicate():
        raise DataParallelError(
            f"{what}: parameter {name!r} of shape {list(param.shape)} has placements "
            f"{placements} on {mesh}, but mesh dim {dp} (data parallel) must be Replicate "
            f"before data parallelism shards or replicates it"
        )
    return placements


def owned_parameters(module: nn.Module) -> Iterator[tuple[nn.Module, str, torch.Tensor]]:
    """(owning module, attribute name, parameter) for each distinct parameter, in order."""
    seen: set[int] = set()
    for owner in module.modules():
        for name, param in list(owner._parameters.items()):
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                yield owner, name, param


def place_parameter(root: nn.Module, param: torch.Tensor, value: torch.Tensor) -> nn.Parameter:
    """Make ``value`` the parameter in place of ``param`` in every module of ``root`` that
    holds it (tied weights stay tied)."""
    new = nn.Parameter(value, requires_grad=param.requires_grad)
    for module in root.modules():
        for key, p in module._parameters.items():
            if p is param:
                module._parameters[key] = new
    return new


def shard_inputs(module: nn.Module, mesh: DeviceMesh, dp: int) -> None:
    """Plain tensors passed to ``module`` are the global batch: shard them over the dp dim
    (Shard(0)), replicated over the other dims. DTensor inputs pass unchanged."""
    placements = [Replicate()] * mesh.ndim
    placements[dp] = Shard(0)

    def place(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.ndim > 0:
            return distribute_tensor(x, mesh, placements)
        return x

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tree_map(place, args), tree_map(place, kwargs)

    module.register_forward_pre_hook(hook, with_kwargs=True)
