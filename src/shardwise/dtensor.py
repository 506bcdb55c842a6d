"""The ``DTensor`` class and the ways in and out of it (PyTorch DTensor's API, plus TF's pack).

A DTensor is a ``torch.Tensor`` wrapper subclass: its shape, stride and dtype are the global
ones, and it holds one local component per device this process owns, in ascending device id.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import comm
from .errors import InvalidArgumentError, InvalidPlacementError, LocalComponentsError, PackError
from .mesh import DeviceMesh
from .placements import Partial, Placement, Replicate, Shard
from .redistribute import execute_plan, plan_redistribute
from .spec import (
    DTensorSpec,
    TensorMeta,
    check_same_mesh,
    contiguous_meta,
    extract_local,
    make_tensor_meta,
    validate_placements,
)

DispatchHandler = Callable[[Any, tuple, dict], Any]
_dispatch_handler: list[DispatchHandler] = []


def set_dispatch_handler(handler: DispatchHandler) -> None:
    """Install the ``__torch_dispatch__`` implementation (the ``dispatch`` layer does this)."""
    _dispatch_handler[:] = [handler]


class DTensor(torch.Tensor):
    """A tensor distributed over a ``DeviceMesh`` by one ``Placement`` per mesh dim."""

    _spec: DTensorSpec
    _components: list[torch.Tensor]

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(
        cls, components: Sequence[torch.Tensor], spec: DTensorSpec, *, requires_grad: bool = False
    ) -> DTensor:
        meta = spec.tensor_meta
        first = components[0] if components else None
        device = first.device if first is not None else spec.mesh.device_of(0)
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            meta.shape,
            strides=meta.stride,
            dtype=meta.dtype,
            device=device,
            requires_grad=requires_grad,
        )
        out._spec = spec
        out._components = list(components)
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        if not _dispatch_handler:
            from .errors import UnsupportedOpError

            raise UnsupportedOpError(f"{func} on a DTensor: import shardwise to enable ops")
        return _dispatch_handler[0](func, args, kwargs or {})

    # ----- metadata ------------------------------------------------------------------------
    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._spec.placements

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # noqa: ARG002
        return (
            f"DTensor(shape={list(self.shape)}, dtype={self.dtype}, "
            f"placements={list(self.placements)}, mesh={self.device_mesh})"
        )

    # ----- conversions ---------------------------------------------------------------------
    @staticmethod
    def from_local(
        local: torch.Tensor | Sequence[torch.Tensor],
        device_mesh: DeviceMesh,
        placements: Sequence[Placement],
        *,
        shape: Sequence[int] | None = None,
        stride: Sequence[int] | None = None,
        run_check: bool = False,
    ) -> DTensor:
        """A DTensor from this process's components (a tensor, or one per local device).

        Components must follow chunk geometry; the global shape is inferred from them unless
        ``shape`` is given. ``run_check`` broadcasts Replicate components from coordinate 0.
        """
        components = _as_components(local, device_mesh, placements)
        spec = _spec_from_components(components, device_mesh, placements, shape, stride)
        if run_check:
            components = _broadcast_replicated(spec, components)
        return _FromLocal.apply(spec, *components)

    def to_local(self) -> torch.Tensor:
        """This process's component; when it owns several devices, use ``unpack``."""
        if len(self._components) != 1:
            raise LocalComponentsError(
                f"to_local() of a DTensor of shape {list(self.shape)} with placements "
                f"{list(self.placements)} needs a process that owns one device, but this one owns "
                f"{len(self._components)} devices {list(self.device_mesh.local_device_ids)} of "
                f"{self.device_mesh}; use shardwise.unpack(dt) for all its components"
            )
        return unpack(self)[0]

    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
    ) -> DTensor:
        """The same global value with new ``placements`` (cheapest plan, differentiable)."""
        if device_mesh is not None:
            check_same_mesh(
                self.device_mesh,
                device_mesh,
                f"redistribute of a DTensor of shape {list(self.shape)} with placements "
                f"{list(self.placements)}",
            )
        if placements is None:
            raise InvalidPlacementError(
                f"redistribute of a DTensor of shape {list(self.shape)} with placements "
                f"{list(self.placements)} needs target placements"
            )
        target = validate_placements(self.shape, self.device_mesh, placements)
        if target == self.placements:
            return self
        return _Redistribute.apply(self, target)

    def tolist(self) -> Any:
        """The global value as (nested) Python lists, never one device's piece."""
        return self.full_tensor().tolist()

    def numpy(self, *, force: bool = False) -> Any:
        """The global value as a NumPy array, never one device's piece."""
        return self.full_tensor().detach().numpy(force=force)

    def full_tensor(self) -> torch.Tensor:
        """The global value as a plain tensor (differentiable)."""
        replicated = self.redistribute(placements=[Replicate()] * self.device_mesh.ndim)
        return _FirstComponent.apply(replicated)


# ----- construction helpers ------------------------------------------------------------------


