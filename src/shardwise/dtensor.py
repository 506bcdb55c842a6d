"""The ``DTensor`` class and the ways in and out of it (PyTorch DTensor's API, plus TF's pack).

A DTensor is a ``torch.Tensor`` wrapper subclass: its shape, stride and dtype are the global
ones, and it holds one local component per device this process owns, in ascending device id.

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
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import budget, comm, settings
from .comm import background
from .comm.reduction import reduce_op_problem
from .comm.safety import redistribution
from .errors import InvalidArgumentError, InvalidPlacementError, LocalComponentsError, PackError
from .geometry import extract_local
from .mesh import DeviceMesh, Mesh, mesh_or_current
from .placements import InterleavedShard, Partial, Placement, RaggedShard, Replicate, Shard
from .redistribute import cross_mesh, execute_plan, issues_async, plan_redistribute
from .spec import (
    LOW_PRECISION,
    DTensorSpec,
    TensorMeta,
    contiguous_meta,
    make_tensor_meta,
    validate_placements,
)
from .torch_compat import (
    disabled_torch_function_impl,
    foreach_supported_types,
    make_wrapper_subclass,
    pytree,
)
from .tracing import dynamo_opaque, eager_under_dynamo

DispatchHandler = Callable[..., Any]  # (cls, func, types, args=(), kwargs=None)


def set_dispatch_handler(handler: DispatchHandler) -> None:
    """Install the ``__torch_dispatch__`` implementation (the ``dispatch`` layer does this):
    the handler becomes the classmethod itself, so an op pays no extra Python frame."""
    DTensor.__torch_dispatch__ = classmethod(eager_under_dynamo(handler))


def check_partials(spec: DTensorSpec) -> None:
    """Raise if a Partial placement of ``spec`` has no meaning for its dtype (the rule lives
    in ``comm.reduction``): a DTensor never holds such a pending reduction. A spec that
    passed is marked, so the hot path pays one dict lookup."""
    if "_partials_ok" in spec.__dict__:
        return
    for p in spec.placements:
        if type(p) is Partial:
            problem = reduce_op_problem(p.reduce_op, spec.tensor_meta.dtype)
            if problem is not None:
                raise InvalidPlacementError(
                    f"{problem} (tensor shape {list(spec.tensor_meta.shape)}, placements "
                    f"{list(spec.placements)}, {spec.mesh})"
                )
    object.__setattr__(spec, "_partials_ok", True)


class DTensor(torch.Tensor):
    """A tensor distributed over a ``DeviceMesh`` by one ``Placement`` per mesh dim."""

    _spec: DTensorSpec
    _components: list[torch.Tensor]

    __torch_function__ = disabled_torch_function_impl

    @staticmethod
    @eager_under_dynamo
    def __new__(
        cls, components: Sequence[torch.Tensor], spec: DTensorSpec, *, requires_grad: bool = False
    ) -> DTensor:
        meta = spec.tensor_meta
        check_partials(spec)
        first = components[0] if components else None
        if meta.dtype in LOW_PRECISION and first is not None:
            held = spec.component_dtype  # float32 while a half-precision sum is pending
            if first.dtype != held and first.dtype.is_floating_point:
                components = [c.to(held) for c in components]
        device = first.device if first is not None else spec.mesh.device_of(0)
        out = make_wrapper_subclass(
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
        ``shape`` is given. ``run_check`` broadcasts Replicate components from coordinate 0.
        ``grad_placements`` (PyTorch's): the placements the gradient is brought to before
        its components become the local tensors' gradients (default: ``placements``, Partial
        dims reduced). ``async_op``: return at once; pending components and the broadcast
        finish in the background (see ``AsyncDTensor``). As in PyTorch, the mesh defaults to
        the current one (``with mesh:``) and the placements to Replicate on every mesh dim.
        """
        device_mesh = mesh_or_current(device_mesh, "DTensor.from_local")
        if placements is None:
            placements = [Replicate()] * device_mesh.ndim
        replica = settings.REPLICA_THREAD.get()
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
            return _outside_mesh(local_tensor, device_mesh, placements, shape)
        if async_op:
            if grad_placements is not None:
                raise InvalidArgumentError(
                    f"DTensor.from_local(async_op=True, grad_placements={list(grad_placements)})"
                    f" on {device_mesh}: grad_placements is not supported with async_op; build "
                    f"it synchronously, or call .redistribute on the gradient yourself"
                )
            return from_local_async(local_tensor, device_mesh, placements, shape, stride, run_check)
        components = _as_components(local_tensor, device_mesh, placements)
        spec = _spec_from_components(components, device_mesh, placements, shape, stride)
        if run_check:
            components = _broadcast_replicated(spec, components)
        grad_spec = None if grad_placements is None else _grad_spec(
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
            return local_components(self)[index]
        return _Unpack.apply(self, _grad_spec(self._spec, grad_placements, "to_local"))[index]

    def _local_index(self, what: str) -> int:
        """Which component is this process's (or this replica thread's)."""
        replica = settings.REPLICA_THREAD.get()
        if replica is not None and replica.count == len(self._components):
            return replica.index
        if len(self._components) != 1:
            raise LocalComponentsError(
                f"{what} of a DTensor of shape {list(self.shape)} with placements "
                f"{list(self.placements)} needs a process that owns one device, but this one owns "
                f"{len(self._components)} devices {list(self.device_mesh.local_device_ids)} of "
                f"{self.device_mesh}; use shardwise.local_components(dt) for all its components"
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
        if target == self.placements:
            return self
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
        grad_spec = _grad_spec(replicated._spec, grad_placements, "full_tensor")
        return _FirstComponent.apply(replicated, grad_spec)


# ----- construction helpers ------------------------------------------------------------------


def _empty_piece(dtensor: DTensor) -> torch.Tensor:
    """What a process outside the mesh holds of ``dtensor`` (PyTorch: an empty local tensor)."""
    return torch.empty(
        0, dtype=dtensor.dtype, device=dtensor.device, requires_grad=dtensor.requires_grad
    )


def _outside_mesh(
    local: Any, mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int] | None
) -> DTensor:
    """``from_local`` on a process that owns no device of ``mesh`` (PyTorch's non-participating
    rank): nothing is held or sent; the global shape is ``shape``, or ``local``'s as if every
    device held a piece of that shape."""
    if not isinstance(local, torch.Tensor):
        raise PackError(
            f"this process owns no device of {mesh}: from_local takes one tensor there (it "
            f"gives the dtype and, without shape=, the per-device shape), got "
            f"{type(local).__name__}"
        )
    normalized = validate_placements([0] * local.ndim, mesh, placements)
    if shape is None:
        shape = list(local.shape)
        for m, p in enumerate(normalized):
            if isinstance(p, Shard):
                shape[p.dim] *= mesh.shape[m]
    normalized = validate_placements(shape, mesh, normalized)
    spec = DTensorSpec(mesh, normalized, contiguous_meta(shape, local.dtype))
    return DTensor([], spec, requires_grad=local.requires_grad)


def _as_components(
    local: torch.Tensor | Sequence[torch.Tensor],
    mesh: DeviceMesh,
    placements: Sequence[Placement],
) -> list[torch.Tensor]:
    n_local = len(mesh.local_device_ids)
    if isinstance(local, DTensor):
        raise PackError(f"from_local/pack got a DTensor {local}; pass its local components")
    for c in [local] if isinstance(local, torch.Tensor) else local:
        if isinstance(c, torch.Tensor) and c.is_meta and mesh.device_type != "meta":
            raise PackError(
                f"a component of shape {list(c.shape)} is on the meta device (it has no data) "
                f"but {mesh} is a {mesh.device_type!r} mesh (placements {list(placements)})"
            )
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
            d for d in mesh.device_ids if _differs_only(mesh, d, base, mesh_dims)
        ]
        ragged = [placements[m] for m in mesh_dims if isinstance(placements[m], RaggedShard)]
        if len(mesh_dims) == 1 and ragged:  # the sizes say it, wherever the pieces are
            shape[dim] = sum(ragged[0].sizes)
        elif all(d in index for d in members):
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
    normalized = validate_placements(
        [0] * ndim, mesh, placements, described=local_shapes, sizes=False
    )
    if shape is None:
        shape = _infer_global_shape(components, mesh, normalized)
    elif len(shape) != ndim:
        raise PackError(f"shape {list(shape)} has rank {len(shape)} but components have {ndim}")
    normalized = validate_placements(shape, mesh, normalized)
    meta = contiguous_meta(shape, components[0].dtype)
    if stride is not None:
        _check_stride(shape, stride, mesh, normalized)
        meta = TensorMeta(meta.shape, tuple(stride), meta.dtype)
    else:
        meta = TensorMeta(meta.shape, _global_stride(components[0], mesh, normalized, shape),
                          meta.dtype)
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


