"""Sharding of the negative log-likelihood losses (``F.cross_entropy`` is ``_log_softmax`` and
then one of these): ``nll_loss_forward``/``nll_loss_backward`` for ``(N, C)`` inputs and
``nll_loss2d_forward``/``nll_loss2d_backward`` for ``(N, C, H, W)``.

The class dim stays whole; the batch dims (N, and H, W for the 2d loss) may be sharded together
with the target's. Per reduction, with a sharded batch:

- ``none``: the per-element loss is sharded like the batch;
- ``sum``: local sums are ``Partial("sum")``, and so is ``total_weight``;
- ``mean``: the loss is ``Partial("avg")``, PyTorch's encoding, whose pieces are the local
  means when every device holds as much weight. PyTorch takes the local means as they are, which
  is wrong on uneven shards (it refuses them) and wherever ``ignore_index`` or class weights
  leave the devices different weights (it does not notice). shardwise keeps the value exact: each
  device sums locally (a local-args hook turns the reduction into ``sum``), then a post-patch
  all-reduces ``total_weight`` (one scalar, counted like any collective) and makes each piece
  ``local sum * D / total weight`` (``D`` devices averaged over), which is the local mean in
  PyTorch's case. ``total_weight`` comes out replicated (PyTorch leaves it ``Partial("sum")``):
  the backward needs it whole, so it is not reduced twice.

The loss is linear in its input, so a Partial input with replicated target gives a Partial loss.

The elementwise losses (``mse_loss``, ``smooth_l1_loss``, ``huber_loss``) shard like pointwise
ops; ``mean`` over a sharded input is ``Partial("avg")`` of the local means on even shards (as in
PyTorch) and, on uneven ones, each device sums and divides by the global element count (static,
``Partial("sum")``), so they need no communication at all.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..dtensor import DTensor, build, local_of
from ..mesh import DeviceMesh
from ..placements import Partial, Placement, Replicate, Shard
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
AVG = Partial("avg")

MEAN, SUM = 1, 2  # at::Reduction
REDUCTION_ARG = 3  # position of ``reduction`` in both forward ops

FORWARD_OPS = [aten.nll_loss_forward.default, aten.nll_loss2d_forward.default]
BACKWARD_OPS = [aten.nll_loss_backward.default, aten.nll_loss2d_backward.default]


def _batch_dims(input_ndim: int) -> list[tuple[int, int]]:
    """(input dim, target dim) pairs that may be sharded together: every dim but the class dim
    (1) of a batched input; none for an unbatched ``(C,)`` input."""
    if input_ndim < 2:
        return []
    return [(0, 0)] + [(d, d - 1) for d in range(2, input_ndim)]


@register_op_strategy(FORWARD_OPS, schema_info=RuntimeSchemaInfo(3))
def nll_loss_forward_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``nll_loss_forward(input, target, weight?, reduction, ignore_index) -> (loss,
    total_weight)``."""
    inputs = input_strategies(schema)
    reduction = schema.args_schema[REDUCTION_ARG]
    extra = (R,) * (len(inputs) - 2)  # the class weight, if any, is replicated
    options: list[DimOption] = [((R, R) + extra, (R, R))]
    for d, t in _batch_dims(inputs[0].ndim):
        loss = {MEAN: AVG, SUM: P}.get(reduction, Shard(t))
        total = P if reduction in (MEAN, SUM) else R
        options.append(((Shard(d), Shard(t)) + extra, (loss, total)))
    options.append(((P, R) + extra, (P, R)))
    return product_strategy(mesh, options, multi=True)


def _nll_forward_local_args(
    args: tuple, kwargs: dict, specs: list[DTensorSpec], _out: Any, _device: int
) -> tuple[tuple, dict]:
    """A sharded batch with ``mean``: sum locally (the post-patch divides by the global weight)."""
    if args[REDUCTION_ARG] == MEAN and any(isinstance(p, Shard) for p in specs[0].placements):
        args = (*args[:REDUCTION_ARG], SUM, *args[REDUCTION_ARG + 1 :])
    return args, kwargs


