"""Variables: ``Variable(...)`` creates a plain variable outside every strategy scope and a
distributed one inside (spec 1B.2): a ``MirroredVariable`` (sync ON_WRITE) is a ``Replicate()``
DTensor over the replica mesh whose copies every update changes alike; a ``SyncOnReadVariable``
(ON_READ) is a ``Partial`` DTensor resolved on a cross-replica read.

Each copy is a leaf tensor (``requires_grad`` when trainable), so autograd in a replica
context accumulates that replica's gradient into its own copy's ``.grad``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from .. import comm, settings
from ..dtensor import DTensor
from ..errors import DistributeContextError, DistributeTypeError, DistributeValueError
from ..placements import Partial, Placement, Replicate
from ..spec import DTensorSpec, contiguous_meta
from . import context
from .context import StrategyLike as Strategy  # by its shape: strategy.py imports this module
from .enums import (
    ReduceOp,
    VariableAggregation,
    VariableSynchronization,
    check_aggregation,
    check_synchronization,
)
from .values import Mirrored, PerReplica, map_nest


class _VariableMeta(type):
    """``Variable(...)`` asks the current strategy to create the variable."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is not Variable:
            return super().__call__(*args, **kwargs)
        return _create(*args, **kwargs)


def _create(
    initial_value: Any,
    trainable: bool = True,
    synchronization: VariableSynchronization = VariableSynchronization.AUTO,
    aggregation: VariableAggregation = VariableAggregation.NONE,
    name: str | None = None,
    dtype: torch.dtype | None = None,
) -> Variable:
    synchronization = check_synchronization(synchronization)
    aggregation = check_aggregation(aggregation)
    mode = context.current_mode()
    strategy = mode.strategy
    rc = mode.replica_context
    if rc is not None and rc._runner is not None:  # inside run: created once, shared
        return rc.merge_call(
            lambda s: s.extended._create_variable(
                initial_value, trainable, synchronization, aggregation, name, dtype
            )
        )
    return strategy.extended._create_variable(
        initial_value, trainable, synchronization, aggregation, name, dtype
    )


def initial_tensor(initial_value: Any, dtype: torch.dtype | None) -> torch.Tensor:
    value = initial_value() if callable(initial_value) else initial_value
    if isinstance(value, Variable):
        value = value.value()
    return torch.as_tensor(value, dtype=dtype).detach().clone()


class Variable(metaclass=_VariableMeta):
    """``Variable(initial_value, trainable=True, synchronization=AUTO, aggregation=NONE,
    name=None, dtype=None)``: a plain variable, or a distributed one inside a strategy scope.
    It acts as its current value in torch functions and arithmetic."""

    _is_distributed_variable = False
    _is_sync_on_read = False

    def value(self) -> torch.Tensor:
        raise NotImplementedError

    def read_value(self) -> torch.Tensor:
        """A snapshot of the current value (aggregated for a sync-on-read variable in a
        cross-replica context); differentiable."""
        return self.value().clone()

    @property
    def dtype(self) -> torch.dtype:
        return self.value().dtype

    @property
    def shape(self) -> torch.Size:
        return self.value().shape

    @property
    def device(self) -> torch.device:
        return self.value().device

    def numpy(self) -> Any:
        return self.read_value().detach().cpu().numpy()

    def tolist(self) -> Any:
        return self.read_value().tolist()

    def item(self) -> Any:
        return self.read_value().item()

    def __float__(self) -> float:
        return float(self.read_value())

    def __int__(self) -> int:
        return int(self.read_value())

    def __array__(self, dtype: Any = None) -> Any:
        array = self.numpy()
        return array if dtype is None else array.astype(dtype)

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:  # torch.as_tensor / torch.tensor
        return self.read_value().detach().__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> Any:
        return self.read_value().__dlpack_device__()

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.value()[index]

    def __neg__(self) -> torch.Tensor:
        return -self.value()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        args, kwargs = _unwrap((args, kwargs or {}))
        return func(*args, **kwargs)

    def __repr__(self) -> str:
        try:
            shown = self.read_value().tolist()
        except Exception:
            shown = "..."
        return f"<{type(self).__name__} {self.name!r} shape={list(self.shape)} value={shown}>"


