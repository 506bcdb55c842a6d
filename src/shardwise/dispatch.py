"""``__torch_dispatch__`` for DTensor: find the op's sharding, move inputs if allowed, run the
local op once per local component, wrap the outputs.

Sharding decisions (``dispatch_decision``: chosen input placements and output specs with their
metadata; here with the plans of the inputs that move, where the DTensor arguments sit and the
op's hooks that apply) are cached per (op, input specs, static arguments), so a repeated op
costs a flat scan of its arguments for the key (``dispatch_args``), two dictionary lookups (the
op's entry by identity, then its decision), the local kernels (through the op's Python binding
once checked, ``fast_call``) and the wrapping. Hooks (``ops/registry``'s ``OpEntry``) are
resolved per decision: a decision they do not apply to runs without them.
Redistribution of inputs is explicit by default: an op whose inputs would need a collective
raises ``ImplicitRedistributeError`` unless ``allow_implicit_redistribute()`` is on
or autograd's backward is running (gradients of differing placements must be combined).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from .caches import PER_LAYOUT, PER_OP, cached, register
from .components import new_wrapper
from .dispatch_args import dtensor_positions, place, replicate_plain, scan, whole_lists
from .dispatch_decision import (
    Decision,
    complete,
    decide,
    may_widen,
    meta_outputs,
    widen,
    widened,
)
from .dtensor import DTensor, check_partials, set_dispatch_handler
from .errors import (
    ImplicitRedistributeError,
    MeshError,
    OpArgumentError,
    ShardwiseError,
    UnsupportedOpError,
)
from .fast_call import binding as _binding
from .fast_call import checked_call
from .mesh import DeviceMesh
from .op_inputs import communicating, run_moves
from .ops import registry
from .placements import Placement
from .redistribute import compile_plan, plan_redistribute
from .spec import LOW_PRECISION, DTensorSpec, make_tensor_meta
from .torch_compat import (
    DispatchKey,
    OpOverload,
    dispatch_has_kernel_for_dispatch_key,
    is_torch_function_mode_enabled,
)

# ----- the cache: one ``_Op`` per op, one ``_Entry`` per decision --------------------------------

_NOTHING = registry.OpEntry()  # an op with nothing registered


class _Op:
    """Everything dispatch needs to know about one op, found with one dictionary lookup: its
    registry entry (``OpEntry``), which arguments key the cache, whether it writes in place or
    returns a view, its kernel (and the candidate binding, ``fast_call``) and its cached
    decisions (``_Entry`` per input specs and static arguments)."""

    __slots__ = ("func", "entry", "handler", "pre", "hooked", "static_argnum", "static_kwargs",
                 "inplace", "written", "view", "call", "binding", "decisions")

    def __init__(self, func: Any) -> None:
        self.func = func  # keeps ``id(func)``, the key of ``_OPS``, from being reused
        entry = self.entry = registry.registration(func) or _NOTHING
        self.handler = entry.handler
        self.pre = entry.pre
        self.hooked = not (entry.handler is None and entry.pre is None)
        info = entry.schema_info
        self.static_argnum = info.static_argnum if info is not None else 100
        # keyword arguments keyed by value (None: all of them); the rest by type, so that
        # AdamW's ``addcdiv_(value=-step_size)`` reuses one decision across steps
        self.static_kwargs = (frozenset(info.static_kwargkey)
                              if info is not None and info.static_kwargkey is not None else None)
        self.inplace = _is_inplace(func)
        self.written = _written_arguments(func)
        self.view = _is_view(func)
        # the kernel without OpOverload.__call__'s Python frame
        self.call = func._op if type(func) is OpOverload else func
        self.binding = _binding(func)
        self.decisions: dict[tuple, _Entry] = {}


class _Entry:
    """A cached decision ready to run: where the DTensor arguments sit, the plans of the
    inputs that move (and whether any needs communication), the specs the inputs move to,
    the op's hooks that apply to this decision, and the complete output spec(s)."""

    __slots__ = ("decision", "where", "top", "seqs", "moves", "communicates", "moved_self",
                 "moved_written", "moved_specs", "devices", "local_args", "local_call", "post",
                 "direct", "single", "call")

    def __init__(
        self, op: _Op, decision: Decision, specs: list[DTensorSpec], where: tuple,
        args: tuple,
    ) -> None:
        self.decision = decision
        self.where = where
        # positions of the DTensors when all are positional arguments (the common case)
        self.top = tuple(i for i, _ in where) if all(
            isinstance(i, int) and j < 0 for i, j in where
        ) else None
        # the list or tuple arguments that hold the DTensors and nothing else (``cat``,
        # ``stack``, foreach ops): (position, first, stop) of each in the DTensors; the key
        # fixes what the lists hold, so they do on every hit
        self.seqs = None if self.top is not None else whole_lists(where, args)
        targets = decision.input_placements
        self.moves = tuple(  # (input index, plan, the plan compiled for its spec)
            (n, plan, compile_plan(plan, s))
            for n, (s, t) in enumerate(zip(specs, targets, strict=True))
            if s.placements != t and not _no_op(plan := plan_redistribute(s, t), s.mesh)
        )
        self.communicates = communicating(self.moves)
        self.moved_self = targets[0] != specs[0].placements
        # the written arguments that move (every element of a foreach op's written lists, a
        # fused optimizer's states): each must then live where it was written
        self.moved_written = tuple(
            n for n, (w, s, t) in enumerate(zip(where, specs, targets, strict=True))
            if w[0] in op.written and s.placements != t
        )
        self.moved_specs = [
            DTensorSpec(s.mesh, p, s.tensor_meta) for s, p in zip(specs, targets, strict=True)
        ]
        self.devices = specs[0].mesh.local_device_ids
        # hooks are resolved here, once: a decision they do not apply to runs without them
        reg = op.entry
        hooked = not (reg.local_args is None and reg.local_call is None and reg.post is None)
        applies = hooked and (
            reg.applies is None or reg.applies(self.moved_specs, decision.output_specs)
        )
        self.local_args = reg.local_args if applies else None
        self.local_call = reg.local_call if applies else None
        self.post = reg.post if applies else None
        # one kernel call on the components as they are: no per-device loop, no moves, no hook
        self.direct = (
            (self.top is not None or self.seqs is not None)
            and len(self.devices) == 1 and not self.moves and not applies
            and not self.moved_written and not decision.widen
        )
        self.single: DTensorSpec | None = None  # set by ``complete``
        # the op's binding once a call through it was checked (``fast_call``), else None
        self.call = None

    def complete(self, op: _Op, decision: Decision) -> None:
        """Take the decision with its output metadata filled in; note when its output is one
        DTensor that needs no more than wrapping (and marking, for a view): not in place, and
        not float16/bfloat16 (whose components ``_wrap_one`` casts to the held dtype)."""
        self.decision = decision
        out = decision.output_specs
        for spec in out if isinstance(out, (tuple, list)) else (out,):
            if spec is not None:
                check_partials(spec)
        if isinstance(out, DTensorSpec) and not (
            decision.multi_output or op.inplace or out.tensor_meta.dtype in LOW_PRECISION
        ):
            self.single = out


