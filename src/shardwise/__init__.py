"""shardwise: distributed tensors for PyTorch. Write for one device, run sharded over a mesh."""

from . import dispatch as _dispatch  # noqa: F401  (installs DTensor.__torch_dispatch__)
from .comm import CommCounter
from .debug import explain_redistribute
from .dtensor import DTensor, distribute_tensor, unpack
from .errors import (
    ImplicitRedistributeError,
    InvalidArgumentError,
    InvalidPlacementError,
    LayoutError,
    LocalComponentsError,
    MeshError,
    PackError,
    ShardwiseError,
    UnsupportedOpError,
)
from .mesh import DeviceMesh, create_mesh, init_device_mesh
from .placements import InterleavedShard, Partial, Placement, Replicate, Shard
from .redistribute import RedistributePlan, Step
from .spec import DTensorSpec, TensorMeta

__all__ = [
    "CommCounter",
    "DTensor",
    "DTensorSpec",
    "DeviceMesh",
    "ImplicitRedistributeError",
    "InterleavedShard",
    "InvalidArgumentError",
    "InvalidPlacementError",
    "LayoutError",
    "LocalComponentsError",
    "MeshError",
    "PackError",
    "Partial",
    "Placement",
    "RedistributePlan",
    "Replicate",
    "Shard",
    "ShardwiseError",
    "Step",
    "TensorMeta",
    "UnsupportedOpError",
    "create_mesh",
    "distribute_tensor",
    "explain_redistribute",
    "init_device_mesh",
    "unpack",
]
