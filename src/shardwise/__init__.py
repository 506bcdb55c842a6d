"""shardwise: distributed tensors for PyTorch. Write for one device, run sharded over a mesh."""

import sys as _sys

if "shardwise.launch" in _sys.orig_argv[1:] and _sys.orig_argv[
    _sys.orig_argv.index("shardwise.launch") - 1
] == "-m" and "--threads" not in _sys.orig_argv:  # ``python -m shardwise.launch``: run the
    # launcher now, without importing torch (--threads: once the package is imported, as rank
    # threads import it)
    from .launch import main as _launch_main

    _sys.exit(_launch_main())

from . import ops as _ops  # noqa: F401  (registers the built-in sharding strategies)
from .async_tensor import AsyncCollectiveTensor, AsyncDTensor
from .budget import CommBudget, comm_budget
from .comm import (
    CommCounter,
    get_collective_timeout,
    set_collective_timeout,
    set_debug_checks,
)
from .custom_sharding import register_sharding
from .debug import explain_redistribute
from .deferred_init import deferred_init, materialize_module
from .dispatch import (
    allow_implicit_redistribute,
    clear_sharding_cache,
    implicit_replication,
    set_implicit_redistribute,
    set_redistribute_logging,
)
from .dtensor import DTensor, distribute_tensor, local_components
from .errors import (
    CheckpointMismatchError,
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
    LayoutError,
    LocalComponentsError,
    MeshError,
    NotEagerError,
    OpArgumentError,
    PackError,
    ParallelPlanError,
    ParallelStyleError,
    ShardwiseError,
    ShardwiseTypeError,
    ShardwiseWarning,
    StateDictMismatchError,
    StrategyValidationError,
    UnsupportedOpError,
)
from .factories import empty, full, ones, rand, randn, zeros
from .layout import MATCH, UNSHARDED, Layout
from .local_map import local_map
from .mesh import DeviceMesh, Mesh, create_mesh, init_device_mesh
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
from .placements import InterleavedShard, Partial, Placement, Replicate, Shard
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

__all__ = [
    "OpSchema",
    "OpStrategy",
    "OutputSharding",
    "PlacementStrategy",
    "RuntimeSchemaInfo",
    "allow_implicit_redistribute",
    "bypass_dispatch",
    "bypass_sharding_propagation",
    "clear_sharding_cache",
    "register_op_strategy",
    "register_local_args",
    "register_post_patch",
    "register_pre_patch",
    "register_prop_rule",
    "remove_hooks",
    "set_collective_timeout",
    "set_debug_checks",
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
    "InvalidArgumentError",
    "InvalidPlacementError",
    "Layout",
    "LayoutError",
    "LocalComponentsError",
    "MATCH",
    "MeshError",
    "OpArgumentError",
    "PackError",
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
    "local_components",
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
    # parity with PyTorch DTensor and TF DTensor names
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
]
__all__ += [
    "DimOption",
    "StrategyValidationError",
    "ValidationReport",
    "product_strategy",
    "validate_strategy",
]
__all__ += ["StateDictMismatchError"]
