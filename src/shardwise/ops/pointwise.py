"""Pointwise ops: unary, binary and ternary math, comparisons, ``where``, ``clamp``,
``masked_fill``, their in-place variants and the ``*_backward`` ops autograd emits for them.

One generic strategy (``pointwise_strategy``) lists, per mesh dim, every way an elementwise op
can run without communication: all Replicate; Shard (or the inputs' InterleavedShard or
RaggedShard: equal sizes stay sharded, others move) of an output dim,
with every input that has that dim at full size sharded alike and the broadcast ones
replicated; and the Partial placements the op passes through. Partial passes through an op
when the op is linear in a group of its arguments (``add``, ``mul`` by a replicated factor,
``where``, the gradient argument of a ``*_backward``...) -- Partial("sum") when the op is
linear, Partial("avg") already when it is affine -- and Partial("max"/"min") through ops
monotone in one argument (``exp``, ``relu``, adding a replicated tensor...). Dispatch picks
the candidate cheapest to reach, so a nonlinear op reduces its Partial inputs first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..mesh import DeviceMesh
from ..placements import (
    Partial,
    Placement,
    Replicate,
    Shard,
    is_special_shard,
    with_dim,
)
from ..torch_compat import elementwise_prims
from .common import DimOption, is_inplace, keep_self_inplace, product_strategy
from .out_variants import register_out_variants
from .registry import (
    OpSchema,
    OpStrategy,
    RuntimeSchemaInfo,
    register_deferred,
    register_op_strategy,
)

aten = torch.ops.aten

_SWAP = {"max": "min", "min": "max"}


@dataclass(frozen=True)
class Linearity:
    """Which Partial placements an op lets through.

    ``groups``: argument positions in which the op is jointly linear with the other arguments
    fixed (``add``: ``((0, 1),)``; ``mul``: ``((0,), (1,))``). All DTensors of a group are
    Partial with the same reduce op and the other DTensors Replicate. A group that contains
    a non-DTensor value (a Python scalar, a plain 0-d tensor) makes the op only affine in the
    rest, which Partial("avg") allows but Partial("sum") does not -- unless that value is a
    zero that is part of the sharding cache key (a position at or after ``static_argnum``).

    ``monotone``: ``(position, +1 or -1)`` pairs: the op is non-decreasing (+1) or
    non-increasing (-1) in that argument over all reals, so Partial("max")/("min") there (all
    other DTensors Replicate) gives Partial("max")/("min") (swapped when -1).

    ``alpha_at``: the position that the op's ``alpha`` argument scales (``add``, ``sub``):
    a negative alpha flips its direction and a zero one makes it constant. Register such ops
    with ``alpha`` in the cache key.
    """

    groups: tuple[tuple[int, ...], ...] = ()
    monotone: tuple[tuple[int, int], ...] = ()
    alpha_at: int | None = None
    # the op is this reduce op itself ("max" for maximum): every DTensor Partial(it) on a
    # mesh dim gives Partial(it), as max(max_i a_i, max_i b_i) = max_i max(a_i, b_i)
    same_reduction: str | None = None


NONLINEAR = Linearity()


def _tensor_args(schema: OpSchema) -> list[tuple[int | str, OpStrategy]]:
    """The DTensor arguments in dispatch's flattened order, each with its position (an index
    into ``args_schema``, or a keyword name)."""
    out: list[tuple[int | str, OpStrategy]] = []
    for i, a in enumerate(schema.args_schema):
        if isinstance(a, OpStrategy):
            out.append((i, a))
        elif isinstance(a, (list, tuple)):
            out.extend((i, x) for x in a if isinstance(x, OpStrategy))
    out.extend((k, v) for k, v in schema.kwargs_schema.items() if isinstance(v, OpStrategy))
    return out


def _plain_shapes(schema: OpSchema) -> list[torch.Size]:
    """Shapes of plain tensor arguments (0-d ones only reach a strategy) for broadcasting."""
    values = list(schema.args_schema) + list(schema.kwargs_schema.values())
    return [v.shape for v in values if isinstance(v, torch.Tensor)]


def _is_zero_constant(schema: OpSchema, position: int) -> bool:
    """True if argument ``position`` is a number equal to 0 that the cache key includes."""
    info = schema.schema_info
    if info is None or position < info.static_argnum or position >= len(schema.args_schema):
        return False
    value = schema.args_schema[position]
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0


def _alpha(schema: OpSchema) -> float:
    """The ``alpha`` argument of ``add``/``sub``/``rsub`` (1 when not given)."""
    if "alpha" in schema.kwargs_schema:
        return schema.kwargs_schema["alpha"]
    return schema.args_schema[2] if len(schema.args_schema) > 2 else 1


def _partial_options(
    schema: OpSchema,
    positions: list[int | str],
    linear: Linearity,
) -> list[DimOption]:
    """Per-mesh-dim options with a Partial output."""
    options: list[DimOption] = []

    def add(partial_at: set[int | str], inp: str, out: str) -> None:
        ins = tuple(Partial(inp) if p in partial_at else Replicate() for p in positions)
        options.append((ins, (Partial(out),)))

    n_args = len(schema.args_schema)
    for group in linear.groups:
        members = {p for p in group if p in positions}
        if not members:
            continue
        constants = [
            p for p in group
            if p not in positions and p < n_args and schema.args_schema[p] is not None
        ]
        linear_sum = all(_is_zero_constant(schema, p) for p in constants)
        for op in ("sum", "avg") if linear_sum else ("avg",):
            add(members, op, op)
    for position, direction in linear.monotone:
        if position == linear.alpha_at:
            alpha = _alpha(schema)
            direction = direction if alpha > 0 else -direction if alpha < 0 else 0
        if position in positions and direction:
            for op in ("max", "min"):
                add({position}, op, op if direction > 0 else _SWAP[op])
    if linear.same_reduction is not None and len(positions) > 1:
        add(set(positions), linear.same_reduction, linear.same_reduction)
    return options


def _shard_options(
    out_shape: Sequence[int],
    shapes: list[torch.Size],
    special: Iterable[Shard],
) -> list[DimOption]:
    """Per-mesh-dim options sharding one output dim: inputs with that dim at full size are
    sharded alike (plain, or the interleaved/ragged kinds in ``special``), broadcast ones
    replicated; at least one input must be sharded."""
    rank = len(out_shape)
    kinds: list[Shard] = [Shard(d) for d in range(rank)]
    kinds += [p for p in special if p not in kinds]
    options: list[DimOption] = []
    for kind in kinds:
        d = kind.dim
        ins: list[Placement] = []
        for shape in shapes:
            offset = rank - len(shape)
            if d >= offset and shape[d - offset] == out_shape[d]:
                ins.append(with_dim(kind, d - offset))
            else:
                ins.append(Replicate())
        if any(isinstance(p, Shard) for p in ins):
            options.append((tuple(ins), (kind,)))
    return options


def _special_in_output(
    shapes: list[torch.Size],
    placements: list[tuple[Placement, ...]],
    out_shape: Sequence[int],
) -> list[Shard]:
    """The InterleavedShard and RaggedShard placements of the inputs that shard a dim at the
    output's full size, moved to output dims."""
    rank = len(out_shape)
    found: list[Shard] = []
    for shape, ps in zip(shapes, placements, strict=True):
        for p in ps:
            if is_special_shard(p):
                q = with_dim(p, p.dim + rank - len(shape))
                if shape[p.dim] == out_shape[q.dim] and q not in found:
                    found.append(q)
    return found


