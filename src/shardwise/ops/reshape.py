"""Sharding of ``view`` / ``_unsafe_view`` (and the reshapes that decompose into them): a shard
survives a view when each device's elements stay a contiguous-in-order local view of the
output; where nothing moves, the output placements are PyTorch's (``_StridedShard`` for a shard
of a later flattened dim, ``Shard`` again once unflattened); ``infer_size`` resolves a view's
-1."""

from __future__ import annotations

from collections.abc import Sequence
from math import prod

import torch

from ..errors import InvalidArgumentError, InvalidPlacementError
from ..geometry import Segments, merge_runs, shard_segments
from ..mesh import DeviceMesh
from ..placements import InterleavedShard, Partial, Placement, RaggedShard, Replicate, Shard
from .common import (
    DimOption,
    input_strategies,
    mapped_options,
    mesh_coords,
    per_tensor,
    product_strategy,
)
from .registry import OpSchema, OpStrategy, RuntimeSchemaInfo, register_op_strategy

aten = torch.ops.aten


def infer_size(size: Sequence[int], numel: int, what: str) -> list[int]:
    """``size`` with its -1 resolved for ``numel`` elements."""
    size = [int(s) for s in size]
    if size.count(-1) == 1:
        known = prod(s for s in size if s != -1)
        if known and numel % known == 0:
            size[size.index(-1)] = numel // known
    if size.count(-1) or prod(size) != numel:
        raise InvalidArgumentError(f"{what}: shape {size} is invalid for {numel} elements")
    return size


