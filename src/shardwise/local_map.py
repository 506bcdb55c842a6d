"""``local_map``: run a function written for plain tensors (a fused kernel, a custom op, a Triton
or C kernel reading raw pointers) on every local component of its DTensor arguments.

The semantics are PyTorch's ``torch.distributed.tensor.experimental.local_map``: DTensor
arguments are checked against ``in_placements`` (or redistributed to them), the function sees
local tensors, its tensor outputs become DTensors with ``out_placements``, and autograd flows
through. A process that owns several devices runs the function once per local device, in
ascending device id, on that device's components.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .dtensor import DTensor, local_components
from .errors import InvalidArgumentError, InvalidPlacementError, MeshError, ShardwiseTypeError
from .mesh import DeviceMesh
from .placements import Placement
from .torch_compat import pytree

PlacementType = Sequence[Placement] | None


def local_map(
    func: Callable | None = None,
    out_placements: PlacementType | Sequence[PlacementType] = None,
    in_placements: Sequence[PlacementType] | None = None,
    *,
    redistribute_inputs: bool = False,
    device_mesh: DeviceMesh | None = None,
) -> Callable:
    """``func`` lifted to DTensors: it runs on local components, its outputs are wrapped.

    ``out_placements``: the placements of the one output, or a tuple with one entry per
    flattened output (``None`` for non-tensor outputs). ``in_placements``: one entry per
    flattened argument, checked on DTensor arguments (``None`` for non-tensors); a mismatch
    raises unless ``redistribute_inputs``. ``device_mesh`` defaults to the first DTensor's.
    Without DTensor arguments ``func`` runs unchanged. Usable as a decorator without ``func``.
    """
    if func is None:
        return functools.partial(
            local_map,
            out_placements=out_placements,
            in_placements=in_placements,
            redistribute_inputs=redistribute_inputs,
            device_mesh=device_mesh,
        )

    @functools.wraps(func)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return _call(func, out_placements, in_placements, redistribute_inputs, device_mesh,
                     args, kwargs)

    return wrapped


def _is_placements(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(p, Placement) for p in value)


def _out_entries(out_placements: Any) -> list[PlacementType]:
    """One placements entry per flattened output."""
    if out_placements is None or _is_placements(out_placements):
        return [out_placements]
    return list(out_placements)


def _call(
    func: Callable,
    out_placements: Any,
    in_placements: Sequence[PlacementType] | None,
    redistribute_inputs: bool,
    mesh: DeviceMesh | None,
    args: tuple,
    kwargs: dict,
) -> Any:
    name = getattr(func, "__name__", repr(func))
    flat, tree = pytree.tree_flatten(args)
    if in_placements is not None and len(in_placements) != len(flat):
        raise InvalidArgumentError(
            f"local_map({name}): in_placements has {len(in_placements)} entries but the "
            f"arguments flatten to {len(flat)} values"
        )
    per_arg: list[Any] = []  # per argument: its list of local components, or the value
    is_local: list[bool] = []
    for i, arg in enumerate(flat):
        if not isinstance(arg, DTensor):
            if in_placements is not None and in_placements[i] is not None and not isinstance(
                arg, torch.Tensor
            ):
                raise InvalidPlacementError(
                    f"local_map({name}): argument {i} is a {type(arg).__name__}, not a tensor, "
                    f"but in_placements gives it {list(in_placements[i])}; use None"
                )
            per_arg.append(arg)
            is_local.append(False)
            continue
        if mesh is None:
            mesh = arg.device_mesh
        elif arg.device_mesh != mesh:
            raise MeshError(
                f"local_map({name}): argument {i} of shape {list(arg.shape)} lives on "
                f"{arg.device_mesh}, not on {mesh}"
            )
        if in_placements is not None:
            wanted = in_placements[i]
            if wanted is None:
                raise InvalidPlacementError(
                    f"local_map({name}): DTensor argument {i} of shape {list(arg.shape)} with "
                    f"placements {list(arg.placements)} needs in_placements, got None"
                )
            if tuple(arg.placements) != tuple(wanted):
                if not redistribute_inputs:
                    raise InvalidPlacementError(
                        f"local_map({name}): argument {i} of shape {list(arg.shape)} has "
                        f"placements {list(arg.placements)} on {mesh} but in_placements wants "
                        f"{list(wanted)}; redistribute it or pass redistribute_inputs=True"
                    )
                arg = arg.redistribute(placements=wanted)
        per_arg.append(local_components(arg))
        is_local.append(True)
    if mesh is None or not any(is_local):
        return func(*args, **kwargs)

    entries = _out_entries(out_placements)
    per_device = []
    for d in range(len(mesh.local_device_ids)):
        local_flat = [v[d] if loc else v for v, loc in zip(per_arg, is_local, strict=True)]
        out = func(*pytree.tree_unflatten(local_flat, tree), **kwargs)
        out_flat, out_tree = pytree.tree_flatten(out)
        if len(out_flat) != len(entries):
            raise InvalidArgumentError(
                f"local_map({name}): out_placements has {len(entries)} entries but the "
                f"function returned {len(out_flat)} values"
            )
        per_device.append(out_flat)
    wrapped = []
    for j, spec in enumerate(entries):
        values = [outs[j] for outs in per_device]
        if isinstance(values[0], DTensor):
            raise ShardwiseTypeError(
                f"local_map({name}): output {j} is a DTensor; the function must return local "
                f"tensors"
            )
        if isinstance(values[0], torch.Tensor):
            if spec is None:
                raise InvalidPlacementError(
                    f"local_map({name}): tensor output {j} of local shape "
                    f"{list(values[0].shape)} needs out_placements, got None"
                )
            wrapped.append(DTensor.from_local(values, mesh, spec))
        else:
            if spec is not None:
                raise InvalidPlacementError(
                    f"local_map({name}): output {j} is a {type(values[0]).__name__}, not a "
                    f"tensor, but out_placements gives it {list(spec)}; use None"
                )
            wrapped.append(values[0])
    return pytree.tree_unflatten(wrapped, out_tree)