# Read without a lock (a dict lookup is atomic); a new entry (op or decision) is built
# completely by the thread that missed and published with one assignment under ``_publish``,
# unless the registry or a ``clear_sharding_cache`` changed the generation meanwhile (the entry
# could be stale).
_OPS: dict[int, _Op] = {}  # by ``id(func)``: OpOverload hashes in Python
_publish = threading.Lock()
_generation = [0]
# Decisions kept, over all ops: a variable sequence length makes new shapes, new keys, so the
# cache is bounded. Past the bound the oldest published decision goes (oldest first, which keeps
# the hit path free of bookkeeping); one still in use is decided again on its next call.
DECISION_CACHE_SIZE = PER_LAYOUT
_published: dict[tuple[_Op, tuple], None] = {}  # (op, key) in publishing order
# [hits, misses] of the decision cache since the last clear_sharding_cache: calls that found
# their decision, and calls that decided (counted without a lock: exact in one thread, a
# count may be lost when rank threads race)
_stats = [0, 0]


def clear_sharding_cache() -> None:
    """Forget every cached sharding decision (and the hit and miss counts)."""
    with _publish:
        _generation[0] += 1
        _OPS.clear()
        _published.clear()
        _stats[:] = [0, 0]


def decision_cache_stats() -> tuple[int, int]:
    """(hits, misses) of the sharding-decision cache since it was last cleared: op calls on
    DTensors that found their decision cached, and those that decided it."""
    return _stats[0], _stats[1]


