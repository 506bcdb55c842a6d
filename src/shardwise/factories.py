"""DTensor factories: ``distribute_tensor`` (a global tensor placed on a mesh), ``zeros``,
``ones``, ``empty``, ``full``, ``rand``, ``randn`` (``torch.distributed.tensor``'s signatures).

All of them build each device's component directly, never the global tensor; ``rand`` and
``randn`` draw each shard from its own stream (``rng.py``), so after the same seeding they give
the same values in every mode, and on CUDA the values of ``torch.distributed.tensor.randn``.

``replicated_factories(mesh)`` is TF's default mesh for torch's own factory functions: inside
it ``torch.ones(4)`` is a DTensor replicated on the mesh, as ``tf.ones`` is under
``dtensor.default_mesh``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from . import settings
from .call_site import called_by_library
from .comm import debug_checks_enabled
from .components import check_partials, component_of, source_process
from .dtensor import DTensor
from .errors import InvalidArgumentError, InvalidPlacementError, MeshError, NonLeafTensorError
from .mesh import DeviceMesh
from .mesh_argument import mesh_or_current
from .placements import Partial, Placement, Replicate
from .redistribute import move
from .rng import check_generator, draw_per_shard
from .spec import DTensorSpec, contiguous_meta, make_tensor_meta, validate_placements
from .tracing import dynamo_opaque

aten = torch.ops.aten
LocalMaker = Callable[[torch.Size, torch.device, bool], torch.Tensor]


def keeps_value(spec: DTensorSpec, device: int) -> bool:
    """False on the devices that hold zeros of a Partial("sum") value (all but coordinate 0 of
    each Partial("sum") mesh dim): where a constant is written once, not once per device."""
    coord = spec.mesh.coordinate_of(device)
    return not any(
        isinstance(p, Partial) and p.zeros_elsewhere and coord[m] != 0
        for m, p in enumerate(spec.placements)
    )


def _normalize_size(size: tuple[Any, ...], what: str) -> tuple[int, ...]:
    """``zeros(2, 3)``, ``zeros((2, 3))`` and ``zeros([2, 3])`` all mean shape (2, 3)."""
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in size):
        raise InvalidArgumentError(f"shardwise.{what}: size must be non-negative ints, got {size}")
    return tuple(size)


def _mesh_and_spec(
    what: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    layout: torch.layout,
    device_mesh: DeviceMesh | None,
    placements: Sequence[Placement] | None,
) -> DTensorSpec:
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgumentError(f"shardwise.{what}: dtype must be a torch.dtype, got {dtype!r}")
    if layout != torch.strided:
        raise InvalidArgumentError(
            f"shardwise.{what}: only the torch.strided layout is supported, not {layout}"
        )
    mesh = mesh_or_current(device_mesh, f"shardwise.{what}({list(shape)})")
    placements = placements if placements is not None else [Replicate()] * mesh.ndim
    normalized = validate_placements(shape, mesh, placements)
    return DTensorSpec(mesh, normalized, contiguous_meta(shape, dtype))


def _build(spec: DTensorSpec, make: LocalMaker, requires_grad: bool) -> DTensor:
    mesh = spec.mesh
    components = [
        make(spec.local_shape(d), mesh.device_of(d), keeps_value(spec, d))
        for d in mesh.local_device_ids
    ]
    return DTensor(components, spec, requires_grad=requires_grad)


def _constant(what: str, value: Any, size: tuple, dtype, layout, requires_grad, mesh, placements):
    shape = _normalize_size(size, what)
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise InvalidArgumentError(f"shardwise.{what}: dtype must be a torch.dtype, got {dtype!r}")
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, (bool, int, float, complex)):
        raise InvalidArgumentError(
            f"shardwise.{what}({list(shape)}): the fill value must be a number, got {value!r}"
        )
    try:
        probe = torch.full((), value, dtype=dtype)
    except RuntimeError as err:
        raise InvalidArgumentError(
            f"shardwise.{what}({list(shape)}): cannot fill {dtype} with {value!r} ({err})"
        ) from None
    spec = _mesh_and_spec(what, shape, probe.dtype, layout, mesh, placements)

    def make(local: torch.Size, device: torch.device, keep: bool) -> torch.Tensor:
        return torch.full(local, value if keep else 0, dtype=probe.dtype, device=device)

    return _build(spec, make, requires_grad)


def zeros(
    *size: Any,
    requires_grad: bool = False,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
) -> DTensor:
    """A DTensor of zeros of global ``size``; each device allocates only its piece."""
    dtype = dtype or torch.get_default_dtype()
    return _constant("zeros", 0, size, dtype, layout, requires_grad, device_mesh, placements)


def ones(
    *size: Any,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    requires_grad: bool = False,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
) -> DTensor:
    """A DTensor of ones of global ``size`` (a Partial("sum") dim holds the ones on its first
    device and zeros on the others, so the value is one)."""
    dtype = dtype or torch.get_default_dtype()
    return _constant("ones", 1, size, dtype, layout, requires_grad, device_mesh, placements)


def full(
    size: Sequence[int],
    fill_value: Any,
    *,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    requires_grad: bool = False,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
) -> DTensor:
    """A DTensor filled with ``fill_value`` (dtype inferred from it as ``torch.full`` does)."""
    return _constant(
        "full", fill_value, (size,), dtype, layout, requires_grad, device_mesh, placements
    )


def empty(
    *size: Any,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    requires_grad: bool = False,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
) -> DTensor:
    """An uninitialised DTensor of global ``size``; each device allocates only its piece."""
    shape = _normalize_size(size, "empty")
    dtype = dtype or torch.get_default_dtype()
    spec = _mesh_and_spec("empty", shape, dtype, layout, device_mesh, placements)

    def make(local: torch.Size, device: torch.device, _keep: bool) -> torch.Tensor:
        return torch.empty(local, dtype=dtype, device=device)

    return _build(spec, make, requires_grad)


def _random(
    what: str,
    draw: Callable[..., torch.Tensor],
    size: tuple,
    requires_grad: bool,
    dtype: torch.dtype | None,
    layout: torch.layout,
    device_mesh: DeviceMesh | None,
    placements: Sequence[Placement] | None,
) -> DTensor:
    shape = _normalize_size(size, what)
    dtype = dtype or torch.get_default_dtype()
    spec = _mesh_and_spec(what, shape, dtype, layout, device_mesh, placements)
    mesh = spec.mesh
    ids = mesh.local_device_ids
    devices = [mesh.device_of(d) for d in ids]
    if devices:
        check_generator(mesh, devices[0])

    def local(i: int) -> torch.Tensor:
        piece = draw(list(spec.local_shape(ids[i])), dtype=dtype, device=devices[i])
        return piece if keeps_value(spec, ids[i]) else piece.zero_()

    return DTensor(draw_per_shard(spec, devices, local), spec, requires_grad=requires_grad)


def rand(
    *size: Any,
    requires_grad: bool = False,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
) -> DTensor:
    """Uniform [0, 1) samples; each device draws only its shard (``shardwise.rng``: on CUDA
    ``torch.distributed.tensor.rand``'s values)."""
    return _random(
        "rand", aten.rand.default, size, requires_grad, dtype, layout, device_mesh, placements
    )


def randn(
    *size: Any,
    requires_grad: bool = False,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
) -> DTensor:
    """Standard normal samples; each device draws only its shard (``shardwise.rng``: on CUDA
    ``torch.distributed.tensor.randn``'s values)."""
    return _random(
        "randn", aten.randn.default, size, requires_grad, dtype, layout, device_mesh, placements
    )


# ----- torch's factory functions under TF's default mesh ------------------------------------

# The functions that take no tensor and that TF DTensor places on the default mesh (tf.ones,
# tf.zeros, tf.fill, tf.range, tf.linspace, stateless random ops); constants (torch.tensor,
# torch.as_tensor) and torch.eye stay plain there, as tf.constant and tf.eye do.
_CONSTANT_FACTORIES = frozenset({torch.ones, torch.zeros, torch.full, torch.empty, torch.arange,
                                 torch.linspace})
_RANDOM_FACTORIES = frozenset({torch.rand, torch.randn, torch.randint})


class _ReplicatedFactories(TorchFunctionMode):
    """Torch's factory functions called by the program make DTensors replicated on ``mesh``:
    the value single-device torch gives, one copy per device (random ones drawn once from the
    default generator, as ``shardwise.rand``). Every other call, and a factory call made by
    torch's or shardwise's own code, passes through."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        self.mesh = mesh

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        random = func in _RANDOM_FACTORIES
        if (
            not (random or func in _CONSTANT_FACTORIES)
            or kwargs.get("out") is not None
            # torch's and shardwise's own calls (nn.Linear's torch.empty, an optimizer's state)
            or called_by_library(1)
        ):
            return func(*args, **kwargs)
        requires_grad = bool(kwargs.pop("requires_grad", False))
        mesh = self.mesh
        first = mesh.device_of(mesh.local_device_ids[0])
        kwargs.setdefault("device", first)
        if random:
            check_generator(mesh, first)
            with settings.drawing_from_default_generator():
                value = func(*args, **kwargs)
        else:
            value = func(*args, **kwargs)
        out = distribute_tensor(value, mesh, [Replicate()] * mesh.ndim, src_data_rank=None)
        return out.requires_grad_(requires_grad) if requires_grad else out


@contextmanager
def replicated_factories(mesh: DeviceMesh) -> Iterator[None]:
    """Within the block, in this thread, ``torch.ones/zeros/full/empty/arange/linspace`` and
    ``torch.rand/randn/randint`` return DTensors replicated on ``mesh`` (TF's default mesh);
    ``out=`` calls and torch's and shardwise's own calls (``nn.Linear``'s parameters, an
    optimizer's state) stay plain. An inner block's mesh wins."""
    with _ReplicatedFactories(mesh):
        yield


__all__ = ["empty", "full", "ones", "rand", "randn", "replicated_factories", "zeros"]


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

    As in PyTorch, ``tensor`` must be a leaf: one autograd made (``x + 2`` of an ``x`` that
    requires grad) raises ``NonLeafTensorError`` (a ``RuntimeError``). A DTensor already on
    ``device_mesh`` with ``placements`` comes back as it is; on another mesh or with other
    placements it raises (``MeshError``, ``InvalidPlacementError``): ``redistribute`` moves it.
    """
    device_mesh = mesh_or_current(device_mesh, "distribute_tensor")
    if isinstance(tensor, torch.Tensor) and not tensor.is_leaf:
        raise NonLeafTensorError(
            f"distribute_tensor can only distribute leaf tensors, but the tensor of shape "
            f"{list(tensor.shape)} to place on {device_mesh} with placements "
            f"{list(placements) if placements is not None else 'Replicate()'} was made by "
            f"autograd ({type(tensor.grad_fn).__name__}): pass tensor.detach() for a new "
            f"leaf DTensor, or build it with DTensor.from_local from each rank's piece to "
            f"keep the gradient flowing back to it"
        )
    if isinstance(tensor, DTensor):
        return _placed_already(tensor, device_mesh, placements)
    return place_tensor(tensor, device_mesh, placements, src_data_rank=src_data_rank)


def _placed_already(
    dtensor: DTensor, mesh: DeviceMesh, placements: Sequence[Placement] | None
) -> DTensor:
    """``distribute_tensor`` of a DTensor, as PyTorch's: itself where it is already placed so."""
    if dtensor.device_mesh != mesh:
        raise MeshError(
            f"distribute_tensor got a DTensor of shape {list(dtensor.shape)} on "
            f"{dtensor.device_mesh} with placements {list(dtensor.placements)}: it cannot be "
            f"distributed to a different device mesh {mesh}; use dt.redistribute({mesh}, "
            f"placements) to move it there"
        )
    target = validate_placements(
        dtensor.shape, mesh, placements if placements is not None else [Replicate()] * mesh.ndim
    )
    if target != dtensor.placements:
        raise InvalidPlacementError(
            f"distribute_tensor got a DTensor of shape {list(dtensor.shape)} on {mesh} with "
            f"placements {list(dtensor.placements)}: it cannot be distributed to a different "
            f"placements {list(target)}; use dt.redistribute(placements={list(target)})"
        )
    return dtensor


@dynamo_opaque
def place_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """``distribute_tensor`` for shardwise's own layers, which also place tensors autograd made
    (a plain operand among DTensors inside dispatch, a module's input batch): the value is
    placed as a new DTensor with the tensor's ``requires_grad``, no autograd edge back to it."""
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
    source = source_process(tensor.shape, device_mesh, normalized, src_data_rank)
    if not local:  # a process outside the mesh takes no part and holds nothing (PyTorch's rule)
        return DTensor([], spec, requires_grad=tensor.requires_grad)
    if data.is_meta:  # deferred init: meta pieces, materialized later without communication
        return DTensor(
            [component_of(data, spec, d) for d in local], spec, requires_grad=tensor.requires_grad
        )
    if len(owners) > 1 and (source is not None or debug_checks_enabled()):
        fields = {"shape": list(tensor.shape), "dtype": str(tensor.dtype),
                  "placements": repr(list(normalized)), "src_data_rank": src_data_rank}
        move.agree(lambda: f"distribute_tensor of {spec}", device_mesh, "distribute_tensor",
                   fields, data)
    if source is None or len(owners) == 1:
        components = [component_of(data, spec, d).to(device_mesh.device_of(d)) for d in local]
    else:
        components = move.scatter_from(
            lambda: f"distribute_tensor of {spec} from rank {source}",
            device_mesh,
            source,
            lambda d: component_of(data, spec, d),
            [spec.local_shape(d) for d in local],
            data,
        )
    return DTensor(components, spec, requires_grad=tensor.requires_grad)