def _nll_forward_post_patch(
    _op: Any, result: tuple[DTensor, DTensor], args: tuple, _kwargs: dict
) -> tuple[DTensor, DTensor]:
    """Finish a batch-sharded ``mean``: all-reduce ``total_weight`` (one scalar) and make each
    device's loss ``local sum * D / global weight``, ``D`` the devices averaged over: the
    ``Partial("avg")`` pieces then average to the exact weighted mean, and each is the local
    mean whenever the devices' weights are equal (PyTorch's case)."""
    loss, total = result
    if args[REDUCTION_ARG] != MEAN or not any(p.is_partial() for p in total.placements):
        return result
    placements: list[Placement] = [Replicate() if p.is_partial() else p for p in total.placements]
    total = total.redistribute(placements=placements)
    mesh = loss.device_mesh
    averaged = math.prod(mesh.shape[m] for m, p in enumerate(loss.placements) if p == AVG)
    held = local_of(loss)
    scaled = held.zip(local_of(total), lambda s, w: s * averaged / w)
    return DTensor(scaled, held.spec), total


for _op in FORWARD_OPS:
    register_local_args(_op, _nll_forward_local_args)
    register_post_patch(_op, _nll_forward_post_patch)


@register_op_strategy(BACKWARD_OPS, schema_info=RuntimeSchemaInfo(4))
def nll_loss_backward_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``nll_loss_backward(grad, input, target, weight?, reduction, ignore_index, total_weight)``.

    Only ``mean`` reads ``total_weight`` (it must then be the global, replicated one); for the
    other reductions it stays wherever it is. The input's values are not read, only its shape.
    """
    inputs = input_strategies(schema)
    reduction = schema.args_schema[4]
    total_now = inputs[-1].output_spec.placements
    extra = (R,) * (len(inputs) - 4)  # the class weight, if any

    def options(mesh_dim: int) -> list[DimOption]:
        total = R if reduction == MEAN else total_now[mesh_dim]
        opts: list[DimOption] = [((R, R, R) + extra + (total,), (R,))]
        for d, t in _batch_dims(inputs[1].ndim):
            grad = Shard(t) if reduction not in (MEAN, SUM) else R
            opts.append(((grad, Shard(d), Shard(t)) + extra + (total,), (Shard(d),)))
        opts.append(((P, R, R) + extra + (total,), (P,)))
        return opts

    return product_strategy(mesh, options)


# ----- elementwise losses (mse, smooth_l1, huber) ----------------------------------------------

ELEMENTWISE_OPS = [aten.mse_loss.default, aten.smooth_l1_loss.default, aten.huber_loss.default]
ELEMENTWISE_BACKWARD_OPS = [
    aten.mse_loss_backward.default,
    aten.smooth_l1_loss_backward.default,
    aten.huber_loss_backward.default,
]


def _reduction(args: tuple, kwargs: dict, at: int) -> int:
    """The ``reduction`` argument, which callers may leave at its default (mean)."""
    if len(args) > at:
        return args[at]
    return kwargs.get("reduction", MEAN)


@register_op_strategy(ELEMENTWISE_OPS, schema_info=RuntimeSchemaInfo(2))
def elementwise_loss_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``mse_loss(input, target, reduction, ...)``: input and target sharded alike on any dim give
    a sharded loss (``none``) or a pending one: ``sum`` is ``Partial("sum")`` of local sums;
    ``mean`` is ``Partial("avg")`` of the local means, as in PyTorch's DTensor, where every
    device holds as many elements, and on uneven shards (where PyTorch gathers) ``Partial("sum")``
    of local sums over the global element count: exact, and no communication either way."""
    inputs, target = input_strategies(schema)
    reduction = _reduction(schema.args_schema, schema.kwargs_schema, 2)
    options: list[DimOption] = [((R, R), (R,))]
    if inputs.shape == target.shape:
        for d in range(inputs.ndim):
            if reduction not in (MEAN, SUM):
                options.append(((Shard(d), Shard(d)), (Shard(d),)))
            else:
                options.append(((Shard(d), Shard(d)), (P,)))
            if reduction == MEAN:
                options.append(((Shard(d), Shard(d)), (AVG,)))
    if reduction != MEAN:
        return product_strategy(mesh, options)
    spec = inputs.output_spec

    def valid(combo: tuple[DimOption, ...]) -> bool:
        made = {c[1][0].reduce_op for c in combo if isinstance(c[1][0], Partial)}
        if not made:
            return True
        ins = spec.with_placements(tuple(c[0][0] for c in combo))
        even = len({math.prod(ins.local_shape(d)) for d in mesh.device_ids}) == 1
        return made == {"avg" if even else "sum"}

    return product_strategy(mesh, options, valid=valid)


def _sums_locally(specs: list[DTensorSpec], output: Any) -> bool:
    """A sharded ``mean`` left as ``Partial("sum")`` (uneven shards): sum, then divide."""
    return any(isinstance(p, Shard) for p in specs[0].placements) and any(
        isinstance(q, Partial) and q.reduce_op == "sum" for q in output.placements
    )