registry.on_registry_change(clear_sharding_cache)
register("shardwise.dispatch sharding decisions", clear_sharding_cache)


def _no_op(plan: Any, mesh: DeviceMesh) -> bool:
    """A plan of local steps over mesh dims of size 1 (and no change of component dtype)
    leaves every component as it is."""
    return plan.cast is None and all(
        s.collective == "local" and isinstance(s.mesh_dim, int) and mesh.shape[s.mesh_dim] == 1
        for s in plan.steps
    )


def _op_entry(func: Any) -> _Op:
    generation = _generation[0]
    op = _Op(func)
    with _publish:
        if _generation[0] == generation:
            op = _OPS.setdefault(id(func), op)
    return op


# ----- running -------------------------------------------------------------------------------


def dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    """The DTensor ``__torch_dispatch__`` entry point (hooks, then sharded execution)."""
    return _torch_dispatch(DTensor, func, (), args, kwargs)


def _torch_dispatch(
    cls: type, func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None
) -> Any:
    """``DTensor.__torch_dispatch__`` itself (``set_dispatch_handler``): the op's entry by
    identity, its handler or pre-patch, the key of the arguments, the cached decision, then
    one kernel call on one device's components as they are (``direct``) or the general route
    (moves, one call per device), the wrapper and the post-patch."""
    op = _OPS.get(id(func))
    if op is None:
        op = _op_entry(func)
    if kwargs is None:
        kwargs = {}
    if op.hooked:
        if op.handler is not None:
            return op.handler(func, args, kwargs)
        args, kwargs = op.pre(func, args, kwargs)
    given = args, kwargs
    key, dtensors, plain = scan(args, kwargs, op.static_argnum, op.static_kwargs)
    if plain:
        args, kwargs = replicate_plain(func, args, kwargs, dtensors[0]._spec.mesh)
        key, dtensors, _ = scan(args, kwargs, op.static_argnum, op.static_kwargs)
    entry = op.decisions.get(key)
    if entry is None:  # this thread decides, fills in and publishes its own entry
        _stats[1] += 1
        return _dispatch_cold(op, func, args, kwargs, key, dtensors, given)
    _stats[0] += 1
    if op.inplace:
        _check_write_reaches_base(
            func, dtensors[0], entry.moved_self, entry.decision.input_placements[0]
        )
    if entry.direct:
        result = _call_direct(op, args, kwargs, entry, dtensors)
        out = _finish(op, entry, [result], None, dtensors)
    else:
        out = _finish(op, entry, *_run_local(op, func, args, kwargs, entry, dtensors), dtensors)
    return out if entry.post is None else entry.post(func, out, *given)


