"""The reduction rules, shared by both transports and by sharding rules, in one place:

- which reduce ops a dtype has: ``avg`` needs a floating or complex dtype (the mean of integers
  or bools is not one of them, and ``torch.mean`` refuses them too), ``max``/``min`` need an
  ordered (non-complex) dtype;
- how partial values accumulate: in coordinate order, so every mode gives the same bits, and
  float16/bfloat16 sums in float32, rounded once at the end, as torch's own reductions do;
- which dtype casts a pending reduction survives (``cast_keeps_partial``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ..errors import ShardwiseError
from ..placements import norm_order
from ..spec import LOW_PRECISION


def _is_inexact(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def reduce_op_problem(op: str, dtype: torch.dtype) -> str | None:
    """Why values of ``dtype`` cannot be pending the reduction ``op``, or None if they can."""
    if op == "avg" and not _is_inexact(dtype):
        return (
            f"Partial('avg') needs a floating or complex dtype, not {dtype}: the mean of "
            f"{dtype} values is not a {dtype} (torch.mean refuses them too); convert to a "
            f"floating dtype first, or use Partial('sum')"
        )
    if op in ("max", "min") and dtype.is_complex:
        return f"Partial({op!r}) needs an ordered dtype, but complex {dtype} values have no order"
    if norm_order(op) is not None and not dtype.is_floating_point:
        return f"Partial({op!r}) holds pending norms, which need a real floating dtype, not {dtype}"
    return None


def accumulation_dtype(dtype: torch.dtype, op: str) -> torch.dtype:
    """The dtype partial values of ``dtype`` are combined in (float32 for half sums)."""
    return torch.float32 if dtype in LOW_PRECISION and op in ("sum", "avg") else dtype


def combine(tensors: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """Reduce in coordinate order, so every mode sums in the same order (avg: the sum), in the
    accumulation dtype; ``finish`` rounds to the values' dtype once."""
    acc = tensors[0].to(accumulation_dtype(tensors[0].dtype, op), copy=True)
    for t in tensors[1:]:
        t = t.to(acc.device)
        if op in ("sum", "avg"):
            acc.add_(t)
        elif op == "max":
            torch.maximum(acc, t, out=acc)
        elif op == "min":
            torch.minimum(acc, t, out=acc)
        else:
            raise ShardwiseError(f"unknown reduce op {op!r}; use sum, avg, max or min")
    return acc


def finish(acc: torch.Tensor, op: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The reduced value of ``dtype``: a combined sum divided by ``n`` for avg, rounded once."""
    if op == "avg":
        acc = acc.div_(n)
    return acc if acc.dtype == dtype else acc.to(dtype)


_FLOAT_WIDTH = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
_COMPLEX_WIDTH = {torch.complex32: 1, torch.complex64: 2, torch.complex128: 3}


def _widens_exactly(src: torch.dtype, dst: torch.dtype) -> bool:
    """Every ``src`` value is a ``dst`` value and ``dst`` has at least the range and precision
    of ``src``, so casting before or after an addition differs only by ``src``'s rounding."""
    if src in _FLOAT_WIDTH and dst in _FLOAT_WIDTH:
        if {src, dst} == {torch.float16, torch.bfloat16}:
            return False  # neither holds the other (range vs precision)
        return _FLOAT_WIDTH[dst] >= _FLOAT_WIDTH[src]
    if src in _FLOAT_WIDTH and dst in _COMPLEX_WIDTH:
        return _COMPLEX_WIDTH[dst] >= _FLOAT_WIDTH[src] and src != torch.bfloat16
    if src in _COMPLEX_WIDTH and dst in _COMPLEX_WIDTH:
        return _COMPLEX_WIDTH[dst] >= _COMPLEX_WIDTH[src]
    return False


def cast_keeps_partial(op: str, src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether a value pending reduction ``op`` may be cast from ``src`` to ``dst`` piece by
    piece (the result stays pending). A sum or average survives only a widening float or
    complex cast (a narrowing cast could overflow or round each piece, an integer one could
    wrap differently); max and min survive a monotonic cast that keeps NaN: to a floating
    dtype, or to an integer dtype that holds every ``src`` value. Other casts must reduce first."""
    if src == dst:
        return True
    if reduce_op_problem(op, dst) is not None:
        return False
    if op in ("sum", "avg") or norm_order(op) is not None:
        return _widens_exactly(src, dst)
    if src.is_complex or dst.is_complex or torch.bool in (src, dst):
        return False
    if dst.is_floating_point:
        return True  # rounding is monotonic, NaN stays NaN
    return not src.is_floating_point and torch.promote_types(src, dst) == dst


def reduce_terms(tensors: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """The finished reduction of ``tensors`` in the order given (a p-norm: ``norm_terms``)."""
    norm = norm_terms(op)
    if norm is not None:
        base, before, after = norm
        return after(reduce_terms([before(t) for t in tensors], base), tensors[0].dtype)
    return finish(combine(tensors, op), op, len(tensors), tensors[0].dtype)


def norm_terms(op: str) -> tuple[str, Callable, Callable] | None:
    """For a pending p-norm reduce op (``"norm<p>"``), the plain reduce op its pieces go
    through and the transforms around it: |x|^p in float32 or wider before, the p-th root
    (and the pieces' dtype) after; None for other ops. p = 1 needs only the sum of |x|, p = inf
    the max of |x|."""
    p = norm_order(op)
    if p is None:
        return None
    if p == math.inf:
        return "max", torch.abs, lambda t, dtype: t.to(dtype)

    def before(t: torch.Tensor) -> torch.Tensor:
        wide = t.abs().to(torch.promote_types(t.dtype, torch.float32))
        return wide if p == 1 else wide.pow_(p)

    def after(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (t if p == 1 else t.pow(1 / p)).to(dtype)

    return "sum", before, after