def _unwrap(nest: Any) -> Any:
    def leaf(x: Any) -> Any:
        if isinstance(x, Variable):
            return x.value()
        if isinstance(x, Mirrored):
            return x.closest()
        return x

    return map_nest(leaf, nest)


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul"):
    for _prefix in ("", "r"):
        _dunder = f"__{_prefix}{_name}__"

        def _op(self: Variable, other: Any, _dunder: str = _dunder) -> Any:
            return getattr(self.value(), _dunder)(_unwrap(other))

        setattr(Variable, _dunder, _op)
for _cmp in ("lt", "le", "gt", "ge"):
    _dunder = f"__{_cmp}__"
    setattr(
        Variable, _dunder, lambda self, other, _d=_dunder: getattr(self.value(), _d)(_unwrap(other))
    )


class LocalVariable(Variable):
    """A variable on one device: a leaf tensor updated in place."""

    def __init__(
        self,
        tensor: torch.Tensor,
        *,
        trainable: bool = True,
        synchronization: VariableSynchronization = VariableSynchronization.AUTO,
        aggregation: VariableAggregation = VariableAggregation.NONE,
        name: str | None = None,
        strategy: Strategy | None = None,
    ) -> None:
        self._tensor = tensor
        if trainable and (tensor.is_floating_point() or tensor.is_complex()):
            self._tensor.requires_grad_(True)
        self.trainable = trainable
        self.synchronization = synchronization
        self.aggregation = aggregation
        self.name = name or "Variable"
        self.distribute_strategy = strategy
        self._container_ref: Any = None

    @property
    def tensor(self) -> torch.Tensor:
        """The leaf tensor (give it to ``torch.optim``; its ``.grad`` is this copy's)."""
        return self._tensor

    @property
    def grad(self) -> torch.Tensor | None:
        return self._tensor.grad

    def value(self) -> torch.Tensor:
        return self._tensor

    def _apply(self, kind: str, value: Any) -> LocalVariable:
        value = _unwrap(value)
        if isinstance(value, PerReplica):
            raise DistributeTypeError(
                f"{kind} of {self.name!r}: cannot assign a PerReplica value to one variable"
            )
        with torch.no_grad():
            v = torch.as_tensor(value, dtype=self._tensor.dtype).to(self._tensor.device)
            _check_shape(self.name, kind, tuple(self._tensor.shape), tuple(v.shape))
            if kind == "assign":
                self._tensor.copy_(v)
            elif kind == "assign_add":
                self._tensor.add_(v)
            else:
                self._tensor.sub_(v)
        return self

    def assign(self, value: Any) -> LocalVariable:
        return self._apply("assign", value)

    def assign_add(self, delta: Any) -> LocalVariable:
        return self._apply("assign_add", delta)

    def assign_sub(self, delta: Any) -> LocalVariable:
        return self._apply("assign_sub", delta)


def _check_shape(name: str, kind: str, shape: tuple[int, ...], given: tuple[int, ...]) -> None:
    """A value of a shape that does not fit (broadcast to) the variable's is an error."""
    try:
        fits = torch.broadcast_shapes(shape, given) == shape
    except RuntimeError:
        fits = False
    if not fits:
        raise DistributeValueError(
            f"{kind} of variable {name!r}: a value of shape {list(given)} does not fit the "
            f"variable's shape {list(shape)}"
        )


def _check_strategy(var: DistributedVariable, what: str) -> context.Mode:
    mode = context.current_mode()
    if mode.strategy is not var._strategy and not mode.strategy._is_default:
        raise DistributeContextError(
            f"{what} of variable {var.name!r}: mixing different tf.distribute.Strategy objects: "
            f"it belongs to {var._strategy!r} but {mode.strategy!r} is current"
        )
    return mode


