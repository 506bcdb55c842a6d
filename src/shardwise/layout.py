"""TF DTensor's ``Layout``: one sharding spec per tensor axis, naming a mesh dim or none.

A Layout is the per-tensor-axis view of what PyTorch placements say per mesh dim. Mesh dims the
layout does not name are replicated. ``to_placements`` / ``from_placements`` convert between the
two (spec Part 3.1); sum-``Partial``, interleaved shards and two mesh dims on one axis have no
Layout and raise ``LayoutError``.
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import InvalidPlacementError, LayoutError
from .mesh import DeviceMesh
from .placements import InterleavedShard, Placement, Replicate, Shard, normalize_placement

UNSHARDED = "unsharded"
MATCH = "match"


class Layout:
    """How a tensor of rank ``len(sharding_specs)`` sits on ``mesh``: axis i is split over the
    mesh dim named ``sharding_specs[i]``, or whole (``UNSHARDED``), or kept as it is (``MATCH``,
    only meaningful for ``relayout``)."""

    def __init__(self, sharding_specs: Sequence[str], mesh: DeviceMesh) -> None:
        if not isinstance(mesh, DeviceMesh):
            raise LayoutError(
                f"a Layout needs a shardwise.DeviceMesh, got {type(mesh).__name__} {mesh!r} "
                f"(sharding_specs {sharding_specs!r})"
            )
        if isinstance(sharding_specs, str) or not isinstance(sharding_specs, Sequence):
            raise LayoutError(
                f"sharding_specs must be a list of strings (one per tensor axis), got "
                f"{sharding_specs!r} for {mesh}"
            )
        specs = tuple(sharding_specs)
        valid = (UNSHARDED, MATCH, *(mesh.mesh_dim_names or ()))
        for spec in specs:
            if not isinstance(spec, str) or spec not in valid:
                raise LayoutError(
                    f"sharding spec {spec!r} in {list(specs)} is neither {UNSHARDED!r}, "
                    f"{MATCH!r} nor a dim of {mesh}; valid specs are {list(valid)}"
                )
        named = [s for s in specs if s not in (UNSHARDED, MATCH)]
        for name in named:
            if named.count(name) > 1:
                raise LayoutError(
                    f"mesh dimension {name!r} was repeated in sharding specs {list(specs)}: "
                    f"a mesh dim may shard at most one tensor axis of a layout ({mesh})"
                )
        self._specs = specs
        self._mesh = mesh

    # ----- factories -----------------------------------------------------------------------
    @classmethod
    def replicated(cls, mesh: DeviceMesh, rank: int) -> Layout:
        """Every axis whole on every device."""
        return cls([UNSHARDED] * _check_rank(rank, mesh), mesh)

    @classmethod
    def batch_sharded(cls, mesh: DeviceMesh, batch_dim: str, rank: int, axis: int = 0) -> Layout:
        """Tensor axis ``axis`` (the batch) split over mesh dim ``batch_dim``, the rest whole."""
        specs = [UNSHARDED] * _check_rank(rank, mesh)
        specs[_check_axis(axis, rank, mesh)] = batch_dim
        return cls(specs, mesh)

    @classmethod
    def inner_sharded(cls, mesh: DeviceMesh, inner_dim: str, rank: int) -> Layout:
        """The last tensor axis split over mesh dim ``inner_dim``, the rest whole."""
        specs = [UNSHARDED] * _check_rank(rank, mesh)
        specs[_check_axis(-1, rank, mesh)] = inner_dim
        return cls(specs, mesh)

    @classmethod
    def from_placements(
        cls, placements: Sequence[Placement], mesh: DeviceMesh, rank: int
    ) -> Layout:
        """The Layout of a rank-``rank`` tensor with PyTorch ``placements`` on ``mesh``."""
        placements = tuple(placements)

        def fail(why: str) -> LayoutError:
            return LayoutError(f"placements {list(placements)} on {mesh} have no TF Layout: {why}")

        if not isinstance(mesh, DeviceMesh):
            raise LayoutError(f"from_placements needs a shardwise.DeviceMesh, got {mesh!r}")
        if len(placements) != mesh.ndim:
            raise fail(f"expected one placement per mesh dim ({mesh.ndim})")
        specs = [UNSHARDED] * _check_rank(rank, mesh)
        for mesh_dim, placement in enumerate(placements):
            if isinstance(placement, Replicate):
                continue
            if isinstance(placement, InterleavedShard):
                raise fail(f"interleaved shard {placement!r} is not a contiguous split")
            if not isinstance(placement, Shard):
                raise fail(f"{placement!r} (reduce the tensor to Replicate or Shard first)")
            try:
                axis = normalize_placement(placement, rank).dim
            except InvalidPlacementError as err:
                raise fail(str(err)) from None
            if mesh.mesh_dim_names is None:
                raise fail(f"mesh dim {mesh_dim} has no name for the layout to refer to")
            if specs[axis] != UNSHARDED:
                raise fail(
                    f"tensor axis {axis} is split over two mesh dims ({specs[axis]!r} and "
                    f"{mesh.mesh_dim_names[mesh_dim]!r}); a layout allows one per axis"
                )
            specs[axis] = mesh.mesh_dim_names[mesh_dim]
        return cls(specs, mesh)

    # ----- queries -------------------------------------------------------------------------
    @property
    def mesh(self) -> DeviceMesh:
        return self._mesh

    @property
    def sharding_specs(self) -> list[str]:
        return list(self._specs)

    @property
    def rank(self) -> int:
        return len(self._specs)

    def num_shards(self, axis: int) -> int:
        """How many blocks tensor axis ``axis`` is split into: 1 unsharded, -1 for MATCH."""
        spec = self._specs[_check_axis(axis, self.rank, self._mesh)]
        if spec == UNSHARDED:
            return 1
        if spec == MATCH:
            return -1
        return self._mesh.dim_size(spec)

    @property
    def shape(self) -> list[int]:
        """The shard grid: ``num_shards`` of every axis."""
        return [self.num_shards(i) for i in range(self.rank)]

    def is_fully_replicated(self) -> bool:
        """True when every axis is in one piece (layouts over size-1 mesh dims included)."""
        return all(n == 1 for n in self.shape)

    def to_placements(self) -> tuple[Placement, ...]:
        """One placement per mesh dim: ``Shard(i)`` where axis i names that dim, else Replicate."""
        if MATCH in self._specs:
            raise LayoutError(
                f"{self} has {MATCH!r} axes, which have no placements of their own; "
                f"use relayout, which keeps their current sharding"
            )
        axis_of = {name: i for i, name in enumerate(self._specs) if name != UNSHARDED}
        names = self._mesh.mesh_dim_names or ()
        placements: list[Placement] = [Replicate()] * self._mesh.ndim
        for mesh_dim, name in enumerate(names):
            if name in axis_of:
                placements[mesh_dim] = Shard(axis_of[name])
        return tuple(placements)

    def offset_to_shard(self) -> list[tuple[int, ...]]:
        """TF: for each device (by its offset in the mesh's row-major order) the index of the
        shard it holds, one block number per tensor axis (0 for an unsharded axis)."""
        if MATCH in self._specs:
            raise LayoutError(f"{self} has {MATCH!r} axes, which hold no shard of their own")
        where = self._mesh.unravel_index()
        return [
            tuple(0 if s == UNSHARDED else where[i][s] for s in self._specs)
            for i in self._mesh.device_ids
        ]

    def delete(self, dims: Sequence[int]) -> Layout:
        """TF: this layout without the tensor axes ``dims`` (as after reducing them away)."""
        drop = {_check_axis(d, self.rank, self._mesh) for d in dims}
        return Layout([s for i, s in enumerate(self._specs) if i not in drop], self._mesh)

    def to_string(self) -> str:
        """TF's serialized layout ``sharding_specs:x,unsharded, mesh:<mesh.to_string()>``."""
        return f"sharding_specs:{','.join(self._specs)}, mesh:{self._mesh.to_string()}"

    @classmethod
    def from_string(cls, layout_str: str) -> Layout:
        """The layout ``to_string`` wrote."""
        head, sep, mesh_str = str(layout_str).partition(", mesh:")
        if not sep or not head.startswith("sharding_specs:"):
            raise LayoutError(
                f"cannot read a layout from {layout_str!r}: expected "
                f"'sharding_specs:<specs>, mesh:<mesh>'"
            )
        specs = head[len("sharding_specs:"):]
        return cls(specs.split(",") if specs else [], DeviceMesh.from_string(mesh_str))

    # ----- identity ------------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Layout):
            return NotImplemented
        return self._specs == other._specs and self._mesh == other._mesh

    def __hash__(self) -> int:
        return hash((self._specs, self._mesh))

    def __repr__(self) -> str:
        return f"Layout({list(self._specs)}, mesh={self._mesh})"


def _check_rank(rank: int, mesh: DeviceMesh) -> int:
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise LayoutError(f"a layout rank must be an int >= 0, got {rank!r} (mesh {mesh})")
    return rank


def _check_axis(axis: int, rank: int, mesh: DeviceMesh) -> int:
    if not isinstance(axis, int) or not -rank <= axis < rank:
        raise LayoutError(
            f"tensor axis {axis!r} is out of range for a rank-{rank} layout on {mesh}"
        )
    return axis % rank
