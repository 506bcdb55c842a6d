"""TF DTensor's user API (``tf.experimental.dtensor``) on shardwise's ``DTensor``.

``pack``/``unpack`` move between a DTensor and this process's per-device components, ``relayout``
and ``copy_to_mesh`` place values with a ``Layout``, ``DVariable`` holds a DTensor that is updated
in place. Errors follow TF's (spec Part 1A) with shardwise's classes. Extension: layouts of an
axis that does not divide evenly follow ``torch.chunk`` geometry, and ``pack`` accepts components
of that geometry.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

from .dtensor import DTensor, distribute_tensor
from .dtensor import unpack as _unpack_dtensor
from .errors import InvalidArgumentError, LayoutError, MeshError, PackError, ShardwiseTypeError
from .layout import MATCH, UNSHARDED, Layout
from .mesh import DeviceMesh
from .placements import Placement, Replicate, Shard

_DEFAULT_MESH: ContextVar[DeviceMesh | None] = ContextVar("shardwise_default_mesh", default=None)


# ----- pack / unpack -------------------------------------------------------------------------


def pack(components: Sequence[torch.Tensor], layout: Layout) -> DTensor:
    """A DTensor from one component per local device of ``layout.mesh`` (ascending device id).

    The global shape is each axis's components put end to end along the mesh dim that splits
    it; replicated components are not compared (the caller's responsibility, as in TF).
    """
    _check_layout_arg(layout, "pack")
    if isinstance(components, torch.Tensor) or not isinstance(components, Sequence):
        raise ShardwiseTypeError(
            f"pack takes a list of components (one per local device), got "
            f"{_describe(components)} for {layout}"
        )
    components = list(components)
    if not components:
        raise InvalidArgumentError(f"pack requires 1 or more components, got none for {layout}")
    for c in components:
        if isinstance(c, DVariable):
            raise ShardwiseTypeError(
                f"pack got a DVariable {c}; variable components are not supported, pack "
                f"tensors (components {_shapes(components)}, {layout})"
            )
        if isinstance(c, DTensor):
            raise InvalidArgumentError(
                f"pack got a component that is already a DTensor {c}; pass plain tensors "
                f"(components {_shapes(components)}, {layout})"
            )
        if not isinstance(c, torch.Tensor):
            raise ShardwiseTypeError(
                f"pack components must be tensors, got {_describe(c)} "
                f"(components {_shapes(components)}, {layout})"
            )
    mesh = layout.mesh
    n_local = mesh.num_local_devices()
    if len(components) != n_local:
        raise InvalidArgumentError(
            f"pack expected {n_local} components, one per local device "
            f"{list(mesh.local_device_ids)} of {mesh}, but got {len(components)} of shapes "
            f"{_shapes(components)} ({layout})"
        )
    dtypes = sorted({str(c.dtype) for c in components})
    if len(dtypes) > 1:
        raise ShardwiseTypeError(
            f"pack components must all have the same dtype, got {dtypes} "
            f"(shapes {_shapes(components)}, {layout})"
        )
    if any(c.ndim != layout.rank for c in components):
        raise InvalidArgumentError(
            f"pack needs components of the layout's rank {layout.rank}, got shapes "
            f"{_shapes(components)} for {layout} (a scalar takes Layout([], mesh))"
        )
    placements = layout.to_placements()
    try:
        return DTensor.from_local(components, mesh, placements)
    except PackError as err:
        raise PackError(
            f"pack: component shapes {_shapes(components)} do not fit {layout}: every axis "
            f"must be split like torch.chunk of some global size ({err})"
        ) from None


def unpack(tensor: DTensor) -> list[torch.Tensor]:
    """This process's components of a DTensor, one per local device in ascending id."""
    if isinstance(tensor, DVariable):
        raise ShardwiseTypeError(
            f"unpack expects a tensor, got the variable {tensor}; read it first: "
            f"unpack(v.read_value())"
        )
    if not isinstance(tensor, torch.Tensor):
        raise ShardwiseTypeError(f"unpack expects a DTensor, got {_describe(tensor)}")
    return _unpack_dtensor(tensor)


# ----- layouts of tensors --------------------------------------------------------------------


def fetch_layout(tensor: Any) -> Layout | None:
    """The Layout of a DTensor or DVariable; None for a value that is not a tensor."""
    if isinstance(tensor, DVariable):
        return tensor.layout
    if isinstance(tensor, DTensor):
        return Layout.from_placements(tensor.placements, tensor.device_mesh, tensor.ndim)
    if isinstance(tensor, torch.Tensor):
        raise InvalidArgumentError(
            f"fetch_layout expects a DTensor, got a plain tensor of shape {list(tensor.shape)}; "
            f"place it on a mesh with copy_to_mesh first"
        )
    return None


def check_layout(tensor: Any, layout: Layout) -> None:
    """Raise ``LayoutError`` unless ``tensor`` has exactly ``layout``."""
    actual = fetch_layout(tensor)
    if actual != layout:
        raise LayoutError(f"expected {layout} but {_describe(tensor)} has layout {actual}")


def relayout(tensor: Any, layout: Layout) -> DTensor:
    """The same global value with ``layout`` (differentiable); MATCH axes keep their sharding.

    A plain tensor is placed on the mesh like ``copy_to_mesh``; the same layout is identity.
    """
    _check_layout_arg(layout, "relayout")
    if isinstance(tensor, DVariable):
        tensor = tensor.read_value()
    if not isinstance(tensor, DTensor):
        return copy_to_mesh(tensor, layout)
    _check_rank(tensor, layout, "relayout")
    if tensor.device_mesh != layout.mesh:
        raise MeshError(
            f"relayout of a DTensor of shape {list(tensor.shape)} on {tensor.device_mesh} to "
            f"{layout}: the layout is on another mesh"
        )
    return tensor.redistribute(placements=_target_placements(layout, tensor.placements))


def relayout_like(tensor: Any, layout_tensor: Any) -> DTensor:
    """``tensor`` relaid out to the layout (and mesh) of ``layout_tensor``."""
    layout = fetch_layout(layout_tensor)
    if layout is None:
        raise ShardwiseTypeError(
            f"relayout_like needs a DTensor or DVariable to take the layout from, got "
            f"{_describe(layout_tensor)}"
        )
    return relayout(tensor, layout)


def copy_to_mesh(tensor: Any, layout: Layout, source_layout: Layout | None = None) -> DTensor:
    """Place a plain tensor (or a value convertible to one) on ``layout.mesh`` with ``layout``:
    every device keeps its slice. Differentiable: the gradient comes back as a plain tensor.

    A DTensor is relaid out (returned as is when it already has ``layout``). ``source_layout``
    is deprecated and ignored, as in TF.
    """
    _check_layout_arg(layout, "copy_to_mesh")
    if source_layout is not None:
        warnings.warn(
            "copy_to_mesh: source_layout is deprecated and ignored", DeprecationWarning, 2
        )
    if isinstance(tensor, (DTensor, DVariable)):
        return relayout(tensor, layout)
    if not isinstance(tensor, torch.Tensor):
        tensor = torch.as_tensor(tensor)
    _check_rank(tensor, layout, "copy_to_mesh")
    placements = _target_placements(layout, (Replicate(),) * layout.mesh.ndim)
    return _CopyToMesh.apply(tensor, layout.mesh, placements)


def call_with_layout(
    fn: Callable[..., Any], layout: Layout | None, *args: Any, **kwargs: Any
) -> Any:
    """Call ``fn`` under ``default_mesh(layout.mesh)`` and give its (first) output ``layout``;
    with ``layout=None`` a plain call."""
    if layout is None:
        return fn(*args, **kwargs)
    _check_layout_arg(layout, "call_with_layout")
    with default_mesh(layout.mesh):
        out = fn(*args, **kwargs)
    if isinstance(out, (tuple, list)) and out:
        first = relayout(out[0], layout)
        return [first, *out[1:]] if isinstance(out, list) else (first, *out[1:])
    return relayout(out, layout)


@contextmanager
def default_mesh(mesh: DeviceMesh) -> Iterator[DeviceMesh]:
    """Make ``mesh`` the default mesh inside the block; nested blocks restore the outer one."""
    if not isinstance(mesh, DeviceMesh):
        raise MeshError(f"default_mesh needs a shardwise.DeviceMesh, got {_describe(mesh)}")
    token = _DEFAULT_MESH.set(mesh)
    try:
        yield mesh
    finally:
        _DEFAULT_MESH.reset(token)


def get_default_mesh() -> DeviceMesh | None:
    """The mesh of the innermost ``default_mesh`` block, or None outside any."""
    return _DEFAULT_MESH.get()


def is_dtensor(value: Any) -> bool:
    """True for DTensors and DVariables, False for anything else."""
    return isinstance(value, (DTensor, DVariable))


# ----- variables -----------------------------------------------------------------------------


class DVariable:
    """A variable whose value is a DTensor with a fixed layout (TF's ``DVariable``; like an
    ``nn.Parameter`` over a DTensor). Updates write the components in place."""

    def __init__(
        self,
        initial_value: Any,
        *,
        layout: Layout | None = None,
        dtype: torch.dtype | None = None,
        trainable: bool = True,
    ) -> None:
        if callable(initial_value):
            initial_value = initial_value()
        if isinstance(initial_value, DVariable):
            initial_value = initial_value.value
        if layout is not None:
            _check_layout_arg(layout, "DVariable")
        if isinstance(initial_value, DTensor):
            value = initial_value
            if layout is not None and not _has_layout(value, layout):
                raise InvalidArgumentError(
                    f"Conflicting layout: the initial value of shape {list(value.shape)} has "
                    f"placements {list(value.placements)} on {value.device_mesh} but "
                    f"layout={layout} was given"
                )
        elif layout is None:
            raise InvalidArgumentError(
                f"Neither layout nor DTensor initial value are provided: got "
                f"{_describe(initial_value)}; pass layout= or a DTensor"
            )
        else:
            if not isinstance(initial_value, torch.Tensor):
                initial_value = torch.as_tensor(initial_value, dtype=dtype)
            value = copy_to_mesh(initial_value.detach(), layout)
        self._layout = fetch_layout(value)
        with torch.no_grad():
            components = [c.to(dtype or c.dtype, copy=True) for c in _unpack_dtensor(value)]
            self._value = DTensor.from_local(
                components, value.device_mesh, value.placements, shape=value.shape
            )
        grad_dtype = self._value.dtype.is_floating_point or self._value.dtype.is_complex
        self._value.requires_grad_(trainable and grad_dtype)

    @property
    def layout(self) -> Layout:
        return self._layout

    @property
    def value(self) -> DTensor:
        """The variable's storage: a leaf DTensor (its ``.grad`` collects gradients)."""
        return self._value

    @property
    def shape(self) -> torch.Size:
        return self._value.shape

    @property
    def dtype(self) -> torch.dtype:
        return self._value.dtype

    @property
    def grad(self) -> torch.Tensor | None:
        return self._value.grad

    def read_value(self) -> DTensor:
        """A snapshot of the value with the variable's layout (differentiable)."""
        return self._value.clone()

    def assign(self, value: Any) -> DVariable:
        """Overwrite the value (same shape and dtype); it keeps the variable's layout."""
        return self._update(value, "assign", torch.Tensor.copy_)

    def assign_add(self, delta: Any) -> DVariable:
        """Add ``delta`` (same shape and dtype) to the value in place."""
        return self._update(delta, "assign_add", torch.Tensor.add_)

    def assign_sub(self, delta: Any) -> DVariable:
        """Subtract ``delta`` (same shape and dtype) from the value in place."""
        return self._update(delta, "assign_sub", torch.Tensor.sub_)

    def _update(
        self, value: Any, what: str, op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> DVariable:
        if isinstance(value, DVariable):
            value = value.value
        if not isinstance(value, torch.Tensor):
            value = torch.as_tensor(value, dtype=self.dtype)
        if value.shape != self.shape:
            raise InvalidArgumentError(
                f"{what}: cannot update {self} with a value of shape {list(value.shape)}; "
                f"shapes must be equal"
            )
        if value.dtype != self.dtype:
            raise ShardwiseTypeError(
                f"{what}: cannot update {self} with a value of dtype {value.dtype}"
            )
        with torch.no_grad():
            source = relayout(value, self._layout)
            for dst, src in zip(self._value._components, source._components, strict=True):
                op(dst, src)
        return self

    def __repr__(self) -> str:
        return f"DVariable(shape={list(self.shape)}, dtype={self.dtype}, layout={self._layout})"


# ----- helpers -------------------------------------------------------------------------------


class _CopyToMesh(torch.autograd.Function):
    """distribute_tensor whose gradient flows back to the source as a plain tensor (TF's
    copy_to_mesh gradient)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, mesh: DeviceMesh, placements: tuple) -> DTensor:  # noqa: ANN001
        return distribute_tensor(tensor.detach(), mesh, placements)

    @staticmethod
    def backward(ctx, grad: DTensor):  # noqa: ANN001
        return grad.full_tensor(), None, None


def _target_placements(layout: Layout, current: Sequence[Placement]) -> tuple[Placement, ...]:
    """``layout``'s placements, where a mesh dim that now shards a MATCH axis keeps doing so."""
    specs = layout.sharding_specs
    concrete = Layout([UNSHARDED if s == MATCH else s for s in specs], layout.mesh)
    return tuple(
        cur
        if isinstance(new, Replicate) and isinstance(cur, Shard) and specs[cur.dim] == MATCH
        else new
        for new, cur in zip(concrete.to_placements(), current, strict=True)
    )


def _has_layout(tensor: DTensor, layout: Layout) -> bool:
    return (
        tensor.device_mesh == layout.mesh
        and tensor.ndim == layout.rank
        and tuple(tensor.placements) == layout.to_placements()
    )


def _check_layout_arg(layout: Any, what: str) -> None:
    if not isinstance(layout, Layout):
        raise ShardwiseTypeError(f"{what} needs a shardwise.Layout, got {_describe(layout)}")


def _check_rank(tensor: torch.Tensor, layout: Layout, what: str) -> None:
    if tensor.ndim != layout.rank:
        raise LayoutError(
            f"{what}: a tensor of shape {list(tensor.shape)} (rank {tensor.ndim}) cannot take "
            f"{layout} of rank {layout.rank}"
        )


def _shapes(components: Sequence[Any]) -> list[Any]:
    return [list(c.shape) if isinstance(c, torch.Tensor) else _describe(c) for c in components]


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{type(value).__name__} of shape {list(value.shape)}"
    return f"{type(value).__name__} {value!r}"
