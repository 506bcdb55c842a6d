"""veScale's dict plans, as veScale's own examples write them:
``{"parameter": {regex: [placements]}, "forward": {regex + ".input"|".output": ...}}``.

Every key is a plain-string regular expression over the full name (``"input"``/``"output"``
alone name the root module). Parameters no key names are replicated. A forward entry holds one
placement list per positional input or output (``None`` leaves one alone), or a dict by argument
name (inputs) or by key (dict-like outputs). A placement list of length one names the
tensor-parallel mesh dim of a larger mesh; otherwise it has one placement per mesh dim.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import InvalidPlacementError, ParallelPlanError
from ..mesh import DeviceMesh
from ..placements import Placement
from ..spec import validate_placements
from .boundary import as_dtensor, on_tp_dim, to_layout
from .params import distribute_parameter, replicate_rest
from .plan import key_text, match_modules, name_matcher, unmatched

PLAN_PARTS = frozenset({"parameter", "forward"})


def is_vescale_plan(plan: Mapping) -> bool:
    """A dict plan with veScale's top-level keys (and dicts under them)."""
    return (
        bool(plan)
        and set(plan) <= PLAN_PARTS
        and all(isinstance(v, Mapping) for v in plan.values())
    )


def apply_vescale_plan(module: nn.Module, mesh: DeviceMesh, plan: Mapping, tp_dim: int) -> None:
    """Distribute the parameters and install the forward layouts of a veScale plan."""
    _distribute_parameters(module, mesh, plan.get("parameter", {}), tp_dim)
    replicate_rest(module, mesh, tp_dim)
    for key, layouts in plan.get("forward", {}).items():
        _install_forward(module, mesh, key, layouts, tp_dim)


def _distribute_parameters(module: nn.Module, mesh: DeviceMesh, plan: Mapping, tp_dim: int) -> None:
    """Place every parameter a key names (the first key that names it); a tied parameter
    becomes one DTensor held by every module that holds it."""
    named = list(module.named_parameters(remove_duplicate=False))
    chosen: dict[int, tuple[str, str, Any]] = {}  # id(param) -> (name, key, placements)
    for key, placements in plan.items():
        matches = name_matcher(key, regex=True)
        hits = [(n, p) for n, p in named if matches(n)]
        if not hits:
            raise unmatched("parameter", key, module, (n for n, _ in named))
        for n, p in hits:
            first = chosen.setdefault(id(p), (n, key, placements))
            if list(first[2]) != list(placements):
                raise ParallelPlanError(
                    f"plan entries {key_text(first[1])} and {key_text(key)} place the tied "
                    f"parameter {first[0]!r} / {n!r} of shape {list(p.shape)} differently: "
                    f"{list(first[2])} and {list(placements)}"
                )
    done: dict[int, nn.Parameter] = {}
    for name, param in named:
        if id(param) in chosen and id(param) not in done:
            owner_name, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            _, key, placements = chosen[id(param)]
            full = on_tp_dim(mesh, tp_dim, placements)
            _check_fits(key, name, param, mesh, full)
            distribute_parameter(owner, attr, mesh, full, tp_dim)
            done[id(param)] = getattr(owner, attr)
    for name, param in named:  # every holder of a placed parameter holds the one DTensor
        if id(param) in done:
            owner_name, _, attr = name.rpartition(".")
            module.get_submodule(owner_name).register_parameter(attr, done[id(param)])


def _check_fits(key: str, name: str, param: torch.Tensor, mesh: DeviceMesh, placements) -> None:
    try:
        validate_placements(param.shape, mesh, placements)
    except InvalidPlacementError as err:
        raise ParallelPlanError(
            f"plan entry {key_text(key)} places parameter {name!r} of shape "
            f"{list(param.shape)} as {list(placements)} on {mesh}: {err}"
        ) from err


def _install_forward(
    module: nn.Module, mesh: DeviceMesh, key: str, layouts: Any, tp_dim: int
) -> None:
    target, side = _split_forward_key(key)
    for name, sub in match_modules(module, target, regex=True):
        entry = f"{key} ({name or 'root'})"
        if side == "input":
            sub.register_forward_pre_hook(
                _input_hook(mesh, tp_dim, layouts, entry), with_kwargs=True
            )
        else:
            sub.register_forward_hook(_output_hook(mesh, tp_dim, layouts, entry))


def _split_forward_key(key: str) -> tuple[str, str]:
    """A forward key's module regex and side: ``"mlp.fc1.input"`` and veScale's escaped
    ``r"mlp\\.fc1\\.input"`` are ``("mlp.fc1", "input")`` and ``(r"mlp\\.fc1", "input")``;
    ``"input"`` alone is the root module's."""
    for side in ("input", "output"):
        if key == side:
            return "", side
        head = key[: -len(side)] if key.endswith(side) else ""
        if head.endswith("."):
            target = head[:-1]
            escapes = len(target) - len(target.rstrip("\\"))
            return (target[:-1] if escapes % 2 else target), side  # drop the dot's escape
    raise ParallelPlanError(
        f"forward plan entry {key!r} must end in '.input' or '.output' (veScale's format, the "
        f"dot escaped or not)"
    )


def _place(x: Any, mesh: DeviceMesh, tp_dim: int, placements: Any, entry: str) -> Any:
    """One input or output into the entry's placements (a plain tensor becomes a DTensor)."""
    if placements is None or not isinstance(x, torch.Tensor):
        return x
    if isinstance(placements, Placement) or not isinstance(placements, Sequence):
        raise ParallelPlanError(
            f"forward plan entry {entry}: {placements!r} is not a list of placements"
        )
    dx = as_dtensor(x, mesh, on_tp_dim(mesh, tp_dim, placements))
    return to_layout(dx, on_tp_dim(mesh, tp_dim, placements, base=dx.placements))


def _input_hook(mesh: DeviceMesh, tp_dim: int, layouts: Any, entry: str):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        if isinstance(layouts, Mapping):
            bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
            for name in layouts:
                if name not in inspect.signature(module.forward).parameters:
                    raise ParallelPlanError(
                        f"forward plan entry {entry}: {type(module).__name__}.forward has no "
                        f"argument {name!r}"
                    )
            for name, value in bound.arguments.items():
                if name in layouts:
                    bound.arguments[name] = _place(value, mesh, tp_dim, layouts[name], entry)
            return tuple(bound.args), dict(bound.kwargs)
        if len(layouts) > len(args):
            raise ParallelPlanError(
                f"forward plan entry {entry}: {len(layouts)} input layouts for "
                f"{type(module).__name__}, which got {len(args)} positional inputs"
            )
        placed = [_place(a, mesh, tp_dim, p, entry) for a, p in zip(args, layouts, strict=False)]
        return (*placed, *args[len(placed) :]), kwargs

    return hook


def _output_hook(mesh: DeviceMesh, tp_dim: int, layouts: Any, entry: str):
    def hook(module: nn.Module, _args: tuple, out: Any) -> Any:
        if isinstance(layouts, Mapping):
            for k in layouts:
                out[k] = _place(out[k], mesh, tp_dim, layouts[k], entry)
            return out
        single = not isinstance(out, (tuple, list))
        outs = [out] if single else list(out)
        if len(layouts) > len(outs):
            raise ParallelPlanError(
                f"forward plan entry {entry}: {len(layouts)} output layouts for "
                f"{type(module).__name__}, which returned {len(outs)} outputs"
            )
        placed = [_place(o, mesh, tp_dim, p, entry) for o, p in zip(outs, layouts, strict=False)]
        placed += outs[len(placed) :]
        return placed[0] if single else type(out)(placed)

    return hook
