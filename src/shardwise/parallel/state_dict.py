"""``Module.load_state_dict`` into modules holding DTensors: every entry is checked against the
parameter or buffer it loads into before anything is copied, so a mismatch (another global
shape or mesh, a plain tensor for a DTensor or the reverse) raises ``StateDictMismatchError``
naming the key, both shapes, meshes and placements, and loads nothing (torch would copy what
fits and wrap the rest in one RuntimeError). A DTensor with the same global shape and mesh but
other placements is redistributed to the parameter's placements, then copied.

The check is a load_state_dict pre-hook: on every module a DTensor parameter or buffer is
registered on (its own entries), and on the module given to ``distribute_module``,
``parallelize_module``, ``fully_shard`` and ``replicate`` (its whole tree, checked before any
of it loads).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..dtensor import DTensor
from ..errors import StateDictMismatchError

_GUARDED: weakref.WeakKeyDictionary[nn.Module, tuple[bool, Any]] = weakref.WeakKeyDictionary()


def guard_loading(module: nn.Module, *, recurse: bool = True) -> None:
    """Check the state dict entries of ``module``'s parameters and buffers (of its whole tree
    with ``recurse``) before ``load_state_dict`` copies any of them; idempotent."""
    held = _GUARDED.get(module)
    if held is not None:
        if held[0] or not recurse:
            return
        held[1].remove()
    handle = module.register_load_state_dict_pre_hook(functools.partial(_check, recurse=recurse))
    _GUARDED[module] = (recurse, handle)


def _entries(module: nn.Module, recurse: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of what ``module.state_dict()`` would hold, without copying anything."""
    subs = module.named_modules(remove_duplicate=False) if recurse else [("", module)]
    for path, sub in subs:
        base = f"{path}." if path else ""
        for name, param in sub._parameters.items():
            if param is not None:
                yield base + name, param
        for name, buf in sub._buffers.items():
            if buf is not None and name not in sub._non_persistent_buffers_set:
                yield base + name, buf


def _describe(t: torch.Tensor) -> str:
    if isinstance(t, DTensor):
        return (f"a DTensor of global shape {list(t.shape)} with placements "
                f"{list(t.placements)} on {t.device_mesh}")
    return f"a plain tensor of shape {list(t.shape)}"


def _problem(own: torch.Tensor, value: torch.Tensor) -> str | None:
    """Why ``value`` cannot load into ``own`` (None if it can, redistributed if need be)."""
    if isinstance(own, DTensor) and isinstance(value, DTensor):
        if value.shape != own.shape:
            return "the global shapes differ"
        if value.device_mesh != own.device_mesh:
            return ("the meshes differ; load across meshes with torch.distributed.checkpoint "
                    "or shardwise.checkpoint, which reshard")
        return None
    if isinstance(own, DTensor):
        return (f"distribute the entry first (shardwise.distribute_tensor(value, "
                f"{own.device_mesh}, {list(own.placements)})) or load with "
                f"torch.distributed.checkpoint / shardwise.checkpoint")
    return "call .full_tensor() on the entry first to load its global value"


def _check(
    module: nn.Module,
    state_dict: dict,
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list,
    unexpected_keys: list,
    error_msgs: list,
    *,
    recurse: bool,
) -> None:
    problems, moves = [], []
    for name, own in _entries(module, recurse):
        key = prefix + name
        value = state_dict.get(key)
        if not isinstance(value, torch.Tensor) or not (
            isinstance(own, DTensor) or isinstance(value, DTensor)
        ):
            continue  # torch's own checks apply
        problem = _problem(own, value)
        if problem is not None:
            problems.append(
                f"  {key!r}: the state dict holds {_describe(value)}, the module "
                f"{_describe(own)}: {problem}"
            )
        elif value.placements != own.placements:
            moves.append((key, own.placements))
    if problems:
        raise StateDictMismatchError(
            f"load_state_dict into {type(module).__name__}: {len(problems)} entr"
            f"{'y does' if len(problems) == 1 else 'ies do'} not fit (nothing was loaded):\n"
            + "\n".join(problems)
        )
    for key, placements in moves:  # the state dict is load_state_dict's own copy
        state_dict[key] = state_dict[key].detach().redistribute(placements=placements)


def _on_registration(module: nn.Module, name: str, value: Any) -> None:
    if isinstance(value, DTensor):
        guard_loading(module, recurse=False)


nn.modules.module.register_module_parameter_registration_hook(_on_registration)
nn.modules.module.register_module_buffer_registration_hook(_on_registration)
