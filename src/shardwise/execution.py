"""The execution context: who this program is, which devices it acts for, what a plain tensor
means, and how its collectives and messages travel (DESIGN.md, "Execution model" and "Plain
tensors at the program's edge"). Every module asks here; none infers it on its own.

One value, ``ExecutionContext``, is made once by whoever creates the context:

- the process, for a thread that declares none (``current()``, made once per rank and world
  from torch.distributed's state): *embedded* without a world of several processes (it acts
  for every device of a mesh), or a *per-rank process* of a world started by ``torchrun``,
  ``shardwise.launch`` or ``init_device_mesh`` (``runtime.start``);
- ``rank_threads``: each *rank thread* of the launcher's threads mode, a process of its own
  whose point-to-point messages go through the ranks' shared mailbox;
- ``Strategy.run``: each *replica thread*, acting for one local replica device in the
  per-rank view (``replica_thread``).

A declared one lives in one setting, ``settings.EXECUTION``, so a thread, or a ``with``
block, sees its own. For a mesh, ``of(mesh)`` binds it to the devices of the mesh this program
acts for and the view of a plain tensor: *per-rank* (a plain tensor is this rank's local
data) where it acts for one device of the mesh or a replica thread declares it, *global* where
it acts for several. ``plain_view(mesh, what)`` is that rule for an API given a plain tensor.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from . import settings
from .errors import MeshError


class DeviceMesh(Protocol):
    """What the context reads of a mesh (named by its shape: mesh.py imports this module)."""

    local_device_ids: list[int]

    def torch_repr(self) -> str: ...


class Kind(enum.Enum):
    """Which of the four execution models a context is."""

    EMBEDDED = "embedded"
    PROCESS = "per-rank process"
    RANK_THREAD = "rank thread"
    REPLICA_THREAD = "replica thread"


class View(enum.Enum):
    """What a plain tensor given for a mesh means."""

    GLOBAL = "global view"  # the whole value: this program acts for several devices
    PER_RANK = "per-rank view"  # this rank's (or replica's) local data


class Transport(Protocol):
    """How a context's point-to-point messages travel between its processes (the messages
    of the point-to-point collectives, ``comm/distributed.py``): ``send`` and ``receive`` post
    a message to or from global rank ``peer`` of the group over ``ranks`` and return a handle
    with ``is_completed()`` and ``wait(timeout)``; ``wait`` waits for one."""

    name: str

    def send(self, tensor: torch.Tensor, peer: int, ranks: tuple[int, ...], tag: int) -> Any: ...

    def receive(
        self, buffer: torch.Tensor, peer: int, ranks: tuple[int, ...], tag: int
    ) -> Any: ...

    def wait(self, work: Any, timeout: timedelta) -> None: ...


class GroupTransports(Protocol):
    """What carries each group of a context's collectives (``comm.transport.Transports``):
    ``routes(mesh, mesh_dim)`` pairs each kind of group along the dim that holds a device of
    this program with the ``comm.transport.GroupTransport`` that carries it."""

    def routes(self, mesh: Any, mesh_dim: int) -> tuple[tuple[Any, tuple], ...]: ...


@dataclasses.dataclass(frozen=True)
class Replica:
    """What a replica thread of ``Strategy.run`` acts for: local replica ``index`` of
    ``count``; ``merge(value, fn)`` waits for every local replica, calls ``fn([value of replica
    0, value of replica 1, ...])`` once and returns its result to each of them."""

    index: int
    count: int
    merge: Callable[[Any, Callable[[list], Any]], Any]


@dataclasses.dataclass(frozen=True)
class ExecutionContext:
    """Who this program is: ``kind``, ``rank`` of ``world`` processes, its ``transport``
    (None: the process group's own ``isend``/``irecv``, ``comm.wire.BACKEND``), its
    ``group_transports``, what carries each kind of group of its collectives (None:
    ``comm.transport.STANDARD``), the ``view`` it declares (None: decided per mesh by the
    devices it acts for), the ``replica`` of a replica thread. ``on(mesh)`` binds it to a
    mesh: ``mesh``, ``devices`` (the devices of it this program acts for) and ``view`` are
    then set."""

    kind: Kind
    rank: int
    world: int
    transport: Transport | None = dataclasses.field(default=None, compare=False, repr=False)
    group_transports: GroupTransports | None = dataclasses.field(
        default=None, compare=False, repr=False)
    view: View | None = None
    replica: Replica | None = None
    mesh: DeviceMesh | None = dataclasses.field(default=None, compare=False, repr=False)
    devices: tuple[int, ...] = ()

    def on(self, mesh: DeviceMesh) -> ExecutionContext:
        """This context for ``mesh``, with the devices of it this program acts for and the
        view of a plain tensor there (``_acting``)."""
        devices, view = _acting(self, mesh)
        return ExecutionContext(self.kind, self.rank, self.world, self.transport,
                                self.group_transports, view, self.replica, mesh, devices)

    def who(self) -> str:
        """"embedded", "per-rank process 1 of 4", "replica thread 0 of 2, rank 1 of 4"..."""
        if self.replica is not None:
            where = "embedded" if self.world == 1 else f"rank {self.rank} of {self.world}"
            return f"replica thread {self.replica.index} of {self.replica.count}, {where}"
        if self.kind is Kind.EMBEDDED:
            return self.kind.value
        return f"{self.kind.value} {self.rank} of {self.world}"

    def __str__(self) -> str:
        """For a mesh: "rank thread 1 of 2, acting for devices [1], per-rank view"."""
        if self.mesh is None:
            return self.who()
        if not self.devices:
            return f"{self.who()}, acting for no device of it"
        return f"{self.who()}, acting for devices {list(self.devices)}, {self.view.value}"  # type: ignore[union-attr]

    def describe(self) -> str:
        """For errors about plain tensors: "this program acts for devices [0] of
        DeviceMesh('cpu', [0, 1]) [per-rank process 0 of 2, acting for devices [0], per-rank
        view]"."""
        if self.mesh is None:
            return f"this program is {self.who()}"
        acts = f"devices {list(self.devices)}" if self.devices else "no device"
        return f"this program acts for {acts} of {self.mesh!r}"


def _acting(
    context: ExecutionContext | None, mesh: DeviceMesh
) -> tuple[tuple[int, ...], View]:
    """The devices of ``mesh`` a program in ``context`` (None: a process's own, which declares
    nothing) acts for, and the view of a plain tensor there: a replica thread acts for its
    replica's device where the mesh has one local device per replica; the view is the
    declared one, else per-rank for one device and global for several."""
    local = mesh.local_device_ids
    replica = None if context is None else context.replica
    devices = (
        (local[replica.index],) if replica is not None and replica.count == len(local)
        else local
    )
    declared = None if context is None else context.view
    return devices, declared or (View.PER_RANK if len(devices) == 1 else View.GLOBAL)


def current() -> ExecutionContext:
    """The context of this thread: the one declared for it (``settings.EXECUTION``), else the
    process's own, embedded or one rank of its ``torch.distributed`` world."""
    declared = settings.EXECUTION.get()
    if declared is not None:
        return declared
    if dist.is_available() and dist.is_initialized():  # this data layer reads c10d itself
        return _process(dist.get_rank(), dist.get_world_size())
    return _process(0, 1)


_PROCESS: dict[tuple[int, int], ExecutionContext] = {}


def _process(rank: int, world: int) -> ExecutionContext:
    made = _PROCESS.get((rank, world))
    if made is None:
        kind = Kind.EMBEDDED if world == 1 else Kind.PROCESS
        made = _PROCESS[(rank, world)] = ExecutionContext(kind, rank, world)
    return made


def rank_thread(rank: int, world: int, transport: Transport) -> ExecutionContext:
    """The context of rank thread ``rank`` of ``world`` (made by ``rank_threads``)."""
    return ExecutionContext(Kind.RANK_THREAD, rank, world, transport)


def replica_thread(index: int, count: int, merge: Callable) -> ExecutionContext:
    """The context of replica thread ``index`` of ``count`` that ``Strategy.run`` starts from
    this thread: its rank's, in the per-rank view."""
    parent = current()
    return dataclasses.replace(
        parent, kind=Kind.REPLICA_THREAD, view=View.PER_RANK,
        replica=Replica(index, count, merge),
    )


def of(mesh: DeviceMesh) -> ExecutionContext:
    """This thread's context bound to ``mesh`` (``ExecutionContext.on``)."""
    return current().on(mesh)


def replica() -> Replica | None:
    """The replica this thread acts for inside ``Strategy.run`` (None: none)."""
    declared = settings.EXECUTION.get()
    return None if declared is None else declared.replica


def plain_view(mesh: DeviceMesh, what: str = "a plain tensor") -> View:
    """The view of a plain tensor given for ``mesh``: ``View.PER_RANK`` where it is this
    rank's local data, ``View.GLOBAL`` where it is the global value. Raises ``MeshError``
    where this program acts for no device of the mesh (the tensor has no meaning there)."""
    devices, view = _acting(settings.EXECUTION.get(), mesh)  # on the hot path: no context made
    if not devices:
        raise MeshError(
            f"{what} given for {mesh.torch_repr()}: {of(mesh).describe()}, so the tensor is "
            f"neither its local piece nor a global value it could place; call this only on the "
            f"ranks of the mesh"
        )
    return view


def per_rank(mesh: DeviceMesh, what: str = "a plain tensor") -> bool:
    """``plain_view(mesh, what) is View.PER_RANK``."""
    return plain_view(mesh, what) is View.PER_RANK
