"""``DTensorSpec`` and shard geometry: which global indices every device's component holds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from .errors import InvalidPlacementError, MeshError
from .mesh import DeviceMesh
from .placements import InterleavedShard, Placement, Shard, normalize_placement

# An ordered list of global indices along one tensor dim, as half-open [start, stop) runs.
Segments = tuple[tuple[int, int], ...]

LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class TensorMeta:
    """Global shape, stride and dtype of a distributed tensor."""

    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class DTensorSpec:
    """Where a distributed tensor lives: its mesh, one placement per mesh dim, global metadata."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    tensor_meta: TensorMeta | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "placements", tuple(self.placements))

    def __hash__(self) -> int:  # cached: specs key the dispatch and plan caches
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.mesh, self.placements, self.tensor_meta))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict:
        """The fields only: the cached hash (of strings, salted per process) and marks are
        recomputed where the spec is loaded."""
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    @property
    def shape(self) -> torch.Size:
        if self.tensor_meta is None:
            raise ValueError(f"{self} has no tensor_meta")
        return self.tensor_meta.shape

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def component_dtype(self) -> torch.dtype:
        """The dtype the components are held in: the tensor's, except that a float16/bfloat16
        value pending a sum or average holds float32 pieces (torch accumulates half values in
        float32; rounding each piece first could overflow or lose what later cancels), so the
        reduction rounds once."""
        held = self.__dict__.get("_component_dtype")
        if held is None:
            held = self.tensor_meta.dtype
            if held in LOW_PRECISION and pending_sum(self.placements):
                held = torch.float32
            object.__setattr__(self, "_component_dtype", held)
        return held

    def with_placements(self, placements: Sequence[Placement]) -> DTensorSpec:
        return DTensorSpec(self.mesh, tuple(placements), self.tensor_meta)

    def local_segments(self, device_id: int) -> tuple[Segments, ...]:
        """Per tensor dim, the global index runs held by ``device_id``."""
        return shard_segments(
            tuple(self.shape), self.mesh.shape, self.placements, self.mesh.coordinate_of(device_id)
        )

    def local_shape(self, device_id: int) -> torch.Size:
        return torch.Size(_length(s) for s in self.local_segments(device_id))

    def is_replicated(self) -> bool:
        return all(p.is_replicate() for p in self.placements)

    def __repr__(self) -> str:
        shape = "?" if self.tensor_meta is None else list(self.tensor_meta.shape)
        return f"DTensorSpec(shape={shape}, placements={list(self.placements)}, mesh={self.mesh})"


def pending_sum(placements: Sequence[Placement]) -> bool:
    """Whether ``placements`` leave a sum or an average pending (``Partial("sum"/"avg")``)."""
    return any(p.is_partial() and p.reduce_op in ("sum", "avg") for p in placements)


def _length(segments: Segments) -> int:
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


def _merge(runs: list[tuple[int, int]]) -> Segments:
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


def split_segments(segments: Segments, placement: Shard, n: int, index: int) -> Segments:
    """The part of ``segments`` that coordinate ``index`` of ``n`` keeps under ``placement``."""
    length = _length(segments)
    if isinstance(placement, InterleavedShard):
        k = placement.interleaved_size
        if length % k:
            raise InvalidPlacementError(
                f"{placement!r} needs the sharded size {length} to be divisible by "
                f"interleaved_size={k}"
            )
        block = length // k
        lo, hi = chunk_bounds(block, n, index)
        runs: list[tuple[int, int]] = []
        for j in range(k):
            runs.extend(_pick(segments, j * block + lo, j * block + hi))
        return _merge(runs)
    lo, hi = chunk_bounds(length, n, index)
    return _merge(_pick(segments, lo, hi))


@lru_cache(maxsize=65536)
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


def validate_placements(
    shape: Sequence[int],
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    *,
    described: str | None = None,
) -> tuple[Placement, ...]:
    """Check that ``placements`` fit a tensor of ``shape`` on ``mesh``; return them normalized.
    ``described`` names the tensor in error messages (default: its shape)."""
    tensor = described or f"tensor shape {list(shape)}"
    if isinstance(placements, Placement) or not isinstance(placements, (list, tuple)):
        raise InvalidPlacementError(
            f"placements must be a list with one placement per mesh dim of {mesh}, e.g. "
            f"[{placements!r}], got {placements!r} ({tensor})"
        )
    placements = tuple(placements)
    if len(placements) != mesh.ndim:
        raise InvalidPlacementError(
            f"got {len(placements)} placements {list(placements)} for the {mesh.ndim}-D {mesh} "
            f"({tensor}): give exactly one placement per mesh dim"
        )
    for p in placements:
        if not isinstance(p, Placement):
            raise InvalidPlacementError(
                f"{p!r} is not a placement; use Shard(dim), Replicate(), Partial(op) or "
                f"InterleavedShard(dim, size) ({tensor}, {mesh})"
            )
    try:
        normalized = tuple(normalize_placement(p, len(shape)) for p in placements)
    except InvalidPlacementError as err:
        raise InvalidPlacementError(
            f"{err} ({tensor}, placements {list(placements)}, {mesh})"
        ) from None
    if any(isinstance(p, InterleavedShard) for p in normalized):
        try:
            for device_id in mesh.local_device_ids or mesh.device_ids[:1]:
                shard_segments(tuple(shape), mesh.shape, normalized, mesh.coordinate_of(device_id))
        except InvalidPlacementError as err:
            raise InvalidPlacementError(
                f"{err} (tensor shape {list(shape)}, placements {list(placements)}, {mesh})"
            ) from None
    return normalized


def check_same_mesh(a: DeviceMesh, b: DeviceMesh, what: str) -> None:
    """Raise a clear error when two tensors of one operation live on different meshes."""
    if a != b:
        raise MeshError(f"{what}: tensors are on different meshes, {a} and {b}")


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


def make_tensor_meta(tensor: torch.Tensor) -> TensorMeta:
    return TensorMeta(tensor.shape, tuple(tensor.stride()), tensor.dtype)


def contiguous_meta(shape: Sequence[int], dtype: torch.dtype) -> TensorMeta:
    """Metadata of a contiguous tensor of ``shape``."""
    stride, acc = [], 1
    for size in reversed(list(shape)):
        stride.append(acc)
        acc *= max(size, 1)
    return TensorMeta(torch.Size(shape), tuple(reversed(stride)), dtype)
