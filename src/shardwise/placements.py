"""Placement types: how a tensor sits on one mesh dimension (PyTorch DTensor's model)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import InvalidPlacementError

REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "max", "min")
NORM = "norm"  # a pending p-norm is Partial("norm<p>"), e.g. Partial("norm2")


def norm_order(reduce_op: str) -> float | None:
    """The order p of a pending p-norm reduce op (``"norm2"`` -> 2.0), None for other ops."""
    if not reduce_op.startswith(NORM):
        return None
    try:
        p = float(reduce_op[len(NORM):])
    except ValueError:
        return None
    return p if p > 0 else None  # (0, inf]: "norminf" is the max of |x|


def norm_partial(p: float) -> Partial | None:
    """How local p-norms of the pieces of a sharded tensor combine into its p-norm, as a
    Partial: ``Partial("norm<p>")`` for p > 0 (the pieces' values v_i stand for
    (sum |v_i|^p)^(1/p): |x|^p, summed, then the p-th root; p = 1 sums |v_i|; p = inf,
    ``"norminf"``, takes max |v_i|), ``Partial("min")`` for p = -inf, ``Partial("sum")`` for
    p = 0 (counts); None where local norms do not combine (p < 0). Unlike ``Partial("max")``,
    a pending inf-norm stays pending under a further inf-norm (PyTorch gives Partial("max"))."""
    p = float(p)
    special = {-math.inf: "min", 0.0: "sum"}
    if p in special:
        return Partial(special[p])
    if p < 0:
        return None
    short = f"{p:g}"  # "inf" for p = inf
    return Partial(f"{NORM}{short if float(short) == p else repr(p)}")


class Placement:
    """Base of all placements; the predicates mirror PyTorch's: ``is_shard()`` is True only for
    the layout of PyTorch's ``Shard`` (contiguous ``torch.chunk`` pieces), so a reader that
    slices by ``is_shard()`` and ``dim`` never mistakes an interleaved or ragged layout for it;
    shardwise's own code asks ``is_any_shard`` for "some shard of this dim"."""

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
        return type(self) is Shard and (dim is None or dim == self.dim)

    @staticmethod
    def local_shard_size_and_offset(
        curr_local_size: int, num_chunks: int, rank: int
    ) -> tuple[int, int]:
        """PyTorch's: the size and offset of piece ``rank`` of ``num_chunks`` ``torch.chunk``
        pieces of a dim of ``curr_local_size`` (offset relative to that dim, clamped to it)."""
        chunk = -(-curr_local_size // num_chunks) if curr_local_size else 0
        lo, hi = min(rank * chunk, curr_local_size), min((rank + 1) * chunk, curr_local_size)
        return hi - lo, lo

    def _split_tensor(
        self,
        tensor: torch.Tensor,
        num_chunks: int,
        *,
        with_padding: bool = True,
        contiguous: bool = True,
    ) -> tuple[list[torch.Tensor], list[int]]:
        """PyTorch's private ``Shard._split_tensor``: the ``num_chunks`` ``torch.chunk`` pieces
        of ``tensor`` along ``dim`` (empty ones where the dim runs out) and, with
        ``with_padding``, each piece zero-padded at its end to the first piece's size and
        the pad sizes (else an empty list)."""
        if type(self) is not Shard:
            raise InvalidPlacementError(
                f"_split_tensor splits in contiguous torch.chunk pieces; {self!r} is not Shard"
            )
        dim = self.dim + tensor.ndim if self.dim < 0 else self.dim
        if not 0 <= dim < tensor.ndim or num_chunks < 1:
            raise InvalidPlacementError(
                f"{self!r} cannot split a tensor of shape {list(tensor.shape)} in "
                f"{num_chunks} pieces"
            )
        full = -(-tensor.shape[dim] // num_chunks)
        pieces, pads = [], []
        for piece in self._custom_chunk(tensor, num_chunks, dim):
            size = piece.shape[dim]
            if with_padding:
                pads.append(full - size)
                if full > size:
                    widths = [0, 0] * (tensor.ndim - 1 - dim) + [0, full - size]
                    piece = torch.nn.functional.pad(piece, widths)
            pieces.append(piece.contiguous() if contiguous else piece)
        return pieces, pads

    @staticmethod
    def _custom_chunk(tensor: torch.Tensor, num_chunks: int, dim: int) -> list[torch.Tensor]:
        """PyTorch's private ``Shard._custom_chunk``: the ``num_chunks`` ``torch.chunk`` pieces
        of ``tensor`` along ``dim``, empty ones where the dim runs out (views)."""
        if tensor.ndim == 0 or num_chunks < 1 or not -tensor.ndim <= dim < tensor.ndim:
            raise InvalidPlacementError(
                f"cannot chunk a tensor of shape {list(tensor.shape)} in {num_chunks} pieces "
                f"along dim {dim}"
            )
        length = tensor.shape[dim]
        return [tensor.narrow(dim, offset, size) for size, offset in (
            Shard.local_shard_size_and_offset(length, num_chunks, r) for r in range(num_chunks))]

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"


@dataclass(frozen=True, repr=False, init=False)
class InterleavedShard(Shard):
    """veScale's interleaved shard: dim viewed as [interleaved_size, size // interleaved_size]
    and the second part sharded, so each device keeps a piece of every interleaved block
    (a merged QKV weight keeps its q, k and v parts together on every device). A size that
    does not divide is cut as PyTorch cuts it: ``torch.chunk`` in ``interleaved_size`` blocks,
    each block ``torch.chunk``-ed over the mesh dim.

    It is the layout of PyTorch's ``_StridedShard(dim, split_factor=interleaved_size)`` (FSDP2
    over a tensor-parallel dim), and ``_StridedShard`` is this class: it takes torch's
    ``split_factor=``/``sf=`` keywords and answers ``split_factor``; like torch's, its
    ``is_shard()`` is False (the pieces are not contiguous)."""

    interleaved_size: int = 1

    def __init__(
        self,
        dim: int,
        interleaved_size: int | None = None,
        *,
        split_factor: int | None = None,
        sf: int | None = None,
    ) -> None:
        given = [k for k in (interleaved_size, split_factor, sf) if k is not None]
        if len(given) > 1:
            raise InvalidPlacementError(
                f"InterleavedShard(dim={dim}) takes one of interleaved_size, split_factor and "
                f"sf, got {interleaved_size!r}, {split_factor!r} and {sf!r}"
            )
        object.__setattr__(self, "dim", dim)
        object.__setattr__(self, "interleaved_size", given[0] if given else 1)
        self.__post_init__()

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.interleaved_size, int) or self.interleaved_size < 1:
            raise InvalidPlacementError(
                f"InterleavedShard(dim={self.dim}) needs a positive int interleaved_size, "
                f"got {self.interleaved_size!r}"
            )

    def local_shard_size_and_offset(  # type: ignore[override]
        self, curr_local_size: int, num_chunks: int, rank: int, offset_mode: int = 0
    ) -> tuple[int, int | list[int] | None]:
        """PyTorch's ``_StridedShard.local_shard_size_and_offset``: the size of piece ``rank``
        and, by ``offset_mode`` (0 FIRST, 1 ALL, 2 NONE), its first index (-1 if empty), all
        its indices, or None."""
        indices = [i for lo, size in self._runs(curr_local_size, num_chunks, rank)
                   for i in range(lo, lo + size)]
        mode = int(offset_mode)
        if mode == 2:
            return len(indices), None
        if mode == 1:
            return len(indices), indices
        return len(indices), indices[0] if indices else -1

    def _runs(self, length: int, num_chunks: int, rank: int) -> list[tuple[int, int]]:
        """(start, size) of each block's piece that ``rank`` keeps: ``torch.chunk`` of the dim
        in ``interleaved_size`` blocks, each block in ``num_chunks`` pieces (uneven included)."""
        runs = []
        for block in range(self.interleaved_size):
            b_size, b_lo = Shard.local_shard_size_and_offset(length, self.interleaved_size, block)
            size, lo = Shard.local_shard_size_and_offset(b_size, num_chunks, rank)
            runs.append((b_lo + lo, size))
        return runs

    def _split_tensor(
        self,
        tensor: torch.Tensor,
        num_chunks: int,
        *,
        with_padding: bool = True,
        contiguous: bool = True,
    ) -> tuple[list[torch.Tensor], list[int]]:
        """PyTorch's private ``_StridedShard._split_tensor``: the ``num_chunks`` pieces of
        ``tensor`` along ``dim`` (each the concatenation of its piece of every block) and, with
        ``with_padding``, how much each is short of the largest (the pieces are not padded,
        as torch's are not); else an empty list."""
        dim = self.dim + tensor.ndim if self.dim < 0 else self.dim
        if not 0 <= dim < tensor.ndim or num_chunks < 1:
            raise InvalidPlacementError(
                f"{self!r} cannot split a tensor of shape {list(tensor.shape)} in "
                f"{num_chunks} pieces"
            )
        pieces = []
        for rank in range(num_chunks):
            parts = [tensor.narrow(dim, lo, size)
                     for lo, size in self._runs(tensor.shape[dim], num_chunks, rank)]
            piece = torch.cat(parts, dim)
            pieces.append(piece.contiguous() if contiguous else piece)
        longest = max(p.shape[dim] for p in pieces)
        return pieces, [longest - p.shape[dim] for p in pieces] if with_padding else []

    @property
    def split_factor(self) -> int:
        """PyTorch's name (``_StridedShard.split_factor``) for ``interleaved_size``."""
        return self.interleaved_size

    def __repr__(self) -> str:
        return f"InterleavedShard(dim={self.dim}, interleaved_size={self.interleaved_size})"


_StridedShard = InterleavedShard  # PyTorch's name for the same layout (FSDP2 x TP parameters)


@dataclass(frozen=True, repr=False)
class RaggedShard(Shard):
    """The tensor dim ``dim`` split in pieces of arbitrary ``sizes`` over the mesh dim (one
    entry per device along it, in coordinate order, zeros allowed, summing to the size of
    ``dim`` there), as veScale's RaggedShard: e.g. FSDP shards aligned to whole blocks. Its
    ``is_shard()`` is False: its pieces are not ``torch.chunk``'s, which a reader of PyTorch's
    ``Shard`` would assume."""

    sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        sizes = self.sizes
        if not isinstance(sizes, (list, tuple)) or not sizes or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in sizes
        ):
            raise InvalidPlacementError(
                f"RaggedShard(dim={self.dim}) needs sizes as a non-empty tuple of ints >= 0, "
                f"one per device along the mesh dim, got {sizes!r}"
            )
        object.__setattr__(self, "sizes", tuple(sizes))

    def local_shard_size_and_offset(  # type: ignore[override]
        self, curr_local_size: int, num_chunks: int, rank: int
    ) -> tuple[int, int]:
        """The size and offset of piece ``rank``: ``sizes[rank]`` after the pieces before it."""
        if len(self.sizes) != num_chunks or sum(self.sizes) != curr_local_size:
            raise InvalidPlacementError(
                f"{self!r} needs one size per device of the mesh dim ({num_chunks}) summing to "
                f"the size {curr_local_size} of dim {self.dim}"
            )
        return self.sizes[rank], sum(self.sizes[:rank])

    def __repr__(self) -> str:
        return f"RaggedShard(dim={self.dim}, sizes={self.sizes})"


