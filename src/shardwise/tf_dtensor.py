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
from typing import Any

import torch

from . import dispatch as _dispatch  # noqa: F401  (DTensor ops run: the op layer is loaded)
from . import runtime
from .dtensor import DTensor, local_components, local_of
from .errors import (
    InvalidArgumentError,
    LayoutError,
    MeshError,
    NotEagerError,
    PackError,
    ShardwiseTypeError,
    VariableInputError,
)
from .factories import distribute_tensor, replicated_factories
from .layout import MATCH, UNSHARDED, Layout
from .mesh import DeviceMesh, init_device_mesh
from .mesh_argument import current_mesh
from .mesh_text import tf_device_type
from .placements import Placement, Replicate
from .spec import DTensorSpec, TensorMeta
from .tf_mesh import Mesh
from .torch_compat import is_fx_symbolic_tracing

# ----- pack / unpack -------------------------------------------------------------------------


def pack(components: Sequence[torch.Tensor], layout: Layout) -> DTensor:
    """A DTensor from one component per local device of ``layout.mesh`` (ascending device id).

    The global shape is each axis's components put end to end along the mesh dim that splits
    it; replicated components are not compared (the caller's responsibility, as in TF).
    """
    _require_eager("pack")
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
            raise VariableInputError(
                f"pack got a DVariable {c}: Variable input is not supported; pack tensors "
                f"(components {_shapes(components)}, {layout})"
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
    """This process's components of a DTensor, one per local device in ascending id, as TF
    gives them: a pending reduction (``Partial``) is done first, so the components are those
    of ``fetch_layout(tensor)``. ``local_components`` returns the raw pieces."""
    _require_eager("unpack")
    if isinstance(tensor, DVariable):
        raise ShardwiseTypeError(
            f"unpack expects a tensor, got the variable {tensor}; read it first: "
            f"unpack(v.read_value())"
        )
    if not isinstance(tensor, torch.Tensor):
        raise ShardwiseTypeError(f"unpack expects a DTensor, got {_describe(tensor)}")
    if isinstance(tensor, DTensor):
        tensor = _reduced(tensor)
    return local_components(tensor)


# ----- layouts of tensors --------------------------------------------------------------------


def fetch_layout(tensor: Any) -> Layout | None:
    """The Layout of a DTensor or DVariable; None for a value that is not a tensor. A pending
    reduction (``Partial``) counts as done, as TF layouts have none: those mesh dims are
    replicated."""
    _require_eager("fetch_layout")
    if isinstance(tensor, DVariable):
        return tensor.layout
    if isinstance(tensor, DTensor):
        return Layout.from_placements(
            _reduced_placements(tensor.placements), tensor.device_mesh, tensor.ndim
        )
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


def relayout(tensor: Any, layout: Layout, name: str | None = None) -> DTensor:
    """The same global value with ``layout`` (differentiable); MATCH axes keep their sharding
    (``LayoutError`` when that mesh dim is also named by another axis of ``layout``).

    A pending reduction (``Partial``) is done first, as TF layouts have none. A plain tensor
    is placed on the mesh like ``copy_to_mesh``; the same layout is identity.
    ``name`` is TF's op name, accepted for compatibility (shardwise builds no graph to name).
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
    tensor = _reduced(tensor)
    return tensor.redistribute(placements=_resolve_match(layout, tensor).to_placements())


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

    A fully replicated ``layout`` of another rank replicates the tensor at its own rank, as TF
    2.21 does. A DTensor is relaid out (returned as is when it already has ``layout``).
    ``source_layout`` is deprecated and ignored, as in TF.
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
    if all(s in (UNSHARDED, MATCH) for s in layout.sharding_specs):
        layout = Layout.replicated(layout.mesh, tensor.ndim)  # TF 2.21: any rank, replicated
    _check_rank(tensor, layout, "copy_to_mesh")
    placements = _resolve_match(layout, None).to_placements()
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
    """Make ``mesh`` the default mesh inside the block, as ``with mesh:`` does (PyTorch's
    name), and, as TF's ``tf.ones`` there, make torch's factory functions (``torch.ones``,
    ``zeros``, ``full``, ``empty``, ``arange``, ``linspace``, ``rand``, ``randn``,
    ``randint``) give DTensors replicated on it, in this thread. Nested blocks restore the
    outer one."""
    if not isinstance(mesh, DeviceMesh):
        raise MeshError(f"default_mesh needs a shardwise.DeviceMesh, got {_describe(mesh)}")
    with mesh, replicated_factories(mesh):
        yield mesh


def get_default_mesh() -> DeviceMesh | None:
    """The mesh of the innermost ``default_mesh`` (or ``with mesh:``) block, or None outside
    any."""
    return current_mesh()


def is_dtensor(value: Any) -> bool:
    """True for DTensors and DVariables, False for anything else."""
    return isinstance(value, (DTensor, DVariable))


# ----- variables -----------------------------------------------------------------------------


class DVariable(DTensor):
    """A variable whose value is a DTensor with a fixed layout (TF's ``DVariable``): itself a
    leaf DTensor, like an ``nn.Parameter``, so it takes part in ops (``v + 1``, ``v @ x``),
    collects ``.grad`` and is stepped by ``torch.optim``. Updates write its components in
    place; ops on it give plain DTensors."""

    _layout: Layout

    @staticmethod
    def __new__(
        cls,
        initial_value: Any,
        *,
        layout: Layout | None = None,
        dtype: torch.dtype | None = None,
        trainable: bool = True,
    ) -> DVariable:
        if callable(initial_value):
            initial_value = initial_value()
        if layout is not None:
            _check_layout_arg(layout, "DVariable")
        if isinstance(initial_value, DTensor):
            value = _reduced(initial_value)
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
        dtype = dtype or value.dtype
        with torch.no_grad():
            components = [c.to(dtype, copy=True) for c in local_of(value).pieces]
        meta = local_of(value).spec.tensor_meta
        meta = TensorMeta(meta.shape, meta.stride, dtype)
        spec = DTensorSpec(value.device_mesh, value.placements, meta)
        trainable = trainable and (dtype.is_floating_point or dtype.is_complex)
        variable = DTensor.__new__(cls, components, spec, requires_grad=trainable)
        variable._layout = fetch_layout(value)
        if trainable:  # the gradient takes the variable's layout, so optimizers step in place
            variable.register_hook(_GradTo(spec.placements))
        return variable

    @property
    def layout(self) -> Layout:  # TF's attribute (a torch.Tensor's memory layout is strided)
        return self._layout

    @property
    def value(self) -> DTensor:
        """The variable's storage: the variable itself, a leaf DTensor."""
        return self

    def read_value(self) -> DTensor:
        """A snapshot of the value with the variable's layout (differentiable)."""
        return self.clone()

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
            for dst, src in zip(local_of(self).pieces, local_of(source).pieces, strict=True):
                op(dst, src)
        return self

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"DVariable(shape={list(self.shape)}, dtype={self.dtype}, layout={self._layout})"


# ----- clients and devices -------------------------------------------------------------------


def client_id() -> int:
    """TF: this client's id, the ``torch.distributed`` rank (0 in a single process)."""
    return runtime.rank_and_world()[0]


def num_clients() -> int:
    """TF: the number of clients, the ``torch.distributed`` world size (1 in one process)."""
    return runtime.rank_and_world()[1]


def local_devices(device_type: str, for_client_id: int | None = None) -> list[torch.device]:
    """TF: the devices of ``device_type`` (``"CPU"``, ``"GPU"``) a client has. Inside
    ``default_mesh(mesh)`` (or ``with mesh:``) of that type they are the mesh's devices this
    client owns, as TF counts a CPU mesh's logical devices; outside any, the client's GPUs or
    its one host CPU. Every client has as many."""
    clients = num_clients()
    if for_client_id is not None and not 0 <= for_client_id < clients:
        raise InvalidArgumentError(
            f"for_client_id {for_client_id} is out of range for {clients} clients"
        )
    kind = tf_device_type(device_type)
    mesh = _current_mesh_of(kind)
    if mesh is not None:
        return mesh.local_devices()
    if kind == "cuda":
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device(kind)]


def num_local_devices(device_type: str) -> int:
    """TF: ``len(local_devices(device_type))``."""
    return len(local_devices(device_type))


def num_global_devices(device_type: str) -> int:
    """TF: the devices of ``device_type`` over all clients (every device of the current mesh
    of that type, inside ``default_mesh``)."""
    mesh = _current_mesh_of(tf_device_type(device_type))
    if mesh is not None:
        return len(mesh.device_ids)
    return num_local_devices(device_type) * num_clients()


def _current_mesh_of(kind: str) -> DeviceMesh | None:
    """The current mesh when its devices are of torch type ``kind``, else None."""
    mesh = current_mesh()
    return mesh if mesh is not None and mesh.device_type == kind else None


def create_distributed_mesh(
    mesh_dims: Sequence[tuple[str, int]],
    mesh_name: str = "",
    local_devices: Sequence[Any] | None = None,
    device_type: str | None = None,
) -> Mesh:
    """TF: a mesh over every client's devices, ``[("batch", 4), ("model", 2)]``, ids row-major.

    Joins the ``torch.distributed`` world from the launcher's environment when it is not yet
    initialized (as ``init_device_mesh``); each of the W clients owns N/W consecutive devices.
    On CPU those are simulated, so N is any multiple of W. ``local_devices`` is accepted for
    TF compatibility: which devices a client owns follows from its rank.
    """
    dims = list(mesh_dims)
    if not dims or any(not (isinstance(n, str) and isinstance(k, int) and k > 0) for n, k in dims):
        raise MeshError(f"mesh_dims must be (name, positive size) pairs, got {mesh_dims!r}")
    kind = tf_device_type(device_type or "CPU")
    base = init_device_mesh(kind, [k for _, k in dims], mesh_dim_names=[n for n, _ in dims])
    return Mesh([n for n, _ in dims], base.mesh, mesh_name=mesh_name, device_type=kind)


def barrier(
    mesh: DeviceMesh, barrier_name: str | None = None, timeout_in_ms: int | None = None
) -> None:
    """TF: wait until every process of ``mesh`` reaches this barrier (nothing to wait for when
    the mesh lives in this process). Past ``timeout_in_ms`` (default: the collective timeout)
    it raises ``CollectiveTimeoutError``."""
    if not isinstance(mesh, DeviceMesh):
        raise MeshError(f"barrier needs a shardwise.DeviceMesh, got {_describe(mesh)}")
    ranks = tuple(sorted({mesh.owner_of(d) for d in mesh.device_ids}))
    seconds = timeout_in_ms / 1000 if timeout_in_ms is not None else None
    runtime.barrier(ranks, seconds, f"barrier {barrier_name or ''!r} on {mesh}")


# ----- eager-only calls ----------------------------------------------------------------------

_NOT_EAGER = (
    "must be called eagerly: it moves this process's per-device components, which a graph "
    "being traced (torch.compile, torch.jit.trace, torch.fx) cannot hold; call it outside the "
    "compiled or traced function"
)


def _raise_not_eager(what: str) -> None:
    raise NotEagerError(f"{what} {_NOT_EAGER}")


# Under torch.compile the check must run when the compiled code runs: dynamo would otherwise
# give up on the frame and run it eagerly, where it succeeds. fullgraph=True reports the reason.
_raise_not_eager_compiled = torch.compiler.disable(
    _raise_not_eager, reason=f"shardwise.tf.pack/unpack/fetch_layout {_NOT_EAGER}"
)


def _require_eager(what: str) -> None:
    """TF's rule: ``pack``, ``unpack`` and ``fetch_layout`` run eagerly, never while tracing."""
    if torch.compiler.is_compiling():
        _raise_not_eager_compiled(what)
    if torch.jit.is_tracing() or is_fx_symbolic_tracing():
        _raise_not_eager(what)


# ----- helpers -------------------------------------------------------------------------------


class _GradTo:
    """Gradient hook of a DVariable: redistribute the gradient to the variable's placements
    (dispatch may have computed it with others, Partial included)."""

    def __init__(self, placements: tuple[Placement, ...]) -> None:
        self.placements = placements

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        if isinstance(grad, DTensor) and grad.placements != self.placements:
            return grad.redistribute(placements=self.placements)
        return grad


class _CopyToMesh(torch.autograd.Function):
    """distribute_tensor whose gradient flows back to the source as a plain tensor (TF's
    copy_to_mesh gradient)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, mesh: DeviceMesh, placements: tuple) -> DTensor:
        return distribute_tensor(tensor.detach(), mesh, placements)

    @staticmethod
    def backward(ctx, grad: DTensor):
        return grad.full_tensor(), None, None


def _reduced_placements(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """``placements`` with every pending reduction (``Partial``) done: those dims Replicate."""
    return tuple(Replicate() if p.is_partial() else p for p in placements)


def _reduced(tensor: DTensor) -> DTensor:
    """TF's view of a DTensor: its pending reductions done (TF layouts have no partial state)."""
    placements = _reduced_placements(tensor.placements)
    if placements == tuple(tensor.placements):
        return tensor
    return tensor.redistribute(placements=placements)


def _resolve_match(layout: Layout, tensor: DTensor | None) -> Layout:
    """``layout`` with each MATCH axis given the spec it has now (unsharded for a plain tensor,
    ``tensor`` None); ``LayoutError`` when that repeats a mesh dim ``layout`` names elsewhere."""
    specs = layout.sharding_specs
    if MATCH not in specs:
        return layout
    current = (
        [UNSHARDED] * layout.rank if tensor is None else fetch_layout(tensor).sharding_specs
    )
    resolved = [cur if spec == MATCH else spec for spec, cur in zip(specs, current, strict=True)]
    named = [s for s in resolved if s != UNSHARDED]
    repeated = sorted({s for s in named if named.count(s) > 1})
    if repeated:
        raise LayoutError(
            f"relayout to {layout}: a MATCH axis keeps its sharding over mesh dim(s) "
            f"{repeated} (the tensor has {current}), which the layout also names for another "
            f"axis; a mesh dim may shard at most one axis"
        )
    return Layout(resolved, layout.mesh)


def _has_layout(tensor: DTensor, layout: Layout) -> bool:
    return (
        tensor.device_mesh == layout.mesh
        and tensor.ndim == layout.rank
        and tuple(tensor.placements) == layout.to_placements()
    )


def _check_layout_arg(layout: Any, what: str) -> None:
    if not isinstance(layout, Layout):
        raise ShardwiseTypeError(f"{what} needs a shardwise.tf.Layout, got {_describe(layout)}")


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
