"""``Strategy`` and ``StrategyExtended``: the user API of tf.distribute (spec 1B.3, 1B.5).

A strategy's replicas are a 1-D shardwise mesh (``extended.mesh``, dim name ``"replica"``,
one device per replica, across processes for the multi-worker strategy). Reductions are
shardwise collectives on that mesh: ``reduce`` resolves a ``Partial`` DTensor built from the
per-replica components, ``batch_reduce_to`` fuses its whole batch into one all-reduce.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from .. import comm
from ..dtensor import DTensor
from ..errors import (
    DistributeAttributeError,
    DistributeContextError,
    DistributeTypeError,
    DistributeValueError,
)
from ..mesh import DeviceMesh
from ..placements import Partial
from . import context
from .enums import ReduceOp, VariableAggregation, VariableSynchronization
from .replica_context import ReplicaContext
from .values import (
    DistributedValues,
    Mirrored,
    PerReplica,
    is_distributed_variable,
    leaves,
    local_results,
    map_nest,
    regroup,
    select_replica,
    value_container,
)

if TYPE_CHECKING:
    from .input import InputContext, ValueContext
    from .module import DistributedModule
    from .variables import Variable


def torch_device(name: str) -> torch.device:
    """The torch device of a device name: ``"cpu:i"`` is a simulated device on the host CPU."""
    device = torch.device(name)
    return torch.device("cpu") if device.type == "cpu" else device


class Strategy:
    """How replicas compute and where variables live (TF's ``tf.distribute.Strategy``)."""

    _is_default = False

    def __init__(self, extended: StrategyExtended) -> None:
        self._extended = extended

    @property
    def extended(self) -> StrategyExtended:
        return self._extended

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self._extended._devices)})"

    def __copy__(self) -> Strategy:
        raise DistributeContextError(f"Must only deepcopy a {type(self).__name__}, not copy it")

    def __deepcopy__(self, memo: dict) -> Strategy:
        new = object.__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items()})
        return new

    # ----- contexts --------------------------------------------------------------------------
    @contextmanager
    def scope(self) -> Iterator[Strategy]:
        """Make this strategy current (cross-replica context): variables created inside are
        distributed by it. Re-entering it is fine; another strategy's scope inside is not."""
        mode = context.current_mode()
        if mode.strategy is self:
            if mode.replica_context is not None and not self._is_default:
                raise DistributeContextError(f"{self!r}.scope(): {context.CROSS_REPLICA_ONLY}")
            explicit = mode.explicit_default or self._is_default
            with context.entered(replace(mode, replica_context=None, explicit_default=explicit)):
                yield self  # re-entry: a new entry of the stack, popped on this exit
            return
        if self._is_default:
            raise DistributeContextError(
                f"Must not nest tf.distribute.Strategy scopes: the default strategy's scope "
                f"inside {mode.strategy!r}'s"
            )
        if not mode.strategy._is_default or mode.explicit_default:
            raise DistributeContextError(
                f"Mixing different tf.distribute.Strategy objects: {mode.strategy!r} is not "
                f"{self!r}; leave one scope before entering the other"
            )
        with context.entered(context.Mode(self, None)):
            yield self

    # ----- properties ------------------------------------------------------------------------
    @property
    def num_replicas_in_sync(self) -> int:
        return self._extended._num_replicas_in_sync

    # ----- running ---------------------------------------------------------------------------
    def run(
        self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict | None = None
    ) -> Any:
        """Call ``fn`` once per replica (replica context) with each argument's component for
        that replica; return the regrouped results (``PerReplica`` where they differ)."""
        if not isinstance(args, (list, tuple)):
            raise DistributeValueError(
                f"positional args must be a list or tuple, got {type(args).__name__}"
            )
        with context.require_cross_replica(self, f"{type(self).__name__}.run"):
            return self._extended._call_for_each_replica(fn, tuple(args), dict(kwargs or {}))

    experimental_run_v2 = run

    def reduce(
        self, reduce_op: ReduceOp | str, value: Any, axis: int | tuple[int, ...] | None = None
    ) -> Any:
        """``value`` reduced across replicas (axis None), or over replicas and ``axis`` (MEAN:
        sum of sums over sum of counts, right for uneven batches). A plain tensor, or a nest
        of them for a nest; an integer MEAN is true-divided (TF's truediv: float32 for
        8- and 16-bit integers, float64 for wider ones); a list ``axis`` raises TypeError, as TF."""
        op = ReduceOp.resolve(reduce_op)
        if isinstance(axis, list):  # TF 2.21 hashes ``axis``
            raise DistributeTypeError(
                f"reduce: `axis` must be an int or a tuple of ints, got the list {axis!r} (TF "
                f"2.21 raises TypeError: unhashable type: 'list')"
            )
        with context.require_cross_replica(
            self, f"{type(self).__name__}.reduce (inside run use ReplicaContext.all_reduce)"
        ):
            return map_nest(lambda leaf: self._extended._reduce(op, leaf, axis), value)

    def gather(self, value: Any, axis: int) -> Any:
        """The replicas' components concatenated along ``axis`` (cross-replica only; inside
        run use ReplicaContext.all_gather); a plain tensor comes back as is."""
        with context.require_cross_replica(
            self, f"{type(self).__name__}.gather (inside run use ReplicaContext.all_gather)"
        ):
            if type(value) is torch.Tensor:  # TF: a plain tensor comes back once
                return value
            return self._extended._gather(value, axis)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """This worker's per-replica components of ``value``, in replica order."""
        return local_results(value)

    def experimental_distribute_dataset(self, dataset: Iterable[Any]) -> Any:
        """Iterate ``dataset`` (batched with the GLOBAL batch size) as per-replica batches."""
        from .input import DistributedDataset

        if self._is_default:
            return dataset
        return DistributedDataset(self, dataset)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Iterable[Any]]
    ) -> Any:
        """``dataset_fn(InputContext)`` builds this worker's per-replica-batched dataset;
        local replicas take consecutive batches."""
        from .input import DistributedDatasetFromFunction, InputContext

        if self._is_default:
            return dataset_fn(InputContext())
        return DistributedDatasetFromFunction(self, dataset_fn)

    experimental_distribute_datasets_from_function = distribute_datasets_from_function

    def experimental_distribute_values_from_function(
        self, value_fn: Callable[[ValueContext], Any]
    ) -> Any:
        """``value_fn(ValueContext)`` once per local replica, as a PerReplica."""
        from .input import ValueContext

        ext = self._extended
        values = [
            value_fn(ValueContext(ext._global_replica_id(i), self.num_replicas_in_sync))
            for i in range(ext._num_local)
        ]
        return values[0] if len(values) == 1 else PerReplica(values, self)

    def distribute_module(self, module: torch.nn.Module) -> DistributedModule:
        """``module`` with its parameters as variables of this strategy (mirrored copies): in
        a replica context it computes with that replica's copy."""
        from .module import DistributedModule

        return DistributedModule(self, module)


