"""TF DTensor's ``Mesh``: a ``DeviceMesh`` built with TF's arguments, with TF's meanings of
``size`` and ``device_type``, and ``create_mesh``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .errors import MeshError
from .mesh import DeviceMesh, mesh_ids
from .mesh_text import tf_device_type


class Mesh(DeviceMesh):
    """TF DTensor's ``Mesh(dim_names, global_device_ids, local_device_ids, local_devices)``: a
    ``DeviceMesh`` built with TF's arguments (usable wherever a DeviceMesh is).

    Which devices this process owns follows from its rank (DESIGN.md); ``local_device_ids``,
    when given, must agree. The device type is read from ``local_devices`` (``"CPU:0"``,
    ``"/job:localhost/replica:0/task:0/device:GPU:0"``, torch devices) or ``device_type``.
    Its ``global_device_ids`` run row-major from 0, as TF requires (``any_order``: any order,
    for ``create_mesh(devices=...)``).
    """

    def __init__(
        self,
        dim_names: Sequence[str],
        global_device_ids: Any,
        local_device_ids: Sequence[int] | None = None,
        local_devices: Sequence[Any] | None = None,
        mesh_name: str = "",
        global_devices: Sequence[Any] | None = None,
        *,
        device_type: str | None = None,
        any_order: bool = False,
    ) -> None:
        if local_device_ids is not None and local_devices is not None and (
            len(local_device_ids) != len(local_devices)
        ):
            raise MeshError(
                f"Mesh: local_device_ids {list(local_device_ids)} and local_devices "
                f"{list(local_devices)} differ in length (TF 2.21 raises ValueError)"
            )
        ids = torch.as_tensor(global_device_ids)
        if not any_order and not torch.equal(ids.reshape(-1), torch.arange(ids.numel())):
            raise MeshError(
                f"Mesh: global_device_ids must increase row-major from 0 (TF 2.21 raises "
                f"ValueError), got {ids.tolist()}; DeviceMesh(device_type, ids) takes any order"
            )
        devices = list(local_devices or []) + list(global_devices or [])
        if device_type is None:
            device_type = _device_type_of(devices[0]) if devices else "cpu"
        super().__init__(
            tf_device_type(device_type), global_device_ids, mesh_dim_names=list(dim_names)
        )
        if local_device_ids is not None and list(local_device_ids) != list(self.local_device_ids):
            raise MeshError(
                f"local_device_ids {list(local_device_ids)} disagree with {self}: process "
                f"{self._rank} owns devices {list(self.local_device_ids)}"
            )
        self.mesh_name = mesh_name
        self.device_type = _TFDeviceType(self.device_type)

    # ----- TF's meanings of names PyTorch's DeviceMesh also has -----------------------------
    @property
    def size(self) -> _MeshSize:  # type: ignore[override]
        """TF: the number of devices of the mesh, an int; calling it keeps PyTorch's
        ``size(mesh_dim=None)``."""
        return _MeshSize(self)

    # ----- TF-only queries ----------------------------------------------------------------
    @property
    def strides(self) -> list[int]:
        """TF: the row-major stride of each mesh dim (the last is 1)."""
        return [math.prod(self.mesh.shape[i + 1:]) for i in range(self.ndim)]

    def coords(self, device_idx: int) -> torch.Tensor:
        """TF: the mesh coordinates of device index ``device_idx``, ``(idx // strides) % shape``,
        as an int32 tensor."""
        strides = torch.tensor(self.strides, dtype=torch.int32)
        shape = torch.tensor(list(self.mesh.shape), dtype=torch.int32)
        return torch.div(torch.as_tensor(device_idx, dtype=torch.int32), strides,
                         rounding_mode="floor") % shape

    def min_global_device_id(self) -> int:
        """TF: the smallest device id of the whole mesh."""
        return min(self._ids)

    def local_device_locations(self) -> list[dict[str, int]]:
        """TF: ``{dim_name: index}`` of each device this process owns, in ascending id."""
        where = self.unravel_index()
        return [where[i] for i in self.local_device_ids]

    def host_mesh(self) -> Mesh:
        """TF: the same mesh on host CPUs (a CPU mesh is its own host mesh)."""
        if self.device_type == "cpu":
            return self
        return Mesh(self._names_or_default(), self.mesh, mesh_name=self.mesh_name,
                    device_type="cpu")

    # ----- pickling: the device type as a plain string -------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["device_type"] = str(self.device_type)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.device_type = _TFDeviceType(self.device_type)


class _TFDeviceType(str):
    """A ``Mesh``'s device type: PyTorch's string (``"cpu"``, ``"cuda"``) that, called, gives
    TF's name (``mesh.device_type()`` is ``"CPU"``, ``"GPU"``)."""

    def __call__(self) -> str:
        return {"cuda": "GPU", "cpu": "CPU"}.get(str(self), str(self).upper())


class _MeshSize(int):
    """A ``Mesh``'s ``size``: TF's int (the number of devices) that, called, is PyTorch's
    ``size(mesh_dim=None)``."""

    _mesh: DeviceMesh

    def __new__(cls, mesh: DeviceMesh) -> _MeshSize:
        value = super().__new__(cls, len(mesh.device_ids))
        value._mesh = mesh
        return value

    def __call__(self, mesh_dim: int | str | None = None) -> int:
        return DeviceMesh.size(self._mesh, mesh_dim)


def _device_type_of(device: Any) -> str:
    """``"cpu"``/``"cuda"`` of a TF device string (``"CPU:0"``, ``"/device:GPU:1"``) or a
    torch device."""
    if isinstance(device, torch.device):
        return device.type
    parts = str(device).split(":")
    if len(parts) < 2:
        raise MeshError(f"cannot tell the device type of {device!r}; write e.g. 'CPU:0'")
    return parts[-2].rsplit("/", 1)[-1]



def create_mesh(
    mesh_dims: Sequence[tuple[str, int]],
    *,
    device_type: str = "cpu",
    devices: Sequence[int] | None = None,
) -> Mesh:
    """TF DTensor's ``create_mesh([("x", 2), ("y", 3)])``: a named mesh with row-major ids, or
    with ``devices`` (each id 0..N-1 once) laid out in row-major order."""
    device_type = tf_device_type(device_type)
    dims = list(mesh_dims)
    if not dims or any(not (isinstance(n, str) and isinstance(s, int) and s > 0) for n, s in dims):
        raise MeshError(f"mesh_dims must be (name, positive size) pairs, got {mesh_dims!r}")
    names = [n for n, _ in dims]
    shape = [s for _, s in dims]
    if devices is not None and len(devices) != math.prod(shape):
        raise MeshError(
            f"create_mesh got {len(devices)} devices for a mesh of shape {shape} "
            f"({math.prod(shape)} devices)"
        )
    if devices is None:  # the Mesh joins the launcher's world as init_device_mesh does
        ids = torch.arange(math.prod(shape)).reshape(shape)
    else:
        ids = mesh_ids(list(devices)).reshape(shape)
    return Mesh(names, ids, device_type=device_type, any_order=True)
