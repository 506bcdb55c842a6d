"""What ``replicate`` and ``fully_shard`` share: which mesh and dims are data parallel, how a
stored parameter becomes the tensor a forward computes with, and how gradients are reduced.

Two views (DESIGN.md, plain tensors at the program's edge):

- **per rank** (this process, or rank thread, acts for one device of the mesh; PyTorch's FSDP2
  and DDP): inputs are never touched, each rank computes on its own batch, and the
  data-parallel dims stay outside the activations: a parameter is gathered over them into a
  DTensor on the sub-mesh of the remaining dims (the tensor-parallel mesh), or a plain tensor
  when no dim remains. Its gradient is this rank's contribution, a pending average over the
  data-parallel dims.
- **global** (a process acting for several devices, or DTensor inputs that carry the
  data-parallel dims): parameters are gathered into DTensors on the whole mesh, Replicate on
  the data-parallel dims; plain tensors entering the outermost data-parallel module are the
  global batch, sharded on dim 0 over those dims (side inputs of inner modules are left alone).

Either way the gradient accumulates in ``param.grad`` as a pending reduction over the
data-parallel dims, and is reduced to the stored placements once per backward (after the
parameter's last accumulation), unless gradient sync is off.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import runtime, settings
from ..comm.native import Pending
from ..dtensor import DTensor, build, local_of, set_local
from ..errors import DataParallelError
from ..execution import View, of, per_rank, plain_view
from ..factories import distribute_tensor, place_tensor
from ..geometry import chunk_sizes
from ..mesh import DeviceMesh, init_device_mesh
from ..mesh_argument import require_mesh
from ..placements import InterleavedShard, Partial, Placement, Replicate, Shard
from ..redistribute import move
from ..spec import DTensorSpec, TensorMeta
from ..torch_compat import tree_flatten, tree_map
from ..tracing import eager_under_dynamo

MANAGED = "_shardwise_data_parallel"  # set on parameters a data-parallel call manages
REPLACED = "_shardwise_replaced"  # set on a parameter a data-parallel call took over


@dataclass(frozen=True)
class DataParallelMeshDims:
    """Which dims of a full mesh are data parallel (PyTorch 2.13's name): ``shard`` dims hold
    parameters sharded (FSDP), ``replicate`` dims replicated (DDP, or HSDP beside ``shard``).
    A tuple of names acts as those dims flattened."""

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise DataParallelError("DataParallelMeshDims needs shard or replicate dims (or both)")

    @staticmethod
    def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
        return () if value is None else (value,) if isinstance(value, str) else tuple(value)

    @property
    def shard_names(self) -> tuple[str, ...]:
        return self._names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return self._names(self.replicate)


@dataclass(frozen=True)
class DataParallelDims:
    """The mesh parameters live on and its data-parallel dims (indices into ``mesh``)."""

    mesh: DeviceMesh
    shard: tuple[int, ...]
    replicate: tuple[int, ...]
    plain: DataParallelDims | None = None  # where plain parameters go, when not on ``mesh``

    @property
    def dims(self) -> tuple[int, ...]:
        return tuple(sorted(self.shard + self.replicate))

    def for_param(self, param: torch.Tensor) -> DataParallelDims:
        """The mesh and dims of ``param``: beside tensor parallelism on a sibling sub-mesh, a
        plain parameter stays on the data-parallel mesh alone (as in FSDP2 + TP)."""
        return self if isinstance(param, DTensor) or self.plain is None else self.plain


def resolve_dims(
    module: nn.Module,
    mesh: DeviceMesh | None,
    dp_mesh_dims: DataParallelMeshDims | None,
    what: str,
    *,
    replicate_only: bool = False,
) -> DataParallelDims:
    """The data-parallel mesh and dims of ``what`` applied to ``module`` with ``mesh``.

    ``mesh`` is the data-parallel mesh (1-D: data parallel; 2-D: HSDP, replicate over dim 0 and
    shard over dim 1), or, with ``dp_mesh_dims``, the full mesh whose named dims are data
    parallel. When tensor parallelism put the parameters on a sibling sub-mesh of the same root
    (``mesh["tp"]`` beside ``mesh["dp"]``), the parameters move to the root's sub-mesh over
    both (PyTorch's FSDP2 + TP recipe)."""
    meshes = {
        p.device_mesh for p in module.parameters()
        if isinstance(p, DTensor) and not getattr(p, MANAGED, False)
    }
    if len(meshes) > 1:
        raise DataParallelError(
            f"{what} of {type(module).__name__}: its parameters live on several meshes "
            f"{sorted(map(str, meshes))}; put them on one"
        )
    if mesh is None:
        mesh = next(iter(meshes)) if dp_mesh_dims is not None and meshes else _default_mesh()
    mesh = require_mesh(mesh, what, "mesh" if what == "fully_shard" else "device_mesh")
    if dp_mesh_dims is not None:
        shard = tuple(mesh.dim_index(n) for n in dp_mesh_dims.shard_names)
        rep = tuple(mesh.dim_index(n) for n in dp_mesh_dims.replicate_names)
        if meshes and next(iter(meshes)) != mesh:
            raise DataParallelError(
                f"{what} of {type(module).__name__} with dp_mesh_dims on {mesh}: its parameters "
                f"are DTensors on {next(iter(meshes))}; dp_mesh_dims names dims of the mesh the "
                f"parameters live on"
            )
        return _checked(DataParallelDims(mesh, shard, rep), replicate_only, what)
    parent = next(iter(meshes)) if meshes else None
    root = mesh.root_mesh
    if parent is None and root is not mesh and not per_rank(root, what):
        parent = root  # the global view: data parallelism over these dims of the whole mesh
    if parent is None or parent == mesh:
        if mesh.ndim > 2 or (parent is not None and mesh.ndim > 1):
            raise DataParallelError(
                (f"{what} of {type(module).__name__} on the {mesh.ndim}-D {mesh} where its "
                 f"parameters already live" if parent is not None else
                 f"{what} expects a 1D or 2D DeviceMesh but got {mesh} ({mesh.ndim}-D) for "
                 f"{type(module).__name__}")
                + ": pass the data-parallel sub-mesh (mesh['dp']), or the full mesh with "
                "dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...)"
            )
        if mesh.ndim == 2:  # HSDP: replicate over dim 0, shard over dim 1
            return _checked(DataParallelDims(mesh, (1,), (0,)), replicate_only, what)
        return _checked(DataParallelDims(mesh, (0,), ()), replicate_only, what)
    if parent.root_mesh == mesh.root_mesh and set(mesh.root_dims) <= set(parent.root_dims):
        # the parameters' mesh holds the data-parallel dims (tensor parallelism on the root)
        dims = tuple(parent.root_dims.index(d) for d in mesh.root_dims)
        split = (dims[1:], dims[:1]) if len(dims) == 2 else (dims, ())
        return _checked(DataParallelDims(parent, *split), replicate_only, what)
    return _checked(_compose(module, mesh, parent, what), replicate_only, what)


def _default_mesh() -> DeviceMesh:
    """PyTorch's default data-parallel mesh: one dim over every process of the world."""
    return init_device_mesh("cpu", (runtime.rank_and_world()[1],))


def _compose(
    module: nn.Module, dp_mesh: DeviceMesh, parent: DeviceMesh, what: str
) -> DataParallelDims:
    """Parameters on ``parent`` (say mesh["tp"]) and data parallelism on ``dp_mesh`` (say
    mesh["dp"]), two sub-meshes of one root: the root's sub-mesh over both."""
    root = dp_mesh.root_mesh
    if parent.root_mesh != root:
        parent = _within(root, parent)  # the same sub-mesh, reached from another unflattening
    if parent.root_mesh != root or set(dp_mesh.root_dims) & set(parent.root_dims):
        raise DataParallelError(
            f"{what} of {type(module).__name__} on {dp_mesh}: its parameters are DTensors on "
            f"{parent}, which is not a disjoint sibling of it in one mesh; index both from the "
            f"same mesh (parallelize_module(model, mesh['tp'], plan), then {what} on "
            f"mesh['dp']), or pass the parameters' mesh with dp_mesh_dims"
        )
    if not per_rank(root, f"{what} of {type(module).__name__}"):
        raise DataParallelError(
            f"{what} of {type(module).__name__} on {dp_mesh} beside parameters on {parent}: "
            f"{of(root).describe()}, where a sub-mesh is one group of devices, not this rank's; "
            f"apply tensor parallelism on the whole mesh (parallelize_module(model, mesh, plan, "
            f"tp_mesh_dim=...)) and pass {what} mesh['dp']"
        )
    dims = sorted(dp_mesh.root_dims + parent.root_dims)
    names = root.mesh_dim_names
    combined = root if len(dims) == root.ndim else root[tuple(names[d] for d in dims)]
    dp = tuple(dims.index(d) for d in dp_mesh.root_dims)
    plain = resolve_dims(nn.Module(), dp_mesh, None, what)
    if len(dp) == 2:
        return DataParallelDims(combined, (dp[1],), (dp[0],), plain)
    return DataParallelDims(combined, dp, (), plain)


def _within(root: DeviceMesh, mesh: DeviceMesh) -> DeviceMesh:
    """``mesh`` as a sub-mesh of ``root`` where ``root`` has its dims by name over the same
    devices (torchtitan reaches mesh["tp"] and mesh["fsdp"] from two ``_unflatten``s of one
    world mesh); else ``mesh`` itself."""
    names, root_names = mesh.mesh_dim_names, root.mesh_dim_names
    if names and root_names and set(names) <= set(root_names):
        candidate = root[tuple(names)]
        if candidate == mesh:
            return candidate
    return mesh


def _checked(dims: DataParallelDims, replicate_only: bool, what: str) -> DataParallelDims:
    if replicate_only:
        plain = None if dims.plain is None else _checked(dims.plain, True, what)
        return DataParallelDims(dims.mesh, (), dims.dims, plain)
    if not dims.shard and what == "fully_shard":
        raise DataParallelError(f"fully_shard on {dims.mesh} needs a shard dim")
    return dims


def compute_placements(
    param: torch.Tensor, dp: DataParallelDims, name: str, what: str
) -> list[Placement]:
    """The parameter's placements before data parallelism (Replicate on the dp dims)."""
    if not isinstance(param, DTensor):
        return [Replicate()] * dp.mesh.ndim
    if param.device_mesh != dp.mesh:  # a sibling sub-mesh: its placements on the other dims
        sub = [d for d in range(dp.mesh.ndim) if d not in dp.dims]
        placements: list[Placement] = [Replicate()] * dp.mesh.ndim
        for d, p in zip(sub, param.placements, strict=True):
            placements[d] = p
        return placements
    placements = list(param.placements)
    for d in dp.dims:
        if not placements[d].is_replicate():
            raise DataParallelError(
                f"{what}: parameter {name!r} of shape {list(param.shape)} has placements "
                f"{placements} on {dp.mesh}, but mesh dim {d} (data parallel) must be "
                f"Replicate before data parallelism shards or replicates it"
            )
    return placements


def owned_parameters(
    module: nn.Module, ignored: set[int] = frozenset()  # type: ignore[assignment]
) -> Iterator[tuple[nn.Module, str, torch.Tensor]]:
    """(owning module, attribute name, parameter) for each distinct parameter, in order,
    without those whose id is in ``ignored``."""
    seen: set[int] = set(ignored)
    for owner in module.modules():
        for name, param in list(owner._parameters.items()):
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                yield owner, name, param


def place_parameter(root: nn.Module, param: torch.Tensor, value: torch.Tensor) -> nn.Parameter:
    """Make ``value`` the parameter in place of ``param`` in every module of ``root`` that
    holds it (tied weights stay tied)."""
    new = nn.Parameter(value, requires_grad=param.requires_grad)
    for module in root.modules():
        for key, p in module._parameters.items():
            if p is param:
                module._parameters[key] = new
    setattr(param, REPLACED, True)  # a module outside ``root`` still holding it is an error
    return new


def aliases(root: nn.Module, owner: nn.Module, name: str) -> tuple[tuple[nn.Module, str], ...]:
    """The other (module, attribute) pairs of ``root`` that hold ``owner``'s parameter
    ``name`` (a tied weight): a forward gathers it into each of them."""
    param = owner._parameters[name]
    return tuple(
        (module, key) for module in root.modules() for key, p in module._parameters.items()
        if p is param and not (module is owner and key == name)
    )


def stored_value(param: torch.Tensor, dp: DataParallelDims, storage: list[Placement]) -> DTensor:
    """``param`` (plain, on ``dp.mesh``, or on a sibling sub-mesh) as a DTensor on ``dp.mesh``
    with ``storage`` placements. A sibling sub-mesh's pieces are already this rank's pieces;
    meta parameters stay meta."""
    from ..deferred_init import is_meta, placed_meta

    if isinstance(param, DTensor) and param.device_mesh != dp.mesh:
        compute = compute_placements(param, dp, "", "")
        held = local_of(param.detach())
        spec = DTensorSpec(dp.mesh, tuple(compute), held.spec.tensor_meta)
        param = build(held.replace(spec=spec))
    if isinstance(param, DTensor) and is_meta(param):
        return placed_meta(param, storage)
    if isinstance(param, DTensor):
        return _owning(param.detach().redistribute(placements=storage))
    return _owning(distribute_tensor(param.detach(), dp.mesh, storage, src_data_rank=0))


def _owning(stored: DTensor) -> DTensor:
    """``stored`` with every component that is a slice of a larger storage (a shard cut from
    the whole parameter) copied into its own: a stored chunk must not keep the whole alive."""
    set_local(stored, local_of(stored).map(
        lambda c: c.clone(memory_format=torch.contiguous_format)
        if c.untyped_storage().nbytes() > c.nbytes else c
    ))
    return stored


# ----- which view a forward runs in -----------------------------------------------------------

_OUTERMOST = settings.DATA_PARALLEL_VIEW


def choose_view(dp: DataParallelDims, args: tuple, kwargs: dict) -> tuple[View, bool]:
    """(the view of the plain tensors, whether this is the outermost data-parallel forward). Inner
    modules run in the view their outermost module chose; DTensor inputs that carry the
    data-parallel dims choose the global view; otherwise the plain-tensor rule decides."""
    outer = _OUTERMOST.get()
    if outer is not None:
        return outer, False
    root, dp_root_dims = dp.mesh.root_mesh, {dp.mesh.root_dims[d] for d in dp.dims}
    for x in tree_flatten((args, kwargs))[0]:
        if isinstance(x, DTensor):
            m = x.device_mesh
            if m.root_mesh == root and dp_root_dims <= set(m.root_dims):
                return View.GLOBAL, True
    return plain_view(dp.mesh), True


def enter_view(view: View) -> contextvars.Token:
    return _OUTERMOST.enter(view)


def leave_view(token: contextvars.Token) -> None:
    _OUTERMOST.leave(token)


def shard_batch(dp: DataParallelDims, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Global view, outermost module: plain tensors are the global batch, sharded on dim 0
    over the data-parallel dims (Replicate elsewhere). DTensors pass unchanged."""
    placements: list[Placement] = [Replicate()] * dp.mesh.ndim
    for d in dp.dims:
        placements[d] = Shard(0)

    def place(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.ndim > 0:
            return place_tensor(x, dp.mesh, placements)
        return x

    return tree_map(place, args), tree_map(place, kwargs)


# ----- the tensor a forward computes with -----------------------------------------------------


def local_sub_mesh(dp: DataParallelDims) -> DeviceMesh | None:
    """The sub-mesh of the non-data-parallel dims through this rank's device (None: no dim)."""
    rest = [d for d in range(dp.mesh.ndim) if d not in dp.dims]
    if not rest:
        return None
    names = dp.mesh.mesh_dim_names
    if names is None:
        raise DataParallelError(
            f"data parallelism beside other dims of {dp.mesh} needs named mesh dims"
        )
    return dp.mesh[tuple(names[d] for d in rest)]


class GatheredView(torch.autograd.Function):
    """A stored parameter as the tensor a forward computes with: gathered over the
    data-parallel dims (cast to ``dtype``), on the whole mesh (global view) or, per rank, on
    the sub-mesh of the other dims (``sub``, a plain tensor when there is none). Backward
    hands the gradient back as a pending reduction over the data-parallel dims, in
    ``reduce_dtype`` and times ``scale``: per rank a pending average (each rank's own batch),
    globally as it came (the batch was sharded over those dims). ``pieces``: the gathered
    components when a packed gather (``gather_packed``) already brought them."""

    @staticmethod
    def forward(
        ctx, stored: DTensor, compute: tuple, dp: DataParallelDims, view: View, sub: Any,
        dtype: torch.dtype | None, reduce_dtype: torch.dtype | None, scale: float,
        pieces: list[torch.Tensor] | None = None,
    ):
        ctx.dp, ctx.view, ctx.reduce_dtype, ctx.scale = dp, view, reduce_dtype, scale
        ctx.stored_dtype = stored.dtype
        if pieces is None:
            source = stored if dtype is None or dtype == stored.dtype else stored.to(dtype)
            gathered = source.redistribute(placements=compute)
        else:
            meta = dataclasses.replace(local_of(stored).spec.tensor_meta, dtype=pieces[0].dtype)
            gathered = DTensor(list(pieces), DTensorSpec(stored.device_mesh, compute, meta))
        if view is View.GLOBAL:
            return gathered
        held = local_of(gathered)
        if sub is None:
            return held.pieces[0]
        placements = tuple(p for d, p in enumerate(compute) if d not in dp.dims)
        return DTensor([held.pieces[0]], DTensorSpec(sub, placements, held.spec.tensor_meta))

    @staticmethod
    @eager_under_dynamo  # backward runs it eagerly, also after a compiled forward
    def backward(ctx, grad: torch.Tensor):
        dp: DataParallelDims = ctx.dp
        dtype = ctx.reduce_dtype or grad.dtype
        if ctx.scale != 1.0:
            grad = grad * ctx.scale
        rest_of_args = (None,) * 8
        if ctx.view is View.GLOBAL:
            return grad.to(dtype), *rest_of_args
        if isinstance(grad, DTensor):
            piece, rest = local_of(grad).pieces[0], list(grad.placements)
        else:
            piece, rest = grad, []
        placements: list[Placement] = []
        for d in range(dp.mesh.ndim):
            placements.append(Partial("avg") if d in dp.dims else rest.pop(0))
        meta = TensorMeta(piece.shape if not isinstance(grad, DTensor) else grad.shape,
                          tuple(grad.stride()), dtype)
        spec = DTensorSpec(dp.mesh, tuple(placements), meta)
        return DTensor([piece.to(dtype)], spec), *rest_of_args


class OnCombinedMesh(torch.autograd.Function):
    """Global view beside tensor parallelism per rank: a parameter gathered on the
    data-parallel mesh alone (a plain one, kept there as FSDP2 + TP keeps it) as the same
    tensor on the unit's ``combined`` mesh (Replicate on the other dims), so it meets the
    activations there. Backward reduces the gradient over the other dims and hands it back on
    the data-parallel mesh, still pending over its dims."""

    @staticmethod
    def forward(ctx, gathered: DTensor, dp: DataParallelDims, combined: DataParallelDims):
        ctx.dp, ctx.combined = dp, combined
        mesh = combined.mesh
        placements: list[Placement] = [Replicate()] * mesh.ndim
        for d, p in zip(_dims_in(dp.mesh, mesh), gathered.placements, strict=True):
            placements[d] = p
        held = local_of(gathered)
        by_device = held.by_device()
        comps = [by_device[d] for d in mesh.local_device_ids]
        return DTensor(comps, DTensorSpec(mesh, tuple(placements), held.spec.tensor_meta))

    @staticmethod
    @eager_under_dynamo
    def backward(ctx, grad: DTensor):
        dp, mesh = ctx.dp, ctx.combined.mesh
        dims = _dims_in(dp.mesh, mesh)
        target = [p if d in dims else Replicate() for d, p in enumerate(grad.placements)]
        if list(grad.placements) != target:
            grad = grad.redistribute(placements=target)
        held = local_of(grad)
        by_device = held.by_device()
        comps = [by_device[d] for d in dp.mesh.local_device_ids]
        spec = DTensorSpec(dp.mesh, tuple(target[d] for d in dims), held.spec.tensor_meta)
        return DTensor(comps, spec), None, None


def _dims_in(sub: DeviceMesh, mesh: DeviceMesh) -> list[int]:
    """The dims of ``mesh`` that ``sub``'s dims are (two sub-meshes of one root)."""
    return [mesh.root_dims.index(d) for d in sub.root_dims]


def reduce_gradient(param: DTensor, storage: tuple[Placement, ...]) -> None:
    """``param.grad`` (pending over the data-parallel dims) reduced to the stored placements,
    in the parameter's dtype."""
    grad = param.grad
    if not isinstance(grad, DTensor) or grad.placements == storage:
        return
    target = [Replicate() if p.is_partial() else p for p in storage]
    reduced = grad.redistribute(placements=target)
    param.grad = reduced if reduced.dtype == param.dtype else reduced.to(param.dtype)


# ----- packed collectives: one per unit instead of one per parameter ------------------------


def packed_dim(
    stored: torch.Tensor, compute: Sequence[Placement], storage: Sequence[Placement],
    dp: DataParallelDims,
) -> int | None:
    """The data-parallel mesh dim over which this parameter's gather and gradient reduction
    can travel in one packed collective with its unit's others (None: it goes on its own).
    That is the common case: one shard dim, stored ``Shard(0)`` there, every other dim stored
    as it computes, none of them (of more than one device) splitting tensor dim 0; or FSDP x
    TP's: stored ``InterleavedShard(0, k)`` beside a later mesh dim of k devices that shards
    dim 0 (each device keeps a chunk of its own tensor-parallel shard, ``_rows``). Uneven
    chunks travel padded to the largest (FSDP2's padding)."""
    if len(dp.shard) != 1 or not isinstance(stored, DTensor) or stored.ndim == 0:
        return None
    d = dp.shard[0]
    kind = type(storage[d])
    if kind not in (Shard, InterleavedShard) or storage[d].dim != 0:
        return None
    if not compute[d].is_replicate() or stored.shape[0] == 0:
        return None
    blocks = storage[d].interleaved_size if kind is InterleavedShard else 1
    for e, (c, s) in enumerate(zip(compute, storage, strict=True)):
        if e == d:
            continue
        splits = getattr(c, "dim", None) == 0 and dp.mesh.shape[e] > 1
        if c != s or (splits and not (type(c) is Shard and e > d
                                      and dp.mesh.shape[e] == blocks)):
            return None
        if splits:
            blocks = 1  # the one dim that the interleaved blocks are split over
    return d if blocks == 1 else None


def _rows(param: DTensor, storage: Sequence[Placement], d: int) -> int:
    """Rows of ``param``'s components once gathered over mesh dim ``d`` (``packed_dim``): the
    whole tensor's, or, stored ``InterleavedShard(0, k)``, one tensor-parallel shard's."""
    place = storage[d]
    return param.shape[0] // (place.interleaved_size if type(place) is InterleavedShard else 1)


def gather_packed(
    stored: Sequence[DTensor], d: int, dtype: torch.dtype | None, async_op: bool = False
) -> list[list[torch.Tensor]] | Pending[list[list[torch.Tensor]]]:
    """Per parameter, its components gathered over mesh dim ``d`` (cast to ``dtype``), by one
    ``all_gather_tensor`` of every parameter's flattened local chunk (each ``packed_dim`` ``d``,
    on one mesh): FSDP2's packed all-gather, each chunk padded to the largest. Each gathered
    component has its own storage. ``async_op``: the chunks are packed and the collective
    issued now, a ``Pending`` whose ``finish()`` waits and cuts the parameters out (fully_shard's
    prefetch)."""
    mesh = stored[0].device_mesh
    n = mesh.shape[d]
    held = [local_of(s).pieces for s in stored]
    n_local = len(held[0])
    rows_of = [_rows(s, s.placements, d) for s in stored]
    widths = [-(-r // n) for r in rows_of]  # rows of the largest chunk
    rests = [[h[i].shape[1:] for h in held] for i in range(n_local)]

    def describe() -> str:
        return f"fully_shard's packed gather of {len(stored)} parameters"

    with torch.no_grad():
        flats = []
        for i in range(n_local):
            parts = []
            for h, width in zip(held, widths, strict=True):
                parts += _padded(h[i], width, dtype)
            flats.append(torch.cat(parts))
        gathered = move.all_gather_tensor(describe, mesh, d, flats, 0, lambda _: flats[0].shape,
                                          async_op=True)

    def cut() -> list[list[torch.Tensor]]:
        with torch.no_grad():
            whole_flats = gathered.finish()
            out: list[list[torch.Tensor]] = [[] for _ in stored]
            for i in range(n_local):
                rows = whole_flats[i].view(n, -1)
                start = 0
                for j, (rest, width, r) in enumerate(zip(rests[i], widths, rows_of,
                                                         strict=True)):
                    end = start + width * rest.numel()
                    whole = rows[:, start:end].reshape(n * width, *rest)
                    out[j].append(whole if n * width == r else whole[:r])
                    start = end
        return out

    return Pending(cut) if async_op else cut()


def _padded(c: torch.Tensor, width: int, dtype: torch.dtype | None) -> list[torch.Tensor]:
    """``c`` (a chunk of ``width`` rows or fewer) flattened, in ``dtype``, then the zeros that
    pad it to ``width`` rows."""
    flat = (c if dtype is None or c.dtype == dtype else c.to(dtype)).reshape(-1)
    missing = (width - c.shape[0]) * c.shape[1:].numel()
    return [flat, flat.new_zeros(missing)] if missing else [flat]


def reducible_packed(param: DTensor, storage: Sequence[Placement], d: int) -> str | None:
    """The reduce op when ``param.grad`` can join its unit's packed reduce-scatter over mesh
    dim ``d``: pending there, on every other dim already as stored (else None)."""
    grad = param.grad
    if not isinstance(grad, DTensor) or not isinstance(grad.placements[d], Partial):
        return None
    for e, (g, s) in enumerate(zip(grad.placements, storage, strict=True)):
        if e != d and g != s:
            return None
    return grad.placements[d].reduce_op


def reduce_packed(
    params: Sequence[DTensor], storages: Sequence[tuple[Placement, ...]], d: int, op: str,
    async_op: bool = False,
) -> Pending[None] | None:
    """Each ``param.grad`` (``reducible_packed`` with ``op`` over ``d``, one mesh and dtype)
    reduced to its stored placements by one ``reduce_scatter`` of all of them (FSDP2's packed
    reduce-scatter, uneven chunks padded), in the parameter's dtype; the gradients are views
    of its result. ``async_op``: the reduce-scatter issued and not waited, each ``param.grad``
    None (its unsharded gradient freed) until the returned ``Pending`` is finished."""
    grads: list[DTensor] = [p.grad for p in params]
    mesh = grads[0].device_mesh
    n = mesh.shape[d]
    held = [local_of(g) for g in grads]
    n_local = len(held[0].pieces)
    rows_of = [_rows(g, storage, d) for g, storage in zip(grads, storages, strict=True)]
    widths = [-(-r // n) for r in rows_of]
    coords = [mesh.coordinate_of(device)[d] for device in mesh.local_device_ids]
    with torch.no_grad():
        pieces = []
        for i in range(n_local):
            packed = torch.cat([torch.cat(_padded(h.pieces[i], n * w, None)).view(n, -1)
                                for h, w in zip(held, widths, strict=True)], 1)
            pieces.append(list(packed.unbind(0)))
        issued = move.reduce_scatter(
            lambda: f"fully_shard's packed gradient of {len(params)} parameters", mesh, d, pieces,
            op, async_op)
    # what the reduced gradients are cut by (the unsharded ones are not kept)
    rests = [[h.pieces[i].shape[1:] for i in range(n_local)] for h in held]
    specs = [h.spec.with_placements(storage) for h, storage in zip(held, storages, strict=True)]
    del grads, held, pieces
    if async_op:
        for p in params:
            p.grad = None

    @torch.no_grad()
    def assign() -> None:
        reduced = issued.finish() if isinstance(issued, Pending) else issued
        starts = [0] * n_local
        for p, rest_of, spec, w, r in zip(params, rests, specs, widths, rows_of, strict=True):
            comps = []
            sizes = chunk_sizes(r, n)
            for i in range(n_local):
                end = starts[i] + w * rest_of[i].numel()
                whole = reduced[i][starts[i] : end].view(w, *rest_of[i])
                comps.append(whole[: sizes[coords[i]]])
                starts[i] = end
            grad = DTensor(comps, spec)
            p.grad = grad if grad.dtype == p.dtype else grad.to(p.dtype)

    if async_op:
        return Pending(assign)
    assign()
    return None
