"""Module-level parallelism with PyTorch's names: ``parallelize_module`` with tensor and sequence
parallel styles (plans by name, glob, regex, or veScale's dict format), ``distribute_module``
and ``loss_parallel``."""

from .. import dispatch as _dispatch  # noqa: F401  (DTensor ops run: the op layer is loaded)
from . import state_dict as _state_dict  # noqa: F401  (checks load_state_dict of DTensors)
from .api import distribute_module, parallelize_module
from .loss import loss_parallel
from .style import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = [
    "ColwiseParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
    "distribute_module",
    "loss_parallel",
    "parallelize_module",
]

# data parallel (composable with the styles above on a 2-D mesh)
from .data_parallel import DataParallelMeshDims
from .fully_shard import (
    FSDPModule,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from .policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .replicate import replicate

__all__ += [
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "replicate",
    "share_comm_ctx",
]
