"""Random ops on DTensors (``uniform_``, ``normal_``, ``bernoulli``, ``rand_like``, dropout...)
and ``manual_seed``.

Every random op draws the *global* tensor from torch's generator exactly as the single-device
call would (same shape, stride, dtype and generator, so the generator advances by the same
amount) and each device keeps its piece. Hence, after the same seeding, the global values are
the single-device ones whatever the mesh and placements, and dropout on a DTensor uses the
single-device mask. The cost: the process materialises the global random tensor once per op
(memory of the whole tensor, no communication). In multi-process runs every process draws the
same tensor, so every process must seed alike (``manual_seed``) and run the same random ops:
the first random op on each mesh compares the processes' generator states (every one does under
debug checks) and raises ``CollectiveMismatchError`` if they differ.
"""

from __future__ import annotations

from typing import Any

import torch

from ..dtensor import DTensor, distribute_tensor
from ..factories import check_generator, keeps_value
from ..mesh import DeviceMesh
from ..placements import Partial, Placement, Replicate, Shard
from ..settings import drawing_from_default_generator
from .common import (
    DimOption,
    R,
    bind,
    input_strategies,
    move_components,
    partial_ops,
    product_strategy,
)
from .registry import OpSchema, OpStrategy, RuntimeSchemaInfo, bypass_dispatch, register_op_strategy

aten = torch.ops.aten


def manual_seed(seed: int) -> None:
    """Seed the generator every DTensor random op draws from (torch's default generator).

    After ``manual_seed(s)``, ``shardwise.randn(shape, device_mesh=m, placements=p)`` equals
    ``torch.manual_seed(s); torch.randn(shape)`` for every mesh and placements, and so does any
    sequence of random ops on DTensors compared with the same ops on plain tensors. In
    multi-process runs call it with the same seed in every process.
    """
    torch.manual_seed(seed)


def _no_partial(placements: tuple[Placement, ...]) -> list[Placement]:
    return [Replicate() if p.is_partial() else p for p in placements]


def _global_empty(dt: DTensor) -> torch.Tensor:
    """A plain tensor with ``dt``'s global shape, stride and dtype (random fills follow the
    memory layout, so the stride matters) on its first local device."""
    return torch.empty_strided(dt.shape, dt.stride(), dtype=dt.dtype, device=dt.device)


def _global_args(op: Any, args: tuple, kwargs: dict, keep_self: bool) -> tuple[tuple, dict]:
    """Arguments for the single-device call: ``self`` becomes an empty global tensor (unless
    its values are the op's probabilities, ``keep_self``), other DTensors are gathered."""
    names = list(bind(op, args, kwargs))
    flat = dict(zip(names, args, strict=False)) | kwargs
    gather = [k for k, v in flat.items() if isinstance(v, DTensor) and (k != names[0] or keep_self)]
    if gather:
        mesh = flat[gather[0]].device_mesh
        moved = move_components(
            op, [flat[k] for k in gather], [[Replicate()] * mesh.ndim] * len(gather)
        )
        flat.update({k: comps[0] for k, comps in zip(gather, moved, strict=True)})
    if not keep_self:
        flat[names[0]] = _global_empty(args[0])
    n = len(args)
    return tuple(flat[k] for k in names[:n]), {k: flat[k] for k in names[n:] if k in flat}


def _random_inplace(op: Any, args: tuple, kwargs: dict) -> DTensor:
    """``self.uniform_()`` and friends: draw the global tensor, write each device's piece
    (a Partial("sum") ``self`` keeps the value on its first device and zeros elsewhere)."""
    self: DTensor = args[0]
    g_args, g_kwargs = _global_args(op, args, kwargs, keep_self=False)
    check_generator(self.device_mesh, self.device)
    with drawing_from_default_generator():
        drawn = op(*g_args, **g_kwargs)
    spec = self._spec
    for component, device in zip(self._components, spec.mesh.local_device_ids, strict=True):
        if keeps_value(spec, device):  # copied from views: one global tensor at a time
            _copy_runs(component, drawn, spec.local_segments(device))
        else:
            component.zero_()
    return self


def _copy_runs(dst: torch.Tensor, src: torch.Tensor, segments: tuple, dim: int = 0) -> None:
    """``dst`` = the part of ``src`` at the per-dim index runs ``segments``, copied run by run
    (an interleaved piece needs no temporary of its own size)."""
    if dim == len(segments):
        dst.copy_(src)
        return
    offset = 0
    for start, stop in segments[dim]:
        size = stop - start
        _copy_runs(dst.narrow(dim, offset, size), src.narrow(dim, start, size), segments, dim + 1)
        offset += size


