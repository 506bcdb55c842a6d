"""Sharding strategies of linear algebra (``torch.linalg`` and the older ``torch.cholesky``,
``triangular_solve``, ``geqrf``... aten ops): decompositions, inverses, solves,
determinants, matrix functions.

Every such op works on the last one or two dims (the matrices or vectors) of each argument and
is independent along the leading batch dims, which broadcast like elementwise ops. So the batch
dims may be sharded (alike on every argument that has them; a broadcast argument stays
replicated) and the matrix dims stay whole on every device. Outputs carry the broadcast batch
shape first; their shapes come from the op's meta kernel. Solves are linear in their right-hand
side: a Partial("sum") right-hand side with a replicated matrix gives a Partial solution.
``linalg_lstsq``, whose auxiliary outputs depend on the driver, runs replicated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..mesh import DeviceMesh
from ..placements import Partial, Replicate
from .common import (
    DimOption,
    axis_options,
    input_strategies,
    leading_axes,
    nonempty_shards,
    product_strategy,
    replicated_strategy,
)
from .registry import (
    OpSchema,
    OpStrategy,
    PlacementStrategy,
    RuntimeSchemaInfo,
    register_op_strategy,
)

aten = torch.ops.aten
R = Replicate()
P = Partial("sum")

CoreDims = Callable[[list[torch.Size]], Sequence[int]]


def _meta_outputs(schema: OpSchema) -> list[torch.Tensor | None]:
    """The op's outputs on meta tensors shaped like its DTensor inputs."""

    def meta(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return a.to("meta")
        if hasattr(a, "output_spec"):
            m = a.output_spec.tensor_meta
            return torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta")
        if isinstance(a, (list, tuple)):
            return type(a)(meta(x) for x in a)
        return a

    args = meta(tuple(schema.args_schema))
    kwargs = {k: meta(v) for k, v in schema.kwargs_schema.items()}
    out = schema.op(*args, **kwargs)
    return list(out) if isinstance(out, (tuple, list)) else [out]


def batched_strategy(
    mesh: DeviceMesh,
    schema: OpSchema,
    core: Sequence[int],
    linear_in: Sequence[int] = (),
    linear_out: Sequence[int] = (0,),
) -> OpStrategy:
    """Batch dims (all but the last ``core[i]`` dims of input i, broadcast together) sharded
    alike on inputs and outputs; ``linear_in``: with the other inputs replicated, Partial
    inputs there give Partial outputs at ``linear_out`` (the others depend only on the
    replicated inputs)."""
    inputs = input_strategies(schema)
    n_out = len(schema.op._schema.returns)
    try:
        outs = _meta_outputs(schema)
    except NotImplementedError:  # no meta kernel (geqrf): run replicated
        return replicated_strategy(mesh, len(inputs), n_out)
    core = list(core)[: len(inputs)] + [core[-1]] * (len(inputs) - len(core))
    in_dims = leading_axes([s.shape for s in inputs], core)
    n_axes = len(in_dims[0]) if in_dims else 0
    batch = [None] * n_axes
    for dims, s in zip(in_dims, inputs, strict=True):
        for k, d in enumerate(dims):
            if d is not None:
                batch[k] = s.shape[d]
    out_dims: list[list[int | None]] = []
    for o in outs:
        if o is not None and o.ndim >= n_axes and list(o.shape[:n_axes]) == batch:
            out_dims.append(list(range(n_axes)))
        elif o is None or o.numel() == 0:
            out_dims.append([None] * n_axes)  # nothing to shard: the same (empty) everywhere
        else:
            return replicated_strategy(mesh, len(inputs), n_out)
    options: list[DimOption] = axis_options(in_dims, out_dims) if in_dims else []
    if not options:
        options = [((R,) * len(inputs), (R,) * n_out)]
    if linear_in:
        ins = tuple(P if i in linear_in else R for i in range(len(inputs)))
        options.append((ins, tuple(P if j in linear_out else R for j in range(n_out))))
    valid = nonempty_shards(mesh, [s.shape for s in inputs])
    return product_strategy(mesh, options, multi=n_out > 1, valid=valid)


def _register(
    ops: list,
    core: Sequence[int] | CoreDims,
    linear_in: Sequence[int] = (),
    linear_out: Sequence[int] = (0,),
) -> None:
    def strategy_fn(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
        shapes = [s.shape for s in input_strategies(schema)]
        dims = core(shapes) if callable(core) else core
        return batched_strategy(mesh, schema, dims, linear_in, linear_out)

    strategy_fn.__doc__ = "Batch dims sharded alike, matrix (and vector) dims whole" + (
        f"; linear in inputs {list(linear_in)}." if linear_in else "."
    )
    register_op_strategy(ops, schema_info=RuntimeSchemaInfo(1))(strategy_fn)


def _solve_core(shapes: list[torch.Size]) -> list[int]:
    """``linalg.solve``'s B is a batch of vectors when it is 1-d or A's shape without the last
    dim (torch's rule), else of matrices."""
    a, b = shapes[0], shapes[1]
    vector = len(b) == 1 or (len(b) == len(a) - 1 and list(b) == list(a[:-1]))
    return [2, 1 if vector else 2]


MATRIX_OPS = [
    aten._linalg_svd.default, aten.linalg_qr.default, aten._linalg_eigh.default,
    aten.linalg_eig.default, aten._linalg_eigvals.default, aten.linalg_eigvals.default,
    aten.linalg_inv_ex.default, aten.linalg_cholesky_ex.default, aten.cholesky.default,
    aten.cholesky_inverse.default, aten._linalg_det.default, aten._linalg_slogdet.default,
    aten.linalg_lu_factor_ex.default, aten.linalg_lu.default, aten.linalg_matrix_exp.default,
    aten.linalg_ldl_factor_ex.default, aten.geqrf.default, aten.linalg_pinv.default,
    aten.linalg_pinv.atol_rtol_float,
]
_register(MATRIX_OPS, [2])
# (A, atol?, rtol?) and (A, rcond): tolerances are per batch entry
_register([aten.linalg_pinv.atol_rtol_tensor, aten.linalg_pinv.rcond_tensor], [2, 0, 0])
_register([aten._linalg_solve_ex.default], _solve_core, linear_in=[1])
_register([aten.linalg_solve_triangular.default], [2, 2], linear_in=[1])
_register([aten.triangular_solve.default], [2, 2], linear_in=[0])  # (B, A)
_register([aten.cholesky_solve.default], [2, 2], linear_in=[0])  # (B, L)
_register([aten.linalg_lu_solve.default, aten.linalg_ldl_solve.default], [2, 1, 2],
          linear_in=[2])
_register([aten.lu_unpack.default], [2, 1])
_register([aten.linalg_householder_product.default], [2, 1])
_register([aten.ormqr.default], [2, 1, 2], linear_in=[2])


@register_op_strategy(aten.linalg_lstsq.default, schema_info=RuntimeSchemaInfo(2))
def lstsq_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``linalg_lstsq``: everything replicated (its residuals, rank and singular values are
    empty or not depending on the driver and the shapes)."""
    return replicated_strategy(mesh, len(input_strategies(schema)), 4)


@register_op_strategy(aten._linalg_check_errors.default, schema_info=RuntimeSchemaInfo(1))
def check_errors_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``_linalg_check_errors(info, api_name, is_matrix)`` returns nothing: each device checks
    its own entries of ``info`` where they are."""
    (info,) = input_strategies(schema)
    return OpStrategy([PlacementStrategy(None, [info.output_spec])])
