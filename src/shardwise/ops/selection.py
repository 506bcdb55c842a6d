"""Sharding strategies of order statistics along a dim (``median``/``nanmedian`` with a dim,
``kthvalue`` and ``mode``: values and indices; the whole-tensor ``median``/``nanmedian``) and of
searches in sorted or given values (``bucketize``, ``searchsorted``, ``isin``).

Each runs per slice along ``dim``: ``dim`` stays whole, every other dim may be sharded alike on
the input and both outputs (shifted down past ``dim`` unless ``keepdim``). The indices are
positions along the whole ``dim``, so they are global. Order statistics are not linear: a
Partial input is reduced first. The whole-tensor median needs every element: replicated.
"""

from __future__ import annotations

import torch

from ..mesh import DeviceMesh
from .common import axis_options, input_strategies, product_strategy, replicated_strategy
from .registry import OpSchema, OpStrategy, RuntimeSchemaInfo, register_op_strategy

aten = torch.ops.aten

# op -> position of ``dim`` (``kthvalue(self, k, dim, keepdim)``)
DIM_AT = {
    aten.median.dim: 1, aten.nanmedian.dim: 1, aten.mode.default: 1, aten.kthvalue.default: 2,
}
DEFAULTS = {aten.mode.default: -1, aten.kthvalue.default: -1}


@register_op_strategy(list(DIM_AT), schema_info=RuntimeSchemaInfo(1))
def order_statistic_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """Any dim but ``dim`` sharded alike on input, values and indices."""
    (x,) = input_strategies(schema)
    at = DIM_AT[schema.op]
    args = schema.args_schema
    dim = args[at] if len(args) > at else schema.kwargs_schema.get("dim", DEFAULTS[schema.op])
    keepdim = args[at + 1] if len(args) > at + 1 else schema.kwargs_schema.get("keepdim", False)
    dim = dim % max(x.ndim, 1)
    kept = [d for d in range(x.ndim) if d != dim]
    out = kept if keepdim else [d if d < dim else d - 1 for d in kept]
    return product_strategy(mesh, axis_options([kept], [out, out]), multi=True)


@register_op_strategy([aten.median.default, aten.nanmedian.default])
def whole_median_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """The median of every element: the input is gathered."""
    return replicated_strategy(mesh, 1, 1)


# ----- searches --------------------------------------------------------------------------------


@register_op_strategy(
    [aten.bucketize.Tensor, aten.isin.Tensor_Tensor, aten.isin.Tensor_Scalar],
    schema_info=RuntimeSchemaInfo(1),
)
def search_elements_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``bucketize(self, boundaries)``, ``isin(elements, test_elements)``: each element is
    looked up on its own, so ``self`` may be sharded on any dim (the output alike) while the
    boundaries or test elements stay replicated."""
    inputs = input_strategies(schema)
    dims = list(range(inputs[0].ndim))
    in_dims: list[list[int | None]] = [dims] + [[None] * len(dims)] * (len(inputs) - 1)
    return product_strategy(mesh, axis_options(in_dims, [dims]))


@register_op_strategy(aten.searchsorted.Tensor, schema_info=RuntimeSchemaInfo(2))
def searchsorted_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``searchsorted(sorted_sequence, self, ...)``: the values' last dim may be sharded with
    the sequence replicated; with a batched sequence, the batch dims alike on both (the
    sequence's last dim stays whole)."""
    inputs = input_strategies(schema)
    seq, values = inputs[0], inputs[1]
    if seq.ndim == 1:
        dims = list(range(values.ndim))
        in_dims: list[list[int | None]] = [[None] * len(dims), dims]
        out = dims
    else:
        batch = list(range(seq.ndim - 1))
        in_dims = [batch + [None], batch + [values.ndim - 1]]
        out = batch + [values.ndim - 1]
    in_dims += [[None] * len(out)] * (len(inputs) - 2)  # a sorter is replicated
    return product_strategy(mesh, axis_options(in_dims, [out]))
