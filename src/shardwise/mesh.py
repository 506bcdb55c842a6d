"""The device mesh: an n-dimensional array of device ids, and which of them this process owns."""

from __future__ import annotations

import atexit
import math
import os
import time
from collections.abc import Iterable, Sequence
from datetime import timedelta
from functools import cached_property
from typing import Any

import torch

from . import settings
from .errors import CollectiveError, CollectiveTimeoutError, MeshError


class MeshDimNameError(MeshError, KeyError):
    """A mesh dimension name that the mesh does not have."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


class IdTuple(tuple):
    """A tuple that can also be called, so ``mesh.shape`` / ``mesh.local_device_ids`` read the
    same as PyTorch's attributes and TF's methods (``mesh.shape()``)."""

    def __call__(self) -> IdTuple:
        return self


def _process_info() -> tuple[int, int]:
    """(rank, world size) of this process; (0, 1) when torch.distributed is not initialized."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _mesh_ids(mesh: Any) -> torch.Tensor:
    """The device ids of ``mesh`` (nested lists or a tensor of ints) as an int64 tensor."""
    try:
        ids = torch.as_tensor(mesh)
    except (TypeError, ValueError, RuntimeError) as err:
        raise MeshError(
            f"a device mesh must be a (nested, rectangular) list or tensor of int device ids, "
            f"got {mesh!r} ({err})"
        ) from None
    if ids.numel() == 0:
        raise MeshError(f"a device mesh needs at least one device, got mesh {mesh!r}")
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise MeshError(f"device ids of a mesh must be ints, got {mesh!r} ({ids.dtype})")
    ids = ids.detach().to("cpu", torch.int64)
    return ids.reshape(1) if ids.ndim == 0 else ids


