"""The ``DTensor`` class and the ways in and out of it (PyTorch DTensor's API, plus TF's pack).

A DTensor is a ``torch.Tensor`` wrapper subclass: its shape, stride and dtype are the global
ones, and it holds one local component per device this process owns, in ascending device id.
The layers above read and replace what it holds through ``Local`` (``local_of``, ``set_local``,
``build``), never through its fields; every DTensor, dispatch's outputs included, is made by
``components.new_wrapper``.

Pending results of background collectives (``redistribute(..., async_op=True)``,
``DTensor.from_local(..., async_op=True)``) are ``AsyncDTensor``s: global metadata is known at
once, the components are computed by the background worker (``comm.background``), or, where
every collective is the backend's own, issued at once and left unwaited, and the first use of
them (any op, ``unpack``, ``full_tensor``...) waits, as ``wait()`` does. ``to_local()``
of a pending DTensor returns an ``AsyncCollectiveTensor``, a tensor that waits on first use, as
PyTorch's does. Results are those of the blocking path, bit for bit: the worker runs the same
plan on the same components.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import execution
from .components import Local as Local  # the DTensor's pieces, for the layers above
from .components import (
    as_components,
    check_partials,
    grad_placements_spec,
    new_wrapper,
    outside_spec,
    spec_from_components,
    with_dtype,
)
from .components import local_of as local_of
from .components import set_local as set_local
from .errors import (
    CollectiveMismatchError,
    InvalidArgumentError,
    InvalidPlacementError,
    LocalComponentsError,
    PackError,
)
from .mesh import DeviceMesh
from .mesh_argument import mesh_or_current
from .pending import PendingComponents, ready
from .placements import InterleavedShard, Partial, Placement, RaggedShard, Replicate, Shard
from .redistribute import cross_mesh, move, plan_redistribute
from .spec import (
    LOW_PRECISION,
    DTensorSpec,
    TensorMeta,
    validate_placements,
)
from .tf_mesh import Mesh
from .torch_compat import (
    disabled_torch_function_impl,
    foreach_supported_types,
)
from .tracing import dynamo_opaque, eager_under_dynamo

DispatchHandler = Callable[..., Any]  # (cls, func, types, args=(), kwargs=None)


def set_dispatch_handler(handler: DispatchHandler) -> None:
    """Install the ``__torch_dispatch__`` implementation (the ``dispatch`` layer does this):
    the handler becomes the classmethod itself, so an op pays no extra Python frame."""
    DTensor.__torch_dispatch__ = classmethod(eager_under_dynamo(handler))


class DTensor(torch.Tensor):
    """A tensor distributed over a ``DeviceMesh`` by one ``Placement`` per mesh dim."""

    _spec: DTensorSpec
    _components: list[torch.Tensor]

    __torch_function__ = disabled_torch_function_impl

    @staticmethod
    @eager_under_dynamo
    def __new__(
        cls,
        components: torch.Tensor | Sequence[torch.Tensor],
        spec: DTensorSpec,
        *,
        requires_grad: bool = False,
    ) -> DTensor:
        if isinstance(components, torch.Tensor):  # PyTorch's private DTensor(local, spec, ...)
            if components.requires_grad and not requires_grad:
                warnings.warn(
                    "To construct DTensor from torch.Tensor, it's recommended to use "
                    "local_tensor.detach() and make requires_grad consistent.",
                    UserWarning,
                    stacklevel=2,
                )
            components = [components]
        meta = spec.tensor_meta
        check_partials(spec)
        first = components[0] if components else None
        if meta.dtype in LOW_PRECISION and first is not None:
            held = spec.component_dtype  # float32 while a half-precision sum is pending
            if first.dtype != held and first.dtype.is_floating_point:
                components = [c.to(held) for c in components]
        device = first.device if first is not None else spec.mesh.device_of(0)
        out = new_wrapper(cls, spec, device, requires_grad, components)
        out._components = list(components)
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # replaced by ``set_dispatch_handler`` when the dispatch layer is imported (the first
        # name taken from the package imports it; importing only submodules may not)
        from .errors import UnsupportedOpError

        raise UnsupportedOpError(
            f"{func} on a DTensor: the op layer is not loaded; import shardwise.dispatch (any "
            f"name taken from the shardwise package loads it)"
        )

    # ----- tracing (torch.compile sees a DTensor as its components plus a constant spec) -----
    @eager_under_dynamo  # AOT autograd's runtime calls these for real, also in a backward
    def __tensor_flatten__(self) -> tuple[list[str], DTensorSpec]:
        return [f"_component_{i}" for i in range(len(self._components))], self._spec

    def __getattr__(self, name: str) -> Any:  # only reached for attributes not found
        if name.startswith("_component_"):
            return self._components[int(name[len("_component_") :])]
        raise AttributeError(f"'DTensor' object has no attribute {name!r}")

    @staticmethod
    @eager_under_dynamo
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], spec: DTensorSpec, outer_size: Any, outer_stride: Any
    ) -> DTensor:
        components = [inner[f"_component_{i}"] for i in range(len(inner))]
        return DTensor(components, spec, requires_grad=components[0].requires_grad)

    # ----- metadata ------------------------------------------------------------------------
    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._spec.placements

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return (
            f"DTensor(shape={list(self.shape)}, dtype={self.dtype}, "
            f"placements={list(self.placements)}, mesh={self.device_mesh})"
        )

    # ----- conversions ---------------------------------------------------------------------
    @staticmethod
    @dynamo_opaque
    def from_local(
        local_tensor: torch.Tensor | Sequence[torch.Tensor],
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        shape: Sequence[int] | None = None,
        stride: Sequence[int] | None = None,
        run_check: bool = False,
        grad_placements: Sequence[Placement] | None = None,
        async_op: bool = False,
    ) -> DTensor:
        """A DTensor from this process's components (a tensor, or one per local device).

        Components must follow chunk geometry; the global shape is inferred from them unless
        ``shape`` is given. ``run_check`` checks, as PyTorch, that every process gives the same
        dtype and ``requires_grad`` (and, without ``shape``/``stride``, shape and stride:
        ``PackError`` otherwise) and broadcasts Replicate components from coordinate 0.
        ``grad_placements`` (PyTorch's): the placements the gradient is brought to before
        its components become the local tensors' gradients (default: ``placements``, Partial
        dims reduced). ``async_op``: return at once; pending components and the broadcast
        finish in the background (see ``AsyncDTensor``). As in PyTorch, the mesh defaults to
        the current one (``with mesh:``) and the placements to Replicate on every mesh dim.
        """
        device_mesh = mesh_or_current(device_mesh, "DTensor.from_local")
        if placements is None:
            placements = [Replicate()] * device_mesh.ndim
        replica = execution.replica()
        if (
            replica is not None
            and replica.count > 1
            and isinstance(local_tensor, torch.Tensor)
            and len(device_mesh.local_device_ids) == replica.count
        ):  # per-replica view: this thread's piece; one DTensor built from every replica's
            return replica.merge(
                local_tensor,
                lambda pieces: DTensor.from_local(
                    pieces, device_mesh, placements, shape=shape, stride=stride,
                    run_check=run_check, grad_placements=grad_placements,
                ),
            )
        if not device_mesh.local_device_ids:
            spec = outside_spec(local_tensor, device_mesh, placements, shape)
            return DTensor([], spec, requires_grad=local_tensor.requires_grad)
        if async_op:
            if grad_placements is not None:
                raise InvalidArgumentError(
                    f"DTensor.from_local(async_op=True, grad_placements={list(grad_placements)})"
                    f" on {device_mesh}: grad_placements is not supported with async_op; build "
                    f"it synchronously, or call .redistribute on the gradient yourself"
                )
            return from_local_async(local_tensor, device_mesh, placements, shape, stride, run_check)
        components = as_components(local_tensor, device_mesh, placements, DTensor)
        spec = spec_from_components(components, device_mesh, placements, shape, stride)
        if run_check:
            _check_same_metadata(components, device_mesh, shape is None and stride is None)
            components = move.broadcast_replicated(spec, components)
        grad_spec = None if grad_placements is None else grad_placements_spec(
            spec, grad_placements, "DTensor.from_local"
        )
        return _FromLocal.apply(spec, grad_spec, *components)

    @dynamo_opaque
    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This process's component; when it owns several devices, use ``local_components`` (inside
        ``Strategy.run``, the component of the replica this thread acts for).

        ``grad_placements`` says how the gradient of the local tensor is to be read (PyTorch's
        keyword), e.g. ``[Partial()]`` when each device's gradient is a partial sum; by default
        it has this DTensor's placements. On a process that owns no device of the mesh it is an
        empty tensor (shape ``(0,)``), as PyTorch gives a rank outside the mesh.
        """
        if not self._components:
            return _empty_piece(self)
        index = self._local_index("to_local()")
        if grad_placements is None:
            held = self._components[index]
            if not torch.is_grad_enabled() and held.dtype == self.dtype:
                return held  # as PyTorch: under no_grad the local tensor itself
            return local_components(self)[index]
        grad_spec = grad_placements_spec(self._spec, grad_placements, "to_local")
        return _Unpack.apply(self, grad_spec)[index]

    def _local_index(self, what: str) -> int:
        """Which component is this process's (or this replica thread's)."""
        replica = execution.replica()
        if replica is not None and replica.count == len(self._components):
            return replica.index
        if len(self._components) != 1:
            raise LocalComponentsError(
                f"{what} of a DTensor of shape {list(self.shape)} with placements "
                f"{list(self.placements)} needs a program acting for one device, but "
                f"{execution.of(self.device_mesh).describe()}; use "
                f"shardwise.local_components(dt) for all its components"
            )
        return 0

    @property
    def _local_tensor(self) -> torch.Tensor:
        """PyTorch's ``DTensor._local_tensor``: this process's component itself (no autograd
        edge to the DTensor), for libraries that read or write it in place."""
        if not self._components:
            return _empty_piece(self)
        return self._components[self._local_index("_local_tensor")]

    @dynamo_opaque
    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        forward_dtype: torch.dtype | None = None,
        backward_dtype: torch.dtype | None = None,
        async_op: bool = False,
    ) -> DTensor:
        """The same global value with new ``placements`` (cheapest plan, differentiable). A
        Shard goes to a Partial("sum") or p-norm target by a spread: its piece in place, zeros
        around it, nothing moved (an op's input moves never spread).

        ``forward_dtype`` casts the components before the collectives (the result has that
        dtype); ``backward_dtype`` runs the backward collectives in that dtype, the gradient
        coming back in this DTensor's dtype (PyTorch's keywords, for low-precision traffic).
        ``async_op``: return at once, the collectives run in the background; the first use
        of the result (or ``wait()``) waits for them. Another ``device_mesh`` moves the value
        there (``reshard``).
        """
        if placements is None:
            raise InvalidPlacementError(
                f"redistribute of a DTensor of shape {list(self.shape)} with placements "
                f"{list(self.placements)} needs target placements"
            )
        if device_mesh is not None and device_mesh != self.device_mesh:
            if forward_dtype is not None or backward_dtype is not None or async_op:
                raise InvalidArgumentError(
                    f"redistribute of a DTensor of shape {list(self.shape)} from "
                    f"{self.device_mesh} with placements {list(self.placements)} to "
                    f"{device_mesh} with placements {placements}: forward_dtype, "
                    f"backward_dtype and async_op are for moves within one mesh; cast first"
                )
            return reshard(self, device_mesh, placements)
        target = validate_placements(self.shape, self.device_mesh, placements)
        if not self._components:  # a process outside the mesh takes no part (PyTorch's rule)
            spec = self._spec.with_placements(target)
            return DTensor([], spec, requires_grad=self.requires_grad)
        if forward_dtype is not None or backward_dtype is not None:
            return _Redistribute.apply(self, target, forward_dtype, backward_dtype)
        if target == self.placements and not (self.requires_grad and torch.is_grad_enabled()):
            return self  # else, as PyTorch's, a step of its own (its backward may reduce)
        check_partials(self._spec.with_placements(target))
        if async_op:
            return redistribute_async(self, target)
        return _Redistribute.apply(self, target)

    def wait(self) -> DTensor:
        """This DTensor once its background collectives finished (at once when none run)."""
        return self

    def __reduce_ex__(self, protocol: Any) -> tuple:
        # torch.save recognises wrapper subclasses by data_ptr() == 0, which a DTensor with one
        # local device does not return (third-party kernels need its pointer): pickle the
        # instance state (components, spec) and rebuild from it
        return _rebuild_dtensor, (type(self), dict(self.__dict__), self.requires_grad)

    def __deepcopy__(self, memo: dict[int, Any]) -> DTensor:
        """An independent copy: every local component copied, the same spec (and mesh, which is
        shared, never copied), ``requires_grad``, ``grad`` and attributes such as a parameter's
        flag. Works however many devices this process owns (torch's default reads ``data_ptr``)."""
        if id(self) in memo:
            return memo[id(self)]
        if not self.is_leaf:
            raise RuntimeError(
                f"deepcopy of a DTensor of shape {list(self.shape)} that is not a graph leaf: "
                f"as for torch.Tensor, only leaves (e.g. parameters, detached tensors) can be "
                f"deep-copied; detach() it first"
            )
        with torch.no_grad():
            components = [c.detach().clone() for c in self._components]
        out = DTensor(components, self._spec, requires_grad=self.requires_grad)
        memo[id(self)] = out
        if self.grad is not None:
            out.grad = copy.deepcopy(self.grad, memo)
        for key, value in self.__dict__.items():
            if key not in ("_spec", "_components", "_ready", "_work"):
                out.__dict__[key] = copy.deepcopy(value, memo)
        return out

    def data_ptr(self) -> int:
        """The local component's data pointer (for third-party kernels); with several local
        devices there is no single pointer: use ``local_components`` or ``local_map``."""
        if len(self._components) != 1:
            raise LocalComponentsError(
                f"data_ptr() of a DTensor of shape {list(self.shape)} with placements "
                f"{list(self.placements)}: this process owns {len(self._components)} devices "
                f"{list(self.device_mesh.local_device_ids)} of {self.device_mesh}, one pointer "
                f"each; use shardwise.local_components(dt) or shardwise.local_map(fn, ...) instead"
            )
        return self._components[0].data_ptr()

    # torch.distributed.checkpoint's protocol for distributed tensors (dcp_protocol.py)
    def __create_write_items__(self, fqn: str, obj: Any) -> list:
        from .dcp_protocol import create_write_items

        return create_write_items(fqn, self)

    def __create_chunk_list__(self) -> list:
        from .dcp_protocol import create_chunk_list

        return create_chunk_list(self)

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        from .dcp_protocol import get_tensor_shard

        return get_tensor_shard(self, index)

    def tolist(self) -> Any:
        """The global value as (nested) Python lists, never one device's piece."""
        return self.full_tensor().tolist()

    def numpy(self, *, force: bool = False) -> Any:
        """The global value as a NumPy array, never one device's piece."""
        return self.full_tensor().detach().numpy(force=force)

    @dynamo_opaque
    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """The global value as a plain tensor (differentiable).

        ``grad_placements`` (Replicate or Partial per mesh dim) says how the gradient of the
        result is to be read: ``[Partial()]`` when each device computes a partial gradient.
        On a process that owns no device of the mesh it is an empty tensor, as in PyTorch.
        """
        if not self._components:
            return _empty_piece(self)
        replicated = self.redistribute(placements=[Replicate()] * self.device_mesh.ndim)
        if grad_placements is None:
            return _FirstComponent.apply(replicated)
        grad_spec = grad_placements_spec(replicated._spec, grad_placements, "full_tensor")
        return _FirstComponent.apply(replicated, grad_spec)


