"""The mesh a call uses: the one it is given, checked to be a mesh, or the current one (the
innermost ``with mesh:`` block of this thread)."""

from __future__ import annotations

from typing import Any

from . import settings
from .errors import MeshError, ShardwiseTypeError
from .mesh import DeviceMesh


def current_mesh() -> DeviceMesh | None:
    """The mesh of the innermost ``with mesh:`` (or ``default_mesh``) block of this thread,
    None outside any."""
    meshes = settings.MESHES.get()
    return meshes[-1] if meshes else None


def require_mesh(device_mesh: Any, what: str, argument: str = "device_mesh") -> DeviceMesh:
    """``device_mesh`` itself when it is a ``DeviceMesh``; else a ``ShardwiseTypeError`` naming
    ``what`` took it, the argument and what was given."""
    if not isinstance(device_mesh, DeviceMesh):
        raise ShardwiseTypeError(
            f"{what}: {argument} must be a shardwise DeviceMesh (shardwise.init_device_mesh or "
            f"DeviceMesh(device_type, ids)), got {type(device_mesh).__name__} {device_mesh!r:.80}"
        )
    return device_mesh


def mesh_or_current(device_mesh: DeviceMesh | None, what: str) -> DeviceMesh:
    """``device_mesh``, or when it is None the current mesh (PyTorch's default for ``what``);
    ``MeshError`` when there is none, ``ShardwiseTypeError`` when it is not a mesh."""
    if device_mesh is not None:
        return require_mesh(device_mesh, what)
    mesh = current_mesh()
    if mesh is None:
        raise MeshError(
            f"{what} got no device_mesh and no mesh is current: pass device_mesh=, or call it "
            f"inside a 'with mesh:' block"
        )
    return mesh