class DeviceMesh:
    """An n-D array of device ids ``0..N-1`` with optional dim names (PyTorch ``DeviceMesh``).

    With ``torch.distributed`` not initialized this process owns every device; with world size
    W > 1, rank r owns ids ``r*N/W .. (r+1)*N/W - 1`` (DESIGN.md, execution model).
    """

    def __init__(
        self,
        device_type: str,
        mesh: Any,
        *,
        mesh_dim_names: Sequence[str] | None = None,
        _devices_per_process: int | None = None,
        _rank: int | None = None,
    ) -> None:
        ids = _mesh_ids(mesh)
        flat = ids.flatten().tolist()
        if len(set(flat)) != len(flat) or min(flat) < 0:
            raise MeshError(f"device ids of a mesh must be unique and >= 0, got {flat}")
        if device_type not in ("cpu", "cuda", "meta"):
            raise MeshError(f"device_type must be 'cpu', 'cuda' or 'meta', got {device_type!r}")
        names = None if mesh_dim_names is None else tuple(mesh_dim_names)
        if names is not None:
            if len(names) != ids.ndim:
                raise MeshError(
                    f"mesh_dim_names {names} has {len(names)} names but the mesh of shape "
                    f"{tuple(ids.shape)} has {ids.ndim} dims"
                )
            if len(set(names)) != len(names) or not all(isinstance(n, str) for n in names):
                raise MeshError(f"mesh_dim_names must be unique strings, got {names}")
        if device_type == "cuda" and not torch.cuda.is_available():
            raise MeshError(
                f"a 'cuda' mesh {flat} needs CUDA, but torch.cuda.is_available() is False here; "
                f"use device_type='cpu' for simulated devices"
            )
        if device_type != "meta" and _devices_per_process is None:
            _init_process_group(device_type, None)
        self.device_type = device_type
        self.mesh = ids
        self.mesh_dim_names = names
        # a meta mesh has no devices to own: it plans and propagates shapes for the whole mesh
        rank, world = (0, 1) if device_type == "meta" else _process_info()
        if _devices_per_process is None and world == 1:
            _devices_per_process = max(flat) + 1  # the only process owns every id
        elif _devices_per_process is None:
            if sorted(flat) != list(range(len(flat))):
                raise MeshError(
                    f"across {world} processes the device ids of a mesh must be "
                    f"0..{len(flat) - 1} (process r owns a run of them), got {flat}; build "
                    f"sub-meshes with mesh[...] or mesh.submeshes(...), or use "
                    f"DeviceMesh.from_group"
                )
            if ids.numel() % world:
                raise MeshError(
                    f"a mesh of {ids.numel()} devices cannot be split over {world} processes: "
                    f"the mesh size must be a multiple of the world size"
                )
            _devices_per_process = ids.numel() // world
        self._devices_per_process = _devices_per_process
        self._rank = rank if _rank is None else _rank
        self._ids = flat
        self._id_set = frozenset(flat)

    @classmethod
    def from_group(
        cls,
        group: Any,
        device_type: str,
        mesh: Any | None = None,
        *,
        mesh_dim_names: Sequence[str] | None = None,
    ) -> DeviceMesh:
        """A mesh over the processes of a ``torch.distributed`` process ``group``, one device per
        process with its global rank as id (PyTorch's ``from_group``); ``mesh`` arranges those
        ranks in n-D (default: 1-D in group order)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise MeshError("DeviceMesh.from_group needs torch.distributed to be initialized")
        ranks = dist.get_process_group_ranks(group)
        ids = torch.tensor(ranks) if mesh is None else torch.as_tensor(mesh, dtype=torch.int64)
        if sorted(ids.flatten().tolist()) != sorted(ranks):
            raise MeshError(
                f"DeviceMesh.from_group: mesh {ids.tolist()} must hold exactly the ranks {ranks} "
                f"of the group"
            )
        return cls(device_type, ids, mesh_dim_names=mesh_dim_names, _devices_per_process=1)

    # ----- shape queries -------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return self.mesh.ndim

    @property
    def shape(self) -> IdTuple:
        return IdTuple(self.mesh.shape)

    def size(self, mesh_dim: int | str | None = None) -> int:
        """Number of devices in the mesh, or along one mesh dim."""
        if mesh_dim is None:
            return self.mesh.numel()
        return self.mesh.shape[self.dim_index(mesh_dim)]

    def dim_index(self, mesh_dim: int | str) -> int:
        """The integer index of a mesh dim given by index or name."""
        if isinstance(mesh_dim, str):
            if self.mesh_dim_names is None or mesh_dim not in self.mesh_dim_names:
                raise MeshDimNameError(
                    f"mesh dim {mesh_dim!r} is not in {self}; its dims are "
                    f"{self.mesh_dim_names or 'unnamed'}"
                )
            return self.mesh_dim_names.index(mesh_dim)
        if not isinstance(mesh_dim, int) or isinstance(mesh_dim, bool):
            raise MeshError(f"a mesh dim is an int or a dim name, got {mesh_dim!r} for {self}")
        if not -self.ndim <= mesh_dim < self.ndim:
            raise MeshError(f"mesh dim {mesh_dim} is out of range for {self}")
        return mesh_dim % self.ndim

    def dim_size(self, name: str) -> int:
        """TF: the size of the mesh dim called ``name``."""
        return self.size(name)

    def __contains__(self, name: object) -> bool:
        return self.mesh_dim_names is not None and name in self.mesh_dim_names

    # ----- devices ------------------------------------------------------------------------
    def owner_of(self, device_id: int) -> int:
        """The process rank that owns ``device_id``."""
        return device_id // self._devices_per_process

    @cached_property
    def local_device_ids(self) -> IdTuple:
        """Ids of the mesh devices this process owns, ascending."""
        return IdTuple(sorted(i for i in self._ids if self.owner_of(i) == self._rank))

    def num_local_devices(self) -> int:
        return len(self.local_device_ids)

    def device_of(self, device_id: int) -> torch.device:
        """The ``torch.device`` that holds the component of ``device_id``."""
        if self.device_type == "cuda":
            count = max(torch.cuda.device_count(), 1)
            return torch.device("cuda", (device_id % self._devices_per_process) % count)
        return torch.device(self.device_type)

    def local_devices(self) -> list[torch.device]:
        """TF: the torch devices of this process's mesh devices, in ascending id."""
        return [self.device_of(i) for i in self.local_device_ids]

    def coordinate_of(self, device_id: int) -> tuple[int, ...]:
        """The mesh coordinate of ``device_id`` (its index in ``mesh``)."""
        if device_id not in self._id_set:
            raise MeshError(f"device {device_id} is not in {self}")
        return self._coordinates[device_id]

    @cached_property
    def _coordinates(self) -> dict[int, tuple[int, ...]]:
        coords: dict[int, tuple[int, ...]] = {}
        for flat_index, device_id in enumerate(self._ids):
            coords[device_id] = tuple(_unravel(flat_index, self.mesh.shape))
        return coords

    def get_coordinate(self) -> tuple[int, ...] | None:
        """Coordinate of this process's first device (PyTorch's meaning), None if it owns none."""
        ids = self.local_device_ids
        return self.coordinate_of(ids[0]) if ids else None

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This process's first device's index along ``mesh_dim`` (PyTorch)."""
        coord = self.get_coordinate()
        if coord is None:
            raise MeshError(f"this process owns no device of {self}")
        if mesh_dim is None:
            if self.ndim != 1:
                raise MeshError(f"get_local_rank needs a mesh_dim on the {self.ndim}-D {self}")
            mesh_dim = 0
        return coord[self.dim_index(mesh_dim)]

    def unravel_index(self) -> dict[int, dict[str, int]]:
        """TF: ``{device_id: {dim_name: index}}`` in device id order."""
        names = self._names_or_default()
        return {
            i: dict(zip(names, self.coordinate_of(i), strict=True)) for i in sorted(self._ids)
        }

    def _names_or_default(self) -> tuple[str, ...]:
        return self.mesh_dim_names or tuple(f"dim{i}" for i in range(self.ndim))

    # ----- groups and sub-meshes ----------------------------------------------------------
    def group_of(self, device_id: int, mesh_dim: int | str) -> tuple[int, ...]:
        """The devices that differ from ``device_id`` only along ``mesh_dim`` (index or name),
        by coordinate."""
        coord: list[Any] = list(self.coordinate_of(device_id))
        coord[self.dim_index(mesh_dim)] = slice(None)
        return tuple(self.mesh[tuple(coord)].tolist())

    def groups(self, mesh_dim: int | str) -> list[tuple[int, ...]]:
        """Every group of devices along ``mesh_dim`` (index or name; the rows of the mesh on
        that dim)."""
        return list(self._groups[self.dim_index(mesh_dim)])

    @cached_property
    def _groups(self) -> tuple[tuple[tuple[int, ...], ...], ...]:
        result = []
        for mesh_dim in range(self.ndim):
            moved = self.mesh.movedim(mesh_dim, -1).reshape(-1, self.mesh.shape[mesh_dim])
            result.append(tuple(tuple(row) for row in moved.tolist()))
        return tuple(result)

    def __getitem__(self, dims: str | Sequence[str]) -> DeviceMesh:
        """The sub-mesh over ``dims`` through this process's first local device (PyTorch)."""
        if not (isinstance(dims, str) or (
            isinstance(dims, (tuple, list)) and all(isinstance(d, str) for d in dims)
        )):
            raise MeshError(
                f"index a mesh by dim name(s), as mesh['x'] or mesh['x', 'y'], got {dims!r} for "
                f"{self}; name the dims with mesh_dim_names, or use mesh.submeshes(dims)"
            )
        names = (dims,) if isinstance(dims, str) else tuple(dims)
        anchor = self.local_device_ids[0] if self.local_device_ids else self._ids[0]
        return self._submesh_through(names, self.coordinate_of(anchor))

    def submeshes(self, dims: str | int | Sequence[str | int]) -> list[DeviceMesh]:
        """All sub-meshes over ``dims`` (veScale's split of a mesh), in order of the other dims."""
        keep = self._dims_of(dims)
        others = [d for d in range(self.ndim) if d not in keep]
        shape = [self.mesh.shape[d] for d in others]
        result = []
        for flat in range(math.prod(shape)):
            coord = [0] * self.ndim
            for d, c in zip(others, _unravel(flat, shape), strict=True):
                coord[d] = c
            result.append(self._submesh_through(keep, tuple(coord)))
        return result

    def _dims_of(self, dims: str | int | Sequence[str | int]) -> tuple[int, ...]:
        seq = (dims,) if isinstance(dims, (str, int)) else tuple(dims)
        idx = tuple(self.dim_index(d) for d in seq)
        if len(set(idx)) != len(idx):
            raise MeshError(f"mesh dims {seq} repeat a dim of {self}")
        return idx

    def _submesh_through(self, dims: Sequence[str | int], coord: tuple[int, ...]) -> DeviceMesh:
        keep = self._dims_of(dims)
        index: list[Any] = list(coord)
        for d in keep:
            index[d] = slice(None)
        sub = self.mesh[tuple(index)]
        remaining = [d for d in range(self.ndim) if d in keep]
        sub = sub.permute([remaining.index(d) for d in keep]) if len(keep) > 1 else sub
        names = None if self.mesh_dim_names is None else [self.mesh_dim_names[d] for d in keep]
        return DeviceMesh(
            self.device_type,
            sub,
            mesh_dim_names=names,
            _devices_per_process=self._devices_per_process,
            _rank=self._rank,
        )

    # ----- pickling (torch.save / torch.load with weights_only) -----------------------------
    def __getstate__(self) -> dict[str, Any]:
        """Only the defining fields: cached tables are rebuilt on use."""
        keep = ("device_type", "mesh", "mesh_dim_names", "_devices_per_process", "_rank", "_ids")
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._id_set = frozenset(self._ids)

    # ----- identity -----------------------------------------------------------------------
    @cached_property
    def _key(self) -> tuple:
        return (self.device_type, tuple(self.mesh.shape), tuple(self._ids), self.mesh_dim_names)

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, DeviceMesh) and self._key == other._key)

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh({self.device_type!r}, {self.mesh.tolist()}{names})"


