"""One ``fully_shard`` or ``replicate`` call's parameters: the forward hooks that swap each
stored parameter for the tensor the forward computes with (``data_parallel.GatheredView``),
re-gathering what backward needs when they were freed after forward, and the reduction of
their gradients once per backward (``dp_reduce``; ``data_parallel`` has the two views).
Parameters stored alike (``data_parallel.packed_dim``) are gathered and reduce-scattered
together, one packed collective per unit as FSDP2; the others each on their own."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import settings
from ..comm.native import Pending
from ..deferred_init import is_meta
from ..dtensor import DTensor, local_of
from ..errors import DataParallelError
from ..execution import View, plain_view
from ..mesh import DeviceMesh
from ..placements import Placement
from ..torch_compat import queue_autograd_callback, tree_map
from ..tracing import eager_under_dynamo
from .data_parallel import (
    DataParallelDims,
    GatheredView,
    OnCombinedMesh,
    choose_view,
    enter_view,
    gather_packed,
    leave_view,
    local_sub_mesh,
    packed_dim,
    reduce_gradient,
    shard_batch,
)
from .dp_reduce import Buckets, Packed
from .policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

_SCHEDULE = settings.FSDP_SCHEDULE  # the _Schedule of the outermost fully_shard forward


@dataclass
class Slot:
    """Where one managed parameter lives and how: placements to compute with and to store."""

    owner: nn.Module
    name: str
    dp: DataParallelDims
    compute: tuple[Placement, ...]
    storage: tuple[Placement, ...]
    aliases: tuple[tuple[nn.Module, str], ...] = ()  # other holders of a tied parameter

    def put(self, tensor: torch.Tensor) -> None:
        """Make ``tensor`` the parameter in its owner and in every other module holding it."""
        self.owner._parameters[self.name] = tensor
        for module, name in self.aliases:
            module._parameters[name] = tensor

    @functools.cached_property
    def sub(self) -> DeviceMesh | None:
        return local_sub_mesh(self.dp)

    @property
    def stored(self) -> DTensor:
        return self.owner._parameters[self.name]

    @functools.cached_property
    def packed(self) -> int | None:
        """The mesh dim of its unit's packed collectives it joins (None: on its own)."""
        return packed_dim(self.stored, self.compute, self.storage, self.dp)


