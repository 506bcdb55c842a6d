"""How a sharding strategy is written, and the helpers the op families share.

One way to write a rule: for ONE mesh dim, list the ``DimOption``s (the placement of every
DTensor input, then of every output, on that mesh dim); ``product_strategy`` expands them into
every ``PlacementStrategy`` for the whole mesh (one option per mesh dim), drops duplicates and
combinations that do not fit, and dispatch picks the cheapest one to reach from the actual
inputs. Handlers that bypass dispatch (ops whose output depends on the values) move their
inputs with ``move_components`` and wrap per-device results with ``run_replicated``-style
helpers below, so they obey the same explicit-redistribution rules as dispatch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..dtensor import DTensor
from ..errors import InvalidPlacementError, MeshError
from ..geometry import shard_segments
from ..mesh import DeviceMesh
from ..op_inputs import implicitly_replicated, redistribute_inputs
from ..placements import (
    InterleavedShard,
    Partial,
    Placement,
    RaggedShard,
    Replicate,
    Shard,
    is_special_shard,
    with_dim,
)
from ..spec import DTensorSpec, TensorMeta, contiguous_meta, make_tensor_meta
from ..torch_compat import pytree
from .registry import OpSchema, OpStrategy, PlacementStrategy

R = Replicate()
P = Partial()

# One mesh dim's choice: a placement for every DTensor input (flattened order), and one for every
# output (None: the output is not a DTensor, e.g. an opaque workspace).
DimOption = tuple[Sequence[Placement], Sequence[Placement | None]]


# ----- building strategies ---------------------------------------------------------------------


def spec_of(mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensorSpec:
    """A spec without metadata (dispatch fills it in from the op's output)."""
    return DTensorSpec(mesh, tuple(placements), None)


def replicate(mesh: DeviceMesh) -> tuple[Placement, ...]:
    return (Replicate(),) * mesh.ndim


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


def product_strategy(
    mesh: DeviceMesh,
    options: Sequence[DimOption] | Callable[[int], Sequence[DimOption]],
    *,
    multi: bool = False,
    valid: Callable[[tuple[DimOption, ...]], bool] | None = None,
    shapes: Sequence[Sequence[int]] | None = None,
) -> OpStrategy:
    """Every way to pick one option per mesh dim, as an ``OpStrategy`` (duplicates dropped).

    ``options`` may depend on the mesh dim (a callable of it); ``valid`` may reject a
    combination (e.g. two mesh dims splitting a dim that may be split once); ``shapes`` (the
    DTensor inputs' global shapes) drops combinations whose input placements do not fit them
    (an interleave that does not divide). ``multi``: one spec per output (``None`` where an
    output is not a DTensor), else the single output's spec. Dispatch breaks cost ties in
    favour of inputs that stay put, so the order of the options does not matter."""
    per_dim = [options(m) if callable(options) else options for m in range(mesh.ndim)]
    found, seen = [], set()
    for combo in itertools.product(*per_dim):
        ins = tuple(tuple(c[0][i] for c in combo) for i in range(len(combo[0][0])))
        outs = tuple(tuple(c[1][j] for c in combo) for j in range(len(combo[0][1])))
        if (ins, outs) in seen:
            continue
        seen.add((ins, outs))
        if shapes is not None and not all(
            fits(s, mesh, p) for s, p in zip(shapes, ins, strict=False)
        ):
            continue
        if valid is not None and not valid(combo):
            continue
        if multi:
            outs_or_none = [None if any(p is None for p in o) else o for o in outs]
            found.append(strategy(mesh, ins, outs_or_none, multi=True))
        else:
            found.append(strategy(mesh, ins, outs[0]))
    return OpStrategy(found)



def per_tensor(combo: Sequence[DimOption]) -> list[tuple[Placement | None, ...]]:
    """The placements a combination of options (one per mesh dim) gives each tensor: the
    inputs', then the outputs' (what a ``valid`` check of ``product_strategy`` usually reads)."""
    width = len(combo[0][0]) + len(combo[0][1])
    return [tuple((*c[0], *c[1])[i] for c in combo) for i in range(width)]


def unary_options(
    placements: Sequence[Placement], ndim: int, allowed: Callable[[Placement], bool]
) -> Callable[[int], list[DimOption]]:
    """Per mesh dim, the options of an op whose output is laid out like its one input: the
    current placement when ``allowed``, plus Replicate and every allowed plain Shard."""

    def options(m: int) -> list[DimOption]:
        candidates: list[Placement] = [Replicate()] + [Shard(d) for d in range(ndim)]
        if allowed(placements[m]) and placements[m] not in candidates:
            candidates.append(placements[m])
        return [((c,), (c,)) for c in candidates if allowed(c)]

    return options


def mapped_options(
    current: Placement, dim_map: dict[int, int], n_outputs: int = 1
) -> list[DimOption]:
    """Per-mesh-dim choices of a unary data-movement op mapping input dim ``d`` to output dim
    ``dim_map[d]``: Partial passes through; otherwise
    Replicate, or a shard of any mapped dim (interleaved or ragged kept when the input has one).
    ``n_outputs``: a list-returning op whose outputs all take the same placement."""
    if isinstance(current, Partial):
        pairs: list[tuple[Placement, Placement]] = [(current, current)]
    else:
        pairs = [(Replicate(), Replicate())]
        pairs += [(Shard(d), Shard(e)) for d, e in dim_map.items()]
        if is_special_shard(current) and current.dim in dim_map:
            pairs.append((current, same_kind(current, dim_map[current.dim])))
    return [((p,), (q,) * n_outputs) for p, q in pairs]


def with_output_meta(found: OpStrategy, meta: TensorMeta) -> OpStrategy:
    """Give every candidate's single output known metadata: it spares dispatch a meta-tensor
    run of the op (slow for ops decomposed in Python, and unable to honour ``device=``)."""
    for candidate in found.strategies:
        candidate.output_specs = DTensorSpec(
            candidate.output_spec.mesh, candidate.output_spec.placements, meta
        )
    return found


# ----- reading an op's schema ----------------------------------------------------------------


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


def bind(op: Any, args: Sequence, kwargs: dict) -> dict[str, Any]:
    """The op's arguments by schema name, defaults filled in (positional or keyword alike)."""
    bound: dict[str, Any] = {}
    for i, arg in enumerate(op._schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


def bind_schema(schema: OpSchema) -> dict[str, Any]:
    """``bind`` for an ``OpSchema`` (DTensor arguments appear as their ``OpStrategy``)."""
    return bind(schema.op, schema.args_schema, schema.kwargs_schema)


def is_inplace(op: Any) -> bool:
    """An op that writes its first argument (``add_``, ``scatter_``, ``index_put_``...)."""
    schema = getattr(op, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    first = schema.arguments[0].alias_info
    return first is not None and first.is_write


def keep_self_inplace(schema: OpSchema, found: OpStrategy) -> OpStrategy:
    """For an in-place op, only the candidates that leave ``self`` where it is (moving the
    tensor being written costs a collective and changes its placements); when there is none,
    all of them: dispatch then moves ``self`` (implicit mode) or names the move (explicit)."""
    if not is_inplace(schema.op):
        return found
    current = input_strategies(schema)[0].output_spec.placements
    kept = [
        s for s in found.strategies
        if tuple(s.input_specs[0].placements) == current
        and (not isinstance(s.output_specs, DTensorSpec) or s.output_spec.placements == current)
    ]
    return OpStrategy(kept) if kept else found


# ----- placements ------------------------------------------------------------------------------



def partial_ops(placements: Sequence[Placement]) -> list[Partial]:
    """The distinct Partial placements among ``placements`` (the ones worth offering)."""
    seen: list[Partial] = []
    for p in placements:
        if isinstance(p, Partial) and p not in seen:
            seen.append(p)
    return seen



def sharding_mesh_dims(placements: Sequence[Placement], dim: int) -> tuple[int, ...]:
    """The mesh dims that shard tensor dim ``dim``, in order."""
    return tuple(m for m, p in enumerate(placements) if isinstance(p, Shard) and p.dim == dim)


def aligned(a: Sequence[Placement], b: Sequence[Placement], dims: Sequence[int]) -> bool:
    """True if ``a`` and ``b`` shard each of ``dims`` over the same mesh dims (so their pieces
    cover the same global indices of those dims, for tensors of equal size there)."""
    return all(sharding_mesh_dims(a, d) == sharding_mesh_dims(b, d) for d in dims)


def same_kind(p: Shard, dim: int) -> Shard:
    """A shard of the same kind as ``p`` (plain, interleaved or ragged) on tensor dim ``dim``."""
    return with_dim(p, dim)


def shard_like(current: Sequence[Placement], dim: int) -> Shard:
    """``Shard(dim)``, or the input's own (interleaved) shard of ``dim`` so it needs no move."""
    for p in current:
        if isinstance(p, Shard) and p.dim == dim:
            return p
    return Shard(dim)


def mesh_coords(mesh: DeviceMesh) -> list[tuple[int, ...]]:
    """Every coordinate of the mesh."""
    return list(itertools.product(*(range(s) for s in mesh.shape)))


def fits(shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]) -> bool:
    """True when ``placements`` can place a tensor of ``shape`` (interleaves divide sizes)."""
    if not any(isinstance(p, (InterleavedShard, RaggedShard)) for p in placements):
        return True
    try:
        for coord in mesh_coords(mesh):
            shard_segments(tuple(shape), mesh.shape, tuple(placements), coord)
    except InvalidPlacementError:
        return False
    return True


def no_empty_shard(
    mesh: DeviceMesh, shape: Sequence[int], placements: Sequence[Placement], dims: Sequence[int]
) -> bool:
    """True if no device gets an empty piece of a non-empty dim among ``dims`` (kernels such as
    reflection padding or embedding_bag reject zero-size dims)."""
    spec = DTensorSpec(mesh, tuple(placements), contiguous_meta(shape, torch.float32))
    for device in mesh.device_ids:
        local = spec.local_shape(device)
        if any(local[d] == 0 < shape[d] for d in dims):
            return False
    return True


# ----- runtime helpers for handlers that bypass dispatch ---------------------------------------


def move_components(
    op: Any, dts: Sequence[DTensor], targets: Sequence[Sequence[Placement]]
) -> list[list[torch.Tensor]]:
    """Components of ``dts`` redistributed to ``targets``, under dispatch's explicit-mode rules
    (a move that needs communication raises ``ImplicitRedistributeError`` unless allowed)."""
    return redistribute_inputs(op, list(dts), tuple(tuple(t) for t in targets))


def dtensor_args(op: Any, flat: Sequence[Any]) -> tuple[DeviceMesh, list[int]]:
    """The mesh and positions of the DTensors among ``flat`` arguments; plain tensors (other
    than scalars) and mixed meshes are refused as in dispatch."""
    at = [i for i, a in enumerate(flat) if isinstance(a, DTensor)]
    mesh = flat[at[0]].device_mesh
    for a in flat:
        if isinstance(a, DTensor):
            if a.device_mesh != mesh:
                raise MeshError(f"{op} got DTensors on different meshes: {mesh}, {a.device_mesh}")
        elif isinstance(a, torch.Tensor) and a.ndim > 0:
            raise MeshError(
                f"{op} mixes DTensors with a plain torch.Tensor of shape {list(a.shape)}; "
                f"distribute it first (shardwise.distribute_tensor(t, {mesh}, placements))"
            )
    return mesh, at


def replicate_plain(mesh: DeviceMesh, value: Any) -> Any:
    """A plain tensor that needs no gradient as a Replicate DTensor (it is the same on every
    device), e.g. the zeros autograd's formulas create with ``torch.zeros``; others unchanged."""
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
        if not value.requires_grad:
            comps = [value.to(mesh.device_of(d)) for d in mesh.local_device_ids]
            return DTensor(comps, DTensorSpec(mesh, replicate(mesh), make_tensor_meta(value)))
    return value


def wrap_replicated(mesh: DeviceMesh, results: list[Any]) -> Any:
    """Per-device results (the same value on every device) as Replicate DTensors."""
    first = results[0]
    if isinstance(first, (tuple, list)):
        return type(first)(
            wrap_replicated(mesh, [r[i] for r in results]) for i in range(len(first))
        )
    if not isinstance(first, torch.Tensor):
        return first
    spec = DTensorSpec(mesh, replicate(mesh), make_tensor_meta(first))
    return DTensor(results, spec)


def as_dtensors(op: Any, values: Sequence[Any]) -> list[Any]:
    """``values`` with their plain tensors (0-d ones aside) replicated on the DTensors' mesh
    by dispatch's rule (one-element constants, inside ``implicit_replication()`` or autograd's
    backward; others are refused with a ``MeshError``)."""
    mesh = next(a for a in values if isinstance(a, DTensor)).device_mesh
    return [
        implicitly_replicated(op, a, mesh)
        if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and a.ndim else a
        for a in values
    ]


def run_replicated(op: Any, args: tuple, kwargs: dict) -> Any:
    """Gather every DTensor argument, run ``op`` on each device, return Replicate DTensors:
    the rule for ops whose output shape depends on the values."""
    flat, tree = pytree.tree_flatten((args, kwargs))
    flat = as_dtensors(op, flat)
    mesh, at = dtensor_args(op, flat)
    comps = move_components(op, [flat[i] for i in at], [replicate(mesh)] * len(at))
    results = []
    for k in range(len(mesh.local_device_ids)):
        local = list(flat)
        for pos, c in zip(at, comps, strict=True):
            local[pos] = c[k]
        a, kw = pytree.tree_unflatten(local, tree)
        results.append(op(*a, **kw))
    return wrap_replicated(mesh, results)


# ----- independent axes (families whose ops are independent along some dims) ----------------


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


def nonempty_shards(
    mesh: DeviceMesh, shapes: Sequence[Sequence[int]]
) -> Callable[[tuple[DimOption, ...]], bool]:
    """A ``product_strategy`` filter: no input (of ``shapes``) gets an empty shard, for ops
    whose kernels refuse empty channel or spatial dims."""

    def valid(combo: tuple[DimOption, ...]) -> bool:
        return all(
            no_empty_shard(mesh, shape, tuple(c[0][i] for c in combo), range(len(shape)))
            for i, shape in enumerate(shapes)
        )

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


def replicated_strategy(mesh: DeviceMesh, n_in: int, n_out: int) -> OpStrategy:
    """Every input and output replicated (``n_out`` > 1: one spec per output)."""
    rep = (Replicate(),)
    return product_strategy(mesh, [(rep * n_in, rep * n_out)], multi=n_out > 1)
