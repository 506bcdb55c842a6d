"""Recurrent layers: ``nn.LSTM`` on CPU runs one ``aten.mkldnn_rnn_layer`` per layer and
direction (input laid out (seq, batch, feature)).

Op table notes (one line per op):

- ``aten.mkldnn_rnn_layer``: batch split (input dim 1, hx/cx dim 0) stays split with
  replicated weights, unless a device would get no batch rows (the kernel fails on those); the
  hidden state couples every feature, so no other shard. Plain tensors that need no gradient
  (the zero initial states ``nn.LSTM`` creates) count as Replicate. The workspace output is an
  opaque per-device buffer, marked Replicate. The oneDNN kernel reads its tensors as dense
  (a strided input gives wrong numbers, as torch's own callers never pass one), so each
  device's pieces are made contiguous first: a move may leave them as views.
- ``aten.mkldnn_rnn_layer_backward``: batch split gives input/state gradients split and weight
  gradients Partial("sum"); linear in the incoming gradients, so Partial ones pass through.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..dtensor import DTensor
from ..mesh import DeviceMesh
from ..placements import Partial, Placement, Replicate, Shard
from .common import DimOption, no_empty_shard, product_strategy, replicate_plain
from .registry import (
    OpSchema,
    OpStrategy,
    RuntimeSchemaInfo,
    register_local_args,
    register_op_strategy,
    register_pre_patch,
)

aten = torch.ops.aten

# Tensor argument positions of mkldnn_rnn_layer: input, 4 weights, hx, cx.
FORWARD_BATCH = {0: Shard(1), 5: Shard(0), 6: Shard(0)}
# mkldnn_rnn_layer_backward: input, 4 weights, hx, cx, output, hy, cy, grad_output, grad_hy,
# grad_cy, ..., workspace (Replicate, as the forward left it).
BACKWARD_BATCH = {0: Shard(1), 5: Shard(0), 6: Shard(0), 7: Shard(1), 8: Shard(0), 9: Shard(0),
                  10: Shard(1), 11: Shard(0), 12: Shard(0)}
BACKWARD_GRADS = (10, 11, 12)


def _replicate_plain_states(op: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Plain tensors without gradient next to DTensors (the zero initial states) become
    Replicate DTensors: they are the same on every device."""
    mesh = next(a.device_mesh for a in args if isinstance(a, DTensor))
    out = [replicate_plain(mesh, a) for a in args]
    return tuple(out), kwargs


register_pre_patch(
    [aten.mkldnn_rnn_layer.default, aten.mkldnn_rnn_layer_backward.default],
    _replicate_plain_states,
)


def _dense_pieces(
    args: tuple, kwargs: dict, specs: list, outputs: Any, device: int
) -> tuple[tuple, dict]:
    """Each device's tensors contiguous: the oneDNN kernel ignores strides."""
    return tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args), kwargs


register_local_args(
    [aten.mkldnn_rnn_layer.default, aten.mkldnn_rnn_layer_backward.default], _dense_pieces
)


def _tensor_positions(schema: OpSchema) -> list[int]:
    return [i for i, a in enumerate(schema.args_schema) if isinstance(a, OpStrategy)]


def _per_arg(
    positions: list[int], chosen: dict[int, Placement], default: Placement
) -> tuple[Placement, ...]:
    return tuple(chosen.get(i, default) for i in positions)


def _batch_not_empty(
    mesh: DeviceMesh, schema: OpSchema
) -> Callable[[tuple[DimOption, ...]], bool]:
    """The oneDNN kernel fails on an empty batch: no device may get an empty batch shard."""
    x = schema.args_schema[0]

    def valid(combo: tuple[DimOption, ...]) -> bool:
        return no_empty_shard(mesh, x.shape, [c[0][0] for c in combo], [1])

    return valid


@register_op_strategy(aten.mkldnn_rnn_layer.default, schema_info=RuntimeSchemaInfo(7))
def rnn_layer_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """All replicated, or the batch split (weights replicated)."""
    pos = _tensor_positions(schema)
    rep = Replicate()
    options: list[DimOption] = [
        (_per_arg(pos, {}, rep), (rep,) * 4),
        (_per_arg(pos, FORWARD_BATCH, rep), (Shard(1), Shard(0), Shard(0), rep)),
    ]
    return product_strategy(mesh, options, multi=True, valid=_batch_not_empty(mesh, schema))


@register_op_strategy(aten.mkldnn_rnn_layer_backward.default, schema_info=RuntimeSchemaInfo(13))
def rnn_layer_backward_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """Batch split: gradients of input and states split, of weights summed (Partial); with
    Partial incoming gradients (all else replicated) every gradient is Partial. The workspace
    stays Replicate, as the forward marked it."""
    pos = _tensor_positions(schema)
    rep = Replicate()
    grads_partial = {g: Partial() for g in BACKWARD_GRADS}
    options: list[DimOption] = [
        (_per_arg(pos, {}, rep), (rep,) * 7),
        (_per_arg(pos, BACKWARD_BATCH, rep), (Shard(1),) + (Partial(),) * 4 + (Shard(0),) * 2),
        (_per_arg(pos, grads_partial, rep), (Partial(),) * 7),
    ]
    return product_strategy(mesh, options, multi=True, valid=_batch_not_empty(mesh, schema))
