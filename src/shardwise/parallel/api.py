"""``distribute_module`` and ``parallelize_module`` (PyTorch's signatures, on any mesh)."""

from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from ..deferred_init import materialize_if_root
from ..errors import ParallelPlanError
from ..mesh import DeviceMesh
from ..mesh_argument import mesh_or_current
from .boundary import resolve_tp_dim, tp_on_root
from .params import replicate_rest
from .plan import PlanKey, key_text, match_modules
from .state_dict import guard_loading
from .style import ParallelStyle
from .vescale import apply_vescale_plan, is_vescale_plan

PartitionFn = Callable[[str, nn.Module, DeviceMesh], None]
InputFn = Callable[[nn.Module, Any, DeviceMesh], Any]
OutputFn = Callable[[nn.Module, Any, DeviceMesh], Any]
# a dict literal's key type is inferred exactly (dict[str, ColwiseParallel]) and Mapping keys
# are invariant: each key type is listed, so type checkers accept {"0": ColwiseParallel()}
Plan = (
    ParallelStyle
    | Mapping[str, ParallelStyle]
    | Mapping[re.Pattern, ParallelStyle]
    | Mapping[PlanKey, ParallelStyle]
    | Mapping[str, Mapping]
)


def distribute_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    partition_fn: PartitionFn | None = None,
    input_fn: InputFn | None = None,
    output_fn: OutputFn | None = None,
) -> nn.Module:
    """Make ``module``'s parameters DTensors on ``device_mesh`` (default: the current mesh,
    ``with mesh:``): ``partition_fn(name, submodule, mesh)`` runs on every submodule and may
    distribute its parameters; every parameter and buffer it leaves alone is replicated.
    ``input_fn(module, inputs, mesh)`` and ``output_fn(module, outputs, mesh)`` run around each
    forward call; PyTorch's older two-argument forms ``input_fn(inputs, mesh)`` and
    ``output_fn(outputs, mesh)`` are accepted too, with PyTorch's ``FutureWarning``."""
    device_mesh = mesh_or_current(device_mesh, "distribute_module")
    if partition_fn is not None:
        for name, sub in list(module.named_modules()):
            partition_fn(name, sub, device_mesh)
    replicate_rest(module, device_mesh)
    guard_loading(module)
    if input_fn is not None:
        takes_module = _takes_module(input_fn, "input_fn")
        module.register_forward_pre_hook(
            lambda mod, inputs: input_fn(mod, inputs, device_mesh) if takes_module
            else input_fn(inputs, device_mesh)  # type: ignore[call-arg]
        )
    if output_fn is not None:
        takes_module = _takes_module(output_fn, "output_fn")
        module.register_forward_hook(
            lambda mod, inputs, outputs: output_fn(mod, outputs, device_mesh) if takes_module
            else output_fn(outputs, device_mesh)  # type: ignore[call-arg]
        )
    return module


def _takes_module(fn: Callable, what: str) -> bool:
    """Whether a ``distribute_module`` hook takes (module, value, mesh) or (value, mesh)."""
    try:
        count = len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return True  # a builtin or C callable: PyTorch's current three-argument form
    if count not in (2, 3):
        raise ParallelPlanError(
            f"distribute_module's {what} takes (module, value, device_mesh) or (value, "
            f"device_mesh), got a callable of {count} parameters: {fn!r}"
        )
    if count == 2:
        warnings.warn(
            f"Deprecating distribute_module's two-argument {what}(value, device_mesh), as "
            f"PyTorch does: pass {what}(module, value, device_mesh)",
            FutureWarning,
            stacklevel=3,
        )
    return count == 3


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    parallelize_plan: Plan | None = None,
    *,
    tp_mesh_dim: int | str | None = None,
    src_data_rank: int | None = 0,
) -> nn.Module:
    """Shard ``module`` by a plan: a style for the module itself; a dict from module names,
    globs (``"layers.*.attn"``) or regexes (``re.compile`` or ``"re:..."``) to styles, applied
    in order; or a veScale dict plan (``{"parameter": ..., "forward": ...}``).

    Styles shard on one mesh dim (``tp_mesh_dim``; default the dim named ``"tp"``, else the
    last), every other mesh dim is Replicate, so a 2-D (data x tensor) mesh works as is; in a
    per-rank program (one device per process) they run on the tp sub-mesh through this rank,
    as ``mesh["tp"]`` would give. The mesh defaults to the current one (``with mesh:``), as in
    PyTorch. ``src_data_rank``: the rank whose parameter values every style distributes, as
    in ``distribute_tensor`` (``None``: each process's own values, no communication)."""
    device_mesh, tp_mesh_dim = tp_on_root(
        mesh_or_current(device_mesh, "parallelize_module"), tp_mesh_dim, "parallelize_module"
    )
    styles = parallelize_plan.values() if isinstance(parallelize_plan, Mapping) else [
        parallelize_plan
    ]
    for style in styles:
        if isinstance(style, ParallelStyle):
            style.src_data_rank = src_data_rank
    _apply_plan(module, device_mesh, parallelize_plan, tp_mesh_dim)
    guard_loading(module)
    # a deferred_init tree materializes at its root; a torch.device("meta") module stays meta
    # (PyTorch's flow: module.to_empty(device=...), then the model's own init)
    materialize_if_root(module)
    return module


