"""``loss_parallel``: cross entropy on logits sharded on the class (vocabulary) dim, without
gathering them.

Each device reduces its slice of every row: the row max and the sum of exponentials are
all-reduced (max, then sum) over the mesh dims that split the classes, and so is the target's
logit, which only the device holding the target class contributes. Only ``O(rows)`` values
move; the backward, ``softmax - one_hot``, is local. Rows may also be sharded (data parallel).
Class weights scale each row by ``weight[target]``, and a mean divides by their sum over the
rows not ignored, as PyTorch's.

Plain labels follow the plain-tensor rule (``execution.plain_view``): where the program acts for one
device of the logits' mesh (a per-rank program) they are this rank's labels, for the rows of the
logits this device holds; where a process acts for several devices they are every row's labels.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .. import execution, settings
from ..dtensor import DTensor, local_of
from ..errors import (
    InvalidArgumentError,
    InvalidPlacementError,
    LabelOutOfRangeError,
    MeshError,
    OpArgumentError,
    UnsupportedOpError,
)
from ..factories import distribute_tensor
from ..mesh import DeviceMesh
from ..placements import Placement, Replicate, Shard, is_special_shard
from ..redistribute import move
from ..spec import DTensorSpec, contiguous_meta
from .boundary import to_layout

_SIGNATURE = inspect.signature(F.cross_entropy)


@contextmanager
def loss_parallel() -> Iterator[None]:
    """Within the block (this thread), ``F.cross_entropy`` on DTensor logits sharded on the
    class dim runs on the shards (PyTorch's ``loss_parallel``); other calls are unchanged. The
    result is a replicated DTensor (per-row for ``reduction="none"``); its backward may run
    after the block. A class ``weight`` is a plain tensor of every class's weight or a DTensor
    replicated over the logits' mesh. Plain labels are this rank's in a per-rank program,
    every row's where a process acts for several devices (``execution.plain_view``)."""
    with _LossParallelMode():
        yield


class _LossParallelMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy:
            bound = _SIGNATURE.bind(*args, **kwargs)
            bound.apply_defaults()
            logits = bound.arguments["input"]
            if isinstance(logits, DTensor) and _class_mesh_dims(logits):
                return _cross_entropy(**bound.arguments)
            target = bound.arguments["target"]
            if isinstance(logits, DTensor) and _plain_labels(target):
                raise InvalidPlacementError(
                    f"loss_parallel() needs the logits sharded on the class dim "
                    f"{_class_dim(logits)}, got shape {list(logits.shape)} with placements "
                    f"{list(logits.placements)} on {logits.device_mesh} and plain labels of "
                    f"shape {list(target.shape)} (as PyTorch's loss_parallel, a ValueError); "
                    f"shard the class dim, or pass the labels as a DTensor"
                )
        return func(*args, **kwargs)


def _plain_labels(target: Any) -> bool:
    """Plain labels that only a class-sharded call can take: more than one element, outside
    ``implicit_replication()`` (elsewhere they are refused beside DTensors anyway)."""
    return (
        isinstance(target, torch.Tensor)
        and not isinstance(target, DTensor)
        and target.numel() > 1
        and not settings.IMPLICIT_REPLICATION.get()
    )


def _class_dim(logits: torch.Tensor) -> int:
    return 0 if logits.ndim == 1 else 1


def _class_mesh_dims(logits: DTensor) -> list[int]:
    cd = _class_dim(logits)
    return [m for m, p in enumerate(logits.placements) if isinstance(p, Shard) and p.dim == cd]


def _cross_entropy(
    input: DTensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    size_average: Any,
    ignore_index: int,
    reduce: Any,
    reduction: str,
    label_smoothing: float,
) -> DTensor:
    if label_smoothing or size_average is not None or reduce is not None:
        raise UnsupportedOpError(
            "loss_parallel's cross entropy supports target class indices with class weights, "
            "reduction and ignore_index; label smoothing and the legacy size_average/reduce "
            f"arguments are not supported (logits {input})"
        )
    if target.dtype.is_floating_point:
        raise UnsupportedOpError(
            f"loss_parallel needs class indices as target, got {target.dtype} probabilities"
        )
    mesh = input.device_mesh
    rows = _row_placements(input)
    target = to_layout(_target_dtensor(target, input, rows), rows)
    weights = None if weight is None else _row_weights(target, weight, input, ignore_index)
    per_row = _VocabParallelCrossEntropy.apply(input, target, weights, ignore_index)
    if reduction == "none":
        return per_row
    replicated = [Replicate()] * mesh.ndim
    total = per_row.sum().redistribute(placements=replicated)
    if reduction == "sum":
        return total
    if reduction != "mean":
        raise UnsupportedOpError(
            f"cross entropy reduction must be mean, sum or none: {reduction!r}"
        )
    counted = (target != ignore_index) if weights is None else weights
    return total / counted.sum().redistribute(placements=replicated)


def _row_placements(logits: DTensor) -> tuple[Placement, ...]:
    """Placements of the per-row values: the logits' with the class dim removed."""
    cd = _class_dim(logits)
    out: list[Placement] = []
    for p in logits.placements:
        if is_special_shard(p) or p.is_partial():
            raise InvalidPlacementError(
                f"loss_parallel needs logits sharded on plain dims (Shard/Replicate), got "
                f"{logits}; redistribute them first"
            )
        if isinstance(p, Shard) and p.dim != cd:
            out.append(Shard(p.dim - (p.dim > cd)))
        else:
            out.append(Replicate())
    return tuple(out)


def _target_dtensor(target: torch.Tensor, logits: DTensor, rows: tuple[Placement, ...]) -> DTensor:
    """The labels as a DTensor of the rows' shape. A DTensor carries its meaning; a plain
    tensor is this rank's labels (for its rows of the logits) in a per-rank program, and every
    row's labels where this process acts for several devices (``execution.plain_view``)."""
    mesh, cd = logits.device_mesh, _class_dim(logits)
    shape = torch.Size(s for d, s in enumerate(logits.shape) if d != cd)
    if isinstance(target, DTensor):
        if target.device_mesh != mesh:
            raise MeshError(
                f"loss_parallel: labels {target} are on {target.device_mesh} but the logits "
                f"{logits} are on {mesh}; put the labels on the logits' mesh"
            )
        if target.shape != shape:
            raise InvalidArgumentError(
                f"loss_parallel: labels of global shape {list(target.shape)} (placements "
                f"{list(target.placements)}) do not fit logits {logits}: expected the logits' "
                f"shape without the class dim {cd}, {list(shape)}, on {mesh}"
            )
        return target
    if execution.per_rank(mesh, f"loss_parallel labels of shape {list(target.shape)}"):
        spec = DTensorSpec(mesh, rows, contiguous_meta(shape, target.dtype))
        expected = spec.local_shape(_acting_device(mesh))
        if target.shape != expected:
            raise InvalidArgumentError(
                f"loss_parallel: plain labels of shape {list(target.shape)} are this rank's "
                f"labels ({execution.of(mesh).describe()}), so they must cover this "
                f"rank's rows of the logits {logits}: shape {list(expected)} (labels placed "
                f"{list(rows)}, global shape {list(shape)}); pass a DTensor for global labels"
            )
        return DTensor.from_local(target, mesh, rows, shape=shape)
    if target.shape != shape:
        raise InvalidArgumentError(
            f"loss_parallel: plain labels of shape {list(target.shape)} are the global labels "
            f"({execution.of(mesh).describe()}), so they must have the "
            f"logits' shape without the class dim {cd}: {list(shape)} (logits {logits})"
        )
    return distribute_tensor(target, mesh, rows)


def _row_weights(
    target: DTensor, weight: torch.Tensor, logits: DTensor, ignore_index: int
) -> DTensor:
    """Each row's class weight ``weight[target]`` (0 at ignored rows), laid out as the rows:
    the loss of a row is scaled by it and a mean divides by its sum (PyTorch's weighted
    mean). ``weight`` is every class's weight: a plain tensor (the same on every rank, as in
    PyTorch) or a DTensor replicated over the logits' mesh."""
    mesh, classes = logits.device_mesh, logits.shape[_class_dim(logits)]
    replicated = [Replicate()] * mesh.ndim
    problem = None
    if weight.shape != (classes,):
        problem = f"a weight for each of the {classes} classes (shape [{classes}])"
    elif weight.dtype != logits.dtype:
        problem = f"the logits' dtype {logits.dtype}"
    elif weight.requires_grad:
        problem = "no gradient: cross entropy is not differentiable in its weight"
    if problem is not None:
        raise OpArgumentError(
            f"loss_parallel cross entropy: weight of shape {list(weight.shape)}, dtype "
            f"{weight.dtype}, requires_grad={weight.requires_grad} for logits {logits}: "
            f"needs {problem}"
        )
    if isinstance(weight, DTensor):
        if weight.device_mesh != mesh or any(not p.is_replicate() for p in weight.placements):
            raise InvalidPlacementError(
                f"loss_parallel cross entropy: weight {weight} must be replicated over the "
                f"logits' mesh {mesh} ({replicated}), or a plain tensor"
            )
    elif execution.per_rank(mesh, f"loss_parallel weight of shape {list(weight.shape)}"):
        weight = DTensor.from_local(weight, mesh, replicated)
    else:
        weight = distribute_tensor(weight, mesh, replicated)
    labels = local_of(target)
    pieces = labels.zip(local_of(weight).pieces, lambda t, w: torch.where(
        t == ignore_index, torch.zeros((), dtype=w.dtype, device=w.device),
        w[t.clamp(0, classes - 1)],
    ))
    return DTensor(pieces, DTensorSpec(mesh, target.placements,
                                       contiguous_meta(target.shape, logits.dtype)))


def _acting_device(mesh: DeviceMesh) -> int:
    """The device of ``mesh`` this program acts for where it acts for one (a per-rank
    process, a rank thread, or one replica thread of ``Strategy.run``)."""
    return execution.of(mesh).devices[0]


def _all_reduce(what: Any, mesh: DeviceMesh, dims: list[int], parts: list[torch.Tensor], op: str):
    for m in dims:
        parts = move.all_reduce(what, mesh, m, parts, op)
    return parts


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-row ``logsumexp(x) - x[target]`` (0 at ignored rows) from class-sharded logits,
    scaled by each row's class weight where there are weights (``_row_weights``)."""

    @staticmethod
    def forward(
        ctx, logits: DTensor, target: DTensor, weights: DTensor | None, ignore_index: int
    ) -> DTensor:
        held, labels = local_of(logits), local_of(target)
        scales = [None] * len(labels.pieces) if weights is None else local_of(weights).pieces
        spec, mesh = held.spec, logits.device_mesh
        cd, dims = _class_dim(logits), _class_mesh_dims(logits)
        parts = held.pieces
        _check_labels(labels.pieces, logits.shape[cd], ignore_index)
        def what() -> str:
            return f"loss_parallel cross entropy of {spec}"

        maxes = _all_reduce(what, mesh, dims, [_row_max(x, cd) for x in parts], "max")
        sums = [(x - m).exp().sum(cd, keepdim=True) for x, m in zip(parts, maxes, strict=True)]
        sums = _all_reduce(what, mesh, dims, sums, "sum")
        lse = [s.log() + m for s, m in zip(sums, maxes, strict=True)]
        picks, locals_ = [], []
        for x, t, d in zip(parts, labels.pieces, mesh.local_device_ids, strict=True):
            start = spec.local_segments(d)[cd][0][0]
            local = _local_target(t, start, x.shape[cd], ignore_index)
            locals_.append(local)
            picked = x.gather(cd, local[0].unsqueeze(cd)).squeeze(cd) if x.shape[cd] else 0
            picks.append(torch.where(local[1], picked, torch.zeros((), dtype=x.dtype)))
        picks = _all_reduce(what, mesh, dims, picks, "sum")
        losses = [
            _scaled(torch.where(t == ignore_index, 0.0, s.squeeze(cd) - p).to(x.dtype), w)
            for s, p, t, x, w in zip(lse, picks, labels.pieces, parts, scales, strict=True)
        ]
        ctx.save_for_backward(*lse, *parts)
        ctx.state = (spec, labels.spec, labels.pieces, locals_, scales, ignore_index)
        out_spec = DTensorSpec(mesh, target.placements, contiguous_meta(target.shape, logits.dtype))
        return DTensor(losses, out_spec)

    @staticmethod
    def backward(ctx, grad: DTensor):
        spec, target_spec, targets, locals_, scales, ignore_index = ctx.state
        grad = grad.redistribute(placements=target_spec.placements)
        cd = 0 if spec.ndim == 1 else 1
        n = len(targets)
        lses, xs = ctx.saved_tensors[:n], ctx.saved_tensors[n:]
        out = []
        parts = zip(xs, lses, local_of(grad).pieces, targets, locals_, scales, strict=True)
        for x, lse, g, t, (index, hit), w in parts:
            probs = (x - lse).exp()
            if x.shape[cd]:
                probs = probs.scatter_add(
                    cd, index.unsqueeze(cd), -hit.to(probs.dtype).unsqueeze(cd)
                )
            scale = _scaled(torch.where(t == ignore_index, 0.0, g).to(probs.dtype), w)
            out.append(probs * scale.unsqueeze(cd))
        return DTensor(out, spec), None, None, None


def _scaled(per_row: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    return per_row if weight is None else per_row * weight


def _row_max(x: torch.Tensor, cd: int) -> torch.Tensor:
    if x.shape[cd] == 0:
        shape = list(x.shape)
        shape[cd] = 1
        return torch.full(shape, float("-inf"), dtype=x.dtype, device=x.device)
    return x.detach().amax(cd, keepdim=True)


def _check_labels(targets: list[torch.Tensor], classes: int, ignore_index: int) -> None:
    """Raise, as torch does, for a label outside ``[0, classes)`` that is not ignored (every
    device sharing these rows sees the same labels, so they all raise before communicating)."""
    for t in targets:
        bad = ((t < 0) | (t >= classes)) & (t != ignore_index)
        if bool(bad.any()):
            value = int(t[bad].flatten()[0])
            raise LabelOutOfRangeError(
                f"loss_parallel cross entropy: label {value} is out of range for {classes} "
                f"classes (labels must be in [0, {classes}) or equal ignore_index={ignore_index})"
            )


def _local_target(t: torch.Tensor, start: int, n: int, ignore_index: int):
    """(index into this device's classes (clamped), whether the target class is here)."""
    hit = (t >= start) & (t < start + n) & (t != ignore_index)
    return (t - start).clamp(0, max(n - 1, 0)), hit
