"""Random ops on DTensors (``uniform_``, ``normal_``, ``bernoulli``, ``rand_like``, dropout...)
and ``manual_seed``.

Every random op runs once per local component, on that component: each device draws only its
own shard's numbers, from the stream ``rng.draw_per_shard`` gives its shard (PyTorch's
offset-based scheme; see ``rng.py`` and the "Random numbers" section of docs/index.md). No
device draws, gathers or holds the global tensor: arguments whose values the draw reads
(probabilities, means) are moved to the output's placements first, which is free where they
already are sharded alike. In multi-process runs every process must seed alike
(``manual_seed``) and run the same random ops: the first random op on each mesh compares the
processes' generator states (every one does under debug checks) and raises
``CollectiveMismatchError`` if they differ.
"""

from __future__ import annotations

from typing import Any

import torch

from ..components import global_stride
from ..dtensor import DTensor, local_of
from ..factories import keeps_value
from ..mesh import DeviceMesh
from ..placements import Partial, Placement, Replicate, Shard
from ..rng import check_generator, draw_per_shard
from ..spec import DTensorSpec, TensorMeta, contiguous_meta
from .common import (
    DimOption,
    R,
    bind,
    dtensor_args,
    input_strategies,
    move_components,
    partial_ops,
    product_strategy,
)
from .registry import OpSchema, OpStrategy, RuntimeSchemaInfo, bypass_dispatch, register_op_strategy

aten = torch.ops.aten


def manual_seed(seed: int) -> None:
    """Seed the generator every DTensor random op draws from (torch's default generators, as
    ``torch.manual_seed``).

    After ``manual_seed(s)`` the same random ops on DTensors of the same mesh and placements
    give the same values in every mode (embedded, per rank, rank threads); on CUDA they are
    the values ``torch.distributed.tensor`` gives. In multi-process runs call it with the same
    seed in every process.
    """
    torch.manual_seed(seed)


