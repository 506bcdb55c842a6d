"""The device mesh: an n-dimensional array of device ids, and which of them this process owns."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from typing import Any

import torch

from . import execution, mesh_text, runtime, settings
from .errors import MeshError, ShardwiseTypeError


class MeshBackendError(MeshError, RuntimeError):
    """A process group was asked of a mesh made without them (PyTorch's ``_init_backend=False``):
    a ``RuntimeError``, as PyTorch raises there."""


class MeshDimNameError(MeshError, KeyError):
    """A mesh dimension name that the mesh does not have."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


def _devices_per_process_of(ids: Sequence[int], world: int) -> int:
    """How many devices of a mesh over ``ids`` each of ``world`` processes owns: several when
    the ids are ``0..N-1`` with N a multiple of W above W, else one (the ids are ranks)."""
    n = len(ids)
    if n > world and sorted(ids) == list(range(n)):
        if n % world:
            raise MeshError(
                f"a mesh of {n} devices cannot be split over {world} processes: the mesh size "
                f"must be a multiple of the world size (or at most {world}, one device per "
                f"process with the ranks as ids)"
            )
        return n // world
    if max(ids) >= world:
        raise MeshError(
            f"across {world} processes the device ids of a mesh are either global ranks "
            f"(each below {world}, one device per process) or 0..N-1 with N a multiple of "
            f"{world} (N/{world} devices per process); got {list(ids)}"
        )
    return 1


def mesh_ids(mesh: Any) -> torch.Tensor:
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
    """An n-D array of device ids with optional dim names (PyTorch ``DeviceMesh``).

    With ``torch.distributed`` not initialized this process owns every device. With world size
    W > 1, a mesh of ids ``0..N-1`` with N a multiple of W and N > W gives rank r the ids
    ``r*N/W .. (r+1)*N/W - 1`` (DESIGN.md, execution model); any other mesh of ids below W is
    PyTorch's: one device per process, its id the global rank, and processes outside the mesh
    own none of it. A mesh is a context manager: ``with mesh:`` makes it the current mesh.
    """

    def __init__(
        self,
        device_type: str,
        mesh: Any,
        *,
        mesh_dim_names: Sequence[str] | None = None,
        _devices_per_process: int | None = None,
        _rank: int | None = None,
        _init_backend: bool = True,
    ) -> None:
        ids = mesh_ids(mesh)
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
        if not _init_backend:  # PyTorch's mesh of ranks, no process groups and no start-up
            _devices_per_process = _devices_per_process or 1
            self._no_backend = True
        if device_type != "meta" and _devices_per_process is None:
            runtime.start(device_type, None)
        self.device_type = device_type
        self.mesh = ids
        self.mesh_dim_names = names
        # a meta mesh has no devices to own: it plans and propagates shapes for the whole mesh
        rank, world = (0, 1) if device_type == "meta" else runtime.rank_and_world()
        if _devices_per_process is None and world == 1:
            _devices_per_process = max(flat) + 1  # the only process owns every id
        elif _devices_per_process is None:
            _devices_per_process = _devices_per_process_of(flat, world)
        self._devices_per_process = _devices_per_process
        self._rank = rank if _rank is None else _rank
        self._ids = tuple(flat)
        self._id_set = frozenset(flat)
        # geometry as Python values now, so no tensor op runs on the mesh later (tracing under
        # torch.compile runs shardwise's dispatch with fake tensors)
        self._groups, self._coordinates, self._group_index  # noqa: B018

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

        if not runtime.initialized():
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

    @cached_property
    def shape(self) -> tuple[int, ...]:
        """The mesh's size along each dim (PyTorch's property; TF's ``mesh.shape()`` reads
        ``mesh.shape`` here, see docs/api_map.md)."""
        return tuple(self.mesh.shape)

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

    @property
    def device_ids(self) -> tuple[int, ...]:
        """Every device id of the mesh, in mesh (row-major) order."""
        return self._ids

    @cached_property
    def local_device_ids(self) -> tuple[int, ...]:
        """Ids of the mesh devices this process owns, ascending."""
        return tuple(sorted(i for i in self._ids if self.owner_of(i) == self._rank))

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

    @property
    def _coordinate_on_dim(self) -> tuple[int, ...] | None:
        """PyTorch's attribute: ``get_coordinate()``."""
        return self.get_coordinate()

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
        self.coordinate_of(device_id)  # checks the id
        return self._group_index[self.dim_index(mesh_dim)][device_id]

    def groups(self, mesh_dim: int | str) -> list[tuple[int, ...]]:
        """Every group of devices along ``mesh_dim`` (index or name): the rows of the mesh on
        that dim."""
        return list(self._groups[self.dim_index(mesh_dim)])

    @cached_property
    def _groups(self) -> tuple[tuple[tuple[int, ...], ...], ...]:
        result = []
        for mesh_dim in range(self.ndim):
            moved = self.mesh.movedim(mesh_dim, -1).reshape(-1, self.mesh.shape[mesh_dim])
            result.append(tuple(tuple(row) for row in moved.tolist()))
        return tuple(result)

    @cached_property
    def _group_index(self) -> tuple[dict[int, tuple[int, ...]], ...]:
        return tuple({d: g for g in groups for d in g} for groups in self._groups)

    def __getitem__(self, dims: str | Sequence[str]) -> DeviceMesh:
        """The sub-mesh over ``dims`` through this process's first local device (PyTorch)."""
        names = (dims,) if isinstance(dims, str) else dims
        if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) for n in names):
            raise ShardwiseTypeError(
                f"a DeviceMesh is indexed by mesh dim names (mesh['x'] or mesh['x', 'y']), got "
                f"{dims!r} for {self}; the device ids are mesh.mesh[...], every sub-mesh along "
                f"a dim is mesh.submeshes(dim)"
            )
        anchor = self.local_device_ids[0] if self.local_device_ids else self._ids[0]
        self._check_one_submesh_per_process(names)
        return self._submesh_through(names, self.coordinate_of(anchor))

    def _check_one_submesh_per_process(self, names: Sequence[str]) -> None:
        """``mesh[names]`` is the sub-mesh through each process's first device. Where a
        process owns devices of several such sub-meshes (a (2, 3) mesh over 3 processes: rank
        1 owns devices 2 and 3, one in each row), it takes part in one only, and the processes
        of the other would wait for it forever: refuse that on every process alike."""
        keep = set(self._dims_of(names))

        def through(device: int) -> tuple:
            return tuple(c for d, c in enumerate(self.coordinate_of(device)) if d not in keep)

        first: dict[int, int] = {}
        for device in sorted(self._ids):
            first.setdefault(self.owner_of(device), device)
        picked = {rank: through(device) for rank, device in first.items()}
        pickers: dict[tuple, list[int]] = {}
        for rank, sub in picked.items():
            pickers.setdefault(sub, []).append(rank)
        for device in self._ids:
            owner = self.owner_of(device)
            used_by = pickers.get(through(device), [])
            if used_by and picked[owner] != through(device):
                mine = sorted(d for d in self._ids if self.owner_of(d) == owner)
                raise MeshError(
                    f"mesh[{list(names)}] of {self} is the sub-mesh through each process's "
                    f"first device, but process {owner} owns devices {mine} of several of them: "
                    f"it would take part in the one through device {first[owner]} only, and "
                    f"processes {used_by} would wait forever for its device {device}. Choose a "
                    f"mesh shape where each process's devices lie in one sub-mesh along "
                    f"{list(names)} (one device per process always does), or use every "
                    f"sub-mesh in one order on every process (mesh.submeshes(...))"
                )

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
        result = DeviceMesh(
            self.device_type,
            sub,
            mesh_dim_names=names,
            _devices_per_process=self._devices_per_process,
            _rank=self._rank,
            _init_backend=not self.__dict__.get("_no_backend"),
        )
        root, root_dims = self.root_mesh, self.root_dims
        result._root = (root, tuple(root_dims[d] for d in keep))
        return result

    # ----- the current mesh (PyTorch's ``with mesh:``) ------------------------------------------
    def __enter__(self) -> DeviceMesh:
        """Make this the current mesh of this thread (or task) until the block ends: the APIs
        that PyTorch lets default their mesh to it (``DTensor.from_local``, the factories,
        ``distribute_module``, ``parallelize_module``) use it when given none."""
        settings.MESHES.push(self)
        return self

    def __exit__(self, *exc: object) -> None:
        settings.MESHES.pop()

    # ----- where a sub-mesh comes from ----------------------------------------------------------
    _root: tuple[DeviceMesh, tuple[int, ...]] | None = None

    @property
    def root_mesh(self) -> DeviceMesh:
        """The mesh this one was indexed from (``mesh["tp"]`` remembers ``mesh``), else itself."""
        return self if self._root is None else self._root[0]

    @property
    def root_dims(self) -> tuple[int, ...]:
        """The dims of ``root_mesh`` this mesh's dims are, in order."""
        return tuple(range(self.ndim)) if self._root is None else self._root[1]

    # ----- pickling (torch.save / torch.load with weights_only) -----------------------------
    def __getstate__(self) -> dict[str, Any]:
        """Only the defining fields: cached tables are rebuilt on use."""
        keep = ("device_type", "mesh", "mesh_dim_names", "_devices_per_process", "_rank", "_ids",
                "mesh_name", "_root", "_no_backend")
        return {k: self.__dict__[k] for k in keep if k in self.__dict__}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._id_set = frozenset(self._ids)

    # ----- PyTorch: process groups, rank, flattening -----------------------------------------
    def get_rank(self) -> int:
        """This process's global rank (0 when torch.distributed is not initialized)."""
        return self._rank

    def get_group(self, mesh_dim: int | str | None = None) -> Any:
        """The ``torch.distributed`` process group of this process's group along ``mesh_dim``
        (PyTorch's ``get_group``), for code that calls ``torch.distributed`` itself.

        A dim of size 1 has the group of this process alone (as in PyTorch). A dim of several
        devices that lives inside this process has none: shardwise's own collectives
        (``redistribute``, ``shardwise.comm``) are the way to communicate there, and asking
        for its group raises ``MeshError``, as does a dim of size 1 while torch.distributed is
        not initialized.
        """
        if self.__dict__.get("_no_backend"):
            raise MeshBackendError(
                f"DeviceMesh process groups not initialized! {self} was made with "
                f"_init_backend=False"
            )
        if mesh_dim is None:
            if self.ndim != 1:
                raise MeshError(f"get_group needs a mesh_dim on the {self.ndim}-D {self}")
            mesh_dim = 0
        dim = self.dim_index(mesh_dim)
        if not self.local_device_ids:
            raise MeshError(
                f"process {self._rank} owns no device of {self}, so it is in no group along "
                f"mesh dim {mesh_dim!r}"
            )
        rank_sets = {
            tuple(sorted({self.owner_of(m) for m in self.group_of(d, dim)}))
            for d in self.local_device_ids
        }
        if self.mesh.shape[dim] > 1 and all(len(ranks) == 1 for ranks in rank_sets):
            raise MeshError(
                f"mesh dim {mesh_dim!r} of {self} lives inside process {self._rank} (its devices "
                f"{list(self.local_device_ids)} are all local), so it has no torch.distributed "
                f"process group; communicate with DTensor.redistribute or shardwise.comm"
            )
        if not runtime.initialized():
            raise MeshError(
                f"mesh dim {mesh_dim!r} of size 1 of {self} has no process group here: "
                f"torch.distributed is not initialized (one process owns every device); "
                f"initialize it (torchrun, shardwise.launch) for a group of this process alone"
            )
        if len(rank_sets) > 1:
            raise MeshError(
                f"this process's devices {list(self.local_device_ids)} of {self} belong to "
                f"{len(rank_sets)} groups of processes {sorted(rank_sets)} along mesh dim "
                f"{mesh_dim!r}; get_group needs one, index a sub-mesh first (mesh[...])"
            )
        # the transport keeps one process group per set of ranks: share it
        return runtime.group_for_ranks(rank_sets.pop())

    def _is_current_rank_part_of_mesh(self) -> bool:
        """PyTorch's name: whether this process owns a device of the mesh."""
        return bool(self.local_device_ids)

    @property
    def _dim_group_names(self) -> list[str]:
        """PyTorch's attribute: the name of ``get_group(d)`` of every mesh dim, as
        ``torch.distributed._functional_collectives`` resolves a mesh to its groups."""
        return [self.get_group(d).group_name for d in range(self.ndim)]

    def get_all_groups(self) -> list[Any]:
        """``get_group`` of every mesh dim, in dim order."""
        return [self.get_group(d) for d in range(self.ndim)]

    def flatten(self, mesh_dim_name: str | None = None) -> DeviceMesh:
        """This mesh as a 1-D mesh over the same devices in row-major order (PyTorch's
        ``_flatten``): sharding over it splits a tensor dim over all of this mesh's dims.

        The name defaults to the dim names joined by ``_``. Take it from a sub-mesh to flatten
        some dims only: ``mesh["dp", "cp"].flatten()``. Flattening a 1-D mesh keeps its
        ``root_mesh``; a flattened dim of several dims is no dim of the root, so the result
        of flattening several dims is a root mesh itself.
        """
        name = mesh_dim_name
        if name is None and self.mesh_dim_names is not None:
            name = "_".join(self.mesh_dim_names)
        if name is not None and not isinstance(name, str):
            raise MeshError(f"flatten needs a str mesh_dim_name, got {name!r} for {self}")
        names = None if name is None else (name,)
        return self._reshaped(self.mesh.flatten(), names, self.ndim == 1)

    def _unflatten(
        self,
        dim: int | str,
        mesh_sizes: Sequence[int],
        mesh_dim_names: Sequence[str],
        backend_override: Any = None,
    ) -> DeviceMesh:
        """This mesh with dim ``dim`` split into dims of ``mesh_sizes`` called
        ``mesh_dim_names`` (PyTorch's ``_unflatten``): ``DeviceMesh("cpu", range(8),
        mesh_dim_names=("world",))._unflatten(0, (2, 2, 2), ("dp", "cp", "tp"))`` is the
        2x2x2 mesh of the same ids in the same order. The split dims are no dims of this
        mesh's root, so the result is a root mesh itself (its sub-meshes remember it).

        ``backend_override`` (PyTorch: a backend per new dim, keyed by its name or its index
        among ``mesh_dim_names``) is checked and has no effect: shardwise picks the transport
        of each group itself when the group first communicates, so a dim PyTorch would give
        the ``"fake"`` backend (torchtitan's unused dims) costs nothing unless used."""
        if self.mesh_dim_names is None:
            raise MeshError(f"_unflatten needs a mesh with mesh_dim_names, got {self}")
        d = self.dim_index(dim)
        sizes, names = tuple(mesh_sizes), tuple(mesh_dim_names)
        if not sizes or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sizes):
            raise MeshError(
                f"_unflatten of {self}: mesh_sizes must be positive ints, got {mesh_sizes!r}"
            )
        if math.prod(sizes) != self.mesh.shape[d]:
            raise MeshError(
                f"_unflatten of {self}: mesh_sizes {sizes} multiply to {math.prod(sizes)}, but "
                f"dim {dim!r} has {self.mesh.shape[d]} devices"
            )
        if len(names) != len(sizes):
            raise MeshError(
                f"_unflatten of {self}: {len(sizes)} mesh_sizes {sizes} need as many "
                f"mesh_dim_names, got {names}"
            )
        if backend_override is not None:
            _check_backend_override(backend_override, names, self)
        shape = (*self.mesh.shape[:d], *sizes, *self.mesh.shape[d + 1 :])
        all_names = (*self.mesh_dim_names[:d], *names, *self.mesh_dim_names[d + 1 :])
        return self._reshaped(self.mesh.reshape(shape), all_names, len(sizes) == 1)

    def _reshaped(
        self, ids: torch.Tensor, names: tuple[str, ...] | None, same_dims: bool
    ) -> DeviceMesh:
        """A mesh over this one's devices laid out as ``ids``, owned as here; ``same_dims``:
        its dims are this mesh's (renamed), so it keeps this mesh's root."""
        result = DeviceMesh(
            self.device_type,
            ids,
            mesh_dim_names=names,
            _devices_per_process=self._devices_per_process,
            _rank=self._rank,
            _init_backend=not self.__dict__.get("_no_backend"),
        )
        if same_dims:
            result._root = (self.root_mesh, self.root_dims)
        return result

    _flatten = flatten

    # ----- TF DTensor's Mesh names --------------------------------------------------------
    mesh_name: str = ""

    @property
    def dim_names(self) -> list[str]:
        """TF: the dim names (``dim0``, ``dim1``... for a mesh created without names)."""
        return list(self._names_or_default())

    def contains_dim(self, dim_name: str) -> bool:
        """TF: whether the mesh has a dim called ``dim_name``."""
        return dim_name in self

    def to_string(self) -> str:
        """TF's serialized mesh: ``|x=2,y=3|global ids|local ids|local devices``; read it back
        with ``DeviceMesh.from_string`` (an unnamed mesh writes its sizes without names)."""
        local = [(self.owner_of(i), i) for i in self.local_device_ids]
        return mesh_text.write(
            self.mesh_name, self.mesh_dim_names, self.shape, self._ids, local, self.device_type
        )

    @classmethod
    def from_string(cls, mesh_str: str) -> DeviceMesh:
        """The mesh ``to_string`` wrote, or TF's short form ``name|x=2,y=2|*CPU`` (devices
        0..N-1). Which devices this process owns follows from its own rank, so a string written
        by another process reads back as the same mesh."""
        text = mesh_text.read(mesh_str)
        mesh = DeviceMesh(
            text.device_type, torch.tensor(text.ids).reshape(text.shape),
            mesh_dim_names=text.dim_names,
        )
        mesh.mesh_name = text.name
        return mesh

    # ----- identity -----------------------------------------------------------------------
    @cached_property
    def _key(self) -> tuple:
        # who owns what: two ranks' meshes own different devices (rank threads share one
        # process), and an embedded mesh owns all the devices a rank thread's mesh owns one of
        return (self.device_type, tuple(self.mesh.shape), tuple(self._ids), self.mesh_dim_names,
                self._rank, tuple(self.local_device_ids))

    def __eq__(self, other: object) -> bool:
        """PyTorch's: False for anything but a mesh (TF 2.21 raises TypeError); meshes with
        different TF names differ, as in TF."""
        return self is other or (
            isinstance(other, DeviceMesh) and self._key == other._key
            and self.mesh_name == other.mesh_name
        )

    def __hash__(self) -> int:
        return hash(self._key)

    def torch_repr(self) -> str:
        """PyTorch's repr, the same in every process: "DeviceMesh('cpu', [0, 1])". Also the
        mesh as messages name it (``str``): what every process describes alike (the
        descriptions of collectives are compared between processes)."""
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh({self.device_type!r}, {self.mesh.tolist()}{names})"

    __str__ = torch_repr

    def __repr__(self) -> str:
        """``torch_repr``, then the execution context this program acts in on the mesh
        (``execution.of``): "DeviceMesh('cpu', [0, 1]) [per-rank process 0 of 2, acting for
        devices [0], per-rank view]". A meta mesh only plans: no program acts on it."""
        if self.device_type == "meta":
            return self.torch_repr()
        return f"{self.torch_repr()} [{execution.of(self)}]"


def _check_backend_override(override: Any, names: tuple[str, ...], mesh: DeviceMesh) -> None:
    """PyTorch's rules for ``backend_override`` keys: each new dim named once, by its name or
    by its index among the new dims."""
    if not isinstance(override, Mapping):
        raise MeshError(
            f"_unflatten of {mesh}: backend_override must be a dict keyed by the new dims' names "
            f"{names} or indices, got {override!r}"
        )
    for key in override:
        valid_index = isinstance(key, int) and not isinstance(key, bool) and 0 <= key < len(names)
        if key not in names and not valid_index:
            raise MeshError(
                f"_unflatten of {mesh}: backend_override key {key!r} is no new dim; expected an "
                f"index in range [0, {len(names)}) or one of {names}"
            )
        if isinstance(key, str) and names.index(key) in override:
            raise MeshError(
                f"_unflatten of {mesh}: backend_override names dim {key!r} twice, by name and "
                f"by index {names.index(key)}"
            )


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
        runtime.start(device_type, init_process_group)
    return DeviceMesh(
        device_type, torch.arange(math.prod(shape)).reshape(shape), mesh_dim_names=mesh_dim_names
    )

