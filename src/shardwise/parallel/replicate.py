"""``replicate``: data parallelism with replicated parameters (PyTorch's composable DDP).

Every parameter is Replicate on the data-parallel dims (other dims keep their tensor parallel
placements). Per rank (one device per process) each rank computes on its own batch with its
parameters as plain tensors (or DTensors on the tensor-parallel sub-mesh) and its gradient is
a pending average over the data-parallel dims; in the embedded global view the plain batch is
sharded over them and the gradient arrives as a pending sum. Either way gradients are reduced
once per backward, bucketed (``dp_unit``): one all-reduce per bucket, dim and dtype.
"""

from __future__ import annotations

from torch import nn

from ..deferred_init import materialize_if_root
from ..mesh import DeviceMesh
from .data_parallel import (
    MANAGED,
    DataParallelMeshDims,
    aliases,
    compute_placements,
    owned_parameters,
    place_parameter,
    resolve_dims,
    stored_value,
)
from .dp_unit import DataParallelModule, DataParallelUnit, Slot, guard_calls
from .policies import MixedPrecisionPolicy, OffloadPolicy
from .state_dict import guard_loading


def replicate(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    *,
    bucket_cap_mb: float = 25.0,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> nn.Module:
    """Replicate ``module``'s parameters over the data-parallel ``device_mesh`` (1-D, the
    ``mesh["dp"]`` sibling of the tensor-parallel mesh, or with ``dp_mesh_dims`` the full mesh
    the parameters live on; default one dim over every process) and reduce their gradients
    once per backward in buckets of at most ``bucket_cap_mb`` MiB. Returns ``module``, whose
    parameters are now DTensors (build the optimizer afterwards)."""
    dp = resolve_dims(module, device_mesh, dp_mesh_dims, "replicate", replicate_only=True)
    slots: list[Slot] = []
    for owner, name, param in list(owned_parameters(module)):
        if getattr(param, MANAGED, False):
            continue  # an inner replicate() or fully_shard() manages it
        pdp = dp.for_param(param)
        compute = tuple(compute_placements(param, pdp, name, "replicate"))
        new = place_parameter(module, param, stored_value(param, pdp, list(compute)))
        setattr(new, MANAGED, True)
        slots.append(Slot(owner, name, pdp, compute, compute, aliases(module, owner, name)))
    materialize_if_root(module)  # after placing: each device allocates only its piece
    unit = DataParallelUnit(
        dp, slots, reshard_after_forward=False, mp_policy=MixedPrecisionPolicy(),
        offload_policy=OffloadPolicy(), bucket_cap=int(bucket_cap_mb * 2**20),
    )
    guard_loading(module)
    module.register_forward_pre_hook(unit.before_forward, with_kwargs=True)
    module.register_forward_hook(unit.after_forward, with_kwargs=True, always_call=True)
    cls = type(module)
    if not issubclass(cls, DataParallelModule):  # PyTorch's replicate makes it DDP<Class>
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"DDP{cls.__name__}", (DataParallelModule, cls), {})
        module.__class__ = _CLASSES[cls]
    guard_calls(module, unit)
    return module


_CLASSES: dict[type, type] = {}
