"""Plain tensors at the program's edge: whose data a plain ``torch.Tensor`` is (DESIGN.md).

A PyTorch program is written per rank, so a plain tensor is *this rank's* data. shardwise keeps
that contract wherever the program acts for exactly one device of a mesh: a process owning one
device (``torchrun``, the launcher), a rank thread of the launcher's threads mode, a per-replica
thread of ``Strategy.run``. Only a process that owns several devices of the mesh, and acts for
all of them, sees plain tensors as global values (the embedded global view). A process owning no
device of the mesh has no meaning to give them: that is an error.

Every module-level API that turns a plain tensor into a DTensor asks ``plain_is_local`` first.
"""

from __future__ import annotations

from . import settings
from .errors import MeshError
from .mesh import DeviceMesh


def plain_is_local(mesh: DeviceMesh, what: str = "a plain tensor") -> bool:
    """True where a plain tensor given for ``mesh`` is this rank's local data (the program acts
    for one device of ``mesh``); False where it is the global value (this process acts for all
    of its several devices). Raises ``MeshError`` where this process owns no device of it."""
    owned = mesh.num_local_devices()
    if owned == 0:
        raise MeshError(
            f"{what} given for {mesh}: process {mesh.get_rank()} owns no device of this mesh, so "
            f"the tensor is neither its local piece nor a global value it could place; call this "
            f"only on the ranks of the mesh"
        )
    return owned == 1 or settings.REPLICA_THREAD.get() is not None
