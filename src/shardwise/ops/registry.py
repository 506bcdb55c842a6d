"""Sharding propagation registry: the public way to say how an aten op shards.

Two kinds of registration, as in PyTorch/veScale DTensor:

- a *rule* (``register_prop_rule``) maps an ``OpSchema`` of input ``DTensorSpec``s to an
  ``OutputSharding`` (possibly asking for the inputs to be redistributed first);
- a *strategy* (``register_op_strategy``) maps the mesh and an ``OpSchema`` of input
  ``OpStrategy``s to an ``OpStrategy`` listing every valid ``PlacementStrategy``; dispatch picks
  the one that is cheapest to reach from the actual inputs.

Every built-in op is registered through these functions. Hooks let an op skip the machinery:
``bypass_dispatch`` (handle the op entirely), ``register_pre_patch``/``register_post_patch``
(adjust arguments or results around dispatch) and ``bypass_sharding_propagation`` (the output
takes the first input's spec).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..mesh import DeviceMesh
from ..spec import DTensorSpec
from ..torch_compat import OpOverloadPacket

OpOverload = Any  # torch._ops.OpOverload; kept loose so packets and custom ops register too
OutputSpecs = DTensorSpec | Sequence[DTensorSpec | None] | None


@dataclass(frozen=True)
class RuntimeSchemaInfo:
    """Which arguments change the sharding decision besides the input specs.

    Positional arguments from ``static_argnum`` on, and the keyword arguments named in
    ``static_kwargkey``, are part of the cache key (e.g. a reduction's ``dim``).
    """

    static_argnum: int = 100
    static_kwargkey: tuple[str, ...] | None = None


@dataclass
class OpSchema:
    """An op call as sharding propagation sees it: DTensor arguments replaced by their
    ``DTensorSpec`` (for rules) or ``OpStrategy`` (for strategies), others as given."""

    op: OpOverload
    args_schema: tuple
    kwargs_schema: dict = field(default_factory=dict)
    schema_info: RuntimeSchemaInfo | None = None

    @property
    def args_spec(self) -> list[DTensorSpec]:
        """The DTensorSpecs among the positional arguments (nested lists included)."""
        return [a for a in _flatten(self.args_schema) if isinstance(a, DTensorSpec)]

    @property
    def mesh(self) -> DeviceMesh:
        for a in _flatten(self.args_schema):
            if isinstance(a, DTensorSpec):
                return a.mesh
            if isinstance(a, OpStrategy):
                return a.mesh
        raise ValueError(f"{self.op} has no DTensor argument")

    def __repr__(self) -> str:
        return f"OpSchema({self.op}, args={self.args_schema}, kwargs={self.kwargs_schema})"


@dataclass
class OutputSharding:
    """A rule's answer: the output spec(s), or the input specs it wants first
    (``redistribute_schema``; the rule is then asked again with those)."""

    output_spec: OutputSpecs
    redistribute_schema: OpSchema | None = None


class PlacementStrategy:
    """One way to run an op: the specs the inputs must have, and the spec(s) of the output.

    ``output_spec=`` is accepted as a synonym of ``output_specs=`` (the seed's spelling).
    """

    def __init__(
        self,
        output_specs: OutputSpecs = None,
        input_specs: Sequence[DTensorSpec] | None = None,
        *,
        output_spec: OutputSpecs = None,
    ) -> None:
        self.output_specs = output_specs if output_spec is None else output_spec
        self.input_specs = input_specs

    @property
    def output_spec(self) -> DTensorSpec:
        if isinstance(self.output_specs, DTensorSpec):
            return self.output_specs
        raise ValueError(f"{self} has several outputs; use output_specs")

    def __repr__(self) -> str:
        ins = None if self.input_specs is None else [list(s.placements) for s in self.input_specs]
        outs = self.output_specs
        if isinstance(outs, DTensorSpec):
            outs = list(outs.placements)
        elif outs is not None:
            outs = [None if s is None else list(s.placements) for s in outs]
        return f"PlacementStrategy(inputs={ins}, outputs={outs})"


@dataclass
class OpStrategy:
    """The valid placement strategies of an op (or, for an argument, its current spec)."""

    strategies: list[PlacementStrategy]

    @property
    def output_spec(self) -> DTensorSpec:
        return self.strategies[0].output_spec

    @property
    def mesh(self) -> DeviceMesh:
        return self.output_spec.mesh

    @property
    def shape(self) -> torch.Size:
        return self.output_spec.shape

    @property
    def ndim(self) -> int:
        return self.output_spec.ndim


PropRule = Callable[[OpSchema], OutputSharding]
StrategyFunc = Callable[[DeviceMesh, OpSchema], OpStrategy]
DispatchHook = Callable[[OpOverload, tuple, dict], Any]


@dataclass
class Registration:
    """What is registered for one op."""

    rule: PropRule | None = None
    strategy: StrategyFunc | None = None
    schema_info: RuntimeSchemaInfo | None = None


_REGISTRY: dict[OpOverload, Registration] = {}
BYPASS_DISPATCH: dict[OpOverload, DispatchHook] = {}
PRE_PATCH: dict[OpOverload, Callable[[OpOverload, tuple, dict], tuple[tuple, dict]]] = {}
POST_PATCH: dict[OpOverload, Callable[[OpOverload, Any, tuple, dict], Any]] = {}
BYPASS_PROPAGATION: set[OpOverload] = set()
LocalArgsHook = Callable[[tuple, dict, list[DTensorSpec], Any, int], tuple[tuple, dict]]
LOCAL_ARGS: dict[OpOverload, LocalArgsHook] = {}
# (input specs after moves, output spec(s)) -> whether a hook applies to that sharding decision
HookApplies = Callable[[list[DTensorSpec], OutputSpecs], bool]
LOCAL_ARGS_APPLIES: dict[OpOverload, HookApplies] = {}
POST_PATCH_APPLIES: dict[OpOverload, HookApplies] = {}
_listeners: list[Callable[[], None]] = []


def _overloads(ops: OpOverload | Iterable[OpOverload]) -> list[OpOverload]:
    """Expand packets (``aten.add``) into their overloads; accept one op or several."""
    items = list(ops) if isinstance(ops, (list, tuple, set)) else [ops]
    result = []
    for op in items:
        if isinstance(op, OpOverloadPacket):
            result.extend(getattr(op, name) for name in op.overloads())
        else:
            result.append(op)
    return result


def _changed() -> None:
    for listener in _listeners:
        listener()


def on_registry_change(listener: Callable[[], None]) -> None:
    """Call ``listener`` whenever a registration changes (dispatch clears its caches)."""
    _listeners.append(listener)


def register_prop_rule(
    ops: OpOverload | Iterable[OpOverload], schema_info: RuntimeSchemaInfo | None = None
) -> Callable[[PropRule], PropRule]:
    """Decorator: register a sharding rule for ``ops`` (replacing what was registered)."""

    def wrap(rule: PropRule) -> PropRule:
        for op in _overloads(ops):
            _REGISTRY[op] = Registration(rule=rule, schema_info=schema_info)
        _changed()
        return rule

    return wrap


def register_op_strategy(
    ops: OpOverload | Iterable[OpOverload], schema_info: RuntimeSchemaInfo | None = None
) -> Callable[[StrategyFunc], StrategyFunc]:
    """Decorator: register a sharding strategy for ``ops`` (replacing what was registered)."""

    def wrap(strategy: StrategyFunc) -> StrategyFunc:
        for op in _overloads(ops):
            _REGISTRY[op] = Registration(strategy=strategy, schema_info=schema_info)
        _changed()
        return strategy

    return wrap


def bypass_dispatch(ops: OpOverload | Iterable[OpOverload], handler: DispatchHook) -> None:
    """Handle ``ops`` on DTensors with ``handler(op, args, kwargs)`` instead of dispatch."""
    for op in _overloads(ops):
        BYPASS_DISPATCH[op] = handler
    _changed()


def register_pre_patch(
    ops: OpOverload | Iterable[OpOverload],
    patch: Callable[[OpOverload, tuple, dict], tuple[tuple, dict]],
) -> None:
    """Run ``patch(op, args, kwargs) -> (args, kwargs)`` before dispatching ``ops``."""
    for op in _overloads(ops):
        PRE_PATCH[op] = patch
    _changed()


def register_post_patch(
    ops: OpOverload | Iterable[OpOverload],
    patch: Callable[[OpOverload, Any, tuple, dict], Any],
    applies: HookApplies | None = None,
) -> None:
    """Run ``patch(op, result, args, kwargs) -> result`` after dispatching ``ops``; with
    ``applies``, only for sharding decisions where ``applies(input_specs, output_specs)``
    (asked once per cached decision, so other calls pay nothing)."""
    for op in _overloads(ops):
        POST_PATCH[op] = patch
        _set_applies(POST_PATCH_APPLIES, op, applies)
    _changed()


def _set_applies(table: dict, op: OpOverload, applies: HookApplies | None) -> None:
    if applies is None:
        table.pop(op, None)
    else:
        table[op] = applies


def bypass_sharding_propagation(ops: OpOverload | Iterable[OpOverload]) -> None:
    """Skip sharding propagation for ``ops``: the output takes the first input's spec."""
    for op in _overloads(ops):
        BYPASS_PROPAGATION.add(op)
    _changed()


def register_local_args(
    ops: OpOverload | Iterable[OpOverload], hook: LocalArgsHook, applies: HookApplies | None = None
) -> None:
    """Rewrite the non-tensor arguments per component before the local op runs:
    ``hook(args, kwargs, input_specs, output_specs, device_id) -> (args, kwargs)``, where args
    already hold the device's components and ``input_specs`` are the specs the inputs were
    moved to (e.g. a view's global size becomes the local one). With ``applies``, only for
    sharding decisions where ``applies(input_specs, output_specs)`` (asked once per cached
    decision)."""
    for op in _overloads(ops):
        LOCAL_ARGS[op] = hook
        _set_applies(LOCAL_ARGS_APPLIES, op, applies)
    _changed()


def unregister(ops: OpOverload | Iterable[OpOverload]) -> None:
    """Forget the rule or strategy registered for ``ops``."""
    for op in _overloads(ops):
        _REGISTRY.pop(op, None)
    _changed()


def remove_hooks(ops: OpOverload | Iterable[OpOverload]) -> None:
    """Undo ``bypass_dispatch``, patches and propagation bypass for ``ops``."""
    for op in _overloads(ops):
        BYPASS_DISPATCH.pop(op, None)
        PRE_PATCH.pop(op, None)
        POST_PATCH.pop(op, None)
        POST_PATCH_APPLIES.pop(op, None)
        BYPASS_PROPAGATION.discard(op)
    _changed()


# qualified op name -> what registers it, for ops that exist only once torch loads a module
# later (``prims::fma`` arrives with torch.compile's inductor prims)
_DEFERRED: dict[str, Callable[[], None]] = {}


def register_deferred(name: str, register: Callable[[], None]) -> None:
    """Run ``register`` the first time an op named ``name`` (``"prims::fma"``) is looked up."""
    _DEFERRED[name] = register


def registration(op: OpOverload) -> Registration | None:
    reg = _REGISTRY.get(op)
    if reg is None and _DEFERRED:
        register = _DEFERRED.pop(getattr(op, "_name", ""), None)
        if register is not None:
            register()
            reg = _REGISTRY.get(op)
    return reg


def registered_ops() -> dict[OpOverload, Registration]:
    """Every op with a rule or strategy (for the generated op table)."""
    return dict(_REGISTRY)


def _flatten(args: Any) -> list:
    if isinstance(args, (list, tuple)):
        out = []
        for a in args:
            out.extend(_flatten(a))
        return out
    return [args]
