"""Ops on a tensor's storage: ``as_strided`` and ``as_strided_copy`` (a view, or copy, that
addresses the storage by explicit sizes, strides and offset), ``resize_`` and ``resize_as_``
(a new shape over the same storage elements, in storage order).

The storage of a DTensor is that of its global value laid out with the DTensor's strides from
offset 0, as single-device torch holds a tensor that is not a view of a larger one. Every
device holds that storage whole: the input is replicated first (a gather for a sharded one,
under the explicit-redistribution rule), and the output is Replicate. A component already laid
out so is used as is, so an ``as_strided`` output aliases it (autograd's ``as_strided``
backward writes through such views); another is first copied into that layout. An ``as_strided`` to
the DTensor's own size, strides and offset is an alias (a clone for ``as_strided_copy``) with
its placements, nothing moved, as PyTorch's. A view of a
larger tensor (a slice) addresses its base's storage, which no DTensor tracks:
``UnsupportedOpError``. Elements a ``resize_`` adds are zeros on every device (torch leaves
them uninitialized; the replicas must agree).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..dtensor import DTensor, Local, set_local
from ..errors import UnsupportedOpError
from ..op_inputs import redistribute_inputs
from ..spec import DTensorSpec, make_tensor_meta
from ..torch_compat import DisableTorchDispatch
from .common import bind, replicate
from .registry import bypass_dispatch

aten = torch.ops.aten


def _dense(shape: torch.Size, stride: tuple[int, ...]) -> bool:
    """Strides that address ``prod(shape)`` consecutive elements, each once."""
    expected = 1
    for size, step in sorted(zip(shape, stride, strict=True), key=lambda p: p[1]):
        if size == 1:
            continue
        if step != expected:
            return False
        expected *= size
    return True


def _storage_view(component: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """``component`` laid out with ``stride`` from offset 0 of a storage of its own size."""
    if (
        tuple(component.stride()) == stride
        and component.storage_offset() == 0
        and component.untyped_storage().nbytes() == component.numel() * component.element_size()
    ):
        return component
    out = torch.empty_strided(component.shape, stride, dtype=component.dtype,
                              device=component.device)
    return out.copy_(component)


def _storages(op: Any, self: DTensor) -> list[torch.Tensor]:
    """Each local device's copy of ``self``'s storage (``self`` laid out by its strides)."""
    stride = tuple(self.stride())
    base = self._base if self._is_view() else None
    if (base is not None and base.numel() != self.numel()) or not _dense(self.shape, stride):
        source = f"a view of a tensor of shape {list(base.shape)}" if base is not None else (
            f"strides {list(stride)} that overlap or leave gaps"
        )
        raise UnsupportedOpError(
            f"{op} of a DTensor of shape {list(self.shape)} with {source}: it addresses a "
            f"storage no device holds; call it on x.contiguous()"
        )
    (components,) = redistribute_inputs(op, [self], [replicate(self.device_mesh)])
    return [_storage_view(c, stride) for c in components]


def _as_strided(op: Any, args: tuple, kwargs: dict) -> DTensor:
    bound = bind(op, args, kwargs)
    self: DTensor = bound["self"]
    mesh = self.device_mesh
    offset = bound.get("storage_offset")
    if (tuple(bound["size"]) == tuple(self.shape) and tuple(bound["stride"]) == self.stride()
            and offset in (None, self.storage_offset())):
        # its own size, strides and offset: ``self`` again (an alias, or a clone), as placed
        return aten.alias.default(self) if op is aten.as_strided.default else self.clone()
    local = [
        aten.as_strided.default(c, bound["size"], bound["stride"], offset)
        for c in _storages(op, self)
    ]
    if op is aten.as_strided_copy.default:
        local = [t.clone() for t in local]
    return DTensor(local, DTensorSpec(mesh, replicate(mesh), make_tensor_meta(local[0])))


bypass_dispatch([aten.as_strided.default, aten.as_strided_copy.default], _as_strided)


def _resize(op: Any, args: tuple, kwargs: dict) -> DTensor:
    """``self`` takes the new shape in place: the first elements of its storage, in order,
    then zeros; Replicate. Its own shape leaves it as it is, as torch does."""
    bound = bind(op, args, kwargs)
    self: DTensor = bound["self"]
    size = list(bound["the_template"].shape if op is aten.resize_as_.default else bound["size"])
    if size == list(self.shape):
        return self
    numel = math.prod(size)
    local = []
    for storage in _storages(op, self):
        flat = storage.as_strided((storage.numel(),), (1,), 0)
        out = torch.zeros(numel, dtype=flat.dtype, device=flat.device)
        keep = min(numel, flat.numel())
        out[:keep] = flat[:keep]
        local.append(out.view(size))
    with DisableTorchDispatch():
        aten.resize_.default(self, size)
    mesh = self.device_mesh
    set_local(self, Local(local, DTensorSpec(mesh, replicate(mesh), make_tensor_meta(local[0]))))
    return self


bypass_dispatch([aten.resize_.default, aten.resize_as_.default], _resize)
