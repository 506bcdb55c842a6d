"""``out=`` overloads of elementwise ops (``torch.mul(a, b, out=c)``: ``aten.mul.out``).

As in PyTorch's DTensor, ``out`` decides where the result lives: the strategy is the one the
functional overload (``aten.mul.Tensor``) has in the registry when the call is decided,
restricted to the candidates whose output has ``out``'s placements, with ``out`` itself never
moved (the inputs move as dispatch allows: freely where the move is local, with
``allow_implicit_redistribute`` otherwise). Each device's kernel writes into its piece of
``out``, and the call returns ``out``. A plain ``out`` beside DTensors, an ``out`` of another
shape than the result (a DTensor is not resized), or placements no candidate gives raise
``OpArgumentError`` naming them.
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
    OpSchema,
    OpStrategy,
    PlacementStrategy,
    RuntimeSchemaInfo,
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


def _dtensor_order(schema: OpSchema) -> list[str | None]:
    """The DTensor arguments in dispatch's order: None for a positional one, the keyword's
    name for a keyword one."""
    order: list[str | None] = []
    for a in schema.args_schema:
        items = a if isinstance(a, (list, tuple)) else (a,)
        order += [None for x in items if isinstance(x, OpStrategy)]
    order += [k for k, v in schema.kwargs_schema.items() if isinstance(v, OpStrategy)]
    return order


def _result_shape(schema: OpSchema, names: Sequence[str]) -> torch.Size:
    """The broadcast shape of the tensor arguments other than ``out``."""
    shapes = []
    for key, value in [*enumerate(schema.args_schema), *schema.kwargs_schema.items()]:
        if key in names:
            continue
        for x in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(x, (OpStrategy, torch.Tensor)):
                shapes.append(x.shape)
    return torch.broadcast_shapes(*shapes)


def _outputs(candidate: PlacementStrategy) -> list[DTensorSpec]:
    outs = candidate.output_specs
    return list(outs) if isinstance(outs, (tuple, list)) else [outs]


def out_variant_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """An out= overload: its functional overload's sharding with the placements out has,
    written into out's pieces."""
    functional = functional_of(schema.op)
    names = out_names(schema.op)
    outs: list[OpStrategy] = [schema.kwargs_schema[n] for n in names]
    entry = registration(functional)
    if entry is None or entry.strategy is None:
        raise UnsupportedOpError(
            f"{schema.op} needs the sharding strategy of {functional}, which has none"
        )
    shape = _result_shape(schema, names)
    for name, out in zip(names, outs, strict=True):
        if out.shape != shape:
            raise OpArgumentError(
                f"{schema.op}: {name} has shape {list(out.shape)} but the result has shape "
                f"{list(shape)}; a DTensor {name} is not resized, pass one of the result's shape"
            )
    kwargs = {k: v for k, v in schema.kwargs_schema.items() if k not in names}
    base = entry.strategy(mesh, OpSchema(functional, schema.args_schema, kwargs,
                                         entry.schema_info))
    current = [s.output_spec for s in _inputs_of(schema, names)]
    wanted = [tuple(o.output_spec.placements) for o in outs]
    kept = []
    for candidate in base.strategies:
        if [tuple(s.placements) for s in _outputs(candidate)] != wanted:
            continue
        inputs = iter(candidate.input_specs if candidate.input_specs is not None else current)
        specs = [schema.kwargs_schema[k].output_spec if k in names else next(inputs)
                 for k in _dtensor_order(schema)]
        kept.append(PlacementStrategy(candidate.output_specs, specs))
    if not kept:
        raise _mismatch(schema, names, wanted, base, current)
    return OpStrategy(kept)


def _inputs_of(schema: OpSchema, names: Sequence[str]) -> list[OpStrategy]:
    """The DTensor arguments other than ``out``, in dispatch's order."""
    found = []
    for a in schema.args_schema:
        items = a if isinstance(a, (list, tuple)) else (a,)
        found += [x for x in items if isinstance(x, OpStrategy)]
    found += [v for k, v in schema.kwargs_schema.items()
              if isinstance(v, OpStrategy) and k not in names]
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
    given = ", ".join(f"{n} {list(w)}" for n, w in zip(names, wanted, strict=True))
    return OpArgumentError(
        f"{schema.op} cannot write into {given}: no sharding of the op gives those placements "
        f"for inputs with placements {[list(s.placements) for s in current]} on "
        f"{schema.mesh}; from the inputs as they are it gives {in_place or 'none'}: pass an "
        f"out with those placements, or call the op without out= and redistribute"
    )


def _out_must_be_dtensor(op: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A plain ``out`` beside DTensor inputs would receive nothing: refuse it."""
    for name in out_names(op):
        out = kwargs.get(name)
        if not isinstance(out, DTensor):
            shape = list(out.shape) if isinstance(out, torch.Tensor) else out
            raise OpArgumentError(
                f"{op} got DTensor inputs and a {name} that is not a DTensor ({type(out).__name__}"
                f" of shape {shape}): pass a DTensor {name} (DTensor.from_local or "
                f"distribute_tensor) with the placements the result should have"
            )
    return args, kwargs


def _return_out(op: Any, result: Any, args: tuple, kwargs: dict) -> Any:
    """The call returns ``out`` itself (its pieces hold the result), as torch does."""
    names = out_names(op)
    return kwargs[names[0]] if len(names) == 1 else tuple(kwargs[n] for n in names)


def register_out_variants(packet: Any, static_argnum: int) -> None:
    """Register every out overload of ``packet`` that has a functional twin (see the module's
    docstring). Positional arguments from ``static_argnum`` on and every keyword argument
    key the decision: whichever of them the twin's strategy reads when asked."""
    ops = out_overloads(packet)
    if ops:
        info = RuntimeSchemaInfo(static_argnum, static_kwargkey=None)
        register_op_strategy(ops, schema_info=info)(out_variant_strategy)
        register_pre_patch(ops, _out_must_be_dtensor)
        register_post_patch(ops, _return_out)
