"""Sharding of ``aten.embedding`` and ``aten.embedding_dense_backward``.

Per mesh dim an embedding lookup can run four ways:

- weight and indices replicated: a replicated output;
- indices sharded on a dim, weight replicated: the output sharded on that (leading) dim;
- weight sharded on the embedding dim (``Shard(1)``): the output sharded on its last dim;
- weight sharded on the vocabulary (``Shard(0)``), indices replicated: every device looks up the
  indices that fall in its rows and writes zeros elsewhere, so the output is ``Partial("sum")``
  (vocabulary-parallel embedding, as in Megatron and PyTorch's ``_MaskPartial``).

The masked lookup needs per-device arguments: a local-args hook shifts the indices into the
device's rows (clamped, so the kernel stays in bounds) and a post-patch zeroes the looked-up rows
of indices that belong to other devices. The backward mirrors it: the weight gradient's
vocabulary shard is computed from the gradient rows whose index falls in the device's rows.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ..dtensor import DTensor, local_of
from ..geometry import shard_segments
from ..mesh import DeviceMesh
from ..placements import Shard
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


class _Masks(threading.local):
    """Per-device masks (device id -> bool tensor of in-range indices) of the embedding call
    being dispatched, handed from the local-args hook to the post-patch."""

    def __init__(self) -> None:
        self.by_device: dict[int, torch.Tensor] = {}


_masks = _Masks()


def _vocab_rows(
    mesh: DeviceMesh, placements: tuple, shape: tuple[int, int], device: int
) -> tuple[int, int] | None:
    """(first row, row count) of the weight held by ``device`` when ``placements`` shard the
    vocabulary dim, else None."""
    if not any(isinstance(p, Shard) and p.dim == 0 for p in placements):
        return None
    runs = shard_segments(shape, mesh.shape, placements, mesh.coordinate_of(device))[0]
    start = runs[0][0] if runs else 0
    return start, sum(stop - begin for begin, stop in runs)


def _local_indices(
    indices: torch.Tensor, start: int, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices shifted into the device's rows and clamped in bounds, and the in-range mask."""
    mask = (indices >= start) & (indices < start + rows)
    return (indices - start).clamp(0, max(rows - 1, 0)), mask


@register_op_strategy(aten.embedding.default, schema_info=RuntimeSchemaInfo(2))
def embedding_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse)``."""
    _, indices = input_strategies(schema)
    options: list[DimOption] = [((R, R), (R,))]
    options += [((R, Shard(d)), (Shard(d),)) for d in range(indices.ndim)]
    options.append(((Shard(1), R), (Shard(indices.ndim),)))
    options.append(((Shard(0), R), (P,)))
    return product_strategy(mesh, options)


def _embedding_local_args(
    args: tuple, kwargs: dict, specs: list[DTensorSpec], _out: Any, device: int
) -> tuple[tuple, dict]:
    """Vocabulary-sharded weight: look up local rows and remember which indices were local."""
    if device == specs[0].mesh.local_device_ids[0]:
        _masks.by_device.clear()
    weight_spec = specs[0]
    rows = _vocab_rows(weight_spec.mesh, weight_spec.placements, tuple(weight_spec.shape), device)
    if rows is None:
        return args, kwargs
    weight, indices = args[0], args[1]
    local, mask = _local_indices(indices, *rows)
    _masks.by_device[device] = mask
    if rows[1] == 0:  # an empty vocabulary shard: look up a zero row instead
        weight = weight.new_zeros((1, weight.shape[1]))
    return (weight, local, *args[2:]), kwargs


def _embedding_post_patch(_op: Any, result: DTensor, _args: tuple, _kwargs: dict) -> DTensor:
    """Zero the looked-up rows of indices that another device's vocabulary shard holds."""
    if _masks.by_device:
        for device, component in zip(result.device_mesh.local_device_ids, local_of(result).pieces,
                                      strict=True):
            component.masked_fill_(~_masks.by_device[device].unsqueeze(-1), 0)
        _masks.by_device.clear()
    return result


def _vocab_sharded(specs: list[DTensorSpec], _out: Any) -> bool:
    """The hooks apply only when the weight's vocabulary is split over more than one device."""
    weight = specs[0]
    return any(
        isinstance(p, Shard) and p.dim == 0 and n > 1
        for p, n in zip(weight.placements, weight.mesh.shape, strict=True)
    )


register_local_args(aten.embedding.default, _embedding_local_args, applies=_vocab_sharded)
register_post_patch(aten.embedding.default, _embedding_post_patch, applies=_vocab_sharded)


@register_op_strategy(aten.embedding_dense_backward.default, schema_info=RuntimeSchemaInfo(2))
def embedding_backward_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq)``.

    Batch-sharded grad and indices give a Partial weight gradient; a grad sharded on its last
    dim gives the embedding-dim shard; replicated ones can give the vocabulary shard directly
    (listed before the replicated result, so a vocabulary-sharded weight gets a matching
    gradient for free), except with ``scale_grad_by_freq``, whose counts the clamped indices
    would skew. Linear in grad, so a Partial grad gives a Partial gradient.
    """
    grad, indices = input_strategies(schema)
    scale_grad_by_freq = schema.args_schema[4]
    options: list[DimOption] = []
    if not scale_grad_by_freq:
        options.append(((R, R), (Shard(0),)))
    options.append(((R, R), (R,)))
    options += [((Shard(d), Shard(d)), (P,)) for d in range(indices.ndim)]
    options.append(((Shard(grad.ndim - 1), R), (Shard(1),)))
    options.append(((P, R), (P,)))
    return product_strategy(mesh, options)


def _embedding_backward_local_args(
    args: tuple, kwargs: dict, specs: list[DTensorSpec], out: DTensorSpec, device: int
) -> tuple[tuple, dict]:
    """Vocabulary-sharded gradient: accumulate only the rows of local indices."""
    grad, indices, num_weights, padding_idx = args[:4]
    rows = _vocab_rows(out.mesh, out.placements, (num_weights, grad.shape[-1]), device)
    if rows is None:
        return args, kwargs
    start, count = rows
    local, mask = _local_indices(indices, start, count)
    grad = grad.masked_fill(~mask.unsqueeze(-1), 0)
    local_padding = padding_idx - start if start <= padding_idx < start + count else -1
    if count == 0:  # no rows here: every index is the padding index, nothing is written
        local, local_padding = torch.zeros_like(local), 0
    return (grad, local, count, local_padding, *args[4:]), kwargs


register_local_args(aten.embedding_dense_backward.default, _embedding_backward_local_args)