# ----- construction helpers ------------------------------------------------------------------


def _empty_piece(dtensor: DTensor) -> torch.Tensor:
    """What a process outside the mesh holds of ``dtensor`` (PyTorch's default: an empty local
    tensor, a zero for a 0-d DTensor)."""
    shape = () if dtensor.ndim == 0 else (0,)
    return torch.zeros(
        shape, dtype=dtensor.dtype, device=dtensor.device, requires_grad=dtensor.requires_grad
    )


def _check_same_metadata(
    components: Sequence[torch.Tensor], mesh: DeviceMesh, with_shape: bool
) -> None:
    """``from_local(run_check=True)``, as PyTorch's: every process's local tensor has the same
    dtype and ``requires_grad`` (and, without ``shape``/``stride``, the same shape and
    stride), else ``PackError`` (a ``ValueError``) on every process."""
    first = components[0]
    fields: dict[str, Any] = {"dtype": str(first.dtype), "requires_grad": first.requires_grad}
    if with_shape:
        fields.update(shape=list(first.shape), stride=list(first.stride()))
    what = f"from_local(run_check=True) on {mesh}"
    try:
        move.agree(lambda: what, mesh, "from_local", fields, first)
    except CollectiveMismatchError as err:
        raise PackError(
            f"{what}: the processes' local tensors differ in dtype, requires_grad"
            + (", shape or stride" if with_shape else "") + f" (this one: {fields}): {err}"
        ) from err


