"""shardwise: distributed tensors for PyTorch. Write for one device, run sharded over a mesh.

The package loads lazily (PEP 562): ``import shardwise`` imports no submodule (nor torch), so
``python -m shardwise.launch`` starts its processes at once; the first public name asked for
(``shardwise.DTensor``, ``from shardwise import Shard``) loads the runtime (``dispatch``, which
registers DTensor's op handler and the sharding rules) and then the module defining the name.
Submodules are reachable as attributes too (``shardwise.parallel``).
"""

from __future__ import annotations

__version__ = "0.1.0"  # the package's version (pyproject.toml reads it from here)

import importlib
import importlib.util
import os
import sys
import types
import warnings
from typing import TYPE_CHECKING, Any

# The top level, the DTensor core (as PyTorch's ``torch.distributed.tensor`` plus its mesh and
# a few of shardwise's own): public name -> the submodule defining it. The rest lives in
# namespaces: ``shardwise.tf`` (TF DTensor), ``shardwise.errors``, ``shardwise.parallel``,
# ``shardwise.distribute`` (tf.distribute), ``shardwise.checkpoint``, ``shardwise.rules`` (op
# sharding rules), ``shardwise.config`` (switches), ``shardwise.debug``.
_NAMES: dict[str, str] = {
    "DTensor": "dtensor",
    "distribute_tensor": "factories",
    "local_components": "dtensor",
    "distribute_module": "parallel",
    "DeviceMesh": "mesh",
    "init_device_mesh": "mesh",
    "Placement": "placements",
    "Shard": "placements",
    "Replicate": "placements",
    "Partial": "placements",
    "InterleavedShard": "placements",
    "RaggedShard": "placements",
    "empty": "factories",
    "full": "factories",
    "ones": "factories",
    "rand": "factories",
    "randn": "factories",
    "zeros": "factories",
    "local_map": "local_map",
    "manual_seed": "ops.random",
    "deferred_init": "deferred_init",
    "materialize_module": "deferred_init",
    "as_torch": "as_torch",
}

if TYPE_CHECKING:  # the same names for type checkers (a test keeps it equal to _NAMES)
    from .as_torch import as_torch  # noqa: F401
    from .deferred_init import deferred_init, materialize_module  # noqa: F401
    from .dtensor import DTensor, local_components  # noqa: F401
    from .factories import distribute_tensor, empty, full, ones, rand, randn, zeros  # noqa: F401
    from .local_map import local_map  # noqa: F401
    from .mesh import DeviceMesh, init_device_mesh  # noqa: F401
    from .ops.random import manual_seed  # noqa: F401
    from .parallel import distribute_module  # noqa: F401
    from .placements import InterleavedShard, Partial, Placement, RaggedShard, Replicate, Shard  # noqa: F401

