"""Sorting ops: ``sort``, ``topk`` and ``unique`` (``aten._unique2``, gathered: Replicate).

``sort`` and ``topk`` run per device along a dim that is whole on every device: other dims may
stay sharded, a sharded sort dim is gathered first (then the indices are global positions). A
Partial input is reduced first: order is not linear.
"""

from __future__ import annotations

import torch

from ..mesh import DeviceMesh
from ..placements import Placement, Replicate, Shard
from .common import DimOption, bind_schema, input_strategies, product_strategy, run_replicated
from .registry import OpSchema, OpStrategy, RuntimeSchemaInfo, bypass_dispatch, register_op_strategy

aten = torch.ops.aten

SORT_OPS = [aten.sort.default, aten.sort.stable, aten.topk.default]


@register_op_strategy(SORT_OPS, schema_info=RuntimeSchemaInfo(1, ("dim", "stable", "descending")))
def sort_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """Values and indices share one layout: per mesh dim, the input's current shard when it is
    not on the sort dim (interleaved shards included), any other dim's plain shard, or
    Replicate."""
    arg = input_strategies(schema)[0]
    ndim = arg.ndim
    dim = bind_schema(schema)["dim"] % max(ndim, 1)
    current = arg.output_spec.placements

    def options(m: int) -> list[DimOption]:
        candidates: list[Placement] = [Replicate()]
        candidates += [Shard(d) for d in range(ndim) if d != dim]
        here = current[m]
        if isinstance(here, Shard) and here.dim != dim and here not in candidates:
            candidates.append(here)
        return [((p,), (p, p)) for p in candidates]

    return product_strategy(mesh, options, multi=True)


# ``torch.unique``'s ``_unique2``: the output size depends on the data, so the input is
# gathered (a collective: explicit mode refuses it unless allowed) and every output (values,
# inverse, counts) is Replicate.
bypass_dispatch(aten._unique2.default, run_replicated)
