"""``DistributedModule``: an ``nn.Module`` whose parameters are variables of a strategy (one
mirrored copy per replica device), computing with the current replica's copies."""

from __future__ import annotations

from typing import Any

import torch
from torch.func import functional_call

from .context import StrategyLike as Strategy  # by its shape: strategy.py imports this module
from .variables import Variable


class DistributedModule:
    """``strategy.distribute_module(module)``: calling it runs ``module`` with the parameters
    of the replica this thread acts for (the primary copies in a cross-replica context).
    Buffers stay the module's own."""

    def __init__(self, strategy: Strategy, module: torch.nn.Module) -> None:
        self.module = module
        self.strategy = strategy
        with strategy.scope():
            self._variables = {
                name: Variable(p.detach(), trainable=p.requires_grad, name=name)
                for name, p in module.named_parameters()
            }

    def variables(self) -> list[Variable]:
        """The parameters as variables, in ``named_parameters`` order (give them to
        ``shardwise.distribute.Optimizer``)."""
        return list(self._variables.values())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        params = {name: v.value() for name, v in self._variables.items()}
        return functional_call(self.module, params, args, kwargs)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The parameters' current values (primary copies) and the module's buffers."""
        state = {name: v.read_value().detach().clone() for name, v in self._variables.items()}
        state.update({k: b for k, b in self.module.named_buffers()})
        return state