def _dispatch_cold(
    op: _Op, func: Any, args: tuple, kwargs: dict, key: tuple, dtensors: list[DTensor],
    given: tuple[tuple, dict],
) -> Any:
    """A call whose decision is not cached: decide, run (trying the op's binding), complete
    the decision's output metadata and publish it."""
    specs = [d._spec for d in dtensors]
    mesh = specs[0].mesh
    for d in dtensors:
        if d.device_mesh != mesh:
            raise MeshError(
                f"{func} got DTensors on different meshes: {mesh} and {d.device_mesh} "
                f"(shapes {[list(x.shape) for x in dtensors]})"
            )
    if not (op.entry.propagates or op.entry.keeps_input_spec) and _composite(func):
        # under inference_mode a composite op (aten.linear) reaches dispatch undecomposed:
        # its decomposition runs, as in PyTorch
        return func.decompose(*args, **kwargs)
    if not dtensors[0]._components:
        return _outside_mesh(op, func, args, kwargs, dtensors)
    generation = _generation[0]
    with _argument_errors(func, specs):
        decision = decide(func, op.entry, args, kwargs, specs)
    where = dtensor_positions(args, kwargs)
    if may_widen(decision, specs):
        decision = widen(func, args, kwargs, where, specs, decision)
    entry = _Entry(op, decision, specs, where, args)
    if op.inplace:
        _check_write_reaches_base(func, dtensors[0], entry.moved_self, decision.input_placements[0])
    with _argument_errors(func, specs):
        results, components = _run_local(op, func, args, kwargs, entry, dtensors, check=True)
    entry.complete(op, complete(
        func, args, kwargs, where, entry.moved_specs, decision, results[0]
    ))
    _publish_entry(op, key, entry, generation)
    out = _finish(op, entry, results, components, dtensors)
    return out if entry.post is None else entry.post(func, out, *given)


def _composite(func: Any) -> bool:
    """``func`` has a CompositeImplicitAutograd kernel (a decomposition into other ops)."""
    name = getattr(func, "name", None)
    return callable(name) and dispatch_has_kernel_for_dispatch_key(
        name(), DispatchKey.CompositeImplicitAutograd
    )


def _publish_entry(op: _Op, key: tuple, entry: _Entry, generation: int) -> None:
    """Cache ``entry`` unless the caches were cleared since ``generation``; past
    ``DECISION_CACHE_SIZE`` the oldest published decision goes."""
    with _publish:
        if _generation[0] != generation:
            return
        if key not in op.decisions:
            _published[op, key] = None
            if len(_published) > DECISION_CACHE_SIZE:
                old_op, old_key = next(iter(_published))
                del _published[old_op, old_key]
                old_op.decisions.pop(old_key, None)
        op.decisions[key] = entry


def _outside_mesh(op: _Op, func: Any, args: tuple, kwargs: dict, dtensors: list[DTensor]) -> Any:
    """An op on a process that owns no device of the DTensors' mesh (PyTorch's
    non-participating rank): the outputs' placements are decided and their global metadata
    found on the meta device, as everywhere, but nothing runs and nothing is held."""
    specs = [d._spec for d in dtensors]
    with _argument_errors(func, specs):
        decision = decide(func, op.entry, args, kwargs, specs)
        if func is torch.ops.aten.equal.default:  # no meta kernel; PyTorch's answer here
            return True
        metas = meta_outputs(func, args, kwargs, dtensor_positions(args, kwargs), specs)
    if op.inplace:
        return dtensors[0]
    multi = isinstance(metas, (tuple, list))
    meta_list = list(metas) if multi else [metas]
    outs = decision.output_specs
    spec_list = list(outs) if isinstance(outs, (tuple, list)) else [outs] * len(meta_list)
    results = [
        DTensor([], DTensorSpec(s.mesh, s.placements, make_tensor_meta(m)))
        if s is not None and isinstance(m, torch.Tensor)
        else (torch.empty(0, dtype=m.dtype) if isinstance(m, torch.Tensor) else m)
        for s, m in zip(spec_list, meta_list, strict=True)
    ]
    return tuple(results) if multi else results[0]