def _unravel(flat_index: int, shape: Iterable[int]) -> list[int]:
    coord = []
    for size in reversed(list(shape)):
        coord.append(flat_index % size)
        flat_index //= size
    return coord[::-1]


def init_device_mesh(
    device_type: str,
    mesh_shape: Sequence[int],
    *,
    mesh_dim_names: Sequence[str] | None = None,
    init_process_group: bool | None = None,
) -> DeviceMesh:
    """A mesh of shape ``mesh_shape`` over devices ``0..N-1`` in row-major order.

    Across processes it uses the initialized ``torch.distributed`` world. If none is
    initialized, it initializes one from the ``torchrun`` environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``; gloo on CPU, NCCL on CUDA) when ``init_process_group`` is
    True, or when it is None and that environment names a world of several processes, so a
    script runs unchanged under ``torchrun`` and ``python -m shardwise.launch``. A ``"meta"``
    mesh never initializes anything.
    """
    if not isinstance(mesh_shape, (tuple, list, torch.Size)):
        raise MeshError(
            f"mesh_shape must be a tuple of positive ints, e.g. ({mesh_shape!r},), got "
            f"{mesh_shape!r}"
        )
    shape = tuple(mesh_shape)
    if not shape or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in shape):
        raise MeshError(f"mesh_shape must be a non-empty tuple of positive ints, got {shape}")
    if device_type != "meta":
        _init_process_group(device_type, init_process_group)
    return DeviceMesh(
        device_type, torch.arange(math.prod(shape)).reshape(shape), mesh_dim_names=mesh_dim_names
    )


