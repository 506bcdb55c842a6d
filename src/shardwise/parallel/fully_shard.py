"""``fully_shard``: fully sharded data parallelism (PyTorch's FSDP2) on a shardwise mesh.

Each parameter, and hence the optimizer state built from it, is stored Shard(0) on the
data-parallel mesh dim (other dims keep their tensor parallel placements). Before the module's
forward its parameters are all-gathered over that dim (a differentiable redistribution, so
backward reduce-scatters each gradient back to Shard(0)); after it the module holds the
sharded parameters again. With ``reshard_after_forward`` the gathered parameters are not kept
for backward either: what autograd saves of them is re-gathered when backward needs it.
Applied per submodule, each call manages the parameters not managed by an earlier call.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..deferred_init import is_meta, materialize_if_root, placed_meta
from ..dtensor import DTensor, distribute_tensor
from ..mesh import DeviceMesh
from ..placements import Placement, Shard
from .data_parallel import (
    dp_mesh_dim,
    dp_placements,
    owned_parameters,
    place_parameter,
    shard_inputs,
)
from .state_dict import guard_loading

_MANAGED = "_shardwise_fully_sharded"


def fully_shard(
    module: nn.Module,
    device_mesh: DeviceMesh,
    *,
    reshard_after_forward: bool = True,
    mesh_dim: int | str | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters Shard(0) over the data-parallel dim of ``device_mesh``,
    gather them for its forward (and backward), reduce-scatter their gradients.

    ``device_mesh``: a 1-D mesh, a mesh whose dim ``mesh_dim`` (default 0) is data parallel,
    or the named 1-D sub-mesh of the mesh tensor parallelism put the parameters on. Apply it to
    the inner blocks first, then to the root. Returns ``module`` (build the optimizer after).
    """
    mesh, dp = dp_mesh_dim(module, device_mesh, mesh_dim, "fully_shard")
    slots: list[tuple[nn.Module, str, tuple[Placement, ...]]] = []
    for owner, name, param in list(owned_parameters(module)):
        if getattr(param, _MANAGED, False):
            continue  # an inner fully_shard() manages it
        compute = dp_placements(param, mesh, dp, name, "fully_shard")
        storage = list(compute)
        if param.ndim > 0:
            storage[dp] = Shard(0)
        if isinstance(param, DTensor) and is_meta(param):
            value = placed_meta(param, storage)  # deferred: materialized in its final shards
        elif isinstance(param, DTensor):
            value = param.detach().redistribute(placements=storage)
        else:
            value = distribute_tensor(param.detach(), mesh, storage)
        place_parameter(module, param, value)
        slots.append((owner, name, tuple(compute)))
    shard_inputs(module, mesh, dp)
    for owner, name, _compute in slots:
        setattr(owner._parameters[name], _MANAGED, True)
    materialize_if_root(module)  # after sharding: each device allocates only its shard
    guard_loading(module)
    unit = _Unit(slots, reshard_after_forward)
    module.register_forward_pre_hook(unit.before_forward)
    module.register_forward_hook(unit.after_forward)
    return module


class _Unit:
    """The parameters one ``fully_shard`` call manages (looked up at each forward: a deferred
    module's are replaced when its root materializes), and its forward hooks."""

    def __init__(self, slots: list, reshard_after_forward: bool) -> None:
        self.slots: list[tuple[nn.Module, str, tuple[Placement, ...]]] = slots
        self.reshard = reshard_after_forward
        self.sharded: list[DTensor] = []  # the stored parameters during a forward
        self.saving: Any = None
        self.storages: dict[int, int] = {}  # storage of a gathered piece -> slot index

    def gather(self, k: int) -> DTensor:
        return self.sharded[k].redistribute(placements=self.slots[k][2])

    def before_forward(self, _module: nn.Module, _args: tuple) -> None:
        self.storages.clear()
        self.sharded = [owner._parameters[name] for owner, name, _ in self.slots]
        for k, (owner, name, _compute) in enumerate(self.slots):
            gathered = self.gather(k)
            owner._parameters[name] = gathered  # the forward computes with the full value
            for c in gathered._components:
                self.storages[c.untyped_storage().data_ptr()] = k
        if self.reshard and torch.is_grad_enabled():
            self.saving = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self.saving.__enter__()

    def after_forward(self, _module: nn.Module, _args: tuple, _output: Any) -> None:
        if self.saving is not None:
            self.saving.__exit__(None, None, None)
            self.saving = None
        for (owner, name, _compute), param in zip(self.slots, self.sharded, strict=True):
            owner._parameters[name] = param
        self.storages.clear()

    def _pack(self, tensor: torch.Tensor) -> Any:
        """What autograd saves: a gathered parameter (or a view of it) is replaced by how to
        rebuild it from the shards."""
        if not isinstance(tensor, DTensor) or not tensor._components:
            return tensor
        k = self.storages.get(tensor._components[0].untyped_storage().data_ptr())
        if k is None:
            return tensor
        views = [(c.shape, c.stride(), c.storage_offset()) for c in tensor._components]
        return (k, tensor._spec, views, tensor.requires_grad)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        k, spec, views, _requires_grad = packed
        with torch.no_grad():
            gathered = self.gather(k)
        components = [
            c.as_strided(shape, stride, offset)
            for c, (shape, stride, offset) in zip(gathered._components, views, strict=True)
        ]
        return DTensor(components, spec)