def _random_out(op: Any, args: tuple, kwargs: dict) -> DTensor:
    """``torch.bernoulli(p)``, ``rand_like(x)`` and friends: draw the global result and shard
    it like the first input (Partial dims replicated: a sample is not a partial value)."""
    self: DTensor = args[0]
    keep_self = op in (aten.bernoulli.default,)
    g_args, g_kwargs = _global_args(op, args, kwargs, keep_self=keep_self)
    check_generator(self.device_mesh, self.device)
    with drawing_from_default_generator():
        drawn = op(*g_args, **g_kwargs)
    return distribute_tensor(drawn, self.device_mesh, _no_partial(self.placements),
                             src_data_rank=None)


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
    """``normal(mean, std)``, ``multinomial(probs, n)``: the global draw from the gathered
    arguments, sharded like the first input when it has the output's shape, else Replicate."""
    self: DTensor = next(a for a in (*args, *kwargs.values()) if isinstance(a, DTensor))
    g_args, g_kwargs = _global_args(op, args, kwargs, keep_self=True)
    with drawing_from_default_generator():
        drawn = op(*g_args, **g_kwargs)
    same = isinstance(args[0], DTensor) and drawn.shape == args[0].shape
    placements = _no_partial(self.placements) if same else [Replicate()] * self.device_mesh.ndim
    return distribute_tensor(drawn, self.device_mesh, placements)


def _rrelu_with_noise(op: Any, args: tuple, kwargs: dict) -> DTensor:
    """``rrelu``: the global call on the gathered input draws the noise as on one device; the
    noise buffer gets each device's piece back (in place) and the output keeps the input's
    shards (Partial dims replicated: rrelu is not linear)."""
    bound = bind(op, args, kwargs)
    x, noise = bound["self"], bound["noise"]
    mesh = x.device_mesh
    rep = [Replicate()] * mesh.ndim
    xs, noises = move_components(op, [x, noise], [rep, rep])
    drawn = noises[0].clone()
    with drawing_from_default_generator():
        out = op(xs[0], drawn, bound["lower"], bound["upper"], bound["training"],
                 bound["generator"])
    pieces = distribute_tensor(drawn, mesh, noise.placements)._components
    for component, piece in zip(noise._components, pieces, strict=True):
        component.copy_(piece)
    return distribute_tensor(out, mesh, _no_partial(x.placements))


bypass_dispatch(aten.rrelu_with_noise.default, _rrelu_with_noise)


@register_op_strategy(aten.rrelu_with_noise_backward.default, schema_info=RuntimeSchemaInfo(3))
def rrelu_backward_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """Elementwise in (grad, self, noise), all of one shape, and linear in grad."""
    ndim = input_strategies(schema)[0].ndim
    options: list[DimOption] = [((R, R, R), (R,))]
    options += [((Shard(d),) * 3, (Shard(d),)) for d in range(ndim)]
    options += [((Partial(op), R, R), (Partial(op),)) for op in ("sum", "avg")]
    return product_strategy(mesh, options)


bypass_dispatch(
    [
        aten.normal.Tensor_Tensor, aten.normal.Tensor_float, aten.normal.float_Tensor,
        aten.multinomial.default, aten.poisson.default, aten._standard_gamma.default,
        aten.binomial.default,
    ],
    _random_from_values,
)


def _native_dropout(op: Any, args: tuple, kwargs: dict) -> tuple[DTensor, DTensor]:
    """The single-device mask (drawn by ``native_dropout`` on a zero tensor of the global
    shape, so the generator advances as it would), sharded like the input; each device scales
    its own piece. Dropout is linear given the mask, so a Partial input stays Partial."""
    bound = bind(op, args, kwargs)
    x: DTensor = bound["input"]
    mesh = x.device_mesh
    train = bound["train"] is None or bound["train"]
    zeros = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    check_generator(mesh, x.device)
    with drawing_from_default_generator():
        drawn = op(zeros, bound["p"], train)[1]
    mask = distribute_tensor(drawn, mesh, _no_partial(x.placements), src_data_rank=None)
    keep = 1.0 - bound["p"]
    scale = 0.0 if keep == 0 or not train else 1.0 / keep
    out = []
    for component, m in zip(x._components, mask._components, strict=True):
        out.append(component.mul(m).mul_(scale) if train else component.clone())
    return DTensor(out, x._spec), mask


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
