"""Distributed values: ``PerReplica`` (one possibly different component per replica) and
``Mirrored`` (identical components), and the regrouping of per-replica results (spec 1B.1).

On the strategy's 1-D replica mesh a Mirrored value is a ``Replicate()`` DTensor; a PerReplica
value has no global invariant, so it stays a tuple of local components (``as_dtensor`` views it
as ``Shard(dim)`` when the components are batch slices).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..errors import DistributeTypeError, DistributeValueError
from ..placements import Placement, Shard
from . import context
from .context import StrategyLike as Strategy  # by its shape: strategy.py imports this module

if TYPE_CHECKING:
    from ..dtensor import DTensor


class DistributedValues:
    """Components of one value, one per local replica, in replica order."""

    def __init__(self, values: Sequence[Any], strategy: Strategy | None = None) -> None:
        self._values = tuple(values)
        self._strategy = strategy

    @property
    def values(self) -> tuple[Any, ...]:
        return self._values

    @property
    def primary(self) -> Any:
        return self._values[0]

    def _local(self, strategy: Strategy) -> tuple[Any, ...]:
        return self._values

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        body = ", ".join(f"{i}: {v!r}" for i, v in enumerate(self._values))
        return f"{type(self).__name__}({{{body}}})"


class PerReplica(DistributedValues):
    """Unsynchronized components (a batch slice, a per-replica loss...). Not usable as a tensor
    in a cross-replica context: reduce it first (``strategy.reduce``)."""

    def as_dtensor(self, mesh: Any, placement: Placement | None = None) -> DTensor:
        """The components as one DTensor over the replica ``mesh`` (default ``Shard(0)``:
        concatenating the components gives the global value)."""
        from ..dtensor import DTensor

        return DTensor.from_local(list(self._values), mesh, [placement or Shard(0)])


class Mirrored(DistributedValues):
    """Identical components: it acts as its value, the closest component (this replica's in a
    replica context, the updated one in an update context, else the primary)."""

    def closest(self) -> Any:
        mode = context.current_mode()
        rc = mode.replica_context
        if mode.update_replica is not None:
            return self._values[mode.update_replica]
        if rc is not None and rc._local_index is not None:
            return self._values[rc._local_index]
        return self._values[0]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.closest(), name)

    def __getitem__(self, index: Any) -> Any:
        return self.closest()[index]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        args, kwargs = _unwrap_mirrored((args, kwargs or {}))
        return func(*args, **kwargs)

    def __float__(self) -> float:
        return float(self.closest())

    def __array__(self, dtype: Any = None) -> Any:
        array = torch.as_tensor(self.closest()).detach().cpu().numpy()
        return array if dtype is None else array.astype(dtype)


def _unwrap_mirrored(nest: Any) -> Any:
    return map_nest(lambda x: x.closest() if isinstance(x, Mirrored) else x, nest)


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul"):
    for _prefix in ("", "r"):
        _dunder = f"__{_prefix}{_name}__"

        def _op(self: Mirrored, other: Any, _dunder: str = _dunder) -> Any:
            value = self.closest()
            if isinstance(other, Mirrored):
                other = other.closest()
            if not isinstance(value, torch.Tensor):
                value = torch.as_tensor(value)
            return getattr(value, _dunder)(other)

        setattr(Mirrored, _dunder, _op)
Mirrored.__neg__ = lambda self: -self.closest()  # type: ignore[method-assign]


# ----- nests ------------------------------------------------------------------------------------


def map_nest(fn: Callable[[Any], Any], nest: Any) -> Any:
    """Apply ``fn`` to every leaf of a list/tuple/namedtuple/dict nest (DistributedValues and
    variables are leaves)."""
    if isinstance(nest, dict):
        return type(nest)((k, map_nest(fn, v)) for k, v in nest.items())
    if isinstance(nest, tuple) and hasattr(nest, "_fields"):
        return type(nest)(*(map_nest(fn, v) for v in nest))
    if isinstance(nest, (list, tuple)):
        return type(nest)(map_nest(fn, v) for v in nest)
    return fn(nest)


def leaves(nest: Any) -> list[Any]:
    out: list[Any] = []
    map_nest(out.append, nest)
    return out


def is_distributed_variable(x: Any) -> bool:
    return getattr(x, "_is_distributed_variable", False)


def select_replica(index: int, nest: Any) -> Any:
    """Every non-variable DistributedValues in ``nest`` replaced by its ``index``-th component."""

    def pick(x: Any) -> Any:
        if isinstance(x, DistributedValues) and not is_distributed_variable(x):
            return x._values[index]
        return x

    return map_nest(pick, nest)


def regroup(per_replica: Sequence[Any], wrap: type[DistributedValues] = PerReplica) -> Any:
    """Merge one nest per replica into one nest: an object every replica returned is kept as
    is; the components of one distributed variable give that variable; anything else is
    wrapped (``PerReplica``; ``Mirrored`` for update results)."""
    first = per_replica[0]
    if isinstance(first, dict) and not isinstance(first, DistributedValues):
        keys = set(first)
        for other in per_replica[1:]:
            if not isinstance(other, dict) or set(other) != keys:
                raise DistributeValueError(
                    f"replicas returned dicts with different keys: "
                    f"{[sorted(map(str, o)) if isinstance(o, dict) else type(o).__name__ for o in per_replica]}"  # noqa: E501
                )
        return type(first)((k, regroup([o[k] for o in per_replica], wrap)) for k in first)
    shared = len(per_replica) > 1 and all(o is first for o in per_replica)
    if isinstance(first, (list, tuple)) and not shared:
        for other in per_replica[1:]:
            if type(other) is not type(first) or len(other) != len(first):
                raise DistributeValueError(
                    f"replicas returned different structures: "
                    f"{[f'{type(o).__name__} of {len(o)}' if isinstance(o, (list, tuple)) else type(o).__name__ for o in per_replica]}"  # noqa: E501
                )
        parts = [regroup([o[i] for o in per_replica], wrap) for i in range(len(first))]
        return type(first)(*parts) if hasattr(first, "_fields") else type(first)(parts)
    container = _container_of(first)
    if container is not None and len(container.values) == len(per_replica):
        if all(o is c for o, c in zip(per_replica, container.values, strict=True)):
            return container
    if all(o is first for o in per_replica):
        return first
    return wrap(per_replica)


def _container_of(x: Any) -> Any:
    ref = getattr(x, "_container_ref", None)
    return ref() if ref is not None else None


def value_container(value: Any) -> Any:
    """The distributed variable whose component ``value`` is, else ``value`` itself."""
    container = _container_of(value)
    return value if container is None else container


def local_results(value: Any) -> tuple[Any, ...]:
    """This worker's per-replica components of ``value`` (a nest of them, per replica)."""
    if isinstance(value, DistributedValues):
        return value.values
    if is_distributed_variable(value):
        return tuple(value.values)
    found = [x for x in leaves(value) if isinstance(x, DistributedValues)]
    if not found or not isinstance(value, (list, tuple, dict)):
        return (value,)
    count = len(found[0].values)
    if any(len(x.values) != count for x in found):
        raise DistributeTypeError(
            f"a nest mixes distributed values of {sorted({len(x.values) for x in found})} replicas"
        )
    return tuple(select_replica(i, value) for i in range(count))
