"""Placement types: how a tensor sits on one mesh dimension (PyTorch DTensor's model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .errors import InvalidPlacementError

ReduceOp = Literal["sum", "avg", "max", "min"]
REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "max", "min")


class Placement:
    """Base of all placements; the predicates mirror PyTorch's."""

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False


@dataclass(frozen=True)
class Shard(Placement):
    """The tensor dim ``dim`` is split in ``torch.chunk`` pieces over the mesh dim."""

    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise InvalidPlacementError(f"Shard(dim) needs an int dim, got {self.dim!r}")

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"


@dataclass(frozen=True, repr=False)
class InterleavedShard(Shard):
    """veScale's interleaved shard: dim viewed as [interleaved_size, size // interleaved_size]
    and the second part sharded, so each device keeps a piece of every interleaved block
    (a merged QKV weight keeps its q, k and v parts together on every device)."""

    interleaved_size: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.interleaved_size, int) or self.interleaved_size < 1:
            raise InvalidPlacementError(
                f"InterleavedShard(dim={self.dim}) needs a positive int interleaved_size, "
                f"got {self.interleaved_size!r}"
            )

    def __repr__(self) -> str:
        return f"InterleavedShard(dim={self.dim}, interleaved_size={self.interleaved_size})"


@dataclass(frozen=True)
class Replicate(Placement):
    """Every device of the mesh dim holds the whole tensor."""

    def is_replicate(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Partial(Placement):
    """Devices of the mesh dim hold values whose reduction (sum, avg, max, min) is the tensor."""

    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op not in REDUCE_OPS:
            raise InvalidPlacementError(
                f"Partial(reduce_op={self.reduce_op!r}) is not supported; use one of {REDUCE_OPS}"
            )

    def is_partial(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op!r})" if self.reduce_op != "sum" else "Partial()"


def normalize_placement(placement: Placement, ndim: int) -> Placement:
    """Return ``placement`` with a negative shard dim made positive for a rank-``ndim`` tensor."""
    if not isinstance(placement, Shard):
        return placement
    dim = placement.dim
    if not -ndim <= dim < ndim:
        raise InvalidPlacementError(
            f"{placement!r} is out of range for a tensor of rank {ndim} "
            f"(valid dims are {-ndim}..{ndim - 1})"
            if ndim
            else f"{placement!r} cannot place a scalar (rank 0): a scalar can only be replicated"
        )
    if dim >= 0:
        return placement
    if isinstance(placement, InterleavedShard):
        return InterleavedShard(dim + ndim, placement.interleaved_size)
    return Shard(dim + ndim)
