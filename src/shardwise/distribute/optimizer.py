"""``Optimizer``: a ``torch.optim`` optimizer over (distributed) variables that, stepped in a
replica context, does steps 2 to 4 of tf.distribute's "how to update a variable" itself:
``merge_call`` with every replica's gradients, ``batch_reduce_to`` (ONE fused all-reduce for
all gradients), then every copy of every variable updated (``extended.update``), as TF's
optimizers do in ``apply_gradients``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..errors import DistributeTypeError
from . import context
from .enums import ReduceOp
from .values import PerReplica
from .variables import LocalVariable, Variable


class Optimizer:
    """``Optimizer(torch.optim.SGD, variables, lr=0.1)``: one ``torch.optim`` optimizer per
    copy (its state, e.g. momentum, lives beside that copy, like TF's slot variables).

    ``gradient_reduction`` is how replica gradients combine: SUM (TF's default: scale the loss
    by the global batch size, see ``compute_average_loss``) or MEAN."""

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        variables: Iterable[Variable],
        *,
        gradient_reduction: ReduceOp | str = ReduceOp.SUM,
        **hyperparameters: Any,
    ) -> None:
        self._variables = list(variables)
        for v in self._variables:
            if not isinstance(v, Variable):
                raise DistributeTypeError(
                    f"Optimizer takes shardwise.distribute Variables, got {type(v).__name__}; "
                    f"wrap a module with strategy.distribute_module(module)"
                )
        self._reduction = ReduceOp.resolve(gradient_reduction)
        owners = {id(v.distribute_strategy): v.distribute_strategy for v in self._variables}
        if len(owners) > 1:
            raise DistributeTypeError(
                f"Optimizer variables belong to different strategies {list(owners.values())}"
            )
        self._strategy = next(iter(owners.values()), None)
        copies = {len(_copies(v)) for v in self._variables}
        if len(copies) > 1:
            raise DistributeTypeError(
                f"Optimizer variables have different numbers of copies {sorted(copies)}; use "
                f"variables of one strategy"
            )
        self._num_copies = copies.pop() if copies else 1
        self.optimizers = [
            optimizer_class([_copies(v)[i].tensor for v in self._variables], **hyperparameters)
            for i in range(self._num_copies)
        ]

    @property
    def variables(self) -> list[Variable]:
        return list(self._variables)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients. In a replica context: this replica's copies only; a copy all
        replicas share (CentralStorage) is cleared by the first replica only, since the others
        run after it and add their gradients to it."""
        index = _replica_index()
        for i, opt in enumerate(self.optimizers):
            if index is None or index == i:
                opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        """Apply the gradients. In a replica context of several replicas this is a merge
        point: every replica must call it."""
        rc = context.get_replica_context()
        if rc is not None and not rc.strategy._is_default:
            index = (rc._local_index or 0) if self._num_copies > 1 else 0
            local = [_copies(v)[index].grad for v in self._variables]
            rc.merge_call(lambda strategy, grads: self._apply(strategy, grads), args=(local,))
            return
        strategy = self._strategy or context.get_strategy()
        if self._num_copies > 1:
            grads = [PerReplica([c.grad for c in _copies(v)]) for v in self._variables]
        else:
            grads = [_copies(v)[0].grad for v in self._variables]
        with context.require_cross_replica(strategy, "Optimizer.step"):
            self._apply(strategy, grads)

    def _apply(self, strategy: Any, grads: list[Any]) -> None:
        n = strategy.num_replicas_in_sync
        if self._num_copies == 1 and strategy.extended._num_local > 1:
            # one shared copy (CentralStorage): autograd already summed every replica's gradient
            if self._reduction is ReduceOp.MEAN:
                with torch.no_grad():
                    for v in self._variables:
                        if v.grad is not None:
                            v.grad.div_(n)
            with context.update_context(0):
                self.optimizers[0].step()
            return
        pairs = [(g, v) for g, v in zip(grads, self._variables, strict=True) if g is not None]
        if self._num_copies > 1 or n > 1:
            reduced = iter(strategy.extended.batch_reduce_to(self._reduction, pairs))
            for g, v in zip(grads, self._variables, strict=True):
                if g is not None:
                    strategy.extended._update(v, _set_grad, (next(reduced),), {}, True)
        for i, opt in enumerate(self.optimizers):
            with context.update_context(i):
                opt.step()

    def state_dict(self) -> list[dict]:
        return [opt.state_dict() for opt in self.optimizers]


def _set_grad(copy: LocalVariable, grad: torch.Tensor) -> None:
    copy.tensor.grad = grad.to(copy.tensor.device).view_as(copy.tensor)


def _copies(v: Variable) -> tuple[LocalVariable, ...]:
    return tuple(getattr(v, "values", (v,)))


def _replica_index() -> int | None:
    rc = context.get_replica_context()
    if rc is None or rc._runner is None:
        return None
    return rc._local_index


def compute_average_loss(
    per_example_loss: torch.Tensor,
    sample_weight: torch.Tensor | float | None = None,
    global_batch_size: int | None = None,
) -> torch.Tensor:
    """TF's ``tf.nn.compute_average_loss``: the per-example losses (times ``sample_weight``,
    broadcast) summed and divided by the GLOBAL batch size (default: local batch size x
    replicas), so gradients summed over the replicas are the gradient of the global mean."""
    if global_batch_size is None:
        rc = context.get_replica_context()
        replicas = rc.num_replicas_in_sync if rc is not None else 1
        global_batch_size = (
            per_example_loss.shape[0] * replicas if per_example_loss.ndim else replicas
        )
    if sample_weight is not None:
        per_example_loss = per_example_loss * torch.as_tensor(
            sample_weight, dtype=per_example_loss.dtype, device=per_example_loss.device
        )
    return per_example_loss.sum() / global_batch_size