def pointwise_strategy(
    mesh: DeviceMesh, schema: OpSchema, linear: Linearity = NONLINEAR
) -> OpStrategy:
    """Every valid sharding of an elementwise (broadcasting) op: the product over mesh dims of
    Replicate, Shard/InterleavedShard of an output dim and the Partial options ``linear``
    allows. In-place ops (``add_``...) keep only candidates that leave ``self`` where it is
    (if there is none, dispatch reports that the op cannot run in place)."""
    args = _tensor_args(schema)
    positions = [p for p, _ in args]
    shapes = [s.shape for _, s in args]
    current = [s.output_spec.placements for _, s in args]
    inplace = is_inplace(schema.op)
    out_shape = list(shapes[0] if inplace else torch.broadcast_shapes(
        *shapes, *_plain_shapes(schema)
    ))
    options: list[DimOption] = [(tuple(Replicate() for _ in args), (Replicate(),))]
    options += _shard_options(out_shape, shapes, _special_in_output(shapes, current, out_shape))
    options += _partial_options(schema, positions, linear)
    return keep_self_inplace(schema, product_strategy(mesh, options, shapes=shapes))


# ----- registration ----------------------------------------------------------------------------


def _tensor_overloads(name: str) -> list[Any]:
    """The functional and in-place overloads of ``aten.<name>`` that take a Tensor and return
    one Tensor (``out=`` variants and Python-number overloads left out)."""
    packet = getattr(aten, name, None)
    if packet is None:
        return []
    found = []
    for overload in packet.overloads():
        op = getattr(packet, overload)
        s = op._schema
        if any(a.kwarg_only and a.alias_info is not None for a in s.arguments):
            continue
        takes_tensor = any(str(a.type).startswith("Tensor") for a in s.arguments)
        if takes_tensor and len(s.returns) == 1 and str(s.returns[0].type) == "Tensor":
            found.append(op)
    return found


