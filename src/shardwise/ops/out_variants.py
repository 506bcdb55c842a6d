"""``out=`` overloads (``torch.mul(a, b, out=c)``: ``aten.mul.out``; ``torch.sum(x, 0, out=c)``,
``torch.mm(a, b, out=c)``, ``torch.cat(xs, out=c)``, ``torch.max(x, 0, out=(v, i))``, the
foreach ones' ``out`` lists).

As in PyTorch's DTensor, ``out`` decides where the result lives: the strategy is the one the
functional overload (``aten.mul.Tensor``) has in the registry when the call is decided,
restricted to the candidates whose outputs have the ``out`` tensors' placements, with ``out``
itself never moved (the inputs move as dispatch allows: freely where the move is local, with
``allow_implicit_redistribute`` otherwise). Each device's kernel writes into its piece of
``out``, and the call returns what torch's does (``out``; nothing for the foreach ones). A plain
``out`` beside DTensors, an ``out`` of another shape than the result (a DTensor is not resized),
or placements no candidate gives raise ``OpArgumentError`` naming them. Every out overload
whose functional twin has a strategy and no per-call hooks gets this (``register_remaining``,
run once every family is registered); a twin with hooks (``mean`` of uneven shards) keeps its
out overload unregistered rather than run without them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..caches import PER_OP, cached
from ..dtensor import DTensor
from ..errors import OpArgumentError, UnsupportedOpError
from ..mesh import DeviceMesh
from ..placements import Placement
from ..spec import DTensorSpec
from .registry import (
    OpEntry,
    OpSchema,
    OpStrategy,
    PlacementStrategy,
    RuntimeSchemaInfo,
    entries,
    register_op_strategy,
    register_post_patch,
    register_pre_patch,
    registration,
)


@cached(PER_OP)  # one entry per op overload
def out_names(op: Any) -> tuple[str, ...]:
    """The names of the op's ``out`` arguments (its schema's ``is_out`` ones), in order."""
    return tuple(a.name for a in op._schema.arguments if a.is_out)


def _signature(op: Any, skip: Sequence[str] = ()) -> tuple[tuple[str, str, bool], ...]:
    return tuple(
        (a.name, str(a.type), a.kwarg_only) for a in op._schema.arguments if a.name not in skip
    )


@cached(PER_OP)  # one entry per op overload
def functional_of(op: Any) -> Any:
    """The functional twin of an out overload (None for any other op): the overload of the
    same packet that takes the same arguments without the ``out`` ones (``mul.Tensor`` for
    ``mul.out``, ``pow.Tensor_Scalar`` for ``pow.Tensor_Scalar_out``)."""
    names = out_names(op)
    if not names:
        return None
    want = _signature(op, names)
    packet = op.overloadpacket
    for name in packet.overloads():
        candidate = getattr(packet, name)
        if not out_names(candidate) and _signature(candidate) == want:
            return candidate
    return None


def out_overloads(packet: Any) -> list[Any]:
    """The out overloads of an aten packet that have a functional twin."""
    ops = [getattr(packet, name) for name in packet.overloads()]
    return [op for op in ops if functional_of(op) is not None]


def _items(value: Any) -> tuple:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _dtensor_order(schema: OpSchema) -> list[str | None]:
    """The DTensor arguments in dispatch's order (list elements one by one): None for a
    positional one, the keyword's name for a keyword one."""
    order: list[str | None] = []
    for a in schema.args_schema:
        order += [None for x in _items(a) if isinstance(x, OpStrategy)]
    for k, v in schema.kwargs_schema.items():
        order += [k for x in _items(v) if isinstance(x, OpStrategy)]
    return order


def _outs(schema: OpSchema, names: Sequence[str]) -> list[tuple[str, OpStrategy]]:
    """The ``out`` tensors (a list's elements one by one), with their argument's name."""
    return [(n, x) for n in names for x in _items(schema.kwargs_schema[n])]


def _as_meta(value: Any) -> Any:
    if isinstance(value, OpStrategy):
        meta = value.output_spec.tensor_meta
        return torch.empty(meta.shape, dtype=meta.dtype, device="meta")
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_as_meta(v) for v in value)
    return value


def _result_shapes(functional: Any, schema: OpSchema, names: Sequence[str]) -> list:
    """The shapes of the functional twin's results, from a run on the meta device."""
    kwargs = {k: _as_meta(v) for k, v in schema.kwargs_schema.items() if k not in names}
    result = functional(*_as_meta(schema.args_schema), **kwargs)
    return [r.shape for r in _items(result)]


def _outputs(candidate: PlacementStrategy) -> list[DTensorSpec]:
    outs = candidate.output_specs
    return list(outs) if isinstance(outs, (tuple, list)) else [outs]