class StrategyExtended:
    """The distribution-aware part of a strategy (TF's ``strategy.extended``)."""

    def __init__(
        self,
        strategy: Strategy,
        devices: Sequence[str],
        mesh: DeviceMesh,
        *,
        first_replica: int = 0,
        num_replicas: int | None = None,
    ) -> None:
        self._strategy = strategy
        self._devices = tuple(devices)
        self.mesh = mesh
        self._first_replica = first_replica
        self._num_replicas_in_sync = num_replicas or len(self._devices)
        self._default_replica_context = ReplicaContext(strategy, 0)

    # ----- geometry --------------------------------------------------------------------------
    @property
    def _num_local(self) -> int:
        return len(self._devices)

    def _global_replica_id(self, local_index: int) -> int:
        return self._first_replica + local_index

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """Compute devices of this worker's replicas, in replica order."""
        return self._devices

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """Devices that hold variables."""
        return self._devices

    @property
    def experimental_require_static_shapes(self) -> bool:
        return False

    def _torch_devices(self) -> list[torch.device]:
        return [torch_device(d) for d in self._devices]

    def __deepcopy__(self, memo: dict) -> StrategyExtended:
        new = object.__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items()})
        return new

    # ----- running ---------------------------------------------------------------------------
    def _call_for_each_replica(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        from .replicas import ReplicaRunner

        n = self._num_local
        per_args = [self._select(i, args) for i in range(n)]
        per_kwargs = [self._select(i, kwargs) for i in range(n)]
        if n == 1:
            rc = ReplicaContext(self._strategy, self._global_replica_id(0), 0)
            with context.entered(context.Mode(self._strategy, rc)):
                return regroup([fn(*per_args[0], **per_kwargs[0])])
        results = ReplicaRunner(self._strategy, fn, per_args, per_kwargs).run()
        return regroup(results)

    def _select(self, index: int, nest: Any) -> Any:
        for x in leaves(nest):
            if isinstance(x, DistributedValues) and len(x.values) != self._num_local:
                raise DistributeValueError(
                    f"{type(x).__name__} with {len(x.values)} components given to "
                    f"{self._strategy!r}, which has {self._num_local} local replicas"
                )
        return select_replica(index, nest)

    def call_for_each_replica(
        self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict | None = None
    ) -> Any:
        with context.require_cross_replica(self._strategy, "call_for_each_replica"):
            return self._call_for_each_replica(fn, tuple(args), dict(kwargs or {}))

    # ----- reductions ------------------------------------------------------------------------
    def _components(self, value: Any) -> list[torch.Tensor] | None:
        """The per-replica components of a value to reduce, or None if it is not distributed."""
        if isinstance(value, PerReplica):
            return [torch.as_tensor(v) for v in value.values]
        if is_distributed_variable(value) and value._is_sync_on_read:
            return [c.value().detach() for c in value.values]
        return None

    def _check_shapes(self, components: list[torch.Tensor], what: str) -> None:
        shapes = {tuple(c.shape) for c in components}
        if len(shapes) > 1:
            raise DistributeValueError(
                f"{what}: per-replica components have different shapes "
                f"{[list(c.shape) for c in components]} on the replica mesh {self.mesh}; a "
                f"reduction across replicas needs one shape (use reduce with axis=... for "
                f"uneven batches)"
            )

    def _non_distributed(self, op: ReduceOp, value: Any, what: str) -> Any:
        """TF's reduce_non_distributed_value: a value every replica shares."""
        if isinstance(value, Mirrored) or (
            is_distributed_variable(value) and not value._is_sync_on_read
        ):
            if op is ReduceOp.SUM and self._num_replicas_in_sync > 1:
                raise DistributeValueError(
                    f"{what}: a mirrored value cannot be reduced with ReduceOp.SUM over "
                    f"{self._num_replicas_in_sync} replicas (it would count it N times); "
                    f"reduce per-replica values instead"
                )
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0 and (
            self._num_replicas_in_sync > 1
        ):
            raise DistributeAttributeError(
                f"{what}: a Python number {value!r} cannot be reduced over "
                f"{self._num_replicas_in_sync} replicas (TF 2.21 raises AttributeError: "
                f"'{type(value).__name__}' object has no attribute 'shape'); pass a tensor"
            )
        if op is ReduceOp.SUM and self._num_replicas_in_sync > 1:
            raise DistributeValueError(
                f"{what}: A non-DistributedValues value {value!r} cannot be reduced with the given "
                f"reduce op ReduceOp.SUM over {self._num_replicas_in_sync} replicas (every "
                f"replica passed the same object); pass a distinct tensor per replica"
            )
        return value

    def _all_reduce(
        self, op: ReduceOp, values: list[list[torch.Tensor]]
    ) -> list[list[torch.Tensor]]:
        """``values[j][i]``: value j on local replica i. One fused collective per dtype; an
        integer MEAN is the sum true-divided by the replica count (TF 2.21's truediv)."""
        devices = self._torch_devices()
        out: list[list[torch.Tensor]] = [[] for _ in values]
        by_dtype: dict[torch.dtype, list[int]] = {}
        for j, comps in enumerate(values):
            by_dtype.setdefault(comps[0].dtype, []).append(j)
        count = torch.tensor(self._num_replicas_in_sync)
        for dtype, idx in by_dtype.items():
            integer_mean = op is ReduceOp.MEAN and not (dtype.is_floating_point or dtype.is_complex)
            with comm.moving(lambda: f"batch_reduce_to over {self.mesh}"):
                reduced = comm.all_reduce_flat(
                    self.mesh, (0,),
                    [[values[j][i].detach().to(devices[i]) for i in range(len(devices))]
                     for j in idx],
                    "sum" if integer_mean else op.partial_op,
                )
            for j, pieces in zip(idx, reduced, strict=True):
                out[j] = [_true_divide(p, count) for p in pieces] if integer_mean else pieces
        return out

    def _destination_devices(self, destinations: Any) -> list[torch.device]:
        if destinations is None or (isinstance(destinations, str) and not destinations):
            raise DistributeValueError("destinations can not be empty")
        if isinstance(destinations, (list, tuple)):
            raise DistributeTypeError(
                f"destinations must be one device string, tensor, variable or distributed value, "
                f"not a {type(destinations).__name__} {destinations!r}"
            )
        if isinstance(destinations, str):
            return [torch_device(destinations)]
        if is_distributed_variable(destinations) or isinstance(destinations, DistributedValues):
            if len(destinations.values) == self._num_local:
                return self._torch_devices()
            return [getattr(destinations.values[0], "device", torch.device("cpu"))]
        if isinstance(destinations, torch.Tensor):
            return [destinations.device]
        from .variables import Variable

        if isinstance(destinations, Variable):
            return [destinations.device]
        raise DistributeValueError(
            f"destinations must be one of a DistributedValues object, a Variable object, or a "
            f"device string, got {type(destinations).__name__}"
        )

    def _place(self, components: list[torch.Tensor], devices: list[torch.device]) -> Any:
        if len(devices) == 1:
            return components[0].to(devices[0])
        if len(devices) != len(components):
            components = [components[0]] * len(devices)
        return Mirrored([c.to(d) for c, d in zip(components, devices, strict=True)], self._strategy)

    def _broadcast_plain(self, value: Any, devices: list[torch.device]) -> Any:
        if isinstance(value, Mirrored) and len(value.values) == len(devices):
            return value
        if isinstance(value, DistributedValues) or is_distributed_variable(value):
            value = value.primary if isinstance(value, DistributedValues) else value.value()
        if len(devices) == 1 or not isinstance(value, torch.Tensor):
            return value
        return Mirrored([value.to(d) for d in devices], self._strategy)

    def _first_replica_value(self, value: Any) -> Any:
        """Replica 0's value (ONLY_FIRST_REPLICA) on every local device; a value every replica
        shares is itself."""
        if isinstance(value, PerReplica):
            components = [torch.as_tensor(v) for v in value.values]
        elif isinstance(value, torch.Tensor) and self._num_local == 1:
            components = [value]
        else:
            return value
        if self._num_replicas_in_sync > self._num_local:
            with comm.moving(lambda: f"ONLY_FIRST_REPLICA value over {self.mesh}"):
                components = comm.broadcast(self.mesh, 0, components, src=0)
        else:
            components = [components[0].to(d) for d in self._torch_devices()]
        return self._place(components, self._torch_devices())

    def batch_reduce_to(
        self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence[tuple[Any, Any]]
    ) -> list[Any]:
        """``reduce_to`` of every pair, the per-replica values in ONE fused all-reduce."""
        op = ReduceOp.resolve(reduce_op)
        with context.require_cross_replica(self._strategy, "batch_reduce_to"):
            return self._batch_reduce(op, list(value_destination_pairs))

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any) -> Any:
        """``value`` reduced across replicas and mirrored onto ``destinations``' devices."""
        op = ReduceOp.resolve(reduce_op)
        with context.require_cross_replica(self._strategy, "reduce_to"):
            return self._batch_reduce(op, [(value, destinations)])[0]

    def _batch_reduce(self, op: ReduceOp, pairs: list[tuple[Any, Any]]) -> list[Any]:
        results: list[Any] = [None] * len(pairs)
        todo: list[int] = []
        comps: list[list[torch.Tensor]] = []
        for j, (value, destinations) in enumerate(pairs):
            devices = self._destination_devices(destinations)
            components = self._components(value)
            if components is None and self._num_local == 1 and self._num_replicas_in_sync > 1:
                if isinstance(value, torch.Tensor):  # one local replica: its own value
                    components = [value]
            if components is None:
                kept = self._non_distributed(op, value, "reduce_to")
                results[j] = self._broadcast_plain(kept, devices)
                continue
            self._check_shapes(components, "reduce_to")
            todo.append(j)
            comps.append(components)
        if comps:
            reduced = self._all_reduce(op, comps)
            for j, components in zip(todo, reduced, strict=True):
                results[j] = self._place(components, self._destination_devices(pairs[j][1]))
        return results

    def _reduce(self, op: ReduceOp, value: Any, axis: int | Sequence[int] | None) -> Any:
        if axis is not None:
            return self._reduce_axis(op, value, axis)
        components = self._components(value)
        if components is None and self._num_local == 1 and self._num_replicas_in_sync > 1:
            if isinstance(value, torch.Tensor):
                components = [value]
        if components is None:
            kept = self._non_distributed(op, value, "reduce")
            if isinstance(kept, Mirrored):
                return kept.primary
            return kept.read_value() if is_distributed_variable(kept) else kept
        self._check_shapes(components, "reduce")
        if op is ReduceOp.MEAN and not _is_float(components[0]):  # TF: sum / N, true-divided
            total = self._reduce(ReduceOp.SUM, PerReplica(components), None)
            return _true_divide(total, torch.tensor(self._num_replicas_in_sync))
        partial = DTensor.from_local(components, self.mesh, [Partial(op.partial_op)])
        return partial.full_tensor()

    def _reduce_axis(self, op: ReduceOp, value: Any, axis: int | Sequence[int]) -> Any:
        components = self._components(value)
        if components is None:
            # TF reduces over ``axis`` in every replica (run), then across replicas: a value
            # every replica shares counts once per replica (SUM: N times its sum).
            if isinstance(value, Mirrored):
                value = value.primary
            elif is_distributed_variable(value):
                value = value.read_value()
            plain = torch.as_tensor(value)
            components = [plain.to(d) for d in self._torch_devices()]
        rank = components[0].ndim
        axes = _normalize_axis(axis, rank)
        # TF keeps an integer dtype (torch would sum into int64)
        sums = [c.sum(dim=axes, dtype=None if c.dtype == torch.bool else c.dtype)
                for c in components]
        total = self._reduce(ReduceOp.SUM, PerReplica(sums), None)
        if op is ReduceOp.SUM:
            return total
        counts = [torch.tensor(_count(c, axes), dtype=torch.int64) for c in components]
        count = self._reduce(ReduceOp.SUM, PerReplica(counts), None)
        return _true_divide(total, count)

    def _gather(self, value: Any, axis: int) -> Any:
        if isinstance(value, Mirrored) or not isinstance(value, DistributedValues):
            components = [torch.as_tensor(value.primary if isinstance(value, Mirrored) else value)]
            components = components * self._num_local
        else:
            components = [torch.as_tensor(v) for v in value.values]
        if components[0].ndim == 0:
            raise DistributeValueError(
                f"gather/all_gather needs values of rank >= 1 to concatenate along axis {axis}, "
                f"got scalars"
            )
        dim = axis % components[0].ndim
        if self._num_replicas_in_sync == self._num_local:
            return torch.cat([c.to(components[0].device) for c in components], dim=dim)
        sizes = self._gathered_sizes(components, dim)
        longest = max(sizes)
        padded = []
        for c in components:
            shape = list(c.shape)
            shape[dim] = longest - c.shape[dim]
            padded.append(torch.cat([c, c.new_zeros(shape)], dim=dim))
        gathered = comm.all_gather(self.mesh, 0, padded, lambda _: padded[0].shape)[0]
        return torch.cat(
            [p.narrow(dim, 0, n) for p, n in zip(gathered, sizes, strict=True)], dim=dim
        )

    def _gathered_sizes(self, components: list[torch.Tensor], dim: int) -> list[int]:
        sizes = [torch.tensor([float(c.shape[dim])]) for c in components]
        return [int(s.item()) for s in comm.all_gather(self.mesh, 0, sizes)[0]]

    # ----- updates ---------------------------------------------------------------------------
    def update(
        self,
        var: Variable,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict | None = None,
        group: bool = True,
    ) -> Any:
        """``fn(component, *args, **kwargs)`` on every component of ``var``, each in its update
        context (Mirrored and PerReplica args unwrapped per component: copy i gets component i,
        as in TF 2.21). From a replica context every replica must call it (a merge point)."""
        args, kwargs = tuple(args), dict(kwargs or {})
        if context.in_replica_context_of(self._strategy):
            rc: Any = context.get_replica_context()
            return rc.merge_call(
                lambda s, *a, **k: s.extended.update(var, fn, a, k, group), args, kwargs
            )
        with context.require_cross_replica(self._strategy, "update"):
            return self._update(var, fn, args, kwargs, group)

    def _update(
        self, var: Any, fn: Callable[..., Any], args: tuple, kwargs: dict, group: bool
    ) -> Any:
        targets = list(var.values) if is_distributed_variable(var) else [var]
        for x in leaves((args, kwargs)):
            if isinstance(x, PerReplica) and len(x.values) != len(targets):
                raise DistributeValueError(
                    f"update of {getattr(var, 'name', var)!r}: a PerReplica argument has "
                    f"{len(x.values)} components for {len(targets)} copies of the variable on "
                    f"the replica mesh {self.mesh}; copy i takes component i"
                )
        results = []
        for i, target in enumerate(targets):
            with context.update_context(i):
                results.append(fn(target, *select_replica(i, args), **select_replica(i, kwargs)))
        return _group(results, group, self._strategy)

    def update_non_slot(
        self,
        colocate_with: Any,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict | None = None,
        group: bool = True,
    ) -> Any:
        """``fn(*args, **kwargs)`` once per non-slot device (``colocate_with`` is what
        ``non_slot_devices`` returned), each in its update context."""
        args, kwargs = tuple(args), dict(kwargs or {})
        with context.require_cross_replica(self._strategy, "update_non_slot"):
            _reject_per_replica((args, kwargs), "update_non_slot")
            count = len(colocate_with) if isinstance(colocate_with, tuple) else 1
            results = []
            for i in range(count):
                with context.update_context(i):
                    results.append(fn(*select_replica(i, args), **select_replica(i, kwargs)))
            return _group(results, group, self._strategy)

    def non_slot_devices(self, var_list: Sequence[Variable]) -> Any:
        """Where optimizer non-slot variables live: every replica device."""
        return tuple(self._devices)

    @contextmanager
    def colocate_vars_with(self, colocate_with_variable: Any) -> Iterator[None]:
        """Variables created inside live where ``colocate_with_variable`` (a variable of this
        strategy) lives: a mirrored strategy's are on every replica device, as any new one. As
        TF 2.21, anything else (what ``non_slot_devices`` returned included) is refused."""
        mode = context.current_mode()
        if mode.strategy is not self._strategy or mode.replica_context is not None:
            raise DistributeContextError(
                f'colocate_vars_with: Need to be inside "with strategy.scope()" of '
                f"{self._strategy!r}"
            )
        if getattr(colocate_with_variable, "distribute_strategy", None) is not self._strategy:
            raise DistributeValueError(
                f"`colocate_vars_with` must only be passed a variable created in this "
                f"tf.distribute.Strategy.scope() ({self._strategy!r}), not: "
                f"{colocate_with_variable!r}"
            )
        yield

    def value_container(self, value: Any) -> Any:
        """The distributed variable ``value`` is a component of, else ``value``."""
        return value_container(value)

    def variable_created_in_scope(self, v: Any) -> bool:
        """True iff ``v`` was created in this strategy's scope."""
        return getattr(v, "distribute_strategy", None) is self._strategy

    def read_var(self, v: Any) -> torch.Tensor:
        """The aggregate of a sync-on-read variable, the value of any other."""
        with context.require_cross_replica(self._strategy, "read_var"):
            return v.read_value()

    def broadcast_to(self, tensor: Any, destinations: Any) -> Any:
        """``tensor`` mirrored onto ``destinations``' devices (Python numbers as they are)."""
        if isinstance(tensor, (int, float)):
            return tensor
        return self._broadcast_plain(tensor, self._destination_devices(destinations))

    # ----- variables -------------------------------------------------------------------------
    def _create_variable(
        self,
        initial_value: Any,
        trainable: bool,
        synchronization: VariableSynchronization,
        aggregation: VariableAggregation,
        name: str | None,
        dtype: torch.dtype | None,
    ) -> Variable:
        from .variables import create_mirrored_variable

        return create_mirrored_variable(
            self._strategy, initial_value, trainable, synchronization, aggregation, name, dtype
        )