class DataParallelUnit:
    """The parameters one data-parallel call manages and the state its ``FSDPModule``
    methods set."""

    def __init__(
        self,
        dp: DataParallelDims,
        slots: list[Slot],
        *,
        reshard_after_forward: bool | None,
        mp_policy: MixedPrecisionPolicy,
        offload_policy: OffloadPolicy,
        bucket_cap: int | None,
    ) -> None:
        self.dp, self.slots = dp, slots
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.is_last_backward = True
        self.unshard_async_op = False  # FSDPModule._set_unshard_async_op's, recorded
        self.gradient_divide_factor: float | None = None
        self.mp, self.offload = mp_policy, offload_policy
        self.held: dict[int, tuple[str, torch.Tensor, Any]] = {}  # k -> (view, tensor, version)
        self.regathered: dict[int, tuple[list[torch.Tensor], Any]] = {}  # backward's, k -> ...
        self.storages: dict[int, int] = {}  # storage of a view's piece -> slot index
        self.active: list[_Active] = []  # the forwards in progress, innermost last
        self.members: dict[int, list[int]] = {}  # id of a hooked module -> its slots
        # prefetch (``_Schedule``): the gathers issued early, those of a module's next forward
        # (by module id, with their view) and those of the next backward's re-gather
        self.prefetched: dict[int, tuple[str, Prefetched]] = {}
        self.prefetched_back: Prefetched = {}
        self.schedule: _Schedule | None = None  # its own, where it runs outermost
        self.backward_schedule: _Schedule | None = None  # the one its last forward ran under
        self.forward_targets: dict[int, list[tuple[DataParallelUnit, nn.Module]]] = {}
        self.backward_targets: list[DataParallelUnit] = []
        self.forward_depth = self.backward_depth = 1
        self.foreign: list[str] = []  # parameters it holds that another call manages
        self.reducer = Buckets(self, bucket_cap) if bucket_cap is not None else Packed(self)
        for k, slot in enumerate(slots):
            if slot.stored.requires_grad:
                slot.stored.register_post_accumulate_grad_hook(
                    functools.partial(self._on_grad, k)
                )

    # ----- views -----------------------------------------------------------------------------
    def _version(self, k: int) -> tuple:
        """Changes whenever slot ``k``'s stored parameter does: replaced, or written in place
        (through the DTensor, whose own counter moves, or through its components)."""
        stored = self.slots[k].stored
        return (id(stored), stored._version, tuple(c._version for c in local_of(stored).pieces))

    def views_of(
        self, ks: list[int], view: View, prefetched: Prefetched | None = None
    ) -> dict[int, torch.Tensor]:
        """``view_of`` for each of the slots ``ks``, those to gather that share a packing key
        (``pack_key``) by one packed gather (the one in ``prefetched`` if it gathered them as
        they are now)."""
        out: dict[int, torch.Tensor] = {}
        ready, groups = self._to_gather(ks, view)
        for k in ready:
            out[k] = self.view_of(k, view)
        for key, members in groups.items():
            gathered = self._take(prefetched, key, members)
            for k, pieces in zip(members, gathered, strict=True):
                out[k] = self.view_of(k, view, pieces)
        _drop(prefetched)
        return out

    def _to_gather(self, ks: list[int], view: View) -> tuple[list[int], dict[tuple, list[int]]]:
        """(the slots of ``ks`` no packed gather serves: held or going on their own; those to
        gather, by packing key)."""
        ready: list[int] = []
        groups: dict[tuple, list[int]] = {}
        for k in ks:
            key = self.pack_key(k)
            held = self.held.get(k)
            if key is None or (held is not None and held[0] == view
                               and held[2] == self._version(k)):
                ready.append(k)
            else:
                groups.setdefault(key, []).append(k)
        return ready, groups

    def _take(self, prefetched: Prefetched | None, key: tuple, members: list[int]
              ) -> list[list[torch.Tensor]]:
        """The packed gather of ``members`` (sharing ``key``): the prefetched one when it
        gathered these slots at their present versions, else one now (a stale prefetch is
        waited for and dropped)."""
        entry = prefetched.pop(key, None) if prefetched else None
        if entry is not None:
            if entry[0] == members and entry[1] == [self._version(k) for k in members]:
                return entry[2].finish()
            entry[2].finish()
        return gather_packed([self.slots[k].stored for k in members], key[1], key[2])

    def _issue(self, groups: dict[tuple, list[int]]) -> Prefetched:
        """The packed gathers of ``groups`` issued now, waited at first use."""
        return {
            key: (members, [self._version(k) for k in members],
                  gather_packed([self.slots[k].stored for k in members], key[1], key[2],
                                async_op=True))
            for key, members in groups.items()
        }

    def prefetch(self, module: nn.Module, view: View) -> None:
        """Issue the packed gathers ``module``'s next forward in ``view`` will need, unless
        issued already."""
        if id(module) in self.prefetched:
            return
        # not the parameters a forward of this unit running now holds gathered (the module
        # itself called twice in one forward, or a tied weight of a module of its group)
        busy = {k for entry in self.active for k in entry.stored}
        groups = self._to_gather([k for k in self._slots_of(module) if k not in busy], view)[1]
        if groups:
            self.prefetched[id(module)] = (view, self._issue(groups))

    def _regather_groups(self) -> dict[tuple, list[int]]:
        """What backward re-gathers: every slot not held, by packing key."""
        groups: dict[tuple, list[int]] = {}
        for j in range(len(self.slots)):
            key = self.pack_key(j)
            if key is not None and j not in self.held:
                groups.setdefault(key, []).append(j)
        return groups

    def prefetch_regather(self) -> None:
        """Issue backward's re-gather of this unit now (inside a backward), unless done or
        issued already; what is left unused when the backward ends is dropped."""
        if self.prefetched_back or self.regathered:
            return
        groups = self._regather_groups()
        if groups:
            self.prefetched_back = self._issue(groups)
            queue_autograd_callback(self.drop_regather)

    def drop_regather(self) -> None:
        _drop(self.prefetched_back)

    def drop_forward(self) -> None:
        """Wait for and drop the gathers prefetched for forwards: none is used after this."""
        for _, entries in self.prefetched.values():
            _drop(entries)
        self.prefetched.clear()

    def drop_prefetched(self) -> None:
        self.drop_forward()
        self.drop_regather()

    def pack_key(self, k: int) -> tuple | None:
        """What slot ``k``'s packed gather shares with the others it travels with (its mesh
        and dims, the shard dim, the dtype it computes in); None when it goes on its own."""
        slot = self.slots[k]
        d = slot.packed
        offloaded = (isinstance(self.offload, CPUOffloadPolicy)
                     and self.dp.mesh.device_type != "cpu")  # on a CPU mesh nothing moves
        if d is None or offloaded or is_meta(slot.stored):
            return None
        return slot.dp, d, self.mp.param_dtype or slot.stored.dtype

    def view_of(
        self, k: int, view: View, pieces: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Slot ``k``'s parameter as the forward computes with it (held ones reused while the
        stored parameter is unchanged; ``pieces``: its components a packed gather brought)."""
        held = self.held.get(k)
        if held is not None and held[0] == view and held[2] == self._version(k):
            return held[1]
        slot = self.slots[k]
        stored = slot.stored
        lifted = view is View.GLOBAL and slot.dp is not self.dp
        if view is View.GLOBAL and not lifted and self._as_stored(slot, stored):
            return stored  # replicate's parameter: the gathered view would be itself
        if isinstance(self.offload, CPUOffloadPolicy) and self.dp.mesh.device_type != "cpu":
            stored = stored.to(self.dp.mesh.device_type)
        tensor = self._gathered(slot, stored, view, self._scale(slot), pieces)
        for piece in _pieces(tensor):
            self.storages[piece.untyped_storage().data_ptr()] = k
        return tensor

    def _gathered(
        self, slot: Slot, stored: DTensor, view: View, scale: float,
        pieces: list[torch.Tensor] | None,
    ) -> torch.Tensor:
        """``GatheredView`` of ``stored``; in the global view, a parameter kept on the
        data-parallel mesh alone (``DataParallelDims.plain``) is moved onto the unit's mesh,
        where the activations are."""
        tensor = GatheredView.apply(
            stored, slot.compute, slot.dp, view, slot.sub, self.mp.param_dtype,
            self.mp.reduce_dtype, scale, pieces,
        )
        if view is View.GLOBAL and slot.dp is not self.dp:
            tensor = OnCombinedMesh.apply(tensor, slot.dp, self.dp)
        return tensor

    def _as_stored(self, slot: Slot, stored: DTensor) -> bool:
        """Whether the global view computes with the stored parameter itself: nothing to
        gather, cast, move or scale (its gradient arrives pending over the data-parallel dims
        either way, as the batch is sharded over them)."""
        mp = self.mp
        return (
            slot.compute == tuple(stored.placements)
            and mp.param_dtype in (None, stored.dtype)
            and mp.reduce_dtype in (None, stored.dtype)
            and self._scale(slot) == 1.0
            and not isinstance(self.offload, CPUOffloadPolicy)
        )

    def _scale(self, slot: Slot) -> float:
        """The factor on each rank's gradient: 1 averages over the data-parallel ranks;
        with ``gradient_divide_factor`` f the reduction is their sum over f (FSDP2)."""
        if self.gradient_divide_factor is None:
            return 1.0
        ranks = 1
        for d in slot.dp.dims:
            ranks *= slot.dp.mesh.size(d)
        return ranks / self.gradient_divide_factor

    def _slots_of(self, module: nn.Module) -> list[int]:
        """The slots whose parameters live in ``module`` (all of them, except in a group of
        modules, ``fully_shard([a, b])``, where each module has its own)."""
        found = self.members.get(id(module))
        if found is None:
            owners = {id(m) for m in module.modules()}
            found = self.members[id(module)] = [
                k for k, slot in enumerate(self.slots)
                if id(slot.owner) in owners or any(id(m) in owners for m, _ in slot.aliases)
            ]
        return found

    def unshard(self) -> None:
        """Gather every parameter now and hold it until ``reshard`` (or a change to it)."""
        self.drop_prefetched()
        view = plain_view(self.dp.mesh)
        for k, tensor in self.views_of(list(range(len(self.slots))), view).items():
            self.held[k] = (view, tensor, self._version(k))

    def reshard(self) -> None:
        """Free the held gathered parameters."""
        self.drop_prefetched()
        self.held.clear()

    def reset(self) -> None:
        """After an exception aborted a forward or backward: restore what unfinished forwards
        set, free every gathered parameter and forget the gradients waiting to be reduced."""
        self.unwind(0)
        self.reshard()
        self.regathered.clear()
        self.reducer.discard()

    # ----- forward hooks ---------------------------------------------------------------------
    # under torch.compile they run eagerly around the compiled forward, as FSDP2's; registered
    # as bound methods, so copy.deepcopy of the module rebinds them to the copied unit
    @torch.compiler.disable
    def before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.foreign:
            raise DataParallelError(
                f"{type(module).__name__} holds {', '.join(self.foreign)}, already managed by "
                f"another fully_shard call on modules outside it (a parameter shared across "
                f"calls): apply one fully_shard to the modules sharing it, fully_shard([a, b])"
            )
        view, outermost = choose_view(self.dp, args, kwargs)
        # what this forward sets is on the stack from here: ``after_forward`` (or ``unwind``,
        # for an exit it does not see) restores it
        entry = _Active(module, enter_view(view) if outermost else None, view)
        self.active.append(entry)
        if view is View.GLOBAL and outermost:
            args, kwargs = shard_batch(self.dp, args, kwargs)
        if self.mp.param_dtype is not None and self.mp.cast_forward_inputs:
            args, kwargs = _cast_floating((args, kwargs), self.mp.param_dtype)
        schedule = _SCHEDULE.get()
        if outermost:
            if self.schedule is None:
                self.schedule = _Schedule()
            schedule = self.schedule
            schedule.start()
            entry.schedule_token = _SCHEDULE.enter(schedule)
        mine = self.prefetched.pop(id(module), None)
        if mine is not None and mine[0] != view:
            _drop(mine[1])
        for k, tensor in self.views_of(self._slots_of(module), view,
                                       mine[1] if mine is not None else None).items():
            slot = self.slots[k]
            entry.stored[k] = slot.stored
            slot.put(tensor)
        if schedule is not None:
            schedule.arrive(self, module, view)
        reshard = self.reshard_after_forward
        if reshard is None:
            reshard = not outermost  # PyTorch: the root keeps its parameters for backward
        if reshard and torch.is_grad_enabled():
            saving = torch.autograd.graph.saved_tensors_hooks(
                self._pack, functools.partial(self._unpack, view)
            )
            saving.__enter__()
            entry.saving = saving
            self.backward_schedule = schedule
        return args, kwargs

    @torch.compiler.disable
    def after_forward(self, module: nn.Module, _args: tuple, _kwargs: dict, output: Any) -> Any:
        if not self.active or self.active[-1].module is not module:
            return output  # its pre-hook failed before setting anything (torch calls us anyway)
        self._restore(self.active.pop(), keep=True)
        if self.mp.output_dtype is not None:
            output = _cast_floating(output, self.mp.output_dtype)
        return output

    def unwind(self, depth: int) -> None:
        """Restore what the forwards begun beyond ``depth`` set and did not restore: their
        exit skipped ``after_forward`` (torch calls it on an ``Exception`` only, not on a
        ``KeyboardInterrupt`` or a test's timeout)."""
        while len(self.active) > depth:
            self._restore(self.active.pop(), keep=False)

    def _restore(self, entry: _Active, keep: bool) -> None:
        """Put the stored parameters back, leave the view and the saved-tensor hooks;
        ``keep``: hold the gathered ones when ``reshard_after_backward`` is off."""
        if entry.saving is not None:
            entry.saving.__exit__(None, None, None)
        for k, param in entry.stored.items():
            slot = self.slots[k]
            viewed = slot.owner._parameters[slot.name]
            slot.put(param)
            if keep and not self.reshard_after_backward and k not in self.held:
                self.held[k] = (entry.view, viewed, self._version(k))
        if entry.token is not None:
            leave_view(entry.token)
        if entry.schedule_token is not None:
            _SCHEDULE.leave(entry.schedule_token)
            self.schedule.close()  # type: ignore[union-attr]
        if not self.active:
            self.storages.clear()

    @eager_under_dynamo  # autograd calls it for real, also from a compiled forward
    def _pack(self, tensor: torch.Tensor) -> Any:
        """What autograd saves: a gathered parameter (or a view of it) is replaced by how to
        rebuild it from the stored shards."""
        pieces = _pieces(tensor)
        if not pieces:
            return tensor
        k = self.storages.get(pieces[0].untyped_storage().data_ptr())
        if k is None or k in self.held:
            return tensor
        if self.backward_schedule is not None:
            self.backward_schedule.saving.setdefault(self, None)
        views = [(p.shape, p.stride(), p.storage_offset()) for p in pieces]
        spec = local_of(tensor).spec if isinstance(tensor, DTensor) else None
        return (k, spec, views)

    @eager_under_dynamo
    def _unpack(self, view: View, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        k, spec, views = packed
        slot = self.slots[k]
        with torch.no_grad():
            fresh = self._gathered(slot, slot.stored, view, 1.0, self._regather(k))
        pieces = [
            p.as_strided(shape, stride, offset)
            for p, (shape, stride, offset) in zip(_pieces(fresh), views, strict=True)
        ]
        return DTensor(pieces, spec) if spec is not None else pieces[0]

    def _regather(self, k: int) -> list[torch.Tensor] | None:
        """Backward's re-gather of slot ``k``: with a packing key, one packed gather of every
        slot not held that shares it, kept until the unit's gradients are reduced (or this
        backward ends); None: it goes on its own."""
        key = self.pack_key(k)
        if key is None:
            return None
        hit = self.regathered.get(k)
        if hit is not None and hit[1] == self._version(k):
            return hit[0]
        members = self._regather_groups()[key]
        gathered = self._take(self.prefetched_back, key, members)
        try:
            queue_autograd_callback(self.regathered.clear)
        except RuntimeError:  # not in a backward: nothing would drop them
            return gathered[members.index(k)]
        for j, pieces in zip(members, gathered, strict=True):
            self.regathered[j] = (pieces, self._version(j))
        schedule = self.backward_schedule
        for unit in self.backward_targets or (
            schedule.before(self, self.backward_depth) if schedule is not None else []
        ):
            unit.prefetch_regather()
        return self.regathered[k][0]

    # ----- gradients -------------------------------------------------------------------------
    @eager_under_dynamo  # backward runs it eagerly, also after a compiled forward
    def _on_grad(self, k: int, param: torch.Tensor) -> None:
        if not self.requires_gradient_sync:
            return  # accumulate the pending reduction; a later synced backward reduces it
        self.reducer.ready(k, param)

    def reduce(self, param: torch.Tensor, slot: Slot) -> None:
        """``param.grad`` (slot ``slot``'s) reduced to the stored placements."""
        if self.requires_all_reduce:
            reduce_gradient(param, slot.storage)
            return
        # HSDP without the all-reduce: reduce over the shard dims only, keep the rest pending
        grad = param.grad
        if isinstance(grad, DTensor):
            target = list(grad.placements)
            for d in slot.dp.shard:
                target[d] = slot.storage[d]
            param.grad = grad.redistribute(placements=target)


@dataclass
class _Active:
    """One forward in progress: its module, the view it entered (the token of the outermost),
    the saved-tensor hooks it set, the stored parameters it swapped out, the prefetch schedule
    it entered."""

    module: nn.Module
    token: Any
    view: View
    saving: Any = None
    stored: dict[int, torch.Tensor] = field(default_factory=dict)
    schedule_token: Any = None  # the prefetch schedule it entered, when outermost


class DataParallelModule:
    """Base of the classes ``fully_shard`` and ``replicate`` give a module: a call that
    leaves by an exit the forward hooks do not see (a ``BaseException``) still restores what
    its pre-forward hook set."""

    _shardwise_units: list[DataParallelUnit]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        units = self._shardwise_units
        depths = [len(unit.active) for unit in units]
        try:
            return super().__call__(*args, **kwargs)  # type: ignore[misc]
        finally:
            for unit, depth in zip(units, depths, strict=True):
                if len(unit.active) > depth:
                    unit.unwind(depth)


def guard_calls(module: nn.Module, unit: DataParallelUnit) -> None:
    """Register ``unit`` with ``module`` (whose class is a ``DataParallelModule``), so each
    call of it restores what ``unit``'s hooks set, however it exits."""
    units = module.__dict__.setdefault("_shardwise_units", [])
    units.append(unit)


def _pieces(tensor: Any) -> list[torch.Tensor]:
    if isinstance(tensor, DTensor):
        return list(local_of(tensor).pieces)
    if isinstance(tensor, torch.Tensor):
        return [tensor]
    return []


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)


# pack key -> (slots, their versions when issued, the packed gather issued early)
Prefetched = dict[tuple, tuple[list[int], list[tuple], Pending]]


def _drop(prefetched: Prefetched | None) -> None:
    """Wait for the gathers left in ``prefetched`` (issued on every process) and drop them."""
    if prefetched:
        for _, _, pending in prefetched.values():
            pending.finish()
        prefetched.clear()


class _Schedule:
    """The order in which the units of one outermost forward gather (FSDP2 records it at its
    root): each forward records it; in the next, a unit that gathers issues the gathers of the
    ``forward_depth`` that follow it, and in backward, a unit that re-gathers issues those of
    the ``backward_depth`` units that saved parameters before it in forward. Decisions depend
    on the recorded order alone (the same on every process of an SPMD program), never on
    timing; once this forward leaves the recorded order, what was issued early is dropped and
    nothing more is."""

    def __init__(self) -> None:
        self.order: list[tuple[DataParallelUnit, nn.Module]] = []  # the last forward's
        self.current: list[tuple[DataParallelUnit, nn.Module]] = []
        self.saving: dict[DataParallelUnit, None] = {}  # units that saved, in forward order
        self.issued: dict[DataParallelUnit, None] = {}
        self.on_course = True

    def start(self) -> None:
        self.current, self.saving, self.issued, self.on_course = [], {}, {}, True

    def arrive(self, unit: DataParallelUnit, module: nn.Module, view: View) -> None:
        """``module`` of ``unit`` has gathered: issue what follows it."""
        at = len(self.current)
        self.current.append((unit, module))
        if self.on_course and self.order[at : at + 1] != [(unit, module)]:
            self.on_course = False
            for early in self.issued:
                early.drop_forward()
        targets = unit.forward_targets.get(id(module)) or (
            self.order[at + 1 : at + 1 + unit.forward_depth] if self.on_course else [])
        for target, target_module in targets:
            target.prefetch(target_module, view)
            self.issued.setdefault(target, None)

    def close(self) -> None:
        """The outermost forward ended: drop what it did not use, keep its order."""
        for early in self.issued:
            early.drop_forward()
        if self.current != self.order:
            self.order = self.current

    def before(self, unit: DataParallelUnit, depth: int) -> list[DataParallelUnit]:
        """The ``depth`` units that saved for backward before ``unit``, nearest first."""
        saving = list(self.saving)
        if unit not in self.saving:
            return []
        at = saving.index(unit)
        return saving[max(0, at - depth) : at][::-1]
