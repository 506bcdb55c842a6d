"""float16/bfloat16 values pending a sum accumulate in float32 and round once, as torch's do.

torch accumulates half-precision sums and matrix products in float32 and rounds the result
once. A sharded op whose output is left pending a sum (``Partial("sum")``/``("avg")``: a sum over
a sharded dim, a row-parallel matmul, a conv over sharded channels, ``Partial + Partial``...)
would round every device's piece first, and pieces that cancel could overflow or lose every
digit. So such a DTensor keeps its dtype but holds float32 components
(``DTensorSpec.component_dtype``): dispatch runs the local kernels of an op with such an output
in float32, a redistribution reduces the float32 pieces (moving, and pricing, 4 bytes an
element) and rounds once when no sum is pending any more, and ``to_local``/``local_components``
round the pieces they return. Ops that divide after summing (``mean``) hand their float32 result
over with ``held_as``, so the division happens before the rounding too.
"""

from __future__ import annotations

import torch

from ..dtensor import DTensor, build, local_of
from ..spec import DTensorSpec, TensorMeta


def held_as(result: DTensor, dtype: torch.dtype) -> DTensor:
    """``result`` (float32) as a DTensor of ``dtype`` with the same placements and no
    communication: float32 pieces are kept where a sum is pending, rounded once otherwise."""
    held = local_of(result)
    spec = held.spec
    meta = TensorMeta(spec.tensor_meta.shape, spec.tensor_meta.stride, dtype)
    return build(held.replace(spec=DTensorSpec(spec.mesh, spec.placements, meta)))
