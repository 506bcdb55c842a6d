"""TF's text form of a mesh, ``name|x=2,y=3|global ids|local ids|local devices`` (and TF's short
form ``name|x=2,y=2|*CPU``), written and read as plain values, and TF's device type names."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from .errors import MeshError

_TF_DEVICE_TYPES = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda", "meta": "meta"}


def tf_device_type(device_type: str) -> str:
    """The torch device type of a TF device type name (``"CPU"``, ``"GPU"``; any case)."""
    kind = _TF_DEVICE_TYPES.get(str(device_type).lower())
    if kind is None:
        raise MeshError(
            f"device type {device_type!r} is not supported; use 'CPU' or 'GPU' ('cpu', 'cuda')"
        )
    return kind


class MeshText(NamedTuple):
    """What a mesh's text says: its TF name, dim names (None: unnamed), shape, device ids in
    row-major order and torch device type."""

    name: str
    dim_names: list[str] | None
    shape: list[int]
    ids: list[int]
    device_type: str


def write(
    name: str,
    dim_names: Sequence[str] | None,
    shape: Sequence[int],
    ids: Sequence[int],
    local_devices: Sequence[tuple[int, int]],
    device_type: str,
) -> str:
    """The text of a mesh; ``local_devices`` holds (owning process, id) of each device this
    process owns (an unnamed mesh writes its sizes without names)."""
    sizes = [str(s) for s in shape]
    if dim_names is not None:
        sizes = [f"{n}={s}" for n, s in zip(dim_names, sizes, strict=True)]
    dims = ",".join(sizes)
    kind = {"cuda": "GPU", "cpu": "CPU"}.get(device_type, device_type.upper())
    devices = ",".join(
        f"/job:localhost/replica:0/task:{owner}/device:{kind}:{i}" for owner, i in local_devices
    )
    local = ",".join(str(i) for _, i in local_devices)
    return f"{name}|{dims}|{','.join(map(str, ids))}|{local}|{devices}"


def read(mesh_str: str) -> MeshText:
    """The mesh ``write`` wrote, or TF's short form (devices 0..N-1); ``MeshError`` naming the
    text when it is neither."""
    parts = mesh_str.split("|") if isinstance(mesh_str, str) else []
    try:
        if len(parts) not in (3, 5, 6, 7):
            raise ValueError(
                "expected name|dims|global ids|local ids|local devices, or TF's short "
                "form name|dims|*CPU"
            )
        entries = parts[1].split(",")
        named = ["=" in e for e in entries]
        if any(named) and not all(named):
            raise ValueError("either every dim is named or none is")
        names = [e.split("=")[0] for e in entries] if all(named) else None
        shape = [int(e.split("=")[-1]) for e in entries]
        if len(parts) == 3:  # TF's short form: devices 0..N-1 of one type
            if not parts[2].startswith("*"):
                raise ValueError(f"expected a * in the device part, found {parts[2]!r}")
            ids = list(range(math.prod(shape)))
            device_type = tf_device_type(parts[2][1:])
        else:
            ids = [int(i) for i in parts[2].split(",")]
            first_device = parts[4].split(",")[0]
            device_type = tf_device_type(first_device.split(":")[-2]) if first_device else "cpu"
    except (ValueError, IndexError, MeshError) as err:
        raise MeshError(f"cannot read a mesh from {mesh_str!r}: {err}") from None
    if math.prod(shape) != len(ids):
        raise MeshError(
            f"cannot read a mesh from {mesh_str!r}: shape {shape} needs {math.prod(shape)} "
            f"device ids, got {len(ids)}"
        )
    return MeshText(parts[0], names, shape, ids, device_type)
