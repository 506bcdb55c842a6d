"""``ReplicaContext``: what the function given to ``Strategy.run`` sees of its replica (spec
1B.6): its id, ``merge_call`` into the cross-replica context, ``all_reduce`` and ``all_gather``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

import torch

from ..errors import DistributeContextError
from . import context
from .context import StrategyLike as Strategy  # by its shape: strategy.py imports this module
from .enums import ReduceOp
from .values import Mirrored, leaves, map_nest


class _Runner(Protocol):
    """What a replica context asks of the threads running its replicas
    (``replicas.ReplicaRunner``, which imports this module)."""

    def merge_call(
        self, index: int, merge_fn: Callable[..., Any], args: tuple, kwargs: dict
    ) -> Any: ...


class ReplicaContext:
    """The context of one replica inside ``strategy.run`` (or the default replica context)."""

    def __init__(
        self,
        strategy: Strategy,
        replica_id_in_sync_group: int,
        local_index: int | None = 0,
        runner: _Runner | None = None,
    ) -> None:
        self._strategy = strategy
        self._replica_id = replica_id_in_sync_group
        self._local_index = local_index
        self._runner = runner

    def __repr__(self) -> str:
        return f"ReplicaContext(replica {self._replica_id} of {self._strategy!r})"

    def _check_current(self, what: str) -> None:
        current = context.current_mode().replica_context
        if current is self:
            return
        if current is None or (current._strategy._is_default and not self._strategy._is_default):
            raise DistributeContextError(
                f"ReplicaContext.{what}: Need to be inside `call_for_each_replica()` "
                f"(the function given to strategy.run)"
            )
        if current._strategy is not self._strategy:
            raise DistributeContextError(
                f"ReplicaContext.{what}: mixing different tf.distribute.Strategy objects: "
                f"{self._strategy!r} is not the current {current._strategy!r}"
            )
        raise DistributeContextError(
            f"ReplicaContext.{what}: Mismatching ReplicaContext: {self!r} is not the current "
            f"{current!r}"
        )

    @property
    def strategy(self) -> Strategy:
        return self._strategy

    @property
    def num_replicas_in_sync(self) -> int:
        return self._strategy.num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self) -> int | torch.Tensor:
        """This replica's global id: an int32 scalar tensor (the Python int 0 in the default
        replica context); as TF's, still readable once ``run`` has returned."""
        if self._strategy._is_default:
            return 0
        return torch.tensor(self._replica_id, dtype=torch.int32)

    @property
    def devices(self) -> tuple[str, ...]:
        """The device(s) of this replica."""
        self._check_current("devices")
        if self._strategy._is_default:
            return ("cpu",)
        return (self._strategy.extended.worker_devices[self._local_index or 0],)

    def merge_call(
        self, merge_fn: Callable[..., Any], args: tuple | list = (), kwargs: dict | None = None
    ) -> Any:
        """Wait for every replica, run ``merge_fn(strategy, *merged args)`` once in the
        cross-replica context, give each replica its own component of the result."""
        self._check_current("merge_call")
        kwargs = dict(kwargs or {})
        if self._runner is None:
            mode = replace(context.current_mode(), replica_context=None)
            with context.entered(mode):
                return merge_fn(self._strategy, *args, **kwargs)
        return self._runner.merge_call(self._local_index or 0, merge_fn, tuple(args), kwargs)

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any) -> Any:
        """Every leaf tensor of the nest ``value`` reduced (SUM or MEAN) over all replicas, in
        one fused collective; differentiable (the gradient is the same reduction)."""
        op = ReduceOp.resolve(reduce_op)
        self._check_current("all_reduce")
        if self._strategy._is_default:
            return value
        flat = [torch.as_tensor(x) for x in leaves(value)]
        if not flat:
            return value
        reduced = _AllReduce.apply(self, op, *flat)
        it = iter(reduced)
        return map_nest(lambda _x: next(it), value)

    def _all_reduce_plain(self, op: ReduceOp, flat: list[torch.Tensor]) -> list[torch.Tensor]:
        def merge_fn(strategy: Strategy, *values: Any) -> list:
            return strategy.extended.batch_reduce_to(op, [(v, v) for v in values])

        return list(self.merge_call(merge_fn, args=tuple(flat)))

    def all_gather(self, value: Any, axis: int) -> Any:
        """Every leaf tensor of ``value`` concatenated along ``axis`` over all replicas (sizes
        may differ along ``axis``)."""
        self._check_current("all_gather")
        if self._strategy._is_default:
            return value
        flat = leaves(value)

        def merge_fn(strategy: Strategy, *values: Any) -> list:
            gathered = [strategy.extended._gather(v, axis) for v in values]
            count = len(strategy.extended.worker_devices)
            return [Mirrored([g] + [g.clone() for _ in range(count - 1)]) for g in gathered]

        out = iter(self.merge_call(merge_fn, args=tuple(flat)))
        return map_nest(lambda _x: next(out), value)


class _AllReduce(torch.autograd.Function):
    """all_reduce as an autograd function: the gradient is the same reduction of the upstream
    gradients, itself a merge point of the replicas' backward passes."""

    @staticmethod
    def forward(ctx, rc: ReplicaContext, op: ReduceOp, *flat: torch.Tensor):
        ctx.rc = rc
        ctx.op = op
        return tuple(rc._all_reduce_plain(op, [t.detach() for t in flat]))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        with context.entered(context.Mode(ctx.rc._strategy, ctx.rc)):
            reduced = ctx.rc._all_reduce_plain(ctx.op, list(grads))
        return (None, None, *reduced)