def out_variant_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """An out= overload: its functional overload's sharding with the placements out has,
    written into out's pieces."""
    functional = functional_of(schema.op)
    names = out_names(schema.op)
    entry = registration(functional)
    if entry is None or entry.strategy is None:
        raise UnsupportedOpError(
            f"{schema.op} needs the sharding strategy of {functional}, which has none"
        )
    outs = _outs(schema, names)
    shapes = _result_shapes(functional, schema, names)
    if len(shapes) != len(outs):
        raise OpArgumentError(
            f"{schema.op}: {len(outs)} out tensors given for {len(shapes)} results"
        )
    for (name, out), shape in zip(outs, shapes, strict=True):
        if out.shape != shape:
            raise OpArgumentError(
                f"{schema.op}: {name} has shape {list(out.shape)} but the result has shape "
                f"{list(shape)}; a DTensor {name} is not resized, pass one of the result's shape"
            )
    kwargs = {k: v for k, v in schema.kwargs_schema.items() if k not in names}
    base = entry.strategy(mesh, OpSchema(functional, schema.args_schema, kwargs,
                                         entry.schema_info))
    current = [s.output_spec for s in _inputs_of(schema, names)]
    wanted = [tuple(o.output_spec.placements) for _, o in outs]
    kept = []
    for candidate in base.strategies:
        if [tuple(s.placements) for s in _outputs(candidate)] != wanted:
            continue
        inputs = iter(candidate.input_specs if candidate.input_specs is not None else current)
        written = iter(o.output_spec for _, o in outs)
        specs = [next(written) if k in names else next(inputs) for k in _dtensor_order(schema)]
        kept.append(PlacementStrategy(candidate.output_specs, specs))
    if not kept:
        raise _mismatch(schema, names, wanted, base, current)
    return OpStrategy(kept)


def _inputs_of(schema: OpSchema, names: Sequence[str]) -> list[OpStrategy]:
    """The DTensor arguments other than ``out``, in dispatch's order."""
    found = []
    for a in schema.args_schema:
        found += [x for x in _items(a) if isinstance(x, OpStrategy)]
    for k, v in schema.kwargs_schema.items():
        if k not in names:
            found += [x for x in _items(v) if isinstance(x, OpStrategy)]
    return found


def _mismatch(
    schema: OpSchema, names: Sequence[str], wanted: list[tuple[Placement, ...]],
    base: OpStrategy, current: list[DTensorSpec],
) -> OpArgumentError:
    """No candidate gives ``out``'s placements: name them and those the op gives in place."""
    in_place = []
    for candidate in base.strategies:
        ins = candidate.input_specs
        if ins is None or [s.placements for s in ins] == [s.placements for s in current]:
            found = [list(s.placements) for s in _outputs(candidate)]
            if found not in in_place:
                in_place.append(found)
    given = ", ".join(f"{n} {list(w)}" for (n, _), w in zip(_outs(schema, names), wanted,
                                                              strict=True))
    return OpArgumentError(
        f"{schema.op} cannot write into {given}: no sharding of the op gives those placements "
        f"for inputs with placements {[list(s.placements) for s in current]} on "
        f"{schema.mesh}; from the inputs as they are it gives {in_place or 'none'}: pass an "
        f"out with those placements, or call the op without out= and redistribute"
    )


def _out_must_be_dtensor(op: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A plain ``out`` beside DTensor inputs would receive nothing: refuse it."""
    for name in out_names(op):
        for out in _items(kwargs.get(name)):
            if isinstance(out, DTensor):
                continue
            shape = list(out.shape) if isinstance(out, torch.Tensor) else out
            raise OpArgumentError(
                f"{op} got DTensor inputs and a {name} that is not a DTensor ({type(out).__name__}"
                f" of shape {shape}): pass a DTensor {name} (DTensor.from_local or "
                f"distribute_tensor) with the placements the result should have"
            )
    return args, kwargs


def _return_out(op: Any, result: Any, args: tuple, kwargs: dict) -> Any:
    """The call returns ``out`` itself (its pieces hold the result), as torch does (nothing
    where torch's returns nothing: the foreach ones)."""
    names = out_names(op)
    if not op._schema.returns:
        return None
    return kwargs[names[0]] if len(names) == 1 else tuple(kwargs[n] for n in names)


def register_out_variants(packet: Any, static_argnum: int) -> None:
    """Register every out overload of ``packet`` that has a functional twin (see the module's
    docstring). Positional arguments from ``static_argnum`` on and every keyword argument
    key the decision: whichever of them the twin's strategy reads when asked."""
    ops = out_overloads(packet)
    if ops:
        _register(ops, static_argnum)


def _register(ops: list[Any], static_argnum: int) -> None:
    info = RuntimeSchemaInfo(static_argnum, static_kwargkey=None)
    register_op_strategy(ops, schema_info=info)(out_variant_strategy)
    register_pre_patch(ops, _out_must_be_dtensor)
    register_post_patch(ops, _return_out)


def _plain(entry: OpEntry) -> bool:
    """Whether an entry is a strategy alone: no hook its out overload would run without."""
    return entry.strategy is not None and entry.without_hooks() == entry


def register_remaining() -> None:
    """Register the out overloads not registered yet whose functional twin has a plain
    strategy (reductions, the matmul family, ``cat``, the foreach ops...), keyed as the twin
    is."""
    known = entries()
    for op, entry in known.items():
        if not _plain(entry):
            continue
        packet = op.overloadpacket
        fresh = [o for o in out_overloads(packet)
                 if functional_of(o) is op and o not in known]
        if fresh:
            info = entry.schema_info or RuntimeSchemaInfo()
            _register(fresh, info.static_argnum)
