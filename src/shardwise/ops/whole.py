"""Ops that run on whole tensors: every DTensor input replicated, every output replicated.

These ops mix positions across the whole tensor in ways that no cheaper sharding keeps exact,
or are rare enough that moving their inputs is the honest price: pairwise distances
(``_pdist_forward``), CTC loss, segment reductions, ``as_strided_scatter`` (strides refer to
the whole tensor's storage), ``block_diag``, ``_chunk_cat``, whole-tensor comparisons
(``equal``, ``allclose``), ``linspace``/``logspace`` with tensor endpoints,
``nonzero_static`` and a few losses with data-dependent reductions (binary
cross entropy, margin losses), forward and backward. Sharded inputs are gathered first (a
collective: explicit mode refuses it unless allowed, as for any op).
"""

from __future__ import annotations

import torch

from ..mesh import DeviceMesh
from .common import input_strategies, replicated_strategy
from .registry import OpSchema, OpStrategy, register_op_strategy

aten = torch.ops.aten

WHOLE_OPS = [
    aten._pdist_forward.default, aten._pdist_backward.default,
    aten._ctc_loss.default, aten._ctc_loss.Tensor,
    aten._ctc_loss_backward.default, aten._ctc_loss_backward.Tensor,
    aten.segment_reduce.default, aten._segment_reduce_backward.default,
    aten.binary_cross_entropy.default, aten.binary_cross_entropy_backward.default,
    aten.binary_cross_entropy_with_logits.default,
    aten.soft_margin_loss.default, aten.soft_margin_loss_backward.default,
    aten.multi_margin_loss.default, aten.multi_margin_loss_backward.default,
    aten.multilabel_margin_loss_forward.default, aten.multilabel_margin_loss_backward.default,
    aten._unsafe_masked_index.default, aten._unsafe_masked_index_put_accumulate.default,
    aten.as_strided_scatter.default,
    aten.block_diag.default, aten._chunk_cat.default,
    aten.allclose.default, aten.equal.default,
    aten.linspace.Tensor_Tensor, aten.linspace.Tensor_Scalar, aten.linspace.Scalar_Tensor,
    aten.logspace.Tensor_Tensor, aten.logspace.Tensor_Scalar, aten.logspace.Scalar_Tensor,
    aten.nonzero_static.default,
    aten._prelu_kernel_backward.default, aten._trilinear.default, aten.dist.default,
]


@register_op_strategy(WHOLE_OPS)
def whole_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """Everything replicated."""
    n_out = max(len(schema.op._schema.returns), 1)
    return replicated_strategy(mesh, len(input_strategies(schema)), n_out)

