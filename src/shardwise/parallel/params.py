"""Module parameters as DTensors: placing them, and keeping their gradients in their placements.

A parameter's gradient can arrive in other placements than the parameter's: a pending sum on
the tensor-parallel dim (a replicated norm weight applied to a sequence-sharded input, a
replicated bias after a reduce-scatter), or a shard a backward op chose. A gradient hook moves
it to the parameter's placements, so optimizers update DTensors of matching placements in
explicit mode; pending sums over the other mesh dims (data parallel) are left to data
parallelism to reduce. With implicit redistribution on (PyTorch's semantics) a pending sum stays
pending on every dim, as PyTorch leaves it: the optimizer step that uses it reduces it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .. import settings
from ..dtensor import DTensor
from ..factories import distribute_tensor
from ..mesh import DeviceMesh
from ..placements import Placement, Replicate
from ..tracing import eager_under_dynamo


def distribute_parameter(
    module: nn.Module,
    name: str,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    tp_dim: int | None = None,
    src_data_rank: int | None = 0,
) -> None:
    """Replace ``module.<name>`` (a parameter or buffer) by a DTensor with ``placements``
    (``src_data_rank``: as ``distribute_tensor``'s); with ``tp_dim``, the parameter's gradient
    is brought to its placements (see above)."""
    value = getattr(module, name)
    if value is None:
        return
    requires_grad = value.requires_grad
    if isinstance(value, DTensor):
        if value.device_mesh == mesh and value.placements == tuple(placements):
            return
        value = value.full_tensor()
    dvalue = distribute_tensor(value.detach(), mesh, placements, src_data_rank=src_data_rank)
    if name in module._buffers:
        module._buffers[name] = dvalue
        return
    param = nn.Parameter(dvalue, requires_grad=requires_grad)
    if tp_dim is not None and param.requires_grad:
        param.register_hook(_reduce_on(tp_dim, tuple(dvalue.placements)))
    module.register_parameter(name, param)


def replicate_rest(
    module: nn.Module, mesh: DeviceMesh, tp_dim: int | None = None, src_data_rank: int | None = 0
) -> None:
    """Every parameter and buffer of ``module`` not yet a DTensor becomes a replicated one
    (``tp_dim``: with the gradient hook of ``distribute_parameter``); a tensor held by several
    modules (tied weights) becomes one DTensor held by all of them."""
    placed: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for slots in (sub._parameters, sub._buffers):
            for name, value in list(slots.items()):
                if value is None or isinstance(value, DTensor):
                    continue
                if id(value) in placed:
                    slots[name] = placed[id(value)]
                    continue
                replicated = [Replicate()] * mesh.ndim
                distribute_parameter(sub, name, mesh, replicated, tp_dim, src_data_rank)
                placed[id(value)] = slots[name]


def _reduce_on(tp_dim: int, placements: tuple[Placement, ...]):
    @eager_under_dynamo  # backward runs it eagerly, also after a compiled forward
    def hook(grad: torch.Tensor) -> torch.Tensor:
        if not isinstance(grad, DTensor):
            return grad
        keep = settings.IMPLICIT_REDISTRIBUTE.get()  # PyTorch's: reduced where it is used
        target = [
            g if g.is_partial() and (keep or m != tp_dim) else p
            for m, (g, p) in enumerate(zip(grad.placements, placements, strict=True))
        ]
        return grad.redistribute(placements=target)

    return hook