def _reject_per_replica(nest: Any, what: str) -> None:
    for x in leaves(nest):
        if isinstance(x, PerReplica):
            raise DistributeTypeError(
                f"{what}: Expected value to be mirrored across replicas, got a PerReplica "
                f"{x!r}; reduce it first (extended.reduce_to)"
            )


def _group(results: list[Any], group: bool, strategy: Strategy) -> Any:
    if not group:
        return tuple(results)
    return regroup(results, Mirrored) if len(results) > 1 else results[0]


def _normalize_axis(axis: Any, rank: int) -> list[int]:
    items = list(axis) if isinstance(axis, (list, tuple)) else [axis]
    out = []
    for a in items:
        if not isinstance(a, int) or isinstance(a, bool):
            raise DistributeTypeError(
                f"`axis` must be an int or a list/tuple of ints, got {axis!r}"
            )
        if not -rank <= a < rank:
            raise DistributeValueError(f"`axis` = {a} out of range for `value` with rank {rank}")
        out.append(a % rank)
    return out


def _is_float(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


_SMALL_INTEGERS = (torch.int8, torch.uint8, torch.int16, torch.uint16)


def _true_divide(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """TF's truediv: a float total keeps its dtype; an 8- or 16-bit integer one gives float32,
    a wider integer one float64."""
    if _is_float(total):
        return torch.true_divide(total, count.to(total.device, total.dtype))
    dtype = torch.float32 if total.dtype in _SMALL_INTEGERS else torch.float64
    return torch.true_divide(total.to(dtype), count.to(total.device, dtype))


def _count(t: torch.Tensor, axes: list[int]) -> int:
    n = 1
    for a in axes:
        n *= t.shape[a]
    return n
