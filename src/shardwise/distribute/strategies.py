"""The strategy classes (spec 1B.7): the default strategy, ``OneDeviceStrategy``,
``MirroredStrategy``, ``MultiWorkerMirroredStrategy`` and ``CentralStorageStrategy``."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from .. import runtime, settings
from ..errors import DistributeContextError, DistributeValueError
from ..mesh import DeviceMesh, init_device_mesh
from . import context
from .enums import ReduceOp, VariableAggregation, VariableSynchronization
from .strategy import Strategy, StrategyExtended, torch_device
from .values import DistributedValues, Mirrored, PerReplica, map_nest
from .variables import LocalVariable, Variable, aggregate, initial_tensor


def _device_name(device: str | torch.device) -> str:
    try:
        d = torch.device(device.lstrip("/").lower() if isinstance(device, str) else device)
    except (RuntimeError, AttributeError):
        raise DistributeValueError(
            f"{device!r} is not a device name; use 'cpu:i' (simulated CPU device i) or 'cuda:i'"
        ) from None
    return f"{d.type}:{d.index or 0}"


def _local_devices(devices: Sequence[str | torch.device] | None) -> list[str]:
    if isinstance(devices, (str, torch.device)):
        devices = [devices]
    names = [_device_name(d) for d in devices or ()]
    if not names:  # None or empty: TF takes the default devices
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [f"cuda:{i}" for i in range(count)] or ["cpu:0"]
    if len(set(names)) != len(names):
        raise DistributeValueError(f"duplicate devices in {names}; each device is one replica")
    if len({n.split(":")[0] for n in names}) > 1:
        raise DistributeValueError(f"devices {names} mix device types; use one type")
    return names


def _replica_mesh(device_type: str, count: int) -> DeviceMesh:
    """A 1-D mesh of ``count`` replicas, all owned by this process."""
    return DeviceMesh(
        device_type,
        list(range(count)),
        mesh_dim_names=("replica",),
        _devices_per_process=count,
        _rank=0,
    )


# ----- default strategy ----------------------------------------------------------------------

_DEFAULT: list[Strategy] = []


class _DefaultStrategy(Strategy):
    """The strategy in force outside every scope: one replica, plain variables."""

    _is_default = True

    def __init__(self) -> None:
        if _DEFAULT:
            raise DistributeContextError(
                "Should only create a single instance of the default strategy; use "
                "get_strategy() outside every scope"
            )
        super().__init__(_DefaultExtended(self))

    def __repr__(self) -> str:
        return "DefaultStrategy()"

    def __deepcopy__(self, memo: dict) -> Strategy:
        raise DistributeContextError("the default strategy cannot be copied")


def default_strategy() -> Strategy:
    """The default strategy singleton."""
    if not _DEFAULT:
        _DEFAULT.append(_DefaultStrategy())
    return _DEFAULT[0]


context.install_default_strategy(default_strategy)


class _DefaultExtended(StrategyExtended):
    def __init__(self, strategy: Strategy) -> None:
        super().__init__(strategy, ("cpu:0",), _replica_mesh("cpu", 1))

    @property
    def worker_devices(self) -> tuple[str, ...]:
        raise DistributeContextError(
            "worker_devices() method unsupported by default tf.distribute.Strategy."
        )

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        raise DistributeContextError(
            "parameter_devices() method unsupported by default tf.distribute.Strategy."
        )

    def _call_for_each_replica(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        with context.entered(context.Mode(self._strategy, self._default_replica_context)):
            return fn(*args, **kwargs)

    def _batch_reduce(self, op: ReduceOp, pairs: list[tuple[Any, Any]]) -> list[Any]:
        return [value for value, _ in pairs]

    def non_slot_devices(self, var_list: Sequence[Variable]) -> Any:
        return _min_by_name(var_list)

    @contextmanager
    def colocate_vars_with(self, colocate_with_variable: Any) -> Iterator[None]:
        yield

    def variable_created_in_scope(self, v: Any) -> bool:
        return getattr(v, "distribute_strategy", False) is None

    def _create_variable(
        self,
        initial_value: Any,
        trainable: bool,
        synchronization: VariableSynchronization,
        aggregation: VariableAggregation,
        name: str | None,
        dtype: torch.dtype | None,
    ) -> Variable:
        return LocalVariable(
            initial_tensor(initial_value, dtype),
            trainable=trainable,
            synchronization=synchronization,
            aggregation=aggregation,
            name=name,
        )


def _min_by_name(var_list: Sequence[Variable]) -> Variable:
    if not var_list:
        raise DistributeValueError("non_slot_devices needs a non-empty var_list")
    return min(var_list, key=lambda v: v.name)


# ----- OneDeviceStrategy -----------------------------------------------------------------------


class OneDeviceStrategy(Strategy):
    """Everything on one device: one replica, plain variables there."""

    def __init__(self, device: str | torch.device) -> None:
        names = _local_devices([device])
        super().__init__(_OneDeviceExtended(self, names))


class _OneDeviceExtended(StrategyExtended):
    def __init__(self, strategy: Strategy, devices: list[str]) -> None:
        mesh = _replica_mesh(torch_device(devices[0]).type, 1)
        super().__init__(strategy, devices, mesh)

    def _batch_reduce(self, op: ReduceOp, pairs: list[tuple[Any, Any]]) -> list[Any]:
        for _, destinations in pairs:
            self._destination_devices(destinations)
        return [
            value.primary if isinstance(value, DistributedValues) else value for value, _ in pairs
        ]

    def _create_variable(
        self,
        initial_value: Any,
        trainable: bool,
        synchronization: VariableSynchronization,
        aggregation: VariableAggregation,
        name: str | None,
        dtype: torch.dtype | None,
    ) -> Variable:
        device = torch_device(self._devices[0])
        return LocalVariable(
            initial_tensor(initial_value, dtype).to(device),
            trainable=trainable,
            synchronization=synchronization,
            aggregation=aggregation,
            name=name,
            strategy=self._strategy,
        )


# ----- MirroredStrategy ------------------------------------------------------------------------


class MirroredStrategy(Strategy):
    """One replica per device of this process (``"cpu:i"``: simulated CPU devices; default:
    every local GPU, else one CPU device); variables mirrored on every device."""

    def __init__(self, devices: Sequence[str | torch.device] | None = None) -> None:
        names = _local_devices(devices)
        mesh = _replica_mesh(torch_device(names[0]).type, len(names))
        super().__init__(StrategyExtended(self, names, mesh))


class MultiWorkerMirroredStrategy(Strategy):
    """Replicas on every process of the ``torch.distributed`` world (``torchrun`` /
    ``python -m shardwise.launch``), ``devices`` (this process's devices, the same count in
    every process) each; replica ids are global (rank * local replicas + local index)."""

    def __init__(self, devices: Sequence[str | torch.device] | None = None) -> None:
        import torch.distributed as dist

        names = _local_devices(devices)
        local = len(names)
        if runtime.initialized():
            rank, world = runtime.rank_and_world()
        else:
            world = int(settings.environ("WORLD_SIZE") or "1")
            rank = int(settings.environ("RANK") or "0")
        device_type = torch_device(names[0]).type
        mesh = init_device_mesh(device_type, (world * local,), mesh_dim_names=("replica",))
        if world > 1:
            counts: list[Any] = [None] * world
            dist.all_gather_object(counts, local)
            if len(set(counts)) > 1:
                raise DistributeValueError(
                    f"MultiWorkerMirroredStrategy: workers must have the same number of devices, "
                    f"got {counts} (per rank)"
                )
        ext = StrategyExtended(
            self, names, mesh, first_replica=rank * local, num_replicas=world * local
        )
        super().__init__(ext)
        self.num_workers = world
        self.worker_index = rank

    def __repr__(self) -> str:
        return (
            f"MultiWorkerMirroredStrategy(worker {self.worker_index} of {self.num_workers}, "
            f"{list(self.extended.worker_devices)})"
        )


# ----- CentralStorageStrategy ------------------------------------------------------------------


class CentralStorageStrategy(Strategy):
    """Replicas on the compute devices; every variable ONCE on the parameter device (default:
    the only GPU when there is exactly one compute device, else the host CPU)."""

    def __init__(
        self,
        compute_devices: Sequence[str | torch.device] | None = None,
        parameter_device: str | torch.device | None = None,
    ) -> None:
        names = _local_devices(compute_devices)
        if parameter_device is None:
            one_gpu = len(names) == 1 and names[0].startswith("cuda")
            parameter_device = names[0] if one_gpu else "cpu:0"
        mesh = _replica_mesh(torch_device(names[0]).type, len(names))
        super().__init__(_CentralExtended(self, names, mesh, _device_name(parameter_device)))


class _CentralExtended(StrategyExtended):
    def __init__(
        self, strategy: Strategy, devices: list[str], mesh: DeviceMesh, parameter_device: str
    ) -> None:
        super().__init__(strategy, devices, mesh)
        self._parameter_device = parameter_device

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        return (self._parameter_device,)

    def non_slot_devices(self, var_list: Sequence[Variable]) -> Any:
        return _min_by_name(var_list)

    def _update(
        self, var: Any, fn: Callable[..., Any], args: tuple, kwargs: dict, group: bool
    ) -> Any:
        if not isinstance(var, Variable):
            raise DistributeValueError(
                f"You can not update `var` {var!r}. It must be a Variable of {self._strategy!r}"
            )
        target = var._v if isinstance(var, AggregatingVariable) else var

        def primary(x: Any) -> Any:
            return x.primary if isinstance(x, DistributedValues) else x

        with context.update_context(0):
            return fn(target, *map_nest(primary, args), **map_nest(primary, kwargs))

    def _create_variable(
        self,
        initial_value: Any,
        trainable: bool,
        synchronization: VariableSynchronization,
        aggregation: VariableAggregation,
        name: str | None,
        dtype: torch.dtype | None,
    ) -> Variable:
        inner = LocalVariable(
            initial_tensor(initial_value, dtype).to(torch_device(self._parameter_device)),
            trainable=trainable,
            synchronization=synchronization,
            aggregation=aggregation,
            name=name,
            strategy=self._strategy,
        )
        if self._num_local == 1:
            return inner
        return AggregatingVariable(self._strategy, inner)


class AggregatingVariable(Variable):
    """CentralStorage's variable: ONE copy on the parameter device; replica-context updates
    are aggregated over the replicas (a merge point), then applied once."""

    def __init__(self, strategy: Strategy, inner: LocalVariable) -> None:
        self._strategy = strategy
        self._v = inner
        inner._container_ref = weakref.ref(self)

    distribute_strategy = property(lambda self: self._strategy)
    name = property(lambda self: self._v.name)
    trainable = property(lambda self: self._v.trainable)
    aggregation = property(lambda self: self._v.aggregation)
    synchronization = property(lambda self: self._v.synchronization)
    tensor = property(lambda self: self._v.tensor)
    grad = property(lambda self: self._v.grad)

    @property
    def values(self) -> tuple[LocalVariable, ...]:
        return (self._v,)

    @property
    def primary(self) -> LocalVariable:
        return self._v

    def value(self) -> torch.Tensor:
        return self._v.value()

    def _update(self, kind: str, value: Any) -> AggregatingVariable:
        mode = context.current_mode()
        rc = mode.replica_context
        if mode.update_replica is None and rc is not None and rc._strategy is self._strategy:
            if self.aggregation == VariableAggregation.NONE:
                raise DistributeValueError(
                    f"You must specify an aggregation method to update a variable ({self.name!r}) "
                    f"of {self._strategy!r} in Replica Context: create it with aggregation=SUM, "
                    f"MEAN or ONLY_FIRST_REPLICA"
                )

            def merge_fn(strategy: Strategy, v: Any) -> None:
                getattr(self._v, kind)(_primary(aggregate(strategy, self, v)))

            rc.merge_call(merge_fn, args=(value,))
            return self
        getattr(self._v, kind)(_primary(value))
        return self

    def assign(self, value: Any) -> AggregatingVariable:
        return self._update("assign", value)

    def assign_add(self, delta: Any) -> AggregatingVariable:
        return self._update("assign_add", delta)

    def assign_sub(self, delta: Any) -> AggregatingVariable:
        return self._update("assign_sub", delta)


def _primary(value: Any) -> Any:
    if isinstance(value, (Mirrored, PerReplica)):
        return value.primary
    return value
