"""``__torch_dispatch__`` for DTensor: find the op's sharding, move inputs if allowed, run the
local op once per local component, wrap the outputs.

Sharding decisions (chosen input placements and output specs with their metadata, the plans of
the inputs that move, where the DTensor arguments sit) are cached per (op, input specs, static
arguments), so a repeated op costs a flat scan of its arguments for the key, two dictionary
lookups (the op's entry by identity, then its decision), the local kernels (through the op's
Python binding once checked, ``fast_call``) and the wrapping, all in one frame on one device.
Hooks are resolved per decision: a decision they do not apply to runs without them.
Redistribution of inputs is explicit by default: an op whose inputs would need a collective
raises ``ImplicitRedistributeError`` unless ``allow_implicit_redistribute()`` is on
or autograd's backward is running (gradients of differing placements must be combined).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .caches import PER_LAYOUT, PER_OP, cached, register
from .dtensor import DTensor, check_partials, set_dispatch_handler
from .errors import (
    DTensorCollectiveError,
    ImplicitRedistributeError,
    MeshError,
    OpArgumentError,
    ShardwiseError,
    UnsupportedOpError,
)
from .fast_call import binding as _binding
from .fast_call import checked_call
from .mesh import DeviceMesh
from .op_inputs import communicating, implicitly_replicated, run_moves
from .ops import registry
from .ops.registry import OpSchema, OpStrategy, OutputSharding, PlacementStrategy
from .placements import Placement
from .redistribute import compile_plan, plan_redistribute
from .spec import LOW_PRECISION, DTensorSpec, make_tensor_meta, pending_sum
from .torch_compat import OpOverload, is_torch_function_mode_enabled, make_wrapper_subclass, pytree

aten = torch.ops.aten
log = logging.getLogger("shardwise.redistribute")


# ----- implicit redistribution settings (per context: see ``settings``) ------------------------


# ----- decisions -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """How one op call runs: target placements per DTensor input and the output spec(s)."""

    input_placements: tuple[tuple[Placement, ...], ...]
    output_specs: Any  # DTensorSpec | tuple[DTensorSpec | None, ...] | None
    multi_output: bool
    # the local kernels run in float32: an output is a float16/bfloat16 sum left pending
    widen: bool = False


class _Op:
    """Everything dispatch needs to know about one op, found with one dictionary lookup: its
    hooks, which arguments key the cache, whether it writes in place or returns a view, its
    kernel (and the candidate binding, ``fast_call``) and its cached decisions (``_Entry`` per
    input specs and static arguments)."""

    __slots__ = ("func", "bypass", "pre", "post", "hooked", "local_args", "static_argnum",
                 "static_kwargs", "inplace", "written", "view", "call", "binding", "decisions")

    def __init__(self, func: Any) -> None:
        self.func = func  # keeps ``id(func)``, the key of ``_OPS``, from being reused
        self.bypass = registry.BYPASS_DISPATCH.get(func)
        self.pre = registry.PRE_PATCH.get(func)
        self.post = registry.POST_PATCH.get(func)
        self.hooked = not (self.bypass is None and self.pre is None)
        self.local_args = registry.LOCAL_ARGS.get(func)
        reg = registry.registration(func)
        info = reg.schema_info if reg is not None else None
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
                 "moved_written", "moved_specs", "devices", "local_args", "post", "direct",
                 "single", "call")

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
        self.seqs = None if self.top is not None else _whole_lists(where, args)
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
        self.local_args = _applying(
            op.func, op.local_args, registry.LOCAL_ARGS_APPLIES, self.moved_specs, decision
        )
        self.post = _applying(
            op.func, op.post, registry.POST_PATCH_APPLIES, self.moved_specs, decision
        )
        # one kernel call on the components as they are: no per-device loop, no moves, no hook
        self.direct = (
            (self.top is not None or self.seqs is not None)
            and len(self.devices) == 1 and not self.moves
            and self.local_args is None and self.post is None
            and not self.moved_written and not decision.widen
        )
        self.single: DTensorSpec | None = None  # set by ``complete``
        # the op's binding once a call through it was checked (``fast_call``), else None
        self.call = None

    def complete(self, op: _Op, decision: Decision) -> None:
        """Take the decision with its output metadata filled in; note when its output is one
        DTensor that needs no more than wrapping (and marking, for a view): not in place, and
        not float16/bfloat16 (whose components ``DTensor()`` casts to the held dtype)."""
        self.decision = decision
        out = decision.output_specs
        for spec in out if isinstance(out, (tuple, list)) else (out,):
            if spec is not None:
                check_partials(spec)
        if isinstance(out, DTensorSpec) and not (
            decision.multi_output or op.inplace or out.tensor_meta.dtype in LOW_PRECISION
        ):
            self.single = out


def _applying(
    func: Any, hook: Any, applies: dict, specs: list[DTensorSpec], decision: Decision
) -> Any:
    """``hook`` if it applies to the decision (no predicate, or its predicate says so)."""
    if hook is None:
        return None
    when = applies.get(func)
    return hook if when is None or when(specs, decision.output_specs) else None


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


def clear_sharding_cache() -> None:
    """Forget every cached sharding decision."""
    with _publish:
        _generation[0] += 1
        _OPS.clear()
        _published.clear()


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


# argument types keyed by value as they are; floats and bools also by type (1, 1.0 and True
# are equal keys but give different output dtypes)
_ATOMS = frozenset({int, str, type(None), torch.dtype, torch.device})
_TYPED_ATOMS = frozenset({float, bool})


def _key_part(value: Any) -> Any:
    t = type(value)
    if t in _ATOMS:
        return value
    if t in _TYPED_ATOMS:
        return t, value
    if t is list or t is tuple:
        return tuple(_key_part(v) for v in value)
    if isinstance(value, DTensor):
        return value._spec
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, (int, float, str, torch.dtype, torch.device)):
        return t, value
    if isinstance(value, (list, tuple)):
        return tuple(_key_part(v) for v in value)
    if isinstance(value, (torch.memory_format, torch.layout)):
        return str(value)
    return ("obj", t.__name__, id(value))


def _loose_part(value: Any) -> Any:
    """Key of an argument before ``static_argnum``: DTensors by spec, others by type (a
    plain scalar tensor by dtype, which type promotion reads)."""
    if isinstance(value, DTensor):
        return value._spec
    if isinstance(value, torch.Tensor):
        return value.dtype
    return type(value)


_SEQUENCES = (list, tuple)


def _scan(
    args: tuple, kwargs: dict, static_argnum: int, static_kwargs: frozenset | None = None
) -> tuple[tuple, list, bool]:
    """One flat pass over the arguments: the cache key (DTensors by spec, arguments from
    ``static_argnum`` on and keyword arguments in ``static_kwargs`` (all when None) by value,
    the others by type), the DTensors in
    argument order (list elements, then keyword arguments), and whether a plain tensor that
    is not a scalar is among them (it must be replicated first). Types are tested before
    ``isinstance`` (slow on torch.Tensor for numbers)."""
    parts: list = []
    dtensors: list = []
    plain = False
    for i, a in enumerate(args):
        t = type(a)
        if t is DTensor:
            dtensors.append(a)
            parts.append(a._spec)
        elif t in _ATOMS:
            parts.append(a if i >= static_argnum else t)
        elif t in _TYPED_ATOMS:
            parts.append((t, a) if i >= static_argnum else t)
        elif t is list or t is tuple:
            specs = []
            for x in a:  # DTensors only (``cat``, ``stack``): keyed by spec at any position
                if type(x) is not DTensor:
                    break
                specs.append(x._spec)
            else:
                if specs:
                    dtensors.extend(a)
                    parts.append(tuple(specs))
                    continue
            if _ATOMS.issuperset(map(type, a)):  # sizes, dims: no tensors
                parts.append(tuple(a) if i >= static_argnum else tuple(map(type, a)))
                continue
            plain = _collect(a, dtensors) or plain
            parts.append(_key_part(a) if i >= static_argnum else tuple(map(_loose_part, a)))
        elif isinstance(a, DTensor):
            dtensors.append(a)
            parts.append(a._spec)
        elif isinstance(a, torch.Tensor):
            plain = plain or a.ndim > 0
            parts.append(_key_part(a) if i >= static_argnum else a.dtype)
        else:
            parts.append(_key_part(a) if i >= static_argnum else t)
    if kwargs:
        for k, v in kwargs.items():
            if isinstance(v, DTensor):
                dtensors.append(v)
            elif isinstance(v, torch.Tensor):
                plain = plain or v.ndim > 0
            elif type(v) in _SEQUENCES:
                plain = _collect(v, dtensors) or plain
            static = static_kwargs is None or k in static_kwargs
            parts.append((k, _key_part(v) if static else _loose_part(v)))
    return tuple(parts), dtensors, plain


def _collect(values: Sequence[Any], dtensors: list) -> bool:
    """Append the DTensors among ``values`` to ``dtensors``; True if a plain tensor that is
    not a scalar is among them."""
    plain = False
    for x in values:
        if isinstance(x, DTensor):
            dtensors.append(x)
        elif isinstance(x, torch.Tensor):
            plain = plain or x.ndim > 0
    return plain


def _where(args: tuple, kwargs: dict) -> tuple:
    """Where each DTensor argument sits, in ``_scan``'s order: (argument index or keyword,
    index in its list or -1)."""
    where = []
    for i, a in itertools.chain(enumerate(args), kwargs.items()):
        if isinstance(a, DTensor):
            where.append((i, -1))
        elif type(a) in _SEQUENCES:
            where.extend((i, j) for j, x in enumerate(a) if isinstance(x, DTensor))
    return tuple(where)


def _whole_lists(where: tuple, args: tuple) -> tuple[tuple[int, int, int], ...] | None:
    """(position, first, stop) per list or tuple argument when the DTensors at ``where``
    fill such positional arguments and nothing else sits in them (``first:stop``: their
    DTensors in ``_scan``'s order); else None."""
    spans: list[list[int]] = []
    for n, (i, j) in enumerate(where):
        if not isinstance(i, int) or j < 0:
            return None
        if j == 0 and not any(span[0] == i for span in spans):
            spans.append([i, n, n + 1])
        elif spans and spans[-1][0] == i and j == n - spans[-1][1]:
            spans[-1][2] = n + 1
        else:
            return None
    if not spans or any(len(args[i]) != stop - first for i, first, stop in spans):
        return None
    return tuple((i, first, stop) for i, first, stop in spans)


def _place(args: tuple, kwargs: dict, where: tuple, pieces: Sequence[Any]) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with the DTensor at each position of ``where`` replaced by the
    matching piece (lists and tuples are copied, never changed)."""
    a = list(args)
    kw = dict(kwargs) if kwargs else kwargs
    copied: dict = {}
    for (i, j), piece in zip(where, pieces, strict=True):
        into = a if isinstance(i, int) else kw
        if j < 0:
            into[i] = piece
            continue
        seq = copied.get(i)
        if seq is None:
            seq = copied[i] = list(into[i])
        seq[j] = piece
    for i, seq in copied.items():
        into = a if isinstance(i, int) else kw
        into[i] = type(into[i])(seq)
    return tuple(a), kw


def _to_schema(func: Any, args: tuple, kwargs: dict, convert) -> OpSchema:
    reg = registry.registration(func)
    conv = pytree.tree_map_only(DTensor, convert, (args, kwargs))
    return OpSchema(func, tuple(conv[0]), dict(conv[1]), reg.schema_info if reg else None)


def _decide(func: Any, args: tuple, kwargs: dict, specs: list[DTensorSpec]) -> Decision:
    reg = registry.registration(func)
    if func in registry.BYPASS_PROPAGATION:
        return Decision(tuple(s.placements for s in specs), specs[0], False)
    if reg is None and _is_collective(func):
        raise _collective_error(func, specs)
    if reg is None:
        raise UnsupportedOpError(
            f"{func} has no sharding rule or strategy for DTensor inputs "
            f"{[list(s.placements) for s in specs]}; register one with "
            f"shardwise.rules.register_op_strategy([{func}]) or "
            f"shardwise.rules.register_prop_rule(...), "
            f"or handle it with shardwise.rules.bypass_dispatch"
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


_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})
# What a DTensor program writes instead of each kind of collective (matched in the op's name
# without underscores: c10d's allreduce_ and the functional all_reduce alike)
_INSTEAD = (
    ("reducescatter", "reduce-scatter a Partial DTensor with dt.redistribute(placements="
                      "[Shard(d)])"),
    ("allreduce", "sum a Partial DTensor with dt.redistribute(placements=[Replicate()]) or "
                  "dt.full_tensor()"),
    ("gather", "gather a sharded DTensor with dt.full_tensor() or dt.redistribute(placements="
               "[Replicate()])"),
    ("broadcast", "a Replicate DTensor already holds one value on every rank "
                  "(DTensor.from_local(..., run_check=True) broadcasts it from the first)"),
    ("alltoall", "move a shard to another tensor dim with dt.redistribute(placements="
                 "[Shard(j)])"),
)


def _is_collective(func: Any) -> bool:
    """Whether ``func`` is a torch.distributed collective or point-to-point op."""
    return getattr(func, "namespace", None) in _COLLECTIVE_NAMESPACES


def _collective_error(func: Any, specs: list[DTensorSpec]) -> DTensorCollectiveError:
    """What to do instead of calling a torch.distributed collective on DTensors."""
    name = func.name().split("::")[-1].split(".")[0].replace("_", "")
    instead = next((text for key, text in _INSTEAD if key in name), None)
    tensors = "; ".join(f"shape {list(s.shape)}, placements {list(s.placements)}" for s in specs)
    return DTensorCollectiveError(
        f"torch.distributed op {func} was called on a DTensor ({tensors}, on {specs[0].mesh}). "
        f"A DTensor is one global tensor whose pieces shardwise moves itself"
        + (f": {instead}" if instead else "")
        + "; to run the collective on this rank's piece as a plain tensor, call it on "
        "dt.to_local() (and rebuild a DTensor with DTensor.from_local if needed)"
    )


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


def _meta_outputs(func: Any, args: tuple, kwargs: dict, where: tuple, specs) -> Any:
    metas = [
        torch.empty_strided(s.tensor_meta.shape, s.tensor_meta.stride,
                            dtype=s.tensor_meta.dtype, device="meta")
        for s in specs
    ]
    args, kwargs = _place(args, kwargs, where, metas)
    args = tuple(_to_meta(a) for a in args)
    kwargs = {k: _to_meta(v) for k, v in kwargs.items()}
    if kwargs.get("device") is not None:  # a factory's target device (to_empty's empty_like)
        kwargs["device"] = "meta"
    return func(*args, **kwargs)


def _to_meta(value: Any) -> Any:
    """A plain tensor argument (or those in a list of them) on the meta device."""
    if type(value) in _SEQUENCES:
        return type(value)(_to_meta(v) for v in value)
    if isinstance(value, torch.Tensor) and value.device.type != "meta":
        return value.to("meta")
    return value


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
    return _torch_dispatch(DTensor, func, (), args, kwargs)


def _replicate_plain(func: Any, args: tuple, kwargs: dict, mesh: DeviceMesh) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with every plain tensor that is not a scalar replaced by its
    replicated DTensor (``implicitly_replicated``)."""
    where, pieces = [], []
    for i, a in itertools.chain(enumerate(args), kwargs.items()):
        for j, x in enumerate(a) if type(a) in _SEQUENCES else [(-1, a)]:
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.ndim > 0:
                where.append((i, j))
                pieces.append(implicitly_replicated(func, x, mesh))
    return _place(args, kwargs, tuple(where), pieces)


def _torch_dispatch(
    cls: type, func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None
) -> Any:
    """``DTensor.__torch_dispatch__`` itself (``set_dispatch_handler``), one frame for a
    cached decision: the op's entry by identity, its hooks, the key of the arguments, the
    decision, then one kernel call and the wrapper on one device, or the general route."""
    op = _OPS.get(id(func))
    if op is None:
        op = _op_entry(func)
    if kwargs is None:
        kwargs = {}
    if op.hooked:
        if op.bypass is not None:
            return op.bypass(func, args, kwargs)
        args, kwargs = op.pre(func, args, kwargs)
    given = args, kwargs
    key, dtensors, plain = _scan(args, kwargs, op.static_argnum, op.static_kwargs)
    if plain:
        args, kwargs = _replicate_plain(func, args, kwargs, dtensors[0]._spec.mesh)
        key, dtensors, _ = _scan(args, kwargs, op.static_argnum, op.static_kwargs)
    entry = op.decisions.get(key)
    if entry is None:  # this thread decides, fills in and publishes its own entry
        return _dispatch_cold(op, func, args, kwargs, key, dtensors, given)
    if op.inplace:
        _check_write_reaches_base(
            func, dtensors[0], entry.moved_self, entry.decision.input_placements[0]
        )
    if entry.direct:  # one kernel call on the components as they are
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
        result = call(*a, **kwargs) if kwargs else call(*a)
        spec = entry.single
        if spec is not None and isinstance(result, _Tensor):
            meta = spec.tensor_meta
            out = _make_wrapper(
                DTensor, meta.shape, meta.stride, None, None, meta.dtype, _strided, result.device
            )
            out._spec = spec
            out._components = [result]
            if op.view:
                out._view_orphan = entry.moved_self or dtensors[0].__dict__.get(
                    "_view_orphan", False
                )
            return out
        return _finish(op, func, entry, [result], dtensors, None)
    if entry.moves:
        components = run_moves(func, dtensors, entry.moves, entry.communicates)
    else:
        components = [d._components for d in dtensors]
    results = _run_local(op, func, args, kwargs, entry, components)
    spec = entry.single
    if spec is not None and isinstance(results[0], _Tensor):
        out = _new_dtensor(results, spec)
        if op.view:
            out._view_orphan = entry.moved_self or dtensors[0].__dict__.get("_view_orphan", False)
    else:
        out = _finish(op, func, entry, results, dtensors, components)
    return out if entry.post is None else entry.post(func, out, *given)


def _dispatch_cold(
    op: _Op, func: Any, args: tuple, kwargs: dict, key: tuple, dtensors: list[DTensor],
    given: tuple[tuple, dict],
) -> Any:
    specs = [d._spec for d in dtensors]
    mesh = specs[0].mesh
    for d in dtensors:
        if d.device_mesh != mesh:
            raise MeshError(
                f"{func} got DTensors on different meshes: {mesh} and {d.device_mesh} "
                f"(shapes {[list(x.shape) for x in dtensors]})"
            )
    if not dtensors[0]._components:
        return _outside_mesh(op, func, args, kwargs, dtensors)
    generation = _generation[0]
    with _argument_errors(func, specs):
        decision = _decide(func, args, kwargs, specs)
    where = _where(args, kwargs)
    if _may_widen(decision, specs):
        decision = _widen(func, args, kwargs, where, specs, decision)
    entry = _Entry(op, decision, specs, where, args)
    if op.inplace:
        _check_write_reaches_base(func, dtensors[0], entry.moved_self, decision.input_placements[0])
    components = run_moves(func, dtensors, entry.moves, entry.communicates) if entry.moves else [
        d._components for d in dtensors
    ]
    with _argument_errors(func, specs):
        results = _run_local(op, func, args, kwargs, entry, components, check=True)
    entry.complete(op, _complete(func, args, kwargs, entry, decision, results[0]))
    with _publish:
        if _generation[0] == generation:
            if key not in op.decisions:
                _published[op, key] = None
                if len(_published) > DECISION_CACHE_SIZE:
                    old_op, old_key = next(iter(_published))
                    del _published[old_op, old_key]
                    old_op.decisions.pop(old_key, None)
            op.decisions[key] = entry
    out = _finish(op, func, entry, results, dtensors, components)
    return out if entry.post is None else entry.post(func, out, *given)



def _outside_mesh(op: _Op, func: Any, args: tuple, kwargs: dict, dtensors: list[DTensor]) -> Any:
    """An op on a process that owns no device of the DTensors' mesh (PyTorch's
    non-participating rank): the outputs' placements are decided and their global metadata
    found on the meta device, as everywhere, but nothing runs and nothing is held."""
    specs = [d._spec for d in dtensors]
    with _argument_errors(func, specs):
        decision = _decide(func, args, kwargs, specs)
        metas = _meta_outputs(func, args, kwargs, _where(args, kwargs), specs)
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


def _run_local(
    op: _Op, func: Any, args: tuple, kwargs: dict, entry: _Entry, components: list,
    check: bool = False,
) -> list:
    """The op run once per local device on that device's components; ``check``: the first
    device's call tries the op's binding (``fast_call``) and the entry keeps it if it held."""
    results = []
    top = entry.top
    local_args = entry.local_args
    widen = entry.decision.widen
    seqs = entry.seqs
    call = entry.call
    if call is None or _function_mode() or any(type(c[0]) is not _Tensor for c in components):
        call = op.call  # the boxed call, as checked (components of one input share a type)
    for k, device in enumerate(entry.devices):
        if top is not None:
            a = list(args)
            for pos, comps in zip(top, components, strict=True):
                a[pos] = comps[k]
            kw = kwargs
        elif seqs is not None:
            a = list(args)
            for pos, first, stop in seqs:
                pieces = [comps[k] for comps in components[first:stop]]
                a[pos] = pieces if type(args[pos]) is list else tuple(pieces)
            kw = kwargs
        else:
            a, kw = _place(args, kwargs, entry.where, [comps[k] for comps in components])
        if widen:
            a, kw = _widened(a, kw)
        if local_args is not None:
            a, kw = local_args(
                tuple(a), kw, entry.moved_specs, entry.decision.output_specs, device
            )
        if check:
            check = False
            result, bound = checked_call(op.func, op.binding, tuple(a), kw)
            if bound:
                entry.call = op.binding
            results.append(result)
            continue
        results.append(call(*a, **kw))
    return results


def _finish(
    op: _Op, func: Any, entry: _Entry, results: list, dtensors: list[DTensor],
    components: list | None,
) -> Any:
    """Update each written argument the op moved (``components``: the moved inputs), wrap
    the outputs, mark views."""
    decision = entry.decision
    for n in entry.moved_written:
        # the op needed a written argument elsewhere: it now lives there (same global value,
        # updated)
        written = dtensors[n]
        written._components = components[n]
        written._spec = entry.moved_specs[n]
    result = _wrap(func, decision, results, dtensors, op.inplace)
    if op.view:
        # a view of a moved input aliases a temporary copy, not the input: writes would be lost
        orphan = entry.moved_self or dtensors[0].__dict__.get("_view_orphan", False)
        for out in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(out, DTensor):
                out._view_orphan = orphan  # present: a view; True: of a temporary copy
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


def _widen(
    func: Any, args: tuple, kwargs: dict, where: tuple, specs: list[DTensorSpec],
    decision: Decision,
) -> Decision:
    """Mark the decision to run its local kernels in float32 when an output pending a sum is
    float16/bfloat16 (its components are held in float32, ``DTensorSpec.component_dtype``):
    each device's piece is then what torch's float32 accumulation gives before its one
    rounding, which the reduction does. Decided once per cache entry, from a meta run."""
    targets = [
        DTensorSpec(s.mesh, p, s.tensor_meta)
        for s, p in zip(specs, decision.input_placements, strict=True)
    ]
    meta = _meta_outputs(func, args, kwargs, where, targets)
    metas = meta if isinstance(meta, (tuple, list)) else (meta,)
    outs = decision.output_specs
    outs = outs if isinstance(outs, (tuple, list)) else (outs,) * len(metas)
    widen = any(
        _pending_sum(s) and isinstance(m, torch.Tensor) and m.dtype in LOW_PRECISION
        for s, m in zip(outs, metas, strict=False)
    )
    return dataclasses.replace(decision, widen=widen)


def _in_float32(value: Any) -> Any:
    if type(value) in _SEQUENCES:
        return type(value)(_in_float32(v) for v in value)
    if isinstance(value, torch.Tensor) and value.dtype in LOW_PRECISION:
        return value.float()
    return value


def _widened(args: Sequence[Any], kwargs: dict) -> tuple[list, dict]:
    """A device's arguments for kernels run in float32 (``Decision.widen``): half-precision
    tensors (also those in lists) and a half-precision ``dtype`` keyword become float32."""
    kw = {k: _in_float32(v) for k, v in kwargs.items()}
    if kw.get("dtype") in LOW_PRECISION:
        kw["dtype"] = torch.float32
    return [_in_float32(a) for a in args], kw


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


def _complete(
    func: Any, args: tuple, kwargs: dict, entry: _Entry, decision: Decision, first: Any
) -> Decision:
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
    meta = _meta_outputs(func, args, kwargs, entry.where, entry.moved_specs) if needs_meta else None
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
    if spec.tensor_meta.dtype in LOW_PRECISION:  # DTensor() casts to the held dtype
        return DTensor(components, spec)
    return _new_dtensor(components, spec)


_make_wrapper = make_wrapper_subclass
_Tensor = torch.Tensor
_strided = torch.strided
_function_mode = is_torch_function_mode_enabled  # bindings would call into it


def _new_dtensor(components: list[torch.Tensor], spec: DTensorSpec) -> DTensor:
    """``DTensor(components, spec)`` for a fresh list of output components and a cached
    output spec whose Partials were checked (``_Entry.complete``): the wrapper made directly."""
    meta = spec.tensor_meta
    out = _make_wrapper(  # positionally: size, strides, offset, format, dtype, layout, device
        DTensor, meta.shape, meta.stride, None, None, meta.dtype, _strided, components[0].device
    )
    out._spec = spec
    out._components = components
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
