"""float16/bfloat16 sums and means round once, as torch's do.

torch accumulates a half-precision sum in float32 and rounds the result once. A sharded sum
that kept a Partial half-precision result would round every device's piece first (and a sum of
pieces that cancel can lose every digit), so these ops run in float32 (``dtype=float32`` on the
local kernels), reduce their float32 Partial mesh dims at once (one all-reduce of the result,
counted like any collective, in every mode: it is the op's own reduction, not a move of its
inputs) and round the reduced value to the input's dtype. The result is Replicate on those
mesh dims and equals torch's.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm.reduction import LOW_PRECISION
from ..dtensor import DTensor
from ..placements import Replicate
from ..redistribute import execute_plan, plan_redistribute
from ..spec import DTensorSpec, TensorMeta
from .registry import register_post_patch, register_pre_patch

aten = torch.ops.aten
SUMS = [aten.sum.default, aten.sum.dim_IntList, aten.nansum.default]


class _RoundTo(dict):
    """The keyword arguments of a half-precision sum run in float32, remembering the dtype to
    round the result to (the post-patch reads it from them, so no state outlives the call)."""

    dtype: torch.dtype


def round_once(result: DTensor, dtype: torch.dtype) -> DTensor:
    """``result`` (float32) with its Partial mesh dims reduced, rounded to ``dtype`` once."""
    spec = result._spec
    target = tuple(Replicate() if p.is_partial() else p for p in spec.placements)
    components = result._components
    if target != spec.placements:
        components = execute_plan(plan_redistribute(spec, target), spec.mesh, components)
    meta = TensorMeta(spec.tensor_meta.shape, spec.tensor_meta.stride, dtype)
    return DTensor([c.to(dtype) for c in components], DTensorSpec(spec.mesh, target, meta))


def _in_float32(op: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    x = args[0]
    if kwargs.get("dtype") is not None or x.dtype not in LOW_PRECISION:
        return args, kwargs
    marked = _RoundTo(kwargs, dtype=torch.float32)
    marked.dtype = x.dtype
    return args, marked


def _rounded(op: Any, result: Any, args: tuple, kwargs: dict) -> Any:
    if isinstance(kwargs, _RoundTo) and isinstance(result, DTensor):
        return round_once(result, kwargs.dtype)
    return result


register_pre_patch(SUMS, _in_float32)
register_post_patch(SUMS, _rounded)