@contextlib.contextmanager
def _argument_errors(func: Any, specs: list[DTensorSpec]) -> Iterator[None]:
    """Torch's own rejection of an op's operands (a plain ``RuntimeError``: shapes that do not
    broadcast, dtypes that do not mix) raised as ``OpArgumentError`` naming the global shapes,
    placements and mesh, where torch's message names the local pieces at best."""
    try:
        yield
    except RuntimeError as err:
        if isinstance(err, (ShardwiseError, NotImplementedError, torch.OutOfMemoryError)):
            raise
        shapes = [list(s.tensor_meta.shape) for s in specs]
        placements = [list(s.placements) for s in specs]
        raise OpArgumentError(
            f"{func} cannot take DTensors of shapes {shapes} with placements {placements} on "
            f"{specs[0].mesh}: {err}"
        ) from err


def _call_direct(op: _Op, args: tuple, kwargs: dict, entry: _Entry, dtensors: list) -> Any:
    """One kernel call on the components as they are (one device, nothing moves, no hook)."""
    a = list(args)
    call = entry.call
    if entry.top is None:  # the DTensors fill list arguments
        for pos, first, stop in entry.seqs:
            seq = [d._components[0] for d in dtensors[first:stop]]
            for c in seq:
                if type(c) is not _Tensor:  # a tensor subclass: the boxed call, as checked
                    call = None
            a[pos] = seq if type(args[pos]) is list else tuple(seq)
    else:
        for pos, d in zip(entry.top, dtensors, strict=True):
            c = a[pos] = d._components[0]
            if type(c) is not _Tensor:  # a tensor subclass: the boxed call, as checked
                call = None
    if call is None or _function_mode():
        call = op.call
    return call(*a, **kwargs) if kwargs else call(*a)


def _run_local(
    op: _Op, func: Any, args: tuple, kwargs: dict, entry: _Entry, dtensors: list[DTensor],
    check: bool = False,
) -> tuple[list, list]:
    """The inputs moved, then the op run once per local device on that device's components:
    (results, components). ``check``: the first device's call tries the op's binding
    (``fast_call``) and the entry keeps it if it held."""
    if entry.moves:
        components = run_moves(func, dtensors, entry.moves, entry.communicates)
    else:
        components = [d._components for d in dtensors]
    call = entry.call
    if call is None or _function_mode() or any(type(c[0]) is not _Tensor for c in components):
        call = op.call  # the boxed call, as checked (components of one input share a type)
    local_call = entry.local_call
    check = check and local_call is None
    results = []
    for k, device in enumerate(entry.devices):
        a, kw = _device_args(args, kwargs, entry, components, k, device)
        if local_call is not None:
            result = local_call(call, a, kw, entry.moved_specs, entry.decision.output_specs, device)
        elif check:
            check = False
            result, bound = checked_call(op.func, op.binding, a, kw)
            if bound:
                entry.call = op.binding
        else:
            result = call(*a, **kw)
        results.append(result)
    return results, components


def _device_args(
    args: tuple, kwargs: dict, entry: _Entry, components: list, k: int, device: int
) -> tuple[tuple, dict]:
    """The arguments of the ``k``-th local device (id ``device``): its components in place of
    the DTensors, in float32 if the decision widens, through the op's local-args hook."""
    if entry.top is not None:
        a = list(args)
        for pos, comps in zip(entry.top, components, strict=True):
            a[pos] = comps[k]
        kw = kwargs
    elif entry.seqs is not None:
        a = list(args)
        for pos, first, stop in entry.seqs:
            pieces = [comps[k] for comps in components[first:stop]]
            a[pos] = pieces if type(args[pos]) is list else tuple(pieces)
        kw = kwargs
    else:
        a, kw = place(args, kwargs, entry.where, [comps[k] for comps in components])
    if entry.decision.widen:
        a, kw = widened(a, kw)
    if entry.local_args is not None:
        return entry.local_args(
            tuple(a), kw, entry.moved_specs, entry.decision.output_specs, device
        )
    return tuple(a), kw


