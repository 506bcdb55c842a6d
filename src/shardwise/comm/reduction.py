"""Reductions of components in coordinate order, shared by both transports so every mode
reduces in the same order and gives the same bits."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import ShardwiseError


def combine(tensors: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """Reduce in coordinate order, so every mode sums in the same order (avg: the sum)."""
    acc = tensors[0].clone()
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


def finish(acc: torch.Tensor, op: str, n: int) -> torch.Tensor:
    """Turn a combined sum into the average of ``n`` values; other ops are done."""
    if op != "avg":
        return acc
    if acc.is_floating_point() or acc.is_complex():
        return acc.div_(n)
    return torch.div(acc, n, rounding_mode="trunc")


def reduce_terms(tensors: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """The finished reduction of ``tensors`` in the order given."""
    return finish(combine(tensors, op), op, len(tensors))
