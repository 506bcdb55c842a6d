"""``replicate``: data parallelism with replicated parameters (PyTorch's composable DDP).

Every parameter is Replicate on the data-parallel mesh dim (other dims keep their tensor
parallel placements); plain inputs are the global batch, sharded over that dim. A parameter's
gradient then arrives Partial on the dp dim (each device summed its part of the batch). The
gradients are reduced once per backward, bucketed: when every parameter of a bucket has its
gradient, one all-reduce per bucket and device group sums their flattened pieces, and each
gradient becomes Replicate on the dp dim. Buckets are filled in reverse parameter order
(roughly the order backward produces gradients); those left at the end of backward (parameters
without a gradient in this step) are reduced then.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .. import comm
from ..deferred_init import materialize_if_root
from ..dtensor import DTensor, distribute_tensor
from ..mesh import DeviceMesh
from ..placements import Partial, Replicate
from .data_parallel import (
    dp_mesh_dim,
    dp_placements,
    owned_parameters,
    place_parameter,
    shard_inputs,
)
from .state_dict import guard_loading

_MANAGED = "_shardwise_replicated"


def replicate(
    module: nn.Module,
    device_mesh: DeviceMesh,
    *,
    mesh_dim: int | str | None = None,
    bucket_cap_mb: float = 25.0,
) -> nn.Module:
    """Replicate ``module``'s parameters over the data-parallel dim of ``device_mesh`` and
    reduce their gradients once per backward in buckets of at most ``bucket_cap_mb`` MiB.

    ``device_mesh``: a 1-D mesh, a mesh whose dim ``mesh_dim`` (default 0) is data parallel,
    or the named 1-D sub-mesh of the mesh tensor parallelism put the parameters on. Returns
    ``module``, whose parameters are now DTensors (build the optimizer afterwards).
    """
    mesh, dp = dp_mesh_dim(module, device_mesh, mesh_dim, "replicate")
    slots: list[tuple[nn.Module, str]] = []
    for owner, name, param in list(owned_parameters(module)):
        if getattr(param, _MANAGED, False):
            continue  # an inner replicate() reduces it already
        placements = dp_placements(param, mesh, dp, name, "replicate")
        if not isinstance(param, DTensor):
            place_parameter(module, param, distribute_tensor(param.detach(), mesh, placements))
        slots.append((owner, name))
    shard_inputs(module, mesh, dp)
    params = [owner._parameters[name] for owner, name in slots]
    for p in params:
        setattr(p, _MANAGED, True)
    _GradReducer(mesh, dp, [p for p in params if p.requires_grad], int(bucket_cap_mb * 2**20))
    materialize_if_root(module)  # after sharding: each device allocates only its piece
    guard_loading(module)
    return module


class _GradReducer:
    """Reduces the gradients of ``params`` over mesh dim ``dp``, bucket by bucket."""

    def __init__(self, mesh: DeviceMesh, dp: int, params: list[torch.Tensor], cap: int) -> None:
        self.mesh, self.dp = mesh, dp
        self.buckets: list[list[torch.Tensor]] = []
        size = cap
        for p in reversed(params):
            nbytes = p._components[0].numel() * p.element_size()  # one device's piece
            if size + nbytes > cap and (not self.buckets or self.buckets[-1]):
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += nbytes
        self.ready: list[list[torch.Tensor]] = [[] for _ in self.buckets]
        self.pending = False
        for b, bucket in enumerate(self.buckets):
            for p in bucket:  # (a deferred module's real parameter inherits the hook)
                p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, b))

    def _on_grad(self, b: int, param: torch.Tensor) -> None:
        if not self.pending:
            self.pending = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        self.ready[b].append(param)
        if len(self.ready[b]) == len(self.buckets[b]):
            self._flush(b)

    def _finish(self) -> None:
        for b in range(len(self.buckets)):
            if self.ready[b]:
                self._flush(b)
        self.pending = False

    def _flush(self, b: int) -> None:
        params, self.ready[b] = self.ready[b], []
        groups: dict[tuple, list[torch.Tensor]] = {}
        for p in params:
            grad = p.grad
            if isinstance(grad, DTensor) and isinstance(grad.placements[self.dp], Partial):
                key = (grad.placements[self.dp].reduce_op, grad.dtype)
                groups.setdefault(key, []).append(p)
        for (op, _dtype), members in groups.items():
            self._all_reduce(members, op)
        for p in params:
            grad = p.grad
            if isinstance(grad, DTensor) and grad.placements != p.placements:
                target = [Replicate() if q.is_partial() else q for q in p.placements]
                p.grad = grad.redistribute(placements=target)

    def _all_reduce(self, params: list[torch.Tensor], op: str) -> None:
        """One all-reduce over the dp dim of the flattened gradients of ``params``."""
        grads: list[DTensor] = [p.grad for p in params]
        n_local = len(self.mesh.local_device_ids)
        flats = [torch.cat([g._components[i].reshape(-1) for g in grads]) for i in range(n_local)]
        with comm.moving(lambda: f"replicate's gradient bucket of {len(grads)} tensors"):
            reduced = comm.all_reduce(self.mesh, self.dp, flats, op)
        for k, (p, g) in enumerate(zip(params, grads, strict=True)):
            pieces = []
            for i in range(n_local):
                offset = sum(grads[j]._components[i].numel() for j in range(k))
                local = g._components[i]
                pieces.append(reduced[i][offset : offset + local.numel()].view_as(local))
            placements = list(g.placements)
            placements[self.dp] = Replicate()
            p.grad = DTensor(pieces, g._spec.with_placements(placements))
