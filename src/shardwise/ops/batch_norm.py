"""Batch norm (and instance norm, which runs batch norm on a reshaped input) and group norm,
forward and backward.

Batch norm in training mode normalises each channel with statistics over the batch and spatial
dims. A device holding part of the batch must not use its local statistics: shardwise computes
the global ones, which is what single-device PyTorch gives and what ``SyncBatchNorm`` computes.
The batch-norm aten ops are therefore decomposed on DTensors: per-channel sums over the batch
and spatial dims come out Partial where those dims are sharded and are all-reduced (C values per
statistic, two all-reduces forward and two backward, like SyncBatchNorm), everything else is
pointwise and stays sharded like the input. A channel-sharded input needs no communication. The
running statistics are updated with the global batch statistics.

Group norm normalises each (sample, group) on its own, so its batch dim may be sharded; its
``N`` argument becomes the device's local batch size.
"""

from __future__ import annotations

from typing import Any

import torch

from ..dtensor import DTensor
from ..factories import distribute_tensor
from ..mesh import DeviceMesh
from ..placements import Partial, Replicate, Shard
from ..spec import DTensorSpec
from .common import DimOption, input_strategies, nonempty_shards, product_strategy
from .registry import (
    OpSchema,
    OpStrategy,
    RuntimeSchemaInfo,
    bypass_dispatch,
    register_local_args,
    register_op_strategy,
)

aten = torch.ops.aten
R = Replicate()
P = Partial("sum")


# ----- batch norm: statistics on DTensors --------------------------------------------------------


def _settled(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its Partial placements reduced (all-reduce of a per-channel statistic)."""
    if not isinstance(t, DTensor) or not any(p.is_partial() for p in t.placements):
        return t
    placements = [R if p.is_partial() else p for p in t.placements]
    return t.redistribute(t.device_mesh, placements)


def _placed_like(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``t`` laid out like the running statistic ``ref`` it updates in place (a channel-sharded
    batch gives channel-sharded statistics; replicated running statistics gather them)."""
    if isinstance(t, DTensor) and isinstance(ref, DTensor) and t.placements != ref.placements:
        return t.redistribute(ref.device_mesh, ref.placements)
    return t


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0] + list(range(2, x.ndim))