def register_pointwise(
    names: Iterable[str], linear: Linearity = NONLINEAR, static_argnum: int = 100
) -> None:
    """Register ``pointwise_strategy`` for ``aten.<name>`` and ``aten.<name>_`` overloads
    (arguments from ``static_argnum`` on, and ``alpha``, are part of the cache key), and
    their ``out=`` overloads (``ops/out_variants``: the functional overload's sharding with
    ``out``'s placements)."""
    ops = []
    for name in names:
        ops += _tensor_overloads(name) + _tensor_overloads(name + "_")

    def strategy_fn(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
        return pointwise_strategy(mesh, schema, linear)

    strategy_fn.__doc__ = f"Elementwise sharding of {sorted(set(names))}."
    info = RuntimeSchemaInfo(static_argnum, static_kwargkey=("alpha",))
    register_op_strategy(ops, schema_info=info)(strategy_fn)
    for name in names:
        packet = getattr(aten, name, None)
        if packet is not None:
            register_out_variants(packet, static_argnum)


INCREASING = Linearity(monotone=((0, 1),))

# Nonlinear elementwise ops: a Partial input is reduced first.
NONLINEAR_OPS = [
    "abs", "sgn", "sign", "signbit", "sqrt", "rsqrt", "log", "log2", "log10", "log1p",
    "sin", "cos", "tan", "asin", "acos", "sinh", "cosh", "acosh", "atanh", "reciprocal",
    "square", "gelu", "silu", "mish", "hardswish", "hardsigmoid", "elu", "selu", "celu",
    "leaky_relu", "softplus", "logit", "lgamma", "digamma", "erfc", "erfinv", "i0",
    "frac", "exp2", "sinc", "deg2rad", "rad2deg", "xlogy", "special_xlog1py",
    "pow", "float_power", "fmod", "remainder", "atan2", "arctan2", "hypot", "copysign",
    "nextafter", "logaddexp", "logaddexp2", "floor_divide", "heaviside", "fmax", "fmin",
    "eq", "ne", "lt", "le", "gt", "ge", "isnan", "isinf", "isfinite", "isposinf",
    "isneginf", "nan_to_num", "logical_and", "logical_or", "logical_not", "logical_xor",
    "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "bitwise_left_shift",
    "bitwise_right_shift", "__and__", "__or__", "__xor__", "__lshift__", "__rshift__",
    "relu6", "hardtanh", "threshold", "polygamma", "igamma", "igammac", "special_erfcx",
    "special_i0e", "special_i1", "special_i1e", "special_ndtr", "special_ndtri",
    "special_log_ndtr", "gcd", "lcm",
]

# Non-decreasing in their first argument over all reals: Partial("max"/"min") passes.
MONOTONE_OPS = [
    "exp", "expm1", "sigmoid", "tanh", "relu", "erf", "floor", "ceil", "round", "trunc",
    "fix", "atan", "arctan", "asinh", "arcsinh", "clamp", "clamp_min", "clamp_max", "clip",
]

# Backward ops linear in their first argument (the incoming gradient).
GRAD_LINEAR_OPS = [
    "threshold_backward", "sigmoid_backward", "tanh_backward", "gelu_backward",
    "silu_backward", "mish_backward", "hardswish_backward", "hardsigmoid_backward",
    "hardtanh_backward", "leaky_relu_backward", "elu_backward", "softplus_backward",
    "logit_backward", "log_sigmoid_backward",
]


def _rounding_division_ops() -> list[Any]:
    """``div(..., rounding_mode=...)`` overloads: rounding is not linear."""
    return [
        op
        for name in ("div", "div_", "divide", "divide_")
        for op in _tensor_overloads(name)
        if "mode" in op._overloadname
    ]


def _register_all() -> None:
    register_pointwise(NONLINEAR_OPS)
    register_pointwise(MONOTONE_OPS, INCREASING)
    for name, other, reduction in (
        ("maximum", aten.max.other, "max"), ("minimum", aten.min.other, "min")
    ):
        extreme = Linearity(monotone=((0, 1), (1, 1)), same_reduction=reduction)
        register_pointwise([name], extreme)
        # torch.max(a, b): the elementwise overload in the reduction's packet
        register_op_strategy([other], schema_info=RuntimeSchemaInfo(static_kwargkey=("alpha",)))(
            lambda mesh, schema, linear=extreme: pointwise_strategy(mesh, schema, linear)
        )
    register_pointwise(GRAD_LINEAR_OPS, Linearity(groups=((0,),)))
    # x + alpha * y, x - alpha * y, y - alpha * x: alpha is positional argument 2
    register_pointwise(
        ["add"], Linearity(((0, 1),), monotone=((0, 1), (1, 1)), alpha_at=1), static_argnum=2
    )
    register_pointwise(
        ["sub", "subtract"],
        Linearity(((0, 1),), monotone=((0, 1), (1, -1)), alpha_at=1),
        static_argnum=2,
    )
    register_pointwise(
        ["rsub"], Linearity(((0, 1),), monotone=((0, -1), (1, 1)), alpha_at=0), static_argnum=2
    )
    register_pointwise(["neg", "negative"], Linearity(groups=((0,),), monotone=((0, -1),)))
    register_pointwise(["positive"], Linearity(groups=((0,),), monotone=((0, 1),)))
    register_pointwise(["mul", "multiply"], Linearity(groups=((0,), (1,))))
    register_pointwise(["div", "divide", "true_divide"], Linearity(groups=((0,),)))
    register_op_strategy(_rounding_division_ops(), schema_info=RuntimeSchemaInfo())(
        pointwise_strategy
    )
    register_pointwise(["where"], Linearity(groups=((1, 2),)))
    register_pointwise(["lerp"], Linearity(groups=((0, 1),)))
    register_pointwise(["addcmul"], Linearity(groups=((0, 1), (0, 2))))
    register_pointwise(["addcdiv"], Linearity(groups=((0, 1),)))
    # the fill value is part of the cache key, so filling a Partial("sum") with 0 stays linear
    register_pointwise(["masked_fill"], Linearity(groups=((0, 2),)), static_argnum=2)


_register_all()


def _register_fma() -> None:
    """``prims.fma(a, b, c)`` = a * b + c, which dynamo writes for in-place ``addcmul_``,
    ``addcdiv_`` and ``add_`` with a tensor ``alpha`` (optimizer steps): linear in (a, c) and
    in (b, c)."""
    fma = Linearity(groups=((0, 2), (1, 2)))
    register_op_strategy([torch.ops.prims.fma.default], schema_info=RuntimeSchemaInfo())(
        lambda mesh, schema: pointwise_strategy(mesh, schema, fma)
    )


register_deferred("prims::fma", _register_fma)

# Every elementwise prim (``prims.bessel_i0e``, ``prims.erfcx``, ``prims.ndtri``... which
# torch's references and decompositions call): elementwise alike, nonlinear (``prims.div``
# truncates integers, so even the arithmetic ones are not taken as linear), as in PyTorch.
register_op_strategy(elementwise_prims(), schema_info=RuntimeSchemaInfo())(pointwise_strategy)


# Special functions (``torch.special``), complex helpers and shrinkage: elementwise as well.
SPECIAL_OPS = [
    "special_airy_ai", "special_bessel_j0", "special_bessel_j1", "special_bessel_y0",
    "special_bessel_y1", "special_chebyshev_polynomial_t", "special_chebyshev_polynomial_u",
    "special_chebyshev_polynomial_v", "special_chebyshev_polynomial_w", "special_entr",
    "special_hermite_polynomial_h", "special_hermite_polynomial_he",
    "special_laguerre_polynomial_l", "special_legendre_polynomial_p",
    "special_modified_bessel_i0", "special_modified_bessel_i1", "special_modified_bessel_k0",
    "special_modified_bessel_k1", "special_scaled_modified_bessel_k0",
    "special_scaled_modified_bessel_k1", "special_shifted_chebyshev_polynomial_t",
    "special_shifted_chebyshev_polynomial_u", "special_shifted_chebyshev_polynomial_v",
    "special_shifted_chebyshev_polynomial_w", "special_spherical_bessel_j0", "special_zeta",
    "mvlgamma", "angle", "polar", "ldexp", "softshrink", "hardshrink", "softshrink_backward",
    "hardshrink_backward",
]
register_pointwise(SPECIAL_OPS)
# conjugation and negation are linear over the reals; complex(real, imag) jointly
register_pointwise(
    ["_conj_physical", "conj_physical", "resolve_conj", "resolve_neg"], Linearity(groups=((0,),))
)
register_pointwise(["complex"], Linearity(groups=((0, 1),)))