def local_components(dtensor: DTensor) -> list[torch.Tensor]:
    """This process's raw components of ``dtensor``, one per local device in ascending id,
    exactly as held (a ``Partial`` dim's pieces unreduced), differentiable. TF's ``unpack``
    is the reduced view of the same."""
    if not isinstance(dtensor, DTensor):
        raise InvalidArgumentError(
            f"local_components expects a DTensor, got {type(dtensor).__name__}"
            + (f" of shape {list(dtensor.shape)}" if isinstance(dtensor, torch.Tensor) else "")
        )
    return list(_Unpack.apply(dtensor))


# ----- what this program holds of a DTensor, for the layers above ----------------------------


def build(local: Local, *, requires_grad: bool = False) -> DTensor:
    """A DTensor holding ``local`` (checked as ``DTensor()`` checks, the pieces list copied)."""
    return DTensor(local.pieces, local.spec, requires_grad=requires_grad)


# ----- autograd functions --------------------------------------------------------------------


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, spec: DTensorSpec, grad_spec: DTensorSpec | None, *components: torch.Tensor
    ) -> DTensor:
        ctx.spec, ctx.grad_spec = spec, grad_spec
        return DTensor([c.view_as(c) for c in components], spec)

    @staticmethod
    def backward(ctx, grad: DTensor):
        if ctx.grad_spec is not None:  # from_local(grad_placements=...): brought there as is
            target = ctx.grad_spec.placements
            moved = grad if grad.placements == target else grad.redistribute(placements=target)
            return (None, None, *moved._components)
        return (None, None, *_grad_components(grad, ctx.spec))