def _per_channel(t: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """A (C,) tensor viewed to broadcast against ``x`` (N, C, *)."""
    if t is None:
        return None
    return aten.view.default(t, [1, -1] + [1] * (x.ndim - 2))


def _count(x: torch.Tensor) -> int:
    return x.numel() // x.shape[1]


def _channel_sum(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The global per-channel sum of ``t`` (shaped like ``x``), kept broadcastable."""
    return _settled(aten.sum.dim_IntList(t, _reduce_dims(x), True))


def _empty_like_stat(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The empty statistic a batch norm returns when it saves none (eval mode)."""
    empty = torch.empty(0, dtype=dtype or x.dtype)
    if isinstance(x, DTensor):
        return distribute_tensor(empty, x.device_mesh, [R] * x.device_mesh.ndim)
    return empty


def batch_norm_forward(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``native_batch_norm`` on DTensors with global statistics: (out, save_mean,
    save_invstd); the running statistics are updated in place when training."""
    if training:
        n = _count(x)
        mean = _channel_sum(x, x) / n
        centered = x - mean
        var = _channel_sum(centered * centered, x) / n
        invstd = aten.rsqrt.default(var + eps)
        if running_mean is not None:
            update = _placed_like(aten.view.default(mean, [-1]) * momentum, running_mean)
            running_mean.mul_(1 - momentum).add_(update)
        if running_var is not None:
            unbiased = aten.view.default(var, [-1]) * (n / max(n - 1, 1))
            running_var.mul_(1 - momentum).add_(_placed_like(unbiased * momentum, running_var))
        save_mean, save_invstd = aten.view.default(mean, [-1]), aten.view.default(invstd, [-1])
    else:
        centered = x - _per_channel(running_mean, x)
        invstd = aten.rsqrt.default(_per_channel(running_var, x) + eps)
        save_mean, save_invstd = _empty_like_stat(x), _empty_like_stat(x)
    out = centered * invstd
    if weight is not None:
        out = out * _per_channel(weight, x)
    if bias is not None:
        out = out + _per_channel(bias, x)
    return out, save_mean, save_invstd


def batch_norm_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    save_mean: torch.Tensor | None,
    save_invstd: torch.Tensor | None,
    training: bool,
    eps: float,
    output_mask: list[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``native_batch_norm_backward`` on DTensors: the two per-channel gradient sums are
    global (all-reduced), the rest is pointwise."""
    if training:
        mean, invstd = _per_channel(save_mean, x), _per_channel(save_invstd, x)
    else:
        mean = _per_channel(running_mean, x)
        invstd = aten.rsqrt.default(_per_channel(running_var, x) + eps)
    xhat = (x - mean) * invstd
    sum_g = _channel_sum(grad, x)
    sum_gx = _channel_sum(grad * xhat, x)
    scale = invstd if weight is None else invstd * _per_channel(weight, x)
    grad_input = None
    if output_mask[0]:
        if training:
            n = _count(x)
            grad_input = (grad - sum_g / n - xhat * (sum_gx / n)) * scale
        else:
            grad_input = grad * scale
    grad_weight = aten.view.default(sum_gx, [-1]) if output_mask[1] else None
    grad_bias = aten.view.default(sum_g, [-1]) if output_mask[2] else None
    return grad_input, grad_weight, grad_bias


def _native_batch_norm(op: Any, args: tuple, kwargs: dict) -> Any:
    """Global batch statistics: per-channel sums all-reduced where the batch or spatial dims
    are sharded; the running statistics updated with them."""
    return batch_norm_forward(*args, **kwargs)


def _legit(op: Any, args: tuple, kwargs: dict) -> Any:
    """``_native_batch_norm_legit`` (with running stats or ``.no_stats``)."""
    if op is aten._native_batch_norm_legit.no_stats:
        x, w, b, training, momentum, eps = args
        return batch_norm_forward(x, w, b, None, None, training, momentum, eps)
    return batch_norm_forward(*args, **kwargs)


def _legit_no_training(op: Any, args: tuple, kwargs: dict) -> Any:
    """Eval mode: normalised with the running statistics, elementwise."""
    x, w, b, rm, rv, momentum, eps = args
    return batch_norm_forward(x, w, b, rm, rv, False, momentum, eps)


def _with_update(op: Any, args: tuple, kwargs: dict) -> Any:
    """``_batch_norm_with_update``/``_batch_norm_no_update``: four outputs, the last an empty
    reserve buffer."""
    x, w, b, rm, rv, momentum, eps = args
    training = op is aten._batch_norm_with_update.default or rm is None
    out = batch_norm_forward(x, w, b, rm, rv, training, momentum, eps)
    return (*out, _empty_like_stat(x, torch.uint8))


def _native_backward(op: Any, args: tuple, kwargs: dict) -> Any:
    """Global per-channel gradient sums (all-reduced where the batch or spatial dims are
    sharded), the rest elementwise."""
    return batch_norm_backward(*args, **kwargs)


def _backward_with_reserve(op: Any, args: tuple, kwargs: dict) -> Any:
    """``batch_norm_backward(..., update, eps, output_mask, reserve)``."""
    return batch_norm_backward(*args[:10])


bypass_dispatch(aten.native_batch_norm.default, _native_batch_norm)
bypass_dispatch(
    [aten._native_batch_norm_legit.default, aten._native_batch_norm_legit.no_stats], _legit
)
bypass_dispatch(aten._native_batch_norm_legit_no_training.default, _legit_no_training)
bypass_dispatch(
    [aten._batch_norm_with_update.default, aten._batch_norm_no_update.default], _with_update
)
bypass_dispatch(aten.native_batch_norm_backward.default, _native_backward)
bypass_dispatch(aten.batch_norm_backward.default, _backward_with_reserve)


# ----- group norm --------------------------------------------------------------------------------


@register_op_strategy(aten.native_group_norm.default, schema_info=RuntimeSchemaInfo(3))
def group_norm_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``native_group_norm(input, weight?, bias?, N, C, HxW, group, eps) -> (out, mean,
    rstd)``: batch-sharded input (weight and bias replicated) gives batch-sharded outputs."""
    inputs = input_strategies(schema)
    n_params = len(inputs) - 1
    options: list[DimOption] = [
        ((R,) * len(inputs), (R, R, R)),
        ((Shard(0),) + (R,) * n_params, (Shard(0),) * 3),
    ]
    valid = nonempty_shards(mesh, [s.shape for s in inputs])
    return product_strategy(mesh, options, multi=True, valid=valid)


@register_op_strategy(aten.native_group_norm_backward.default, schema_info=RuntimeSchemaInfo(5))
def group_norm_backward_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``native_group_norm_backward(grad, input, mean, rstd, weight?, N, C, HxW, group,
    output_mask)``: batch-sharded pass gives a sharded grad_input and Partial weight and bias
    gradients; linear in grad."""
    inputs = input_strategies(schema)
    n_params = len(inputs) - 4
    options: list[DimOption] = [
        ((R,) * len(inputs), (R, R, R)),
        ((Shard(0),) * 4 + (R,) * n_params, (Shard(0), P, P)),
        ((P,) + (R,) * (len(inputs) - 1), (P, P, P)),
    ]
    valid = nonempty_shards(mesh, [s.shape for s in inputs])
    return product_strategy(mesh, options, multi=True, valid=valid)


def _local_batch(n_at: int, input_at: int):
    """Argument ``n_at`` (the global batch size N) becomes the local one of argument
    ``input_at``."""

    def hook(args: tuple, kwargs: dict, in_specs: list[DTensorSpec], out_spec, device: int):
        args = list(args)
        args[n_at] = args[input_at].shape[0]
        return tuple(args), kwargs

    return hook


register_local_args(aten.native_group_norm.default, _local_batch(3, 0))
register_local_args(aten.native_group_norm_backward.default, _local_batch(5, 1))
