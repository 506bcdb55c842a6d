"""``DTensorSpec``: where a distributed tensor lives (mesh, placements, global metadata); the
indices each device holds come from ``geometry``."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .caches import PER_LAYOUT, register
from .errors import InvalidPlacementError, MeshError
from .geometry import Segments, segments_size, shard_segments
from .placements import InterleavedShard, Placement, RaggedShard, Shard, normalize_placement

if TYPE_CHECKING:  # only named: a spec holds a mesh, it does not build one
    from .mesh import DeviceMesh

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

    @property
    def dim_map(self) -> list[int]:
        """PyTorch's private ``DTensorSpec.dim_map``, read-only: per tensor dim, the mesh dim
        that shards it (in any layout: ``Shard``, interleaved ``_StridedShard`` or ragged), or
        -1 where no mesh dim does (replicated, or pending a reduction: a ``Partial`` mesh dim
        appears nowhere in it). As in torch, a tensor dim sharded by two mesh dims has no
        answer (``[Shard(0), Shard(0)]``): ``InvalidPlacementError``, a ``ValueError``."""
        found = [-1] * self.ndim
        for mesh_dim, p in enumerate(self.placements):
            if not isinstance(p, Shard):
                continue
            dim = normalize_placement(p, self.ndim).dim
            if found[dim] >= 0:
                raise InvalidPlacementError(
                    f"dim_map of {self}: tensor dim {dim} is sharded by mesh dims "
                    f"{found[dim]} and {mesh_dim}; dim_map names one mesh dim per tensor dim"
                )
            found[dim] = mesh_dim
        return found

    def with_placements(self, placements: Sequence[Placement]) -> DTensorSpec:
        return DTensorSpec(self.mesh, tuple(placements), self.tensor_meta)

    def local_segments(self, device_id: int) -> tuple[Segments, ...]:
        """Per tensor dim, the global index runs held by ``device_id``."""
        return shard_segments(
            tuple(self.shape), self.mesh.shape, self.placements, self.mesh.coordinate_of(device_id)
        )

    def local_shape(self, device_id: int) -> torch.Size:
        return torch.Size(segments_size(s) for s in self.local_segments(device_id))

    def is_replicated(self) -> bool:
        return all(p.is_replicate() for p in self.placements)

    def __repr__(self) -> str:
        shape = "?" if self.tensor_meta is None else list(self.tensor_meta.shape)
        return f"DTensorSpec(shape={shape}, placements={list(self.placements)}, mesh={self.mesh})"


def pending_sum(placements: Sequence[Placement]) -> bool:
    """Whether ``placements`` leave a sum or an average pending (``Partial("sum"/"avg")``)."""
    return any(p.is_partial() and p.reduce_op in ("sum", "avg") for p in placements)


# (shape, mesh, placements, sizes) -> the placements normalized, for those that passed
_VALIDATED: dict[tuple, tuple[Placement, ...]] = {}
_VALIDATED_MAX = PER_LAYOUT
register("shardwise.spec._VALIDATED", _VALIDATED.clear)


def validate_placements(
    shape: Sequence[int],
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    *,
    described: str | None = None,
    sizes: bool = True,
) -> tuple[Placement, ...]:
    """Check that ``placements`` fit a tensor of ``shape`` on ``mesh``; return them normalized.
    ``described`` names the tensor in error messages (default: its shape); ``sizes=False``
    checks the placements without the sizes of ``shape`` (only its rank is known yet). Every
    parallel style's hook asks this: a combination that passed is remembered (interleaved and
    ragged shards, whose check reads this rank's devices, are checked every time)."""
    try:
        key: tuple | None = (tuple(shape), mesh, tuple(placements), sizes)
        known = _VALIDATED.get(key)
    except TypeError:  # not placements at all: the checks below say what is wrong
        key = known = None
    if known is not None:
        return known
    normalized = _validated(shape, mesh, placements, described, sizes)
    if key is not None and not any(isinstance(p, (InterleavedShard, RaggedShard))
                                   for p in normalized):
        if len(_VALIDATED) >= _VALIDATED_MAX:  # oldest out, as every hand-rolled cache
            with contextlib.suppress(KeyError, StopIteration, RuntimeError):  # another thread
                del _VALIDATED[next(iter(_VALIDATED))]
        _VALIDATED[key] = normalized
    return normalized


def _validated(
    shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement],
    described: str | None, sizes: bool,
) -> tuple[Placement, ...]:
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
            f"({tensor}): give exactly one placement per mesh dim (placements and the mesh's "
            f"dims must have the same length)"
        )
    for p in placements:
        if not isinstance(p, Placement):
            raise InvalidPlacementError(
                f"{p!r} is not a placement; use Shard(dim), Replicate(), Partial(op) or "
                f"InterleavedShard(dim, size) or RaggedShard(dim, sizes) ({tensor}, {mesh})"
            )
    try:
        normalized = tuple(normalize_placement(p, len(shape)) for p in placements)
    except InvalidPlacementError as err:
        raise InvalidPlacementError(
            f"{err} ({tensor}, placements {list(placements)}, {mesh})"
        ) from None
    if sizes and any(isinstance(p, (InterleavedShard, RaggedShard)) for p in normalized):
        try:
            ragged = any(isinstance(p, RaggedShard) for p in normalized)
            for device_id in mesh.device_ids if ragged else (
                mesh.local_device_ids or mesh.device_ids[:1]
            ):
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


def make_tensor_meta(tensor: torch.Tensor) -> TensorMeta:
    return TensorMeta(tensor.shape, tuple(tensor.stride()), tensor.dtype)


def contiguous_meta(shape: Sequence[int], dtype: torch.dtype) -> TensorMeta:
    """Metadata of a contiguous tensor of ``shape``."""
    stride, acc = [], 1
    for size in reversed(list(shape)):
        stride.append(acc)
        acc *= max(size, 1)
    return TensorMeta(torch.Size(shape), tuple(reversed(stride)), dtype)
