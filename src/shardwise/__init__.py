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
from typing import TYPE_CHECKING, Any

# public name -> the submodule defining it
_NAMES: dict[str, str] = {
    "AsyncCollectiveTensor": "pending",
    "AsyncDTensor": "dtensor",
    "CommCounter": "comm",
    "CommBudget": "comm.budget",
    "comm_budget": "comm.budget",
    "get_collective_timeout": "comm",
    "set_collective_timeout": "comm",
    "set_debug_checks": "comm",
    "set_deterministic": "comm",
    "deterministic": "comm",
    "register_sharding": "custom_sharding",
    "explain_redistribute": "debug",
    "deferred_init": "deferred_init",
    "materialize_module": "deferred_init",
    "clear_sharding_cache": "dispatch",
    "as_torch": "as_torch",
    "distribute_tensor": "factories",
    "DTensor": "dtensor",
    "local_components": "dtensor",
    "reshard": "dtensor",
    "CheckpointMismatchError": "errors",
    "CollectiveError": "errors",
    "CollectiveMismatchError": "errors",
    "CollectiveTimeoutError": "errors",
    "CommBudgetExceededError": "errors",
    "CommBudgetWarning": "errors",
    "ShardwiseWarning": "errors",
    "DataParallelError": "errors",
    "DeferredInitError": "errors",
    "DTensorCollectiveError": "errors",
    "ImplicitRedistributeError": "errors",
    "InvalidArgumentError": "errors",
    "InvalidPlacementError": "errors",
    "LayoutError": "errors",
    "LocalComponentsError": "errors",
    "MeshError": "errors",
    "NotEagerError": "errors",
    "OpArgumentError": "errors",
    "CheckpointCorruptError": "errors",
    "CheckpointFileMissingError": "errors",
    "CheckpointNotFoundError": "errors",
    "CheckpointPathError": "errors",
    "LabelOutOfRangeError": "errors",
    "UnsafeCheckpointError": "errors",
    "PackError": "errors",
    "ProcessStateError": "errors",
    "ParallelPlanError": "errors",
    "ParallelStyleError": "errors",
    "ShardwiseError": "errors",
    "ShardwiseTypeError": "errors",
    "StateDictMismatchError": "errors",
    "StrategyValidationError": "errors",
    "UnsupportedOpError": "errors",
    "empty": "factories",
    "full": "factories",
    "ones": "factories",
    "rand": "factories",
    "randn": "factories",
    "zeros": "factories",
    "Layout": "layout",
    "MATCH": "layout",
    "UNSHARDED": "layout",
    "local_map": "local_map",
    "create_mesh": "mesh",
    "DeviceMesh": "mesh",
    "init_device_mesh": "mesh",
    "Mesh": "mesh",
    "allow_implicit_redistribute": "op_inputs",
    "implicit_replication": "op_inputs",
    "set_implicit_redistribute": "op_inputs",
    "set_redistribute_logging": "op_inputs",
    "DimOption": "ops.common",
    "product_strategy": "ops.common",
    "manual_seed": "ops.random",
    "bypass_dispatch": "ops.registry",
    "bypass_sharding_propagation": "ops.registry",
    "OpSchema": "ops.registry",
    "OpStrategy": "ops.registry",
    "OutputSharding": "ops.registry",
    "PlacementStrategy": "ops.registry",
    "register_local_args": "ops.registry",
    "register_op_strategy": "ops.registry",
    "register_post_patch": "ops.registry",
    "register_pre_patch": "ops.registry",
    "register_prop_rule": "ops.registry",
    "remove_hooks": "ops.registry",
    "RuntimeSchemaInfo": "ops.registry",
    "validate_strategy": "ops.validate",
    "ValidationReport": "ops.validate",
    "distribute_module": "parallel",
    "InterleavedShard": "placements",
    "RaggedShard": "placements",
    "Partial": "placements",
    "Placement": "placements",
    "Replicate": "placements",
    "Shard": "placements",
    "RedistributePlan": "redistribute",
    "Step": "redistribute",
    "DTensorSpec": "spec",
    "TensorMeta": "spec",
    "barrier": "tf_dtensor",
    "call_with_layout": "tf_dtensor",
    "check_layout": "tf_dtensor",
    "client_id": "tf_dtensor",
    "copy_to_mesh": "tf_dtensor",
    "create_distributed_mesh": "tf_dtensor",
    "default_mesh": "tf_dtensor",
    "DVariable": "tf_dtensor",
    "fetch_layout": "tf_dtensor",
    "get_default_mesh": "tf_dtensor",
    "is_dtensor": "tf_dtensor",
    "local_devices": "tf_dtensor",
    "num_clients": "tf_dtensor",
    "num_global_devices": "tf_dtensor",
    "num_local_devices": "tf_dtensor",
    "pack": "tf_dtensor",
    "relayout": "tf_dtensor",
    "relayout_like": "tf_dtensor",
    "unpack": "tf_dtensor",
}

