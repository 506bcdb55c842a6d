"""Collectives over one mesh dim on a list of local components (one per local device).

Every function takes ``components`` (or ``pieces``) ordered like ``mesh.local_device_ids`` and
returns results in the same order. A group whose devices are all in this process runs in-process;
every collective reports the bytes its devices receive to the active ``CommCounter``s.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch

from ..errors import ShardwiseError
from ..mesh import DeviceMesh
from . import accounting


@lru_cache(maxsize=4096)
def local_groups(mesh: DeviceMesh, mesh_dim: int) -> tuple[tuple[tuple[int, ...], tuple], ...]:
    """Groups along ``mesh_dim`` that hold a local device: (member ids, local index or None)."""
    local_index = {d: i for i, d in enumerate(mesh.local_device_ids)}
    groups: dict[tuple[int, ...], tuple] = {}
    for device in mesh.local_device_ids:
        group = mesh.group_of(device, mesh_dim)
        groups.setdefault(group, tuple(local_index.get(m) for m in group))
    return tuple(groups.items())


def _in_process(mesh: DeviceMesh, mesh_dim: int, kind: str):
    """Yield (member devices, local indices) of each group, refusing groups across processes."""
    for members, indices in local_groups(mesh, mesh_dim):
        if any(i is None for i in indices):
            raise ShardwiseError(
                f"{kind} over mesh dim {mesh_dim} of {mesh} spans processes; this process owns "
                f"devices {list(mesh.local_device_ids)} of group {list(members)}"
            )
        yield members, indices


def _reduce(tensors: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """Reduce in coordinate order, so every mode sums in the same order."""
    acc = tensors[0].clone()
    for t in tensors[1:]:
        t = t.to(acc.device)
        if op in ("sum", "avg"):
            acc.add_(t)
        elif op == "max":
            torch.maximum(acc, t, out=acc)
        elif op == "min":
            torch.minimum(acc, t, out=acc)
        else:
            raise ShardwiseError(f"unknown reduce op {op!r}; use sum, avg, max or min")
    if op == "avg":
        n = len(tensors)
        if acc.is_floating_point() or acc.is_complex():
            acc.div_(n)
        else:
            acc = torch.div(acc, n, rounding_mode="trunc")
    return acc


def _to(t: torch.Tensor, mesh: DeviceMesh, device_id: int) -> torch.Tensor:
    return t.to(mesh.device_of(device_id))


def all_reduce(
    mesh: DeviceMesh, mesh_dim: int, components: Sequence[torch.Tensor], op: str = "sum"
) -> list[torch.Tensor]:
    """Every device gets the reduction (sum, avg, max, min) of its group's components."""
    out: list[torch.Tensor] = list(components)
    received = 0
    for members, indices in _in_process(mesh, mesh_dim, "all_reduce"):
        result = _reduce([components[i] for i in indices], op)
        n = len(members)
        for k, i in enumerate(indices):
            out[i] = _to(result if k == 0 else result.clone(), mesh, members[k])
            received += accounting.all_reduce_received(
                result.numel(), result.element_size(), n, k
            )
    accounting.record("all_reduce", mesh_dim, received)
    return out


def all_gather(
    mesh: DeviceMesh, mesh_dim: int, components: Sequence[torch.Tensor]
) -> list[list[torch.Tensor]]:
    """Every device gets the list of its group's components, in coordinate order."""
    out: list[list[torch.Tensor]] = [[] for _ in components]
    received = 0
    for members, indices in _in_process(mesh, mesh_dim, "all_gather"):
        pieces = [components[i] for i in indices]
        sizes = [p.numel() * p.element_size() for p in pieces]
        for k, i in enumerate(indices):
            out[i] = [_to(p, mesh, members[k]) for p in pieces]
            received += accounting.all_gather_received(sizes, k)
    accounting.record("all_gather", mesh_dim, received)
    return out


def reduce_scatter(
    mesh: DeviceMesh, mesh_dim: int, pieces: Sequence[Sequence[torch.Tensor]], op: str = "sum"
) -> list[torch.Tensor]:
    """``pieces[i][k]`` is local device i's contribution to group member k; member k gets the
    reduction of what every member addressed to it."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(pieces)
    received = 0
    for members, indices in _in_process(mesh, mesh_dim, "reduce_scatter"):
        sizes = [p.numel() * p.element_size() for p in pieces[indices[0]]]
        for k, i in enumerate(indices):
            out[i] = _to(_reduce([pieces[j][k] for j in indices], op), mesh, members[k])
            received += accounting.reduce_scatter_received(sizes, k)
    accounting.record("reduce_scatter", mesh_dim, received)
    return out


def all_to_all(
    mesh: DeviceMesh, mesh_dim: int, pieces: Sequence[Sequence[torch.Tensor]]
) -> list[list[torch.Tensor]]:
    """``pieces[i][k]`` goes from local device i to group member k; the result ``out[i][j]`` is
    what member j sent to device i."""
    out: list[list[torch.Tensor]] = [[] for _ in pieces]
    received = 0
    for members, indices in _in_process(mesh, mesh_dim, "all_to_all"):
        for k, i in enumerate(indices):
            incoming = [pieces[j][k] for j in indices]
            out[i] = [_to(p, mesh, members[k]) for p in incoming]
            received += accounting.all_to_all_received(
                [p.numel() * p.element_size() for p in incoming], k
            )
    accounting.record("all_to_all", mesh_dim, received)
    return out


def broadcast(
    mesh: DeviceMesh, mesh_dim: int, components: Sequence[torch.Tensor], src: int = 0
) -> list[torch.Tensor]:
    """Every device gets a copy of the component of the group member at coordinate ``src``."""
    out: list[torch.Tensor] = list(components)
    received = 0
    for members, indices in _in_process(mesh, mesh_dim, "broadcast"):
        source = components[indices[src]]
        for k, i in enumerate(indices):
            out[i] = source if k == src else _to(source.clone(), mesh, members[k])
            received += accounting.broadcast_received(
                source.numel() * source.element_size(), k, src
            )
    accounting.record("broadcast", mesh_dim, received)
    return out