def _elementwise_local_args(
    args: tuple, kwargs: dict, specs: list[DTensorSpec], _out: Any, _device: int
) -> tuple[tuple, dict]:
    """A ``mean`` over uneven shards: sum locally (the post-patch divides by the global count)."""
    if _reduction(args, kwargs, 2) == MEAN:
        if len(args) > 2:
            return (*args[:2], SUM, *args[3:]), kwargs
        return args, {**kwargs, "reduction": SUM}
    return args, kwargs


def _elementwise_post_patch(_op: Any, result: DTensor, args: tuple, kwargs: dict) -> DTensor:
    """Finish a ``mean`` over uneven shards: divide the local sums by the global element count."""
    if _reduction(args, kwargs, 2) != MEAN:
        return result
    count = args[0].numel()
    return build(local_of(result).map(lambda c: c / count))


for _op in ELEMENTWISE_OPS:
    register_local_args(_op, _elementwise_local_args, applies=_sums_locally)
    register_post_patch(_op, _elementwise_post_patch, applies=_sums_locally)


@register_op_strategy(ELEMENTWISE_BACKWARD_OPS, schema_info=RuntimeSchemaInfo(3))
def elementwise_loss_backward_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``mse_loss_backward(grad, input, target, reduction, ...)``: input and target sharded alike
    (grad too for ``none``) give a gradient sharded the same way; linear in grad, so a Partial
    grad with the rest replicated gives a Partial gradient."""
    _, inputs, target = input_strategies(schema)
    reduction = schema.args_schema[3]
    options: list[DimOption] = [((R, R, R), (R,)), ((P, R, R), (P,))]
    if inputs.shape == target.shape:
        for d in range(inputs.ndim):
            grad = Shard(d) if reduction not in (MEAN, SUM) else R
            options.append(((grad, Shard(d), Shard(d)), (Shard(d),)))
    return product_strategy(mesh, options)


def _elementwise_backward_local_args(
    args: tuple, kwargs: dict, specs: list[DTensorSpec], _out: Any, _device: int
) -> tuple[tuple, dict]:
    """A sharded ``mean``: the kernel divides by the local count; rescale grad to the global."""
    grad, local = args[0], args[1]
    if args[3] == MEAN and any(isinstance(p, Shard) for p in specs[1].placements):
        grad = grad * (local.numel() / max(specs[1].shape.numel(), 1))
        return (grad, *args[1:]), kwargs
    return args, kwargs


register_local_args(ELEMENTWISE_BACKWARD_OPS, _elementwise_backward_local_args)


# ----- torch's chunked linear_cross_entropy (custom ops of torch.nn) -----------------------------


def _chunked_linear_cross_entropy_ops() -> list[Any]:
    """The custom ops ``F.linear_cross_entropy`` runs in its chunked mode (torch >= 2.13)."""
    try:
        import torch.nn.modules.linear_cross_entropy  # defines the ops
    except ImportError:
        return []
    names = ("_linear_cross_entropy_batch_chunked",
             "_linear_cross_entropy_batch_chunked_no_reduction")
    return [getattr(torch.ops.torch_nn, n).default for n in names
            if hasattr(torch.ops.torch_nn, n)]


CHUNKED_LCE_OPS = _chunked_linear_cross_entropy_ops()


@register_op_strategy(CHUNKED_LCE_OPS, schema_info=RuntimeSchemaInfo(5))
def chunked_linear_cross_entropy_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """Rows of ``input`` sharded with the target (the linear weight, bias and class weights
    replicated): ``reduction="none"`` gives the per-row loss sharded alike; ``sum`` gives the
    loss and the weight and bias gradients ``Partial("sum")`` and the input gradient sharded.
    Otherwise (``mean``, one row) everything replicated. The backward of ``none`` (torch's
    accumulator in Python, with out= matmuls) is not supported: shardwise runs no out= ops."""
    inputs = input_strategies(schema)
    x, target = inputs[0], inputs[2]
    multi = len(schema.op._schema.returns) > 1
    reduction = schema.args_schema[5] if multi else "none"
    n_out = 4 if multi else 1
    options: list[DimOption] = [((R,) * len(inputs), (R,) * n_out)]
    batch = (Shard(0), R, Shard(0), *[R] * (len(inputs) - 3))
    if x.ndim == 2 and target.ndim == 1:
        if not multi:
            options.append((batch, (Shard(0),)))
        elif reduction == "sum":
            options.append((batch, (P, Shard(0), P, P)))
    return product_strategy(mesh, options, multi=multi)