def _grad_components(grad: DTensor, spec: DTensorSpec) -> list[torch.Tensor]:
    """Component gradients of a DTensor built with ``spec`` (PyTorch's rule): the gradient
    brought to ``spec``'s placements with Partial dims taken as Replicate (each piece of a
    pending sum receives the whole gradient, so a pending gradient is reduced first), and
    Partial("avg") dims scaled by 1/n."""
    target = tuple(Replicate() if p.is_partial() else p for p in spec.placements)
    moved = grad if grad.placements == target else grad.redistribute(placements=target)
    components = list(moved._components)
    scale = 1
    for m, p in enumerate(spec.placements):
        if isinstance(p, Partial) and p.reduce_op == "avg":
            scale *= spec.mesh.shape[m]
    return components if scale == 1 else [c / scale for c in components]


class _Unpack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dtensor: DTensor, grad_spec: DTensorSpec | None = None):
        ctx.spec = grad_spec or dtensor._spec
        dtype = dtensor.dtype  # a pending half-precision sum's float32 pieces, rounded
        return tuple(c.view_as(c) if c.dtype == dtype else c.to(dtype) for c in dtensor._components)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        spec = ctx.spec
        components = [
            g if g is not None else torch.zeros(spec.local_shape(d), dtype=spec.tensor_meta.dtype)
            for g, d in zip(grads, spec.mesh.local_device_ids, strict=True)
        ]
        return DTensor(components, spec), None


