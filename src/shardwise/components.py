"""A DTensor's components seen from outside it: ``Local`` (what this program holds of a
DTensor, the one way the layers above read and replace a DTensor's pieces and spec; dtensor.py
exports it), the one wrapper builder, the components ``from_local`` is given (checked, placed on
their devices, the global shape and stride inferred from them by PyTorch's rules), a global
tensor's piece for one device, where ``distribute_tensor`` takes its values from, and the specs
a DTensor may hold (Partials with a meaning for the dtype, gradient placements)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from .comm.reduction import reduce_op_problem
from .errors import DTensorAsLocalError, InvalidArgumentError, InvalidPlacementError, PackError
from .geometry import extract_local
from .mesh import DeviceMesh
from .placements import Partial, Placement, RaggedShard, Shard
from .spec import DTensorSpec, TensorMeta, contiguous_meta, validate_placements
from .torch_compat import make_wrapper_subclass


class DTensor(Protocol):
    """The DTensor whose fields these functions read and replace (named by its shape here:
    dtensor.py imports this module, and nothing imports back)."""

    _spec: DTensorSpec
    _components: list[torch.Tensor]


class Local:
    """The ``pieces`` of a DTensor this program holds (one per local device, ascending id,
    exactly as held: a Partial dim's unreduced) and its ``spec``. The layers above read and
    build DTensors through it, never through a DTensor's fields."""

    __slots__ = ("pieces", "spec")

    def __init__(self, pieces: Sequence[torch.Tensor], spec: DTensorSpec) -> None:
        self.pieces, self.spec = pieces, spec

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor],
            spec: DTensorSpec | None = None) -> Local:
        """Every piece through ``fn``, with ``spec`` when given."""
        return Local([fn(p) for p in self.pieces], self.spec if spec is None else spec)

    def zip(self, other: Local | Sequence[torch.Tensor], fn: Callable[..., Any]) -> list:
        """``fn(piece, other piece)`` per local device."""
        theirs = other.pieces if isinstance(other, Local) else other
        return [fn(a, b) for a, b in zip(self.pieces, theirs, strict=True)]

    def replace(self, pieces: Sequence[torch.Tensor] | None = None,
                spec: DTensorSpec | None = None) -> Local:
        """This value with other ``pieces`` and/or ``spec``."""
        return Local(self.pieces if pieces is None else pieces, self.spec if spec is None else spec)

    def by_device(self) -> dict[int, torch.Tensor]:
        """Local device id -> its piece."""
        return dict(zip(self.spec.mesh.local_device_ids, self.pieces, strict=True))


def local_of(dtensor: DTensor) -> Local:
    """What this program holds of ``dtensor`` (no autograd edge: ``local_components`` has)."""
    return Local(dtensor._components, dtensor._spec)


def set_local(dtensor: DTensor, local: Local) -> None:
    """``dtensor`` holds ``local`` from now on, in place (a written argument an op moved, a
    storage made its own, an in-place view or resize: the caller keeps the wrapper's own sizes
    in step)."""
    dtensor._components = list(local.pieces)
    dtensor._spec = local.spec


_make_wrapper = make_wrapper_subclass
_strided = torch.strided


def new_wrapper(
    cls: type,
    spec: DTensorSpec,
    device: torch.device,
    requires_grad: bool = False,
    pieces: Sequence[torch.Tensor] = (),
) -> Any:
    """The one wrapper builder of every DTensor route (``DTensor()``, dispatch's outputs,
    pending DTensors): an instance of ``cls`` with ``spec``'s global shape, stride and dtype,
    holding nothing yet (the caller sets its pieces). Its ``storage_offset()`` is that of the
    local tensor, as PyTorch's DTensor answers, when ``pieces`` is one tensor (this process's
    one device); with several pieces, or none yet, there is no one local tensor: 0."""
    meta = spec.tensor_meta
    offset = pieces[0].storage_offset() if len(pieces) == 1 else 0
    # positionally: size, strides, offset, format, dtype, layout, device, pin, requires_grad
    out = _make_wrapper(cls, meta.shape, meta.stride, offset, None, meta.dtype, _strided,
                        device, False, requires_grad)
    out._spec = spec
    return out


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


def grad_placements_spec(
    spec: DTensorSpec, grad_placements: Sequence[Placement], what: str
) -> DTensorSpec:
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


def with_dtype(spec: DTensorSpec, dtype: torch.dtype) -> TensorMeta:
    meta = spec.tensor_meta
    return TensorMeta(meta.shape, meta.stride, dtype)


def outside_spec(
    local: Any, mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int] | None
) -> DTensorSpec:
    """The spec of ``from_local`` on a process that owns no device of ``mesh`` (PyTorch's
    non-participating rank): nothing is held or sent; the global shape is ``shape``, or
    ``local``'s as if every device held a piece of that shape."""
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
    return DTensorSpec(mesh, normalized, contiguous_meta(shape, local.dtype))


def as_components(
    local: torch.Tensor | Sequence[torch.Tensor],
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    wrapper: type,
) -> list[torch.Tensor]:
    """``local`` (one tensor, or one per local device) as this process's components, each on
    its device; ``wrapper`` (DTensor) is refused as a component."""
    n_local = len(mesh.local_device_ids)
    if isinstance(local, wrapper):
        raise DTensorAsLocalError(
            f"from_local/pack: the local_tensor argument only accepts torch.Tensor, got a "
            f"DTensor {local}; pass its local components (to_local())"
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
        if isinstance(c, wrapper) or not isinstance(c, torch.Tensor):
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
        if not c.is_meta:  # meta components stay meta (deferred init, as PyTorch's)
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


def spec_from_components(
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
        meta = TensorMeta(meta.shape, global_stride(components[0], mesh, normalized, shape),
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


def global_stride(
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


def component_of(tensor: torch.Tensor, spec: DTensorSpec, device: int) -> torch.Tensor:
    """Device ``device``'s piece of the global ``tensor``: its slice; for Partial("sum") dims
    the first device of the mesh dim keeps the value and the others hold zeros."""
    piece = extract_local(tensor, spec.local_segments(device))
    coord = spec.mesh.coordinate_of(device)
    for m, p in enumerate(spec.placements):
        if isinstance(p, Partial) and p.zeros_elsewhere and coord[m] != 0:
            return torch.zeros_like(piece)
    return piece.clone(memory_format=torch.contiguous_format)


def source_process(
    shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement],
    src_data_rank: int | None,
) -> int | None:
    """The process whose values ``distribute_tensor(src_data_rank=...)`` gives every device
    (the owner of the device at index ``src_data_rank`` of every mesh dim); None for None."""
    if src_data_rank is not None and (
        isinstance(src_data_rank, bool)
        or not isinstance(src_data_rank, int)
        or not 0 <= src_data_rank < min(mesh.shape)
    ):
        raise InvalidArgumentError(
            f"distribute_tensor: src_data_rank={src_data_rank!r} must be None or a rank within "
            f"each mesh dim of {mesh} (0..{min(mesh.shape) - 1}, as in PyTorch: "
            f"the values come from the device at that index of every dim); tensor shape "
            f"{list(shape)}, placements {list(placements)}"
        )
    if src_data_rank is None:
        return None
    flat = 0
    for size in mesh.shape:  # row-major index of coordinate (k, k, ..., k)
        flat = flat * size + src_data_rank
    return mesh.owner_of(mesh.device_ids[flat])
