"""Sharding of scaled dot-product attention on CPU: ``_scaled_dot_product_flash_attention_for_cpu``
and its backward (what ``F.scaled_dot_product_attention`` runs for 4-d inputs, causal or with a
mask that needs no gradient, in torch 2.13).

Attention is independent per batch element and per head, so q, k and v sharded alike on the
batch or the head dim give an output (and logsumexp) sharded the same way with no communication,
``is_causal`` included: heads stay sharded, unlike torch 2.13's DTensor. Without a causal mask the
query sequence may also be sharded against replicated k and v (every query row sees every key);
the causal mask is aligned to local row 0, so a query shard would be masked wrongly. The output
is linear in v, and the backward in the output gradient, so Partial v (resp. gradient) with the
rest replicated gives Partial results. An ``attn_mask`` follows the dim it broadcasts against.

The CPU kernel dies with a floating point exception on an empty head or sequence dim, which
uneven shards produce (3 heads on 4 devices): those devices run it on a batch-0 stand-in and a
post-patch gives their (empty, or zero Partial) results the right shape.

Other inputs (3-d, or a mask that needs a gradient) take torch's math variant, a decomposition
into matmuls and softmax that builds its causal mask as a plain tensor: it is registered with
``op_inputs.register_plain_making_decomposition``, so that mask is taken as replicated while an
``attn_mask`` the user passes as a plain tensor is refused.
"""

from __future__ import annotations

from typing import Any

import torch

from ..dtensor import DTensor, local_of
from ..errors import UnsupportedOpError
from ..mesh import DeviceMesh
from ..op_inputs import register_plain_making_decomposition
from ..placements import Placement, Shard
from ..spec import DTensorSpec
from .common import DimOption, P, R, input_strategies, product_strategy
from .registry import (
    OpSchema,
    OpStrategy,
    RuntimeSchemaInfo,
    register_local_args,
    register_op_strategy,
    register_post_patch,
)

aten = torch.ops.aten

FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
BATCH, HEADS, QUERY = 0, 1, 2


def _mask_placement(mask: OpStrategy | None, dim: int | None) -> tuple[Placement, ...]:
    """The mask's placement when q is sharded on ``dim`` (None: not sharded): the mask dim
    aligned with it from the right, replicated where the mask broadcasts (absent or size 1)."""
    if mask is None:
        return ()
    if dim is None:
        return (R,)
    mask_dim = dim - (4 - mask.ndim)
    if mask_dim < 0 or mask.shape[mask_dim] == 1:
        return (R,)
    return (Shard(mask_dim),)


def _check(op: Any, q: OpStrategy, dropout_p: float) -> None:
    if dropout_p:
        raise UnsupportedOpError(
            f"{op} with dropout_p={dropout_p} on DTensors: its random mask would differ from "
            f"one device's; use dropout_p=0 (or F.dropout on the attention weights)"
        )
    if q.ndim != 4:
        raise UnsupportedOpError(f"{op} expects 4-d (batch, heads, seq, dim) q, got {q.shape}")


def _shared_dims(q: OpStrategy, k: OpStrategy, v: OpStrategy) -> list[int]:
    """Batch and head dims whose sizes agree across q, k and v (so they can be split alike)."""
    return [d for d in (BATCH, HEADS) if q.shape[d] == k.shape[d] == v.shape[d]]


@register_op_strategy(FLASH, schema_info=RuntimeSchemaInfo(3))
def flash_attention_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``(q, k, v, dropout_p, is_causal, *, attn_mask, scale) -> (out, logsumexp)``."""
    q, k, v, *rest = input_strategies(schema)
    mask = rest[0] if rest else None
    dropout_p = schema.args_schema[3] if len(schema.args_schema) > 3 else 0.0
    is_causal = schema.args_schema[4] if len(schema.args_schema) > 4 else False
    _check(schema.op, q, dropout_p)
    options: list[DimOption] = [((R, R, R) + _mask_placement(mask, None), (R, R))]
    for d in _shared_dims(q, k, v):
        options.append(((Shard(d),) * 3 + _mask_placement(mask, d), (Shard(d), Shard(d))))
    if not is_causal:
        options.append(((Shard(QUERY), R, R) + _mask_placement(mask, QUERY),
                        (Shard(QUERY), Shard(QUERY))))
    options.append(((R, R, P) + _mask_placement(mask, None), (P, R)))
    return product_strategy(mesh, options, multi=True)


@register_op_strategy(FLASH_BACKWARD, schema_info=RuntimeSchemaInfo(6))
def flash_attention_backward_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``(grad, q, k, v, out, logsumexp, dropout_p, is_causal, *, attn_mask, scale) ->
    (grad_q, grad_k, grad_v)``: batch or heads sharded everywhere; the query sequence sharded
    with k, v replicated gives Partial grad_k/grad_v (sums over the local queries)."""
    _, q, k, v, _, _, *rest = input_strategies(schema)
    mask = rest[0] if rest else None
    dropout_p, is_causal = schema.args_schema[6:8]
    _check(schema.op, q, dropout_p)
    options: list[DimOption] = [((R,) * 6 + _mask_placement(mask, None), (R, R, R))]
    for d in _shared_dims(q, k, v):
        options.append(((Shard(d),) * 6 + _mask_placement(mask, d), (Shard(d),) * 3))
    if not is_causal:
        s = Shard(QUERY)
        options.append(((s, s, R, R, s, s) + _mask_placement(mask, QUERY), (s, P, P)))
    options.append(((P,) + (R,) * 5 + _mask_placement(mask, None), (P, P, P)))
    return product_strategy(mesh, options, multi=True)


def _empty_safe_args(
    args: tuple, kwargs: dict, _specs: list[DTensorSpec], _out: Any, _device: int
) -> tuple[tuple, dict]:
    """On a device whose q or k shard has no heads or no rows, run on a batch-0 stand-in."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    q_at = 1 if len(tensors) == 6 else 0  # the backward's first tensor is the gradient
    q, k = tensors[q_at], tensors[q_at + 1]
    if min(q.shape[HEADS], q.shape[QUERY], k.shape[QUERY]) > 0:
        return args, kwargs

    def stand_in(t: torch.Tensor) -> torch.Tensor:
        return t.new_zeros((0,) + tuple(max(n, 1) for n in t.shape[1:]))

    args = tuple(stand_in(a) if isinstance(a, torch.Tensor) else a for a in args)
    return args, {**kwargs, "attn_mask": None}


def _fix_shapes(_op: Any, result: tuple, _args: tuple, _kwargs: dict) -> tuple:
    """Give stand-in results their local shape (zeros: empty, or a zero Partial term)."""
    fixed = []
    for out in result:
        ids = out.device_mesh.local_device_ids
        held = local_of(out)
        comps = [
            c.new_zeros(held.spec.local_shape(i))
            if c.numel() == 0 and c.shape != held.spec.local_shape(i) else c
            for i, c in zip(ids, held.pieces, strict=True)
        ]
        changed = any(a is not b for a, b in zip(comps, held.pieces, strict=True))
        fixed.append(DTensor(comps, held.spec) if changed else out)
    return tuple(fixed)


for _op in (FLASH, FLASH_BACKWARD):
    register_local_args(_op, _empty_safe_args)
    register_post_patch(_op, _fix_shapes)


# F.scaled_dot_product_attention on inputs the fused kernel does not take (3-d, a mask that
# needs a gradient) runs torch's math variant, which makes its causal mask as a plain tensor
register_plain_making_decomposition(
    aten._scaled_dot_product_attention_math.default, "the causal mask (is_causal=True)"
)
