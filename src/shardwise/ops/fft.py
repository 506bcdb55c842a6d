"""Sharding strategies of the FFTs (``aten._fft_r2c``, ``_fft_c2c``, ``_fft_c2r``: every
``torch.fft`` function decomposes into these).

An FFT over some dims is independent along the others: those may be sharded (the output keeps
the shard, its size there unchanged), the transformed dims stay whole. FFTs are linear (over
the reals, so the real-to-complex and complex-to-real ones too): a Partial("sum") input gives a
Partial("sum") output. No device gets an empty shard (the FFT kernels refuse empty input).
"""

from __future__ import annotations

import torch

from ..mesh import DeviceMesh
from .common import (
    axis_options,
    input_strategies,
    linear_option,
    nonempty_shards,
    product_strategy,
)
from .registry import OpSchema, OpStrategy, RuntimeSchemaInfo, register_op_strategy

aten = torch.ops.aten

FFT_OPS = [aten._fft_r2c.default, aten._fft_c2c.default, aten._fft_c2r.default]


@register_op_strategy(FFT_OPS, schema_info=RuntimeSchemaInfo(1))
def fft_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``_fft_*(self, dim, normalization, ...)``: any dim not in ``dim`` sharded alike on
    input and output; linear."""
    (x,) = input_strategies(schema)
    transformed = {d % max(x.ndim, 1) for d in schema.args_schema[1]}
    kept = [[d for d in range(x.ndim) if d not in transformed]]
    options = axis_options(kept, kept) + [linear_option(1, 1, [0])]
    return product_strategy(mesh, options, valid=nonempty_shards(mesh, [x.shape]))  # MKL
