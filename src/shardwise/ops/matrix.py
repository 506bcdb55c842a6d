"""Sharding of matrix products: mm, bmm, mv, dot and their biased forms addmm, baddbmm, addmv.

``matmul``, ``linear`` and ``einsum`` decompose into these plus views (ops/views.py). Each
product is described by index labels ("mk,kn->mn"); on one mesh dim a strategy shards one
label on every operand that has it: a kept label shards the output the same way, a contracted
label leaves every device a partial sum (the seed's Shard(1) x Shard(0) -> Partial). Products
are linear in each operand, so one Partial("sum"/"avg") operand times Replicate ones gives the
same Partial. A bias follows the output; for a Partial output it is Partial too (Replicate ->
Partial is free: for sum one device keeps the bias and the others add zeros), so it is counted
once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..mesh import DeviceMesh
from ..placements import Partial, Placement, Replicate, Shard, is_special_shard, with_dim
from ..spec import DTensorSpec
from .common import DimOption, input_strategies, product_strategy, same_kind
from .registry import OpSchema, OpStrategy, RuntimeSchemaInfo, register_op_strategy

aten = torch.ops.aten

# operand labels and output labels of each product
EQUATIONS: dict[object, tuple[tuple[str, ...], str]] = {
    aten.mm.default: (("mk", "kn"), "mn"),
    aten.bmm.default: (("bmk", "bkn"), "bmn"),
    aten.mv.default: (("mk", "k"), "m"),
    aten.dot.default: (("k", "k"), ""),
}
BIASED = {
    aten.addmm.default: aten.mm.default,
    aten.baddbmm.default: aten.bmm.default,
    aten.addmv.default: aten.mv.default,
}
LINEAR_PARTIALS = ("sum", "avg")

def _shard_kinds(current: Sequence[Placement]) -> list[Shard]:
    """Shard kinds to try on a mesh dim: plain Shard, and the interleaved or ragged shards the
    operands carry (moved to each operand's dim of the label by ``with_dim``; the shapes
    check drops those that do not fit)."""
    return [Shard(0), *dict.fromkeys(p for p in current if is_special_shard(p))]


def mesh_dim_choices(
    labels: Sequence[str], out: str, current: Sequence[Placement]
) -> list[tuple[tuple[Placement, ...], Placement]]:
    """Every valid placement of the operands and output of a product on one mesh dim."""
    rep = Replicate()
    choices = [((rep,) * len(labels), rep)]
    for letter in dict.fromkeys("".join(labels)):
        for k in _shard_kinds(current):
            ins = tuple(with_dim(k, lbl.index(letter)) if letter in lbl else rep for lbl in labels)
            result = with_dim(k, out.index(letter)) if letter in out else Partial("sum")
            choices.append((ins, result))
    for op in LINEAR_PARTIALS:
        if any(isinstance(p, Partial) and p.reduce_op == op for p in current):
            for i in range(len(labels)):
                ins = tuple(Partial(op) if j == i else rep for j in range(len(labels)))
                choices.append((ins, Partial(op)))
    return choices


def _bias_placement(p: Placement, bias_shape: Sequence[int], out_shape: Sequence[int]) -> Placement:
    """The bias placement matching output placement ``p`` under broadcasting."""
    if not isinstance(p, Shard):
        return p
    dim = p.dim - (len(out_shape) - len(bias_shape))
    if dim < 0 or bias_shape[dim] != out_shape[p.dim]:
        return Replicate()
    return same_kind(p, dim)


def contraction_strategies(
    mesh: DeviceMesh,
    labels: Sequence[str],
    out: str,
    operands: Sequence[DTensorSpec],
    bias: DTensorSpec | None = None,
    partial_sum: bool = True,
) -> OpStrategy:
    """All strategies of a product (with its bias first when given), cheapest-to-keep first;
    ``partial_sum=False`` drops Partial("sum") outputs (a plain bias would be added n times)."""
    sizes = {c: n for lbl, spec in zip(labels, operands, strict=True)
             for c, n in zip(lbl, spec.shape, strict=True)}
    out_shape = [sizes[c] for c in out]

    def options(m: int) -> list[DimOption]:
        current = [s.placements[m] for s in operands]
        if bias is not None:
            current.append(bias.placements[m])
        found: list[DimOption] = []
        for ins, result in mesh_dim_choices(labels, out, current):
            if not partial_sum and result == Partial("sum"):
                continue
            if bias is not None:
                ins = (_bias_placement(result, bias.shape, out_shape), *ins)
            found.append((ins, (result,)))
        return found

    shapes = ([bias.shape] if bias is not None else []) + [s.shape for s in operands]
    return product_strategy(mesh, options, shapes=shapes)


@register_op_strategy(list(EQUATIONS), schema_info=RuntimeSchemaInfo())
def mm_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """mm, bmm, mv, dot: shard kept labels, contract sharded labels to Partial("sum")."""
    labels, out = EQUATIONS[schema.op]
    operands = [s.output_spec for s in input_strategies(schema)]
    return contraction_strategies(mesh, labels, out, operands)


@register_op_strategy(list(BIASED), schema_info=RuntimeSchemaInfo())
def biased_product_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """addmm, baddbmm, addmv: the product's strategies with the bias following the output."""
    labels, out = EQUATIONS[BIASED[schema.op]]
    specs = [s.output_spec for s in input_strategies(schema)]
    if len(specs) == len(labels):  # the bias is a plain scalar tensor, the same on every device
        return contraction_strategies(mesh, labels, out, specs, partial_sum=False)
    return contraction_strategies(mesh, labels, out, specs[1:], specs[0])


# vdot (conjugate-linear in its first operand: a pending sum still sums), addr (the outer
# product plus a bias) and addbmm (the batch contracted too: "bmk,bkn->mn") reuse the above.
EQUATIONS[aten.vdot.default] = EQUATIONS[aten.dot.default]
EQUATIONS["outer"] = (("m", "n"), "mn")
EQUATIONS["batch_contracted"] = (("bmk", "bkn"), "mn")
BIASED[aten.addr.default] = "outer"
BIASED[aten.addbmm.default] = "batch_contracted"
register_op_strategy([aten.vdot.default], schema_info=RuntimeSchemaInfo())(mm_strategy)
register_op_strategy([aten.addr.default, aten.addbmm.default], schema_info=RuntimeSchemaInfo())(
    biased_product_strategy
)