def _init_process_group(device_type: str, wanted: bool | None) -> None:
    """Initialize torch.distributed from the torchrun environment (see ``init_device_mesh``)."""
    import torch.distributed as dist

    if wanted is False or not dist.is_available() or dist.is_initialized():
        return
    env = os.environ
    if wanted is None:
        wanted = int(env.get("WORLD_SIZE", "1")) > 1 and "RANK" in env and "MASTER_ADDR" in env
        if not wanted:
            return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise MeshError(
            f"init_process_group=True reads the torchrun environment, but {missing} are not set; "
            f"start the script with torchrun or python -m shardwise.launch"
        )
    backend = "nccl" if device_type == "cuda" else "gloo"
    timeout = timedelta(seconds=settings.COLLECTIVE_TIMEOUT.get())
    if "TORCHELASTIC_RUN_ID" in env:  # torchrun's agent owns the store and watches the peers
        dist.init_process_group(backend, timeout=timeout)
    else:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        dist.init_process_group(
            backend, store=_rendezvous(rank, world, timeout), rank=rank, world_size=world,
            timeout=timeout,
        )
    atexit.register(_destroy_process_group)


def _rendezvous(rank: int, world: int, timeout: timedelta) -> Any:
    """The store every process meets at (rank 0 hosts it at MASTER_ADDR:MASTER_PORT), once all
    ``world`` processes have joined it; past ``timeout`` raise ``CollectiveTimeoutError``
    naming the ranks that did not come."""
    import torch.distributed as dist

    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    seconds = timeout.total_seconds()
    try:
        store = dist.TCPStore(
            addr, port, world, is_master=rank == 0, timeout=timeout, wait_for_workers=False
        )
    except RuntimeError as err:
        raise CollectiveTimeoutError(
            f"process-group setup: rank {rank} of {world} could not reach the store of rank 0 "
            f"at {addr}:{port} within {seconds:g} s (rank 0 did not start, died, or the "
            f"address is wrong): {err}"
        ) from None
    deadline = time.monotonic() + seconds
    while True:
        try:
            store.set(f"shardwise/joined/{rank}", "1")
            missing = [r for r in range(world) if not store.check([f"shardwise/joined/{r}"])]
        except RuntimeError as err:
            raise CollectiveError(
                f"process-group setup: rank {rank} of {world} lost the store of rank 0 at "
                f"{addr}:{port} (rank 0 died?): {err}"
            ) from None
        if not missing:
            return store
        if time.monotonic() >= deadline:
            raise CollectiveTimeoutError(
                f"process-group setup: ranks {missing} of {world} did not join within the "
                f"collective timeout of {seconds:g} s (rank {rank} waited at {addr}:{port}); "
                f"they died or were not started"
            )
        time.sleep(0.02)


def _destroy_process_group() -> None:
    """Tear down the process group shardwise started, so gloo's threads stop before exit."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def create_mesh(
    mesh_dims: Sequence[tuple[str, int]],
    *,
    device_type: str = "cpu",
    devices: Sequence[int] | None = None,
) -> DeviceMesh:
    """TF DTensor's ``create_mesh([("x", 2), ("y", 3)])``: a named mesh with row-major ids, or
    with ``devices`` (each id 0..N-1 once) laid out in row-major order."""
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
    if devices is None:
        return init_device_mesh(device_type, shape, mesh_dim_names=names)
    if device_type != "meta":
        _init_process_group(device_type, None)
    return DeviceMesh(device_type, _mesh_ids(list(devices)).reshape(shape), mesh_dim_names=names)