def _global_stride(
    local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int]
) -> tuple[int, ...]:
    """The global stride ``from_local`` gives, PyTorch's rule: the local tensor's stride, where
    each mesh dim of size n that shards tensor dim d multiplies by n every other stride at
    least as large as d's (a permuted local tensor gives a permuted global one). Where that
    does not lay the global shape out densely (a local tensor with gaps, or uneven shards of a
    given shape), the global stride is the dense one in the local tensor's dim order."""
    stride = list(local.stride())
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            n = mesh.shape[m]
            stride = [s * n if i != p.dim and s >= stride[p.dim] else s
                      for i, s in enumerate(stride)]
    try:
        _check_stride(shape, stride, mesh, placements)
    except PackError:
        order = sorted(range(len(shape)), key=lambda d: (local.stride(d), local.shape[d]))
        stride, acc = [0] * len(shape), 1
        for d in order:
            stride[d] = acc
            acc *= max(shape[d], 1)
    return tuple(stride)


def _check_stride(
    shape: Sequence[int], stride: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]
) -> None:
    """A global stride must lay the global shape out densely without overlap (a permutation of
    the contiguous strides: what torch gives a tensor with no gaps nor aliasing)."""
    stride = list(stride) if isinstance(stride, (list, tuple, torch.Size)) else stride
    ok = isinstance(stride, list) and len(stride) == len(shape) and all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in stride
    )
    if ok:
        expected = 1
        for d in sorted(range(len(shape)), key=lambda d: (stride[d], shape[d])):
            if shape[d] == 1:
                continue
            ok = ok and stride[d] == expected
            expected *= shape[d]
    if not ok:
        raise PackError(
            f"stride {stride!r} does not lay out the global shape {list(shape)} densely (one "
            f"non-negative stride per dim, a permutation of the contiguous strides); "
            f"placements {list(placements)}, {mesh}"
        )


