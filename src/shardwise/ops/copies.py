"""The ``*_copy`` variants of view ops (``view_copy``, ``permute_copy``, ``transpose_copy``,
``unbind_copy``...: what functionalisation emits), the other non-aliasing variants
(``unsafe_split``, the functional ``fill``) and ``unfold``.

A ``*_copy`` op has the value of its view op without aliasing, so on DTensors it runs as the
view op (sharded by the views family's strategies, with their local-size rewriting) followed by
a clone. ``unfold(self, dimension, size, step)`` gathers windows along ``dimension`` into a new
last dim: every other dim may be sharded alike on input and output, and it is linear; so is
its backward, whose global ``input_sizes`` become the device's.
"""

from __future__ import annotations

from typing import Any

import torch

from ..dtensor import DTensor
from ..mesh import DeviceMesh
from ..spec import DTensorSpec
from ..torch_compat import pytree
from .common import axis_options, input_strategies, linear_option, product_strategy
from .registry import (
    OpSchema,
    OpStrategy,
    RuntimeSchemaInfo,
    bypass_dispatch,
    register_local_args,
    register_op_strategy,
)

aten = torch.ops.aten

COPY_OF = {
    aten.expand_copy.default: aten.expand.default,
    aten.alias_copy.default: aten.alias.default,
    aten.view_copy.default: aten.view.default,
    aten.view_copy.dtype: aten.view.dtype,
    aten.permute_copy.default: aten.permute.default,
    aten.t_copy.default: aten.t.default,
    aten.transpose_copy.int: aten.transpose.int,
    aten.squeeze_copy.default: aten.squeeze.default,
    aten.squeeze_copy.dim: aten.squeeze.dim,
    aten.squeeze_copy.dims: aten.squeeze.dims,
    aten.unsqueeze_copy.default: aten.unsqueeze.default,
    aten.unbind_copy.int: aten.unbind.int,
    aten.split_copy.Tensor: aten.split.Tensor,
    aten.split_with_sizes_copy.default: aten.split_with_sizes.default,
    aten.unfold_copy.default: aten.unfold.default,
    aten.select_copy.int: aten.select.int,
    aten.slice_copy.Tensor: aten.slice.Tensor,
    aten.detach_copy.default: aten.detach.default,
    aten.view_as_real_copy.default: aten.view_as_real.default,
    aten.view_as_complex_copy.default: aten.view_as_complex.default,
}


def _as_view_then_clone(op: Any, args: tuple, kwargs: dict) -> Any:
    """The view op, sharded as views are, then a clone (no aliasing)."""
    out = COPY_OF[op](*args, **kwargs)
    return pytree.tree_map_only(DTensor, aten.clone.default, out)


def _narrow_copy(op: Any, args: tuple, kwargs: dict) -> Any:
    """``narrow_copy(self, dim, start, length)``: the slice [start, start + length)."""
    x, dim, start, length = args
    return aten.clone.default(aten.slice.Tensor(x, dim, start, start + length))


def _unsafe_split(op: Any, args: tuple, kwargs: dict) -> Any:
    """``unsafe_split``/``unsafe_split_with_sizes``: ``split`` without the aliasing checks."""
    safe = aten.split.Tensor if op is aten.unsafe_split.Tensor else aten.split_with_sizes.default
    return [aten.clone.default(t) for t in safe(*args, **kwargs)]


def _fill(op: Any, args: tuple, kwargs: dict) -> Any:
    """``fill(self, value)``: a filled copy (``fill_`` on a clone)."""
    inplace = aten.fill_.Scalar if op is aten.fill.Scalar else aten.fill_.Tensor
    return inplace(aten.clone.default(args[0]), *args[1:], **kwargs)


bypass_dispatch(list(COPY_OF), _as_view_then_clone)
bypass_dispatch(aten.narrow_copy.default, _narrow_copy)
bypass_dispatch([aten.unsafe_split.Tensor, aten.unsafe_split_with_sizes.default], _unsafe_split)
bypass_dispatch([aten.fill.Scalar, aten.fill.Tensor], _fill)


@register_op_strategy(aten.unfold.default, schema_info=RuntimeSchemaInfo(1))
def unfold_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``unfold(self, dimension, size, step)``: any dim but ``dimension`` sharded alike (the
    output's windows are its new last dim); linear."""
    (x,) = input_strategies(schema)
    dim = schema.args_schema[1] % max(x.ndim, 1)
    dims = [[d for d in range(x.ndim) if d != dim]]
    return product_strategy(mesh, axis_options(dims, dims) + [linear_option(1, 1, [0])])


@register_op_strategy(aten.unfold_backward.default, schema_info=RuntimeSchemaInfo(1))
def unfold_backward_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``unfold_backward(grad, input_sizes, dim, size, step)``: the dims but ``dim`` (and the
    windows' last dim) sharded alike on grad and result; linear."""
    (grad,) = input_strategies(schema)
    ndim = grad.ndim - 1
    dim = schema.args_schema[2] % max(ndim, 1)
    dims = [[d for d in range(ndim) if d != dim]]
    return product_strategy(mesh, axis_options(dims, dims) + [linear_option(1, 1, [0])])


def _unfold_backward_local(
    args: tuple, kwargs: dict, in_specs: list[DTensorSpec], out_spec, device: int
) -> tuple[tuple, dict]:
    grad, sizes, dim = args[0], list(args[1]), args[2] % max(len(args[1]), 1)
    sizes = [s if d == dim else grad.shape[d] for d, s in enumerate(sizes)]
    return (grad, sizes, *args[2:]), kwargs


register_local_args(aten.unfold_backward.default, _unfold_backward_local)
