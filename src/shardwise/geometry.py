"""Shard geometry: which global indices every device holds under any placements.

One device's share of a tensor is, per tensor dim, an ordered list of index runs
(``Segments``); mesh dims split their tensor dims in mesh-dim order (``shard_segments``).
Over all devices of a mesh at once, ``pieces`` gives every device's runs, shape and size (and
its box where every piece is one); ``blocks`` cuts the index space on every run boundary so
that each piece is a union of whole blocks, and ``block_transfers`` counts what one block
needs to move: the lower bound, the exchange and the planner's guess all count with it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from math import prod
from typing import TYPE_CHECKING, NamedTuple

import torch

from .caches import PER_LAYOUT, PER_PIECE, PER_SEGMENT, cached
from .errors import InvalidPlacementError, UnsupportedOpError
from .placements import (
    InterleavedShard,
    Partial,
    Placement,
    RaggedShard,
    Replicate,
    Shard,
    normalize_placement,
)

if TYPE_CHECKING:  # only named: geometry reads a mesh's shape and coordinates
    from .mesh import DeviceMesh

# An ordered list of global indices along one tensor dim, as half-open [start, stop) runs.
Segments = tuple[tuple[int, int], ...]


def segments_size(segments: Segments) -> int:
    return sum(stop - start for start, stop in segments)


def _pick(segments: Segments, begin: int, end: int) -> list[tuple[int, int]]:
    """The runs covering positions [begin, end) of the index list ``segments``."""
    picked, pos = [], 0
    for start, stop in segments:
        n = stop - start
        lo, hi = max(begin, pos), min(end, pos + n)
        if lo < hi:
            picked.append((start + lo - pos, start + hi - pos))
        pos += n
    return picked


def merge_runs(runs: list[tuple[int, int]]) -> Segments:
    """Adjacent runs joined into one (``((0, 0),)`` for none)."""
    merged: list[tuple[int, int]] = []
    for start, stop in runs:
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], stop)
        else:
            merged.append((start, stop))
    return tuple(merged) if merged else ((0, 0),)


def chunk_bounds(length: int, n: int, index: int) -> tuple[int, int]:
    """``torch.chunk`` geometry: piece ``index`` of ``n`` is [i*c, min((i+1)*c, length))."""
    chunk = -(-length // n) if length else 0
    return min(index * chunk, length), min((index + 1) * chunk, length)


@cached(PER_LAYOUT)
def chunk_sizes(length: int, n: int) -> tuple[int, ...]:
    """The sizes of the ``n`` pieces of ``length`` under ``torch.chunk`` geometry (trailing
    ones empty), as ``split_with_sizes`` takes them."""
    return tuple(b - a for a, b in (chunk_bounds(length, n, k) for k in range(n)))


def split_segments(segments: Segments, placement: Shard, n: int, index: int) -> Segments:
    """The part of ``segments`` that coordinate ``index`` of ``n`` keeps under ``placement``."""
    length = segments_size(segments)
    if isinstance(placement, RaggedShard):
        sizes = placement.sizes
        if len(sizes) != n or sum(sizes) != length:
            raise InvalidPlacementError(
                f"{placement!r} needs one size per device of the mesh dim ({n}) summing to the "
                f"size {length} of dim {placement.dim}, got {len(sizes)} sizes summing to "
                f"{sum(sizes)}"
            )
        lo = sum(sizes[:index])
        return merge_runs(_pick(segments, lo, lo + sizes[index]))
    if isinstance(placement, InterleavedShard):  # torch.chunk in k blocks, each in n pieces
        runs: list[tuple[int, int]] = []
        for j in range(placement.interleaved_size):
            b_lo, b_hi = chunk_bounds(length, placement.interleaved_size, j)
            lo, hi = chunk_bounds(b_hi - b_lo, n, index)
            runs.extend(_pick(segments, b_lo + lo, b_lo + hi))
        return merge_runs(runs)
    lo, hi = chunk_bounds(length, n, index)
    return merge_runs(_pick(segments, lo, hi))


def compute_local_shape_and_global_offset(
    global_shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """PyTorch's ``torch.distributed.tensor._utils`` helper: the local shape of this process's
    (first) device's piece and, per dim, the global index its piece starts at (the dim's size
    for an empty piece of a sharded dim); ``((0,), ())`` on a process outside the mesh."""
    coord = mesh.get_coordinate()
    if coord is None:
        return (0,), ()
    if len(placements) != mesh.ndim:
        raise InvalidPlacementError(
            f"{len(placements)} placements {list(placements)} for the {mesh.ndim}-D {mesh}"
        )
    return _compute_local_shape_and_global_offset(global_shape, mesh.shape, coord, placements)


def _compute_local_shape_and_global_offset(
    global_shape: Sequence[int], mesh_shape: Sequence[int], my_coordinate: Sequence[int],
    placements: Sequence[Placement],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """PyTorch's private ``_utils`` helper on plain values: ``compute_local_shape_and_global_
    offset`` for mesh coordinate ``my_coordinate`` of a mesh of ``mesh_shape``."""
    shape = tuple(int(s) for s in global_shape)
    if not len(placements) == len(mesh_shape) == len(my_coordinate):
        raise InvalidPlacementError(
            f"{len(placements)} placements {list(placements)} for a mesh of shape "
            f"{tuple(mesh_shape)} at coordinate {list(my_coordinate)}"
        )
    normal = tuple(normalize_placement(p, len(shape)) for p in placements)
    segments = shard_segments(
        shape, tuple(int(n) for n in mesh_shape), normal, tuple(int(c) for c in my_coordinate)
    )
    sharded = {p.dim for p in normal if isinstance(p, Shard)}
    sizes = tuple(segments_size(seg) for seg in segments)
    offsets = tuple(
        seg[0][0] if size else (shape[d] if d in sharded else 0)
        for d, (seg, size) in enumerate(zip(segments, sizes, strict=True))
    )
    return sizes, offsets


def _even_shard_dims(
    shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]
) -> Iterator[tuple[int, int]]:
    """(tensor dim, mesh dim size) of each placement that shards, in mesh-dim order; only
    ``mesh.size(m)`` is read. Other placements than shards, Replicate and Partial raise."""
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            yield p.dim % max(len(shape), 1), mesh.size(m)
        elif not isinstance(p, (Replicate, Partial)):
            raise UnsupportedOpError(
                f"placement {p!r} (mesh dim {m}) of a tensor of shape {list(shape)}: only shards, "
                f"Replicate and Partial have a global or local tensor info"
            )


def compute_global_tensor_info(
    tensor: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]
) -> tuple[list[int], list[int]]:
    """PyTorch's ``_utils`` helper: the global shape and stride of a DTensor whose every device
    holds a piece like ``tensor`` (even shards). A mesh dim of size n sharding tensor dim d
    multiplies d's size by n, and by n every other stride at least as large as d's."""
    shape, stride = list(tensor.shape), list(tensor.stride())
    for d, n in _even_shard_dims(shape, mesh, placements):
        shape[d] *= n
        stride = [s * n if i != d and s >= stride[d] else s for i, s in enumerate(stride)]
    return shape, stride


def compute_local_tensor_info(
    global_tensor: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]
) -> tuple[list[int], list[int]]:
    """PyTorch's ``_utils`` helper, the inverse of ``compute_global_tensor_info``: the shape and
    stride of each device's piece of ``global_tensor`` (each sharded dim divisible by its
    mesh dims' sizes)."""
    shape, stride = list(global_tensor.shape), list(global_tensor.stride())
    for d, n in _even_shard_dims(shape, mesh, placements):
        if shape[d] % n:
            raise InvalidPlacementError(
                f"dim {d} of size {shape[d]} of a tensor of shape {list(global_tensor.shape)} "
                f"does not split evenly over a mesh dim of size {n} (placements "
                f"{list(placements)})"
            )
        shape[d] //= n
        stride = [s // n if i != d and s >= stride[d] * n else s for i, s in enumerate(stride)]
    return shape, stride

@cached(PER_SEGMENT)
def shard_segments(
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    placements: tuple[Placement, ...],
    coord: tuple[int, ...],
) -> tuple[Segments, ...]:
    """Geometry of one device: mesh dims split their tensor dims in mesh-dim order."""
    dims: list[Segments] = [((0, size),) for size in shape]
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            dims[placement.dim] = split_segments(
                dims[placement.dim], placement, mesh_shape[mesh_dim], coord[mesh_dim]
            )
    return tuple(dims)


def extract_local(tensor: torch.Tensor, segments: tuple[Segments, ...]) -> torch.Tensor:
    """The sub-tensor of ``tensor`` at the given per-dim index runs (a view where possible)."""
    out = tensor
    for dim, runs in enumerate(segments):
        if len(runs) == 1:
            start, stop = runs[0]
            if (start, stop) != (0, out.shape[dim]):
                out = out.narrow(dim, start, stop - start)
        else:
            out = torch.cat([out.narrow(dim, a, b - a) for a, b in runs], dim=dim)
    return out


# ----- every device at once --------------------------------------------------------------------

Placements = tuple[Placement, ...]
Box = tuple[tuple[int, int], ...]  # one (start, stop) per tensor dim


class Pieces(NamedTuple):
    """Every device's share of a tensor under one placement tuple, in ``mesh.device_ids``
    order."""

    segments: tuple[tuple[Segments, ...], ...]
    shapes: tuple[tuple[int, ...], ...]
    numels: tuple[int, ...]
    # per tensor dim, per device: the elements of its piece per index along that dim
    slices: tuple[tuple[int, ...], ...]
    # per device its piece as one box, where every piece is one (at most one run per dim)
    boxes: tuple[Box, ...] | None
    # per device its box as one number (``box_key``: equal keys, equal boxes), or None
    keys: tuple[int, ...] | None


@cached(PER_PIECE)
def pieces(mesh: DeviceMesh, shape: tuple[int, ...], placements: Placements) -> Pieces:
    """Every device's ``Pieces`` under ``placements`` (shared by every plan on that mesh and
    shape)."""
    segments = tuple(
        shard_segments(shape, mesh.shape, placements, mesh.coordinate_of(d))
        for d in mesh.device_ids
    )
    shapes = tuple(tuple(sum(b - a for a, b in runs) for runs in s) for s in segments)
    slices = tuple(tuple(prod(s[:d] + s[d + 1:]) for s in shapes) for d in range(len(shape)))
    boxes = keys = None
    if all(len(runs) <= 1 for s in segments for runs in s):
        boxes = tuple(tuple(runs[0] if runs else (0, 0) for runs in s) for s in segments)
        keys = tuple(box_key(box, shape) for box in boxes)
    return Pieces(segments, shapes, tuple(prod(s) for s in shapes), slices, boxes, keys)


def box_key(box: Box, shape: tuple[int, ...]) -> int:
    """``box`` of a tensor of ``shape`` as one number: its corners in mixed radix (each
    corner of a dim of size ``n`` is one of ``n + 1`` values), so equal keys mean equal boxes
    and the key depends on the data alone."""
    key = 0
    for (start, stop), n in zip(box, shape, strict=True):
        key = (key * (n + 1) + start) * (n + 1) + stop
    return key


def box_overlap(a: Box, b: Box) -> int:
    """How many elements two boxes share."""
    common = 1
    for (a0, a1), (b0, b1) in zip(a, b, strict=True):
        span = (a1 if a1 < b1 else b1) - (a0 if a0 > b0 else b0)
        if span <= 0:
            return 0
        common *= span
    return common


def runs_overlap(a: Segments, b: Segments) -> int:
    """How many indices two run lists share."""
    return sum(max(0, min(y1, y2) - max(x1, x2)) for x1, y1 in a for x2, y2 in b)


def spans(
    shape: tuple[int, ...], held: Sequence[tuple[Segments, ...]]
) -> list[list[tuple[int, int]]]:
    """Per tensor dim, the intervals between every run boundary of the pieces ``held``."""
    cuts = [{0, size} for size in shape]
    for segments in held:
        for dim, runs in enumerate(segments):
            for a, b in runs:
                cuts[dim].update((a, b))
    edges = [sorted(c) for c in cuts]
    return [list(zip(e[:-1], e[1:], strict=False)) or [(0, 0)] for e in edges]


def blocks(shape: tuple[int, ...], held: Sequence[tuple[Segments, ...]]) -> list[Box]:
    """The boxes of global indices cut on every run boundary of the pieces ``held``: each
    piece is a union of whole blocks."""
    return list(itertools.product(*spans(shape, held)))


def covers(segments: tuple[Segments, ...], block: Box) -> bool:
    """Whether a piece holds the whole ``block``."""
    return all(
        any(a <= lo and hi <= b for a, b in runs)
        for runs, (lo, hi) in zip(segments, block, strict=True)
    )


def cover_masks(
    held: Sequence[tuple[Segments, ...]], dim: int, intervals: list[tuple[int, int]]
) -> list[int]:
    """Per interval of ``dim``, the bit mask of the pieces whose runs cover it."""
    masks = []
    for lo, hi in intervals:
        mask = 0
        for i, segments in enumerate(held):
            if any(a <= lo and hi <= b for a, b in segments[dim]):
                mask |= 1 << i
        masks.append(mask)
    return masks


def bits(mask: int) -> list[int]:
    """The positions of the set bits of ``mask``, lowest first."""
    return [i for i in range(mask.bit_length()) if mask >> i & 1]


# a block between two layouts: (its index per tensor dim, the box, its size, the devices that
# need it, the holders of each Partial term in term order), devices as bit masks over their
# positions in ``mesh.device_ids``
Block = tuple[tuple[int, ...], Box, int, int, list[int]]


def block_holders(
    mesh: DeviceMesh, shape: tuple[int, ...], before: Placements, after: Placements
) -> Iterator[Block]:
    """The non-empty blocks some device needs going from ``before`` to the Partial-free
    ``after``, with who needs them and who holds each of their Partial terms."""
    coords = [mesh.coordinate_of(d) for d in mesh.device_ids]
    partial = [m for m, p in enumerate(before) if p.is_partial() and mesh.shape[m] > 1]
    old, new = pieces(mesh, shape, before).segments, pieces(mesh, shape, after).segments
    intervals = spans(shape, [*old, *new])
    old_masks = [cover_masks(old, dim, s) for dim, s in enumerate(intervals)]
    new_masks = [cover_masks(new, dim, s) for dim, s in enumerate(intervals)]
    term_masks: dict[tuple[int, ...], int] = {}
    for i, c in enumerate(coords):
        term = tuple(c[m] for m in partial)
        term_masks[term] = term_masks.get(term, 0) | 1 << i
    terms = [term_masks[t] for t in sorted(term_masks)]
    everyone = (1 << len(coords)) - 1
    for index in itertools.product(*(range(len(s)) for s in intervals)):
        need, hold = everyone, everyone
        for dim, k in enumerate(index):
            need &= new_masks[dim][k]
            hold &= old_masks[dim][k]
        box = tuple(s[k] for s, k in zip(intervals, index, strict=True))
        size = prod(b - a for a, b in box)
        if need and size:
            yield index, box, size, need, [hold & t for t in terms if hold & t]


# ----- the count -------------------------------------------------------------------------------


def block_transfers(terms: int, needers: int, size: int, lacking: int, held: int) -> int:
    """The elements all devices must receive to bring ``size`` elements, each needed by
    ``needers`` devices, to where they are needed.

    With at most one Partial term every needer that lacks an element receives it once:
    ``lacking`` counts the (needer, element) pairs where the needer lacks it. With ``terms``
    distinct Partial terms, a reduction tree rooted at a needer takes ``terms - 1`` transfers
    (``terms`` when no needer holds a term) and handing the result to the other needers
    ``needers - 1``: ``held`` counts the elements some needer holds a term of. The count is
    linear in ``size``, ``lacking`` and ``held``, so it counts a union of blocks with the same
    ``terms`` and ``needers`` as well as one block."""
    if terms <= 1:
        return lacking
    return (terms + needers - 1) * size - held


def lower_bound_bytes(
    mesh: DeviceMesh, shape: tuple[int, ...], itemsize: int, source: Placements,
    target: Placements,
) -> int:
    """The fewest bytes all devices together must receive to go from ``source`` to ``target``
    (a plan's ``global_bytes`` can never be lower): ``block_transfers`` per block.

    A target Partial("sum") group needs the value on one member only (the others may hold
    zeros); a Partial kept on a mesh dim needs no reduction there."""
    coords = [mesh.coordinate_of(d) for d in mesh.device_ids]
    kept = {m for m, p in enumerate(source) if p.is_partial() and target[m] == p}
    partial_dims = [
        m for m, p in enumerate(source) if p.is_partial() and mesh.shape[m] > 1 and m not in kept
    ]
    summed = [
        m for m, p in enumerate(target)
        if isinstance(p, Partial) and p.zeros_elsewhere and m not in kept
    ]
    src = [shard_segments(shape, mesh.shape, source, c) for c in coords]
    dst = [shard_segments(shape, mesh.shape, target, c) for c in coords]
    total = 0
    for block in blocks(shape, src + dst):
        size = prod(b - a for a, b in block)
        if size == 0:
            continue
        holders = {i for i, s in enumerate(src) if covers(s, block)}
        needers = {i for i, s in enumerate(dst) if covers(s, block)}
        if summed:  # one needer per target sum group, a holder where the group has one
            groups: dict[tuple[int, ...], int] = {}
            for i in sorted(needers, key=lambda i: i not in holders):
                groups.setdefault(tuple(c for m, c in enumerate(coords[i]) if m not in summed), i)
            needers = set(groups.values())
        terms = {tuple(coords[i][m] for m in partial_dims) for i in holders}
        total += block_transfers(
            len(terms), len(needers), size, len(needers - holders) * size,
            size if needers & holders else 0,
        ) * itemsize
    return total