def reshard(
    dtensor: DTensor, device_mesh: DeviceMesh, placements: Sequence[Placement] | None = None
) -> DTensor:
    """The same global value on another mesh (other devices, shape or size) with
    ``placements`` (default: Replicate everywhere), moved point to point: every device receives
    only what the same physical device did not hold before (``redistribute.cross_mesh``).
    Every process of either mesh takes part; others return a DTensor they hold nothing of."""
    if not isinstance(device_mesh, DeviceMesh):
        raise InvalidArgumentError(
            f"reshard of a DTensor of shape {list(dtensor.shape)} on {dtensor.device_mesh} "
            f"needs a DeviceMesh to move to, got {type(device_mesh).__name__}"
        )
    if placements is None:
        placements = [Replicate()] * device_mesh.ndim
    target = validate_placements(dtensor.shape, device_mesh, placements)
    source = dtensor._spec
    if device_mesh == source.mesh:
        return dtensor.redistribute(placements=target)
    shape = tuple(dtensor.shape)
    cross_mesh.check_meshes(shape, source.mesh, source.placements, device_mesh, target)
    spec = DTensorSpec(device_mesh, target, source.tensor_meta)
    check_partials(spec)
    union = cross_mesh.union_mesh(source.mesh, device_mesh)[0]
    if not union.local_device_ids:  # a process of neither mesh takes no part
        return DTensor([], spec, requires_grad=dtensor.requires_grad)
    sample = torch.empty(0, dtype=dtensor.dtype, device=union.device_of(union.local_device_ids[0]))
    what = (f"reshard from {cross_mesh.describe(source.mesh, source.placements)} to "
            f"{cross_mesh.describe(device_mesh, target)}")
    move.agree(what, union, what, {
        "shape": list(shape), "dtype": str(dtensor.dtype),
        "source": cross_mesh.describe(source.mesh, source.placements),
        "target": cross_mesh.describe(device_mesh, target),
    }, sample)
    return _Reshard.apply(dtensor, spec)