def _finish(
    op: _Op, entry: _Entry, results: list, components: list | None, dtensors: list[DTensor]
) -> Any:
    """Update each written argument the op moved (``components``: the moved inputs) and wrap
    the outputs, marked as views for a view op (one that needs no more than wrapping
    directly)."""
    if entry.moved_written:
        _rehome_written(entry, dtensors, components)
    # a view op's outputs: whether they alias a temporary copy of a moved input (writes lost)
    orphan = (entry.moved_self or dtensors[0].__dict__.get("_view_orphan", False)
              if op.view else None)
    spec = entry.single
    if spec is not None and isinstance(results[0], _Tensor):
        return _new_dtensor(results, spec, orphan)
    return _wrap(op.func, entry.decision, results, dtensors, op.inplace, orphan)


def _rehome_written(entry: _Entry, dtensors: list[DTensor], components: list) -> None:
    """The op needed a written argument elsewhere: it now lives there (same global value,
    updated)."""
    for n in entry.moved_written:
        written = dtensors[n]
        written._components = components[n]
        written._spec = entry.moved_specs[n]


def _check_write_reaches_base(
    func: Any, target: DTensor, moved: bool, placements: tuple[Placement, ...]
) -> None:
    """An in-place write into a view must reach the viewed DTensor: refuse it when the view
    aliases a moved copy, or when the view itself would have to move first."""
    orphan = target.__dict__.get("_view_orphan")  # None: not a view
    if orphan or (moved and orphan is not None):
        raise UnsupportedOpError(
            f"in-place {func} writes into a view (shape {list(target.shape)}, placements "
            f"{list(target.placements)}) of a DTensor that had to be redistributed for the view "
            f"or the write (to {list(placements)}), so the viewed DTensor would not see the write"
            f"; redistribute the viewed DTensor first or write out of place"
        )


def _wrap(
    func: Any, decision: Decision, local_results: list, inputs: list[DTensor], inplace: bool,
    orphan: bool | None,
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
            _wrap_one(s, [r[i] for r in local_results], orphan) for i, s in enumerate(specs)
        )
    return _wrap_one(decision.output_specs, local_results, orphan)


def _wrap_one(spec: DTensorSpec | None, components: list, orphan: bool | None) -> Any:
    if spec is None or not isinstance(components[0], torch.Tensor):
        return components[0]
    held = spec.component_dtype  # float32 while a half-precision sum is pending
    if components[0].dtype != held and components[0].dtype.is_floating_point:
        components = [c.to(held) for c in components]
    return _new_dtensor(components, spec, orphan)


_Tensor = torch.Tensor
_function_mode = is_torch_function_mode_enabled  # bindings would call into it


def _new_dtensor(components: list[torch.Tensor], spec: DTensorSpec, orphan: bool | None) -> DTensor:
    """The one place dispatch builds an output DTensor: ``DTensor(components, spec)`` for a
    fresh list of components in the held dtype and a cached output spec whose Partials were
    checked (``_Entry.complete``), made directly. ``orphan``: None for an op that is not a
    view, else whether the view aliases a temporary copy (``_view_orphan`` present marks a
    view)."""
    out = new_wrapper(DTensor, spec, components[0].device, False, components)
    out._components = components
    if orphan is not None:
        out._view_orphan = orphan
    return out


@cached(PER_OP)  # one entry per op overload
def _is_view(func: Any) -> bool:
    """An op whose output aliases its input (``view``, ``select``, ``transpose``...)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


@cached(PER_OP)  # one entry per op overload
def _written_arguments(func: Any) -> frozenset:
    """The positions and names of the arguments the op writes (its schema's ``(a!)``)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return frozenset()
    return frozenset(
        key
        for i, arg in enumerate(schema.arguments)
        if arg.alias_info is not None and arg.alias_info.is_write
        for key in ((arg.name,) if arg.kwarg_only else (i, arg.name))
    )


@cached(PER_OP)  # one entry per op overload
def _is_inplace(func: Any) -> bool:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False
    name = schema.name.split("::")[-1]
    return name.endswith("_") and schema.arguments and schema.arguments[0].alias_info is not None


set_dispatch_handler(_torch_dispatch)

__all__ = ["clear_sharding_cache", "dispatch"]