def _broadcast_replicated(spec: DTensorSpec, components: list[torch.Tensor]) -> list[torch.Tensor]:
    with comm.moving(lambda: f"from_local(run_check=True) of {spec}"):
        for m, p in enumerate(spec.placements):
            if p.is_replicate():
                components = comm.broadcast(spec.mesh, m, components)
    return components


@dynamo_opaque
def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """Place a global ``tensor`` on ``device_mesh``: each device keeps its piece (a leaf DTensor
    with the tensor's ``requires_grad``, as in PyTorch).

    Across processes, every process passes a tensor of the same shape and dtype (checked: a
    difference raises ``CollectiveMismatchError`` on every process) and the values are those of
    the process owning the device at index ``src_data_rank`` of every mesh dim (PyTorch: the
    group rank on each dim, so ``mesh["tp"]`` of any rank works), which sends each process
    its devices' pieces. With ``src_data_rank=None`` every process must already hold the same
    tensor and nothing moves (shapes are then compared only under debug checks). In one process
    nothing moves either way. Without ``device_mesh``, the current mesh (``with mesh:``).
    """
    device_mesh = mesh_or_current(device_mesh, "distribute_tensor")
    if isinstance(tensor, DTensor):
        raise InvalidPlacementError(
            f"distribute_tensor got a DTensor {tensor}; use its redistribute() instead"
        )
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgumentError(
            f"distribute_tensor expects a torch.Tensor, got {type(tensor).__name__}"
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
    check_partials(spec)
    data = tensor.detach()
    local = device_mesh.local_device_ids
    owners = sorted({device_mesh.owner_of(d) for d in device_mesh.device_ids})
    if src_data_rank is not None and (
        isinstance(src_data_rank, bool)
        or not isinstance(src_data_rank, int)
        or not 0 <= src_data_rank < min(device_mesh.shape)
    ):
        raise InvalidArgumentError(
            f"distribute_tensor: src_data_rank={src_data_rank!r} must be None or a rank within "
            f"each mesh dim of {device_mesh} (0..{min(device_mesh.shape) - 1}, as in PyTorch: "
            f"the values come from the device at that index of every dim); tensor shape "
            f"{list(tensor.shape)}, placements {list(normalized)}"
        )
    source = None  # the process whose values every device gets
    if src_data_rank is not None:
        flat = 0
        for size in device_mesh.shape:  # row-major index of coordinate (k, k, ..., k)
            flat = flat * size + src_data_rank
        source = device_mesh.owner_of(device_mesh.device_ids[flat])
    if not local:  # a process outside the mesh takes no part and holds nothing (PyTorch's rule)
        return DTensor([], spec, requires_grad=tensor.requires_grad)
    if data.is_meta:  # deferred init: meta pieces, materialized later without communication
        return DTensor(
            [_component_of(data, spec, d) for d in local], spec, requires_grad=tensor.requires_grad
        )
    if len(owners) > 1 and (source is not None or comm.debug_checks_enabled()):
        fields = {"shape": list(tensor.shape), "dtype": str(tensor.dtype),
                  "placements": repr(list(normalized)), "src_data_rank": src_data_rank}
        with comm.moving(lambda: f"distribute_tensor of {spec}"):
            comm.agree(device_mesh, "distribute_tensor", fields, data)
    if source is None or len(owners) == 1:
        components = [_component_of(data, spec, d).to(device_mesh.device_of(d)) for d in local]
    else:
        with comm.moving(lambda: f"distribute_tensor of {spec} from rank {source}"):
            components = comm.scatter_from(
                device_mesh,
                source,
                lambda d: _component_of(data, spec, d),
                [spec.local_shape(d) for d in local],
                data,
            )
    return DTensor(components, spec, requires_grad=tensor.requires_grad)


def _component_of(tensor: torch.Tensor, spec: DTensorSpec, device: int) -> torch.Tensor:
    """Device ``device``'s piece of the global ``tensor``: its slice; for Partial("sum") dims
    the first device of the mesh dim keeps the value and the others hold zeros."""
    piece = extract_local(tensor, spec.local_segments(device))
    coord = spec.mesh.coordinate_of(device)
    for m, p in enumerate(spec.placements):
        if isinstance(p, Partial) and p.zeros_elsewhere and coord[m] != 0:
            return torch.zeros_like(piece)
    return piece.clone(memory_format=torch.contiguous_format)


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


def _grad_spec(spec: DTensorSpec, grad_placements: Sequence[Placement], what: str) -> DTensorSpec:
    """``spec`` with the ``grad_placements`` of ``to_local``/``full_tensor``: the gradient keeps
    the local shapes, so the placements must give every local device the same shape."""
    target = validate_placements(spec.shape, spec.mesh, grad_placements)
    grad_spec = spec.with_placements(target)
    for d in spec.mesh.local_device_ids:
        if grad_spec.local_shape(d) != spec.local_shape(d):
            raise InvalidPlacementError(
                f"{what}(grad_placements={list(grad_placements)}) of a DTensor of shape "
                f"{list(spec.shape)} with placements {list(spec.placements)} on {spec.mesh}: "
                f"device {d} holds {list(spec.local_shape(d))} but those placements give it "
                f"{list(grad_spec.local_shape(d))}; the gradient must have the local shape"
            )
    return grad_spec


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
    comm.agree(union, what, {
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
        with comm.moving(lambda: f"reshard of {source} to {spec}"):
            components = cross_mesh.run_cross_mesh(plan, dtensor._components, held)
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
            spec = DTensorSpec(spec.mesh, spec.placements, _with_dtype(spec, forward_dtype))
        # asked for by name: a Shard may spread to a Partial target (op input moves never do)
        plan = plan_redistribute(spec, target, spread=True)
        with (
            comm.moving(lambda: f"redistribute of {spec} to {list(target)}",
                        spec=lambda: redistribution(spec, tuple(target))),
            budget.around("DTensor.redistribute", [("the DTensor", spec, plan)]),
        ):
            components = execute_plan(plan, spec.mesh, components)
        return DTensor(components, spec.with_placements(target))

    @staticmethod
    def backward(ctx, grad: DTensor):
        target = [Replicate() if p.is_partial() else p for p in ctx.source]
        backward_dtype, input_dtype = ctx.dtypes
        if backward_dtype is not None and backward_dtype != grad.dtype:
            grad = grad.to(backward_dtype)
        grad = grad.redistribute(placements=target)
        return (grad if grad.dtype == input_dtype else grad.to(input_dtype)), None, None, None


def _with_dtype(spec: DTensorSpec, dtype: torch.dtype) -> TensorMeta:
    meta = spec.tensor_meta
    return TensorMeta(meta.shape, meta.stride, dtype)


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


class AsyncDTensor(DTensor):
    """A DTensor whose components a background collective is still computing."""

    @staticmethod
    def __new__(
        cls, work: background.Work, spec: DTensorSpec, *, requires_grad: bool = False
    ) -> AsyncDTensor:
        meta = spec.tensor_meta
        device = spec.mesh.device_of(spec.mesh.local_device_ids[0])
        out = make_wrapper_subclass(
            cls, meta.shape, strides=meta.stride, dtype=meta.dtype, device=device,
            requires_grad=requires_grad,
        )
        out._spec = spec
        out.__dict__["_ready"] = None
        out.__dict__["_work"] = work
        return out

    @property
    def _components(self) -> list[torch.Tensor]:  # type: ignore[override]
        work = self.__dict__["_work"]
        if work is not None:
            self.__dict__["_ready"] = list(work.wait())
            self.__dict__["_work"] = None
        return self.__dict__["_ready"]

    @_components.setter
    def _components(self, value: list[torch.Tensor]) -> None:
        self.__dict__["_ready"] = value
        self.__dict__["_work"] = None

    def is_pending(self) -> bool:
        """True while the background collective has not finished."""
        work = self.__dict__["_work"]
        return work is not None and not work.done()

    def wait(self) -> AsyncDTensor:
        """Block until the components are ready (an error of the collective is raised here)."""
        self._components  # noqa: B018 - reading them waits
        return self

    def to_local(self) -> torch.Tensor:
        """This process's component; while pending, a tensor that waits on first use."""
        work = self.__dict__["_work"]
        if work is None or (self.requires_grad and torch.is_grad_enabled()):
            return super().to_local()
        if len(self.device_mesh.local_device_ids) != 1:
            return super().to_local()  # raises LocalComponentsError
        if isinstance(work, background.Issued):  # torch's, as issued: views stay unwaited
            return work.unwaited()[0]
        device = self.device_mesh.local_device_ids[0]
        return AsyncCollectiveTensor(
            work,
            0,
            self._spec.local_shape(device),
            self.dtype,
            self.device_mesh.device_of(device),
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        state = "pending" if self.is_pending() else "ready"
        return f"Async{super().__repr__()[:-1]}, {state})"


class AsyncCollectiveTensor(torch.Tensor):
    """A plain tensor that a background collective is still computing: any op on it, and
    ``wait()``, first wait for the collective and then see the plain result."""

    __torch_function__ = disabled_torch_function_impl

    @staticmethod
    def __new__(
        cls,
        work: background.Work,
        index: int,
        shape: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> AsyncCollectiveTensor:
        out = make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device)
        out._work, out._index = work, index
        return out

    def wait(self) -> torch.Tensor:
        """The plain tensor (component ``index`` of the job's result), once it is ready."""
        return self._work.wait()[self._index]

    def is_pending(self) -> bool:
        return not self._work.done()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(t: Any) -> Any:
            return t.wait() if isinstance(t, AsyncCollectiveTensor) else t

        args, kwargs = pytree.tree_map(unwrap, (args, kwargs or {}))
        return func(*args, **kwargs)

    def data_ptr(self) -> int:
        return self.wait().data_ptr()

    def tolist(self) -> Any:
        return self.wait().tolist()

    def numpy(self, *, force: bool = False) -> Any:
        return self.wait().numpy(force=force)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        state = "pending" if self.is_pending() else repr(self.wait())
        return f"AsyncCollectiveTensor({state})"


# ----- the async paths -----------------------------------------------------------------------


class _AsyncRedistribute(_Redistribute):
    """``_Redistribute`` whose forward hands the plan to the background worker."""

    @staticmethod
    def forward(ctx, dtensor: DTensor, target: tuple[Placement, ...]) -> DTensor:
        spec = dtensor._spec
        ctx.source = spec.placements
        ctx.dtypes = (None, dtensor.dtype)  # the blocking backward, without dtype changes
        plan = plan_redistribute(spec, target, spread=True)

        def job() -> list[torch.Tensor]:
            with comm.moving(lambda: f"redistribute of {spec} to {list(target)}",
                             spec=lambda: redistribution(spec, tuple(target))):
                return execute_plan(plan, spec.mesh, dtensor._components)

        # checked against the budgets now; the job charges them in this context's copy
        with budget.around("DTensor.redistribute", [("the DTensor", spec, plan)]):
            start = background.issue if issues_async(plan, spec.mesh) else background.submit
            work = start(job, f"redistribute of {spec} to {list(target)}")
        return AsyncDTensor(work, spec.with_placements(target))


def redistribute_async(dtensor: DTensor, target: tuple[Placement, ...]) -> AsyncDTensor:
    """``dtensor.redistribute(placements=target, async_op=True)``."""
    return _AsyncRedistribute.apply(dtensor, target)


class _AsyncFromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec: DTensorSpec, run_check: bool, *components: torch.Tensor) -> DTensor:
        ctx.spec = spec

        def job() -> list[torch.Tensor]:
            ready = [
                c.wait() if isinstance(c, AsyncCollectiveTensor) else c.view_as(c)
                for c in components
            ]
            return _broadcast_replicated(spec, ready) if run_check else ready

        return AsyncDTensor(background.submit(job, f"from_local of {spec}"), spec)

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
    components = _as_components(local, mesh, placements)
    spec = _spec_from_components(components, mesh, placements, shape, stride)
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