def _as_components(
    local: torch.Tensor | Sequence[torch.Tensor],
    mesh: DeviceMesh,
    placements: Sequence[Placement],
) -> list[torch.Tensor]:
    n_local = len(mesh.local_device_ids)
    if isinstance(local, DTensor):
        raise PackError(f"from_local/pack got a DTensor {local}; pass its local components")
    if isinstance(local, torch.Tensor):
        if n_local == 1 or all(p.is_replicate() for p in placements):
            return [local] + [local.clone() for _ in range(n_local - 1)]
        raise PackError(
            f"this process owns {n_local} devices of {mesh}; pass a list of {n_local} "
            f"components (one per device, ascending id) for placements {list(placements)}"
        )
    components = list(local)
    if len(components) != n_local:
        raise PackError(
            f"expected {n_local} components (one per local device "
            f"{list(mesh.local_device_ids)} of {mesh}) for placements {list(placements)} but got "
            f"{len(components)}"
        )
    for c in components:
        if isinstance(c, DTensor) or not isinstance(c, torch.Tensor):
            raise PackError(
                f"components must be plain tensors, got {type(c).__name__} "
                f"(placements {list(placements)}, {mesh})"
            )
    dtypes = {c.dtype for c in components}
    if len(dtypes) > 1:
        raise PackError(f"components have different dtypes {sorted(map(str, dtypes))}")
    ranks = {c.ndim for c in components}
    if len(ranks) > 1:
        raise PackError(f"components have different ranks: {[list(c.shape) for c in components]}")
    seen: set[int] = set()
    placed = []
    for c, d in zip(components, mesh.local_device_ids, strict=True):
        c = c.to(mesh.device_of(d))
        placed.append(c.clone() if id(c) in seen else c)  # one tensor given twice: no aliasing
        seen.add(id(c))
    return placed


def _infer_global_shape(
    components: list[torch.Tensor], mesh: DeviceMesh, placements: tuple[Placement, ...]
) -> list[int]:
    """Sum the sizes along each sharded dim over the devices that split it; when some of them
    belong to other processes, assume even shards (PyTorch's rule)."""
    local_ids = mesh.local_device_ids
    index = {d: i for i, d in enumerate(local_ids)}
    base = mesh.coordinate_of(local_ids[0])
    shape = list(components[0].shape)
    for dim in range(len(shape)):
        mesh_dims = [m for m, p in enumerate(placements) if isinstance(p, Shard) and p.dim == dim]
        if not mesh_dims:
            continue
        members = [
            d for d in mesh.mesh.flatten().tolist() if _differs_only(mesh, d, base, mesh_dims)
        ]
        if all(d in index for d in members):
            shape[dim] = sum(components[index[d]].shape[dim] for d in members)
        else:
            factor = 1
            for m in mesh_dims:
                factor *= mesh.shape[m]
            shape[dim] = components[0].shape[dim] * factor
    return shape


def _differs_only(mesh: DeviceMesh, device: int, base: tuple[int, ...], dims: list[int]) -> bool:
    coord = mesh.coordinate_of(device)
    return all(c == b for m, (c, b) in enumerate(zip(coord, base, strict=True)) if m not in dims)


def _spec_from_components(
    components: list[torch.Tensor],
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    shape: Sequence[int] | None,
    stride: Sequence[int] | None,
) -> DTensorSpec:
    ndim = components[0].ndim
    local_shapes = f"local component shapes {[list(c.shape) for c in components]}"
    normalized = validate_placements([0] * ndim, mesh, placements, described=local_shapes)
    if shape is None:
        shape = _infer_global_shape(components, mesh, normalized)
    elif len(shape) != ndim:
        raise PackError(f"shape {list(shape)} has rank {len(shape)} but components have {ndim}")
    normalized = validate_placements(shape, mesh, normalized)
    meta = contiguous_meta(shape, components[0].dtype)
    if stride is not None:
        meta = TensorMeta(meta.shape, tuple(stride), meta.dtype)
    spec = DTensorSpec(mesh, normalized, meta)
    for c, d in zip(components, mesh.local_device_ids, strict=True):
        if c.shape != spec.local_shape(d):
            raise PackError(
                f"component of device {d} has shape {list(c.shape)} but a tensor of global shape "
                f"{list(shape)} with placements {list(normalized)} on {mesh} puts "
                f"{list(spec.local_shape(d))} there (components: "
                f"{[list(x.shape) for x in components]})"
            )
    return spec


def _broadcast_replicated(spec: DTensorSpec, components: list[torch.Tensor]) -> list[torch.Tensor]:
    with comm.moving(lambda: f"from_local(run_check=True) of {spec}"):
        for m, p in enumerate(spec.placements):
            if p.is_replicate():
                components = comm.broadcast(spec.mesh, m, components)
    return components