class DistributedVariable(Variable):
    """A variable with one copy per replica device (``values``), stored as a DTensor over the
    strategy's replica mesh."""

    _is_distributed_variable = True

    def __init__(
        self,
        strategy: Strategy,
        components: list[LocalVariable],
        synchronization: VariableSynchronization,
        aggregation: VariableAggregation,
        placement: Placement | None,
    ) -> None:
        self._strategy = strategy
        self._values = tuple(components)
        self.synchronization = synchronization
        self.aggregation = aggregation
        for c in components:
            c._container_ref = weakref.ref(self)
        self._dtensor: DTensor | None = None
        if placement is not None:
            first = components[0].tensor
            meta = contiguous_meta(first.shape, first.dtype)
            spec = DTensorSpec(strategy.extended.mesh, (placement,), meta)
            self._dtensor = DTensor([c.tensor for c in components], spec)

    @property
    def values(self) -> tuple[LocalVariable, ...]:
        return self._values

    @property
    def dtype(self) -> torch.dtype:
        return self.primary.dtype

    @property
    def shape(self) -> torch.Size:
        return self.primary.shape

    @property
    def device(self) -> torch.device:
        return self.primary.device

    @property
    def primary(self) -> LocalVariable:
        return self._values[0]

    @property
    def devices(self) -> tuple[str, ...]:
        return self._strategy.extended.parameter_devices

    @property
    def distribute_strategy(self) -> Strategy:
        return self._strategy

    @property
    def name(self) -> str:
        return self.primary.name

    @property
    def trainable(self) -> bool:
        return self.primary.trainable

    @property
    def dtensor(self) -> DTensor | None:
        """The copies as one DTensor over the replica mesh (Replicate / Partial)."""
        return self._dtensor

    def _local_index(self, mode: context.Mode) -> int | None:
        """The copy this context reads and writes directly, or None (cross-replica)."""
        if mode.update_replica is not None:
            return mode.update_replica
        rc = mode.replica_context
        if rc is not None and rc._strategy is self._strategy:
            return rc._local_index
        return None

    def assign(self, value: Any) -> DistributedVariable:
        return self._update("assign", value)

    def assign_add(self, delta: Any) -> DistributedVariable:
        return self._update("assign_add", delta)

    def assign_sub(self, delta: Any) -> DistributedVariable:
        return self._update("assign_sub", delta)

    def _update(self, kind: str, value: Any) -> DistributedVariable:
        raise NotImplementedError


class MirroredVariable(DistributedVariable):
    """Sync ON_WRITE: identical copies; replica-context updates are aggregated (a merge point),
    cross-replica updates go to every copy."""

    def value(self) -> torch.Tensor:
        mode = _check_strategy(self, "read")
        index = self._local_index(mode)
        return self._values[index or 0].value()

    def _update(self, kind: str, value: Any) -> MirroredVariable:
        mode = _check_strategy(self, kind)
        if mode.update_replica is not None:
            getattr(self._values[mode.update_replica], kind)(value)
            return self
        rc = mode.replica_context
        if rc is not None and rc._strategy is self._strategy:
            if self.aggregation == VariableAggregation.NONE:
                raise DistributeValueError(
                    f"You must specify an aggregation method to update a MirroredVariable "
                    f"({self.name!r}) in Replica Context: {kind} in a replica context of "
                    f"{self._strategy!r} needs aggregation=SUM, MEAN or ONLY_FIRST_REPLICA at "
                    f"creation (or update it in the cross-replica context, e.g. in merge_call)"
                )
            rc.merge_call(_merge_update, args=(self, kind, value))
            return self
        # a PerReplica value gives copy i its component i (TF 2.21), via extended.update
        with context.require_cross_replica(self._strategy, kind):
            self._strategy.extended._update(self, _apply_fn(kind), (value,), {}, True)
        return self


def _apply_fn(kind: str) -> Callable[[LocalVariable, Any], Any]:
    return lambda component, v: getattr(component, kind)(v)


def _merge_update(strategy: Strategy, var: DistributedVariable, kind: str, value: Any) -> None:
    """merge_fn of a replica-context update: aggregate the replicas' values, update every copy."""
    aggregated = aggregate(strategy, var, value)
    strategy.extended._update(var, _apply_fn(kind), (aggregated,), {}, True)


def aggregate(strategy: Strategy, var: Variable, value: Any) -> Any:
    """The replicas' values combined by ``var.aggregation`` (placed like ``var``)."""
    if var.aggregation == VariableAggregation.ONLY_FIRST_REPLICA:
        return strategy.extended._first_replica_value(value)
    op = ReduceOp.from_variable_aggregation(var.aggregation)
    return strategy.extended.reduce_to(op, value, var)