def view_groups(
    in_shape: Sequence[int], out_shape: Sequence[int]
) -> list[tuple[list[int], list[int]]]:
    """Split a view into independent groups (input dims, output dims) of equal products; a
    size-1 dim that appears or disappears is a group of its own (for nonzero numel)."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    a, b = list(in_shape), list(out_shape)
    while i < len(a) or j < len(b):
        if i < len(a) and j < len(b) and a[i] == 1 and b[j] == 1:
            groups.append(([i], [j]))
            i, j = i + 1, j + 1
        elif i < len(a) and a[i] == 1:
            groups.append(([i], []))
            i += 1
        elif j < len(b) and b[j] == 1:
            groups.append(([], [j]))
            j += 1
        else:
            ins, outs, pa, pb = [i], [j], a[i], b[j]
            i, j = i + 1, j + 1
            while pa != pb:
                if pa < pb:
                    ins.append(i)
                    pa *= a[i]
                    i += 1
                else:
                    outs.append(j)
                    pb *= b[j]
                    j += 1
            groups.append((ins, outs))
    return groups


_RUN_LIMIT = 4096


def _flat_runs(sizes: Sequence[int], segments: Sequence[Segments]) -> list[tuple[int, int]] | None:
    """The row-major flat indices (as sorted runs) of a product of per-dim index runs within a
    group of dims; None when it would take more than ``_RUN_LIMIT`` runs to say."""
    runs = [(0, 1)]
    for size, segs in zip(sizes, segments, strict=True):
        segs = [(a, b) for a, b in segs if b > a]
        if not segs:
            return []
        if segs == [(0, size)]:
            runs = [(a * size, b * size) for a, b in runs]
        else:
            if sum(b - a for a, b in runs) * len(segs) > _RUN_LIMIT:
                return None
            runs = [(f * size + s, f * size + e) for a, b in runs for f in range(a, b)
                    for s, e in segs]
        runs = list(merge_runs(runs))  # runs is never empty here
    return runs


def view_is_local(
    mesh: DeviceMesh,
    in_shape: Sequence[int],
    out_shape: Sequence[int],
    ins: tuple[Placement, ...],
    outs: tuple[Placement, ...],
) -> bool:
    """True when every device's component viewed to its local output shape is exactly its
    output piece: per view group, both sides hold the same global elements (row-major order
    then agrees too)."""
    groups = view_groups(in_shape, out_shape)
    for coord in mesh_coords(mesh):
        try:
            a = shard_segments(tuple(in_shape), mesh.shape, ins, coord)
            b = shard_segments(tuple(out_shape), mesh.shape, outs, coord)
        except InvalidPlacementError:
            return False
        for gi, go in groups:
            left = _flat_runs([in_shape[d] for d in gi], [a[d] for d in gi])
            right = _flat_runs([out_shape[d] for d in go], [b[d] for d in go])
            if left is None or right is None or left != right:
                return False
    return True


def _view_options(
    current: Placement, in_shape: Sequence[int], out_shape: Sequence[int]
) -> list[DimOption]:
    """Candidate choices for one mesh dim of a view (checked by ``view_is_local`` later): a
    shard of any input dim onto any output dim of its group, an interleaved input onto the
    inner dim of a [k, n] split, a shard of an inner dim onto an interleaved merge, and a
    ragged input onto the dims of its group (``_ragged_view_options``)."""
    if isinstance(current, Partial):
        return [((current,), (current,))]
    options: list[tuple[Placement, Placement]] = [(Replicate(), Replicate())]
    for gi, go in view_groups(in_shape, out_shape):
        options += [(Shard(d), Shard(e)) for d in gi for e in go]
        if gi and go and len(gi) > 1:
            for pos in range(1, len(gi)):
                k = prod(in_shape[d] for d in gi[:pos])
                if k > 1:
                    options.append((Shard(gi[pos]), InterleavedShard(go[0], k)))
        if isinstance(current, InterleavedShard) and current.dim in gi:
            k = current.interleaved_size
            options += [(current, InterleavedShard(e, k)) for e in go]
            options += [(current, Shard(go[pos])) for pos in range(1, len(go))
                        if prod(out_shape[e] for e in go[:pos]) == k]
        if isinstance(current, RaggedShard) and current.dim in gi:
            options += _ragged_view_options(current, in_shape, out_shape, gi, go)
    return [((p,), (q,)) for p, q in options]


def _ragged_view_options(
    current: RaggedShard, in_shape: Sequence[int], out_shape: Sequence[int],
    gi: list[int], go: list[int],
) -> list[tuple[Placement, Placement]]:
    """A ragged input dim onto each output dim of its view group, its sizes scaled by the
    ratio of the elements after the two dims (a merge into an outer dim multiplies them, a
    split off an outer dim divides them); ``view_is_local`` keeps those that are local."""
    inner = prod(in_shape[d] for d in gi[gi.index(current.dim) + 1:])
    options: list[tuple[Placement, Placement]] = []
    for pos, e in enumerate(go):
        after = prod(out_shape[f] for f in go[pos + 1:])
        sizes = [s * inner for s in current.sizes]
        if after and all(s % after == 0 for s in sizes):
            options.append((current, RaggedShard(e, tuple(s // after for s in sizes))))
    return options


def _strided_names(
    p: Shard, groups: list[tuple[list[int], list[int]]], local_in: Sequence[int],
    local_out: Sequence[int],
) -> list[Placement]:
    """Where a view may put the shard ``p`` of one mesh dim, named as PyTorch names it: in the
    flattened view group of a device's local piece (earlier mesh dims applied), ``p`` is an
    interleave of ``sf`` blocks; on output dim ``e`` that is ``Shard(e)`` where the local
    output dims before ``e`` make ``sf`` blocks, else an interleave of the blocks left over."""
    gi, go = next(g for g in groups if p.dim in g[0])
    k = p.interleaved_size if isinstance(p, InterleavedShard) else 1
    sf = k * prod(local_in[d] for d in gi if d < p.dim)
    found: list[Placement] = []
    for e in go:
        before = prod(local_out[f] for f in go if f < e)
        if before and sf % before == 0:
            found.append(Shard(e) if sf == before else InterleavedShard(e, sf // before))
    return sorted(found, key=lambda q: isinstance(q, InterleavedShard))  # plain shards first


def _kept_view_placements(
    mesh: DeviceMesh, in_shape: Sequence[int], out_shape: Sequence[int],
    placements: Sequence[Placement],
) -> tuple[Placement, ...] | None:
    """The output placements of a view that moves nothing, mesh dim by mesh dim as PyTorch
    derives them (a shard of a later flattened dim becomes ``_StridedShard`` with the local
    sizes before it as split factor, an unflatten turns it back into ``Shard``), each checked
    by ``view_is_local``; None where a mesh dim's shard has none (ragged, or not kept)."""
    groups = view_groups(in_shape, out_shape)
    local_in, local_out = list(in_shape), list(out_shape)
    outs: list[Placement] = []
    for m, p in enumerate(placements):
        if isinstance(p, RaggedShard):
            return None
        if not isinstance(p, Shard):
            outs.append(p)
            continue
        rest = (Replicate(),) * (mesh.ndim - m - 1)
        ins = (*placements[:m + 1], *rest)
        q = next((q for q in _strided_names(p, groups, local_in, local_out)
                  if view_is_local(mesh, in_shape, out_shape, ins, (*outs, q, *rest))), None)
        if q is None:
            return None
        outs.append(q)
        local_in[p.dim] //= mesh.shape[m]
        local_out[q.dim] //= mesh.shape[m]
    return tuple(outs)


@register_op_strategy(
    [aten.view.default, aten._unsafe_view.default], schema_info=RuntimeSchemaInfo(1)
)
def view_strategy(mesh: DeviceMesh, schema: OpSchema) -> OpStrategy:
    """A view keeps a shard when each device's elements stay a contiguous-in-order local view."""
    spec = input_strategies(schema)[0].output_spec
    in_shape = list(spec.shape)
    out_shape = infer_size(
        schema.args_schema[1], prod(in_shape),
        f"{schema.op} of a DTensor of shape {in_shape} with placements {list(spec.placements)}",
    )
    current = spec.placements
    if prod(in_shape) == 0:
        return product_strategy(mesh, lambda m: mapped_options(current[m], {}))

    kept = _kept_view_placements(mesh, in_shape, out_shape, current)

    def options(m: int) -> list[DimOption]:
        first = [((current[m],), (kept[m],))] if kept is not None else []
        return first + _view_options(current[m], in_shape, out_shape)

    def valid(combo: Sequence[DimOption]) -> bool:
        ins, outs = per_tensor(combo)
        return view_is_local(mesh, in_shape, out_shape, ins, outs)

    return product_strategy(mesh, options, valid=valid)