def distribute_tensor(
    tensor: torch.Tensor, device_mesh: DeviceMesh, placements: Sequence[Placement] | None = None
) -> DTensor:
    """Place a global ``tensor`` on ``device_mesh``: each device keeps its piece (a leaf DTensor
    with the tensor's ``requires_grad``, as in PyTorch)."""
    if isinstance(tensor, DTensor):
        raise InvalidPlacementError(
            f"distribute_tensor got a DTensor {tensor}; use its redistribute() instead"
        )
    placements = placements if placements is not None else [Replicate()] * device_mesh.ndim
    if tensor.layout != torch.strided:
        raise InvalidArgumentError(
            f"distribute_tensor got a {tensor.layout} tensor of shape {list(tensor.shape)}; "
            f"only dense (strided) tensors can be placed on {device_mesh} with {list(placements)}"
            f": call .to_dense() first"
        )
    normalized = validate_placements(tensor.shape, device_mesh, placements)
    spec = DTensorSpec(device_mesh, normalized, make_tensor_meta(tensor))
    data = tensor.detach()
    components = [
        _component_of(data, spec, device).to(device_mesh.device_of(device))
        for device in device_mesh.local_device_ids
    ]
    return DTensor(components, spec, requires_grad=tensor.requires_grad)


def _component_of(tensor: torch.Tensor, spec: DTensorSpec, device: int) -> torch.Tensor:
    """Device ``device``'s piece of the global ``tensor``: its slice; for Partial("sum") dims
    the first device of the mesh dim keeps the value and the others hold zeros."""
    piece = extract_local(tensor, spec.local_segments(device))
    coord = spec.mesh.coordinate_of(device)
    for m, p in enumerate(spec.placements):
        if isinstance(p, Partial) and p.reduce_op == "sum" and coord[m] != 0:
            return torch.zeros_like(piece)
    return piece.clone(memory_format=torch.contiguous_format)


def unpack(dtensor: DTensor) -> list[torch.Tensor]:
    """This process's components of ``dtensor``, in ascending device id (differentiable)."""
    if not isinstance(dtensor, DTensor):
        from .errors import InvalidArgumentError

        raise InvalidArgumentError(
            f"unpack expects a DTensor, got {type(dtensor).__name__}"
            + (f" of shape {list(dtensor.shape)}" if isinstance(dtensor, torch.Tensor) else "")
        )
    return list(_Unpack.apply(dtensor))


# ----- autograd functions --------------------------------------------------------------------


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec: DTensorSpec, *components: torch.Tensor) -> DTensor:  # noqa: ANN001
        ctx.spec = spec
        return DTensor([c.view_as(c) for c in components], spec)

    @staticmethod
    def backward(ctx, grad: DTensor):  # noqa: ANN001
        return (None, *_grad_components(grad, ctx.spec))


def _grad_components(grad: DTensor, spec: DTensorSpec) -> list[torch.Tensor]:
    """Component gradients of a DTensor built with ``spec`` (PyTorch's rule: a gradient with
    the same placements passes through; otherwise it is redistributed to them, with Partial
    dims taken as Replicate, and Partial("avg") dims scaled by 1/n)."""
    if grad.placements == spec.placements:
        return list(grad._components)
    target = [Replicate() if p.is_partial() else p for p in spec.placements]
    components = list(grad.redistribute(placements=target)._components)
    scale = 1
    for m, p in enumerate(spec.placements):
        if isinstance(p, Partial) and p.reduce_op == "avg":
            scale *= spec.mesh.shape[m]
    return components if scale == 1 else [c / scale for c in components]


class _Unpack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dtensor: DTensor):  # noqa: ANN001
        ctx.spec = dtensor._spec
        return tuple(c.view_as(c) for c in dtensor._components)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):  # noqa: ANN001
        spec = ctx.spec
        components = [
            g if g is not None else torch.zeros(spec.local_shape(d), dtype=spec.tensor_meta.dtype)
            for g, d in zip(grads, spec.mesh.local_device_ids, strict=True)
        ]
        return DTensor(components, spec)


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dtensor: DTensor, target: tuple[Placement, ...]) -> DTensor:  # noqa: ANN001
        spec = dtensor._spec
        ctx.source = spec.placements
        plan = plan_redistribute(spec, target)
        with comm.moving(lambda: f"redistribute of {spec} to {list(target)}"):
            components = execute_plan(plan, spec.mesh, dtensor._components)
        return DTensor(components, spec.with_placements(target))

    @staticmethod
    def backward(ctx, grad: DTensor):  # noqa: ANN001
        target = [Replicate() if p.is_partial() else p for p in ctx.source]
        return grad.redistribute(placements=target), None


class _FirstComponent(torch.autograd.Function):
    """A replicated DTensor's value as a plain tensor; the gradient is replicated back."""

    @staticmethod
    def forward(ctx, dtensor: DTensor) -> torch.Tensor:  # noqa: ANN001
        ctx.spec = dtensor._spec
        return dtensor._components[0].view_as(dtensor._components[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001
        spec = ctx.spec
        components = [
            grad.to(spec.mesh.device_of(d)) if i == 0 else grad.to(spec.mesh.device_of(d)).clone()
            for i, d in enumerate(spec.mesh.local_device_ids)
        ]
        return DTensor(components, spec)
