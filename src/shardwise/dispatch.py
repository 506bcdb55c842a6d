"""``__torch_dispatch__`` for DTensor: find the op's sharding, move inputs if allowed, run the
local op once per local component, wrap the outputs.

Sharding decisions (chosen input placements and output specs with their metadata) are cached per
(op, input specs, static arguments), so a repeated op costs a dictionary lookup plus the local
kernels. Redistribution of inputs is explicit by default: an op whose inputs would need a
collective raises ``ImplicitRedistributeError`` unless ``allow_implicit_redistribute()`` is on
or autograd's backward is running (gradients of differing placements must be combined).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import sys
import threading
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from . import settings
from .dtensor import DTensor, distribute_tensor, set_dispatch_handler
from .errors import ImplicitRedistributeError, MeshError, UnsupportedOpError
from .mesh import DeviceMesh
from .ops import registry
from .ops.registry import OpSchema, OpStrategy, OutputSharding, PlacementStrategy
from .placements import Placement, Replicate
from .redistribute import RedistributePlan, execute_plan, plan_redistribute
from .spec import LOW_PRECISION, DTensorSpec, make_tensor_meta, pending_sum

aten = torch.ops.aten
log = logging.getLogger("shardwise.redistribute")


# ----- implicit redistribution settings (per context: see ``settings``) ------------------------


def set_implicit_redistribute(enabled: bool) -> None:
    """Process-wide: allow (True) or forbid (False, the default) implicit redistribution."""
    settings.IMPLICIT_REDISTRIBUTE.set_default(bool(enabled))


@contextlib.contextmanager
def allow_implicit_redistribute(enabled: bool = True) -> Iterator[None]:
    """Within the block (this thread only), ops may redistribute their inputs themselves."""
    with settings.IMPLICIT_REDISTRIBUTE.override(bool(enabled)):
        yield


def set_redistribute_logging(enabled: bool) -> None:
    """Log every redistribution an op makes, with the user's call site, to
    the ``shardwise.redistribute`` logger (level INFO)."""
    settings.LOG_REDISTRIBUTE.set_default(bool(enabled))


# ----- decisions -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """How one op call runs: target placements per DTensor input and the output spec(s)."""

    input_placements: tuple[tuple[Placement, ...], ...]
    output_specs: Any  # DTensorSpec | tuple[DTensorSpec | None, ...] | None
    multi_output: bool
    # the local kernels run in float32: an output is a float16/bfloat16 sum left pending
    widen: bool = False


# Read without a lock (a dict lookup is atomic); a new entry is built completely by the thread
# that missed and published with one assignment under ``_publish``, unless the registry or a
# ``clear_sharding_cache`` changed the generation meanwhile (the entry could be stale).
_cache: dict[Any, Decision] = {}
_publish = threading.Lock()
_generation = [0]


def clear_sharding_cache() -> None:
    """Forget every cached sharding decision."""
    with _publish:
        _generation[0] += 1
        _cache.clear()


registry.on_registry_change(clear_sharding_cache)


def _key_part(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_key_part(v) for v in value)
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, (int, float, bool, str, type(None), torch.dtype, torch.device)):
        return value
    if isinstance(value, (torch.memory_format, torch.layout)):
        return str(value)
    return ("obj", type(value).__name__, id(value))


def _cache_key(func: Any, args: tuple, kwargs: dict, specs: list[DTensorSpec]) -> Any:
    reg = registry.registration(func)
    info = reg.schema_info if reg is not None else None
    static_argnum = info.static_argnum if info else 100
    parts = []
    for i, a in enumerate(args):
        if isinstance(a, DTensor):
            parts.append("D")
        elif i >= static_argnum:
            parts.append(_key_part(a))
        else:
            parts.append(type(a).__name__ if not isinstance(a, (list, tuple)) else _key_part(
                [type(x).__name__ if not isinstance(x, DTensor) else "D" for x in a]
            ))
    # keyword arguments (dtype, device, keepdim...) decide output metadata: key them all
    kw = tuple(sorted((k, _key_part(v)) for k, v in kwargs.items()))
    return (func, tuple(specs), tuple(parts), kw)


def _to_schema(func: Any, args: tuple, kwargs: dict, convert) -> OpSchema:
    reg = registry.registration(func)
    conv = pytree.tree_map_only(DTensor, convert, (args, kwargs))
    return OpSchema(func, tuple(conv[0]), dict(conv[1]), reg.schema_info if reg else None)


def _decide(func: Any, args: tuple, kwargs: dict, specs: list[DTensorSpec]) -> Decision:
    reg = registry.registration(func)
    if func in registry.BYPASS_PROPAGATION:
        return Decision(tuple(s.placements for s in specs), specs[0], False)
    if reg is None:
        raise UnsupportedOpError(
            f"{func} has no sharding rule or strategy for DTensor inputs "
            f"{[list(s.placements) for s in specs]}; register one with "
            f"shardwise.register_op_strategy([{func}]) or shardwise.register_prop_rule(...), "
            f"or handle it with shardwise.bypass_dispatch"
        )
    if reg.strategy is not None:
        schema = _to_schema(
            func, args, kwargs, lambda d: OpStrategy([PlacementStrategy(d._spec)])
        )
        chosen = _choose(func, reg.strategy(specs[0].mesh, schema), specs)
        inputs = chosen.input_specs if chosen.input_specs is not None else specs
        outputs = chosen.output_specs
    else:
        schema = _to_schema(func, args, kwargs, lambda d: d._spec)
        result: OutputSharding = reg.rule(schema)
        inputs = specs
        if result.redistribute_schema is not None:
            inputs = result.redistribute_schema.args_spec
            if result.output_spec is None:
                result = reg.rule(result.redistribute_schema)
        outputs = result.output_spec
    if len(inputs) != len(specs):
        raise UnsupportedOpError(
            f"the sharding of {func} gave {len(inputs)} input specs for {len(specs)} DTensor inputs"
        )
    schema_returns = getattr(getattr(func, "_schema", None), "returns", [])
    return Decision(tuple(tuple(s.placements) for s in inputs), outputs, len(schema_returns) > 1)


def _move_cost(spec: DTensorSpec, target: Sequence[Placement]) -> tuple[int, int]:
    if tuple(target) == spec.placements:
        return 0, 0
    plan = plan_redistribute(spec, tuple(target))
    return plan.global_bytes, sum(s.collective != "local" for s in plan.steps)


def _choose(func: Any, strategy: OpStrategy, specs: list[DTensorSpec]) -> PlacementStrategy:
    """The strategy cheapest to reach from the actual input specs (bytes, then collectives)."""
    best, best_cost = None, None
    for candidate in strategy.strategies:
        inputs = candidate.input_specs if candidate.input_specs is not None else specs
        if len(inputs) != len(specs):
            continue
        cost = (0, 0, 0)  # bytes, collectives, placements changed (ties keep inputs in place)
        for spec, want in zip(specs, inputs, strict=True):
            moved = _move_cost(spec, want.placements)
            changed = sum(a != b for a, b in zip(want.placements, spec.placements, strict=True))
            cost = (cost[0] + moved[0], cost[1] + moved[1], cost[2] + changed)
        if best_cost is None or cost < best_cost:
            best, best_cost = candidate, cost
    if best is None:
        raise UnsupportedOpError(
            f"{func} has no sharding strategy for inputs {[list(s.placements) for s in specs]} "
            f"of shapes {[list(s.shape) for s in specs]}"
        )
    return best


# ----- running -------------------------------------------------------------------------------


def _flatten(args: tuple, kwargs: dict) -> tuple[list, tuple]:
    """Flatten aten arguments one level deep (aten schemas nest tensors only in lists), much
    cheaper than pytree on the hot path."""
    flat: list = []
    layout: list = []
    for a in args:
        if type(a) in (list, tuple):
            flat.extend(a)
            layout.append((type(a), len(a)))
        else:
            flat.append(a)
            layout.append(None)
    flat.extend(kwargs.values())
    return flat, (tuple(layout), tuple(kwargs))


def _unflatten(flat: list, tree: tuple) -> tuple[tuple, dict]:
    layout, keys = tree
    args, i = [], 0
    for entry in layout:
        if entry is None:
            args.append(flat[i])
            i += 1
        else:
            kind, n = entry
            args.append(kind(flat[i : i + n]))
            i += n
    return tuple(args), dict(zip(keys, flat[i:], strict=True))



def _call_site() -> str:
    for frame in reversed(traceback.extract_stack()[:-3]):
        name = frame.filename
        if "shardwise" not in name and "torch" not in name:
            return f"{name}:{frame.lineno}"
    return "<unknown>"


def redistribute_inputs(
    func: Any, dtensors: Sequence[DTensor], targets: Sequence[Sequence[Placement]]
) -> list[list[torch.Tensor]]:
    """The components of ``dtensors`` moved to ``targets`` (one placement tuple each), as an op
    ``func`` moves its inputs: a move that needs communication raises
    ``ImplicitRedistributeError`` unless ``allow_implicit_redistribute()`` is on or autograd's
    backward runs. For handlers registered with ``bypass_dispatch``."""
    dtensors = list(dtensors)
    targets = tuple(tuple(t) for t in targets)
    if all(dt._spec.placements == t for dt, t in zip(dtensors, targets, strict=True)):
        return [dt._components for dt in dtensors]
    plans: list[RedistributePlan | None] = []
    for dt, target in zip(dtensors, targets, strict=True):
        plans.append(None if dt._spec.placements == target else plan_redistribute(dt._spec, target))
    moving = [
        (i, p) for i, p in enumerate(plans) if p is not None and any(
            s.collective != "local" for s in p.steps
        )
    ]
    in_backward = torch._C._current_graph_task_id() != -1
    if moving and not settings.IMPLICIT_REDISTRIBUTE.get() and not in_backward:
        lines = []
        for i, p in moving:
            dt = dtensors[i]
            lines.append(
                f"  input {i}: shape {list(dt.shape)}, placements {list(dt.placements)} -> "
                f"{list(p.target)} (needs {[s.collective for s in p.steps]}); call "
                f"x.redistribute(placements={list(p.target)}) on it first"
            )
        raise ImplicitRedistributeError(
            f"{func} on {dtensors[0].device_mesh} needs its inputs redistributed:\n"
            + "\n".join(lines)
            + "\nor allow it with `with shardwise.allow_implicit_redistribute():`"
        )
    components = []
    for dt, plan in zip(dtensors, plans, strict=True):
        if plan is None:
            components.append(dt._components)
            continue
        if settings.LOG_REDISTRIBUTE.get() and any(s.collective != "local" for s in plan.steps):
            log.info(
                "%s redistributes %s: %s at %s", func, list(dt.shape), plan.steps, _call_site()
            )
        components.append(execute_plan(plan, dt._spec.mesh, dt._components))
    return components


def _meta_outputs(func: Any, flat: list, tree: Any, dtensors_at: list[int], specs) -> Any:
    metas = list(flat)
    for i, spec in zip(dtensors_at, specs, strict=True):
        m = spec.tensor_meta
        metas[i] = torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta")
    for i, a in enumerate(metas):
        if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and a.device.type != "meta":
            metas[i] = a.to("meta")
    args, kwargs = _unflatten(metas, tree)
    return func(*args, **kwargs)


def _fill_meta(spec: DTensorSpec | None, meta_out: Any, local_out: Any) -> DTensorSpec | None:
    if spec is None or not isinstance(local_out, torch.Tensor):
        return None
    if spec.is_replicated() and spec.tensor_meta is None:
        return DTensorSpec(spec.mesh, spec.placements, make_tensor_meta(local_out))
    if isinstance(meta_out, torch.Tensor):
        return DTensorSpec(spec.mesh, spec.placements, make_tensor_meta(meta_out))
    return spec


def dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    """The DTensor ``__torch_dispatch__`` entry point (hooks, then sharded execution)."""
    bypass = registry.BYPASS_DISPATCH.get(func)
    if bypass is not None:
        return bypass(func, args, kwargs)
    pre = registry.PRE_PATCH.get(func)
    if pre is not None:
        args, kwargs = pre(func, args, kwargs)
    result = _dispatch(func, args, kwargs)
    post = registry.POST_PATCH.get(func)
    if post is not None:
        result = post(func, result, args, kwargs)
    return result


SMALL_CONSTANT_NUMEL = 16


@contextlib.contextmanager
def implicit_replication(enabled: bool = True) -> Iterator[None]:
    """Within the block, plain tensors mixed with DTensors are taken as replicated global
    values (PyTorch's ``implicit_replication``), e.g. masks that decompositions create."""
    with settings.IMPLICIT_REPLICATION.override(bool(enabled)):
        yield


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIR = os.path.dirname(__file__) + os.sep


def _holds(values: Any, tensor: torch.Tensor) -> bool:
    """True if ``tensor`` is one of ``values`` or inside one of their lists, tuples, dicts."""
    for v in values:
        if v is tensor:
            return True
        if isinstance(v, (list, tuple)) and any(x is tensor for x in v):
            return True
        if isinstance(v, dict) and any(x is tensor for x in v.values()):
            return True
        if isinstance(v, torch.nn.Module) and any(
            x is tensor for x in (*v._parameters.values(), *v._buffers.values())
        ):
            return True
    return False


def made_by_torch(tensor: torch.Tensor) -> bool:
    """True if a plain tensor reaching dispatch was made by torch's own decomposition of the
    op the user called (SDPA's causal mask, ``masked.var``'s count, fractional max pooling's
    samples), not passed by the user: it is neither a variable of the user's calling frame
    nor an argument the user gave the torch function running the decomposition, nor a
    parameter or buffer of a module in reach, nor a tensor that requires grad."""
    if tensor.requires_grad or isinstance(tensor, torch.nn.Parameter):
        return False
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_OWN_DIR):
        frame = frame.f_back
    entry = None  # the outermost torch frame: the torch function the user called
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH_DIR):
        entry, frame = frame, frame.f_back
    if entry is not None:
        code = entry.f_code
        n_args = code.co_argcount + code.co_kwonlyargcount
        n_args += bool(code.co_flags & inspect.CO_VARARGS) + bool(
            code.co_flags & inspect.CO_VARKEYWORDS
        )
        names = code.co_varnames[:n_args]
        return not _holds([entry.f_locals.get(n) for n in names], tensor)
    # the user's code called an op (or a C++ composite) directly: its variables are its own
    return frame is not None and not (
        _holds(frame.f_locals.values(), tensor) or _holds(frame.f_globals.values(), tensor)
    )


