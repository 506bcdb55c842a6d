"""``__torch_dispatch__`` for DTensor: run an aten op on every local component."""

from __future__ import annotations

from typing import Any

import torch

from .dtensor import DTensor, set_dispatch_handler
from .errors import UnsupportedOpError

aten = torch.ops.aten


def _same_spec(func: Any, args: tuple, kwargs: dict) -> DTensor:
    """Ops that keep the spec and act per component (detach, alias, clone)."""
    src: DTensor = args[0]
    return DTensor([func(c, *args[1:], **kwargs) for c in src._components], src._spec)


_HANDLERS = {
    aten.detach.default: _same_spec,
    aten.alias.default: _same_spec,
    aten.clone.default: _same_spec,
}


def dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    handler = _HANDLERS.get(func)
    if handler is None:
        raise UnsupportedOpError(f"{func} has no sharding rule for DTensor inputs")
    return handler(func, args, kwargs)


set_dispatch_handler(dispatch)
