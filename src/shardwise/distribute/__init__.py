"""tf.distribute's strategy model on shardwise (``import shardwise.distribute as swd``).

A strategy's replicas are a 1-D shardwise mesh; Mirrored values and variables are
``Replicate()``, sync-on-read variables are ``Partial`` resolved on read, and every reduction is
a shardwise collective (counted by ``CommCounter``). See docs/distribute.md.
"""

from .. import dispatch as _dispatch  # noqa: F401  (DTensor ops run: the op layer is loaded)
from .context import (
    experimental_set_strategy,
    get_cross_replica_context,
    get_replica_context,
    get_strategy,
    get_update_replica_id,
    has_strategy,
    in_cross_replica_context,
    variable_sync_on_read_context,
)
from .enums import ReduceOp, VariableAggregation, VariableSynchronization
from .input import DistributedDataset, InputContext, ValueContext
from .module import DistributedModule
from .optimizer import Optimizer, compute_average_loss
from .replica_context import ReplicaContext
from .strategies import (
    AggregatingVariable,
    CentralStorageStrategy,
    MirroredStrategy,
    MultiWorkerMirroredStrategy,
    OneDeviceStrategy,
)
from .strategy import Strategy, StrategyExtended
from .values import DistributedValues, Mirrored, PerReplica
from .variables import (
    DistributedVariable,
    LocalVariable,
    MirroredVariable,
    SyncOnReadVariable,
    Variable,
)

__all__ = [
    "AggregatingVariable",
    "CentralStorageStrategy",
    "DistributedDataset",
    "DistributedModule",
    "DistributedValues",
    "DistributedVariable",
    "InputContext",
    "LocalVariable",
    "Mirrored",
    "MirroredStrategy",
    "MirroredVariable",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "Optimizer",
    "PerReplica",
    "ReduceOp",
    "ReplicaContext",
    "Strategy",
    "StrategyExtended",
    "SyncOnReadVariable",
    "ValueContext",
    "Variable",
    "VariableAggregation",
    "VariableSynchronization",
    "compute_average_loss",
    "experimental_set_strategy",
    "get_cross_replica_context",
    "get_replica_context",
    "get_strategy",
    "get_update_replica_id",
    "has_strategy",
    "in_cross_replica_context",
    "variable_sync_on_read_context",
]