class SyncOnReadVariable(DistributedVariable):
    """Sync ON_READ: each replica reads and writes its own copy; a cross-replica read
    aggregates the copies (SUM / MEAN: the Partial DTensor resolved; ONLY_FIRST_REPLICA: the
    first replica's copy)."""

    _is_sync_on_read = True

    def value(self) -> torch.Tensor:
        mode = _check_strategy(self, "read")
        index = self._local_index(mode)
        if index is not None:
            local = self._values[index].value()
            if settings.SYNC_ON_READ_AGGREGATES.get() and mode.replica_context is not None:
                return self._aggregate_in_replica(mode, local)
            return local
        return self._cross_replica_read()

    def _aggregate_in_replica(self, mode: context.Mode, local: torch.Tensor) -> torch.Tensor:
        rc: Any = mode.replica_context
        if self.aggregation == VariableAggregation.ONLY_FIRST_REPLICA:
            return rc.merge_call(
                lambda s, v: s.extended._first_replica_value(v), args=(local.detach(),)
            )
        return rc.all_reduce(self._reduce_op("read"), local.detach())

    def _reduce_op(self, what: str) -> ReduceOp:
        if self.aggregation == VariableAggregation.NONE:
            raise DistributeValueError(
                f"{what} of SyncOnReadVariable {self.name!r} in cross-replica context: its "
                f"aggregation is NONE, so its copies cannot be combined; create it with "
                f"aggregation=SUM, MEAN or ONLY_FIRST_REPLICA"
            )
        return ReduceOp.from_variable_aggregation(self.aggregation)

    def _cross_replica_read(self) -> torch.Tensor:
        if self.aggregation == VariableAggregation.ONLY_FIRST_REPLICA:
            first = self._strategy.extended._first_replica_value(
                PerReplica([c.value().detach() for c in self._values])
            )
            return first.primary if isinstance(first, Mirrored) else first
        self._reduce_op("read")
        dtensor: Any = self._dtensor
        with torch.no_grad(), comm.moving(lambda: f"read of SyncOnReadVariable {self.name!r}"):
            return dtensor.full_tensor()

    def _update(self, kind: str, value: Any) -> SyncOnReadVariable:
        mode = _check_strategy(self, kind)
        index = self._local_index(mode)
        if index is not None:
            getattr(self._values[index], kind)(value)
            return self
        if isinstance(value, PerReplica):
            raise DistributeTypeError(
                f"{kind} of SyncOnReadVariable {self.name!r} in cross-replica context got a "
                f"PerReplica value; assign it inside strategy.run instead"
            )
        if kind != "assign":
            if self.aggregation == VariableAggregation.SUM:
                raise DistributeValueError(
                    f"SyncOnReadVariable does not support `{kind}` in cross-replica context when "
                    f"aggregation is set to SUM ({self.name!r}); assign the new total instead"
                )
            for c in self._values:
                getattr(c, kind)(value)
            return self
        value = _unwrap(value)
        if self.aggregation == VariableAggregation.SUM:
            n = self._strategy.num_replicas_in_sync
            value = (torch.as_tensor(value) / n).to(self.dtype)
        for c in self._values:
            c.assign(value)
        return self


def create_mirrored_variable(
    strategy: Strategy,
    initial_value: Any,
    trainable: bool,
    synchronization: VariableSynchronization,
    aggregation: VariableAggregation,
    name: str | None,
    dtype: torch.dtype | None,
) -> DistributedVariable:
    """A MirroredVariable (AUTO / ON_WRITE) or SyncOnReadVariable (ON_READ) of a mirrored
    strategy: the initial value computed once and copied to every device (from worker 0 when
    the replicas span processes)."""
    if synchronization == VariableSynchronization.NONE:
        raise DistributeValueError(
            f"NONE variable synchronization mode is not supported with Mirrored distribution "
            f"strategy ({strategy!r}); use AUTO, ON_WRITE or ON_READ"
        )
    ext = strategy.extended
    base = initial_tensor(initial_value, dtype)
    copies = [base.to(d).clone() for d in ext._torch_devices()]
    if ext._num_replicas_in_sync > ext._num_local:  # multi-worker: worker 0's value wins
        with comm.moving(lambda: f"initial value of variable {name!r}"):
            copies = [c.contiguous() for c in comm.broadcast(ext.mesh, 0, copies, src=0)]
    name = name or "Variable"
    if synchronization == VariableSynchronization.AUTO:  # TF: AUTO means ON_WRITE here
        synchronization = VariableSynchronization.ON_WRITE
    components = [
        LocalVariable(
            c,
            trainable=trainable,
            synchronization=synchronization,
            aggregation=aggregation,
            name=name if i == 0 else f"{name}/replica_{i}",
            strategy=strategy,
        )
        for i, c in enumerate(copies)
    ]
    if synchronization == VariableSynchronization.ON_READ:
        placement: Placement | None = {
            VariableAggregation.SUM: Partial("sum"),
            VariableAggregation.MEAN: Partial("avg"),
        }.get(aggregation)
        return SyncOnReadVariable(strategy, components, synchronization, aggregation, placement)
    return MirroredVariable(strategy, components, synchronization, aggregation, Replicate())
