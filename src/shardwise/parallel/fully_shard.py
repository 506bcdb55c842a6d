"""``fully_shard``: fully sharded data parallelism with PyTorch FSDP2's signature and methods.

Each parameter, and hence the optimizer state built from it, is stored sharded (Shard(0), or
what ``shard_placement_fn`` says) on the data-parallel mesh dims, tensor-parallel dims keeping
their placements. Before the module's forward its parameters are gathered (``data_parallel``:
per rank into plain tensors or DTensors on the tensor-parallel sub-mesh, as FSDP2; in the
embedded global view into DTensors on the whole mesh); after it the module holds the stored
parameters again. With ``reshard_after_forward`` what autograd saves of them is re-gathered
when backward needs it. Gradients are reduce-scattered to the stored placements once each
parameter's gradient is complete. Applied per submodule, each call manages the parameters not
managed by an earlier call: apply it to the inner blocks first, then to the root.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, overload

from torch import nn

from ..deferred_init import materialize_if_root
from ..errors import DataParallelError
from ..mesh import DeviceMesh
from ..placements import InterleavedShard, Placement, RaggedShard, Shard
from .data_parallel import (
    MANAGED,
    REPLACED,
    DataParallelMeshDims,
    aliases,
    compute_placements,
    owned_parameters,
    place_parameter,
    resolve_dims,
    stored_value,
)
from .dp_unit import DataParallelModule, DataParallelUnit, Slot, guard_calls
from .policies import MixedPrecisionPolicy, OffloadPolicy
from .state_dict import guard_loading


class FSDPModule(DataParallelModule):
    """What ``fully_shard`` makes of a module (its class becomes ``FSDP<Class>``): FSDP2's
    methods over the parameters that call manages."""

    _shardwise_unit: DataParallelUnit

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather the parameters now; the next forwards use them until ``reshard`` (or until
        the optimizer changes them). The gather is synchronous: with ``async_op`` the
        ``UnshardHandle`` returned has nothing left to wait for."""
        self._shardwise_unit.unshard()
        return UnshardHandle() if async_op else None

    def reshard(self) -> None:
        """Free the gathered parameters ``unshard`` (or ``set_reshard_after_backward``) kept."""
        self._shardwise_unit.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True
                                   ) -> None:
        """Whether backward reduces gradients over the data-parallel dims. Off, each rank's
        gradient accumulates as a pending average (``Partial("avg")``) that the next synced
        backward reduces with its own (gradient accumulation without communication)."""
        for unit in self._units(recurse):
            unit.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: whether backward also all-reduces over the replicate dim (off: only the
        reduce-scatter over the shard dim runs; the replicate dim stays pending)."""
        for unit in self._units(recurse):
            unit.requires_all_reduce = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether the gathered parameters are freed after forward (re-gathered in backward)."""
        for unit in self._units(recurse):
            unit.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True
                                   ) -> None:
        """False keeps the gathered parameters after forward and backward, so the next forward
        gathers nothing while they are unchanged (gradient accumulation)."""
        for unit in self._units(recurse):
            unit.reshard_after_backward = reshard_after_backward
            if reshard_after_backward:
                unit.reshard()

    def reset_iter_state(self) -> None:
        """After an exception aborted a forward or backward: every ``fully_shard`` module
        under this one (call it on the root) restores what its unfinished forwards set, frees
        its gathered parameters and forgets the gradients waiting to be reduced (that
        iteration's gradients are lost), so the next iteration runs normally."""
        for unit in self._units(True):
            unit.reset()

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """PyTorch's (private): every ``fully_shard`` module under this one issues its
        pre-forward and pre-backward gathers with ``async_op`` and waits for them before the
        module runs, so their buffers come from the calling stream. shardwise's gathers are
        issued on the calling stream and waited before the module runs either way, so this
        records the flag (``DataParallelUnit.unshard_async_op``); values are unchanged."""
        for unit in self._units(True):
            unit.unshard_async_op = bool(async_op)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """FSDP2 waits for its asynchronous reductions after the last backward; shardwise's
        are waited at the end of every backward, so this only records the flag."""
        for unit in self._units(True):
            unit.is_last_backward = is_last_backward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Reduce gradients to their sum over the data-parallel ranks divided by ``factor``
        (default: the number of those ranks, an average); torchtitan sets 1.0 (a sum)."""
        if not factor > 0:
            raise DataParallelError(f"set_gradient_divide_factor needs a positive factor, got "
                                    f"{factor!r}")
        for unit in self._units(True):
            unit.gradient_divide_factor = float(factor)

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """When this module gathers its parameters for forward, also issue the gathers of
        ``modules`` (instead of the next module in the recorded order), waited when their
        forward starts; an empty list restores the implicit prefetch (FSDP2's)."""
        unit = self._shardwise_unit
        targets = _fsdp_modules(modules, "set_modules_to_forward_prefetch")
        unit.forward_targets[id(self)] = [(m._shardwise_unit, m) for m in targets]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """When this module re-gathers its parameters in backward, also issue the re-gathers
        of ``modules`` (instead of the module before it in forward); an empty list restores
        the implicit prefetch (FSDP2's)."""
        self._shardwise_unit.backward_targets = [
            m._shardwise_unit for m in _fsdp_modules(modules, "set_modules_to_backward_prefetch")]

    def set_implicit_prefetch(self, forward: int = 1, backward: int = 1, *,
                              recurse: bool = True) -> None:
        """How many modules ahead the implicit prefetch gathers (shardwise's; FSDP2's
        implicit prefetch is one module): in forward, those that follow this one in the
        order recorded by the previous forward; in backward, those that ran before it in
        forward. 0 turns it off."""
        if forward < 0 or backward < 0:
            raise DataParallelError(f"set_implicit_prefetch needs counts >= 0, got forward="
                                    f"{forward!r}, backward={backward!r}")
        for unit in self._units(recurse):
            unit.forward_depth, unit.backward_depth = forward, backward

    def _units(self, recurse: bool) -> list[DataParallelUnit]:
        modules = self.modules() if recurse else [self]  # type: ignore[attr-defined]
        return [m._shardwise_unit for m in modules if isinstance(m, FSDPModule)]


class UnshardHandle:
    """What ``FSDPModule.unshard(async_op=True)`` returns (PyTorch's name): the gather has
    finished by then, so ``wait`` returns at once."""

    def wait(self) -> None:
        """The gathered parameters are the module's already."""


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Let ``module.<method_name>`` (a method other than ``forward`` that callers run
    directly) gather and release the parameters as ``forward`` does: the method runs between
    the module's pre- and post-forward steps. A module ``fully_shard`` was not applied to is
    left alone (PyTorch's no-op)."""
    if not isinstance(module, FSDPModule):
        return
    method = getattr(module, method_name, None)
    if not callable(method):
        raise DataParallelError(
            f"register_fsdp_forward_method: {type(module).__name__} has no method "
            f"{method_name!r}"
        )
    unit = module._shardwise_unit

    @functools.wraps(method)
    def gathered(*args: Any, **kwargs: Any) -> Any:
        depth = len(unit.active)
        args, kwargs = unit.before_forward(module, args, kwargs)
        try:
            output = method(*args, **kwargs)
        except BaseException:
            unit.unwind(depth)
            raise
        return unit.after_forward(module, args, kwargs, output)

    setattr(module, method_name, gathered)


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """PyTorch's: let ``modules`` share their communication streams. shardwise's gathers and
    reductions run on the calling stream, so there is nothing to share; checks the modules."""
    _fsdp_modules(modules, "share_comm_ctx")


def _fsdp_modules(modules: Sequence[Any], what: str) -> list[FSDPModule]:
    bad = [m for m in modules if not isinstance(m, FSDPModule)]
    if bad:
        raise DataParallelError(
            f"{what} expects modules fully_shard was applied to, got "
            f"{', '.join(type(m).__name__ for m in bad)}")
    return list(modules)


_CLASSES: dict[type, type] = {}


def _as_fsdp_module(module: nn.Module, unit: DataParallelUnit) -> None:
    cls = type(module)
    if not issubclass(cls, FSDPModule):
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        module.__class__ = _CLASSES[cls]
    module._shardwise_unit = unit
    guard_calls(module, unit)


ShardPlacementFn = Callable[[nn.Parameter], Shard | None]


@overload
def fully_shard(module: nn.Module, **kwargs: Any) -> nn.Module: ...
@overload
def fully_shard(module: Sequence[nn.Module], **kwargs: Any) -> list[nn.Module]: ...


def fully_shard(
    module: nn.Module | Sequence[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | None = None,
    shard_placement_fn: ShardPlacementFn | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 (frozen)
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008 (frozen)
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> nn.Module | list[nn.Module]:
    """Shard ``module``'s parameters over the data-parallel ``mesh`` (PyTorch FSDP2).

    ``mesh``: 1-D data parallel; 2-D HSDP (replicate over dim 0, shard over dim 1); the
    ``mesh["dp"]`` sibling of the ``mesh["tp"]`` tensor parallelism used (parameters become
    2-D DTensors on the root's sub-mesh over both); or, with ``dp_mesh_dims``, the full mesh
    the parameters live on. Default: one dim over every process. ``reshard_after_forward``:
    None frees gathered parameters after forward except in the outermost module.
    ``shard_placement_fn(param)`` may return a ``Shard(dim)`` to shard on instead of dim 0,
    or a ``RaggedShard(dim, sizes)`` (one size per data-parallel device) to align the shards
    to blocks.
    A list of modules is one group (FSDP2's ``fully_shard([a, b])``). Returns the module(s),
    now instances of ``FSDPModule``; build the optimizer after.
    """
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        raise DataParallelError(
            f"fully_shard(reshard_after_forward={reshard_after_forward}): resharding to a "
            f"smaller world size after forward is not supported; use True, False or None"
        )
    modules = list(module) if isinstance(module, Sequence) else [module]
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise DataParallelError(
            f"fully_shard expects an nn.Module or a list of them, got {module!r}"
        )
    group = nn.ModuleList(modules) if len(modules) > 1 else modules[0]
    dp = resolve_dims(group, mesh, dp_mesh_dims, "fully_shard")
    ignored = {id(p) for p in ignored_params or ()}
    slots: list[Slot] = []
    inner = {id(slot.stored) for m in group.modules() if isinstance(m, DataParallelModule)
             for u in m._shardwise_units for slot in u.slots}
    foreign: list[str] = []  # managed by a call on modules outside this one (tied across calls)
    for owner, name, param in list(owned_parameters(group, ignored)):
        if getattr(param, REPLACED, False) or (
                getattr(param, MANAGED, False) and id(param) not in inner):
            foreign.append(f"{type(owner).__name__}.{name}")
            continue
        if getattr(param, MANAGED, False):
            continue  # an inner fully_shard() or replicate() manages it
        pdp = dp.for_param(param)
        compute = compute_placements(param, pdp, name, "fully_shard")
        storage = list(compute)
        shard = shard_placement_fn(param) if shard_placement_fn is not None else None
        if shard is not None and not isinstance(shard, Shard):
            raise DataParallelError(
                f"fully_shard: shard_placement_fn returned {shard!r} for parameter {name!r} of "
                f"shape {list(param.shape)}; it must return a Shard(dim) or None"
            )
        for d in pdp.shard:
            storage[d] = (
                _storage(param, compute, pdp.mesh, d, shard, name)
                if param.ndim > 0 else compute[d]
            )
        value = stored_value(param, pdp, storage)
        new = place_parameter(group, param, value)
        setattr(new, MANAGED, True)
        slots.append(Slot(owner, name, pdp, tuple(compute), tuple(storage),
                          aliases(group, owner, name)))
    materialize_if_root(group)  # after sharding: each device allocates only its shard
    unit = DataParallelUnit(
        dp, slots, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
        offload_policy=offload_policy, bucket_cap=None,
    )
    unit.foreign = foreign
    for m in modules:
        guard_loading(m)
        m.register_forward_pre_hook(unit.before_forward, with_kwargs=True)
        m.register_forward_hook(unit.after_forward, with_kwargs=True, always_call=True)
        _as_fsdp_module(m, unit)
    return modules if isinstance(module, Sequence) else modules[0]


def _storage(
    param: Any, compute: list[Placement], mesh: DeviceMesh, d: int, shard: Shard | None,
    name: str,
) -> Placement:
    """The stored placement on data-parallel mesh dim ``d``: ``Shard(dim)``, or where tensor
    parallelism shards the same tensor dim on later mesh dims, ``InterleavedShard`` over them:
    each device keeps its data-parallel chunk of its own tensor-parallel shard (FSDP2's
    strided shard), so sharding moves nothing and matches PyTorch's layout."""
    dim = 0 if shard is None else shard.dim
    if not -param.ndim <= dim < param.ndim:
        raise DataParallelError(
            f"fully_shard: shard_placement_fn returned {shard!r} for parameter {name!r} of "
            f"shape {list(param.shape)}, out of range"
        )
    dim %= param.ndim
    inner = 1
    for p, size in zip(compute[d + 1:], mesh.shape[d + 1:], strict=True):
        if type(p) is Shard and p.dim == dim:
            inner *= size
    if isinstance(shard, RaggedShard):
        return _ragged_storage(param, compute, mesh, d, RaggedShard(dim, shard.sizes), name)
    if inner > 1 and param.shape[dim] % inner == 0:
        return InterleavedShard(dim, interleaved_size=inner)
    return Shard(dim)


def _ragged_storage(
    param: Any, compute: list[Placement], mesh: DeviceMesh, d: int, shard: RaggedShard,
    name: str,
) -> RaggedShard:
    """A ``RaggedShard`` from ``shard_placement_fn`` (shards aligned to blocks, as veScale):
    one size per device of the data-parallel mesh dim, summing to the parameter's dim, which
    no other mesh dim may shard."""
    where = (
        f"fully_shard: shard_placement_fn returned {shard!r} for parameter {name!r} of shape "
        f"{list(param.shape)} on {mesh} (data-parallel mesh dim {d} of size {mesh.shape[d]})"
    )
    if any(isinstance(p, Shard) and p.dim == shard.dim for p in compute):
        raise DataParallelError(
            f"{where}: tensor parallelism shards dim {shard.dim} too; a ragged data-parallel "
            f"shard needs a dim no other mesh dim shards"
        )
    if len(shard.sizes) != mesh.shape[d] or sum(shard.sizes) != param.shape[shard.dim]:
        raise DataParallelError(
            f"{where}: its sizes need one entry per device of that mesh dim summing to "
            f"{param.shape[shard.dim]}"
        )
    return shard