def _apply_plan(
    module: nn.Module, device_mesh: DeviceMesh, parallelize_plan: Plan, tp_mesh_dim: Any
) -> nn.Module:
    tp_dim = resolve_tp_dim(device_mesh, tp_mesh_dim)
    if isinstance(parallelize_plan, Mapping) and is_vescale_plan(parallelize_plan):
        # its placements name every mesh dim
        apply_vescale_plan(module, device_mesh, parallelize_plan, tp_dim)
        return module
    if device_mesh.ndim > 1 and device_mesh.num_local_devices() == 1:
        # per rank, a plain tensor is this rank's data, which differs along the other mesh dims:
        # the styles run on the tp sub-mesh through this rank, as parallelize_module(model,
        # mesh["tp"], plan) does (on the whole mesh an input would be taken as replicated there)
        device_mesh = device_mesh._submesh_through(
            [tp_dim], device_mesh.coordinate_of(device_mesh.local_device_ids[0]))
        tp_dim = 0
    if isinstance(parallelize_plan, ParallelStyle):
        return parallelize_plan.apply(module, device_mesh, tp_mesh_dim=tp_dim)
    if not isinstance(parallelize_plan, Mapping):
        raise ParallelPlanError(
            f"parallelize_plan must be a ParallelStyle or a dict, got "
            f"{type(parallelize_plan).__name__}"
        )
    ties = _tied_parameters(module)
    for key, style in parallelize_plan.items():
        if not isinstance(style, ParallelStyle):
            raise ParallelPlanError(
                f"plan entry {key_text(key)} maps to {style!r}, not a ParallelStyle"
            )
        for name, sub in match_modules(module, key):
            label = key_text(key) if name == key else f"{key_text(key)} ({name})"
            style.apply(sub, device_mesh, tp_mesh_dim=tp_dim, plan_entry=label)
    _retie(module, ties)
    return module


def _tied_parameters(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, attribute) that hold the same parameter object."""
    by_id: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for attr, p in sub._parameters.items():
            if p is not None:
                by_id.setdefault(id(p), []).append((sub, attr))
    return [group for group in by_id.values() if len(group) > 1]


def _retie(module: nn.Module, ties: list[list[tuple[nn.Module, str]]]) -> None:
    """After a plan, every holder of a tied parameter holds the one a style distributed."""
    for group in ties:
        held = {id(sub._parameters[attr]): sub._parameters[attr] for sub, attr in group}
        if len(held) == 1:
            continue
        placed = [p for p in held.values() if hasattr(p, "placements")]
        if len(placed) != 1:
            names = [n for n, m in module.named_modules() if any(m is s for s, _ in group)]
            raise ParallelPlanError(
                f"a parameter tied between modules {names} was sharded by {len(placed)} plan "
                f"entries; shard it once (or keep it plain in all of them)"
            )
        for sub, attr in group:
            sub._parameters[attr] = placed[0]


__all__ = ["distribute_module", "parallelize_module"]
