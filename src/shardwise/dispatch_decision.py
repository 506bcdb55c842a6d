"""The sharding decision of one op call: the op's rule or strategy asked for the input specs
(the strategy cheapest to reach from them chosen), the output's metadata found by a meta run,
and whether the local kernels run in float32 (a half-precision output left pending a sum).
``dispatch`` decides once per cache key and keeps the result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .dispatch_args import SEQUENCES, place
from .dtensor import DTensor
from .errors import DTensorCollectiveError, UnsupportedOpError
from .ops.registry import OpEntry, OpSchema, OpStrategy, OutputSharding, PlacementStrategy
from .placements import Placement
from .redistribute import plan_redistribute
from .spec import LOW_PRECISION, DTensorSpec, make_tensor_meta, pending_sum
from .torch_compat import pytree


@dataclass(frozen=True)
class Decision:
    """How one op call runs: target placements per DTensor input and the output spec(s)."""

    input_placements: tuple[tuple[Placement, ...], ...]
    output_specs: Any  # DTensorSpec | tuple[DTensorSpec | None, ...] | None
    multi_output: bool
    # the local kernels run in float32: an output is a float16/bfloat16 sum left pending
    widen: bool = False


def _to_schema(
    func: Any, entry: OpEntry, args: tuple, kwargs: dict, convert: Any
) -> OpSchema:
    conv = pytree.tree_map_only(DTensor, convert, (args, kwargs))
    return OpSchema(func, tuple(conv[0]), dict(conv[1]), entry.schema_info)


def decide(
    func: Any, entry: OpEntry | None, args: tuple, kwargs: dict, specs: list[DTensorSpec]
) -> Decision:
    """The op's decision for these input specs, from ``entry``, what is registered for it."""
    if entry is not None and entry.keeps_input_spec:
        return Decision(tuple(s.placements for s in specs), specs[0], False)
    if entry is None or not entry.propagates:
        if is_collective(func):
            raise collective_error(func, specs)
        raise UnsupportedOpError(
            f"{func} has no sharding rule or strategy for DTensor inputs "
            f"{[list(s.placements) for s in specs]}; register one with "
            f"shardwise.rules.register_op_strategy([{func}]) or "
            f"shardwise.rules.register_prop_rule(...), "
            f"or handle it with shardwise.rules.bypass_dispatch"
        )
    if entry.strategy is not None:
        schema = _to_schema(
            func, entry, args, kwargs, lambda d: OpStrategy([PlacementStrategy(d._spec)])
        )
        chosen = _choose(func, entry.strategy(specs[0].mesh, schema), specs)
        inputs = chosen.input_specs if chosen.input_specs is not None else specs
        outputs = chosen.output_specs
    else:
        schema = _to_schema(func, entry, args, kwargs, lambda d: d._spec)
        result: OutputSharding = entry.rule(schema)
        inputs = specs
        if result.redistribute_schema is not None:
            inputs = result.redistribute_schema.args_spec
            if result.output_spec is None:
                result = entry.rule(result.redistribute_schema)
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


def is_collective(func: Any) -> bool:
    """Whether ``func`` is a torch.distributed collective or point-to-point op."""
    return getattr(func, "namespace", None) in _COLLECTIVE_NAMESPACES


def collective_error(func: Any, specs: list[DTensorSpec]) -> DTensorCollectiveError:
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


def meta_outputs(
    func: Any, args: tuple, kwargs: dict, where: tuple, specs: Sequence[DTensorSpec]
) -> Any:
    """The op run on the meta device, the DTensors at ``where`` standing in with ``specs``'
    global metadata: the outputs' global shapes, strides and dtypes."""
    metas = [
        torch.empty_strided(s.tensor_meta.shape, s.tensor_meta.stride,
                            dtype=s.tensor_meta.dtype, device="meta")
        for s in specs
    ]
    args, kwargs = place(args, kwargs, where, metas)
    args = tuple(_to_meta(a) for a in args)
    kwargs = {k: _to_meta(v) for k, v in kwargs.items()}
    if kwargs.get("device") is not None:  # a factory's target device (to_empty's empty_like)
        kwargs["device"] = "meta"
    return func(*args, **kwargs)


def _to_meta(value: Any) -> Any:
    """A plain tensor argument (or those in a list of them) on the meta device."""
    if type(value) in SEQUENCES:
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


def _pending_sum(spec: Any) -> bool:
    return isinstance(spec, DTensorSpec) and pending_sum(spec.placements)


def may_widen(decision: Decision, specs: list[DTensorSpec]) -> bool:
    """Cheap test: a half-precision input and an output left pending a sum."""
    outs = decision.output_specs
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    return any(s.tensor_meta.dtype in LOW_PRECISION for s in specs) and any(
        _pending_sum(s) for s in outs
    )


def widen(
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
    meta = meta_outputs(func, args, kwargs, where, targets)
    metas = meta if isinstance(meta, (tuple, list)) else (meta,)
    outs = decision.output_specs
    outs = outs if isinstance(outs, (tuple, list)) else (outs,) * len(metas)
    wide = any(
        _pending_sum(s) and isinstance(m, torch.Tensor) and m.dtype in LOW_PRECISION
        for s, m in zip(outs, metas, strict=False)
    )
    return dataclasses.replace(decision, widen=wide)


def _in_float32(value: Any) -> Any:
    if type(value) in SEQUENCES:
        return type(value)(_in_float32(v) for v in value)
    if isinstance(value, torch.Tensor) and value.dtype in LOW_PRECISION:
        return value.float()
    return value


def widened(args: Sequence[Any], kwargs: dict) -> tuple[list, dict]:
    """A device's arguments for kernels run in float32 (``Decision.widen``): half-precision
    tensors (also those in lists) and a half-precision ``dtype`` keyword become float32."""
    kw = {k: _in_float32(v) for k, v in kwargs.items()}
    if kw.get("dtype") in LOW_PRECISION:
        kw["dtype"] = torch.float32
    return [_in_float32(a) for a in args], kw


def complete(
    func: Any, args: tuple, kwargs: dict, where: tuple, moved_specs: list[DTensorSpec],
    decision: Decision, first: Any,
) -> Decision:
    """Fill in output metadata once per cache entry (meta run unless Replicate): ``first`` is
    the first device's result, ``moved_specs`` the specs the inputs (at ``where``) moved to."""
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
    meta = meta_outputs(func, args, kwargs, where, moved_specs) if needs_meta else None
    meta_list = list(meta) if isinstance(meta, (tuple, list)) else [meta] * len(first_list)
    filled = tuple(
        _fill_meta(s, m, o) for s, m, o in zip(out_list, meta_list, first_list, strict=False)
    )
    multi = isinstance(first, (tuple, list))
    return Decision(
        decision.input_placements, filled if multi else filled[0], multi, decision.widen
    )