def _no_partial(placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
    return tuple(Replicate() if p.is_partial() else p for p in placements)


def _pop_generator(op: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict, Any]:
    """``args``, ``kwargs`` without the op's ``generator`` (the local calls draw from the
    default generator, which ``draw_per_shard`` sets up from it), and that generator."""
    names = [a.name for a in op._schema.arguments]
    if "generator" not in names:
        return args, kwargs, None
    at = names.index("generator")
    if at < len(args):
        return (*args[:at], None, *args[at + 1 :]), kwargs, args[at]
    generator = kwargs.get("generator")
    return args, {k: v for k, v in kwargs.items() if k != "generator"}, generator


def _per_shard(
    op: Any, args: tuple, kwargs: dict, spec: DTensorSpec, moved: dict[int, list[torch.Tensor]]
) -> list[Any]:
    """``op`` once per local component of ``spec``, each DTensor argument replaced by its
    component in ``moved`` (by ``id``), each call drawing its shard's numbers."""
    dtensor_args(op, [*args, *kwargs.values()])  # a plain tensor beside them is refused
    args, kwargs, generator = _pop_generator(op, args, kwargs)

    def local(value: Any, i: int) -> Any:
        return moved[id(value)][i] if isinstance(value, DTensor) else value

    def draw(i: int) -> Any:
        return op(*(local(a, i) for a in args), **{k: local(v, i) for k, v in kwargs.items()})

    devices = [c.device for c in next(iter(moved.values()))]
    if devices:  # (none in a process that holds no device of the mesh)
        check_generator(spec.mesh, devices[0])
    return draw_per_shard(spec, devices, draw, generator)


def _move(op: Any, args: tuple, kwargs: dict, shape: torch.Size, target: tuple) -> dict:
    """The components of every DTensor argument at ``target``, a broadcast one expanded to
    ``shape`` first, under dispatch's explicit-mode rules (by ``id`` of the argument)."""
    dts = [a for a in (*args, *kwargs.values()) if isinstance(a, DTensor)]
    if not dts:
        return {}
    full = [d if d.shape == shape else d.expand(shape) for d in dts]
    moved = move_components(op, full, [target] * len(full))
    return {id(d): comps for d, comps in zip(dts, moved, strict=True)}


def _wrap(components: list[torch.Tensor], mesh: DeviceMesh, placements: tuple,
          shape: torch.Size, dtype: torch.dtype) -> DTensor:
    """A DTensor of global ``shape`` from its freshly drawn ``components`` (of ``dtype``
    where this process holds none)."""
    if not components:
        return DTensor([], DTensorSpec(mesh, placements, contiguous_meta(shape, dtype)))
    first = components[0]
    stride = global_stride(first, mesh, placements, tuple(shape))
    meta = TensorMeta(shape, stride, first.dtype)
    return DTensor(components, DTensorSpec(mesh, placements, meta))


def _random_inplace(op: Any, args: tuple, kwargs: dict) -> DTensor:
    """``self.uniform_()`` and friends: each component draws its shard in place (a
    Partial("sum") ``self`` keeps the value on its first device and zeros elsewhere)."""
    self: DTensor = args[0]
    spec = local_of(self).spec
    moved = _move(op, args[1:], kwargs, self.shape, _no_partial(spec.placements))
    moved[id(self)] = local_of(self).pieces
    _per_shard(op, args, kwargs, spec, moved)
    for component, device in zip(local_of(self).pieces, spec.mesh.local_device_ids, strict=True):
        if not keeps_value(spec, device):
            component.zero_()
    return self


# ops of OUT_RANDOM that read the values of ``self`` (the others only its shape and dtype)
_READS_SELF = (aten.bernoulli.default, aten.bernoulli.Tensor)


def _random_out(op: Any, args: tuple, kwargs: dict) -> DTensor:
    """``torch.bernoulli(p)``, ``rand_like(x)`` and friends: each component draws its shard
    of the result, sharded like the first input (Partial dims replicated: a sample is not a
    partial value)."""
    self: DTensor = args[0]
    target = _no_partial(self.placements)
    if op in _READS_SELF:
        moved = _move(op, args, kwargs, self.shape, target)
    else:
        moved = _move(op, args[1:], kwargs, self.shape, target) if len(args) > 1 else {}
        moved[id(self)] = local_of(self).pieces
    spec = local_of(self).spec.with_placements(target)
    drawn = _per_shard(op, args, kwargs, spec, moved)
    return _wrap(drawn, self.device_mesh, target, self.shape, self.dtype)


INPLACE_RANDOM = [
    aten.uniform_.default,
    aten.normal_.default,
    aten.bernoulli_.float,
    aten.bernoulli_.Tensor,
    aten.random_.default,
    getattr(aten.random_, "from"),
    aten.random_.to,
    aten.exponential_.default,
    aten.geometric_.default,
    aten.log_normal_.default,
    aten.cauchy_.default,
]
OUT_RANDOM = [
    aten.bernoulli.default,
    aten.bernoulli.p,
    aten.bernoulli.Tensor,
    aten.rand_like.default,
    aten.rand_like.generator,
    aten.randn_like.default,
    aten.randn_like.generator,
    aten.randint_like.default,
    aten.randint_like.low_dtype,
    aten.randint_like.generator,
    aten.randint_like.low_generator_dtype,
]
bypass_dispatch(INPLACE_RANDOM, _random_inplace)
bypass_dispatch(OUT_RANDOM, _random_out)


def _random_from_values(op: Any, args: tuple, kwargs: dict) -> DTensor:
    """``normal(mean, std)``, ``poisson(rates)``, ``multinomial(probs, n)``...: the arguments
    (a broadcast one expanded) moved to the placements of one with the result's shape (Partial
    dims and a multinomial's category dim replicated), then each component draws its shard."""
    dts = [a for a in (*args, *kwargs.values()) if isinstance(a, DTensor)]
    first = dts[0]
    mesh = first.device_mesh
    if op is aten.multinomial.default:
        last = first.ndim - 1
        target = tuple(Replicate() if p.is_shard(last) else p for p in first.placements)
        target = _no_partial(target)
        moved = _move(op, args, kwargs, first.shape, target)
        shape = torch.Size((*first.shape[:-1], bind(op, args, kwargs)["num_samples"]))
    else:  # elementwise: arguments broadcast to the result's shape, sharded alike
        shape = torch.broadcast_shapes(*(d.shape for d in dts))
        like = next((d for d in dts if d.shape == shape), None)
        target = _no_partial(like.placements) if like is not None else (Replicate(),) * mesh.ndim
        moved = _move(op, args, kwargs, shape, target)
    spec = DTensorSpec(mesh, target, contiguous_meta(shape, first.dtype))
    return _wrap(_per_shard(op, args, kwargs, spec, moved), mesh, target, shape, first.dtype)


bypass_dispatch(
    [
        aten.normal.Tensor_Tensor, aten.normal.Tensor_float, aten.normal.float_Tensor,
        aten.multinomial.default, aten.poisson.default, aten._standard_gamma.default,
        aten.binomial.default,
    ],
    _random_from_values,
)


def _rrelu_with_noise(op: Any, args: tuple, kwargs: dict) -> DTensor:
    """``rrelu``: each component draws its shard of the noise; the noise buffer gets it in
    place (moved back to its own placements if it had others) and the output keeps the
    input's shards (Partial dims replicated: rrelu is not linear)."""
    bound = bind(op, args, kwargs)
    x, noise = bound["self"], bound["noise"]
    mesh = x.device_mesh
    target = _no_partial(x.placements)
    moved = _move(op, (x, noise), {}, x.shape, target)
    spec = local_of(x).spec.with_placements(target)
    out = _wrap(_per_shard(op, args, kwargs, spec, moved), mesh, target, x.shape, x.dtype)
    if noise.placements != target:
        drawn = DTensor(moved[id(noise)], local_of(noise).spec.with_placements(target))
        pieces = move_components(op, [drawn], [noise.placements])[0]
        for component, piece in zip(local_of(noise).pieces, pieces, strict=True):
            component.copy_(piece)
    return out


bypass_dispatch(aten.rrelu_with_noise.default, _rrelu_with_noise)


@register_op_strategy(aten.rrelu_with_noise_backward.default, schema_info=RuntimeSchemaInfo(3))
def rrelu_backward_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """Elementwise in (grad, self, noise), all of one shape, and linear in grad."""
    ndim = input_strategies(schema)[0].ndim
    options: list[DimOption] = [((R, R, R), (R,))]
    options += [((Shard(d),) * 3, (Shard(d),)) for d in range(ndim)]
    options += [((Partial(op), R, R), (Partial(op),)) for op in ("sum", "avg")]
    return product_strategy(mesh, options)


def _native_dropout(op: Any, args: tuple, kwargs: dict) -> tuple[DTensor, DTensor]:
    """Each component drops with its shard's mask (the devices of one shard draw the same
    one). Dropout is linear given the mask, so a Partial input stays Partial; the mask is
    sharded like the input (Partial dims replicated)."""
    x: DTensor = args[0]
    drawn = _per_shard(op, args, kwargs, local_of(x).spec, {id(x): local_of(x).pieces})
    out = DTensor([o for o, _ in drawn], local_of(x).spec)
    target = _no_partial(x.placements)
    return out, _wrap([m for _, m in drawn], x.device_mesh, target, x.shape, x.dtype)


bypass_dispatch(aten.native_dropout.default, _native_dropout)


@register_op_strategy(aten.native_dropout_backward.default, schema_info=RuntimeSchemaInfo(2))
def native_dropout_backward_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """``grad * mask * scale``: grad and mask sharded alike, or a Partial grad (linear) with a
    replicated mask, or both replicated."""
    grad, _mask = input_strategies(schema)
    options: list[DimOption] = [((R, R), (R,))]
    options += [((Shard(d), Shard(d)), (Shard(d),)) for d in range(grad.ndim)]
    options += [((p, R), (p,)) for p in partial_ops(grad.output_spec.placements)]
    return product_strategy(mesh, options)
