"""Helpers shared by the op families' sharding strategies."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence

from ..mesh import DeviceMesh
from ..placements import Partial, Placement, Replicate, Shard
from ..spec import DTensorSpec, chunk_bounds
from .registry import OpSchema, OpStrategy, PlacementStrategy


def spec_of(mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensorSpec:
    """A spec without metadata (dispatch fills it in from the op's output)."""
    return DTensorSpec(mesh, tuple(placements), None)


def replicate(mesh: DeviceMesh) -> tuple[Placement, ...]:
    return (Replicate(),) * mesh.ndim


def input_strategies(schema: OpSchema) -> list[OpStrategy]:
    """The ``OpStrategy`` arguments (DTensor inputs) of a schema, in order."""
    out = []
    for a in schema.args_schema:
        if isinstance(a, OpStrategy):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, OpStrategy))
    out.extend(v for v in schema.kwargs_schema.values() if isinstance(v, OpStrategy))
    return out


def current_placements(strategy: OpStrategy) -> tuple[Placement, ...]:
    return strategy.output_spec.placements


def has_partial(placements: Iterable[Placement]) -> bool:
    return any(isinstance(p, Partial) for p in placements)


def strategy(
    mesh: DeviceMesh,
    inputs: Sequence[Sequence[Placement]],
    outputs: Sequence[Placement] | Sequence[Sequence[Placement] | None],
    multi: bool = False,
) -> PlacementStrategy:
    """A ``PlacementStrategy`` from placement tuples (``multi``: one tuple per output)."""
    ins = [spec_of(mesh, p) for p in inputs]
    if multi:
        outs = tuple(None if p is None else spec_of(mesh, p) for p in outputs)
        return PlacementStrategy(outs, ins)
    return PlacementStrategy(spec_of(mesh, outputs), ins)


def replicate_strategy(mesh: DeviceMesh, n_inputs: int, n_outputs: int = 1) -> PlacementStrategy:
    """Everything replicated: valid for every op (the fallback of last resort)."""
    rep = replicate(mesh)
    if n_outputs == 1:
        return strategy(mesh, [rep] * n_inputs, rep)
    return strategy(mesh, [rep] * n_inputs, [rep] * n_outputs, multi=True)


def shard_dim_on(placements: Sequence[Placement], dim: int) -> bool:
    """True if some mesh dim shards tensor dim ``dim``."""
    return any(isinstance(p, Shard) and p.dim == dim for p in placements)


# One mesh dim's choice: a placement for every DTensor input (flattened order), and one for every
# output (None: the output is not a DTensor, e.g. an opaque workspace).
DimOption = tuple[Sequence[Placement], Sequence[Placement | None]]


def product_strategy(
    mesh: DeviceMesh,
    options: Sequence[DimOption] | Callable[[int], Sequence[DimOption]],
    *,
    multi: bool = False,
    valid: Callable[[tuple[DimOption, ...]], bool] | None = None,
) -> OpStrategy:
    """Every way to pick one option per mesh dim, as an ``OpStrategy``. ``options`` may depend
    on the mesh dim; ``valid`` may reject a combination (e.g. two mesh dims splitting a dim
    that may be split once). Dispatch breaks cost ties in favour of inputs that stay put."""
    per_dim = [options(m) if callable(options) else options for m in range(mesh.ndim)]
    found = []
    for combo in itertools.product(*per_dim):
        if valid is not None and not valid(combo):
            continue
        ins = [tuple(c[0][i] for c in combo) for i in range(len(combo[0][0]))]
        outs = [tuple(c[1][j] for c in combo) for j in range(len(combo[0][1]))]
        if multi:
            outs_or_none = [None if any(p is None for p in o) else o for o in outs]
            found.append(strategy(mesh, ins, outs_or_none, multi=True))
        else:
            found.append(strategy(mesh, ins, outs[0]))
    return OpStrategy(found)


def axis_options(
    in_dims: Sequence[Sequence[int | None]], out_dims: Sequence[Sequence[int | None]]
) -> list[DimOption]:
    """Options of an op that is independent along some axes (batch, channels, untransformed
    dims): all Replicate, plus one option per axis ``k`` in which input ``i`` is sharded on its
    dim ``in_dims[i][k]`` and output ``j`` on ``out_dims[j][k]`` (``None``: that tensor does not
    have the axis and stays Replicate). An axis no input is sharded on is left out."""
    n_axes = len(in_dims[0]) if in_dims else 0
    rep: DimOption = ((Replicate(),) * len(in_dims), (Replicate(),) * len(out_dims))
    options = [rep]
    for k in range(n_axes):
        if all(dims[k] is None for dims in in_dims):
            continue
        ins = tuple(Replicate() if d[k] is None else Shard(d[k]) for d in in_dims)
        outs = tuple(Replicate() if d[k] is None else Shard(d[k]) for d in out_dims)
        options.append((ins, outs))
    return options


def linear_option(n_in: int, n_out: int, linear_in: Sequence[int]) -> DimOption:
    """Partial("sum") through an op linear in the inputs at ``linear_in`` jointly (the others
    Replicate): every output is Partial("sum")."""
    ins = tuple(Partial("sum") if i in linear_in else Replicate() for i in range(n_in))
    return ins, (Partial("sum"),) * n_out


def _smallest_piece(size: int, splits: Sequence[int]) -> int:
    """The smallest piece of a dim of ``size`` split (``torch.chunk`` style) by each of
    ``splits`` in turn."""
    pieces = [size]
    for n in splits:
        pieces = [hi - lo for p in pieces for lo, hi in (chunk_bounds(p, n, i) for i in range(n))]
    return min(pieces)


def nonempty_shards(
    mesh: DeviceMesh, shapes: Sequence[Sequence[int]]
) -> Callable[[tuple[DimOption, ...]], bool]:
    """A ``product_strategy`` filter: no input (of ``shapes``) gets an empty shard, for ops
    whose kernels refuse empty channel or spatial dims."""

    def valid(combo: tuple[DimOption, ...]) -> bool:
        for i, shape in enumerate(shapes):
            for d, size in enumerate(shape):
                splits = [
                    mesh.size(m) for m, option in enumerate(combo)
                    if isinstance(option[0][i], Shard) and option[0][i].dim == d
                ]
                if splits and _smallest_piece(size, splits) == 0:
                    return False
        return True

    return valid


def leading_axes(
    shapes: Sequence[Sequence[int]], core: Sequence[int]
) -> list[list[int | None]]:
    """Per tensor, the dim of each shared leading axis: tensor i's leading dims (all but its
    last ``core[i]``) aligned from the right with the longest such prefix (``None``: the
    tensor lacks the axis). An axis where a tensor broadcasts (size 1 against more) is left
    out by returning ``None`` for it in every tensor."""
    leads = [list(s[: max(len(s) - c, 0)]) for s, c in zip(shapes, core, strict=True)]
    ref = max(leads, key=len)
    dims: list[list[int | None]] = [[] for _ in leads]
    for k in range(len(ref)):
        column: list[int | None] = []
        for lead in leads:
            d = k - (len(ref) - len(lead))
            column.append(d if d >= 0 else None)
        broadcast = any(d is not None and leads[i][d] != ref[k] for i, d in enumerate(column))
        for i, d in enumerate(column):
            dims[i].append(None if broadcast else d)
    return dims