class _Reshard(torch.autograd.Function):
    """A cross-mesh move; the gradient moves back to the source mesh (Partial as Replicate)."""

    @staticmethod
    def forward(ctx, dtensor: DTensor, spec: DTensorSpec):
        source = dtensor._spec
        ctx.source = source
        held = source.component_dtype
        plan = cross_mesh.plan_cross_mesh(
            tuple(dtensor.shape), held.itemsize, source.mesh,
            source.placements, spec.mesh, spec.placements,
        )
        components = move.cross_mesh(
            lambda: f"reshard of {source} to {spec}", plan, dtensor._components, held
        )
        return DTensor(components, spec)

    @staticmethod
    def backward(ctx, grad: DTensor):
        source = ctx.source
        back = [Replicate() if p.is_partial() else p for p in source.placements]
        return reshard(grad, source.mesh, back), None


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        dtensor: DTensor,
        target: tuple[Placement, ...],
        forward_dtype: torch.dtype | None = None,
        backward_dtype: torch.dtype | None = None,
    ):
        spec = dtensor._spec
        ctx.source = spec.placements
        ctx.dtypes = (backward_dtype, dtensor.dtype)
        components = dtensor._components
        if forward_dtype is not None and forward_dtype != dtensor.dtype:
            components = [c.to(forward_dtype) for c in components]
            spec = DTensorSpec(spec.mesh, spec.placements, with_dtype(spec, forward_dtype))
        # asked for by name: a Shard may spread to a Partial target (op input moves never do)
        plan = plan_redistribute(spec, target, spread=True)
        components = move.run_plan(lambda: f"redistribute of {spec} to {list(target)}",
                                   "DTensor.redistribute", spec, plan, components)
        return DTensor(components, spec.with_placements(target))

    @staticmethod
    def backward(ctx, grad: DTensor):
        # PyTorch's rule: the gradient goes back to the source placements, a Partial dim as
        # Replicate unless the gradient is that same Partial (then it passes, unreduced)
        target = [
            s if not s.is_partial() or g == s else Replicate()
            for s, g in zip(ctx.source, grad.placements, strict=True)
        ]
        backward_dtype, input_dtype = ctx.dtypes
        if backward_dtype is not None and backward_dtype != grad.dtype:
            grad = grad.to(backward_dtype)
        grad = grad.redistribute(placements=target)
        return (grad if grad.dtype == input_dtype else grad.to(input_dtype)), None, None, None