__all__ = [
    "CheckpointCorruptError",
    "CheckpointFileMissingError",
    "CheckpointNotFoundError",
    "CheckpointPathError",
    "LabelOutOfRangeError",
    "OpArgumentError",
    "UnsafeCheckpointError",
    "local_components",
    "reshard",
    "OpSchema",
    "OpStrategy",
    "OutputSharding",
    "PlacementStrategy",
    "RuntimeSchemaInfo",
    "allow_implicit_redistribute",
    "bypass_dispatch",
    "bypass_sharding_propagation",
    "clear_sharding_cache",
    "as_torch",
    "register_op_strategy",
    "register_local_args",
    "register_post_patch",
    "register_pre_patch",
    "register_prop_rule",
    "remove_hooks",
    "set_collective_timeout",
    "set_debug_checks",
    "set_deterministic",
    "deterministic",
    "set_implicit_redistribute",
    "set_redistribute_logging",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CommBudget",
    "CommBudgetExceededError",
    "CommBudgetWarning",
    "CommCounter",
    "ShardwiseWarning",
    "comm_budget",
    "DataParallelError",
    "DTensorCollectiveError",
    "DeferredInitError",
    "DTensor",
    "DTensorSpec",
    "DVariable",
    "DeviceMesh",
    "ImplicitRedistributeError",
    "InterleavedShard",
    "RaggedShard",
    "InvalidArgumentError",
    "InvalidPlacementError",
    "Layout",
    "LayoutError",
    "LocalComponentsError",
    "MATCH",
    "MeshError",
    "PackError",
    "ProcessStateError",
    "ParallelPlanError",
    "ParallelStyleError",
    "Partial",
    "Placement",
    "RedistributePlan",
    "Replicate",
    "Shard",
    "ShardwiseError",
    "ShardwiseTypeError",
    "Step",
    "TensorMeta",
    "UNSHARDED",
    "UnsupportedOpError",
    "call_with_layout",
    "check_layout",
    "copy_to_mesh",
    "create_mesh",
    "default_mesh",
    "deferred_init",
    "distribute_module",
    "distribute_tensor",
    "empty",
    "explain_redistribute",
    "fetch_layout",
    "full",
    "get_collective_timeout",
    "get_default_mesh",
    "implicit_replication",
    "init_device_mesh",
    "is_dtensor",
    "manual_seed",
    "materialize_module",
    "ones",
    "pack",
    "rand",
    "randn",
    "relayout",
    "relayout_like",
    "unpack",
    "zeros",
    "Mesh",
    "NotEagerError",
    "barrier",
    "client_id",
    "create_distributed_mesh",
    "local_devices",
    "num_clients",
    "num_global_devices",
    "num_local_devices",
    "AsyncCollectiveTensor",
    "AsyncDTensor",
    "local_map",
    "register_sharding",
    "CheckpointMismatchError",
    "DimOption",
    "StrategyValidationError",
    "ValidationReport",
    "product_strategy",
    "validate_strategy",
    "StateDictMismatchError",
]


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
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
        if name in _NAMES and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

if os.environ.get("SHARDWISE_AS_TORCH"):  # settings.AS_TORCH decides; nothing loads without it
    if importlib.import_module(".settings", __name__).AS_TORCH:
        importlib.import_module(".as_torch", __name__).as_torch()


if TYPE_CHECKING:  # what the names are, for type checkers and IDEs (never run)
    from .as_torch import as_torch
    from .comm import (
        CommCounter,
        deterministic,
        get_collective_timeout,
        set_collective_timeout,
        set_debug_checks,
        set_deterministic,
    )
    from .comm.budget import CommBudget, comm_budget
    from .custom_sharding import register_sharding
    from .debug import explain_redistribute
    from .deferred_init import deferred_init, materialize_module
    from .dispatch import clear_sharding_cache
    from .dtensor import (
        AsyncDTensor,
        DTensor,
        local_components,
        reshard,
    )
    from .errors import (
        CheckpointCorruptError,
        CheckpointFileMissingError,
        CheckpointMismatchError,
        CheckpointNotFoundError,
        CheckpointPathError,
        CollectiveError,
        CollectiveMismatchError,
        CollectiveTimeoutError,
        CommBudgetExceededError,
        CommBudgetWarning,
        DataParallelError,
        DeferredInitError,
        DTensorCollectiveError,
        ImplicitRedistributeError,
        InvalidArgumentError,
        InvalidPlacementError,
        LabelOutOfRangeError,
        LayoutError,
        LocalComponentsError,
        MeshError,
        NotEagerError,
        OpArgumentError,
        PackError,
        ParallelPlanError,
        ParallelStyleError,
        ProcessStateError,
        ShardwiseError,
        ShardwiseTypeError,
        ShardwiseWarning,
        StateDictMismatchError,
        StrategyValidationError,
        UnsafeCheckpointError,
        UnsupportedOpError,
    )
    from .factories import distribute_tensor, empty, full, ones, rand, randn, zeros
    from .layout import MATCH, UNSHARDED, Layout
    from .local_map import local_map
    from .mesh import DeviceMesh, Mesh, create_mesh, init_device_mesh
    from .op_inputs import (
        allow_implicit_redistribute,
        implicit_replication,
        set_implicit_redistribute,
        set_redistribute_logging,
    )
    from .ops.common import DimOption, product_strategy
    from .ops.random import manual_seed
    from .ops.registry import (
        OpSchema,
        OpStrategy,
        OutputSharding,
        PlacementStrategy,
        RuntimeSchemaInfo,
        bypass_dispatch,
        bypass_sharding_propagation,
        register_local_args,
        register_op_strategy,
        register_post_patch,
        register_pre_patch,
        register_prop_rule,
        remove_hooks,
    )
    from .ops.validate import ValidationReport, validate_strategy
    from .parallel import distribute_module
    from .pending import AsyncCollectiveTensor
    from .placements import InterleavedShard, Partial, Placement, RaggedShard, Replicate, Shard
    from .redistribute import RedistributePlan, Step
    from .spec import DTensorSpec, TensorMeta
    from .tf_dtensor import (
        DVariable,
        barrier,
        call_with_layout,
        check_layout,
        client_id,
        copy_to_mesh,
        create_distributed_mesh,
        default_mesh,
        fetch_layout,
        get_default_mesh,
        is_dtensor,
        local_devices,
        num_clients,
        num_global_devices,
        num_local_devices,
        pack,
        relayout,
        relayout_like,
        unpack,
    )