@dataclass(frozen=True)
class Replicate(Placement):
    """Every device of the mesh dim holds the whole tensor."""

    def is_replicate(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Partial(Placement):
    """Devices of the mesh dim hold values whose reduction (sum, avg, max, min, or a p-norm
    ``"norm<p>"``, 0 < p <= inf: see ``norm_partial``) is the tensor."""

    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op not in REDUCE_OPS and norm_order(self.reduce_op) is None:
            raise InvalidPlacementError(
                f"Partial(reduce_op={self.reduce_op!r}) is not supported; use one of {REDUCE_OPS}"
                f" or a p-norm 'norm<p>' with 0 < p <= inf (e.g. 'norm2', 'norminf')"
            )

    def is_partial(self) -> bool:
        return True

    @property
    def zeros_elsewhere(self) -> bool:
        """Whether a whole value may sit on one device of the mesh dim with zeros on the others
        (a sum or a p-norm of (v, 0, ...) is v; avg, max and min need v everywhere)."""
        return self.reduce_op == "sum" or norm_order(self.reduce_op) is not None

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op!r})" if self.reduce_op != "sum" else "Partial()"


_Partial = Partial  # PyTorch's older name, still imported by its tests and some libraries


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
    if isinstance(placement, RaggedShard):
        return RaggedShard(dim + ndim, placement.sizes)
    return Shard(dim + ndim)


def with_dim(p: Shard, dim: int) -> Shard:
    """A shard of the same kind as ``p`` (plain, interleaved or ragged) on tensor dim ``dim``."""
    if isinstance(p, InterleavedShard):
        return InterleavedShard(dim, p.interleaved_size)
    if isinstance(p, RaggedShard):
        return RaggedShard(dim, p.sizes)
    return Shard(dim)


def is_any_shard(p: Placement, dim: int | None = None) -> bool:
    """Whether ``p`` shards a tensor dim (``dim`` if given) in any layout: plain, interleaved
    or ragged. ``p.is_shard()`` answers PyTorch's narrower question (plain ``Shard`` only)."""
    return isinstance(p, Shard) and (dim is None or dim == p.dim)


def is_special_shard(p: Placement) -> bool:
    """An InterleavedShard or RaggedShard: a shard whose layout is not ``Shard(dim)``'s, which
    op rules offer only as an input already has it (``with_dim`` moves it to another dim)."""
    return isinstance(p, Shard) and type(p) is not Shard