class _FirstComponent(torch.autograd.Function):
    """A replicated DTensor's value as a plain tensor; the gradient is replicated back."""

    @staticmethod
    def forward(
        ctx, dtensor: DTensor, grad_spec: DTensorSpec | None = None
    ):
        ctx.spec = grad_spec or dtensor._spec
        return dtensor._components[0].view_as(dtensor._components[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        spec = ctx.spec
        components = [
            grad.to(spec.mesh.device_of(d)) if i == 0 else grad.to(spec.mesh.device_of(d)).clone()
            for i, d in enumerate(spec.mesh.local_device_ids)
        ]
        return DTensor(components, spec), None


# ----- pending DTensors (async_op=True) -------------------------------------------------------


class AsyncDTensor(PendingComponents, DTensor):
    """A DTensor whose components a background collective is still computing."""


# ----- the async paths -----------------------------------------------------------------------


class _AsyncRedistribute(_Redistribute):
    """``_Redistribute`` whose forward hands the plan to the background worker."""

    @staticmethod
    def forward(ctx, dtensor: DTensor, target: tuple[Placement, ...]) -> DTensor:
        spec = dtensor._spec
        ctx.source = spec.placements
        ctx.dtypes = (None, dtensor.dtype)  # the blocking backward, without dtype changes
        plan = plan_redistribute(spec, target, spread=True)
        work = move.submit_plan(f"redistribute of {spec} to {list(target)}",
                                "DTensor.redistribute", spec, plan, dtensor._components)
        return AsyncDTensor(work, spec.with_placements(target))


def redistribute_async(dtensor: DTensor, target: tuple[Placement, ...]) -> AsyncDTensor:
    """``dtensor.redistribute(placements=target, async_op=True)``."""
    return _AsyncRedistribute.apply(dtensor, target)


class _AsyncFromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec: DTensorSpec, run_check: bool, *components: torch.Tensor) -> DTensor:
        ctx.spec = spec

        def job() -> list[torch.Tensor]:
            pieces = ready(components)
            return move.broadcast_replicated(spec, pieces) if run_check else pieces

        return AsyncDTensor(move.submit(f"from_local of {spec}", job), spec)

    @staticmethod
    def backward(ctx, grad: DTensor):
        return (None, None, *_grad_components(grad, ctx.spec))


def from_local_async(
    local: torch.Tensor | Sequence[torch.Tensor],
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    shape: Sequence[int] | None,
    stride: Sequence[int] | None,
    run_check: bool,
) -> AsyncDTensor:
    """``DTensor.from_local(..., async_op=True)``: components may be pending themselves."""
    components = as_components(local, mesh, placements, DTensor)
    spec = spec_from_components(components, mesh, placements, shape, stride)
    return _AsyncFromLocal.apply(spec, run_check, *components)


def _rebuild_dtensor(cls: type, state: dict, requires_grad: bool) -> DTensor:
    """Inverse of ``DTensor.__reduce_ex__``."""
    out = DTensor.__new__(cls, state["_components"], state["_spec"], requires_grad=requires_grad)
    out.__dict__.update(state)
    return out


# torch.load(weights_only=True), torch's default, accepts saved DTensors and meshes
torch.serialization.add_safe_globals(
    [DTensor, DTensorSpec, TensorMeta, DeviceMesh, Mesh, Shard, InterleavedShard, RaggedShard,
     Replicate, Partial, _rebuild_dtensor]
)

# torch's foreach paths take DTensors as they take torch's own DTensor: clip_grad_norm_ and
# the optimizers choose foreach by the parameters' type (``foreach=None``), so without this a
# DTensor would fall back to one dispatch per tensor where plain tensors run one per list
for _types in foreach_supported_types():
    if DTensor not in _types:
        _types.append(DTensor)