def implicitly_replicated(func: Any, tensor: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """A plain tensor among DTensor arguments is taken as replicated when it is a small
    constant (TF DTensor's rule), when autograd's backward or one of torch's decompositions
    made it (``made_by_torch``), or inside ``implicit_replication()``; otherwise (the user's
    own tensor) it is refused."""
    if (
        tensor.numel() > SMALL_CONSTANT_NUMEL
        and torch._C._current_graph_task_id() == -1
        and not settings.IMPLICIT_REPLICATION.get()
        and not made_by_torch(tensor)
    ):
        raise MeshError(
            f"{func} mixes DTensors with a plain torch.Tensor of shape {list(tensor.shape)}; "
            f"distribute it first (shardwise.distribute_tensor(t, {mesh}, placements)) or "
            f"take it as replicated inside `with shardwise.implicit_replication():`"
        )
    return distribute_tensor(tensor, mesh, [Replicate()] * mesh.ndim, src_data_rank=None)


def _dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    flat, tree = _flatten(args, kwargs)
    dtensors_at, plain = [], []
    for i, a in enumerate(flat):
        if isinstance(a, DTensor):
            dtensors_at.append(i)
        elif isinstance(a, torch.Tensor) and a.ndim > 0:
            plain.append(i)
    mesh = flat[dtensors_at[0]].device_mesh
    if plain:
        for i in plain:
            flat[i] = implicitly_replicated(func, flat[i], mesh)
        args, kwargs = _unflatten(flat, tree)
        dtensors_at = sorted(dtensors_at + plain)
    dtensors: list[DTensor] = [flat[i] for i in dtensors_at]
    specs = [d._spec for d in dtensors]
    for d in dtensors:
        if d.device_mesh != mesh:
            raise MeshError(
                f"{func} got DTensors on different meshes: {mesh} and {d.device_mesh} "
                f"(shapes {[list(x.shape) for x in dtensors]})"
            )

    key = _cache_key(func, args, kwargs, specs)
    decision = _cache.get(key)
    fresh = decision is None  # this thread decides, fills in and publishes its own entry
    if fresh:
        generation = _generation[0]
        decision = _decide(func, args, kwargs, specs)
        if _may_widen(decision, specs):
            decision = _widen(func, flat, tree, dtensors_at, specs, decision)
    moved_self = decision.input_placements[0] != specs[0].placements
    inplace = _is_inplace(func)
    if inplace:
        _check_write_reaches_base(func, dtensors[0], moved_self, decision.input_placements[0])
    components = redistribute_inputs(func, dtensors, decision.input_placements)

    local_args = registry.LOCAL_ARGS.get(func)
    if local_args is not None:
        moved = [
            DTensorSpec(s.mesh, p, s.tensor_meta)
            for s, p in zip(specs, decision.input_placements, strict=True)
        ]
    local_results = []
    for k, device in enumerate(mesh.local_device_ids):
        local_flat = list(flat)
        for pos, comps in zip(dtensors_at, components, strict=True):
            local_flat[pos] = comps[k]
        if decision.widen:
            local_flat = [_in_float32(x) for x in local_flat]
        a, kw = _unflatten(local_flat, tree)
        if decision.widen and kw.get("dtype") in LOW_PRECISION:
            kw["dtype"] = torch.float32
        if local_args is not None:
            a, kw = local_args(a, kw, moved, decision.output_specs, device)
        local_results.append(func(*a, **kw))

    if fresh:
        decision = _complete(func, flat, tree, dtensors_at, specs, decision, local_results[0])
        with _publish:
            if _generation[0] == generation:
                _cache[key] = decision
    if inplace and moved_self:
        # the op needed self elsewhere: self now lives there (same global value, updated)
        dtensors[0]._components = components[0]
        dtensors[0]._spec = DTensorSpec(mesh, decision.input_placements[0], specs[0].tensor_meta)
    result = _wrap(func, decision, local_results, dtensors, inplace)
    if _is_view(func):
        # a view of a moved input aliases a temporary copy, not the input: writes would be lost
        orphan = moved_self or getattr(dtensors[0], "_orphan_view", False)
        for out in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(out, DTensor):
                out._is_view_of_dtensor = True
                out._orphan_view = orphan
    return result


def _pending_sum(spec: Any) -> bool:
    return isinstance(spec, DTensorSpec) and pending_sum(spec.placements)


def _may_widen(decision: Decision, specs: list[DTensorSpec]) -> bool:
    """Cheap test: a half-precision input and an output left pending a sum."""
    outs = decision.output_specs
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    return any(s.tensor_meta.dtype in LOW_PRECISION for s in specs) and any(
        _pending_sum(s) for s in outs
    )


def _widen(func, flat, tree, dtensors_at, specs, decision: Decision) -> Decision:
    """Mark the decision to run its local kernels in float32 when an output pending a sum is
    float16/bfloat16 (its components are held in float32, ``DTensorSpec.component_dtype``):
    each device's piece is then what torch's float32 accumulation gives before its one
    rounding, which the reduction does. Decided once per cache entry, from a meta run."""
    targets = [
        DTensorSpec(s.mesh, p, s.tensor_meta)
        for s, p in zip(specs, decision.input_placements, strict=True)
    ]
    meta = _meta_outputs(func, flat, tree, dtensors_at, targets)
    metas = meta if isinstance(meta, (tuple, list)) else (meta,)
    outs = decision.output_specs
    outs = outs if isinstance(outs, (tuple, list)) else (outs,) * len(metas)
    widen = any(
        _pending_sum(s) and isinstance(m, torch.Tensor) and m.dtype in LOW_PRECISION
        for s, m in zip(outs, metas, strict=False)
    )
    return dataclasses.replace(decision, widen=widen)


def _in_float32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in LOW_PRECISION:
        return value.float()
    return value


def _check_write_reaches_base(
    func: Any, target: DTensor, moved: bool, placements: tuple[Placement, ...]
) -> None:
    """An in-place write into a view must reach the viewed DTensor: refuse it when the view
    aliases a moved copy, or when the view itself would have to move first."""
    if getattr(target, "_orphan_view", False) or (
        moved and getattr(target, "_is_view_of_dtensor", False)
    ):
        raise UnsupportedOpError(
            f"in-place {func} writes into a view (shape {list(target.shape)}, placements "
            f"{list(target.placements)}) of a DTensor that had to be redistributed for the view "
            f"or the write (to {list(placements)}), so the viewed DTensor would not see the write"
            f"; redistribute the viewed DTensor first or write out of place"
        )


def _complete(func, flat, tree, dtensors_at, specs, decision: Decision, first: Any) -> Decision:
    """Fill in output metadata once per cache entry (meta run unless Replicate)."""
    outs = decision.output_specs
    first_list = list(first) if isinstance(first, (tuple, list)) else [first]
    if isinstance(outs, DTensorSpec) or outs is None:
        out_list = [outs] * len(first_list)
    else:
        out_list = list(outs)
    needs_meta = any(
        s is not None and not s.is_replicated() and isinstance(o, torch.Tensor)
        and (len(first_list) > 1 or s.tensor_meta is None)
        for s, o in zip(out_list, first_list, strict=False)
    )
    target_specs = [
        DTensorSpec(s.mesh, p, s.tensor_meta) for s, p in zip(specs, decision.input_placements,
                                                              strict=True)
    ]
    meta = _meta_outputs(func, flat, tree, dtensors_at, target_specs) if needs_meta else None
    meta_list = list(meta) if isinstance(meta, (tuple, list)) else [meta] * len(first_list)
    filled = tuple(
        _fill_meta(s, m, o) for s, m, o in zip(out_list, meta_list, first_list, strict=False)
    )
    multi = isinstance(first, (tuple, list))
    return Decision(
        decision.input_placements, filled if multi else filled[0], multi, decision.widen
    )


def _wrap(
    func: Any, decision: Decision, local_results: list, inputs: list[DTensor], inplace: bool
) -> Any:
    first = local_results[0]
    if isinstance(first, torch.Tensor) and inplace:
        target = inputs[0]
        spec = decision.output_specs
        if spec is not None and spec.placements != target.placements:
            raise ImplicitRedistributeError(
                f"in-place {func} would change the placements of its input of shape "
                f"{list(target.shape)} from {list(target.placements)} to {list(spec.placements)}"
            )
        return target
    if decision.multi_output or isinstance(first, (tuple, list)):
        specs = decision.output_specs
        return type(first)(
            _wrap_one(s, [r[i] for r in local_results]) for i, s in enumerate(specs)
        )
    return _wrap_one(decision.output_specs, local_results)


def _wrap_one(spec: DTensorSpec | None, components: list) -> Any:
    if spec is None or not isinstance(components[0], torch.Tensor):
        return components[0]
    return DTensor(components, spec)


@functools.cache
def _is_view(func: Any) -> bool:
    """An op whose output aliases its input (``view``, ``select``, ``transpose``...)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


@functools.cache
def _is_inplace(func: Any) -> bool:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False
    name = schema.name.split("::")[-1]
    return name.endswith("_") and schema.arguments and schema.arguments[0].alias_info is not None


set_dispatch_handler(dispatch)

__all__ = [
    "implicit_replication",
    "allow_implicit_redistribute",
    "clear_sharding_cache",
    "dispatch",
    "implicitly_replicated",
    "redistribute_inputs",
    "set_implicit_redistribute",
    "set_redistribute_logging",
]