# Names that moved from the top level to a namespace: they keep working for one release, with a
# DeprecationWarning naming their new home (old name -> the submodule holding it now).
_MOVED: dict[str, str] = {
    "CheckpointCorruptError": "errors",
    "CheckpointFileMissingError": "errors",
    "CheckpointMismatchError": "errors",
    "CheckpointNotFoundError": "errors",
    "CheckpointPathError": "errors",
    "CollectiveError": "errors",
    "CollectiveMismatchError": "errors",
    "CollectiveTimeoutError": "errors",
    "CommBudgetExceededError": "errors",
    "CommBudgetWarning": "errors",
    "DataParallelError": "errors",
    "DeferredInitError": "errors",
    "DTensorCollectiveError": "errors",
    "ImplicitRedistributeError": "errors",
    "InvalidArgumentError": "errors",
    "InvalidPlacementError": "errors",
    "LabelOutOfRangeError": "errors",
    "LayoutError": "errors",
    "LocalComponentsError": "errors",
    "MeshError": "errors",
    "NotEagerError": "errors",
    "OpArgumentError": "errors",
    "PackError": "errors",
    "ParallelPlanError": "errors",
    "ParallelStyleError": "errors",
    "ProcessStateError": "errors",
    "ShardwiseError": "errors",
    "ShardwiseTypeError": "errors",
    "ShardwiseWarning": "errors",
    "StateDictMismatchError": "errors",
    "StrategyValidationError": "errors",
    "UnsafeCheckpointError": "errors",
    "UnsupportedOpError": "errors",
    "barrier": "tf",
    "call_with_layout": "tf",
    "check_layout": "tf",
    "client_id": "tf",
    "copy_to_mesh": "tf",
    "create_distributed_mesh": "tf",
    "create_mesh": "tf",
    "default_mesh": "tf",
    "DVariable": "tf",
    "fetch_layout": "tf",
    "get_default_mesh": "tf",
    "is_dtensor": "tf",
    "Layout": "tf",
    "local_devices": "tf",
    "MATCH": "tf",
    "Mesh": "tf",
    "num_clients": "tf",
    "num_global_devices": "tf",
    "num_local_devices": "tf",
    "pack": "tf",
    "relayout": "tf",
    "relayout_like": "tf",
    "unpack": "tf",
    "UNSHARDED": "tf",
    "bypass_dispatch": "rules",
    "bypass_sharding_propagation": "rules",
    "clear_sharding_cache": "rules",
    "DimOption": "rules",
    "OpSchema": "rules",
    "OpStrategy": "rules",
    "OutputSharding": "rules",
    "PlacementStrategy": "rules",
    "product_strategy": "rules",
    "register_local_args": "rules",
    "register_op_strategy": "rules",
    "register_post_patch": "rules",
    "register_pre_patch": "rules",
    "register_prop_rule": "rules",
    "register_sharding": "rules",
    "remove_hooks": "rules",
    "RuntimeSchemaInfo": "rules",
    "validate_strategy": "rules",
    "ValidationReport": "rules",
    "allow_implicit_redistribute": "config",
    "deterministic": "config",
    "get_collective_timeout": "config",
    "implicit_replication": "config",
    "set_collective_timeout": "config",
    "set_debug_checks": "config",
    "set_deterministic": "config",
    "set_implicit_redistribute": "config",
    "set_redistribute_logging": "config",
    "comm_budget": "debug",
    "CommBudget": "debug",
    "CommCounter": "debug",
    "explain_redistribute": "debug",
    "AsyncCollectiveTensor": "pending",
    "AsyncDTensor": "dtensor",
    "reshard": "dtensor",
    "DTensorSpec": "spec",
    "TensorMeta": "spec",
    "RedistributePlan": "redistribute",
    "Step": "redistribute",
}

__all__ = list(_NAMES)


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None and name in _MOVED:
        new = f"{__name__}.{_MOVED[name]}"
        warnings.warn(
            f"shardwise.{name} moved to {new}.{name}; the top-level name goes in the next "
            f"release",
            DeprecationWarning,
            stacklevel=2,
        )
        importlib.import_module(".dispatch", __name__)
        return getattr(importlib.import_module(new), name)
    if module is None:
        if name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        # a submodule, as an attribute (also how ``from . import settings`` finds one: so
        # nothing more is loaded here)
        return importlib.import_module(f".{name}", __name__)
    importlib.import_module(".dispatch", __name__)  # the runtime: op handler and rules
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """The package's module type: the import system binds every submodule it loads on the
    package, and where a public name is also a submodule's (``deferred_init``, ``local_map``),
    the public name keeps its meaning."""

    def __setattr__(self, name: str, value: Any) -> None:
        if (name in _NAMES or name in _MOVED) and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

if os.environ.get("SHARDWISE_AS_TORCH"):  # settings.AS_TORCH decides; nothing loads without it
    if importlib.import_module(".settings", __name__).AS_TORCH:
        importlib.import_module(".as_torch", __name__).as_torch()

